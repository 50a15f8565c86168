"""Placing batches on the mesh: batch dimension over the data axes, optionally H/W too.

``dataset_strategy`` (in ``ParallelConfig``) decides the split of every batch leaf:

* ``None`` (default): dimension 0 over the *batch axes* — the mesh axes of the ``"batch"``
  rule if there is one, else the ``"data"`` axis, else (mode ``"data"``) every mesh axis;
* ``"full_batch"``: every device sees the whole batch (replicated);
* one strategy in any form, e.g. ``(2, 1, 2, 2)`` for NHWC images split over batch, H, W.

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
from jaxpar.strategy import check_spec, logical_axes, to_partition_spec


def batch_axes(config: ParallelConfig, mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over by default."""
    sizes = dict(mesh.shape)
    if "batch" in config.rules:
        return logical_axes("batch", sizes, config.rules)
    if config.mode == "data":
        return tuple(a for a in mesh.axis_names if a != config.pipeline.axis)
    return ("data",) if "data" in sizes else ()


def leaf_spec(config: ParallelConfig, mesh, shape) -> PartitionSpec:
    """The ``PartitionSpec`` of one batch leaf of global ``shape``."""
    strategy = config.dataset_strategy
    if strategy == "full_batch" or not shape:
        return PartitionSpec()
    if strategy is not None:
        return to_partition_spec(strategy, mesh, shape, rules=config.rules)
    axes = batch_axes(config, mesh)
    spec = PartitionSpec(axes if len(axes) > 1 else axes[0] if axes else None)
    n = math.prod(dict(mesh.shape)[a] for a in axes)
    if shape[0] % n:
        raise ValueError(
            f"batch leaf of shape {tuple(shape)}: the batch dimension {shape[0]} is not divisible by "
            f"{n}, the size of the batch axes {axes} of mesh {dict(mesh.shape)}; use a global batch "
            f"that is a multiple of {n}"
        )
    check_spec(spec, mesh, shape)
    return spec


def batch_shardings(config: ParallelConfig, mesh, batch) -> Any:
    """``NamedSharding`` for every leaf of ``batch`` (by its global shape)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(config, mesh, _shape(x))), batch)


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _global_shape(local_shape, sharding: NamedSharding) -> tuple[int, ...]:
    procs = jax.process_count()
    return (local_shape[0] * procs, *local_shape[1:]) if local_shape else local_shape


def place_batch(config: ParallelConfig, mesh, batch, *, global_batch: bool = True) -> Any:
    """Put a batch on the mesh.

    ``global_batch=True``: every leaf holds the global batch (single process: always).
    ``global_batch=False`` in a multi-process run: each process holds its contiguous block of
    rows; the global array is assembled with ``make_array_from_process_local_data``.
    """
    if jax.process_count() == 1 or global_batch:
        def put(x):
            if isinstance(x, jax.Array) and not isinstance(x, np.ndarray) and x.is_fully_addressable is False:
                return x
            sharding = NamedSharding(mesh, leaf_spec(config, mesh, np.shape(x)))
            if jax.process_count() == 1:
                return jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, batch)

    from jaxpar.distributed import make_global_batch

    def put_local(x):
        x = np.asarray(x)
        shape = _global_shape(x.shape, None)
        # Handles meshes whose batch axes do not follow process boundaries (e.g. data=2 on 4 processes).
        return make_global_batch(x, NamedSharding(mesh, leaf_spec(config, mesh, shape)))

    return jax.tree.map(put_local, batch)
