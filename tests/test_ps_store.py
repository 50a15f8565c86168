"""A parameter server's durable state: a write-ahead log whose damage stops the start (only an
incomplete last record, never acknowledged, is dropped), pushes acknowledged only once their
record is on disk, and step snapshots committed with the state that lists them.

In-process servers (`jaxpar.ps.server.Server`) except where the exit code is checked: those start
``python -m jaxpar.ps.server`` under a timeout.
"""

import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from jaxpar import ps
from jaxpar.ps import store
from jaxpar.ps.server import Server
from jaxpar.ps.store import WAL_MAGIC, StoreError, read_state

TOKEN = "t0ken"
SPEC = ps.TableSpec("t", 4, 2, ps.SGD(1.0))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _server(path, mode="sync", every=100):
    server = Server(0, 1, str(path), every=every)
    if server.job is None:
        server.handle({"op": "hello", "mode": mode, "staleness": 0, "workers": 1, "tables": [SPEC.to_json()]}, [])
    return server


def _push(server, step, g=1.0):
    if server.job["mode"] == "async":   # (an async push names the pull that gave its rows)
        assert server.handle({"op": "pull", "table": "t", "step": step, "worker": 0}, [np.array([0])])
    return server.handle({"op": "push", "table": "t", "step": step, "worker": 0},
                         [np.array([0]), np.full((1, 2), g, np.float32)])


def _logged(path, steps=3):
    """A server killed after ``steps`` acknowledged pushes: its log's bytes and record offsets."""
    server = _server(path)
    for step in range(steps):
        assert _push(server, step)[0]["status"] == "applied"
    server.wal.close()  # (the kill: no checkpoint)
    data = (path / "server-0-of-1" / "wal.bin").read_bytes()
    offsets, at = [], len(WAL_MAGIC)
    while at < len(data):
        offsets.append(at)
        at += 24 + struct.unpack_from("<Q", data, at + 8)[0]
    assert len(offsets) == steps
    return data, offsets


def _start(path, timeout=60):
    env = {**os.environ, "JAXPAR_PS_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "jaxpar.ps.server", "--index", "0", "--count", "1",
                           "--checkpoint-dir", str(path)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _set_length(data, at, value):   # a record's body length, its header checksum left as it was
    data[at + 8:at + 16] = struct.pack("<Q", value)


def _set_frame_count(data, at, value):
    data[at + 24:at + 28] = struct.pack("<I", value)


def _flip_gradient_byte(data, at):
    end = at + 24 + struct.unpack_from("<Q", data, at + 8)[0]
    data[end - 1] ^= 0x40


def _edit_header_validly(data, at):  # the push's JSON header, step 1 -> step 7: still a valid push
    body = bytes(data[at + 24:])
    i = body.index(b'"step": 1')
    data[at + 24 + i + 8] = ord("7")


def _edit_head_and_its_checksum(data, at):  # a record renumbered consistently: a record missing
    head = struct.pack("<QQI", 5, *struct.unpack_from("<QI", data, at + 8))
    data[at:at + 24] = head + struct.pack("<I", zlib.crc32(head))


@pytest.mark.parametrize("damage, what", [
    (lambda d, at: _set_length(d, at, 1 << 40), "its header's checksum does not match"),
    (lambda d, at: _set_length(d, at, 3), "its header's checksum does not match"),
    (lambda d, at: _set_frame_count(d, at, 7), "its content's checksum does not match"),
    (_flip_gradient_byte, "its content's checksum does not match"),
    (_edit_header_validly, "its content's checksum does not match"),
    (_edit_head_and_its_checksum, "it is numbered 5: a record is missing or repeated"),
])
def test_a_damaged_record_in_the_middle_of_the_log_stops_the_start_and_keeps_the_file(tmp_path, damage, what):
    """One damaged field of record 1 of 3 (a length, a frame count, a gradient byte, a header
    edited into another valid one): the server started at clock 1 instead of 3 without a word,
    dropping two acknowledged pushes, and cut the file to its first record."""
    data, offsets = _logged(tmp_path)
    wal = tmp_path / "server-0-of-1" / "wal.bin"
    damaged = bytearray(data)
    damage(damaged, offsets[1])
    wal.write_bytes(bytes(damaged))
    with pytest.raises(StoreError, match=rf"wal.bin': record 1 at byte {offsets[1]} is damaged \({what}\); the "
                                         r"acknowledged pushes from it on cannot be replayed.*move wal.bin aside"):
        Server(0, 1, str(tmp_path), every=100)
    assert wal.read_bytes() == bytes(damaged)  # the evidence is kept


def test_the_server_exits_2_on_a_damaged_log_random_bytes_or_an_earlier_format(tmp_path):
    data, offsets = _logged(tmp_path)
    wal = tmp_path / "server-0-of-1" / "wal.bin"
    damaged = bytearray(data)
    _set_length(damaged, offsets[1], 1 << 40)
    wal.write_bytes(bytes(damaged))
    run = _start(tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and f"record 1 at byte {offsets[1]} is damaged" in run.stderr
    assert wal.read_bytes() == bytes(damaged)

    wal.write_bytes(np.random.default_rng(0).bytes(1000))   # random bytes: the server started at clock 0
    with pytest.raises(StoreError, match=r"wal.bin' does not begin with b'jaxpar-ps-wal 2\\n' \(byte 0, "
                                         r"record 0\): it is damaged or not a jaxpar log"):
        Server(0, 1, str(tmp_path), every=100)

    # the earlier format: records of [frame count, (length, frame)...] without a file header
    earlier = b"".join(struct.pack("<I", 3) + b"".join(struct.pack("<Q", len(f)) + f for f in frames)
                       for _, frames in store._records(wal, data)[0])
    wal.write_bytes(earlier)
    with pytest.raises(StoreError, match=r"is in the format of an earlier jaxpar \(records without checksums\).*"
                                         r"stop it with SIGTERM: its final checkpoint empties the log"):
        Server(0, 1, str(tmp_path), every=100)
    wal.write_bytes(b"")   # what the earlier version's SIGTERM leaves: an empty log, read by this one
    assert Server(0, 1, str(tmp_path), every=100).tables["t"].clock == 0


@pytest.mark.parametrize("cut", [1, 10, 23, 24, 30, -1])
def test_only_an_incomplete_last_record_is_dropped(tmp_path, cut, capfd):
    """A kill while record 2 was written leaves a prefix of it: dropped (never acknowledged), said
    on stderr, and the file cut back so that what is logged after the restart follows record 1."""
    data, offsets = _logged(tmp_path)
    wal = tmp_path / "server-0-of-1" / "wal.bin"
    end = offsets[2] + (cut if cut > 0 else len(data) - offsets[2] + cut)
    wal.write_bytes(data[:end])
    again = Server(0, 1, str(tmp_path), every=100)
    assert again.tables["t"].clock == 2
    assert f"dropped an incomplete last record ({end - offsets[2]} bytes at byte {offsets[2]})" in capfd.readouterr().err
    assert wal.read_bytes() == data[:offsets[2]]
    assert _push(again, 2)[0]["status"] == "applied"
    again.wal.close()
    assert Server(0, 1, str(tmp_path), every=100).tables["t"].clock == 3


def test_a_push_is_acknowledged_only_once_its_record_is_on_disk(tmp_path, monkeypatch):
    """The log was flushed to the operating system only: a power cut after the acknowledgement
    lost the push. A record that cannot be synced is not acknowledged; one cut short by a full
    disk leaves nothing behind that would stop the next start."""
    server = _server(tmp_path)
    synced = []
    monkeypatch.setattr(store.os, "fdatasync", lambda fd: synced.append(fd))
    _push(server, 0)
    assert synced == [server.wal.file.fileno()]

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.os, "fdatasync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        _push(server, 1)
    monkeypatch.undo()

    real = server.wal.file

    class FullDisk:   # writes half a record, then the disk is full
        def tell(self):
            return real.tell()

        def write(self, b):
            real.write(b[:len(b) // 2])
            real.flush()
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()

    server.wal.file = FullDisk()
    with pytest.raises(OSError, match="No space left"):
        _push(server, 1)
    assert _push(server, 1)[0]["status"] == "applied"   # the worker sends it again
    server.wal.close()
    assert Server(0, 1, str(tmp_path), every=100).tables["t"].clock == 2


def _snapshot_clock(path, step):
    return read_state(path / "server-0-of-1" / f"step-{step}.npz")[1]["tables"]["t"]["done"][0]


def test_an_async_snapshot_is_not_written_again_after_a_kill(tmp_path):
    """Saved at step 2 (clock 2), killed before the next state.npz: the restart did not know the
    snapshot, so another worker's save of step 2 at clock 3 wrote it again over the one the
    first worker's checkpoint goes with."""
    server = _server(tmp_path, mode="async")
    _push(server, 0), _push(server, 1)
    assert server.handle({"op": "save", "step": 2}, [])[0]["clock"] == 2
    server.wal.close()                                # killed
    again = Server(0, 1, str(tmp_path), every=100)
    assert 2 in again.snapshots
    _push(again, 2)
    again.handle({"op": "save", "step": 2}, [])
    assert _snapshot_clock(tmp_path, 2) == 2


class _Crash(BaseException):
    """The process dies here."""


@pytest.mark.parametrize("links", [True, False])
@pytest.mark.parametrize("crash_at", [0, 1, 2, None])
def test_a_snapshot_and_its_state_commit_as_one(tmp_path, monkeypatch, crash_at, links):
    """A kill at each rename of a save: the restart finds the old pair (step 3 not a snapshot of
    this history, the abandoned history's file untouched) or the new one (listed, written at
    clock 3), no temporary file, and a later save of step 3 keeps the new pair."""
    server = _server(tmp_path, mode="async")
    _push(server, 0), server.handle({"op": "save", "step": 1}, [])
    _push(server, 1), _push(server, 2), server.handle({"op": "save", "step": 3}, [])
    server.handle({"op": "restore", "step": 1}, [])   # step 3 now belongs to the history left
    assert server.snapshots == {1}
    _push(server, 1, g=5.0), _push(server, 2, g=5.0)
    directory = tmp_path / "server-0-of-1"
    old = (directory / "step-3.npz").read_bytes()
    renames, real = [], os.replace

    def replace(src, dst):
        if len(renames) == crash_at:
            raise _Crash()
        renames.append(os.path.basename(dst))
        real(src, dst)

    monkeypatch.setattr(store.os, "replace", replace)
    if not links:
        monkeypatch.setattr(store.os, "link", lambda *a: (_ for _ in ()).throw(OSError(1, "not permitted")))
    try:
        server.handle({"op": "save", "step": 3}, [])
    except _Crash:
        pass
    server.wal.close()
    monkeypatch.undo()
    assert renames == ["state.npz", "step-3.npz", "wal.bin"][:len(renames)]
    again = Server(0, 1, str(tmp_path), every=100)
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert again.tables["t"].clock == 3
    committed = crash_at is None or crash_at >= 1
    assert (3 in again.snapshots) == committed
    if committed:
        _push(again, 3)
        again.handle({"op": "save", "step": 3}, [])   # another worker asks again: kept
        assert _snapshot_clock(tmp_path, 3) == 3
        again.handle({"op": "restore", "step": 3}, [])
        want = ps.init_rows(SPEC, np.array([0]))[0] - 11
        np.testing.assert_allclose(again.tables["t"].weights[0], want, rtol=1e-6)
    else:
        assert (directory / "step-3.npz").read_bytes() == old


def test_a_state_file_that_cannot_be_read_stops_the_start_naming_it(tmp_path):
    """A state.npz holding pickled data raised numpy's "Object arrays cannot be loaded when
    allow_pickle=False" as a traceback; one of random bytes a BadZipFile."""
    directory = tmp_path / "server-0-of-1"
    directory.mkdir()
    np.savez(directory / "state.npz", x=np.array([{"a": 1}], dtype=object))
    run = _start(tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert f"shard checkpoint '{directory / 'state.npz'}' cannot be read (it holds pickled (object) arrays, which " \
           "a checkpoint never does and this server never loads): it is damaged or not a jaxpar" in run.stderr
    (directory / "state.npz").write_bytes(b"not a zip file")
    with pytest.raises(StoreError, match=r"state.npz' cannot be read \(not an .npz archive\).*move the directory"):
        Server(0, 1, str(tmp_path), every=100)
