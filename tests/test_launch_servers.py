"""`jaxpar launch --servers N`: servers start and serve before the workers, workers learn
where they are, a dead server is restarted with the same arguments (and fails the job past
``--server-restarts``), and the servers stop whenever the job ends.

The servers are a test double (tests/workers/fake_ps_server.py, picked with
``--server-module``) that keeps the server contract without holding rows.
"""

import glob
import json
import os
import re
import signal
import time

import pytest
import yaml

from jaxpar.cli import main
from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]
FAKE_SERVER = "tests.workers.fake_ps_server"
ENV_WORKER = os.path.join(WORKERS, "ps_env_worker.py")


def start(tmp_path, tag, *flags, worker_args=()):
    # The tag in the checkpoint folder marks the servers' command lines too (the tag fixture
    # then checks that none outlives the test).
    ckpt = tmp_path / tag
    args = ["--worker-num", 2, "--local-worker-num", 2, "--master-port", free_port(),
            "--servers", 2, "--server-module", FAKE_SERVER, "--server-checkpoint-dir", ckpt,
            "--kill-time-out", 5, *flags]
    return Launch(tmp_path, tag, args, worker_args, script=ENV_WORKER), ckpt


def wait_for(predicate, what: str, run: Launch, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or run.process.poll() is not None:
            raise AssertionError(f"never saw {what}; launcher:\n{run.stderr}")
        time.sleep(0.05)


def server_pid(run: Launch, index: int) -> int:
    """The pid of server ``index``'s first run."""
    return int(re.search(rf"started server {index} \(pid (\d+)\)", run.stderr).group(1))


def starts(ckpt, index: int) -> list[dict]:
    return [json.loads(open(p).read()) for p in sorted(glob.glob(str(ckpt / f"start_{index}_*.json")),
                                                       key=os.path.getmtime)]


def test_servers_serve_the_workers_and_restart(tmp_path, tag):
    run, ckpt = start(tmp_path, tag, "--server-restarts", 1)
    try:
        wait_for(lambda: len(run.results()) == 2, "both workers' reports", run)
        os.kill(server_pid(run, 1), signal.SIGKILL)
        wait_for(lambda: "server 1 ready again" in run.stderr, "server 1 restarted", run)
        (tmp_path / "out" / "stop").write_text("")
        assert run.wait(timeout=30) == 0, run.stderr
    finally:
        run.close()
    first, second = starts(ckpt, 1)
    assert first["argv"] == second["argv"], "a restart keeps the port and the arguments"
    assert "restart 1 of 1 with the same arguments" in run.stderr
    reports = run.results()
    token = reports[0]["token"]
    assert len(token) == 32 and all(r["token"] == token for r in reports)
    addresses = reports[0]["addresses"]
    assert len(set(addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    for r in reports:
        assert r["addresses"] == r["reached"] == addresses  # every server served before any worker
    for i, address in enumerate(addresses):
        (record,) = starts(ckpt, 0) if i == 0 else [first]
        argv = record["argv"]
        assert argv[argv.index("--bind") + 1] == address and argv[argv.index("--index") + 1] == str(i)
        assert token not in " ".join(argv), "the token travels in the environment only"
        assert record["env"]["JAXPAR_PS_TOKEN"] == token and record["env"]["JAX_PLATFORMS"] == "cpu"
        assert record["env"]["JAXPAR_COORDINATOR_ADDRESS"] is None  # never joins jax.distributed
        assert (ckpt / f"final_{i}.json").exists(), "SIGTERM gave each server its final checkpoint"
        assert "jaxpar-ps-server ready" in (run.log_dir / f"server_{i}.log").read_text()


@pytest.mark.parametrize("end", ["ctrl_c", "worker_fails", "server_dies"])
def test_servers_stop_whenever_the_job_ends(tmp_path, tag, end):
    flags = ["--server-restarts", 0] if end == "server_dies" else []
    run, ckpt = start(tmp_path, tag, *flags, worker_args=["--fail"] if end == "worker_fails" else [])
    try:
        wait_for(lambda: len(run.results()) == 2 or end == "worker_fails" and run.results(),
                 "the workers' reports", run)
        if end == "ctrl_c":
            os.killpg(run.process.pid, signal.SIGINT)
        elif end == "server_dies":
            os.kill(server_pid(run, 0), signal.SIGKILL)
        code = run.wait(timeout=30)
    finally:
        run.close()
    expected = {"ctrl_c": 128 + signal.SIGINT, "worker_fails": 3, "server_dies": 1}[end]
    assert code == expected, run.stderr
    assert "stopped the servers" in run.stderr
    stopped = [i for i in range(2) if (ckpt / f"final_{i}.json").exists()]
    assert stopped == ([1] if end == "server_dies" else [0, 1])
    if end == "server_dies":
        assert "server 0 (pid" in run.stderr and "was killed by signal 9" in run.stderr
        assert "the most --server-restarts allows (0)" in run.stderr
        assert str(run.log_dir / "server_0.log") in run.stderr


def test_a_server_that_never_says_ready_stops_the_start(tmp_path, tag, monkeypatch):
    monkeypatch.setenv("FAKE_PS_SILENT", "1")
    run, _ = start(tmp_path, tag, "--server-time-out", 1)
    try:
        assert run.wait(timeout=30) == 1
    finally:
        run.close()
    err = run.stderr
    assert "server 1 (pid" in err and "within 1 s (--server-time-out)" in err, err
    assert str(run.log_dir / "server_1.log") in err
    assert "started rank" not in err, "no worker starts before every server serves"


@pytest.mark.parametrize("argv, words", [
    (["--servers", "0"], "servers=0 must be a positive int (--servers)"),
    (["--servers", "-2"], "servers=-2 must be a positive int (--servers)"),
    (["--servers", "2", "--server-restarts", "-1"], "server_restarts=-1 must be a whole number >= 0"),
    (["--servers", "2", "--worker-num", "4", "--local-worker-num", "2"], "needs --server-port P"),
    (["--servers", "2", "--server-port", "8117"], "include --master-port 8118"),
    # nan was accepted, and a server that never got ready kept the launcher waiting forever (t > nan is False)
    (["--servers", "2", "--server-time-out", "nan"], "server_time_out=nan must be a positive, finite number"),
])
def test_bad_server_flags_exit_2_with_one_line(capsys, argv, words):
    code = main(["launch", *argv, "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert err.startswith("jaxpar launch: error: ") and len(err.strip().splitlines()) == 1


def test_k8s_server_and_worker_roles(capsys):
    code = main(["k8s", "--workers", "2", "--image", "img", "--name", "ctr", "--servers", "2",
                 "--server-storage", "5Gi", "--", "python", "train.py"])
    assert code == 0
    svc, sts, _, job = yaml.safe_load_all(capsys.readouterr().out)
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 2
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == "ctr-ps"
    assert sts["spec"]["template"]["metadata"]["labels"] == svc["spec"]["selector"]
    server = sts["spec"]["template"]["spec"]["containers"][0]
    command = server["command"]
    assert command[:3] == ["python", "-m", "jaxpar.ps.server"]
    assert command[command.index("--count") + 1] == "2"
    assert command[command.index("--bind") + 1] == "0.0.0.0:8500"
    server_env = {e["name"]: e for e in server["env"]}
    index_var = command[command.index("--index") + 1]
    assert index_var == "$(JAXPAR_PS_INDEX)"
    assert "pod-index" in server_env["JAXPAR_PS_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert server["volumeMounts"][0]["name"] == claim["metadata"]["name"]
    worker = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    # StatefulSet pod i is <set>-<i>, resolvable as <pod>.<serviceName>.
    assert worker["JAXPAR_PS_ADDRESSES"]["value"] == "ctr-ps-0.ctr-ps:8500,ctr-ps-1.ctr-ps:8500"
    for env in (worker, server_env):
        token = env["JAXPAR_PS_TOKEN"]
        assert "value" not in token  # the token never appears in the manifest
        assert token["valueFrom"]["secretKeyRef"] == {"name": "ctr-ps-token", "key": "token"}


@pytest.mark.parametrize("argv, words", [
    (["--servers", "0"], "servers=0 must be a positive int (--servers)"),
    (["--servers", "1", "--server-port", "8476"], "differ from the coordinator port 8476"),
    (["--servers", "1", "--env", "JAXPAR_PS_TOKEN=abc"], "jaxpar k8s sets JAXPAR_PS_TOKEN itself"),
])
def test_k8s_bad_server_flags(capsys, argv, words):
    code = main(["k8s", "--workers", "2", "--image", "img", *argv, "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_other_nodes_wait_until_they_reach_the_servers():
    """Node 1 starts its workers only once node 0's servers accept connections."""
    import socket

    from jaxpar.launch.servers import ServerError, wait_reachable

    with socket.create_server(("127.0.0.1", 0)) as listening:
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        assert wait_reachable([up], 2, lambda: False)
    down = up  # closed now: nothing listens there
    began = time.monotonic()
    with pytest.raises(ServerError, match=rf"parameter server {down} did not accept a connection "
                                          r"within 0.3 s \(--server-time-out\)"):
        wait_reachable([down], 0.3, lambda: False)
    assert time.monotonic() - began < 3
    assert wait_reachable([down], 30, lambda: True) is False  # a signal cuts the wait short


def consecutive_free_ports(n: int) -> int:
    import socket

    for _ in range(50):
        first = free_port()
        try:
            held = [socket.create_server(("127.0.0.1", first + i)) for i in range(n)]
        except OSError:
            continue
        for sock in held:
            sock.close()
        return first
    raise AssertionError(f"no {n} consecutive free ports")


def test_two_nodes_share_the_servers_of_node_0(tmp_path, tag, monkeypatch):
    monkeypatch.setenv("JAXPAR_PS_TOKEN", "job-token-from-the-user")
    port, master = consecutive_free_ports(2), free_port()
    runs = []
    try:
        for node in (1, 0):  # node 1 first: its workers must wait for node 0's servers
            (tmp_path / f"node{node}").mkdir()
            args = ["--worker-num", 4, "--local-worker-num", 2, "--node-rank", node,
                    "--master-port", master, "--servers", 2, "--server-port", port,
                    "--server-module", FAKE_SERVER, "--server-checkpoint-dir", tmp_path / tag]
            runs.append(Launch(tmp_path / f"node{node}", tag, args, script=ENV_WORKER))
        for run in runs:
            wait_for(lambda: len(run.results()) == 2, "the node's two workers", run)
            (run.out_dir / "stop").write_text("")
        assert [run.wait(timeout=30) for run in runs] == [0, 0]
    finally:
        for run in runs:
            run.close()
    node1, node0 = runs
    assert "started server" not in node1.stderr and "started server 1" in node0.stderr
    expected = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    for run in runs:
        for r in run.results():
            assert r["addresses"] == r["reached"] == expected
            assert r["token"] == "job-token-from-the-user"


def test_docstring_examples_run():
    import doctest

    from jaxpar.launch import servers

    assert doctest.testmod(servers).failed == 0


@pytest.mark.parametrize("command, flag", [("launch", "--server-port"), ("k8s", "--server-storage")])
def test_server_flags_without_servers_are_refused(capsys, command, flag):
    base = (["launch", "--worker-num", "2", "--local-worker-num", "2", flag, "9100", "t.py"]
            if command == "launch" else
            ["k8s", "--workers", "2", "--image", "img", flag, "5Gi", "--", "python", "t.py"])
    assert main(base) == 2
    err = capsys.readouterr().err
    assert f"({flag}) has no effect without servers; add --servers N, or drop it." in err, err
