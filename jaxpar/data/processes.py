"""The rows one process feeds, in a run of several processes each passing its own block of the
global batch (``global batch = rows x processes``).

A process's rows are checked against the batch shards its *own* devices hold (`process_shards`,
`check_process_rows`), never against the devices of the whole mesh: a host with 8 devices
feeding 8 rows trains, whatever the cluster size. `jaxpar.data.BatchLayout.process_view` applies
the rule to a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np


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


def check_processes_agree(batch, where: str) -> None:
    """In a run of several processes each feeding its own rows, every process must feed the same
    number (the global batch is that times the process count, which each process works out
    alone): one all-gather of each leaf's row count, made where every process builds the
    program for a batch shape (its first step with that shape), so that a process feeding
    another count is refused on every process alike, naming each process's rows, instead of
    each process training on a global batch of its own. Leaves that are global ``jax.Array``s
    already are not counted."""
    from jaxpar.distributed import every_process

    leaves = [(jax.tree_util.keystr(path), np.shape(x)[0]) for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
              if np.ndim(x) and (not isinstance(x, jax.Array) or x.is_fully_addressable)]
    every = every_process([rows for _, rows in leaves] or [0])
    for i, (name, _) in enumerate(leaves):
        counts = every[:, i].tolist()
        if len(set(counts)) > 1:
            procs = len(counts)
            raise ValueError(f"{where}: batch{name}: the processes feed different numbers of their own rows ("
                             + ", ".join(f"process {p}: {n}" for p, n in enumerate(counts)) + "), but each "
                             f"process's rows are its block of one global batch of rows x {procs} processes; feed "
                             f"every process the same number of rows (jaxpar.distributed.process_rows(global_batch) "
                             f"is each process's slice), e.g. {max(counts)} rows each for a global batch of "
                             f"{max(counts) * procs}")


def check_processes_same(batch, where: str) -> None:
    """In a run of several processes each given the whole global batch
    (``Placement(global_batch=True)``), every process must pass the same values: a digest of the
    host leaves gathered from every process where the program for a batch shape is built (a
    process passing its own rows instead would make each global row a mix of processes' rows,
    without an error). Only host values are read (not ``jax.Array``s nor abstract shapes)."""
    import hashlib

    from jaxpar.distributed import every_process

    digest = hashlib.sha256()
    for x in jax.tree.leaves(batch):
        if isinstance(x, (np.ndarray, np.generic, int, float)):      # host values (not arrays, not shapes)
            a = np.ascontiguousarray(x)
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(a.tobytes())
    every = every_process(np.frombuffer(digest.digest()[:16], np.int32))
    differ = [p for p in range(len(every)) if (every[p] != every[0]).any()]
    if differ:
        raise ValueError(f"{where}: Placement(global_batch=True) takes the whole global batch on every process, but "
                         f"process(es) {differ} passed other values than process 0; pass every process the same "
                         "global batch, or feed each process its own rows with Placement(global_batch=False) (the "
                         "default on several processes)")
