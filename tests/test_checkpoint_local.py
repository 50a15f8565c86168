"""The local checkpoint tier and its peer copy (`jaxpar.checkpoint.local`, `.peer`): resume from
the newest local step, fall back to the persistent tier when it is damaged or the layout moved,
a kill's leftovers never taken, a peer server that survives any frame, and, under ``jaxpar
launch`` with a rank SIGKILLed and a host's local storage wiped, a group that resumes through
its peers' copies and ends with the parameters of an uninterrupted run."""

import json
import os
import shutil
import socket
import struct
import sys
import time
import warnings

import numpy as np
import pytest

import jaxpar
from jaxpar.checkpoint import peer as wire
from jaxpar.checkpoint.local import LocalTier, peers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import local_tier_worker as worker  # noqa: E402


def _params(trainer):
    """``{path: array}`` of the parameters, named as the worker names them."""
    import jax
    from flax import nnx

    tree = nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _trainer(tmp_path, *, local_every=2, config=None, resume="newest"):
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(
        dir=tmp_path / "ckpt", save_every=100, resume=resume, local_dir=tmp_path / "local", local_every=local_every))
    if config is None:
        return worker.trainer(services)
    import optax
    from flax import nnx

    from jaxpar.models.gpt import GPT, loss_fn

    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(worker.model_config(), rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, services=services)


@pytest.fixture(scope="module")
def uninterrupted():
    """Losses and parameters of `worker.STEPS` steps in one process, no checkpoint."""
    t = worker.trainer()
    losses = [float(t.step(b)["loss"]) for b in worker.batches()]
    return losses, _params(t)


def test_a_new_trainer_resumes_the_newest_local_step_and_trains_on_bit_identically(tmp_path, uninterrupted):
    t = _trainer(tmp_path)
    for b in worker.batches()[:5]:
        t.step(b)
    t.close()
    own = tmp_path / "local" / "process-0" / "own"
    assert sorted(os.listdir(own)) == ["step-2", "step-4"]
    assert not (tmp_path / "ckpt" / "4").exists()       # the persistent tier saves every 100 steps
    t = _trainer(tmp_path)
    assert t.step_count == 4
    assert t.service("checkpoint").local.recovery.source == "own"
    losses = [float(t.step(b)["loss"]) for b in worker.batches()[4:]]
    assert losses == uninterrupted[0][4:]
    for k, v in _params(t).items():
        np.testing.assert_array_equal(v, uninterrupted[1][k], err_msg=str(k))
    t.close()
    # steps are retired by agreement: at each save, those older than the newest written one go
    assert sorted(os.listdir(own)) == ["step-10", "step-8"]


def test_a_damaged_local_step_falls_back_to_the_persistent_tier(tmp_path):
    t = _trainer(tmp_path)
    for b in worker.batches()[:3]:
        t.step(b)
    t.save()                           # persistent step 3
    t.step(worker.batches()[3])        # local step 4
    t.close()
    shards = tmp_path / "local" / "process-0" / "own" / "step-4" / "shards.bin"
    data = bytearray(shards.read_bytes())
    data[len(data) // 2] ^= 0x40
    shards.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step 4 could not be taken on process\(es\) \[0\].*damaged.*CRC-32"):
        t = _trainer(tmp_path)
    assert t.step_count == 3
    assert [n for n in os.listdir(tmp_path / "local" / "process-0" / "own") if n.startswith("damaged-step-4")]
    t.close()


def test_a_layout_the_saved_shards_do_not_cover_falls_back_and_one_they_cover_is_taken(tmp_path):
    t = _trainer(tmp_path)
    for b in worker.batches()[:2]:
        t.step(b)
    t.save()
    before = _params(t)
    t.close()
    # ZeRO-3 splits the parameters further over data: within what one process saved (all of it here)
    zero3 = jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"}, optimizer={"level": 3, "threshold_kb": 0})
    t = _trainer(tmp_path, config=zero3)
    assert t.step_count == 2 and t.service("checkpoint").local.recovery is not None
    for k, v in _params(t).items():
        np.testing.assert_array_equal(v, before[k])
    t.close()


def test_a_kill_during_a_write_leaves_nothing_a_restore_takes(tmp_path):
    t = _trainer(tmp_path)
    for b in worker.batches()[:2]:
        t.step(b)
    t.close()
    own = tmp_path / "local" / "process-0" / "own"
    # what a kill leaves: a half-written temporary directory (renamed into place only when whole),
    # and a step directory of another run's job size (4 processes) that is no step of this one
    (own / "tmp-step-4-dead").mkdir()
    (own / "tmp-step-4-dead" / "shards.bin").write_bytes(b"\0" * 10)
    shutil.copytree(own / "step-2", own / "step-6")
    manifest = json.loads((own / "step-6" / "manifest.json").read_text())
    (own / "step-6" / "manifest.json").write_text(json.dumps({**manifest, "processes": 4}))
    t = _trainer(tmp_path)
    assert t.step_count == 2
    assert not (own / "tmp-step-4-dead").exists()
    t.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kills_during_local_writes_never_leave_a_step_a_restore_takes(tmp_path):
    """A process saving a 13 MB state to the local tier every step is SIGKILLed at random moments
    (each step waits for the previous write, so most kills land inside one): every restart
    resumes, without a warning, a step at least as new as the newest the killed process saw
    written and no newer than it had started; a kill left a half-written step at least once."""
    import random
    import signal
    import subprocess

    from workers.procs import env

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "local_kill_worker.py")
    own = tmp_path / "local" / "process-0" / "own"
    rng, written, started, torn = random.Random(0), 0, 0, 0
    for run in range(3):
        proc = subprocess.Popen([sys.executable, script, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env())
        try:
            lines = []
            while not (lines and lines[-1].startswith("RESUMED")):
                line = proc.stdout.readline()
                assert line, f"the worker ended before resuming: {lines}"
                lines.append(line.strip())
            assert not [line for line in lines if line.startswith("WARNING")], lines
            resumed = int(lines[-1].split()[1])
            assert written <= resumed <= started, (run, written, resumed, started)
            if run == 2:
                break
            target = resumed + 3 + rng.randrange(3)
            while started < target:
                word, step = proc.stdout.readline().split()
                if word == "WRITTEN":
                    written = max(written, int(step))
                else:
                    started = int(step)
            deadline = time.monotonic() + 5       # kill it as soon as a write is seen under way
            while not any(name.startswith("tmp-") for name in os.listdir(own)) and time.monotonic() < deadline:
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            torn += any(name.startswith("tmp-") for name in os.listdir(own))
            for line in proc.stdout.read().split("\n"):    # what it printed before it died
                if line.startswith("WRITTEN"):
                    written = max(written, int(line.split()[1]))
                elif line.startswith("STARTED"):
                    started = int(line.split()[1])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
    assert torn >= 1, "no kill landed inside a write"


def test_local_steps_of_another_run_are_not_taken(tmp_path):
    # the persistent directory was deleted to start afresh: the local steps in the same local_dir
    # belong to the run that is gone (its identity lived there), so nothing is resumed and they go
    t = _trainer(tmp_path)
    for b in worker.batches()[:2]:
        t.step(b)
    t.close()
    shutil.rmtree(tmp_path / "ckpt")
    t = _trainer(tmp_path)
    assert t.step_count == 0 and t.service("checkpoint").local.recovery is None
    assert not os.listdir(tmp_path / "local" / "process-0" / "own")
    t.close()


def test_a_region_is_cut_from_the_saved_pieces_or_refused_when_they_do_not_cover_it():
    from jaxpar.checkpoint.local import LayoutNotCovered, _region

    whole = np.arange(32.0).reshape(4, 8)
    pieces = {((0, 2), (0, 8)): whole[:2], ((2, 4), (0, 4)): whole[2:, :4]}
    np.testing.assert_array_equal(_region(pieces, ((1, 3), (2, 4)), whole.dtype), whole[1:3, 2:4])   # across two
    assert _region(pieces, ((0, 2), (0, 8)), whole.dtype) is pieces[((0, 2), (0, 8))]                  # as saved
    with pytest.raises(LayoutNotCovered, match=r"the shard \[\(2, 4\), \(0, 8\)\] is not within"):
        _region(pieces, ((2, 4), (0, 8)), whole.dtype)


def test_local_tier_settings_are_checked():
    with pytest.raises(ValueError, match=r"local_every=3 saves into local_dir, and none was given"):
        jaxpar.CheckpointConfig(dir="c", local_every=3)
    with pytest.raises(ValueError, match=r"local_dir='/dev/shm/x' with local_every=0 keeps nothing"):
        jaxpar.CheckpointConfig(dir="c", local_dir="/dev/shm/x")
    with pytest.raises(ValueError, match=r"local_every=-1 must be an int >= 0"):
        jaxpar.CheckpointConfig(dir="c", local_dir="/dev/shm/x", local_every=-1)
    with pytest.raises(TypeError, match=r"peer='yes' must be True or False"):
        jaxpar.CheckpointConfig(dir="c", local_dir="/dev/shm/x", local_every=1, peer="yes")


def test_peers_are_the_same_rank_on_the_next_host():
    assert peers(["a", "a", "b", "b"]) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert peers(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    assert peers(["a", "a", "a", "b"]) == {0: 3, 1: 3, 2: 3, 3: 0}
    assert peers(["a"]) == {}


def _exactly(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _raw(port, payload: bytes = b"", *, handshake=None, attack=None):
    """Connect; answer the handshake with the key ``handshake`` (or, with ``attack``, try to get
    past it without the key: "echo" sends the server's nonce back as this side's, "reflect"
    sends the server's own proof back as this side's); send ``payload``; read what comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        out = b""
        try:
            if handshake is not None or attack is not None:
                nonce = _exactly(s, 32)
                mine = nonce if attack == "echo" else os.urandom(32)
                s.sendall(mine)
                theirs = _exactly(s, 32)            # the server's proof
                s.sendall(theirs if attack else wire._proof(handshake, b"client", nonce, mine))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                out += chunk
        except OSError:         # the server dropped the connection, with data still unread
            pass
        return out


def test_the_peer_server_survives_any_frame_and_serves_after(tmp_path):
    key = b"k" * 32
    server = wire.PeerServer(str(tmp_path / "holder"), key, host="127.0.0.1")
    step = tmp_path / "src"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    (step / "shards.bin").write_bytes(os.urandom(3000))
    try:
        frame = lambda obj: struct.pack("!Q", len(json.dumps(obj))) + json.dumps(obj).encode()  # noqa: E731
        _raw(server.port, os.urandom(200))                                       # no handshake at all
        _raw(server.port, b"", handshake=b"wrong" * 7)                           # a wrong key
        put = frame({"op": "put", "source": 3, "step": 9, "files": [{"name": "manifest.json", "size": 2}]}) + b"{}"
        for attack in ("echo", "reflect"):                                       # no key: its own proofs sent back
            assert b'"ok"' not in _raw(server.port, put, attack=attack)
        assert not (tmp_path / "holder" / "peer-3").exists()
        bad = [struct.pack("!Q", 1 << 40),                                       # an oversized header
               struct.pack("!Q", 5) + b"notjs",                                  # not JSON
               frame([1, 2]), frame({"op": "delete"}),                           # not an object; unknown op
               frame({"op": "put", "source": -1, "step": 1, "files": []}),       # a bad number
               frame({"op": "put", "source": 1, "step": 1, "files": [{"name": "../x", "size": 1}]}),   # a bad name
               frame({"op": "put", "source": 1, "step": 1, "files": [{"name": "manifest.json", "size": 99}]}) + b"{"]
        replies = [_raw(server.port, payload, handshake=key) for payload in bad]
        assert all(b'"error"' in r for r in replies[1:]), replies
        assert server.rejected == 4 + len(bad)
        assert not (tmp_path / "holder" / "peer-1").exists() or not any(
            n.startswith("step-") for n in os.listdir(tmp_path / "holder" / "peer-1"))
        wire.put_step(("127.0.0.1", server.port), key, 5, 7, str(step))
        wire.get_step(("127.0.0.1", server.port), key, 5, 7, str(tmp_path / "back"))
        assert (tmp_path / "back" / "shards.bin").read_bytes() == (step / "shards.bin").read_bytes()
        with pytest.raises(wire.PeerError, match="no copy of process 5's step 8"):
            wire.get_step(("127.0.0.1", server.port), key, 5, 8, str(tmp_path / "none"))
        with pytest.raises(wire.PeerError, match="handshake"):
            wire.get_step(("127.0.0.1", server.port), b"x" * 32, 5, 7, str(tmp_path / "none"))
    finally:
        server.close()


def test_a_peer_step_larger_than_the_free_space_is_refused_before_a_byte_is_written(tmp_path, monkeypatch):
    key = b"k" * 32
    server = wire.PeerServer(str(tmp_path / "holder"), key, host="127.0.0.1")
    step = tmp_path / "src"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    (step / "shards.bin").write_bytes(os.urandom(48 << 20))      # more than the sockets' buffers hold
    usage = wire.shutil.disk_usage
    monkeypatch.setattr(wire.shutil, "disk_usage", lambda path: usage(path)._replace(free=1000))
    try:
        # the server refuses at the header and closes while the bytes still arrive: the sender reads why
        with pytest.raises(wire.PeerError, match=rf"refused: OSError: .*a step of {(48 << 20) + 2} bytes does not "
                                                 r"fit the 1000 bytes free under"):
            wire.put_step(("127.0.0.1", server.port), key, 5, 7, str(step))
        assert not any(n.startswith(("step-", "tmp-")) for n in os.listdir(tmp_path / "holder" / "peer-5"))
        monkeypatch.setattr(wire.shutil, "disk_usage", usage)
        wire.put_step(("127.0.0.1", server.port), key, 5, 7, str(step))      # the server serves on
        assert (tmp_path / "holder" / "peer-5" / "step-7" / "shards.bin").read_bytes() == (step / "shards.bin").read_bytes()
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_rank_and_a_wiped_host_resume_from_the_local_tier_through_peers(tmp_path, tag, uninterrupted):
    from workers.procs import WORKERS, Launch

    from jaxpar.launch.ports import free_port

    args = ["--worker-num", 4, "--local-worker-num", 4, "--simulated-devices", 2, "--worker-restarts", 1,
            "--master-port", free_port(), "--cluster-time-out", 60]
    run = Launch(tmp_path, tag, args, ["--tier", tmp_path / "local", "--ckpt", tmp_path / "ckpt"],
                 script=os.path.join(WORKERS, "local_tier_worker.py"), entry=("-m", "jaxpar.cli", "launch"))
    try:
        code = run.wait(timeout=280)
    finally:
        run.close()
    logs = "\n".join(run.log(r)[-2000:] for r in range(4))
    assert code == 0, (run.stderr[-3000:], logs)
    assert "restarting the worker group (1 of 1" in run.stderr
    resumed = {p: json.loads((run.out_dir / f"resumed-{p}.1.json").read_text()) for p in range(4)}
    # step 6 (the newest local step, local_every=2 before the kill after step 7): host 0's processes
    # from their own copies, host 1's (wiped) from their peers' on host 0
    assert resumed == {0: {"step": 6, "source": "own"}, 1: {"step": 6, "source": "own"},
                       2: {"step": 6, "source": "peer"}, 3: {"step": 6, "source": "peer"}}, resumed
    assert not os.listdir(tmp_path / "ckpt") or all(not n.isdigit() for n in os.listdir(tmp_path / "ckpt"))
    # the job's processes share their programs on this host (jaxpar.executables): in the first
    # life one process compiled the step and the others read it; restarted, none compiles it
    first = {p: json.loads((run.out_dir / f"compiled-{p}.0.first.json").read_text()) for p in range(4)}
    assert sum("flat_step" in first[p]["compiled"] for p in range(4)) <= 1, first   # (0: an earlier run's)
    assert all("flat_step" in first[p]["compiled"] or first[p]["read"] >= 1 for p in range(4)), first
    compiled = {p: json.loads((run.out_dir / f"compiled-{p}.1.json").read_text()) for p in range(4)}
    for p in range(4):
        assert "flat_step" not in compiled[p]["compiled"] and compiled[p]["read"] >= 1, (p, compiled[p])
    with np.load(run.out_dir / "params.npz") as z:
        got = {k: z[k] for k in z.files}
    assert sorted(got) == sorted(uninterrupted[1])
    for k, v in got.items():
        np.testing.assert_allclose(v, uninterrupted[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
