"""Which rank's failure came first: the launcher's account of the ranks that ended.

When one rank dies, its peers often die of it a moment later (a gloo error in a collective,
the coordination service's "another task died"). The launcher must name the rank that failed
on its own, not the first exit it happened to notice. Each death carries its time (from the
rank's own ``end.<rank>`` record, written by ``jaxpar.launch.runner`` before it exits, else
from the launcher's reaper thread) and its text (the record's traceback, else the log's tail);
:func:`root_cause` takes the earliest death whose text is not a peer-failure error.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxpar.launch.worker import signal_name

# Lower-case pieces of the errors a rank reports when a *peer* died or left: the coordination
# service's error polling and heartbeats, gloo's broken TCP pairs, a failed shutdown barrier.
PEER_FAILURE_TEXT = (
    "gloo",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "another task died",
    "coordination service",
    "coordinationservice",
    "heartbeat",
    "barrier failed",
    "task is set to error",
    "distributed service detected fatal errors",
)
# Gloo's start-up line ("[Gloo] Rank 0 is connected to 1 peer ranks") is no error.
_GLOO_HELLO = "[gloo] rank"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Death:
    """One rank that ended on its own (not stopped by the launcher).

    Example:
        >>> Death(rank=1, code=-9, time=10.0, text="").describe()
        'was killed by signal 9 (SIGKILL)'
    """

    rank: int
    code: int
    """Exit status; negative: killed by that signal (as ``Popen.returncode``)."""
    time: float
    """``time.time()`` of the death: the rank's own record, else when the launcher reaped it."""
    text: str
    """The rank's own account: its traceback tail, else the tail of its log."""
    recorded: bool = False
    """True when ``time`` and ``text`` come from the rank's ``end.<rank>`` record."""

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def consequence(self) -> bool:
        """True when its error says a peer died first (so it is not the cause)."""
        lines = [line.lower() for line in self.text.splitlines()]
        return any(piece in line for line in lines if not line.startswith(_GLOO_HELLO)
                   for piece in PEER_FAILURE_TEXT)

    def describe(self) -> str:
        if self.code < 0:
            return f"was killed by signal {-self.code} ({signal_name(-self.code)})"
        return f"exited with code {self.code}"


def root_cause(deaths: list[Death]) -> Death:
    """The failure to blame: the earliest failed death that is not a peer-failure error.

    Falls back to the earliest failed death when every one looks like a consequence.

    Example:
        >>> gloo = Death(rank=0, code=1, time=1.0, text="gloo: Connection reset by peer")
        >>> own = Death(rank=1, code=1, time=1.2, text="ValueError: bad batch")
        >>> root_cause([gloo, own]).rank
        1
    """
    failed = [d for d in deaths if d.failed]
    if not failed:
        raise ValueError(f"root_cause needs a failed death; got codes {[d.code for d in deaths]}.")
    own = [d for d in failed if not d.consequence]
    return min(own or failed, key=lambda d: (d.time, d.rank))


def read_record(run_dir: str, rank: int) -> dict | None:
    """The ``end.<rank>`` record the runner wrote, or None (no runner, or killed first)."""
    try:
        with open(os.path.join(run_dir, f"end.{rank}"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def death_of(rank: int, code: int, reaped_at: float, log_tail: list[str],
             record: dict | None) -> Death:
    """A Death from what the launcher saw (status, reap time, log) and the rank's record."""
    if record is not None and record.get("code") == code:
        return Death(rank=rank, code=code, time=float(record["time"]),
                     text="\n".join(record.get("tail") or log_tail), recorded=True)
    # No record (killed, or not a Python script), or a record the process outlived.
    return Death(rank=rank, code=code, time=reaped_at, text="\n".join(log_tail))
