"""`jaxpar launch` options: parsing, msrun spellings, validation, and `python -m jaxpar.launch`."""

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from jaxpar.launch import LaunchConfig
from jaxpar.cli.launch import add_k8s_parser, add_launch_parser, launch_config
from jaxpar.launch.launcher import RUNNER, worker_command, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
    parser = argparse.ArgumentParser(prog="jaxpar")
    sub = parser.add_subparsers()
    add_launch_parser(sub)
    add_k8s_parser(sub)
    return parser.parse_args(argv)


def test_options_and_script_args():
    args = parse(["launch", "--worker-num", "4", "--local-worker-num", "2", "--master-addr",
                  "10.0.0.1", "--master-port", "9000", "--node-rank", "1", "--log-dir", "L",
                  "--join", "--cluster-time-out", "30", "--simulated-devices", "2",
                  "train.py", "--steps", "5", "--join"])
    config = launch_config(args)
    assert config == LaunchConfig(worker_num=4, local_worker_num=2, master_addr="10.0.0.1",
                                  master_port=9000, node_rank=1, log_dir="L", join=True,
                                  cluster_time_out=30.0, simulated_devices=2)
    assert args.script == "train.py" and args.script_args == ["--steps", "5", "--join"]
    assert list(config.ranks) == [2, 3]
    assert callable(args.func)


def test_msrun_spellings():
    args = parse(["launch", "--worker_num", "2", "--local_worker_num", "2", "--master_port",
                  "1234", "--cluster_time_out", "5", "t.py"])
    assert (args.worker_num, args.local_worker_num, args.master_port) == (2, 2, 1234)


@pytest.mark.parametrize("kw, words", [
    ({"worker_num": 0}, "worker_num=0"),
    ({"worker_num": 4, "local_worker_num": 2, "node_rank": 2}, "--worker-num >= 6"),
    ({"master_port": 70000}, "master_port=70000"),
    ({"cluster_time_out": -1.0}, "cluster_time_out=-1.0"),
    # each worker got the simulated CPU devices, and --devices-per-worker (accelerators) said nothing
    ({"simulated_devices": 2, "devices_per_worker": 4}, "simulated_devices=2 with devices_per_worker=4"),
])
def test_bad_configs(kw, words):
    with pytest.raises(ValueError) as err:
        LaunchConfig(**kw)
    assert words in str(err.value)


def test_worker_env():
    config = LaunchConfig(worker_num=4, local_worker_num=2, node_rank=1, master_port=9000,
                          simulated_devices=2, cluster_time_out=7)
    env = worker_env(config, 3, "/run", {"SLURM_PROCID": "1", "KEEP": "x"})
    assert env["JAXPAR_COORDINATOR_ADDRESS"] == "127.0.0.1:9000"
    assert (env["JAXPAR_NUM_PROCESSES"], env["JAXPAR_PROCESS_ID"]) == ("4", "3")
    assert env["JAXPAR_LOCAL_PROCESS_ID"] == "1" and "JAXPAR_LOCAL_DEVICE_IDS" not in env
    assert env["JAXPAR_SIMULATED_DEVICES"] == "2" and env["JAXPAR_CLUSTER_TIMEOUT"] == "7"
    assert env["JAXPAR_CLUSTER_SOURCE"] == "env" and env["KEEP"] == "x"
    config = LaunchConfig(worker_num=4, local_worker_num=2, node_rank=1, devices_per_worker=2)
    env = worker_env(config, 3, "/run", {})
    assert env["JAXPAR_LOCAL_DEVICE_IDS"] == "2,3" and "JAXPAR_SIMULATED_DEVICES" not in env


def test_worker_command():
    # Python scripts run under the runner, which records how they end.
    assert worker_command("t.py", ["-x"]) == [sys.executable, "-u", RUNNER, "t.py", "-x"]
    assert RUNNER == os.path.join(ROOT, "jaxpar", "launch", "runner.py")
    assert worker_command("/bin/true", ["-x"]) == ["/bin/true", "-x"]


def test_bind_address_and_exit_time_out():
    args = parse(["launch", "--master-addr", "10.0.0.1", "--bind-address", "10.0.0.1",
                  "--exit-time-out", "4", "t.py"])
    config = launch_config(args)
    assert (config.bind_address, config.exit_time_out) == ("10.0.0.1", 4.0)
    env = worker_env(config, 0, "/run", {})
    assert env["JAXPAR_COORDINATOR_BIND_ADDRESS"] == "10.0.0.1"
    # No flag: no variable, and jaxpar.distributed binds the coordinator's own address.
    assert "JAXPAR_COORDINATOR_BIND_ADDRESS" not in worker_env(LaunchConfig(), 0, "/run", {})


@pytest.mark.parametrize("argv, words", [
    (["--bind-address", "a:b"], "--bind-address 'a:b' must be an address of this host"),
    (["--exit-time-out", "0"], "exit_time_out=0.0 must be a positive, finite number of seconds (--exit-time-out)"),
    # each of these was accepted: nan and inf as time-outs (a job that may wait forever), an empty
    # --master-addr (every worker died of a traceback), a --bind-address that is not this host's
    # (rank 0 died of SIGSEGV in JAX's coordinator), an unusable --log-dir (a launcher traceback)
    (["--cluster-time-out", "nan"], "cluster_time_out=nan must be a positive, finite number of seconds"),
    (["--cluster-time-out", "inf"], "cluster_time_out=inf must be a positive, finite number of seconds"),
    (["--master-addr", ""], "master_addr='' must be the host name or IP of rank 0's node"),
    (["--master-addr", "[::1]"], "(IPv6 without brackets) (--master-addr)"),
    (["--bind-address", "192.0.2.7"], "--bind-address '192.0.2.7:8118': 192.0.2.7 is not an address of this host"),
    (["--bind-address", "no-such-host.invalid"], "no-such-host.invalid does not resolve"),
    # node 0 runs rank 0: an address of another host left every other process waiting the whole
    # cluster time-out for a coordinator there (which listened on every interface of this host)
    (["--master-addr", "192.0.2.7"], "--master-addr '192.0.2.7': 192.0.2.7 is not an address of this host, but "
                                     "this node (--node-rank 0) runs rank 0"),
    (["--master-addr", "no-such-host.invalid"], "no-such-host.invalid does not resolve to an address"),
    (["--log-dir", "/proc/no/such"], "--log-dir '/proc/no/such' cannot be created"),
    (["--log-dir", __file__], "is a file, not a folder"),
    (["--devices-per-worker", "4", "--simulated-devices", "2"],
     "--simulated-devices 2 gives each worker 2 CPU devices, --devices-per-worker 4 picks accelerators i*4..i*4+3 "
     "for worker i; a worker runs on one or the other. On a CPU machine drop --devices-per-worker; on an "
     "accelerator node drop --simulated-devices."),
])
def test_bad_launch_flags_exit_2(tmp_path, argv, words):
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.launch", "--log-dir", str(tmp_path), *argv, __file__],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_shell_scripts_run_as_named(tmp_path):
    """An executable `train.sh` given without ./ was looked up on PATH (a launcher FileNotFoundError
    traceback); a #!/bin/bash script without +x ran under Python (a SyntaxError in every worker); a #! line
    naming no interpreter was a launcher traceback."""
    def launch(script, mode):
        path = tmp_path / script
        path.write_text({"ok.sh": "#!/bin/sh\necho hi\n", "plain.sh": "#!/bin/bash\necho hi\n",
                         "bad.sh": "#!/no/such/interpreter\n"}[script])
        path.chmod(mode)
        return subprocess.run([sys.executable, "-m", "jaxpar.launch", "--worker-num", "1", "--local-worker-num",
                               "1", "--log-dir", "logs", script], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": ROOT})

    result = launch("ok.sh", 0o755)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "logs" / "worker_0.log").read_text() == "hi\n"
    result = launch("plain.sh", 0o644)
    assert result.returncode == 2 and "script 'plain.sh' starts with '#!/bin/bash' but is not executable" in \
        result.stderr and "chmod +x plain.sh" in result.stderr, result.stderr
    result = launch("bad.sh", 0o755)
    assert result.returncode == 1 and "error: rank 0 could not start './bad.sh'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_bad_option_exits_2_with_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.launch", "--worker-num", "2", "--local-worker-num", "3",
         "--log-dir", str(tmp_path), "t.py"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 2
    assert "local_worker_num=3" in result.stderr


def test_module_entry_is_jaxpar_launch():
    """`python -m jaxpar.launch --help` prints the parser `jaxpar launch` registers."""
    result = subprocess.run([sys.executable, "-m", "jaxpar.launch", "--help"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0
    assert result.stdout.startswith("usage: jaxpar launch")
    for flag in ("--worker-num", "--local-worker-num", "--master-addr", "--master-port",
                 "--node-rank", "--log-dir", "--join", "--cluster-time-out",
                 "--simulated-devices", "--bind-address", "--exit-time-out"):
        assert flag in result.stdout


def help_flags(code: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"--[a-z][-a-z_]*", result.stdout))


def test_jaxpar_command_wires_launch():
    """`jaxpar launch` (the main command) takes exactly the flags of `python -m jaxpar.launch`."""
    ours = help_flags("import runpy, sys; sys.argv = ['jaxpar.launch', '--help']; "
                      "runpy.run_module('jaxpar.launch', run_name='__main__')")
    theirs = help_flags("import sys; from jaxpar.cli import main; main(['launch', '--help'])")
    assert ours == theirs and "--worker-num" in ours


def test_a_directory_as_the_script_is_refused_naming_its_scripts(tmp_path):
    from jaxpar.cli.launch import check_script

    (tmp_path / "train.py").write_text("")
    with pytest.raises(ValueError, match=re.escape(f"script '{tmp_path}' is a directory (it holds train.py); give the "
                                                   f"Python script (or executable) each worker runs, e.g. jaxpar launch "
                                                   f"... {tmp_path / 'train.py'}")):
        check_script(str(tmp_path))
    check_script(str(tmp_path / "train.py"))          # a file passes; a missing one is the worker's to report


def test_a_failure_report_quotes_this_run_not_an_earlier_one_in_the_same_log_folder(tmp_path):
    """Worker logs are appended to (a restarted rank keeps its first attempt's output above): the
    tail the launcher quotes when a rank fails starts where this process's output does. It had
    quoted an earlier job's SyntaxError for a rank that exited with code 3 and printed nothing."""
    import threading

    from jaxpar.launch.worker import Worker

    def run(code):
        worker = Worker(rank=1, command=[sys.executable, "-c", code], env=os.environ, log_path=str(log))
        worker.start_copying(None, threading.Lock())
        worker.process.wait(timeout=60)
        worker.close()
        return worker

    log = tmp_path / "worker_1.log"
    log.write_text("Traceback (most recent call last):\nSyntaxError: invalid syntax\n")
    assert run("import os; os._exit(3)").tail() == []
    assert run("print('step 3 failed')").tail() == ["step 3 failed"] and "SyntaxError" in log.read_text()


def test_a_missing_script_names_only_the_script(capsys):
    """Without a script the error said "the following arguments are required: script, script_args",
    though a script may take no arguments."""
    from jaxpar.cli import main

    assert main(["launch", "--worker-num", "2"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: script (" in err and "script_args" not in err, err


def _launch_here(tmp_path, capsys, body, args=(), **kw):
    """``launch`` in this process on a tiny script (no JAX): (status, the launcher's messages)."""
    from jaxpar.launch import launch
    from jaxpar.launch.ports import free_port

    script = tmp_path / "script.py"
    script.write_text(body)
    config = LaunchConfig(log_dir=str(tmp_path / "logs"), master_port=free_port(), cluster_time_out=60, **kw)
    code = launch(config, str(script), list(args))
    return code, capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_restart_without_servers_says_none_and_the_command_can_be_pasted(tmp_path, capsys):
    """A one-node restart logged "...; the servers keep running" with no --servers; the worker command
    was joined with spaces (``--mesh {"data": 8}``), which a shell splits otherwise."""
    body = "import os, sys\nsys.exit(3 if os.environ['JAXPAR_WORKER_RESTART'] == '0' else 0)\n"
    code, err = _launch_here(tmp_path, capsys, body, ["--mesh", '{"data": 8}'], worker_num=1, local_worker_num=1,
                             worker_restarts=1)
    assert code == 0, err
    assert "restarting the worker group (1 of 1, --worker-restarts)\n" in err, err
    assert "the servers keep running" not in err, err
    command = worker_command(str(tmp_path / "script.py"), ["--mesh", '{"data": 8}'])
    assert f": {shlex.join(command)}\n" in err and """--mesh '{"data": 8}'""" in err, err
    assert shlex.split(shlex.join(command)) == command


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("node_rank", [0, 1])
def test_ranks_stopped_by_a_collective_on_one_node_are_not_sent_to_other_nodes(tmp_path, capsys, node_rank):
    """Every rank died of a peer-failure error (a gloo time-out: ranks that ran different collectives),
    none on its own. On a one-node job the launcher sent the user to "the other nodes' launcher logs",
    which do not exist; on several nodes it still does."""
    body = "raise RuntimeError('Gloo: Timed out waiting 30000ms for recv operation to complete')\n"
    kw = dict(worker_num=2, local_worker_num=2) if node_rank == 0 else \
        dict(worker_num=4, local_worker_num=2, node_rank=1)
    code, err = _launch_here(tmp_path, capsys, body, **kw)
    assert code == 1, err
    if node_rank == 0:
        assert "other nodes" not in err, err
        assert "but no rank failed on its own (all 2 run on this node): a collective failed or timed out under " \
               "them. Ranks that run different collectives, or different numbers of them" in err, err
        assert f"compare where each rank's log ends: {tmp_path / 'logs' / 'worker_<rank>.log'}." in err, err
    else:
        assert "no rank of this node failed on its own: look at the other nodes' launcher logs" in err, err
