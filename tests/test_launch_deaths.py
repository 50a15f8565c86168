"""Blaming the right rank, the runner's records, and the coordinator's listening address.

Pure tests of `jaxpar.launch.deaths` and `jaxpar.launch.ports`, and the runner run on tiny
scripts (no JAX): fast, no cluster.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxpar.launch.deaths import Death, death_of, root_cause
from jaxpar.launch.ports import check_bind_address, coordinator_bind_address

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "jaxpar", "launch", "runner.py")
GLOO_HELLO = ("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
              "ranks is : 1")
JAX_FATAL = ("F1122 client.h:80] Terminating process because the JAX distributed service "
             "detected fatal errors. This most likely indicates that another task died")


def death(rank, code, at, text=""):
    return Death(rank=rank, code=code, time=at, text=text)


def test_earliest_failure_is_the_cause():
    assert root_cause([death(0, 1, 2.0, "ValueError"), death(1, -9, 1.0)]).rank == 1
    assert root_cause([death(0, 0, 0.5), death(1, 3, 1.0)]).rank == 1  # exit 0 is no failure


def test_peer_failure_errors_are_consequences():
    # Rank 0 was stamped first (its reaper woke first), but its error says a peer died.
    gloo = death(0, 1, 1.0, "RuntimeError: Gloo: Connection reset by peer")
    fatal = death(2, -6, 1.1, JAX_FATAL)
    killed = death(1, -9, 1.2, GLOO_HELLO + "\nrank 1: step 3")
    assert gloo.consequence and fatal.consequence and not killed.consequence
    assert root_cause([gloo, fatal, killed]).rank == 1
    # Only consequences: the earliest of them.
    assert root_cause([fatal, gloo]).rank == 0


def test_root_cause_needs_a_failure():
    with pytest.raises(ValueError, match=r"codes \[0\]"):
        root_cause([death(0, 0, 1.0)])


def test_death_of_prefers_the_ranks_own_record():
    record = {"rank": 1, "code": 3, "time": 5.0, "tail": ["sys.exit(3)"]}
    d = death_of(1, 3, 9.0, ["log line"], record)
    assert (d.time, d.text, d.recorded, d.describe()) == (5.0, "sys.exit(3)", True,
                                                          "exited with code 3")
    # A record the process outlived (it wrote code 0, then was killed) does not count.
    d = death_of(1, -9, 9.0, ["log line"], {**record, "code": 0})
    assert (d.time, d.text, d.recorded) == (9.0, "log line", False)
    assert d.describe() == "was killed by signal 9 (SIGKILL)"


def run_script(tmp_path, body, *args):
    script = tmp_path / "script.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAXPAR_LAUNCH_RUN_DIR": str(tmp_path),
           "JAXPAR_PROCESS_ID": "3"}
    result = subprocess.run([sys.executable, RUNNER, str(script), *args],
                            capture_output=True, text=True, timeout=60, env=env)
    record = json.loads((tmp_path / "end.3").read_text())
    return result, record


@pytest.mark.parametrize("body, code, how", [
    ("import sys\nprint(sys.argv[1:], __name__, 'jax' in sys.modules)\n", 0, "return"),
    ("import sys\nsys.exit(3)\n", 3, "exit"),
    ("import sys\nsys.exit('bad config')\n", 1, "exit"),
    ("def f():\n    raise ValueError('broken batch')\nf()\n", 1, "exception"),
])
def test_runner_records_how_the_script_ended(tmp_path, body, code, how):
    result, record = run_script(tmp_path, body, "--steps", "2")
    assert result.returncode == code == record["code"]
    assert record["how"] == how and record["rank"] == 3 and record["time"] > 0
    if how == "return":
        # As `python script.py`: its arguments, run as __main__, JAX not imported before it.
        assert result.stdout == "['--steps', '2'] __main__ False\n"
    if how == "exception":
        # The script's own frames, none of the runner's.
        assert "ValueError: broken batch" in result.stderr and "runpy" not in result.stderr
        assert record["tail"][-1] == "ValueError: broken batch"
    if body.endswith("'bad config')\n"):
        assert result.stderr == "bad config\n" and record["tail"] == ["bad config"]


def test_runner_missing_script(tmp_path):
    result = subprocess.run([sys.executable, RUNNER, str(tmp_path / "no.py")],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 2 and "can't open file" in result.stderr


def test_coordinator_binds_loopback_or_its_own_address():
    assert coordinator_bind_address("127.0.0.1:8118", None) == "127.0.0.1:8118"
    assert coordinator_bind_address("localhost:8118", None) == "localhost:8118"
    assert coordinator_bind_address("[::1]:8118", None) == "[::1]:8118"
    # An address of another host cannot be bound here: JAX's default (all interfaces).
    assert coordinator_bind_address("192.0.2.7:8118", None) is None
    assert coordinator_bind_address("node-0.cluster:8118", None) is None
    # What the user asks for wins; the port defaults to the coordinator's.
    assert coordinator_bind_address("127.0.0.1:8118", "0.0.0.0") == "0.0.0.0:8118"
    assert coordinator_bind_address("node-0:8118", "127.0.0.1:9000") == "127.0.0.1:9000"
    # ... if this host can listen there: JAX's coordinator died of SIGSEGV on another host's address
    for other, why in (("192.0.2.7", "is not an address of this host"), ("no-such-host.invalid", "does not resolve")):
        with pytest.raises(ValueError) as err:
            coordinator_bind_address("node-0:8118", other, "JAXPAR_COORDINATOR_BIND_ADDRESS=")
        assert f"JAXPAR_COORDINATOR_BIND_ADDRESS='{other}:8118': {other} {why}" in str(err.value), err.value


@pytest.mark.parametrize("bad", ["a:b", "", ":80", "10.0.0.1:70000", "[::1]x"])
def test_bad_bind_address(bad):
    with pytest.raises(ValueError) as err:
        check_bind_address(bad, 8118, "--bind-address")
    assert f"--bind-address {bad!r}" in str(err.value) and "0.0.0.0" in str(err.value)
