"""Training glue: a dense Flax NNX model that reads embedding rows kept on parameter servers.

:class:`ServerRows` is the servers' tables as a row source of the one training loop,
``jaxpar.Trainer(..., rows=ServerRows(client, fields))`` (one process; `jaxpar.ps.rows`), so
ZeRO, precision and accumulation compose with them. :class:`SparseTrainer` is the worker loop
of its own that a job of several processes, prefetching and worker-group restores still need.

One step of :class:`SparseTrainer` (and, but for the prefetch, of a Trainer with ``ServerRows``):

1. **look up**: the ids of every categorical field are gathered per table (several fields
   may read one shared table), deduplicated, and each field keeps the index of its ids among
   the table's unique ids;
2. **pull** the unique rows (for step t+1 in a background thread while step t computes,
   when ``prefetch``); they are padded with zero rows to a bucket size so that a handful of
   shapes, not one per batch, get compiled;
3. **dense step**: one jitted function gathers each field's rows, evaluates
   ``loss_fn(model, embedded, batch)``, differentiates with respect to the dense parameters
   and the pulled rows, and applies ``tx`` to the dense parameters;
4. **push** the gradients of the unique rows (the padding is cut off), divided by the worker
   count so that the servers' sum is the gradient of the mean over the global batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


def _replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Every array of ``tree`` replicated over ``mesh``, whose devices may span processes.

    Built from host values on each process: ``jax.device_put`` onto devices of other processes
    gives arrays that jit accepts but whose shards orbax cannot read before a first step.
    """
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(x):
        if jax.process_count() == 1 or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, replicated)  # (random keys have no plain host value)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

    return jax.tree.map(put, tree)


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
    With ``Trainer(checkpoint_dir=...)`` the servers snapshot their tables at each checkpoint
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
        if self.processes == 1:
            scale = np.float32(1.0 / self.client.workers)
            grads = {t: (u, np.asarray(row_grads[t])[:len(u)] * scale) for t, u in lk.unique.items()}
        else:   # this process's block of the global gradient; the loss is the global batch's mean
            grads = {t: (u, _local_rows(row_grads[t], row_grads[t].shape[0] // self.processes)[:len(u)])
                     for t, u in lk.unique.items()}
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


class SparseTrainer:
    """Trains ``model`` (dense, on this worker's devices) with embedding tables on servers.

    Args:
        client: from :func:`jaxpar.ps.connect`.
        model: a Flax NNX module holding the dense parameters.
        tx: the optax optimizer of the dense parameters.
        loss_fn: ``loss_fn(model, embedded, batch) -> scalar``; ``embedded[field]`` holds the
            rows of ``batch[field]``'s ids, shape ``batch[field].shape + (dim,)``.
        fields: batch key of each categorical field -> the table it reads.
        mesh, batch_axis: when given, batch arrays are split over ``batch_axis`` of ``mesh``
            (dense parameters and rows replicated): data parallel over the worker's devices.
        prefetch: pull step t+1's rows in a background thread while step t runs.

    Example:
        >>> trainer = jaxpar.ps.SparseTrainer(client, model, optax.sgd(0.1), loss_fn,
        ...                                   {"user": "users", "item": "items"})  # doctest: +SKIP
        >>> history = trainer.fit(batches)  # doctest: +SKIP
    """

    def __init__(self, client: Client, model: nnx.Module, tx: optax.GradientTransformation,
                 loss_fn: Callable, fields: Mapping[str, str], *, mesh: jax.sharding.Mesh | None = None,
                 batch_axis: str | None = None, prefetch: bool = True, buckets: tuple[int, ...] = BUCKETS):
        unknown = sorted(set(fields.values()) - set(client.tables))
        if unknown:
            raise ValueError(f"SparseTrainer: fields read tables {unknown} the client does not know; "
                             f"its tables are {sorted(client.tables)}")
        self.client, self.tx, self.fields = client, tx, dict(fields)
        self.mesh, self.batch_axis = mesh, batch_axis or (mesh.axis_names[0] if mesh else None)
        self.prefetch, self.buckets = prefetch, buckets
        self.processes = jax.process_count()
        if self.processes > 1 and mesh is None:
            raise ValueError(f"SparseTrainer: a job of {self.processes} processes needs mesh= (a mesh over "
                             "every process's devices): the dense step is data parallel across them")
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.opt_state = tx.init(self.params)
        if mesh is not None:  # dense state replicated over the mesh (every process's devices)
            # The optimizer state too: a counter left on one device would come back from a
            # checkpoint committed to that device, which the jitted step then refuses.
            self.params, self.rest, self.opt_state = _replicate((self.params, self.rest, self.opt_state), mesh)
        # A worker restarted into a running job rejoins at the step the servers expect from it.
        self.step_count = client.next_step()
        self.timings = {"pull_wait_s": 0.0, "step_s": 0.0}
        self._train = jax.jit(self._make_train(loss_fn))

    @property
    def model(self) -> nnx.Module:
        """The dense model with the current parameters."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def _make_train(self, loss_fn: Callable) -> Callable:
        fields, graphdef = self.fields, self.graphdef

        def train(params, rest, opt_state, rows, index, batch):
            def loss(params, rows):
                model = nnx.merge(graphdef, params, rest)
                embedded = {f: jnp.take(rows[t], index[f], axis=0) for f, t in fields.items()}
                return loss_fn(model, embedded, batch)

            value, (g_params, g_rows) = jax.value_and_grad(loss, argnums=(0, 1))(params, rows)
            updates, opt_state = self.tx.update(g_params, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, g_rows

        return train

    def _pull(self, batch: Mapping[str, Any], step: int) -> tuple[Lookup, dict[str, np.ndarray]]:
        lk = lookup(batch, self.fields)
        return lk, self.client.pull_many(lk.unique, step)

    def _place(self, x: np.ndarray) -> Any:
        """This process's part of a batch-split array: a global array over the mesh."""
        if self.mesh is None:
            return x
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.batch_axis))
        if self.processes > 1:
            return jax.make_array_from_process_local_data(sharding, x)
        split = self.mesh.shape[self.batch_axis]
        if x.shape[0] % split:
            raise ValueError(f"SparseTrainer: a batch leaf of shape {x.shape} does not split over mesh axis "
                             f"{self.batch_axis!r} of size {split}; make the batch's rows a multiple of {split}")
        return jax.device_put(x, sharding)

    def _bucket(self, table: str, unique: int, batch: Mapping[str, Any]) -> int:
        if self.processes == 1:
            return bucket_size(unique, self.buckets)
        # Every process must pad to the same size without asking the others: the ids of its
        # part of the batch bound its unique count, and the parts have equal shapes.
        bound = sum(np.size(batch[f]) for f, t in self.fields.items() if t == table)
        size = bucket_size(bound, self.buckets)
        per_process = self.mesh.shape[self.batch_axis] // self.processes
        if size % per_process:
            raise ValueError(f"SparseTrainer: bucket {size} of table {table!r} does not split over the "
                             f"{per_process} devices each process has on mesh axis {self.batch_axis!r}")
        return size

    def _local_rows(self, g: jax.Array, size: int) -> np.ndarray:
        """This process's block ``[p * size, (p + 1) * size)`` of a global row-gradient array,
        from whichever of its shards cover it (the compiler picks the output's sharding)."""
        return np.asarray(g) if self.processes == 1 else _local_rows(g, size)

    def _dense_step(self, batch: Mapping[str, Any], lk: Lookup, rows: dict[str, np.ndarray]) -> float:
        sizes = {t: len(u) for t, u in lk.unique.items()}
        padded = {t: _pad(r, self._bucket(t, sizes[t], batch)) for t, r in rows.items()}
        # Several processes: each one's rows are its block of one global rows array, and its
        # indices point into that block.
        offset = {t: jax.process_index() * len(p) for t, p in padded.items()}
        dense = {k: self._place(np.asarray(v)) for k, v in batch.items() if k not in self.fields}
        index = {f: self._place(i + np.int32(offset[self.fields[f]])) for f, i in lk.index.items()}
        rows_in = {t: self._place(p) if self.processes > 1 else p for t, p in padded.items()}
        self.params, self.opt_state, loss, g_rows = self._train(
            self.params, self.rest, self.opt_state, rows_in, index, dense)
        # One process: its loss is its part's mean, and the servers sum the workers' pushes.
        # Several in one jax job: the loss is already the global batch's mean.
        scale = np.float32(1.0 / self.client.workers if self.processes == 1 else 1.0)
        grads = {t: (lk.unique[t], self._local_rows(g_rows[t], len(padded[t]))[:sizes[t]] * scale)
                 for t in sizes}
        self.client.push_many(grads, self.step_count)
        return float(loss.addressable_data(0)) if self.processes > 1 else float(loss)

    def save(self) -> dict[str, Any]:
        """Makes the servers snapshot the tables at this step; returns the worker's state (dense
        parameters, optimizer state, step) for the worker's own orbax checkpoint of this step.

        Example:
            >>> orbax_checkpointer.save(path, trainer.save())  # doctest: +SKIP
        """
        self.client.save(self.step_count)
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step_count}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a state :meth:`save` returned (e.g. read from orbax) and brings the
        servers back to their snapshot of the same step.

        Example:
            >>> trainer.restore(orbax_checkpointer.restore(path))  # doctest: +SKIP
        """
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step_count = int(state["step"])
        self.client.restore(self.step_count)

    def step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One training step on ``batch`` (no prefetch); returns ``{"loss": ...}``."""
        start = time.perf_counter()
        lk, rows = self._pull(batch, self.step_count)
        self.timings["pull_wait_s"] += time.perf_counter() - start
        loss = self._dense_step(batch, lk, rows)
        self.step_count += 1
        self.timings["step_s"] += time.perf_counter() - start
        return {"loss": loss}

    def fit(self, batches: Iterable[Mapping[str, Any]], steps: int | None = None) -> list[dict[str, float]]:
        """Trains on ``batches`` (at most ``steps`` of them), prefetching when enabled."""
        batches = iter(batches)
        history: list[dict[str, float]] = []
        if not self.prefetch:
            for batch in batches:
                if steps is not None and len(history) >= steps:
                    break
                history.append(self.step(batch))
            return history
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            self._fit_prefetching(pool, batches, steps, history)
        except BaseException:
            # A prefetched pull of a step that will never be pushed waits for its reply until
            # the client's timeout: do not wait for it to raise this step's error.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return history

    def _fit_prefetching(self, pool, batches, steps, history) -> None:
        batch = next(batches, None)
        future = pool.submit(self._pull, batch, self.step_count) if batch is not None else None
        while future is not None and (steps is None or len(history) < steps):
            start = time.perf_counter()
            lk, rows = future.result()
            self.timings["pull_wait_s"] += time.perf_counter() - start
            nxt = next(batches, None) if steps is None or len(history) + 1 < steps else None
            # Sent now: a sync server answers it as soon as this step's push is applied.
            future = pool.submit(self._pull, nxt, self.step_count + 1) if nxt is not None else None
            history.append({"loss": self._dense_step(batch, lk, rows)})
            self.step_count += 1
            self.timings["step_s"] += time.perf_counter() - start
            batch = nxt
