"""Placing batches on the mesh: batch dimension over the data axes, optionally H/W too.

``dataset_strategy`` (in ``ParallelConfig``) decides the split of every batch leaf:

* ``None`` (default): dimension 0 over the *batch axes* — the mesh axes of the ``"batch"``
  rule if there is one, else the ``"data"`` axis, else (mode ``"data"``) every mesh axis;
* ``"full_batch"``: every device sees the whole batch (replicated);
* one strategy in any form, e.g. ``(2, 2, 2, 1)`` for NHWC images split over batch, H, W;
* a dict, top-level batch key → one of the above (MindSpore's one strategy per dataset
  column), e.g. ``{"image": (2, 2, 2, 1), "label": (2,)}``.

Batches come as host numpy arrays holding the global batch. In a run of several processes
each process passes its own contiguous block of rows by default (``global_batch=False``),
or the identical full batch on every process (``global_batch=True``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.data.sequence import context_axes, reorder_batch
from jaxpar.strategy import check_spec, logical_axes, mesh_sizes, to_partition_spec


def batch_axes(config: ParallelConfig, mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over by default (``mesh``: a ``Mesh``,
    ``AbstractMesh`` or ``{axis: size}``)."""
    sizes = mesh_sizes(mesh)
    if "batch" in config.rules:
        return logical_axes("batch", sizes, config.rules)
    if config.mode == "data":
        skip = (config.pipeline.axis, *context_axes(config, sizes))   # these split stages / the sequence
        return tuple(a for a in sizes if a not in skip)
    return ("data",) if "data" in sizes else ()


def leaf_spec(config: ParallelConfig, mesh, shape, key: str | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of one batch leaf of global ``shape`` (under top-level ``key``)."""
    strategy = config.dataset_strategy
    if isinstance(strategy, dict):
        if key not in strategy:
            raise ValueError(
                f"dataset_strategy is a dict with keys {sorted(strategy)} but the batch has a leaf "
                f"under {key!r}; give a strategy (or None) for every top-level batch key"
            )
        strategy = strategy[key]
    if strategy == "full_batch" or not shape:
        return PartitionSpec()
    if strategy is not None:
        return to_partition_spec(strategy, mesh, shape, rules=config.rules)
    return _default_spec(config, mesh, shape)


def _default_spec(config: ParallelConfig, mesh, shape) -> PartitionSpec:
    axes = batch_axes(config, mesh)
    spec = PartitionSpec(axes if len(axes) > 1 else axes[0] if axes else None)
    sizes = mesh_sizes(mesh)
    seq = context_axes(config, mesh)
    if seq and len(shape) >= 2:    # context parallel: [B, S, ...] leaves split over S too
        spec = PartitionSpec(spec[0], seq if len(seq) > 1 else seq[0])
    n = math.prod(sizes[a] for a in axes)
    if shape[0] % n:
        raise ValueError(
            f"batch leaf of shape {tuple(shape)}: the batch dimension {shape[0]} is not divisible by "
            f"{n}, the size of the batch axes {axes} of mesh {sizes}; " + _batch_fix(config, n))
    check_spec(spec, mesh, shape)
    return spec


def _batch_fix(config: ParallelConfig, n: int) -> str:
    """How to size the global batch: a training step cuts it into grad_accum × interleave parts
    (`split_rows`) and splits each part over the batch axes, so a leaf that fails may be one part."""
    parts = {k: v for k, v in (("grad_accum", config.grad_accum), ("interleave", config.interleave)) if v > 1}
    if not parts:
        return f"use a global batch that is a multiple of {n}"
    k = math.prod(parts.values())
    names = " × ".join(f"{name} {v}" for name, v in parts.items())
    return (f"a training step cuts the global batch into {k} parts ({names}) of global batch / {k} rows "
            f"and splits each part over the batch axes (this leaf is the global batch or one part), so the "
            f"global batch must be a multiple of {n * k} = {n} × {names}; use such a global batch, or a "
            f"smaller {' or '.join(parts)}")


def part_shapes(batch, k: int) -> Any:
    """Abstract shapes of one of ``k`` equal parts of ``batch`` (see `split_rows`).

    >>> part_shapes({"x": np.zeros((8, 3))}, 4)["x"].shape
    (2, 3)
    """
    def one(x):
        shape = _shape(x)
        if not shape or shape[0] % k:
            raise ValueError(
                f"batch leaf of shape {tuple(shape)}: its batch dimension is not divisible into {k} "
                f"equal parts (grad_accum × interleave, or pipeline micro-batches); use a global batch "
                f"that is a multiple of {k}")
        return jax.ShapeDtypeStruct((shape[0] // k, *shape[1:]), x.dtype)

    return jax.tree.map(one, batch)


def split_rows(x, k: int):
    """``[B, ...]`` → ``[k, B/k, ...]`` where part ``j`` holds rows ``j, j+k, j+2k, ...``.

    The one way jaxpar cuts a batch into parts (gradient accumulation, multi-copy, pipeline
    micro-batches): with the batch split over the data axes in contiguous blocks, every
    device holds ``1/k`` of its own rows in each part, so no row moves between devices.

    >>> split_rows(np.arange(6), 3).tolist()
    [[0, 3], [1, 4], [2, 5]]
    """
    if not np.shape(x) or x.shape[0] % k:
        raise ValueError(f"batch leaf of shape {tuple(np.shape(x))}: the batch dimension is not divisible "
                         f"into {k} equal parts; use a batch that is a multiple of {k}")
    return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def _top_key(path) -> str | None:
    return getattr(path[0], "key", getattr(path[0], "name", None)) if path else None


def batch_specs(config: ParallelConfig, mesh, batch) -> Any:
    """``PartitionSpec`` for every leaf of ``batch`` (by its global shape and top-level key)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: leaf_spec(config, mesh, _shape(x), _top_key(path)), batch)


def batch_shardings(config: ParallelConfig, mesh, batch) -> Any:
    """``NamedSharding`` for every leaf of ``batch``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), batch_specs(config, mesh, batch),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _global_shape(local_shape) -> tuple[int, ...]:
    procs = jax.process_count()
    return (local_shape[0] * procs, *local_shape[1:]) if local_shape else local_shape


def place_batch(config: ParallelConfig, mesh, batch, *, global_batch: bool = True) -> Any:
    """Put a batch on the mesh.

    ``global_batch=True``: every leaf holds the global batch (single process: always).
    ``global_batch=False`` in a multi-process run: each process holds its contiguous block of
    rows; the global array is assembled with ``make_array_from_process_local_data``.
    """
    batch = reorder_batch(config, mesh, batch)   # context parallel: causal load-balancing order
    if jax.process_count() == 1 or global_batch:
        def put(x, sharding):
            if isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding):
                return x   # already placed (a batch placed once and stepped on again costs nothing)
            if jax.process_count() == 1:
                return jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, batch, batch_shardings(config, mesh, batch))

    from jaxpar.distributed import make_global_batch

    def put_local(path, x):
        x = np.asarray(x)
        spec = leaf_spec(config, mesh, _global_shape(x.shape), _top_key(path))
        # Handles meshes whose batch axes do not follow process boundaries (e.g. data=2 on 4 processes).
        return make_global_batch(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(put_local, batch)


# Token datasets (after the batch helpers above, which jaxpar.plan imports without them).
from jaxpar.data.loader import TokenLoader  # noqa: E402
from jaxpar.data.store import ShardDamage, TokenStore, prepare, verify_store  # noqa: E402
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_tokenizer  # noqa: E402

__all__ = ["ByteTokenizer", "HFTokenizer", "ShardDamage", "TokenLoader", "TokenStore", "batch_axes",
           "batch_shardings", "batch_specs", "leaf_spec", "load_tokenizer", "part_shapes", "place_batch", "prepare",
           "split_rows", "train_tokenizer", "verify_store"]
