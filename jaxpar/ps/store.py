"""A server's durable state: an atomic shard checkpoint and a write-ahead log of pushes since.

``DIR/server-I-of-N/``
  ``state.npz``       every table's rows, optimizer slots, pending sync pushes, and a JSON
                      summary (job config, clocks, counters) as a byte array; written to a
                      temporary file, fsynced, then renamed, so a kill leaves the old or the new.
  ``wal.bin``         every push received since ``state.npz``, in the wire format, appended
                      and flushed before the push is acknowledged; replayed on restart.
  ``step-S.npz``      the snapshot ``client.save(S)`` asked for (same layout as ``state.npz``).

Loading uses ``np.load(allow_pickle=False)``: a checkpoint, like a message, is never unpickled.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Any, Iterator

import numpy as np

from jaxpar.ps.wire import WireError, decode

_META = "__meta__"


def server_dir(root: str | os.PathLike, index: int, count: int) -> pathlib.Path:
    path = pathlib.Path(root) / f"server-{index}-of-{count}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_state(path: pathlib.Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Writes ``arrays`` and ``meta`` to ``path`` atomically (temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    payload = {**arrays, _META: np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    with open(tmp, "wb") as f:
        np.savez(f, **payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(path: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(arrays.pop(_META).tobytes().decode())
    return arrays, meta


class WriteAheadLog:
    """Length-prefixed wire messages appended to one file.

    Flushed to the operating system before each acknowledgement: a killed server loses
    nothing it acknowledged (a machine crash could; fsync per push would cost a disk write
    per step).
    """

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.file = open(path, "ab")

    def append(self, frames: list[bytes]) -> None:
        record = struct.pack("<I", len(frames)) + b"".join(
            struct.pack("<Q", len(f)) + bytes(f) for f in frames)
        self.file.write(record)
        self.file.flush()

    def truncate(self) -> None:
        self.file.close()
        self.file = open(self.path, "wb")

    def close(self) -> None:
        self.file.close()

    def replay(self) -> Iterator[tuple[dict[str, Any], list[np.ndarray]]]:
        """The logged messages in order. A record cut short by a kill ends the replay, and the
        file is cut back to the last whole record first, so what is appended after this restart
        follows it (not the torn bytes, which would end the next replay before it)."""
        data = self.path.read_bytes() if self.path.exists() else b""
        records, end = _records(data)
        if end < len(data):
            self.file.flush()
            os.truncate(self.path, end)
        for k, frames in enumerate(records):
            try:
                message = decode(frames)
            except WireError as e:   # whole but damaged (a disk error, an edit): not a kill's cut
                raise WireError(
                    f"write-ahead log {str(self.path)!r}: record {k} of {len(records)} is damaged ({e}); the "
                    f"pushes from it on cannot be replayed. Keep a copy of the file; to serve from the last "
                    f"checkpoint ({self.path.name} moved aside, state.npz alone) those pushes are lost, or "
                    "restore a snapshot (client.restore(step))") from None
            yield message


def _records(data: bytes) -> tuple[list[list[bytes]], int]:
    """The whole records at the start of ``data`` and the offset where they end."""
    records, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        at, frames = pos + 4, []
        for _ in range(n):
            if at + 8 > len(data):
                return records, pos
            (size,) = struct.unpack_from("<Q", data, at)
            at += 8
            if at + size > len(data):
                return records, pos
            frames.append(data[at:at + size])
            at += size
        records.append(frames)
        pos = at
    return records, pos
