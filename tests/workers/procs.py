"""Helpers for the multi-process tests: run the launcher, find and clean up tagged processes.

Every process a test starts carries a unique ``--tag`` in its command line, so ``ps`` can tell
whether any of them outlived the test; the cleanup kills leftovers by pid, never by name.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "workers")
PSUM_WORKER = os.path.join(WORKERS, "psum_worker.py")


def new_tag() -> str:
    return "jaxpar-test-" + uuid.uuid4().hex[:12]


def tagged(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line holds ``tag``."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        pid, stat, args = line.strip().split(None, 2)
        if tag in args and not stat.startswith("Z") and int(pid) != os.getpid():
            found.append((int(pid), args))
    return found


def wait_gone(tag: str, timeout: float) -> list[tuple[int, str]]:
    """Waits up to ``timeout`` s for the tagged processes to end; returns those left."""
    deadline = time.monotonic() + timeout
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_tagged(tag: str) -> None:
    for pid, _ in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}


class Launch:
    """``python -m jaxpar.launch`` (or ``entry``, e.g. the ``jaxpar launch`` command) running
    in the background, its output in files."""

    def __init__(self, tmp_path, tag: str, launch_args, worker_args=(), script=PSUM_WORKER,
                 entry=("-m", "jaxpar.launch")):
        self.out_dir = tmp_path / "out"
        self.log_dir = tmp_path / "logs"
        self.out_dir.mkdir(exist_ok=True)
        self._stdout_path = tmp_path / "launcher.stdout"
        self._stderr_path = tmp_path / "launcher.stderr"
        self._stdout = open(self._stdout_path, "w")
        self._stderr = open(self._stderr_path, "w")
        command = [sys.executable, *entry, "--log-dir", str(self.log_dir),
                   *map(str, launch_args), script, "--out", str(self.out_dir), "--tag", tag,
                   *map(str, worker_args)]
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self._stdout, stderr=self._stderr,
                                        env=env(), cwd=str(tmp_path), start_new_session=True)

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self.ended = time.monotonic()
        return code

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text()

    @property
    def stdout(self) -> str:
        return self._stdout_path.read_text()

    def log(self, rank: int) -> str:
        path = self.log_dir / f"worker_{rank}.log"
        return path.read_text() if path.exists() else ""

    def wait_for_log(self, rank: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(rank):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"rank {rank} never logged {text!r}:\n{self.log(rank)}"
                                     f"\nlauncher:\n{self.stderr}")
            time.sleep(0.1)

    def worker_pid(self, rank: int) -> int:
        for line in self.stderr.splitlines():
            if f"started rank {rank} (pid " in line:
                return int(line.split("(pid ")[1].split(")")[0])
        raise AssertionError(f"no pid for rank {rank} in:\n{self.stderr}")

    def results(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out_dir.glob("rank_*.json"))]

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self._stdout.close()
        self._stderr.close()


def start_worker(tmp_path, tag: str, extra_env: dict, name: str, script=PSUM_WORKER, args=()):
    """Starts one worker without the launcher (dynamic cluster, OpenMPI-like, ...)."""
    log = open(tmp_path / f"{name}.log", "w")
    command = [sys.executable, "-u", script, "--out", str(tmp_path), "--tag", tag, *args]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**env(), **extra_env}, start_new_session=True)
