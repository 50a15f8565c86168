"""One worker process under ``jaxpar launch``: start it, copy its output, stop it.

Each worker runs in its own session (``os.setsid``), so stopping it signals its whole process
group, and on Linux it asks the kernel for SIGKILL when the launcher dies
(``PR_SET_PDEATHSIG``), so even a launcher killed with SIGKILL leaves no worker behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

_PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once, in the launcher: the child, between fork and exec, only calls it.
_prctl = _load_prctl()


def die_with_parent(parent_pid: int):
    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def signal_name(number: int) -> str:
    """``9`` → ``"SIGKILL"``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Worker:
    """A started worker: its rank, process, log file, and the thread that copies its output."""

    def __init__(self, *, rank: int, command: Sequence[str], env: Mapping[str, str], log_path: str):
        self.rank = rank
        self.log_path = log_path
        self.ended_at: float | None = None
        """``time.time()`` when the process ended (comparable with the workers' own clocks)."""
        self._log = open(log_path, "ab", buffering=0)
        # this process's output starts here: a log folder used before keeps earlier runs above it
        self._start = self._log.tell()
        self.process = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        self._pump: threading.Thread | None = None
        self._reaper: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def start_copying(self, echo: IO[str] | None, lock: threading.Lock) -> None:
        """Copies the worker's output to its log file and, with ``echo``, prefixed to there."""
        self._pump = threading.Thread(target=self._copy, args=(echo, lock), daemon=True)
        self._pump.start()
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        # A thread blocked in wait() stamps the death when it happens, not at the next look
        # of a polling loop: the launcher orders deaths by these times.
        self.process.wait()
        self.ended_at = time.time()

    def _copy(self, echo: IO[str] | None, lock: threading.Lock) -> None:
        prefix = f"[rank {self.rank}] "
        for line in iter(self.process.stdout.readline, b""):
            self._log.write(line)
            if echo is None:
                continue
            try:
                with lock:
                    echo.write(prefix + line.decode(errors="replace"))
                    echo.flush()
            except (OSError, ValueError):
                echo = None  # a closed console (`| head`): keep logging, never block the worker

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while it runs."""
        if self._reaper is not None and self._reaper.is_alive():
            return None
        code = self.process.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.time()
        return code

    def has_exited(self, timeout: float = 2.0) -> bool:
        """True when the process has ended, even if the reaper thread has not stamped it yet.

        Waits up to ``timeout`` s for that stamp, so a death that came first is never taken
        for a process still running (and then counted among those the launcher killed).
        """
        if self.poll() is not None:
            return True
        try:
            # WNOWAIT: look without reaping; the reaper thread still reaps it.
            ended = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            ended = True  # already reaped: the reaper is about to stamp it
        if ended and self._reaper is not None:
            self._reaper.join(timeout)
        return self.poll() is not None

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the worker's process group (it and anything it started)."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def describe_exit(self) -> str:
        """``"exited with code 3"`` or ``"was killed by signal 9 (SIGKILL)"``."""
        code = self.process.returncode
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by signal {-code} ({signal_name(-code)})"
        return f"exited with code {code}"

    def close(self, timeout: float = 2.0) -> None:
        """Waits for the output copy to finish and closes the log file."""
        if self._pump is not None:
            self._pump.join(timeout)
        if self.process.stdout is not None and (self._pump is None or not self._pump.is_alive()):
            self.process.stdout.close()
        self._log.close()

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines this process wrote to its log (not an earlier run's)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._start, os.path.getsize(self.log_path) - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]


def stop_all(workers: Sequence[Worker], grace: float, hurry=lambda: False) -> float:
    """SIGTERM every running worker's group, SIGKILL what is left after ``grace`` seconds.

    ``grace=0`` kills at once; ``hurry()`` returning True cuts the grace short (a second
    Ctrl-C). Every worker is reaped before it returns; returns the seconds it took.
    """
    start = time.monotonic()
    if grace > 0:
        for w in workers:
            if w.poll() is None:
                w.signal_group(signal.SIGTERM)
    deadline = start + grace
    while time.monotonic() < deadline and any(w.poll() is None for w in workers) and not hurry():
        time.sleep(0.02)
    for w in workers:
        # Also the group of a worker that ended: it may have left children behind.
        w.signal_group(signal.SIGKILL)
    for w in workers:
        try:
            w.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        w.poll()
    return time.monotonic() - start
