"""Replica groups: the coordinator's bookkeeping (`jaxpar.ps.quorum`), its process, the
Trainer's two-program step, and three groups on localhost with one SIGKILLed and restarted."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, assert_close, batches, mesh_for
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.ps.quorum import Quorum
from workers.ps_servers import ROOT

zmq = pytest.importorskip("zmq")

WORKER = os.path.join(ROOT, "tests", "workers", "replica_worker.py")
TOKEN = "replica-test-token"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _quorum(groups=3, timeout=2.0, **kw):
    clock = Clock()
    lines = []
    return Quorum(groups, timeout, clock=clock, log=lines.append, **kw), clock, lines


def _join(q, group, *, rank=0, ranks=1, step=0, incarnation=None, layout="L", digest="D"):
    return q.handle(f"g{group}r{rank}".encode(), {"op": "join", "group": group, "rank": rank, "ranks": ranks,
                                                  "incarnation": incarnation or f"i{group}", "layout": layout,
                                                  "step": step, "digest": digest, "rid": f"j{group}.{rank}"}, [])


def _state(q, group, rank, step, arrays, data=None):
    return q.handle(f"g{group}r{rank}".encode(), {"op": "state", "group": group, "rank": rank, "step": step,
                                                  "incarnation": f"i{group}", "data": data, "rid": f"s{group}.{rank}"},
                    arrays)


def _average(q, group, step, arrays, *, rank=0, incarnation=None):
    return q.handle(f"g{group}r{rank}".encode(), {"op": "average", "group": group, "rank": rank, "step": step,
                                                  "incarnation": incarnation or f"i{group}", "rid": f"a{group}.{step}"},
                    arrays)


def _beat(q, group, *, rank=0, incarnation=None):
    q.handle(b"beat", {"op": "beat", "group": group, "rank": rank, "incarnation": incarnation or f"i{group}"}, [])


# ------------------------------------------------------------------ the coordinator's bookkeeping
def test_quorum_starts_when_every_group_joined_and_means_in_group_order():
    q, clock, _ = _quorum()
    assert _join(q, 0) == [] and _join(q, 1) == []
    started = _join(q, 2)
    assert sorted(f["rid"] for _, f, _ in started) == ["j0.0", "j1.0", "j2.0"]
    assert all(f["heal"] is False and f["step"] == 0 and f["members"] == [0, 1, 2] for _, f, _ in started)
    parts = [np.array([1.0, 2.0], np.float32), np.array([2.0, 4.0], np.float32), np.array([1e8, 1.0], np.float32)]
    assert _average(q, 0, 1, [parts[0]]) == [] and _average(q, 1, 1, [parts[1]]) == []
    replies = _average(q, 2, 1, [parts[2]])
    want = ((parts[0].astype(np.float64) + parts[1] + parts[2]) / 3).astype(np.float32)
    assert len(replies) == 3 and q.step == 1
    for _, fields, (mean,) in replies:
        assert fields["groups"] == [0, 1, 2] and not fields["donate"]
        assert mean.dtype == np.float32 and mean.tobytes() == want.tobytes()   # the same bytes to every group


def test_quorum_drops_a_silent_group_and_heals_it_from_a_live_one():
    q, clock, lines = _quorum()
    for g in range(3):
        _join(q, g)
    one = [np.ones(3, np.float32)]
    _average(q, 0, 1, one)
    _average(q, 2, 1, [np.full(3, 3.0, np.float32)])
    clock.now = 1.5
    _beat(q, 0)
    _beat(q, 2)
    assert q.tick() == []                      # group 1 is late, not yet dropped
    clock.now = 2.5
    replies = q.tick()                         # 2.5 s without a beat from group 1: the round goes on without it
    assert [f["groups"] for _, f, _ in replies] == [[0, 2], [0, 2]]
    np.testing.assert_array_equal(replies[0][2][0], np.full(3, 2.0, np.float32))
    assert "group 1 dropped at step 0" in lines[-1] and q.step == 1
    # the restarted group joins with a new incarnation and waits for a live group's state
    assert _join(q, 1, incarnation="i1-again", step=0) == []
    _average(q, 0, 2, one)
    replies = _average(q, 2, 2, one)
    assert {f["rid"]: f["donate"] for _, f, _ in replies} == {"a0.2": True, "a2.2": False}
    with pytest.raises(ValueError, match="asked for its state of step 2 and sent no state first"):
        _average(q, 0, 3, one)
    state = [np.arange(4, dtype=np.float32)]
    out = q.handle(b"g0r0", {"op": "state", "group": 0, "rank": 0, "incarnation": "i0", "step": 2,
                             "data": {"epoch": 1}, "rid": "s"}, state)
    healed = [f for _, f, _ in out if f.get("heal")]
    assert healed == [{"rid": "j1.0", "heal": True, "step": 2, "donor": 0, "data": {"epoch": 1}}]
    assert sorted(q.members) == [0, 1, 2] and q.members[1].incarnation == "i1-again"
    # the healed group is in the next round: it completes only with its part
    _average(q, 0, 3, one)
    assert _average(q, 2, 3, one) == []
    assert len(_average(q, 1, 3, one, incarnation="i1-again")) == 3


def test_quorum_rounds_are_atomic_over_ranks():
    """Rank 0 of group 1 sent, then group 1 died: both ranks' means go without it."""
    q, clock, _ = _quorum(groups=2)
    for g in range(2):
        for r in range(2):
            _join(q, g, rank=r, ranks=2)
    assert q.started and sorted(q.members) == [0, 1]
    x = [np.ones(2, np.float32)]
    for g, r in ((0, 0), (0, 1), (1, 0)):
        assert _average(q, g, 1, x, rank=r) == []
    clock.now = 3.0
    for r in range(2):
        _beat(q, 0, rank=r)
    replies = q.tick()
    errors = [f for _, f, _ in replies if f.get("ok") is False]
    means = [f for _, f, _ in replies if "groups" in f]
    assert len(means) == 2 and all(f["groups"] == [0] for f in means)
    assert len(errors) == 1 and "group 1 was dropped" in errors[0]["error"]   # its waiting rank is told


def test_quorum_refuses_what_cannot_join_or_average():
    q, clock, _ = _quorum(groups=2)
    _join(q, 0)
    with pytest.raises(ValueError, match="state layout .* differs"):
        _join(q, 1, layout="other")
    with pytest.raises(ValueError, match="rank=2 is not below ranks=2"):
        _join(q, 1, rank=2, ranks=2)
    with pytest.raises(ValueError, match="field 'group' is 'x'"):
        q.handle(b"x", {"op": "join", "group": "x"}, [])
    with pytest.raises(ValueError, match="unknown operation"):
        q.handle(b"x", {"op": "drop_everything"}, [])
    _join(q, 1)
    with pytest.raises(ValueError, match="sends step 5, and the groups are at step 1"):
        _average(q, 0, 5, [])
    with pytest.raises(ValueError, match="group 7 is not in the mean"):
        _average(q, 7, 1, [])
    _average(q, 0, 1, [np.ones(2, np.float32)])
    replies = _average(q, 1, 1, [np.ones(3, np.float32)])
    assert all(f["ok"] is False and "other shapes" in f["error"] for _, f, _ in replies)


def test_quorum_starts_with_the_groups_there_after_start_timeout():
    q, clock, lines = _quorum(groups=3, start_timeout=10.0)
    _join(q, 0, step=4)
    _join(q, 1, step=2)             # behind: it heals from group 0 at the first round's end
    clock.now = 5.0
    for g in (0, 1):
        _beat(q, g)
    assert q.tick() == [] and not q.started
    clock.now = 10.5
    for g in (0, 1):
        _beat(q, g)
    started = q.tick()
    assert [f["rid"] for _, f, _ in started] == ["j0.0"] and q.step == 4
    assert "2 of 3 joined in time" in lines[-1] and sorted(q.joining) == [1]
    assert _average(q, 0, 5, [])[0][1]["donate"] is True


def test_quorum_lets_a_waiting_group_go_on_alone_when_every_member_left():
    q, clock, _ = _quorum(groups=1)
    _join(q, 0, step=7)
    assert _join(q, 1, step=3) == []        # waits for a live group's state
    out = q.handle(b"g0r0", {"op": "leave", "group": 0, "incarnation": "i0", "rid": "l"}, [])
    assert [f["rid"] for _, f, _ in out] == ["l"]
    started = q.tick()                       # nobody to heal from: the job starts again, from it
    assert [(f["rid"], f["heal"], f["step"]) for _, f, _ in started] == [("j1.0", False, 3)]
    assert sorted(q.members) == [1] and q.step == 3


def test_quorum_founders_whose_state_differs_take_the_first_ones():
    q, clock, lines = _quorum(groups=3)
    _join(q, 0, digest="A")
    _join(q, 1, digest="A")
    started = _join(q, 2, digest="B")       # another seed: not a founder
    assert sorted(f["rid"] for _, f, _ in started) == ["j0.0", "j1.0"] and sorted(q.joining) == [2]
    assert "group 2's state at step 0 differs from group 0's" in lines[-2]
    _average(q, 0, 1, [])
    assert _average(q, 1, 1, [])[0][1]["donate"] is True


def test_quorum_heals_a_group_of_two_processes_only_when_the_donor_sent_every_shard():
    """The donor's state goes out once every one of its processes has sent its own; a group that
    became ready meanwhile waits for the next donor; a donor dropped half-way sends nothing."""
    q, clock, lines = _quorum(groups=2, timeout=5.0)
    for g in (0, 1):
        for r in (0, 1):
            _join(q, g, rank=r, ranks=2)
    for r in (0, 1):
        _join(q, 2, rank=r, ranks=2)        # waits
    x = [np.ones(2, np.float32)]
    for g, r in ((0, 0), (0, 1), (1, 0)):
        _average(q, g, 1, x, rank=r)
    replies = _average(q, 1, 1, x, rank=1)
    assert {f["rid"]: f["donate"] for _, f, _ in replies} == {"a0.1": True, "a1.1": False}
    assert [f["rid"] for _, f, _ in _state(q, 0, 0, 1, [np.zeros(1, np.float32)], {"at": 1})] == ["s0.0"]
    _join(q, 3, rank=0, ranks=2)
    _join(q, 3, rank=1, ranks=2)            # ready after the donor was asked: not this donor's
    _average(q, 0, 2, x, rank=0)            # donor rank 0 sent its state: it may go on
    with pytest.raises(ValueError, match="sent no state first"):
        _average(q, 0, 2, x, rank=1)
    out = _state(q, 0, 1, 1, [np.ones(1, np.float32)], {"at": 1})
    heals = {f["rid"]: (f["heal"], a[0].tolist()) for _, f, a in out if f.get("heal")}
    assert heals == {"j2.0": (True, [0.0]), "j2.1": (True, [1.0])}
    assert sorted(q.members) == [0, 1, 2] and sorted(q.joining) == [3]
    # round 2 asks a donor for group 3; the donor dies after sending one shard: group 3 gets nothing
    for g, r in ((0, 1), (1, 0), (1, 1), (2, 0), (2, 1)):
        _average(q, g, 2, x, rank=r)
    assert q.donor == (0, 2)
    assert not [f for _, f, _ in _state(q, 0, 0, 2, [np.zeros(1, np.float32)]) if f.get("heal")]
    clock.now = 6.0
    for g in (1, 2, 3):
        for r in (0, 1):
            _beat(q, g, rank=r)
    q.tick()
    assert 0 not in q.members and q.donor is None and sorted(q.joining) == [3]
    for g in (1, 2):
        for r in (0, 1):
            _average(q, g, 3, x, rank=r)
    assert q.donor == (1, 3)                # the next round asks the next live group


# ------------------------------------------------------------------ the coordinator's process
def _coordinator(tmp_path, *args):
    env = {**os.environ, "JAXPAR_REPLICAS_TOKEN": TOKEN, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.ps.replica_server", "--bind", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "coordinator.err", "w"), text=True,
                            env=env, cwd=ROOT)
    line = proc.stdout.readline()
    assert line.startswith("jaxpar-replicas ready "), line
    return proc, line.split()[-1]


@pytest.mark.timeout(120)
def test_coordinator_survives_any_frame_and_refuses_a_wrong_token(tmp_path):
    from jaxpar.ps.replicas import ReplicaGroup
    from jaxpar.ps.wire import decode, encode

    proc, address = _coordinator(tmp_path, "--groups", "1", "--timeout", "5")
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        frames = [[b"not json"], [b"[1, 2]"], [b'{"arrays": 5}'], [b"{}", b"extra"], [b"\xff" * 100],
                  encode({"op": "join", "token": TOKEN, "group": -1}), encode({"op": "average", "token": TOKEN}),
                  encode({"op": "join", "token": "wrong"}), [b"{" * 5000]]
        for f in frames:
            sock.send_multipart(f)
            assert sock.poll(5000), f"no answer to {f!r:.60}"
            header, _ = decode(sock.recv_multipart())
            assert header["ok"] is False and header["error"]
        sock.close()
        ctx.term()
        group = ReplicaGroup(address, 0, token="wrong", rank=0, ranks=1, timeout=10)
        with pytest.raises(PermissionError, match="wrong job token"):
            group.join(0, "L")
        group.close()
        group = ReplicaGroup(address, 0, token=TOKEN, rank=0, ranks=1, timeout=10, beat_every=0.1)
        assert group.join(3, "L")[:2] == (False, 3)     # it still serves
        np.testing.assert_array_equal(group.average(4, [np.arange(3, dtype=np.float32)])[0], np.arange(3))
        assert group.groups == [0] and group.stats()["step"] == 4
        assert group.loader_process(3) == jaxpar.data.LoaderProcess(index=0, count=3)
        group.close()                                     # it leaves: the mean stops waiting for it
        probe = ReplicaGroup(address, 5, token=TOKEN, rank=0, ranks=1, timeout=10)
        assert probe.stats()["members"] == []
        probe.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_coordinator_and_connect_refuse_bad_arguments(monkeypatch):
    from jaxpar.ps.replicas import connect

    run = lambda *a, env=None: subprocess.run([sys.executable, "-m", "jaxpar.ps.replica_server", *a],  # noqa: E731
                                              capture_output=True, text=True, cwd=ROOT, timeout=60,
                                              env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    out = run("--groups", "0", env={"JAXPAR_REPLICAS_TOKEN": "t"})
    assert out.returncode == 2 and "--groups 0 must be an integer >= 1" in out.stderr and "Traceback" not in out.stderr
    out = run("--groups", "2", env={"JAXPAR_REPLICAS_TOKEN": ""})
    assert out.returncode == 2 and "JAXPAR_REPLICAS_TOKEN" in out.stderr
    out = run("--groups", "2", "--bind", "nowhere", env={"JAXPAR_REPLICAS_TOKEN": "t"})
    assert out.returncode == 2 and "is not HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    monkeypatch.delenv("JAXPAR_REPLICAS_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="address=None must be the coordinator's HOST:PORT"):
        connect(group=0, token="t")
    monkeypatch.setenv("JAXPAR_REPLICA_GROUP", "one")
    with pytest.raises(ValueError, match="JAXPAR_REPLICA_GROUP='one' is not a group number"):
        connect("127.0.0.1:1", token="t")
    with pytest.raises(ValueError, match="group=-1 must be an int >= 0"):
        connect("127.0.0.1:1", -1, token="t")
    with pytest.raises(ValueError, match="beat_every=0 must be a positive number"):
        connect("127.0.0.1:1", 0, token="t", beat_every=0)


# ------------------------------------------------------------------ the Trainer's two-program step
class Alone:
    """A replica group of one: the mean of one group is its own gradient."""

    def __init__(self):
        self.calls, self.donate, self.groups = 0, False, [0]

    def join(self, step, layout, digest=""):
        return False, step, None, []

    def average(self, step, arrays):
        self.calls += 1
        return arrays

    def send_state(self, step, arrays, data):
        raise AssertionError("a group alone is never asked for its state")

    def close(self):
        pass


class Nothing(Alone):
    """A mean of zeros: the update must see what the mean gave, not the group's own gradient."""

    def average(self, step, arrays):
        return [np.zeros_like(a) for a in arrays]


Z = lambda level: {"level": level, "threshold_kb": 0}  # noqa: E731
SPLIT = {
    "data=2": jaxpar.ParallelConfig(mesh={"data": 2}),
    "zero3+accum2 data=4": jaxpar.ParallelConfig(mesh={"data": 4}, mode="data", optimizer=Z(3), grad_accum=2),
    "hybrid zero2+fusion data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", optimizer=Z(2),
                                                        comm_fusion={"bucket_mb": 0.01}),
    "megatron data=2,model=2": jaxpar.ParallelConfig(mesh={"data": 2, "model": 2},
                                                     rules={"batch": "data", "heads": "model", "mlp": "model"}),
    "1f1b pipe=2,data=2": jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 2},
                                                rules={"layers": "pipe", "batch": "data"},
                                                pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"}),
}
PIPELINED = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=4, scan_layers=True)


def _train(config, replicas, nonfinite="stop"):
    mesh = mesh_for(config)
    staged = config.pipeline.stages > 1
    model = jaxpar.init(lambda: GPT(PIPELINED if staged else TINY, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), pipeline_loss() if staged else loss_fn, config, mesh,
                             services=jaxpar.Services(nonfinite=nonfinite),
                             placement=jaxpar.Placement(replicas=replicas))
    losses = [float(trainer.step(b)["loss"]) for b in batches(3)]
    return losses, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)), trainer


@pytest.mark.parametrize("name", SPLIT)
def test_two_program_step_equals_the_one_program_step(name):
    """Gradients, the mean, then the update: with a group alone, the one-program step's result."""
    want_losses, want, _ = _train(SPLIT[name], None)
    alone = Alone()
    losses, params, trainer = _train(SPLIT[name], alone, nonfinite="skip")
    assert alone.calls == 3 and trainer.service("replicas") is not None
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_close(params, want, rtol=1e-5, what=name)     # (XLA fuses the two programs otherwise: 1e-6 apart)
    assert trainer.lower(batches(1)[0]).compile().cost_analysis() is not None   # the gradient program
    if name == "data=2":
        losses, params, _ = _train(SPLIT[name], Nothing())
        assert losses == [0.0, 0.0, 0.0]     # the mean's loss is the loss reported
        moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want))]
        assert max(moved) > 1e-4             # zero gradients (adamw's decay alone): not the group's own update


def test_replicas_with_rows_or_without_the_calls_are_refused():
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = mesh_for(config)
    model = GPT(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="replicas= must be a replica group with"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, config, mesh, placement=jaxpar.Placement(replicas=object()))
    rows = type("Rows", (), {"pull": lambda self, batch: None, "push": lambda self, *a: None})()
    with pytest.raises(ValueError, match=r"Placement\(replicas=...\) with rows="):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, config, mesh, placement=jaxpar.Placement(replicas=Alone()),
                       rows=rows)


# ------------------------------------------------------------------ three groups, one killed
def _spawn(address, out, group, *extra):
    env = {**os.environ, "JAXPAR_REPLICAS_TOKEN": TOKEN, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, WORKER, "--group", str(group), "--groups", "3", "--address", address,
                             "--out", str(out), "--steps", "100000", *extra],
                            stdout=open(out / f"worker-{group}.log", "a"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _records(out, group):
    path = out / f"group-{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what, until, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_three_groups_one_killed_the_others_step_on_and_it_heals(tmp_path):
    """Groups 0-2 train (each 2 devices, its own rows); group 1 is SIGKILLed after step 8. Groups 0
    and 2 never stop: every step from 1 on is theirs, and the mean leaves group 1 out after the
    coordinator's 2 s timeout. Group 1, started again, takes group 0's state at the end of a step
    and its parameters equal the others' at every step after. Up to step 5 (every group in the
    mean) the parameters equal one device's on the 12 rows of the three groups."""
    proc, address = _coordinator(tmp_path, "--groups", "3", "--timeout", "2")
    workers = {g: _spawn(address, tmp_path, g, "--pace", "0.05", "--save-at", "5") for g in range(3)}
    try:
        steps = lambda g: [r for r in _records(tmp_path, g) if "time" in r]  # noqa: E731
        _wait("group 1's step 8", lambda: len(steps(1)) >= 8)
        workers[1].kill()
        workers[1].wait(timeout=30)
        killed_at = steps(1)[-1]["step"]
        _wait("the others to step on without group 1", lambda: any(r["groups"] == [0, 2] for r in steps(0)))
        workers[1] = _spawn(address, tmp_path, 1, "--pace", "0.05")
        _wait("group 1 to heal", lambda: any(r.get("healed") for r in _records(tmp_path, 1)))
        healed = next(r for r in _records(tmp_path, 1) if r.get("healed"))
        (tmp_path / "stop").write_text(str(healed["step"] + 4))
        codes = {g: w.wait(timeout=120) for g, w in workers.items()}
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
        proc.terminate()
        proc.wait(timeout=30)
    assert codes == {0: 0, 1: 0, 2: 0}, [(tmp_path / f"worker-{g}.log").read_text()[-2000:] for g in range(3)]
    end = healed["step"] + 4
    for g in (0, 2):    # never stopped: one start, every step once
        records = _records(tmp_path, g)
        assert sum("start" in r for r in records) == 1
        assert [r["step"] for r in records if "time" in r] == list(range(1, end + 1))
    without = [r["step"] for r in steps(0) if r["groups"] == [0, 2]]
    # (a step group 1 averaged but did not log before the kill is the one after killed_at)
    assert without and killed_at + 1 <= min(without) <= killed_at + 2 and max(without) <= healed["step"]
    digests = {g: {r["step"]: r["digest"] for r in steps(g)} for g in range(3)}
    assert healed["digest"] == digests[0][healed["step"]]           # the state it took is group 0's
    for s in range(healed["step"] + 1, end + 1):                    # and it stays equal, step after step
        assert digests[0][s] == digests[1][s] == digests[2][s], s
    assert all(digests[0][s] == digests[1][s] for s in range(1, killed_at + 1))
    # up to step 5 every group was in the mean: one device on the three groups' 12 rows
    want = _one_device(5, 3)
    for g in range(3):
        got = np.load(tmp_path / f"params-{g}-at-5.npz")
        got = [got[f"arr_{i}"] for i in range(len(want))]
        assert_close(got, want, rtol=2e-5, what=f"group {g} at step 5 vs one device")


def _one_device(steps: int, groups: int):
    """The parameters one device trains on the rows of every group, step after step."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    from replica_worker import group_batch, model_config

    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = mesh_for(config)
    model = jaxpar.init(lambda: GPT(model_config(), rngs=nnx.Rngs(0)), config, mesh)
    ref = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    for s in range(1, steps + 1):
        parts = [group_batch(s, g, groups) for g in range(groups)]
        ref.step({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return [np.asarray(x) for x in jax.tree.leaves(ref.state.params)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_groups_of_two_processes_average_rank_by_rank(tmp_path):
    """Two groups, each a jax.distributed job of 2 processes (jaxpar launch, one device each,
    each process its own rows): process p of each group averages with process p of the other,
    and after 3 steps every process holds one device's parameters on the 8 rows."""
    from jaxpar.launch.ports import free_port

    proc, address = _coordinator(tmp_path, "--groups", "2", "--timeout", "10")
    env = {**os.environ, "JAXPAR_REPLICAS_TOKEN": TOKEN, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    launches = []
    try:
        for g in range(2):
            launches.append(subprocess.Popen(
                [sys.executable, "-m", "jaxpar.cli", "launch", "--worker-num", "2", "--local-worker-num", "2",
                 "--simulated-devices", "1", "--master-port", str(free_port()), "--log-dir", str(tmp_path / f"logs{g}"),
                 WORKER, "--launched", "--group", str(g), "--groups", "2", "--address", address, "--out", str(tmp_path),
                 "--steps", "3"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        codes = [p.wait(timeout=180) for p in launches]
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
        proc.terminate()
        proc.wait(timeout=30)
    assert codes == [0, 0], [p.stderr.read()[-2000:] for p in launches]
    want = _one_device(3, 2)
    for name in ("0.0", "0.1", "1.0", "1.1"):
        got = np.load(tmp_path / f"params-{name}.npz")
        assert_close([got[f"arr_{i}"] for i in range(len(want))], want, rtol=2e-5, what=f"group.process {name}")
        assert [r["groups"] for r in _records(tmp_path, name) if "time" in r] == [[0, 1]] * 3
