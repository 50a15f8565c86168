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
or the identical full batch on every process (``global_batch=True``). A process's own rows
are checked against the batch shards its own devices hold (`process_shards`,
`check_process_rows`), never against the devices of the whole mesh: the global batch is
those rows times the process count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.data.sequence import context_axes, reorder_batch
from jaxpar.strategy import check_spec, logical_axes, mesh_sizes, spec_axes, to_partition_spec


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


def leaf_spec(config: ParallelConfig, mesh, shape, key: str | None = None, *,
              training: bool | None = None, name: str | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of one batch leaf of global ``shape`` (under top-level ``key``;
    ``name``: the leaf as a refusal names it, e.g. ``batch['inputs']``, by default its shape).

    ``training`` says what the batch is for, which decides the rows it must have
    (`check_rows`): ``True``, a training step's global batch (cut into ``step_parts``);
    ``False``, a batch split whole (an evaluation, a placement); ``None``, not known (the leaf
    may be a training batch, one of its parts or an evaluation batch): its rows must split over
    the batch axes, and a refusal names what a training and an evaluation batch need.

    >>> leaf_spec(ParallelConfig(mesh={"data": 8}, grad_accum=2), {"data": 8}, (12, 4), training=False)
    Traceback (most recent call last):
    ValueError: batch leaf of shape (12, 4): the batch dimension 12 is not divisible by 8, the size of the batch \
axes ('data',) of mesh {'data': 8}; use a batch that is a multiple of 8 (e.g. 8 or 16)
    """
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
    return _default_spec(config, mesh, shape, training, name or f"batch leaf of shape {tuple(shape)}")


def _default_spec(config: ParallelConfig, mesh, shape, training: bool | None, name: str) -> PartitionSpec:
    axes = batch_axes(config, mesh)
    spec = PartitionSpec(axes if len(axes) > 1 else axes[0] if axes else None)
    sizes = mesh_sizes(mesh)
    seq = context_axes(config, mesh)
    if seq and len(shape) >= 2:    # context parallel: [B, S, ...] leaves split over S too
        spec = PartitionSpec(spec[0], seq if len(seq) > 1 else seq[0])
    check_rows(name, shape[0], axes, sizes,
               {} if training is False else step_parts(config), known=training is not None)
    check_spec(spec, mesh, shape)
    return spec


def step_parts(config: ParallelConfig) -> dict[str, int]:
    """The parts a training step cuts its global batch into (`split_rows`), by the field that
    asks for them: ``grad_accum`` and ``interleave``, those above 1.

    >>> step_parts(ParallelConfig(grad_accum=4))
    {'grad_accum': 4}
    """
    return {name: v for name, v in (("grad_accum", config.grad_accum), ("interleave", config.interleave)) if v > 1}


def check_rows(what: str, rows: int, axes: tuple[str, ...], sizes: Mapping[str, int], parts: Mapping[str, int],
               *, known: bool = True) -> None:
    """The one rule for the rows of a batch leaf: a training step cuts its global batch into
    ``parts`` (`step_parts`; ``{}`` for a batch split whole: an evaluation, a placement) and
    splits each part over the batch ``axes``, so the rows must be a multiple of the devices of
    ``axes`` times the parts. ``known=False``: whether the parts apply is not known (the leaf
    may be a training batch, one part of one, or an evaluation batch): only the devices are
    required, and the refusal names both. A ``ValueError`` names ``what``, the sizes and the fix.

    >>> check_rows("batch['x']", 16, ("data",), {"data": 8}, {"grad_accum": 4})
    Traceback (most recent call last):
    ValueError: batch['x'] has 16 rows: grad_accum=4 cuts it into 4 parts of 4 rows, and each part is split \
over the batch axes ('data',) (8 devices), so the global batch must be a multiple of 32 = 8 x 4; use a global \
batch of 32, or a smaller grad_accum
    """
    devices = math.prod(sizes[a] for a in axes)
    k = math.prod(parts.values())
    need = devices * k if known else devices
    if rows % need == 0:
        return
    cut = " x ".join(f"{name}={v}" for name, v in parts.items())
    smaller = " or ".join(parts)
    if known and parts:
        raise ValueError(
            f"{what} has {rows} rows: {cut} cuts it into {k} parts of {rows / k:g} rows, and each part is split over "
            f"the batch axes {axes} ({devices} devices), so the global batch must be a multiple of {need} = "
            f"{devices} x {k}; use a global batch of {_near(rows, need)}, or a smaller {smaller}")
    head = (f"{what}: the batch dimension {rows} is not divisible by {devices}, the size of the batch axes {axes} "
            f"of mesh {dict(sizes)}; ")
    if not parts:
        raise ValueError(head + f"use a batch that is a multiple of {devices} (e.g. {_near(rows, devices)})")
    raise ValueError(head + f"use a training batch that is a multiple of {devices * k} = {devices} x {k} (a training "
                     f"step cuts it into {k} parts, {cut}, and splits each over those devices; or use a smaller "
                     f"{smaller}) and an evaluation batch that is a multiple of {devices}")


def _near(rows: int, need: int) -> str:
    """The batch sizes nearest ``rows`` that are multiples of ``need``."""
    return " or ".join(str(b) for b in (rows // need * need, (rows // need + 1) * need) if b)


@dataclasses.dataclass(frozen=True)
class ProcessShards:
    """Where one process's own rows go on a mesh (`process_shards` reads it from which process
    drives each of the mesh's devices).

    Attributes:
      process: the process.
      processes: the processes driving the mesh's devices.
      axes: the batch axes, the mesh axes the batch dimension is split over.
      shards: the batch shards of the mesh (the sizes of ``axes`` multiplied).
      local: the distinct batch shards this process's devices hold.
      sharing: how many processes hold each of those shards (None: not as many for each).
      devices: the ids of this process's devices on the mesh.
    """

    process: int
    processes: int
    axes: tuple[str, ...]
    shards: int
    local: int
    sharing: int | None
    devices: tuple[int, ...]

    def rows_multiple(self, parts: int = 1) -> int:
        """The multiple this process's rows must be when a step cuts its batch into ``parts``.

        Every process feeds as many rows; the global batch is theirs in process order, cut into
        ``parts`` pieces each split over the ``shards``. Where this process's devices hold
        ``local`` shards, each filled by ``sharing`` processes' rows, and the processes tile the
        batch axes evenly (``processes x local == shards x sharing``, whatever the order of
        their devices on the axes), its ``rows`` make ``rows x sharing / local`` rows a shard:
        ``rows x sharing`` must be a multiple of ``local x parts``. An uneven tiling is ruled on
        the global batch (rows x processes a multiple of shards x parts), alike on every process.

        >>> ProcessShards(0, 4, ("data",), 8, 2, 1, (0, 1)).rows_multiple(2)   # 2 local shards x 2 parts
        4
        >>> ProcessShards(0, 4, ("data",), 2, 1, 2, (0, 1)).rows_multiple(2)   # 2 processes fill a shard
        1
        """
        if self.sharing is not None and self.processes * self.local == self.shards * self.sharing:
            need = self.local * parts
            return need // math.gcd(need, self.sharing)
        need = self.shards * parts
        return need // math.gcd(need, self.processes)


def process_shards(processes, axis_names: Sequence[str], axes: Sequence[str], process: int,
                   device_ids=None) -> ProcessShards:
    """The batch shards process ``process`` holds, from ``processes``: for every device of the
    mesh (an array shaped like ``mesh.devices``, axes ``axis_names``), the index of the process
    that drives it. A device's batch shard is its position along the batch ``axes``. Pure: no
    device is read (`mesh_process_shards` reads a live mesh), so any layout can be tried.

    >>> grid = np.array([[0, 0, 1, 1], [2, 2, 3, 3]])     # {"model": 2, "data": 4}, jaxpar.make_mesh's order
    >>> s = process_shards(grid, ("model", "data"), ("data",), 2)
    >>> s.local, s.sharing, s.devices                     # data shards 0, 1, which process 0 holds too
    (2, 2, (4, 5))
    >>> s = process_shards(grid.reshape(4, 2).T, ("model", "data"), ("data",), 2)    # devices on "model"
    >>> s.local, s.sharing, s.devices
    (1, 1, (2, 6))
    """
    grid = np.asarray(processes)
    names = tuple(axis_names)
    if grid.ndim != len(names):
        raise ValueError(f"process_shards: processes has {grid.ndim} dimensions but axis_names={names} names "
                         f"{len(names)}; give one process index per device of the mesh")
    unknown = [a for a in axes if a not in names]
    if unknown:
        raise ValueError(f"process_shards: batch axes {unknown} are not axes of the mesh {names}")
    coords = np.indices(grid.shape)
    shard = np.zeros(grid.shape, dtype=np.int64)
    for a in axes:                 # the position along the batch axes, in their order, as one index
        i = names.index(a)
        shard = shard * grid.shape[i] + coords[i]
    mine = grid == process
    held = np.unique(shard[mine])
    holders = {len(np.unique(grid[shard == s])) for s in held}
    ids = np.arange(grid.size).reshape(grid.shape) if device_ids is None else np.asarray(device_ids)
    return ProcessShards(process=int(process), processes=len(np.unique(grid)), axes=tuple(axes),
                         shards=math.prod(grid.shape[names.index(a)] for a in axes), local=len(held),
                         sharing=holders.pop() if len(holders) == 1 else None,
                         devices=tuple(int(i) for i in ids[mine]))


@functools.lru_cache(maxsize=64)
def mesh_process_shards(mesh, axes: tuple[str, ...]) -> ProcessShards:
    """`process_shards` of this process on a live ``mesh`` (its devices' ``process_index``);
    found once per mesh and batch axes, not at every step."""
    devices = mesh.devices
    processes = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices)
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devices)
    return process_shards(processes, mesh.axis_names, axes, jax.process_index(), ids)


def check_process_rows(what: str, rows: int, shards: ProcessShards, parts: Mapping[str, int]) -> None:
    """The rule for a process's own rows, in a run of several processes each feeding its block
    of the global batch (``global batch = rows x processes``): a training step cuts the global
    batch into ``parts`` (`step_parts`; ``{}`` for a batch split whole) and splits each over the
    batch shards, so the rows must be a multiple of `ProcessShards.rows_multiple`: with the
    processes along the batch axes, the batch shards this process's own devices hold times the
    parts, whatever the size of the whole mesh. A ``ValueError`` names ``what``, this process's
    rows, its devices on the batch axes, the global rows and the fix.

    >>> mine = ProcessShards(0, 4, ("data",), 8, 2, 1, (0, 1))   # 4 processes x 2 devices, {"data": 8}
    >>> check_process_rows("batch['x']", 4, mine, {"grad_accum": 2})
    >>> check_process_rows("batch['x']", 3, mine, {})
    Traceback (most recent call last):
    ValueError: batch['x']: this process's 3 rows do not split: the global batch is 3 rows x 4 processes = 12 rows, and this process's 2 devices on the batch axes ('data',) (ids 0, 1) hold 2 of their 8 shards, so every process must feed a multiple of 2 rows; feed 2 or 4 rows per process (a global batch of 8 or 16)
    """
    if shards.local == 0:
        raise ValueError(f"{what}: this process (process {shards.process}) drives none of the mesh's devices, so its "
                         f"{rows} rows have nowhere to go; build the mesh over every process's devices "
                         "(jaxpar.make_mesh(config) does)")
    k = math.prod(parts.values())
    need = shards.rows_multiple(k)
    if rows % need == 0:
        return
    ids = ", ".join(map(str, shards.devices))
    held = (f"this process's {len(shards.devices)} devices on the batch axes {shards.axes} (ids {ids}) hold "
            f"{shards.local} of their {shards.shards} shards")
    if shards.sharing and shards.sharing > 1:
        held += f", each filled by the rows of {shards.sharing} processes"
    cut = " x ".join(f"{name}={v}" for name, v in parts.items())
    why = f"; {cut} cuts each step's batch into {k} parts, each split over those shards" if parts else ""
    per = [b for b in (rows // need * need, (rows // need + 1) * need) if b]
    fix = (f"feed {' or '.join(map(str, per))} rows per process (a global batch of "
           f"{' or '.join(str(b * shards.processes) for b in per)})")
    if parts:
        fix += f", or a smaller {' or '.join(parts)}"
    raise ValueError(f"{what}: this process's {rows} rows do not split: the global batch is {rows} rows x "
                     f"{shards.processes} processes = {rows * shards.processes} rows, and {held}{why}, so every "
                     f"process must feed a multiple of {need} rows; {fix}")


def process_view(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """Shapes (``jax.ShapeDtypeStruct``) of the global batch that ``batch``, this process's own
    rows in a run of several processes, makes: each leaf's rows times the process count, once
    they pass `check_process_rows` against the batch shards this process's devices hold
    (``training``: as `leaf_spec`; a training batch is cut into `step_parts`). A leaf that is a
    global ``jax.Array`` already keeps its shape."""
    procs = jax.process_count()
    parts = step_parts(config) if training else {}
    found: dict[tuple[str, ...], ProcessShards] = {}

    def one(path, x):
        shape = _shape(x)
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        if _is_global(x) or not shape:
            return jax.ShapeDtypeStruct(shape, dtype)
        axes = _row_axes(config, mesh, shape, _top_key(path))
        if axes not in found:
            found[axes] = mesh_process_shards(mesh, axes)
        check_process_rows(f"batch{jax.tree_util.keystr(path)}", shape[0], found[axes], parts)
        return jax.ShapeDtypeStruct((shape[0] * procs, *shape[1:]), dtype)

    return jax.tree_util.tree_map_with_path(one, batch)


def _row_axes(config: ParallelConfig, mesh, shape, key) -> tuple[str, ...]:
    """The mesh axes a batch leaf's rows are split over (its spec's first entry)."""
    strategy = config.dataset_strategy
    if isinstance(strategy, dict):
        if key not in strategy:
            leaf_spec(config, mesh, shape, key)      # refuses the missing key by name
        strategy = strategy[key]
    if strategy == "full_batch":
        return ()
    if strategy is None:
        return batch_axes(config, mesh)
    spec = to_partition_spec(strategy, mesh, None, rules=config.rules)    # the rows are checked by the caller
    return spec_axes(spec[0]) if len(spec) else ()


def _is_global(x) -> bool:
    """A ``jax.Array`` over several processes' devices: its shape is the global one already."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


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


def batch_specs(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """``PartitionSpec`` for every leaf of ``batch`` (by its global shape and top-level key);
    ``training``: what the batch is for (see `leaf_spec`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: leaf_spec(config, mesh, _shape(x), _top_key(path), training=training,
                                  name=f"batch{jax.tree_util.keystr(path)}"), batch)


def batch_shardings(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """``NamedSharding`` for every leaf of ``batch``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), batch_specs(config, mesh, batch, training=training),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def place_batch(config: ParallelConfig, mesh, batch, *, global_batch: bool = True) -> Any:
    """Put a batch on the mesh.

    ``global_batch=True``: every leaf holds the global batch (single process: always).
    ``global_batch=False`` in a multi-process run: each process holds its contiguous block of
    rows; the global array is assembled with ``make_array_from_process_local_data``, its rows
    this block's times the process count, and the block is checked against the batch shards
    this process's devices hold (`check_process_rows`); a leaf that is a global ``jax.Array``
    already is kept (moved to the batch's sharding if it has another).
    Placing splits the batch whole over the batch axes (a training step's ``grad_accum`` parts
    are checked by the step): its rows must be a multiple of their devices.
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

        return jax.tree.map(put, batch, batch_shardings(config, mesh, batch, training=False))

    from jaxpar.distributed import make_global_batch

    shapes = process_view(config, mesh, batch, training=False)     # this process's rows, checked

    def put_local(path, x, shape):
        spec = leaf_spec(config, mesh, shape.shape, _top_key(path), training=False,
                         name=f"batch{jax.tree_util.keystr(path)}")
        sharding = NamedSharding(mesh, spec)
        if _is_global(x):
            return x if x.sharding == sharding else jax.jit(lambda a: a, out_shardings=sharding)(x)
        # Handles meshes whose batch axes do not follow process boundaries (e.g. data=2 on 4 processes).
        return make_global_batch(np.asarray(x), sharding)

    return jax.tree_util.tree_map_with_path(put_local, batch, shapes)


# Token datasets (after the batch helpers above, which jaxpar.plan imports without them).
from jaxpar.data.loader import TokenLoader  # noqa: E402
from jaxpar.data.store import ShardDamage, TokenStore, prepare, verify_store  # noqa: E402
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_tokenizer  # noqa: E402

__all__ = ["ByteTokenizer", "HFTokenizer", "ProcessShards", "ShardDamage", "TokenLoader", "TokenStore", "batch_axes",
           "batch_shardings", "batch_specs", "check_process_rows", "check_rows", "leaf_spec", "load_tokenizer",
           "mesh_process_shards", "part_shapes", "place_batch", "prepare", "process_shards", "process_view",
           "split_rows", "step_parts", "train_tokenizer", "verify_store"]
