"""A ``[rows, dim]`` float32 array kept in a file and read / written a row at a time.

The table of a `HostEmbedding` with ``storage="file"``: the file is created sparse (its
length set, nothing written), and a row gets its initial value the first time a step reads
it, so a table of any size is created at once and only the rows training touches are ever
written. Rows travel with ``os.pread`` / ``os.pwrite``: they sit in the kernel's page cache,
not in the process's address space, so neither the process's resident memory nor its
``RLIMIT_AS`` grows with the table (a memory map would count against ``RLIMIT_AS``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import numpy as np

_OPEN: set[str] = set()   # files some RowFile of this process has open (each is emptied on open)


def _release(fd: int, real: str) -> None:
    os.close(fd)
    _OPEN.discard(real)


class RowFile:
    """Rows in a file, indexed like a numpy array by integer arrays.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t.rows")
        >>> rows = RowFile(path, 1000, 2, lambda ids: np.ones((len(ids), 2), np.float32))
        >>> rows[np.array([7])] = np.array([[3.0, 4.0]])
        >>> rows[np.array([7, 8])].tolist()
        [[3.0, 4.0], [1.0, 1.0]]
    """

    def __init__(self, path: str, num_rows: int, dim: int,
                 initial: Callable[[np.ndarray], np.ndarray]):
        self.path, self.shape = path, (num_rows, dim)
        self._row_bytes = dim * 4
        self._initial = initial
        self._written = np.zeros(num_rows, bool)  # one byte a row: 10M rows = 10 MB
        real = os.path.realpath(path)
        if real in _OPEN:
            raise ValueError(f"row file {path!r} is already open as another table's rows in this process; "
                             "opening it empties it. Give each table (and its optimizer slot) its own path")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        _OPEN.add(real)
        # the descriptor closes with close() or when the table is collected
        self._close = weakref.finalize(self, _release, self._fd, real)
        os.ftruncate(self._fd, num_rows * self._row_bytes)

    def close(self) -> None:
        """Closes the file (the rows written stay in it); idempotent."""
        self._close()

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((ids.size, self.shape[1]), np.float32)
        fresh = ~self._written[ids]
        if fresh.any():
            out[fresh] = self._initial(ids[fresh])
        for k in np.flatnonzero(~fresh):
            data = os.pread(self._fd, self._row_bytes, int(ids[k]) * self._row_bytes)
            out[k] = np.frombuffer(data, np.float32)
        return out

    def __setitem__(self, ids, values) -> None:
        ids = np.asarray(ids).reshape(-1)
        values = np.ascontiguousarray(np.broadcast_to(values, (ids.size, self.shape[1])),
                                      np.float32)
        for k, row in enumerate(ids):
            os.pwrite(self._fd, values[k].tobytes(), int(row) * self._row_bytes)
        self._written[ids] = True

    def written(self) -> np.ndarray:
        """The ids of the rows written so far (the others still hold their initial values)."""
        return np.flatnonzero(self._written)

    def load(self, ids: np.ndarray, values: np.ndarray) -> None:
        """The rows ``ids`` set to ``values`` and every other row back to its initial value (a
        snapshot of `written` rows read back)."""
        self._written[:] = False
        self[ids] = values

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[np.arange(self.shape[0])]
        return whole if dtype is None else whole.astype(dtype)
