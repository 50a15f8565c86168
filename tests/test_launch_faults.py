"""Launcher faults, each run 5 times in a row: the first rank to fail is named, with its own
output, and the whole job ends within seconds, leaving no process behind (the `tag` fixture).

Plus: a rank that leaves early with code 0 stops the job, and the coordinator listens on
loopback only.
"""

import ipaddress
import os
import signal
import time

import pytest

from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch, wait_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
REPEATS = range(5)
FAKE_RANKS = os.path.join(WORKERS, "fake_ranks.py")


def start(tmp_path, tag, worker_args, script=None, port=None, **flags):
    args = ["--worker-num", 2, "--local-worker-num", 2, "--simulated-devices", 2,
            "--master-port", port or free_port(), "--cluster-time-out", 60]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", value]
    extra = {"script": script} if script else {}
    return Launch(tmp_path, tag, args, worker_args, **extra)


@pytest.mark.parametrize("repeat", REPEATS)
def test_rank_that_dies_of_a_peer_is_not_blamed(tmp_path, tag, repeat):
    """Rank 0 dies of rank 1's failure and exits first; rank 1 is named, with its traceback."""
    run = start(tmp_path, tag, ["--slow-exit", 1], script=FAKE_RANKS)
    try:
        assert run.wait(timeout=60) == 1
    finally:
        run.close()
    err = run.stderr
    assert "error: rank 1 (pid" in err and "the first rank to fail" in err, err
    assert "ValueError: rank 1: the root cause" in err  # its own tail
    assert "rank 0 also exited with code 1" in err and "after a peer failed" in err
    assert not wait_gone(tag, timeout=5)


FAULTS = {
    # how rank 1 fails: (worker flags, launcher status, words in the launcher's report)
    "raise": (["--fail-how", "raise"], 1, ["exited with code 1", "fails on purpose at step 3"]),
    "sigkill": (["--fail-how", "kill"], 128 + signal.SIGKILL, ["killed by signal 9 (SIGKILL)"]),
    "sys_exit_3": (["--fail-how", "sysexit", "--exit-code", 3], 3, ["exited with code 3"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_names_the_failing_rank(tmp_path, tag, fault, repeat):
    flags, status, words = FAULTS[fault]
    # Every step is a cross-process sum, so rank 0 is inside a collective when rank 1 goes.
    run = start(tmp_path, tag, ["--steps", 100000, "--step-psum", "--skip-checks",
                                "--fail-rank", 1, "--fail-step", 3, *flags])
    try:
        run.wait_for_log(1, "failing at step 3", timeout=90)
        failed_at = time.monotonic()
        assert run.wait(timeout=40) == status, run.stderr
        took = time.monotonic() - failed_at
    finally:
        run.close()
    err = run.stderr
    assert "error: rank 1 (pid" in err and "the first rank to fail" in err, err
    assert "error: rank 0" not in err
    assert all(w in err for w in words), err
    assert "rank 1: failing at step 3" in err  # the tail of rank 1's own log
    print(f"{fault}: job ended {took:.2f} s after rank 1 failed")
    assert took < 30
    assert not wait_gone(tag, timeout=5)


def listening_hosts(port: int) -> set[str]:
    """The local addresses in LISTEN state on ``port`` (from /proc/net/tcp and tcp6)."""
    hosts = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state != "0A" or int(port_hex, 16) != port:
                    continue
                # /proc writes each 32-bit word in host (little-endian) order.
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                               for i in range(0, len(address), 8))
                ip = ipaddress.ip_address(raw)
                hosts.add(str(getattr(ip, "ipv4_mapped", None) or ip))  # ::ffff:a.b.c.d
    return hosts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_rank_leaving_early_stops_the_job_and_coordinator_is_on_loopback(tmp_path, tag):
    port = free_port()
    run = start(tmp_path, tag, ["--steps", 100000, "--step-psum", "--step-sleep", 0.05,
                                "--fail-rank", 1, "--fail-step", 20, "--fail-how", "sysexit",
                                "--exit-code", 0], port=port, exit_time_out=3)
    try:
        run.wait_for_log(0, "step 1", timeout=90)
        hosts = listening_hosts(port)
        run.wait_for_log(1, "failing at step 20", timeout=60)
        left_at = time.monotonic()
        assert run.wait(timeout=40) == 1, run.stderr
        took = time.monotonic() - left_at
    finally:
        run.close()
    assert hosts == {"127.0.0.1"}, f"coordinator port {port} listens on {hosts}"
    err = run.stderr
    assert "rank 1 ended its script with code 0, but rank(s) [0] were still running" in err, err
    print(f"rank 1 left early: job ended {took:.2f} s later (--exit-time-out 3)")
    assert took < 3 + 10
    assert not wait_gone(tag, timeout=5)
