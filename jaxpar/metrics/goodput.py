"""Goodput: where a run's wall time went, across its restarts.

A run with metrics (``Services(metrics=MetricsConfig(dir=...))``) appends a ledger,
``goodput.jsonl``, beside ``metrics.jsonl`` on process 0: one ``start`` line per process start
(the wall clock, when the process began, the step it resumed from), one ``steps`` line per
metrics log (the steps logged and how their window's seconds divide: compiling, waiting for
data, checkpoint saves that held the step, the rest productive) and an ``end`` line at a clean
close. A killed process writes no ``end``: its last ``steps`` line is where it stopped. The
ledger is appended to, never truncated, so it spans every restart of the run (start a new
experiment in a new directory).

`summarize` reads it into the time of each cause, summed over the run's processes' lives:

- ``startup``: from a process's start (the operating system's clock of it; for a later Trainer
  of the same process, from when it began to be built) to its first logged window: imports,
  ``jax.distributed``, building the model, restoring a checkpoint; and the first step of each
  start, less its own compiling (logged alone, as the watcher logs a start's first step): it
  runs once every process of the job has its programs, so it holds the waits for the slowest
  one's compiles, which process 0's clock cannot tell from computing (measured on 4 processes
  after a restart: 11-13 s for a 0.7 s step);
- ``compile``: tracing, lowering and compiling (or loading from the persistent cache) inside
  the logged windows, read from JAX's own events (``jax.monitoring``), overlapping spans counted once;
- ``data``: ``Trainer.fit`` waiting for its next batch;
- ``checkpoint``: saves that held the host (an asynchronous save's device-to-host copy);
- ``recomputed``: productive time of steps a later start did again (it resumed from an older step);
- ``restart``: from the last line a process wrote to the next process's start (after a crash
  or a resubmission); ``restarts`` counts those changes of process;
- ``other``: inside a process's life but in no logged window (evaluation, user code between fits,
  the time between two Trainers of one process);
- ``productive``: the rest of the logged windows, less ``recomputed``.

Goodput is productive time over the wall time from the first start to the last line; the
effective MFU is the steady steps' MFU (the median of ``metrics.jsonl``'s ``mfu`` after its first
record) times goodput. ``jaxpar goodput RUN_DIR`` prints it (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

LEDGER = "goodput.jsonl"
CAUSES = ("productive", "startup", "compile", "data", "checkpoint", "recomputed", "restart", "other")
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
})
_IMPORTED = time.time()
_MAX_SPANS = 10_000
_FIRST_LIFE = [True]     # the first Trainer start of this process begins at the process's start


class CompileClock:
    """The spans JAX spent tracing, lowering and compiling in this process (from its
    ``jax.monitoring`` duration events), as wall-clock intervals; nested spans count once."""

    def __init__(self):
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._heard)
            self._installed = True

    def _heard(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            now = time.time()
            with self._lock:
                self._spans.append((now - duration, now))
                if len(self._spans) > _MAX_SPANS:     # a long process with no ledger asking: keep the newest
                    del self._spans[:len(self._spans) - _MAX_SPANS // 2]

    def spent(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` (wall clock) inside a compile span; spans ending before
        ``start`` are dropped (windows are asked for in order)."""
        with self._lock:
            self._spans = [s for s in self._spans if s[1] > start]
            spans = sorted((max(a, start), min(b, end)) for a, b in self._spans if a < end)
        total, reach = 0.0, start
        for a, b in spans:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


COMPILE_CLOCK = CompileClock()


def process_start_time() -> float:
    """When this process started (wall clock): the kernel's record of it on Linux, else when
    jaxpar was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


class GoodputLedger:
    """Appends the ledger's lines (module docstring) to ``directory/goodput.jsonl``; writes
    nothing where ``writing`` is False (processes other than 0). Made when the Trainer is
    being built: a life begins at the process's start for the first ledger of a process, else
    here (a second Trainer in one process, a notebook)."""

    def __init__(self, directory: str | os.PathLike, *, writing: bool = True):
        self.path = os.path.join(os.fspath(directory), LEDGER)
        self.writing = writing
        self._data_seen = 0.0
        self._started = False
        self._began = process_start_time() if _FIRST_LIFE[0] else time.time()
        _FIRST_LIFE[0] = False
        if writing:
            COMPILE_CLOCK.install()

    def _write(self, record: dict) -> None:
        if not self.writing:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:      # one whole line a write: a kill leaves the earlier lines whole
            f.write(json.dumps(record) + "\n")

    def start(self, step: int, *, processes: int, devices: int) -> None:
        self._write({"event": "start", "time": time.time(), "began": self._began, "process_start": process_start_time(),
                     "step": int(step), "pid": os.getpid(), "processes": processes, "devices": devices})
        self._started = True

    def steps(self, first: int, last: int, window_s: float, checkpoint_s: float, data_total_s: float) -> None:
        """The steps ``first..last`` logged now, which took ``window_s`` seconds (checkpoint saves
        apart: ``checkpoint_s``); ``data_total_s``: the Trainer's running total of batch waits."""
        now = time.time()
        data = max(data_total_s - self._data_seen, 0.0)
        self._data_seen = data_total_s
        compile_s = COMPILE_CLOCK.spent(now - window_s - checkpoint_s, now) if self.writing else 0.0
        compile_s = min(compile_s, window_s)
        data = min(data, window_s - compile_s)
        self._write({"event": "steps", "time": now, "first": int(first), "last": int(last),
                     "wall_s": window_s + checkpoint_s, "compile_s": compile_s, "data_s": data,
                     "checkpoint_s": checkpoint_s, "productive_s": max(window_s - compile_s - data, 0.0)})

    def end(self, step: int) -> None:
        """A clean close (nothing when this ledger wrote no start: a Trainer whose construction failed)."""
        if self._started:
            self._write({"event": "end", "time": time.time(), "step": int(step), "pid": os.getpid()})
            self._started = False


_FIELDS = {"start": ("time", "step"), "steps": ("time", "first", "last", "wall_s", "compile_s", "data_s",
                                                  "checkpoint_s", "productive_s"), "end": ("time", "step")}


def read_ledger(path: str) -> tuple[list[dict], int]:
    """The ledger's records, and how many lines could not be read (a line cut by a kill, or a
    record without the numbers its kind has)."""
    records, bad = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            fields = _FIELDS.get(record.get("event")) if isinstance(record, dict) else None
            if fields is not None and all(isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
                                          for k in fields):
                records.append(record)
            else:
                bad += 1
    return records, bad


def _runs(records: list[dict]) -> list[dict]:
    runs: list[dict] = []
    for r in records:
        if r["event"] == "start":
            runs.append({"start": r, "windows": [], "end": None})
        elif runs:          # lines before any start (a ledger cut at its head) belong to no life
            if r["event"] == "steps":
                runs[-1]["windows"].append(r)
            elif r.get("pid", runs[-1]["start"].get("pid")) == runs[-1]["start"].get("pid"):
                runs[-1]["end"] = r
    return runs


def _began(start: dict) -> float:
    return min(start.get("began", start.get("process_start", start["time"])), start["time"])


def summarize(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Seconds per cause (`CAUSES`), goodput and effective MFU of the run in ``run_dir``."""
    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, LEDGER)
    if not os.path.isfile(path):
        raise ValueError(f"goodput: {path} does not exist; a run writes it when trained with metrics "
                         f"(Services(metrics=MetricsConfig(dir={run_dir!r})) or a job's logging.dir)")
    records, unreadable = read_ledger(path)
    runs = _runs(records)
    if not runs:
        raise ValueError(f"goodput: {path} holds no start of a run ({len(records)} records, {unreadable} "
                         "unreadable lines); it is not a ledger a jaxpar Trainer wrote: give the run's metrics "
                         "directory, or move the file aside and train again")
    seconds = dict.fromkeys(CAUSES, 0.0)
    lives, previous = [], None
    for run in runs:    # born: when the life began, or where the life before it ended if later
        start = run["start"]
        run["last"] = max([start["time"]] + [w["time"] for w in run["windows"]]
                          + ([run["end"]["time"]] if run["end"] else []))
        run["born"] = _began(start) if previous is None else max(_began(start), previous)
        previous = run["last"]
    restarts = 0
    for k, run in enumerate(runs):
        start, windows, born, last = run["start"], run["windows"], run["born"], run["last"]
        first_window = windows[0]["time"] - windows[0]["wall_s"] if windows else last
        seconds["startup"] += max(first_window - born, 0.0)
        logged, stepping = 0.0, []
        for i, w in enumerate(windows):
            seconds["compile"] += w["compile_s"]
            seconds["data"] += w["data_s"]
            seconds["checkpoint"] += w["checkpoint_s"]
            first_step = i == 0 and w["first"] == w["last"] == start["step"] + 1
            seconds["startup" if first_step else "productive"] += w["productive_s"]
            stepping += [] if first_step else [w]
            logged += w["wall_s"]
        seconds["other"] += max(last - first_window - logged, 0.0)
        if k + 1 < len(runs):      # steps past where a later life resumed were done again
            resumed = min(r["start"]["step"] for r in runs[k + 1:])
            for w in stepping:
                done_again = w["last"] - max(w["first"] - 1, resumed)
                if done_again > 0:
                    seconds["recomputed"] += w["productive_s"] * done_again / (w["last"] - w["first"] + 1)
            # between two processes: a restart; between two Trainers of one process: other work
            new_process = runs[k + 1]["start"].get("pid") != start.get("pid")
            restarts += new_process
            seconds["restart" if new_process else "other"] += runs[k + 1]["born"] - last
        lives.append({"resumed_from": start["step"], "last_step": windows[-1]["last"] if windows else start["step"],
                      "seconds": last - born, "clean_end": run["end"] is not None})
    seconds["productive"] -= seconds["recomputed"]
    wall = runs[-1]["last"] - runs[0]["born"]
    goodput = seconds["productive"] / wall if wall > 0 else 0.0
    mfu = steady_mfu(os.path.join(run_dir, "metrics.jsonl"))
    return {"run_dir": run_dir, "wall_s": wall, "seconds": seconds, "goodput": goodput,
            "badput": {c: s / wall if wall > 0 else 0.0 for c, s in seconds.items() if c != "productive"},
            "mfu": mfu, "effective_mfu": None if mfu is None else mfu * goodput,
            "restarts": restarts, "lives": lives, "unreadable_lines": unreadable}


def steady_mfu(path: str) -> float | None:
    """The median ``mfu`` of ``metrics.jsonl`` after its first record (which holds the compile),
    or None without one (no peak FLOPs on this backend, or no metrics file)."""
    if not os.path.isfile(path):
        return None
    values = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("mfu"), (int, float)):
                values.append(float(record["mfu"]))
    values = values[1:] or values
    if not values:
        return None
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def plot(summary: dict[str, Any], path: str) -> str:
    """A bar of the run's wall time by cause, saved to ``path`` (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(f"goodput: --plot {path} needs matplotlib ({e}); pip install 'jaxpar[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 2.2))
    left = 0.0
    for cause in CAUSES:
        width = summary["seconds"][cause]
        if width > 0:
            ax.barh([0], [width], left=left, label=f"{cause} {width:.1f} s")
            left += width
    mfu = summary["effective_mfu"]
    ax.set_title(f"goodput {summary['goodput']:.1%} of {summary['wall_s']:.1f} s, {summary['restarts']} restarts"
                 + (f", effective MFU {mfu:.1%}" if mfu is not None else ""))
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
