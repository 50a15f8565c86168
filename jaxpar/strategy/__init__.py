"""Strategy forms (integer tuples, ``Layout``, logical names, ``PartitionSpec``) → ``PartitionSpec``."""

from jaxpar.strategy.layout import Layout, LayoutSpec
from jaxpar.strategy.resolve import (
    check_spec,
    is_integer_strategy,
    logical_axes,
    manual_axes,
    match_varying,
    mesh_sizes,
    record_axes,
    recording_axes,
    recording_rules,
    shard_count,
    spec_axes,
    spec_entry,
    to_partition_spec,
    varying_axes,
)

__all__ = [
    "Layout",
    "LayoutSpec",
    "check_spec",
    "is_integer_strategy",
    "logical_axes",
    "manual_axes",
    "match_varying",
    "mesh_sizes",
    "record_axes",
    "recording_axes",
    "recording_rules",
    "shard_count",
    "spec_axes",
    "spec_entry",
    "to_partition_spec",
    "varying_axes",
]
