"""Embedding tables in host memory, trained with a sparse row optimizer (no servers).

For a table larger than a device but not a host: the table lives in host memory and each
step touches only the rows its batch uses. ``Trainer(..., rows=HostRows(table))`` trains it
with the dense model in the one training loop (`jaxpar.ps.rows`):

1. ``prepare(ids)`` (host): checks the ids, deduplicates them → ``unique`` row ids (padded to
   a fixed length, so every batch of one shape runs one compiled step) and ``inverse``
   (``unique[inverse] == ids``);
2. ``pull(prepared)`` (host, before the step) brings the unique rows to the device: with
   ``storage="pinned_host"`` the table is a ``jax.Array`` in the ``pinned_host`` memory kind
   and a compiled gather copies the rows; with ``storage="callback"`` it is a numpy array;
   ``storage="file"`` is a `RowFile`: rows read and written one by one in a file,
   initialized when first read, so neither resident memory nor address space grows with
   the table;
3. the step differentiates with respect to the pulled rows (``rows[inverse]`` is the
   embedding of each id), so the gradient of a row used twice is already summed;
4. ``apply(prepared, row_grads)`` (after the step) updates those rows, and their optimizer
   slots, in host memory.

``snapshot()`` / ``load_snapshot(tables)`` copy the table and its optimizer state out and back
in: a `jaxpar.Trainer` writes them into each of its checkpoint steps (``HostRows`` hands them
over), so a resumed run goes on with the tables of the step it resumes from.

The row optimizers follow optax's dense ones exactly: a row absent from a batch has a zero
gradient, which changes neither SGD nor Adagrad, so training the table sparsely equals
training it as an ordinary parameter with ``optax.sgd`` / ``optax.adagrad``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import SingleDeviceSharding

from jaxpar.deprecation import Removed, RemovedAttribute
from jaxpar.ps.row_file import RowFile

STORAGES = ("auto", "pinned_host", "callback", "file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowOptimizer:
    """A per-row optimizer applied on the host: ``"sgd"`` or ``"adagrad"`` (optax's formulas).

    Example:
        >>> opt = RowOptimizer(kind="sgd", learning_rate=0.5)
        >>> opt.update(np.ones((1, 2)), None, np.ones((1, 2)))[0].tolist()
        [[0.5, 0.5]]
    """

    kind: str = "sgd"
    """``"sgd"`` (``optax.sgd``) or ``"adagrad"`` (``optax.adagrad``)."""
    learning_rate: float = 0.01
    initial_accumulator_value: float = 0.1
    """Adagrad: the starting sum of squares of every entry."""
    eps: float = 1e-7
    """Adagrad: added under the square root."""

    def __post_init__(self):
        if self.kind not in ("sgd", "adagrad"):
            raise ValueError(f"RowOptimizer kind={self.kind!r} must be 'sgd' or 'adagrad'.")
        for name in ("learning_rate", "initial_accumulator_value", "eps"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_))
                    or not np.isfinite(value)):
                raise ValueError(f"RowOptimizer {name}={value!r} must be a finite number.")
        if not self.learning_rate > 0:
            raise ValueError(f"RowOptimizer learning_rate={self.learning_rate!r} must be > 0.")
        if not self.eps > 0 or self.initial_accumulator_value < 0:
            raise ValueError(f"RowOptimizer eps={self.eps!r} must be > 0 and "
                             f"initial_accumulator_value={self.initial_accumulator_value!r} >= 0.")

    def init_slot(self, shape: tuple[int, ...], dtype) -> np.ndarray | None:
        """The optimizer's per-entry state for a table of ``shape`` (None for SGD)."""
        if self.kind == "sgd":
            return None
        return np.full(shape, self.initial_accumulator_value, dtype)

    def update(self, rows, slot, grads):
        """New ``(rows, slot)`` from the gradient of those rows (numpy or jax arrays)."""
        if self.kind == "sgd":
            return rows - self.learning_rate * grads, None
        slot = slot + grads * grads
        # optax.scale_by_rss: rsqrt(sum + eps); where the sum is 0 so is the gradient.
        scale = (1.0 / np.sqrt(slot + np.float32(self.eps))).astype(rows.dtype)
        return rows - self.learning_rate * (grads * scale), slot


@dataclasses.dataclass(frozen=True)
class PreparedIds:
    """One batch's ids, deduplicated on the host: ``unique[inverse]`` equals the ids."""

    unique: np.ndarray
    """Row ids, ``int32[n]`` with ``n = ids.size``; entries past ``count`` are padding (row 0)."""
    inverse: np.ndarray
    """``int32``, the shape of the ids: where each id's row sits in ``unique``."""
    count: int
    """How many entries of ``unique`` are real rows."""


def check_ids(ids, num_rows: int, name: str) -> np.ndarray:
    """``ids`` as an int64 numpy array; TypeError / ValueError naming the table and its range.

    Example:
        >>> check_ids([[1, 2]], 10, "items").tolist()
        [[1, 2]]
    """
    array = np.asarray(ids)
    if not (np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_):
        raise TypeError(
            f"table {name!r}: ids must be integers, got dtype {array.dtype} (shape "
            f"{array.shape}); cast them with ids.astype(np.int32) — a float id is a bug upstream.")
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_rows:
            bad = low if low < 0 else high
            raise ValueError(
                f"table {name!r} has rows 0..{num_rows - 1}, but the ids (shape {array.shape}) "
                f"hold {bad}; map ids into range first (e.g. ids % {num_rows}, or a hash), or "
                "make the table larger.")
    return array.astype(np.int64)


def dedup(ids: np.ndarray) -> PreparedIds:
    """Unique rows (padded to ``ids.size``) and the inverse indices of checked ``ids``."""
    unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
    padded = np.zeros(ids.size, np.int32)
    padded[:unique.size] = unique
    return PreparedIds(padded, inverse.reshape(ids.shape).astype(np.int32), int(unique.size))


def _whole(table: str, name: str, value) -> int:
    try:
        number = operator.index(value)  # ints and numpy integers, not floats or bools
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < 1:
        raise ValueError(f"table {table!r}: {name}={value!r} must be a positive whole number.")
    return number


def _pick_storage(storage: str, device) -> str:
    kinds = {m.kind for m in device.addressable_memories()}
    if storage == "auto":
        return "pinned_host" if "pinned_host" in kinds else "callback"
    if storage == "pinned_host" and "pinned_host" not in kinds:
        raise ValueError(f"storage='pinned_host': device {device} has memory kinds "
                         f"{sorted(kinds)}, no 'pinned_host'; use storage='callback'.")
    return storage


class HostEmbedding:
    """A ``[num_rows, dim]`` table in host memory, trained row by row after each step.

    Example:
        >>> table = HostEmbedding("items", 100, 4, RowOptimizer(kind="sgd", learning_rate=0.1))
        >>> prepared = table.prepare(np.array([[3, 7], [3, 9]]))
        >>> prepared.count, table.pull(prepared).shape
        (3, (4, 4))
    """

    gather = RemovedAttribute(Removed("rows reach the step from the row source jaxpar.ps.HostRows(table), pulled "
                                      "before the compiled step (Trainer(rows=...))", "docs/recommendation.md"))

    def __init__(self, name: str, num_rows: int, dim: int, optimizer: RowOptimizer, *,
                 init: np.ndarray | None = None, init_scale: float = 0.01, seed: int = 0,
                 storage: str = "auto", path: str | None = None, device=None):
        num_rows, dim = _whole(name, "num_rows", num_rows), _whole(name, "dim", dim)
        if num_rows >= 2 ** 31:   # row ids reach the device as int32
            raise ValueError(f"table {name!r}: num_rows={num_rows:,} is over the 2**31 - 1 rows whose ids fit the "
                             "int32 row indices of the step; split the table into several (hash ids into each)")
        if storage not in STORAGES:
            raise ValueError(f"table {name!r}: storage={storage!r} must be one of {STORAGES}.")
        if (storage == "file") != (path is not None):
            raise ValueError(f"table {name!r}: storage='file' takes a file path (path=...), "
                             f"and only it does; got storage={storage!r}, path={path!r}.")
        self.name, self.num_rows, self.dim, self.optimizer = name, num_rows, dim, optimizer
        self._initial_draw = np.array([seed, init_scale], np.float64)   # what a file table's unwritten rows hold
        self.device = device or jax.devices()[0]
        self.storage = _pick_storage(storage, self.device)
        table = self._initial(init, init_scale, seed, path)
        self._slot = (self._file_slot(path) if path is not None
                      else optimizer.init_slot(table.shape, table.dtype))
        if self.storage == "pinned_host":
            self._host = SingleDeviceSharding(self.device, memory_kind="pinned_host")
            self._table = jax.device_put(table, self._host)
            if self._slot is not None:
                self._slot = jax.device_put(self._slot, self._host)
        else:
            self._table = table

    def _initial(self, init, scale, seed, path) -> np.ndarray:
        shape = (self.num_rows, self.dim)
        if init is not None and np.shape(init) != shape:
            raise ValueError(f"table {self.name!r}: init has shape {np.shape(init)}, the table "
                             f"is {shape} (num_rows, dim); pass an init of that shape.")
        if path is not None:
            if init is not None:
                raise ValueError(f"table {self.name!r}: storage='file' draws each row's initial "
                                 "value when it is first read; leave init out.")
            return RowFile(path, self.num_rows, self.dim, functools.partial(
                _row_normal, seed=seed, scale=scale, dim=self.dim))
        if init is not None:
            return np.array(init, np.float32)
        return np.random.default_rng(seed).normal(0, scale, shape).astype(np.float32)

    def _file_slot(self, path: str) -> RowFile | None:
        value = self.optimizer.init_slot((1, self.dim), np.float32)
        if value is None:
            return None
        return RowFile(path + ".slot", self.num_rows, self.dim,
                       lambda ids: np.broadcast_to(value, (ids.size, self.dim)))

    def close(self) -> None:
        """Closes a file table's row files (``storage="file"``; other storages hold no file)."""
        for part in (self._table, self._slot):
            if isinstance(part, RowFile):
                part.close()

    def prepare(self, ids) -> PreparedIds:
        """Checks ``ids`` (integers in ``0..num_rows-1``) and deduplicates them."""
        return dedup(check_ids(ids, self.num_rows, self.name))

    def pull(self, prepared: PreparedIds, sharding: jax.sharding.Sharding | None = None
             ) -> jax.Array:
        """The rows ``prepared.unique`` on the device, ``float32[ids.size, dim]`` (placed
        with ``sharding`` if given, e.g. replicated over a mesh)."""
        if self.storage == "pinned_host":
            rows = _pinned_gather(self._host)(self._table, jnp.asarray(prepared.unique))
        else:
            rows = np.asarray(self._table[prepared.unique])
        return jax.device_put(rows, sharding or self.device)

    def apply(self, prepared: PreparedIds, row_grads) -> None:
        """Updates the rows of ``prepared`` (and their optimizer slots) from their gradient."""
        n = prepared.count
        if self.storage == "pinned_host":
            # Gradients of a step over a mesh come replicated: the update takes one copy.
            grads = jax.device_put(row_grads, self.device)
            self._table, self._slot = _pinned_update(self._host, self.optimizer)(
                self._table, self._slot, jnp.asarray(prepared.unique), np.int32(n), grads)
            return
        rows = prepared.unique[:n]
        # Slice on the host: slicing the jax array would compile a program per distinct count.
        grads = np.asarray(row_grads, np.float32)[:n]
        slot = None if self._slot is None else self._slot[rows]
        new_rows, new_slot = self.optimizer.update(self._table[rows], slot, grads)
        self._table[rows] = new_rows
        if new_slot is not None:
            self._slot[rows] = new_slot

    def block_until_ready(self) -> HostEmbedding:
        """Waits for the last ``apply`` (a pinned_host update runs asynchronously)."""
        if self.storage == "pinned_host":
            jax.block_until_ready((self._table, self._slot))
        return self

    def numpy(self) -> np.ndarray:
        """A numpy copy of the whole table (small tables: tests, export)."""
        return np.array(self._table)

    def snapshot(self) -> dict[str, np.ndarray]:
        """The table and its optimizer state as numpy copies taken now (later updates leave them
        as they are): ``{"table": [num_rows, dim]}`` and, with Adagrad, ``"slot"`` (its sums).
        A file table (``storage="file"``) gives ``"initial"`` (``[seed, init_scale]``, which
        draw the rows never written) and the rows written so far, if any: ``"ids"`` (int64) and
        their ``"table"`` / ``"slot"`` rows; its size grows with the rows trained, not the table.

        Example:
            >>> table = HostEmbedding("t", 4, 2, RowOptimizer(kind="adagrad"), storage="callback")
            >>> {k: v.shape for k, v in table.snapshot().items()}
            {'table': (4, 2), 'slot': (4, 2)}
        """
        if isinstance(self._table, RowFile):
            out = {"initial": self._initial_draw.copy()}
            ids = self._table.written()
            if ids.size:        # (a checkpoint stores no empty array)
                out |= {"ids": ids.astype(np.int64), "table": self._table[ids]}
                if self._slot is not None:
                    out["slot"] = self._slot[ids]
            return out
        out = {"table": np.array(self._table, np.float32, copy=True)}   # waits for a pinned_host update
        if self._slot is not None:
            out["slot"] = np.array(self._slot, np.float32, copy=True)
        return out

    def load_snapshot(self, tables: Mapping[str, Any]) -> None:
        """Sets the table and its optimizer state to a `snapshot` (of a table made alike: the
        same ``num_rows``, ``dim`` and optimizer kind; a file table's, into a file table drawn
        with the same seed and ``init_scale``). Anything else is refused before a row changes."""
        tables = {k: np.asarray(v) for k, v in dict(tables).items()}
        self._check_snapshot(tables)
        if isinstance(self._table, RowFile):
            if "initial" not in tables:     # a whole table's
                tables["ids"] = np.arange(self.num_rows)
            ids = tables.get("ids", np.zeros(0, np.int64))
            empty = np.zeros((0, self.dim), np.float32)
            self._table.load(ids, tables.get("table", empty))
            if self._slot is not None:
                self._slot.load(ids, tables.get("slot", empty))
        elif self.storage == "pinned_host":
            self._table = jax.device_put(tables["table"].astype(np.float32), self._host)
            if self._slot is not None:
                self._slot = jax.device_put(tables["slot"].astype(np.float32), self._host)
        else:
            self._table[...] = tables["table"]
            if self._slot is not None:
                self._slot[...] = tables["slot"]

    def _check_snapshot(self, tables: dict[str, np.ndarray]) -> None:
        sparse = "initial" in tables        # the rows a file table wrote
        n = (len(tables["ids"]) if np.ndim(tables["ids"]) == 1 else -1) if "ids" in tables else 0
        n = n if sparse else self.num_rows
        want = {"initial": (2,)} if sparse else {}
        if n:
            want |= {"ids": (n,)} if sparse else {}
            want["table"] = (n, self.dim)
            if self._slot is not None:
                want["slot"] = (n, self.dim)
        got = {k: v.shape for k, v in tables.items()}
        this = (f"this table (num_rows={self.num_rows}, dim={self.dim}, optimizer kind={self.optimizer.kind!r}, "
                f"storage={self.storage!r})")
        fix = ("restore into a HostEmbedding made as the saved one was (the same num_rows, dim and optimizer kind; "
               "the rows a file table wrote: storage='file' with the same seed and init_scale)")
        if sparse and self.storage != "file":
            raise ValueError(f"table {self.name!r}: the checkpoint holds only the {n} rows a file table "
                             f"(storage='file') wrote; {this} needs the whole table; {fix}")
        if got != want:
            raise ValueError(f"table {self.name!r}: the checkpoint holds arrays {got}, {this} takes {want}; {fix}")
        if sparse:
            ids = tables.get("ids", np.zeros(0, np.int64))
            if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
                raise ValueError(f"table {self.name!r}: the checkpoint holds rows up to {int(ids.max())}, "
                                 f"{this} has rows 0..{self.num_rows - 1}; {fix}")
            if not np.array_equal(tables["initial"], self._initial_draw):
                seed, scale = tables["initial"].tolist()
                raise ValueError(f"table {self.name!r}: the checkpoint's file table drew its rows with seed="
                                 f"{int(seed)}, init_scale={scale}, {this} with seed={int(self._initial_draw[0])}, "
                                 f"init_scale={self._initial_draw[1]}: its unwritten rows would differ; {fix}")


class HostRows:
    """A `HostEmbedding` as the row source of a `jaxpar.Trainer` (``Trainer(..., rows=HostRows(table))``).

    ``batch[key]`` holds the ids (``ids(batch[key])`` maps them to table rows when given, e.g.
    ``DLRMConfig.table_ids``); the compiled step gets the batch with ``batch[key]`` replaced by
    the index of each id among the pulled rows, and the Trainer's ``loss_fn(model, batch, rows)``
    embeds them as ``rows[batch[key]]``. After the step the table's row optimizer applies the
    rows' gradients on the host.

    Example:
        >>> table = HostEmbedding("items", 10, 2, RowOptimizer(kind="sgd", learning_rate=1.0), storage="callback")
        >>> source = HostRows(table)
        >>> batch, rows, handle = source.pull({"ids": np.array([7, 3, 7])})
        >>> batch["ids"].tolist(), rows.shape
        ([1, 0, 1], (3, 2))
    """

    def __init__(self, table: HostEmbedding, *, key: str = "ids", ids: Callable | None = None):
        if not isinstance(table, HostEmbedding):
            raise TypeError(f"HostRows: table must be a jaxpar.ps.HostEmbedding, got {type(table).__name__}")
        if jax.process_count() > 1:
            raise ValueError(f"HostRows (table {table.name!r}): a job of {jax.process_count()} processes would train "
                             "one copy of the table per process; run one process (its devices form the mesh), or "
                             "keep the table on parameter servers (jaxpar.ps.ServerRows)")
        if ids is not None and not callable(ids):
            raise TypeError(f"HostRows: ids must map batch[{key!r}] to table rows (a callable), "
                            f"got {type(ids).__name__}")
        self.table, self.key, self.ids = table, key, ids

    def pull(self, batch: Mapping[str, Any]) -> tuple[dict, jax.Array, PreparedIds]:
        """``(batch with the ids as indices into the rows, the rows, the prepared ids)``."""
        if not isinstance(batch, Mapping) or self.key not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(f"HostRows (table {self.table.name!r}): the batch has no ids under key {self.key!r} "
                             f"(its keys: {keys}); pass a dict batch with the ids there, or HostRows(table, key=...)")
        ids = batch[self.key] if self.ids is None else self.ids(batch[self.key])
        prepared = self.table.prepare(ids)
        return {**batch, self.key: prepared.inverse}, self.table.pull(prepared), prepared

    def push(self, handle: PreparedIds, row_grads, step: int) -> None:
        """The row optimizer's update of the pulled rows (``step`` is not needed here); nothing
        for a non-finite step (``row_grads`` None)."""
        if row_grads is not None:
            self.table.apply(handle, row_grads)

    def snapshot(self) -> dict[str, np.ndarray]:
        """The table and its optimizer state, copied now (`HostEmbedding.snapshot`): the Trainer
        writes them into the checkpoint step it saves."""
        return self.table.snapshot()

    def load_snapshot(self, tables: Mapping[str, Any]) -> None:
        """The tables of the checkpoint step the Trainer restores or resumes from
        (`HostEmbedding.load_snapshot`)."""
        self.table.load_snapshot(tables)


def _row_normal(ids: np.ndarray, *, seed: int, scale: float, dim: int) -> np.ndarray:
    """Initial rows of a file table: normal values fixed by (seed, row, column), drawn on
    demand with a counter-based hash (splitmix64 → Box-Muller), all rows at once."""
    counters = (ids.astype(np.uint64)[:, None] * np.uint64(2 * dim)
                + np.arange(2 * dim, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        x = counters + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    u1, u2 = u[:, :dim], u[:, dim:]
    return (scale * np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)).astype(np.float32)


def _device_of(host: SingleDeviceSharding) -> SingleDeviceSharding:
    return SingleDeviceSharding(next(iter(host.device_set)))


@functools.lru_cache(maxsize=None)
def _pinned_gather(host: SingleDeviceSharding):
    device = _device_of(host)

    def gather(table, unique):
        # Indices and table must share a memory space; the rows alone travel to the device.
        rows = table[jax.device_put(unique, host)]
        return jax.device_put(rows, device)

    return jax.jit(gather, in_shardings=(host, device), out_shardings=device)


@functools.lru_cache(maxsize=None)
def _pinned_update(host: SingleDeviceSharding, optimizer: RowOptimizer):
    device = _device_of(host)
    slot = host if optimizer.kind == "adagrad" else None

    # Every operand of the update sits in host memory, so it runs as host code (XLA refuses
    # an operation whose operands live in different memory spaces).
    @compute_on("device_host")
    @jax.jit
    def on_host(table, slot, unique, target, grads):
        old_slot = None if slot is None else slot[unique]
        new_rows, new_slot = _jnp_update(optimizer, table[unique], old_slot, grads)
        table = table.at[target].set(new_rows, mode="drop")
        slot = None if slot is None else slot.at[target].set(new_slot, mode="drop")
        return table, slot

    def update(table, slot, unique, count, grads):
        # Padding entries point past the table and are dropped: the count varies from batch
        # to batch, the compiled update does not.
        target = jnp.where(jnp.arange(unique.shape[0]) < count, unique, table.shape[0])
        return on_host(table, slot, *jax.device_put((unique, target, grads), host))

    # The table is donated: updated in place, never copied whole.
    return jax.jit(update, in_shardings=(host, slot, device, device, device),
                   out_shardings=(host, slot), donate_argnums=(0, 1))


def _jnp_update(optimizer: RowOptimizer, rows, slot, grads):
    if optimizer.kind == "sgd":
        return rows - optimizer.learning_rate * grads, None
    slot = slot + grads * grads
    # optax.scale_by_rss zeroes the scale where the sum is 0; there the gradient is 0 too, and
    # eps > 0 keeps the product 0, so no select (whose constant would sit in device memory).
    scale = jax.lax.rsqrt(slot + optimizer.eps)
    return rows - optimizer.learning_rate * (grads * scale), slot
