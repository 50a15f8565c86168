"""A server's durable state: an atomic shard checkpoint and a write-ahead log of pushes since.

``DIR/server-I-of-N/``
  ``state.npz``       every table's rows, optimizer slots, pending sync pushes, and a JSON
                      summary (job config, clocks, counters, the step snapshots) as a byte
                      array; written to a temporary file, fsynced, then renamed, so a kill
                      leaves the old or the new.
  ``wal.bin``         every push received since ``state.npz``: a file header, then one record
                      per push (its number, its length and CRC-32 checksums of both, then the
                      push in the wire format), written and fsynced before the push is
                      acknowledged; replayed on restart.
  ``step-S.npz``      the snapshot ``client.save(S)`` asked for (same layout as ``state.npz``),
                      committed together with a ``state.npz`` that lists it (`commit_snapshot`).

Loading uses ``np.load(allow_pickle=False)``: a checkpoint, like a message, is never unpickled.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import struct
import zipfile
import zlib
from typing import Any, Iterator

import numpy as np

from jaxpar.ps.wire import WireError, decode

_META = "__meta__"
# The first bytes of a write-ahead log of this format (an earlier jaxpar wrote records without
# a file header or checksums).
WAL_MAGIC = b"jaxpar-ps-wal 2\n"
# A record's header: its number in the file, the body's length, the body's CRC-32, and the
# CRC-32 of these first 20 bytes (a damaged length is told from a record cut short by a kill).
_HEAD = struct.Struct("<QQII")
_MOVE_ASIDE = ("Keep a copy of the file. To serve from the last checkpoint (state.npz) alone, move "
               "wal.bin aside and start the server again (the pushes logged in it are lost), or "
               "restore a snapshot with client.restore(step)")


class StoreError(ValueError):
    """A checkpoint or log file that cannot be read as written."""


def server_dir(root: str | os.PathLike, index: int, count: int) -> pathlib.Path:
    root = pathlib.Path(root)
    if root.exists() and not root.is_dir():
        raise StoreError(f"--checkpoint-dir {str(root)!r} is a file, not a directory; give a directory "
                         "(it is created if missing)")
    path = root / f"server-{index}-of-{count}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"--checkpoint-dir {str(root)!r}: cannot create {str(path)!r} ({e.strerror}); "
                         "give a directory this user can write") from None
    return path


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: pathlib.Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> pathlib.Path:
    tmp = path.with_name(path.name + ".tmp")
    payload = {**arrays, _META: np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    with open(tmp, "wb") as f:
        np.savez(f, **payload)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_state(path: pathlib.Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Writes ``arrays`` and ``meta`` to ``path`` atomically (temporary file, fsync, rename)."""
    os.replace(_write_tmp(path, arrays, meta), path)
    _fsync_dir(path.parent)


def commit_snapshot(directory: pathlib.Path, step: int, arrays: dict[str, np.ndarray],
                    meta: dict[str, Any]) -> None:
    """Writes ``state.npz`` and the snapshot ``step-S.npz`` (the same content) as one unit: a
    restart finds either the old pair or the new one.

    Order: the snapshot under a fresh temporary name (a hard link to the state's temporary file:
    written once), fsynced; then ``state.npz`` renamed into place, naming that temporary file
    (``meta["renaming"]``): the commit; then the snapshot renamed. A restart that finds the state
    naming a temporary file that still exists finishes the rename (`finish_commit`); a temporary
    file no state names was never committed and is removed."""
    state = directory / "state.npz"
    pending = f"step-{step}.npz.{secrets.token_hex(4)}.tmp"
    tmp = _write_tmp(state, arrays, {**meta, "renaming": {"step": step, "file": pending}})
    try:
        os.link(tmp, directory / pending)
    except OSError:   # a file system without hard links: write it twice
        _write_tmp(directory / pending.removesuffix(".tmp"), arrays, meta)
    _fsync_dir(directory)
    os.replace(tmp, state)
    _fsync_dir(directory)
    os.replace(directory / pending, directory / f"step-{step}.npz")
    _fsync_dir(directory)


def finish_commit(directory: pathlib.Path, meta: dict[str, Any]) -> None:
    """Completes the snapshot rename a kill interrupted after ``state.npz`` was committed, and
    removes the temporary files of writes that were never committed."""
    renaming = meta.get("renaming")
    if renaming and (directory / renaming["file"]).exists():
        os.replace(directory / renaming["file"], directory / f"step-{renaming['step']}.npz")
    for stale in [*directory.glob("step-*.tmp"), *directory.glob("*.npz.tmp")]:
        stale.unlink()
    _fsync_dir(directory)


def read_state(path: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and the summary of a checkpoint; one that cannot be read raises ``StoreError``
    naming the file."""
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("not an .npz archive")
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        if _META not in arrays:
            raise ValueError(f"no {_META} entry")
        meta = json.loads(arrays.pop(_META).tobytes().decode())
        if not isinstance(meta, dict):
            raise ValueError("its summary is not a JSON object")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        if "pickle" in why:   # (numpy's advice to load it unsafely does not apply: no checkpoint holds one)
            why = "it holds pickled (object) arrays, which a checkpoint never does and this server never loads"
        raise StoreError(
            f"shard checkpoint {str(path)!r} cannot be read ({why[:200]}): it is damaged or not a jaxpar "
            "parameter-server checkpoint. Put back an intact copy, or move the directory "
            f"{str(path.parent)!r} aside to start this server with fresh tables") from None
    return arrays, meta


class WriteAheadLog:
    """Checksummed records of wire messages appended to one file.

    Opening verifies every record (a damaged one raises `StoreError` naming the file, the byte
    offset and the record number) and cuts off an incomplete last record (a push a kill cut
    short while it was written: never acknowledged); `dropped` tells its offset and length.
    `append` writes and fsyncs a record before it returns, so a push is acknowledged only once
    its record is on disk.
    """

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.dropped: tuple[int, int] | None = None
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)   # an empty log a kill left unrenamed
        data = path.read_bytes() if path.exists() else b""
        if not data:
            self._start_empty()
            self.records: list[tuple[int, list[bytes]]] = []
        else:
            self.records, end = _records(path, data)
            if end < len(data):
                self.dropped = (end, len(data) - end)
                os.truncate(path, end)
        self.count = len(self.records)
        self.file = open(path, "ab")
        os.fsync(self.file.fileno())

    def _start_empty(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(WAL_MAGIC)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)

    def append(self, frames: list[bytes]) -> None:
        body = struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f)) + bytes(f) for f in frames)
        head = struct.pack("<QQI", self.count, len(body), zlib.crc32(body))
        end = self.file.tell()
        try:
            self.file.write(head + struct.pack("<I", zlib.crc32(head)) + body)
            self.file.flush()
        except BaseException:   # (a full disk): no partial record may stay before the next one
            self.file.close()
            os.truncate(self.path, end)
            self.file = open(self.path, "ab")
            raise
        self.count += 1        # (the record is in the file: the next one follows it)
        os.fdatasync(self.file.fileno())

    def truncate(self) -> None:
        """Starts an empty log (after a checkpoint that holds every logged push)."""
        self.file.close()
        self._start_empty()
        self.records, self.count = [], 0
        self.file = open(self.path, "ab")

    def close(self) -> None:
        self.file.close()

    def replay(self) -> Iterator[tuple[dict[str, Any], list[np.ndarray]]]:
        """The logged messages in order (each verified when the log was opened)."""
        for k, (offset, frames) in enumerate(self.records):
            try:
                message = decode(frames)
            except WireError as e:
                raise _damaged(self.path, k, offset, f"its push does not decode: {e}") from None
            yield message
        self.records = []


def _damaged(path: pathlib.Path, k: int, offset: int, what: str) -> StoreError:
    return StoreError(f"write-ahead log {str(path)!r}: record {k} at byte {offset} is damaged ({what}); "
                      f"the acknowledged pushes from it on cannot be replayed, and the server does not start "
                      f"without them. {_MOVE_ASIDE}")


def _records(path: pathlib.Path, data: bytes) -> tuple[list[tuple[int, list[bytes]]], int]:
    """The verified records of a log's bytes (offset, frames) and the offset where they end: the
    length of ``data``, or less when the last record is incomplete."""
    if not data.startswith(WAL_MAGIC):
        raise StoreError(_not_a_log(path, data))
    records, pos = [], len(WAL_MAGIC)
    while pos < len(data):
        k = len(records)
        if pos + _HEAD.size > len(data):
            return records, pos                       # a header cut short: the last bytes
        number, size, body_crc, head_crc = _HEAD.unpack_from(data, pos)
        if zlib.crc32(data[pos:pos + 20]) != head_crc:
            raise _damaged(path, k, pos, "its header's checksum does not match")
        if number != k:
            raise _damaged(path, k, pos, f"it is numbered {number}: a record is missing or repeated")
        start = pos + _HEAD.size
        if start + size > len(data):
            return records, pos                       # a body cut short: the last bytes
        body = data[start:start + size]
        if zlib.crc32(body) != body_crc:
            raise _damaged(path, k, pos, "its content's checksum does not match")
        frames = _frames(body)
        if frames is None:
            raise _damaged(path, k, pos, "its frame lengths do not add up")
        records.append((pos, frames))
        pos = start + size
    return records, pos


def _frames(body: bytes) -> list[bytes] | None:
    if len(body) < 4:
        return None
    (n,) = struct.unpack_from("<I", body, 0)
    at, frames = 4, []
    for _ in range(n):
        if at + 8 > len(body):
            return None
        (size,) = struct.unpack_from("<Q", body, at)
        at += 8
        if at + size > len(body):
            return None
        frames.append(body[at:at + size])
        at += size
    return frames if at == len(body) else None


def _not_a_log(path: pathlib.Path, data: bytes) -> str:
    if _earlier_format(data):
        return (f"write-ahead log {str(path)!r} is in the format of an earlier jaxpar (records without "
                "checksums), which this version does not replay. Start the server once with the jaxpar "
                "that wrote it and stop it with SIGTERM: its final checkpoint empties the log, and this "
                "version then starts from it. Or move wal.bin aside to serve from state.npz alone (the "
                "pushes logged in it are lost)")
    return (f"write-ahead log {str(path)!r} does not begin with {WAL_MAGIC!r} (byte 0, record 0): it is "
            f"damaged or not a jaxpar log. {_MOVE_ASIDE}")


def _earlier_format(data: bytes) -> bool:
    """Whether ``data`` begins with a whole record of the earlier format (no file header, no
    checksums) holding a push."""
    if len(data) < 12:
        return False
    (n,) = struct.unpack_from("<I", data, 0)
    (size,) = struct.unpack_from("<Q", data, 4)
    if not 1 <= n <= 16 or 12 + size > len(data):
        return False
    try:
        header = json.loads(data[12:12 + size].decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(header, dict) and header.get("op") == "push"
