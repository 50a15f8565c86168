"""Reading a token shard's file: ``os.preadv`` on an open descriptor, every byte count checked.

A shard file is never memory-mapped. When another process truncates a mapped file (``cp`` over
it, ``truncate``, a second ``prepare``), the next access of a page that is gone raises SIGBUS,
which kills the process without a Python error, whatever checks ran before the access. A read
from a descriptor returns fewer bytes instead: `ShardTokens` turns that into a `ShardDamage`
naming the shard, the byte offset and the bytes expected. Each read also compares the file
(size, modification time, inode) before and after with what the store opened, so a shard
rewritten in place or replaced under the reader is named rather than read half old, half new.

    >>> import tempfile, pathlib, numpy as np
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "tokens_00000.bin"
    >>> _ = f.write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    >>> tokens = ShardTokens("store", 0, str(f), np.uint16, 10)
    >>> tokens[2:5], [r.tolist() for r in tokens.read_rows([0, 7], [2, 3])]
    (array([2, 3, 4], dtype=uint16), [[0, 1], [7, 8, 9]])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import numpy as np


class ShardDamage(ValueError):
    """A shard file that does not match the store's index: ``shard`` (its number), ``file``, ``what``."""

    def __init__(self, store: str, shard: int, file: str, what: str):
        self.store, self.shard, self.file, self.what = store, shard, file, what
        super().__init__(f"token store {store!r} is damaged: shard {shard}: {file!r} {what}; restore the file from "
                         f"a copy, or delete {store!r} and run 'jaxpar data prepare' again ('jaxpar data verify "
                         f"{store}' checks every shard)")


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells a file apart from a changed one: size, modification time, inode."""
    return st.st_size, st.st_mtime_ns, st.st_ino


class ShardTokens:
    """The token ids of one shard, read from its file on demand (never mapped).

    ``len`` is the shard's token count; ``tokens[a:b]`` and ``tokens[i]`` read those tokens,
    ``np.asarray(tokens)`` all of them, `read_rows` many spans at once (one open file). A file
    that is gone, shorter, or not the one ``opened`` describes is a `ShardDamage`.
    """

    def __init__(self, store: str, shard: int, file: str, dtype, num_tokens: int,
                 opened: tuple[int, int, int] | None = None):
        self.store, self.shard, self.file = store, int(shard), file
        self.dtype, self.num_tokens = np.dtype(dtype), int(num_tokens)
        self.opened = opened if opened is not None else identity(os.stat(file))

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def shape(self) -> tuple[int]:
        return (self.num_tokens,)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.num_tokens)
            if step != 1:
                raise TypeError(f"shard {self.shard}: slice {key} has step {step}; read a contiguous span "
                                "(step 1) and index the result")
            return self.read(start, max(0, stop - start))
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            at = int(key) + self.num_tokens if key < 0 else int(key)
            if not 0 <= at < self.num_tokens:
                raise IndexError(f"token {key} of shard {self.shard}, which holds {self.num_tokens}")
            return self.read(at, 1)[0]
        raise TypeError(f"shard {self.shard}: index {key!r}; use an int or a slice (or np.asarray(tokens) first)")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.read(0, self.num_tokens)
        return out if dtype is None else out.astype(dtype)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)``."""
        return self.read_rows([start], [count])[0]

    def read_rows(self, starts: Sequence[int], lengths: Sequence[int] | int) -> list[np.ndarray]:
        """Tokens ``[starts[r], starts[r] + lengths[r])`` for each ``r`` (``lengths`` may be one int)."""
        lengths = np.broadcast_to(np.asarray(lengths, np.int64), np.shape(starts))
        for s, n in zip(starts, lengths):
            if s < 0 or n < 0 or s + n > self.num_tokens:
                raise IndexError(f"tokens [{s}, {s + n}) of shard {self.shard}, which holds {self.num_tokens}")
        with self._open() as fd:
            return [self._read(fd, int(s), int(n)) for s, n in zip(starts, lengths)]

    def chunks(self, tokens: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first token, tokens)`` of the whole shard in pieces of at most ``tokens``."""
        with self._open() as fd:
            for at in range(0, self.num_tokens, tokens):
                yield at, self._read(fd, at, min(tokens, self.num_tokens - at))

    @contextlib.contextmanager
    def _open(self) -> Iterator[int]:
        try:
            fd = os.open(self.file, os.O_RDONLY)
        except OSError as e:
            raise ShardDamage(self.store, self.shard, self.file,
                              f"is gone while it was being read ({e.strerror})") from None
        try:
            self._check_same(fd)
            yield fd
            self._check_same(fd)        # a rewrite during the reads: what was read may be half old, half new
        finally:
            os.close(fd)

    def _check_same(self, fd: int) -> None:
        now = identity(os.fstat(fd))
        if now != self.opened:
            raise ShardDamage(self.store, self.shard, self.file, f"changed while it was being read ({self.opened[0]} "
                              f"bytes when opened, {now[0]} now): a store must not be rewritten while a job reads it")

    def _read(self, fd: int, start: int, count: int) -> np.ndarray:
        out = np.empty(count, self.dtype)
        view, offset, want = memoryview(out).cast("B"), start * self.dtype.itemsize, count * self.dtype.itemsize
        got = 0
        while got < want:
            n = _pread_into(fd, view[got:], offset + got)
            if n == 0:
                size = os.fstat(fd).st_size
                raise ShardDamage(self.store, self.shard, self.file, f"ended early: reading {want} bytes at byte "
                                  f"offset {offset} (tokens {start} to {start + count}) gave {got}; the file is "
                                  f"{size} bytes now, {self.opened[0]} when opened: it was truncated while it was "
                                  "being read (a store must not be rewritten while a job reads it)")
            got += n
        return out


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)
