"""`TokenLoader`: global batch ``i`` is a pure function of (store, seed, i), read per process.

Examples are sequences of ``seq_len + 1`` tokens (inputs and next-token targets):

* ``packing="packed"``: consecutive windows of the token stream, documents packed together;
  ``segment_ids`` numbers the documents inside each row from 1, so attention stays inside a
  document and positions restart (`jaxpar.models.llama.loss_fn` reads them);
* ``packing="padded"``: one document per row, cut at ``seq_len + 1`` tokens, padded with
  segment id 0 (left out of the loss).

Each epoch visits every example once in the order of a permutation seeded by ``(seed, epoch)``;
global batch ``i`` is the rows ``[j * global_batch, (j + 1) * global_batch)`` of epoch
``i // batches_per_epoch`` (``j = i % batches_per_epoch``; the remainder of an epoch is
dropped). A process reads only its own contiguous block of rows (`jaxpar.distributed.process_rows`),
which the Trainer assembles into the global array with ``make_array_from_process_local_data``.
The position is one number, the next global batch, so ``state()`` saved on 1 process x 8
devices resumes on 2 x 4 (or any other split) with exactly the same global batches.

    >>> import tempfile, pathlib
    >>> from jaxpar.data.store import prepare
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "a.txt").write_text("".join(f"line {i}\\n" for i in range(100)))
    >>> store = prepare([str(tmp / "a.txt")], str(tmp / "s"), docs="line", progress=False)
    >>> loader = TokenLoader(store, seq_len=8, global_batch=4, seed=0)
    >>> batch = next(loader)
    >>> batch["inputs"].shape, loader.state()["next_batch"]
    ((4, 8), 1)
    >>> bool((loader.batch(0)["targets"] == batch["targets"]).all())
    True
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import queue
import threading
from typing import Any

import numpy as np

from jaxpar.data.store import ShardDamage, TokenStore
from jaxpar.deprecation import FormerForm, accepts_former_form, former_signature
from jaxpar.distributed import process_rows

KIND = "jaxpar.TokenLoader"
_FIXED = ("dataset", "seed", "seq_len", "global_batch", "packing", "shuffle")


@dataclasses.dataclass(frozen=True)
class LoaderProcess:
    """Whose rows of each global batch a `TokenLoader` reads: process ``index`` of ``count``
    (each None: this process of the job, ``jax.process_index()`` / ``jax.process_count()``).
    Process ``index`` reads the contiguous block ``[index * rows, (index + 1) * rows)``,
    ``rows = global_batch // count`` (`jaxpar.distributed.process_rows`).

    >>> LoaderProcess(index=1, count=2).rows(8)
    slice(4, 8, None)
    """

    index: int | None = None
    count: int | None = None

    def __post_init__(self):
        for name, value, low in (("index", self.index, 0), ("count", self.count, 1)):
            if value is None:
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
                raise TypeError(f"LoaderProcess: {name}={value!r} must be an int >= {low}, or None for this "
                                "process of the job")
            if value < low:
                raise ValueError(f"LoaderProcess: {name}={value!r} must be an int >= {low}, or None for this "
                                 "process of the job")
        if self.index is not None and self.count is not None and self.index >= self.count:
            raise ValueError(f"LoaderProcess: index={self.index} must be in 0..{self.count - 1} (count={self.count})")

    def rows(self, global_batch: int) -> slice:
        """This process's rows of a global batch of ``global_batch`` rows."""
        try:
            return process_rows(global_batch, None if self.index is None else int(self.index),
                                None if self.count is None else int(self.count))
        except ValueError as e:      # named as the loader's caller gave it
            raise ValueError(str(e).replace("global_batch_size=", "global_batch=", 1)) from None


def _former_call(arguments: dict) -> tuple[tuple, dict]:
    """``TokenLoader(..., process_index=i, process_count=n)`` → ``process=LoaderProcess(i, n)``."""
    self, store = arguments.pop("self"), arguments.pop("store")
    index, count = arguments.pop("process_index"), arguments.pop("process_count")
    return (self, store), {**arguments, "process": LoaderProcess(index=index, count=count)}


class _InitSignature(inspect.Signature):
    """An ``__init__``'s signature, shown as the class is called: without ``self``."""

    def __str__(self) -> str:
        return str(inspect.Signature(list(self.parameters.values())[1:]))


# 0.1.0's TokenLoader took the process as two keywords; they warn through the next release
_FORMER = FormerForm(
    owner="TokenLoader",
    signature=_InitSignature(former_signature("self store", {
        "*": None, "seq_len": dataclasses.MISSING, "global_batch": dataclasses.MISSING, "seed": 0,
        "packing": "packed", "shuffle": True, "tokenizer": None, "model_config": None, "prefetch": 2,
        "process_index": None, "process_count": None}).parameters.values()),
    is_former=lambda args, kwargs: "process_index" in kwargs or "process_count" in kwargs,
    convert=_former_call,
    instead="TokenLoader(store, ..., process=jaxpar.data.LoaderProcess(index=..., count=...))")


class TokenLoader:
    """Deterministic, resumable, reshardable batches of token sequences from a `TokenStore`.

    Args:
      store: a `TokenStore` or the path of one.
      seq_len: tokens per row (inputs and targets are each ``[rows, seq_len]``).
      global_batch: rows of the global batch; a multiple of the process count.
      seed: the shuffle's seed; ``shuffle=False`` keeps the store's order.
      packing: ``"packed"`` or ``"padded"`` (see the module docstring).
      tokenizer: if given, refused unless it is the store's tokenizer.
      model_config: if given (e.g. a ``LlamaConfig``), ``seq_len`` must be at most its
        ``max_seq_len`` and the store's vocabulary at most its ``vocab_size``.
      prefetch: batches prepared ahead in a background thread (0: none).
      process: whose rows to read, a `LoaderProcess` (default: this process of the job).
        ``process_index=i, process_count=n`` (0.1.0) still work through the next release,
        with a ``DeprecationWarning``: they are ``process=LoaderProcess(index=i, count=n)``.

    Iterating yields this process's rows of global batch 0, 1, ...; ``state()`` is the
    position as a JSON-able dict (what ``Trainer.fit`` stores in ``TrainState.data``) and
    ``restore(state)`` goes back to it.
    """

    @accepts_former_form(_FORMER)
    def __init__(self, store: TokenStore | str, *, seq_len: int, global_batch: int, seed: int = 0,
                 packing: str = "packed", shuffle: bool = True, tokenizer: Any = None, model_config: Any = None,
                 prefetch: int = 2, process: LoaderProcess | None = None):
        if not isinstance(store, (TokenStore, str, os.PathLike)):
            raise TypeError(f"TokenLoader: store={store!r} must be a TokenStore or the path of one (the directory "
                            "'jaxpar data prepare --out' wrote)")
        self.store = store if isinstance(store, TokenStore) else TokenStore(os.fspath(store))
        # Plain ints (a numpy integer would make state() fail to save as JSON)
        seq_len, global_batch = _check_int("seq_len", seq_len, 1), _check_int("global_batch", global_batch, 1)
        seed, prefetch = _check_int("seed", seed, 0), _check_int("prefetch", prefetch, 0)
        if packing not in ("packed", "padded"):
            raise ValueError(f"TokenLoader: packing={packing!r}; choose 'packed' (documents packed into rows, "
                             "segment_ids apart) or 'padded' (a document per row)")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"TokenLoader: shuffle={shuffle!r} must be True or False")
        if process is not None and not isinstance(process, LoaderProcess):
            raise TypeError(f"TokenLoader: process={process!r} must be a jaxpar.data.LoaderProcess(index=..., "
                            "count=...), or None for this process of the job")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.packing, self.shuffle, self.prefetch = packing, bool(shuffle), prefetch
        self.rows = (process or LoaderProcess()).rows(global_batch)
        if tokenizer is not None:
            self.store.check_tokenizer(tokenizer)
        if model_config is not None:
            self._check_model(model_config)
        self._examples = self._packed_examples() if packing == "packed" else self._padded_examples()
        self.num_examples = len(self._examples[0])
        self.batches_per_epoch = self.num_examples // global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"TokenLoader: the store {self.store.path!r} gives {self.num_examples} {packing} "
                             f"sequences of seq_len={seq_len}, fewer than global_batch={global_batch}; use a smaller "
                             "global batch or seq_len, or more data")
        self.position = 0
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._worker: _Prefetch | None = None

    # ------------------------------------------------------------------ checks
    def _check_model(self, cfg: Any) -> None:
        max_len, vocab = getattr(cfg, "max_seq_len", None), getattr(cfg, "vocab_size", None)
        if max_len is not None and self.seq_len > max_len:
            raise ValueError(f"TokenLoader: seq_len={self.seq_len} is longer than the model's max_seq_len={max_len}; "
                             f"use seq_len <= {max_len} or a model with a longer max_seq_len")
        if vocab is not None and self.store.vocab_size > vocab:
            raise ValueError(f"TokenLoader: the store {self.store.path!r} has a vocabulary of {self.store.vocab_size} "
                             f"tokens but the model's vocab_size is {vocab}; give the model vocab_size >= "
                             f"{self.store.vocab_size}")

    def _packed_examples(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard, first token) of every window; windows stay inside a shard."""
        sizes = [len(tokens) for tokens, _ in self.store.shards]
        if not sizes or max(sizes) < self.seq_len + 1:
            raise ValueError(f"TokenLoader: seq_len={self.seq_len} is longer than the data: a row needs "
                             f"{self.seq_len + 1} tokens and the largest shard of {self.store.index_path!r} holds "
                             f"{max(sizes, default=0)}; use a shorter seq_len or more data")
        counts = [(n - 1) // self.seq_len for n in sizes]
        shard = np.repeat(np.arange(len(sizes)), counts)
        start = np.concatenate([np.arange(c) * self.seq_len for c in counts])
        return shard, start

    def _padded_examples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, length) of every document of at least 2 tokens (one target or more)."""
        parts = []
        for s, (tokens, starts) in enumerate(self.store.shards):
            lengths = np.diff(starts, append=len(tokens))
            keep = lengths >= 2
            parts.append((np.full(keep.sum(), s), starts[keep], lengths[keep]))
        shard, start, length = (np.concatenate([p[k] for p in parts] or [np.zeros(0, np.int64)]) for k in range(3))
        if not len(shard):
            raise ValueError(f"TokenLoader: no document of {self.store.index_path!r} has 2 tokens or more; "
                             "padded rows need at least one target")
        return shard, start, length

    # ------------------------------------------------------------------ batches
    def order(self, epoch: int) -> np.ndarray:
        """The example order of ``epoch``: a permutation seeded by ``(seed, epoch)``."""
        cached = self._order_cache
        if cached is None or cached[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_examples) if self.shuffle
                     else np.arange(self.num_examples))
            cached = self._order_cache = (epoch, order)
        return cached[1]

    def batch(self, i: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Rows ``rows`` (default: this process's) of global batch ``i``: ``inputs``, ``targets``,
        ``segment_ids``, each int32 ``[rows, seq_len]``."""
        rows = self.rows if rows is None else rows
        i = _check_int("batch index i", i, 0)
        epoch, j = divmod(i, self.batches_per_epoch)
        ids = self.order(epoch)[j * self.global_batch:(j + 1) * self.global_batch][rows]
        windows, segments = self._read_packed(ids) if self.packing == "packed" else self._read_padded(ids)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "segment_ids": segments}

    def _read_packed(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard, start = (a[ids] for a in self._examples)
        span = np.arange(self.seq_len + 1)
        windows = np.empty((len(ids), self.seq_len + 1), np.int32)
        segments = np.empty((len(ids), self.seq_len), np.int32)
        for s in np.unique(shard):
            mine = shard == s
            tokens, doc_starts = self.store.shards[s]
            windows[mine] = np.stack(tokens.read_rows(start[mine], self.seq_len + 1))   # read, never mapped
            pos = start[mine][:, None] + span
            doc = np.searchsorted(doc_starts, pos[:, :-1], side="right")
            segments[mine] = doc - doc[:, :1] + 1
        self._check_ids(windows, shard, start)
        return windows, segments

    def _read_padded(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard, start, length = (a[ids] for a in self._examples)
        windows = np.full((len(ids), self.seq_len + 1), self.store.eos_id, np.int32)
        n = np.minimum(length, self.seq_len + 1)
        for s in np.unique(shard):      # one open file per shard; a shorter file is a ShardDamage, never a SIGBUS
            mine = np.flatnonzero(shard == s)
            for r, row in zip(mine, self.store.shards[s][0].read_rows(start[mine], n[mine])):
                windows[r, :n[r]] = row
        self._check_ids(windows, shard, start)
        segments = (np.arange(self.seq_len)[None, :] < (n - 1)[:, None]).astype(np.int32)
        return windows, segments

    def _check_ids(self, windows: np.ndarray, shard: np.ndarray, start: np.ndarray) -> None:
        """Every id read must be in the store's vocabulary: an edited shard would otherwise reach
        the model and fail a step far from here. One pass over the batch; row ``r``, column ``c``
        came from token ``start[r] + c`` of shard ``shard[r]`` (or is padding, the eos id)."""
        vocab = self.store.vocab_size
        if int(windows.view(np.uint32).max()) < vocab:     # a uint32 id >= 2**31 read as int32 is < 0
            return
        r, c = np.argwhere(windows.view(np.uint32) >= vocab)[0]
        at = int(start[r] + c)
        raise ShardDamage(self.store.path, int(shard[r]), self.store.shard_file(shard[r]), f"holds token id "
                          f"{int(windows.view(np.uint32)[r, c])} at token {at}, outside the store's vocabulary "
                          f"of {vocab}: it was edited or overwritten")

    # ------------------------------------------------------------------ iterating and position
    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.prefetch == 0:
            batch = self.batch(self.position)
        else:
            if self._worker is None:
                self._worker = _Prefetch(self, self.position)
            batch = self._worker.get(self.position)
        self.position += 1
        return batch

    def state(self) -> dict[str, Any]:
        """The position (the next global batch) and what it depends on, as a JSON-able dict."""
        return {"loader": KIND, "dataset": self.store.fingerprint, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "packing": self.packing, "shuffle": self.shuffle,
                "next_batch": self.position}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from `state`, any process count); ``ValueError`` if it belongs to
        other data or other settings, since its batches would not be the same."""
        if not isinstance(state, dict) or state.get("loader") != KIND:
            raise ValueError(f"TokenLoader.restore: {state!r} is not a TokenLoader position (no 'loader': {KIND!r}); "
                             "pass the dict that TokenLoader.state() returned")
        mine = self.state()
        for key in _FIXED:
            if state.get(key) != mine[key]:
                raise ValueError(f"TokenLoader.restore: the saved position has {key}={state.get(key)!r} but this "
                                 f"loader has {key}={mine[key]!r}; resume with the same store and settings (the "
                                 "global batches would differ otherwise)")
        position = _check_int("next_batch", state.get("next_batch"), 0)
        self.close()
        self.position = position

    def close(self) -> None:
        """Stop the prefetch thread (a later ``next`` starts a new one)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def __repr__(self) -> str:
        return (f"TokenLoader({self.store.path!r}, seq_len={self.seq_len}, global_batch={self.global_batch}, "
                f"{self.packing}, {self.num_examples} sequences, next batch {self.position})")


class _Prefetch:
    """A daemon thread computing batches ``start, start + 1, ...`` into a bounded queue."""

    def __init__(self, loader: TokenLoader, start: int):
        self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loader, start), daemon=True,
                                        name="jaxpar-token-loader")
        self._thread.start()

    def _run(self, loader: TokenLoader, i: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = (i, loader.batch(i))
            except Exception as e:       # handed to the consumer, which raises it
                item = (i, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            i += 1

    def get(self, i: int) -> dict[str, np.ndarray]:
        got, batch = self._queue.get()
        if isinstance(batch, Exception):
            raise batch
        if got != i:       # cannot happen: one consumer, positions in order
            raise RuntimeError(f"TokenLoader prefetch returned batch {got}, expected {i}")
        return batch

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _check_int(name: str, value: Any, low: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < low:
        raise ValueError(f"TokenLoader: {name}={value!r} must be an int >= {low}")
    return int(value)
