"""Parameter servers as subprocesses for the tests: start, wait for ready, kill, restart, stop.

The test's tag is part of each server's ``--checkpoint-dir``, so the ``tag`` fixture of
``conftest.py`` finds any server that outlives its test.
"""

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """``count`` servers of one job on loopback, each with its own fixed port."""

    def __init__(self, tmp_path, tag: str, count: int, token: str, every: int = 10):
        self.dir = tmp_path / tag
        self.token, self.count, self.every = token, count, every
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(count)]
        self.procs = [None] * count
        self.logs = [None] * count
        for i in range(count):
            self.start(i)
        for i in range(count):
            self.wait_ready(i)

    def start(self, i: int) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAXPAR_PS_TOKEN": self.token}
        cmd = [sys.executable, "-m", "jaxpar.ps.server", "--index", str(i), "--count", str(self.count),
               "--bind", self.addresses[i], "--checkpoint-dir", str(self.dir),
               "--checkpoint-every", str(self.every)]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs[i] = (self.dir / f"server-{i}.out", self.dir / f"server-{i}.err")
        with open(self.logs[i][0], "w") as out, open(self.logs[i][1], "a") as err:
            self.procs[i] = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT,
                                             start_new_session=True)

    def wait_ready(self, i: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[i]
        seen = ""
        while time.monotonic() < deadline:
            seen = self.logs[i][0].read_text()
            if f"jaxpar-ps-server ready {self.addresses[i]}" in seen:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"server {i} exited {proc.returncode}: {self.logs[i][1].read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"server {i} not ready after {timeout} s: {seen!r}")

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=10)

    def stop(self) -> list[int]:
        """SIGTERM to every live server; their exit codes."""
        codes = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=20))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes
