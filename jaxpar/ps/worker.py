"""Training glue: embedding rows kept on parameter servers, as a row source of `jaxpar.Trainer`.

One step of ``Trainer(..., rows=ServerRows(client, fields))`` (`jaxpar.ps.rows`):

1. **look up**: the ids of every categorical field are gathered per table (several fields
   may read one shared table), deduplicated, and each field keeps the index of its ids among
   the table's unique ids;
2. **pull** the unique rows (for step t+1 in a background thread while step t computes, with
   ``prefetching``); they are padded with zero rows to a bucket size so that a handful of
   shapes, not one per batch, get compiled;
3. **the Trainer's compiled step** gathers each field's rows (``ServerRows.embedded``),
   differentiates ``loss_fn(model, batch, rows)`` with respect to the dense parameters and the
   pulled rows, and updates the dense parameters (ZeRO, precision, accumulation as configured);
4. **push** the gradients of the unique rows (the padding is cut off), divided by the worker
   count so that the servers' sum is the gradient of the mean over the global batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.ps.client import Client

BUCKETS = (64, 256, 1024, 4096, 16384)


def bucket_size(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket holding ``n`` rows; past the largest, the next multiple of it.

    Example:
        >>> jaxpar.ps.bucket_size(300)
        1024
    """
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


@dataclasses.dataclass
class Lookup:
    """A batch's deduplicated ids: ``unique[table]`` and each field's ``index`` into them, so
    that ``unique[fields[f]][index[f]] == batch[f]``.

    Example:
        >>> jaxpar.ps.lookup({"a": np.array([7, 7])}, {"a": "t"}).unique["t"].tolist()
        [7]
    """

    unique: dict[str, np.ndarray]
    index: dict[str, np.ndarray]


def lookup(batch: Mapping[str, Any], fields: Mapping[str, str]) -> Lookup:
    """Deduplicates the ids of ``batch[field]`` for each ``field -> table`` of ``fields``.

    Example:
        >>> lk = jaxpar.ps.lookup({"a": np.array([5, 3]), "b": np.array([3, 9])}, {"a": "t", "b": "t"})
        >>> lk.unique["t"].tolist(), lk.index["b"].tolist()
        ([3, 5, 9], [0, 2])
    """
    missing = [f for f in fields if f not in batch] if isinstance(batch, Mapping) else list(fields)
    if missing:
        # (keys of several types do not compare: ordered by type name, then by repr)
        keys = (sorted(batch, key=lambda k: (type(k).__name__, repr(k))) if isinstance(batch, Mapping)
                else type(batch).__name__)
        raise ValueError(f"the batch has no ids for fields {missing} (tables "
                         f"{[fields[f] for f in missing]}); its keys: {keys}. Give every field of fields= in the "
                         "batch, or leave the field out of fields=")
    unique, index = {}, {}
    for table in dict.fromkeys(fields.values()):
        names = [f for f, t in fields.items() if t == table]
        parts = [np.asarray(batch[f]) for f in names]
        for f, p in zip(names, parts):
            if p.dtype.kind not in "iu":
                raise TypeError(f"field {f!r} (table {table!r}): ids of dtype {p.dtype}; ids must be integers")
        unique[table], inverse = np.unique(np.concatenate([p.reshape(-1) for p in parts]), return_inverse=True)
        offsets = np.cumsum([0] + [p.size for p in parts])
        for f, p, lo, hi in zip(names, parts, offsets[:-1], offsets[1:]):
            index[f] = inverse[lo:hi].reshape(p.shape).astype(np.int32)
    return Lookup(unique, index)


def check_process_blocks(grid, axis_names, batch_axis: str, processes: int) -> None:
    """`ServerRows` in a job of several processes puts process ``p``'s rows at block ``p`` of a
    global rows array split over ``batch_axis``: the devices process ``p`` drives (``grid``: the
    driving process of each of the mesh's devices, shaped like it) must sit at positions
    ``p * k ... (p + 1) * k - 1`` of that axis, ``k = axis size / processes``, and no other
    process's devices there. Anything else is refused here, naming the layout.

    >>> check_process_blocks(np.array([[0, 0, 1, 1]]), ("model", "data"), "data", 2)   # passes
    """
    names = tuple(axis_names)
    grid = np.asarray(grid)
    fix = (f"give batch_axis= the mesh axis the batch is split over, with the processes in order along it and "
           f"each process's devices together on it (e.g. jaxpar.make_mesh(ParallelConfig(mesh={{'data': -1}})), or "
           f"the data axis first in the mesh)")
    if batch_axis not in names:
        raise ValueError(f"ServerRows: batch_axis={batch_axis!r} is not an axis of the mesh {names}; {fix}")
    size = grid.shape[names.index(batch_axis)]
    where = f"mesh {dict(zip(names, grid.shape))}, batch_axis={batch_axis!r}"
    if size % processes:
        raise ValueError(f"ServerRows: {where} has {size} positions, not a multiple of the {processes} processes "
                         f"(each process's rows are a block of the axis); {fix}")
    k = size // processes
    along = np.moveaxis(grid, names.index(batch_axis), 0).reshape(size, -1)
    for position in range(size):
        held = sorted(set(along[position].tolist()))
        if held != [position // k]:
            raise ValueError(f"ServerRows: in {where}, position {position} of {batch_axis!r} is driven by "
                             f"process(es) {held}, but process {position // k}'s rows go there (block {position // k} "
                             f"of {k} positions); {fix}")


class ServerRows:
    """Tables on parameter servers as the row source of a `jaxpar.Trainer`.

    ``fields``: batch key of each categorical field -> the table it reads. Before each step the
    batch's ids are deduplicated per table (`lookup`) and their rows pulled, padded with zero
    rows to a bucket size (`bucket_size`) so that a handful of shapes get compiled; the step
    gets the batch with each field's ids replaced by their index into ``rows[table]`` (the
    Trainer's ``loss_fn(model, batch, rows)``; :meth:`embedded` looks them up). After it the
    gradients of the unique rows are pushed, divided by the worker count so that the servers'
    sum is the gradient of the mean over the global batch. Steps are numbered as the servers
    expect from this worker (``client.next_step()`` at construction: a restarted worker rejoins).
    With ``Services(checkpoint=CheckpointConfig(dir=...))`` the servers snapshot their tables at each checkpoint
    (`save`) and go back to the step the Trainer resumes from (`restore`).

    A job of several processes (one worker each) needs ``mesh`` (the Trainer's): each process
    pulls the rows of its part of the batch, padded to a size every process finds alike (its
    ids bound its unique count), and they form one global rows array split over ``batch_axis``
    (default: the mesh's first axis), process ``p``'s block at ``p * size`` where its indices
    point; each process pushes its block's gradients, undivided (the loss is already the
    global batch's mean).

    Example:
        >>> source = jaxpar.ps.ServerRows(client, {"user": "users", "item": "items"})  # doctest: +SKIP
        >>> trainer = jaxpar.Trainer(model, tx, lambda m, b, rows: loss_fn(m, source.embedded(b, rows), b),
        ...                          config, mesh, rows=source)  # doctest: +SKIP
    """

    def __init__(self, client: Client, fields: Mapping[str, str], *, buckets: tuple[int, ...] = BUCKETS,
                 mesh: jax.sharding.Mesh | None = None, batch_axis: str | None = None):
        unknown = sorted(set(fields.values()) - set(client.tables))
        if unknown:
            raise ValueError(f"ServerRows: fields read tables {unknown} the client does not know; "
                             f"its tables are {sorted(client.tables)}")
        self.processes = jax.process_count()
        if self.processes > 1 and mesh is None:
            raise ValueError(f"ServerRows: a job of {self.processes} processes needs mesh= (the Trainer's mesh): "
                             "each process's rows are its block of one global rows array over it")
        self.client, self.fields, self.buckets = client, dict(fields), buckets
        self.mesh, self.batch_axis = mesh, batch_axis or (mesh.axis_names[0] if mesh is not None else None)
        if self.processes > 1:
            grid = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
            check_process_blocks(grid, mesh.axis_names, self.batch_axis, self.processes)
        self.step = client.next_step()
        self.timings = {"pull_wait_s": 0.0, "prefetched": 0}
        self._prefetched = None         # (batch, future of its pull) from `prefetching`

    def pull(self, batch: Mapping[str, Any]) -> tuple[dict, dict[str, np.ndarray], tuple[Lookup, int]]:
        """``(batch with indices for ids, padded rows per table, (lookup, server step))``; a
        batch `prefetching` yielded takes the pull already under way."""
        start = time.perf_counter()
        if self._prefetched is not None and self._prefetched[0] is batch:
            out = self._prefetched[1].result()
            self.timings["prefetched"] += 1
        else:
            out = self._pull_at(batch, self.step)
        self._prefetched = None
        self.timings["pull_wait_s"] += time.perf_counter() - start
        return out

    def _pull_at(self, batch: Mapping[str, Any], step: int):
        lk = lookup(batch, self.fields)
        rows = self.client.pull_many(lk.unique, step)
        if self.processes == 1:
            padded = {t: _pad(r, bucket_size(len(r), self.buckets)) for t, r in rows.items()}
            step_batch = {k: v for k, v in batch.items() if k not in self.fields} | lk.index
            return step_batch, padded, (lk, step)
        sizes = {t: self._process_bucket(t, batch) for t in rows}
        at = {t: jax.process_index() * size for t, size in sizes.items()}   # this process's block
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.batch_axis))
        placed = {t: jax.make_array_from_process_local_data(sharding, _pad(r, sizes[t])) for t, r in rows.items()}
        index = {f: i + np.int32(at[self.fields[f]]) for f, i in lk.index.items()}
        return {k: v for k, v in batch.items() if k not in self.fields} | index, placed, (lk, step)

    def _process_bucket(self, table: str, batch: Mapping[str, Any]) -> int:
        """Rows of one process's block: every process pads to the same size without asking the
        others (the ids of its part of the batch bound its unique count; the parts are alike)."""
        size = bucket_size(sum(np.size(batch[f]) for f, t in self.fields.items() if t == table), self.buckets)
        per_process = self.mesh.shape[self.batch_axis] // self.processes
        if size % per_process:
            raise ValueError(f"ServerRows: bucket {size} of table {table!r} does not split over the "
                             f"{per_process} devices each process has on mesh axis {self.batch_axis!r}")
        return size

    def prefetching(self, batches: Iterable[Mapping[str, Any]], steps: int) -> Iterator[Mapping[str, Any]]:
        """The first ``steps`` of ``batches``, each batch's rows pulled in a background thread
        while the step before it runs (a sync server answers as soon as that step's push is
        applied): ``trainer.fit(source.prefetching(batches, steps), steps)``. Nothing is pulled
        past ``steps``; a step that fails leaves its prefetched pull behind without waiting."""
        it, first = iter(batches), self.step
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            batch = next(it, None) if steps > 0 else None
            future = pool.submit(self._pull_at, batch, first) if batch is not None else None
            for i in range(steps):
                if batch is None:
                    return
                nxt = next(it, None) if i + 1 < steps else None
                self._prefetched = (batch, future)
                # Sent now: its answer waits for the push of the step that takes `batch`.
                upcoming = pool.submit(self._pull_at, nxt, first + i + 1) if nxt is not None else None
                yield batch
                batch, future = nxt, upcoming
        finally:
            # A prefetched pull of a step that never ran waits for its reply until the client's
            # timeout: do not wait for it here.
            self._prefetched = None
            pool.shutdown(wait=False, cancel_futures=True)

    def push(self, handle: tuple[Lookup, int], row_grads: Mapping[str, Any], step: int) -> None:
        """Pushes the unique rows' gradients (padding cut off) at the server step of the pull."""
        lk, at = handle
        if row_grads is None:   # a non-finite step: an empty push, so that the servers count the step
            grads = {t: (u[:0], np.zeros((0, self.client.tables[t].dim), np.float32)) for t, u in lk.unique.items()}
        elif self.processes == 1:
            scale = np.float32(1.0 / self.client.workers)
            grads = {t: (u, np.asarray(row_grads[t])[:len(u)] * scale) for t, u in lk.unique.items()}
        else:   # this process's block of the global gradient; the loss is the global batch's mean
            grads = {t: (u, _local_rows(row_grads[t], row_grads[t].shape[0] // self.processes)[:len(u)])
                     for t, u in lk.unique.items()}
        # A table of the client that no field reads gets an empty push too: its clock must move
        # with the others, or the servers' snapshots (save), checkpoints and next_step wait on it.
        grads |= {t: (np.zeros(0, np.int64), np.zeros((0, spec.dim), np.float32))
                  for t, spec in self.client.tables.items() if t not in grads}
        self.client.push_many(grads, at)
        self.step = at + 1

    def save(self, step: int) -> None:
        """The Trainer saved its checkpoint of ``step``: the servers snapshot their tables there."""
        if step != self.step:
            raise ValueError(f"ServerRows: the Trainer saves step {step} but the servers are at step {self.step} "
                             f"for this worker; restore the Trainer's checkpoint of step {self.step} (or start the "
                             "servers afresh) so that both count the same steps")
        self.client.save(step)

    def restore(self, step: int) -> None:
        """The Trainer resumed or restored its checkpoint of ``step``: the servers go back to
        their snapshot of it."""
        self.client.restore(step)
        self.step = step

    def embedded(self, batch: Mapping[str, Any], rows: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Inside the step: ``{field: the rows of its ids}``, shape ``batch[field].shape + (dim,)``."""
        return {f: jnp.take(rows[t], batch[f], axis=0) for f, t in self.fields.items()}


def _local_rows(g: jax.Array, size: int) -> np.ndarray:
    """This process's block ``[p * size, (p + 1) * size)`` of a global row-gradient array, from
    whichever of its shards cover it (the compiler picks the output's sharding)."""
    lo = jax.process_index() * size
    out = np.zeros((size, g.shape[1]), np.float32)
    for shard in g.addressable_shards:
        start, stop, _ = shard.index[0].indices(g.shape[0])
        a, b = max(start, lo), min(stop, lo + size)
        if a < b:
            out[a - lo:b - lo] = np.asarray(shard.data)[a - start:b - start]
    return out


def _pad(rows: np.ndarray, size: int) -> np.ndarray:
    """``rows`` followed by zero rows up to ``size``."""
    out = np.zeros((size, rows.shape[1]), np.float32)
    out[:len(rows)] = rows
    return out
