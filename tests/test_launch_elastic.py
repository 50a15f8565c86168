"""Several nodes' launchers restarting one job together, and going on without a node that is
gone for good (`jaxpar.launch.rendezvous`; `jaxpar launch --worker-restarts K --min-workers N`)."""

import dataclasses
import json
import os
import re
import signal
import socket
import time

import pytest

from jaxpar.launch import LaunchConfig, rendezvous
from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch

TERMS = rendezvous.Terms(worker_num=6, local_worker_num=2, worker_restarts=2, min_workers=4)


class Nodes:
    """A rendezvous server and one client per node, in this process."""

    # rejoin: how long node 0 waits for the nodes after a failure; the tests' own steps between a
    # failure and a rejoin must fit in it on a loaded machine, so it is not made shorter
    def __init__(self, terms=TERMS, rejoin=3.0, first=5.0, **kw):
        self.logs: list[str] = []
        self.port = free_port()
        self.server = rendezvous.Server("127.0.0.1", self.port, terms, first_time_out=first,
                                        rejoin_time_out=rejoin, log=self.logs.append, **kw)
        self.terms = terms

    def client(self, node, terms=None):
        return rendezvous.Client("127.0.0.1", self.port, node, terms or self.terms, time_out=5)

    def started(self, count: int) -> list:
        """Clients of nodes 0..count-1, each past its first start."""
        clients = [self.client(i) for i in range(count)]
        for c in clients:
            _next(c)
        return clients

    def close(self):
        self.server.close(linger=0.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _next(client, timeout=30.0):
    """The next `Start` or `End` node 0 sends ``client``, failing after ``timeout`` s (never a hang)."""
    deadline = time.monotonic() + timeout
    message = client.wait(interrupted=lambda: time.monotonic() > deadline)
    assert message is not None, f"node {client.node}: no start or end came within {timeout:g} s"
    return message


def _logged(nodes, text, timeout=10.0):
    """Waits until node 0's rendezvous has logged a line containing ``text``."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in nodes.logs):
        assert time.monotonic() < deadline, f"never logged {text!r}: {nodes.logs}"
        time.sleep(0.02)


def _stopped(client, timeout=5.0, final=False):
    """The reason of the next stop (``final``: the job's end) node 0 sends ``client``."""
    deadline = time.monotonic() + timeout
    while (stop := client.stopped()) is None:
        assert time.monotonic() < deadline, "no stop came"
        time.sleep(0.02)
    assert stop.final == final, stop
    return stop.reason


def test_a_failure_restarts_every_node_and_a_lost_node_is_left_out_while_enough_remain():
    with Nodes() as nodes:
        c = [nodes.client(i) for i in range(3)]
        first = [_next(x) for x in c]
        assert [(s.generation, s.index, s.worker_num) for s in first] == [(0, 0, 6), (0, 1, 6), (0, 2, 6)]
        # a worker of node 2 fails: every node is stopped and the whole group starts again
        c[2].failed(137, "rank 5 was killed")
        c[2].rejoin()
        for x in c[:2]:
            assert "node 2: rank 5 was killed" in _stopped(x)
            x.rejoin()
        again = [_next(x) for x in c]
        assert [(s.generation, s.index, s.worker_num) for s in again] == [(1, 0, 6), (1, 1, 6), (1, 2, 6)]
        # node 1's launcher is gone (its connection ends): the others go on without it after the
        # rejoin time-out, renumbered: node 2 is now index 1 (ranks 2..3) of 4 workers
        c[1].close()
        for x in (c[0], c[2]):
            assert "node 1's launcher is gone" in _stopped(x)
            x.rejoin()
        t = time.monotonic()
        shrunk = [_next(c[0]), _next(c[2])]
        assert time.monotonic() - t > 2.0                         # it waited for node 1 first
        assert [(s.generation, s.index, s.nodes, s.worker_num) for s in shrunk] == \
            [(2, 0, (0, 2), 4), (2, 1, (0, 2), 4)]
        assert any("did not come back within 3 s (--rejoin-time-out): going on with 4 of 6 workers" in line
                   for line in nodes.logs)
        c[0].done()
        c[2].done()
        for x in (c[0], c[2]):
            assert _stopped(x, final=True) == "all 2 node(s) finished"
            assert _next(x) == rendezvous.End(0, "all 2 node(s) finished")


def test_no_restarts_left_or_too_few_workers_end_the_job_on_every_node():
    with Nodes(rendezvous.Terms(6, 2, 1, 4)) as nodes:
        c = nodes.started(3)
        c[1].close()
        c[2].close()                                   # 2 of 6 workers would remain, fewer than 4
        assert "gone" in _stopped(c[0])
        c[0].rejoin()
        end = _next(c[0])
        assert end.code == 1 and "only 2 worker(s) came back within 3 s" in end.reason
        assert "fewer than --min-workers 4" in end.reason
    with Nodes(rendezvous.Terms(4, 2, 1, 4)) as nodes:
        c = nodes.started(2)
        c[0].failed(3, "one")
        c[0].rejoin()
        assert "one" in _stopped(c[1])
        c[1].rejoin()
        [_next(x) for x in c]
        c[1].failed(7, "two")
        assert "two" in _stopped(c[0], final=True)
        end = _next(c[0])
        assert end.code == 7 and "no restarts left (1, --worker-restarts)" in end.reason
    # a failure a restart cannot get past (a worker that never joined) ends the job at once
    with Nodes(rendezvous.Terms(4, 2, 3, 4)) as nodes:
        c = nodes.started(2)
        c[1].failed(124, "rank 3 never joined", final=True)
        assert "rank 3 never joined" in _stopped(c[0], final=True)
        assert _next(c[0]) == rendezvous.End(124, "node 1: rank 3 never joined")


def test_an_interrupt_a_late_finisher_a_silent_node_and_a_second_launcher_of_one_node():
    # a signal to any node's launcher ends the job on every node (its workers get SIGTERM first)
    with Nodes(rendezvous.Terms(4, 2, 3, 2)) as nodes:
        c = nodes.started(2)
        c[1].interrupted(143, "its launcher received SIGTERM")
        assert _stopped(c[0], final=True) == "node 1: its launcher received SIGTERM"
        assert _next(c[0]).code == 143
    # a node done while another runs on past --exit-time-out: the job ends with 1, naming both
    with Nodes(rendezvous.Terms(4, 2, 3, 2), exit_time_out=0.5) as nodes:
        c = nodes.started(2)
        c[0].done()
        end = _stopped(c[1], final=True)
        assert "node(s) [0] finished, but node(s) [1] still ran 0.5 s later (--exit-time-out)" in end
    # a node that sends nothing (its host is down) is lost after the heartbeat time-out; a node that
    # comes back after the group went on without it joins the next group
    with Nodes(rendezvous.Terms(4, 2, 5, 2), heartbeat_time_out=3.0) as nodes:
        c0 = nodes.client(0)
        silent = socket.create_connection(("127.0.0.1", nodes.port))
        silent.sendall((json.dumps({"op": "join", "node": 1, "terms": dataclasses.asdict(nodes.terms)}) + "\n").encode())
        assert _next(c0).worker_num == 4
        assert "node 1's launcher is gone (it sent nothing for 3 s)" in _stopped(c0, timeout=10)
        c0.rejoin()
        assert _next(c0) == rendezvous.Start(1, 0, (0,), 2)
        back = nodes.client(1)                           # the host is back: it waits for the next group
        _logged(nodes, "node 1 joined while generation 1 runs without it; it joins the group at the next restart")
        c0.failed(1, "rank 0 crashed")
        c0.rejoin()
        assert [_next(c0), _next(back)] == [rendezvous.Start(2, 0, (0, 1), 4), rendezvous.Start(2, 1, (0, 1), 4)]
        # a node that comes back while the others gather for a restart joins that very group
        back.close()
        assert "node 1's launcher is gone" in _stopped(c0)
        c0.rejoin()
        assert _next(c0) == rendezvous.Start(3, 0, (0,), 2)
        c0.failed(1, "rank 1 crashed")
        assert "rank 1 crashed" in _stopped(c0)
        back = nodes.client(1)
        _logged(nodes, "node 1 is back; it joins generation 4")
        c0.rejoin()
        assert [_next(c0), _next(back)] == [rendezvous.Start(4, 0, (0, 1), 4), rendezvous.Start(4, 1, (0, 1), 4)]
        # a second launcher as node 1 (restarted, or --node-rank given twice) replaces the first,
        # which is told so; the running group is stopped
        again = nodes.client(1)
        with pytest.raises(rendezvous.RendezvousError, match="another launcher joined as node 1"):
            _next(back)
        assert "node 1's launcher started again" in _stopped(c0)
        c0.rejoin()
        assert _next(again).generation == 5
        silent.close()


def test_a_silent_node_0_and_an_unreachable_one_end_a_launcher():
    with socket.socket() as mute:                        # accepts and never answers, never beats
        mute.bind(("127.0.0.1", 0))
        mute.listen(1)
        client = rendezvous.Client("127.0.0.1", mute.getsockname()[1], 1, TERMS, time_out=5, heartbeat_time_out=0.5)
        with pytest.raises(rendezvous.RendezvousError, match="node 0's launcher is gone"):
            _next(client)
        client.close()
    with pytest.raises(rendezvous.RendezvousError, match=r"could not be reached within 0\.5 s"):
        rendezvous.Client("127.0.0.1", free_port(), 1, TERMS, time_out=0.5)
    with pytest.raises(rendezvous.RendezvousError, match="interrupted while reaching node 0's launcher"):
        rendezvous.Client("127.0.0.1", free_port(), 1, TERMS, time_out=30, interrupted=lambda: True)


def test_a_node_that_never_joins_ends_the_first_group_with_124():
    with Nodes(rendezvous.Terms(4, 2, 1, 2), first=0.5) as nodes:
        end = _next(nodes.client(0))
        assert end.code == 124 and "node(s) [1] never joined within 0.5 s (--cluster-time-out)" in end.reason


def test_a_launcher_with_other_flags_ends_the_job_at_once_before_the_first_group():
    """Node 1's launcher started with another --worker-num was refused, and told so at once, but node 0
    waited the whole --cluster-time-out for it and then said it "never joined" (status 124)."""
    with Nodes(rendezvous.Terms(4, 2, 1, 4), first=60.0) as nodes:
        c0, t = nodes.client(0), time.monotonic()
        why = ("node 1 was started with --worker-num 6 (node 0: 4); give every node's launcher the same "
               "--worker-num, --local-worker-num, --worker-restarts and --min-workers")
        with pytest.raises(rendezvous.Refused, match=re.escape(f"node 0 refused this node: {why}")):
            _next(nodes.client(1, rendezvous.Terms(6, 2, 1, 6)))
        assert _next(c0) == rendezvous.End(rendezvous.REFUSED_EXIT_CODE, f"node 0 refused node 1: {why}")
        assert time.monotonic() - t < 30 and rendezvous.REFUSED_EXIT_CODE == 2
    # once the job runs, such a launcher is refused and the job goes on without it
    with Nodes(rendezvous.Terms(4, 2, 1, 2)) as nodes:
        c = nodes.started(2)
        with pytest.raises(rendezvous.Refused, match=r"node 1 was started with --worker-restarts 3 \(node 0: 1\), "
                                                     r"--min-workers 4 \(node 0: 2\); give"):
            _next(nodes.client(1, rendezvous.Terms(4, 2, 3, 4)))
        _logged(nodes, "rendezvous: refused a launcher: node 1 was started with --worker-restarts 3")
        assert c[0].stopped() is None and c[1].stopped() is None
        for x in c:
            x.done()
        assert [_next(x) for x in c] == [rendezvous.End(0, "all 2 node(s) finished")] * 2


def _mismatched_launchers(launches: list, tmp_path, tag, flags, worker_args=()) -> None:
    """Append to ``launches`` node 0's launcher (--worker-num 2) and node 1's (--worker-num 3), one
    rank each on localhost, with ``flags`` besides."""
    port = free_port()
    for node, total in ((0, 2), (1, 3)):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        launches.append(Launch(folder, tag, ["--worker-num", total, "--local-worker-num", 1, "--node-rank", node,
                                             "--simulated-devices", 1, "--master-port", port, *flags], worker_args))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_launchers_with_other_worker_nums_both_end_at_once_with_status_2(tmp_path, tag):
    """The reviewer's case, with real launchers: node 0 (--worker-num 2) and node 1 (--worker-num 3), both
    with --worker-restarts 1. Node 0 used to wait --cluster-time-out (here 120 s) for node 1; now both
    end before any worker starts, node 0 naming node 1 and the flag."""
    launches = []
    try:
        _mismatched_launchers(launches, tmp_path, tag, ["--worker-restarts", 1, "--rendezvous-port", free_port(),
                                                        "--cluster-time-out", 120])
        codes = [launch.wait(timeout=90) for launch in launches]
        node0, node1 = launches
        assert codes == [2, 2], (node0.stderr, node1.stderr)
        why = "node 1 was started with --worker-num 3 (node 0: 2); give every node's launcher the same --worker-num"
        assert f"the job ended with status 2: node 0 refused node 1: {why}" in node0.stderr, node0.stderr
        assert f"error: node 0 refused this node: {why}" in node1.stderr, node1.stderr
        assert "never joined" not in node0.stderr and "started rank" not in node0.stderr + node1.stderr
    finally:
        for launch in launches:
            launch.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_without_restarts_a_rank_started_for_another_job_size_leaves_naming_both(tmp_path, tag):
    """Without --worker-restarts the launchers never meet: node 1 (--worker-num 3) started its rank,
    which joined node 0's coordinator of 2 processes, and the two trained as a job of 2 while
    the rank believed in 3. Now the rank sees the job the coordinator formed and leaves at once,
    with status 2 and both sizes (`jaxpar.distributed.initialize`)."""
    launches = []
    try:
        _mismatched_launchers(launches, tmp_path, tag, ["--cluster-time-out", 60], ["--steps", 3])
        node1 = launches[1]
        assert node1.wait(timeout=90) == 2, node1.stderr
        assert ("process 1 was started for a job of 3 processes (--worker-num / JAXPAR_NUM_PROCESSES), but the "
                "coordinator at") in node1.stderr and "formed a job of 2" in node1.stderr, node1.stderr
        assert "Traceback" not in node1.stderr
    finally:
        for launch in launches:
            launch.close()


def test_the_rendezvous_refuses_other_terms_and_survives_any_frame():
    with Nodes(rendezvous.Terms(4, 2, 1, 2)) as nodes:
        with pytest.raises(rendezvous.RendezvousError, match=r"node rank 5 is not in 0\.\.1"):
            _next(nodes.client(5))
        for frame in (b"\xff\xfe\n", b"[1, 2]\n", b'{"op": "fly"}\n', b'{"op": "done"}\n', b"x" * 70000,
                      b'{"op": "join", "node": "0", "terms": 1}\n'):
            with socket.create_connection(("127.0.0.1", nodes.port)) as raw:
                raw.sendall(frame)
                raw.settimeout(5)
                try:
                    raw.recv(4096)                           # a refusal, or the end of the connection
                except OSError:
                    pass
        c = [nodes.client(i) for i in range(2)]
        assert [_next(x).worker_num for x in c] == [4, 4]
        assert any("bad frame" in line for line in nodes.logs)


@pytest.mark.parametrize("kw, words", [
    (dict(worker_num=4, local_worker_num=4, worker_restarts=1, min_workers=2),
     "min_workers=2 on a one-node job"),
    (dict(worker_num=4, local_worker_num=2, min_workers=2), "min_workers=2 with worker_restarts=0"),
    (dict(worker_num=6, local_worker_num=2, worker_restarts=1, min_workers=3),
     "min_workers=3 is not a multiple of local_worker_num=2: a group loses whole nodes; use --min-workers 2 or 4"),
    (dict(worker_num=4, local_worker_num=2, worker_restarts=1, min_workers=5), r"must be a whole number in 1\.\.4"),
    (dict(worker_num=4, local_worker_num=2, worker_restarts=1, rendezvous_port=8118),
     "not --master-port 8118"),
    (dict(worker_num=4, local_worker_num=2, rejoin_time_out=0), r"rejoin_time_out=0 must be a positive"),
])
def test_bad_elastic_settings_are_refused_by_name(kw, words):
    with pytest.raises(ValueError, match=words):
        LaunchConfig(**kw)
    # several nodes with restarts are no longer refused
    assert LaunchConfig(worker_num=4, local_worker_num=2, worker_restarts=1, min_workers=2).elastic


JOB = """
model: {{name: llama, size: tiny}}
data: {{path: {store}, seq_len: 16, batch: 16, seed: 3}}
optimizer: {{lr: 1.0e-2, warmup_steps: 1, schedule: constant}}
parallel: {{mesh: {{data: -1}}}}
train: {{steps: {steps}}}
checkpoint: {{every: 2}}
logging: {{every: 1}}
"""
STEPS = 12


def _saved(ckpt) -> int:
    return max((int(n) for n in os.listdir(ckpt) if n.isdigit()), default=0) if os.path.isdir(ckpt) else 0


def _wait_saved(ckpt, step, launches, timeout=240.0):
    deadline = time.monotonic() + timeout
    while _saved(ckpt) < step:
        for launch in launches:
            assert launch.process.poll() is None, launch.stderr
        assert time.monotonic() < deadline, f"step {step} was never saved"
        time.sleep(0.2)


def _losses(log_dir) -> dict:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "eval_loss" not in r}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_two_nodes_restart_together_then_go_on_without_a_lost_node(tmp_path, tag):
    """Two simulated nodes (one ``jaxpar launch`` each, 2 processes x 2 CPU devices) train a job
    whose data axis takes every device (``mesh: {data: -1}``). A worker of node 1 is SIGKILLed:
    both nodes restart the 4-process group, which resumes from its checkpoint. Then node 1's
    launcher is SIGKILLed (its host is gone): node 0 waits ``--rejoin-time-out`` s, goes on with
    its 2 processes (``--min-workers 2``) on 4 devices, resumes the same global batches and ends
    with every loss of an uninterrupted one-process run."""
    from jaxpar.cli import main
    from jaxpar.data import prepare
    from jaxpar.models.data import arithmetic_text

    (tmp_path / "corpus.txt").write_text(arithmetic_text(2000, seed=1))
    prepare([str(tmp_path / "corpus.txt")], str(tmp_path / "store"), docs="line", progress=False)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(store=tmp_path / "store", steps=STEPS))
    whole = tmp_path / "whole"
    assert main(["train", "--config", str(job), "--checkpoint.dir", str(whole / "ckpt"), "--logging.dir",
                 str(whole / "log"), "--quiet"]) == 0
    expected = _losses(whole / "log")

    ckpt, log = tmp_path / "run" / "ckpt", tmp_path / "run" / "log"
    ports = ["--master-port", free_port(), "--rendezvous-port", free_port()]
    launches = []
    try:
        for node in (0, 1):
            folder = tmp_path / f"node{node}"
            folder.mkdir()
            launches.append(Launch(folder, tag, ["--worker-num", 4, "--local-worker-num", 2, "--node-rank", node,
                                                 "--simulated-devices", 2, *ports, "--cluster-time-out", 60,
                                                 "--worker-restarts", 2, "--min-workers", 2,
                                                 "--rejoin-time-out", 3],
                                   ["--config", job, "--checkpoint.dir", ckpt, "--logging.dir", log, "--quiet"],
                                   script=os.path.join(WORKERS, "job_worker.py"), entry=("-m", "jaxpar.cli", "launch")))
        node0, node1 = launches
        _wait_saved(ckpt, 2, launches)
        pid = int(re.findall(r"started rank 3 \(pid (\d+)\)", (node1.log_dir / "launcher_1.log").read_text())[-1])
        os.kill(pid, signal.SIGKILL)                              # a worker of node 1 dies
        restarted = _saved(ckpt)
        _wait_saved(ckpt, restarted + 2, launches)                # the 4-process group trains again
        os.kill(node1.process.pid, signal.SIGKILL)                # node 1 is gone, its workers with it
        assert node0.wait(timeout=300) == 0, node0.stderr
        text = (node0.log_dir / "launcher_0.log").read_text()
        assert "restart 1 of 2" in text and "restart 2 of 2" in text, text
        assert "node(s) [1] did not come back within 3 s (--rejoin-time-out): going on with 2 of 4 workers" in text
        assert "ranks 0..1 of 2" in text and "all 1 node(s) finished" in text
    finally:
        for launch in launches:
            launch.close()
    resumed = _losses(log)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), step
