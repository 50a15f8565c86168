"""The metric writers and the profile window as hooks: `MetricsHook` logs a loop over
``Trainer.step`` every ``MetricsConfig.every`` steps (``fit`` hands it the records it reads
itself), `ProfileHook` traces a window of steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import jax

from jaxpar.metrics import (MetricsConfig, MetricsLogger, ProfileWindow, profile_window_outside, read,
                            tokens_per_example)
from jaxpar.metrics.goodput import GoodputLedger
from jaxpar.metrics.logger import ROUTING, examples_per_step
from jaxpar.train.hooks import Hook


class Window:
    """The steps dispatched since the last read: their device metrics, and the host time since
    (less the checkpoint saves in it: ``trainer.save_s``, logged apart as ``checkpoint_s``)."""

    def __init__(self):
        self.pending: list[tuple[int, int, dict]] = []      # (index, step, device metrics)
        self.since = time.perf_counter()

    def add(self, index: int, step: int, metrics: dict[str, Any]) -> None:
        self.pending.append((index, step, metrics))

    def read(self, trainer, *, check: bool = True) -> tuple[list[tuple[int, dict]], float, float]:
        """``([(index, record)], window seconds, save seconds)`` of the pending steps (one wait);
        ``check``: the finite flags are read first (a non-finite step under "stop" is refused
        before it is logged)."""
        if check:
            trainer.check_finite()
        values = read([{k: m[k] for k in ("loss", "grad_norm", *ROUTING) if k in m} for _, _, m in self.pending])
        now = time.perf_counter()
        saving, trainer.save_s = trainer.save_s, 0.0
        window = max(now - self.since - saving, 1e-9)
        per_step = window / len(self.pending)
        out = []
        for (i, step, _), value in zip(self.pending, values):
            record = {"step": step, "loss": float(value["loss"]), "grad_norm": float(value["grad_norm"]),
                      "time_s": per_step}
            record |= {k: value[k].item() for k in ROUTING if k in value}     # an MoE model's routing
            out.append((i, record))
        self.pending.clear()
        self.since = now
        return out, window, saving


class MetricsHook(Hook):
    """Writes loss, grad norm, lr, tokens/s, MFU and memory (`jaxpar.metrics.MetricsLogger`),
    and the goodput ledger beside them (`jaxpar.metrics.goodput`: where the wall time went).

    In a loop over ``step`` it reads the metrics every ``config.every`` steps, at the first step
    and when the Trainer closes; inside ``fit``, which reads them for its history anyway, fit
    hands it the records (`log`).

    >>> hook = MetricsHook(MetricsConfig(dir="runs/exp1", every=10))     # doctest: +SKIP
    """

    service = "metrics"

    def __init__(self, config: MetricsConfig):
        self.config = config
        self.logger = MetricsLogger(config)
        self.ledger = GoodputLedger(config.dir, writing=jax.process_index() == 0)
        self.window: Window | None = None
        self.steps = 0          # steps this hook has seen in a loop over `step`

    def __repr__(self) -> str:
        return f"MetricsHook({self.config!r})"

    def on_start(self, trainer) -> None:
        self.ledger.start(trainer.step_count, processes=jax.process_count(), devices=trainer.mesh.devices.size)

    def before_step(self, trainer, step: int) -> None:
        if self.window is None and not trainer.fitting:
            self.window = Window()

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        if trainer.fitting:
            return            # fit reads the records and hands them over (`log`)
        self.window.add(self.steps, step, metrics)
        self.steps += 1
        if self.steps == 1:
            self.start(trainer, trainer.last_batch)
        if self.steps == 1 or not step % self.config.every:
            self.flush(trainer)

    def flush(self, trainer, *, check: bool = True, end: bool = False) -> None:
        """Log the steps read since the last log (a loop over ``step``); ``end``: the loop is
        over (``fit`` starts, which keeps its own window): the next loop starts a new window."""
        if self.window is not None and self.window.pending:
            records, window, saving = self.window.read(trainer, check=check)
            self.log(trainer, [r for _, r in records], window, saving)
        if end:
            self.window = None

    def log(self, trainer, records: list[dict], window_s: float, checkpoint_s: float = 0.0) -> None:
        self.logger.log(records[-1]["step"], records, window_s, trainer.state.opt_state, checkpoint_s=checkpoint_s)
        self.ledger.steps(records[0]["step"], records[-1]["step"], window_s, checkpoint_s,
                          getattr(trainer, "data_wait_s", 0.0))     # a stand-in Trainer may keep no count

    def start(self, trainer, batch) -> int:
        """Tokens per step of ``batch``, and the compiled step's memory and FLOPs, read once per
        compiled step over the Trainer's life (a later run of batches shaped alike reads nothing)."""
        program, placed, compiled = trainer.programs.last_step(batch)
        if not self.logger.started(program):
            self.logger.start(compiled(), placed, num_devices=trainer.mesh.devices.size,
                              resumed=trainer.step_count > 1, model_flops_per_token=trainer.flops_per_token,
                              key=program)
        return self.logger.tokens_per_step

    def mfu(self, step_time_s: float) -> float | None:
        """MFU of a step that took ``step_time_s`` from model FLOPs (None without a peak)."""
        if self.logger.mfu_source not in ("given", "model"):
            return None
        return self.logger.mfu(step_time_s)

    def on_close(self, trainer) -> None:
        try:
            if trainer is not None:
                self.flush(trainer, check=False)     # the last steps of a loop over `step`
                self.ledger.end(trainer.step_count)
        finally:
            self.logger.close()


def tokens_per_step(trainer, batch) -> int:
    """Tokens in one step of ``batch`` (as placed: a process's host batch may hold only its rows)."""
    _, placed, _ = trainer.programs.last_step(batch)
    return examples_per_step(placed) * tokens_per_example(placed)


class ProfileHook(Hook):
    """A ``jax.profiler`` trace of steps ``start`` to ``stop - 1`` into ``directory``
    (`jaxpar.metrics.ProfileWindow`), each step marked for the trace viewer.

    >>> hook = ProfileHook("runs/exp1/profile", (10, 13))               # doctest: +SKIP
    """

    service = "profile"

    def __init__(self, directory: str, steps: tuple[int, int]):
        self.window = ProfileWindow(directory, steps)
        self._marker = contextlib.ExitStack()

    def __repr__(self) -> str:
        return f"ProfileHook({self.window.directory!r}, {(self.window.start, self.window.stop)})"

    def before_step(self, trainer, step: int) -> None:
        self.window.before(step)
        self._marker.enter_context(self.window.annotate(step))

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        self._marker.close()
        self.window.after(step, metrics)

    def check_until(self, first: int, until: int) -> None:
        """A window not yet traced must end by ``until``, the last step of the run a fit from step
        ``first`` is part of (`profile_window_outside`, the rule ``--profile-steps`` follows). A
        window the Trainer resumed past is left alone: it was the interrupted run's to trace."""
        window = self.window
        if window.active or window.done or window.stop - 1 < first:
            return
        inside = profile_window_outside((window.start, window.stop), first, until)
        if inside is None:
            return
        start, stop = window.start, window.stop
        what = "nothing would be traced" if start > until else f"the trace would stop short of step {stop - 1}"
        raise ValueError(f"Trainer.fit: Services(profile=({start}, {stop})) traces steps {start} to {stop - 1}, but "
                         f"the run this fit is part of ends at step until={until}, so {what}; run to step "
                         f"{stop - 1} (until={stop - 1} and the fits to reach it), or choose a window inside the "
                         f"run, e.g. Services(profile={inside})")

    def on_close(self, trainer) -> None:
        self._marker.close()
        self.window.close()



def flush(trainer, window: Window, history: list, callback, watcher: MetricsHook | None) -> None:
    """``fit``'s read of its pending steps (one wait): each record goes into ``history`` (and
    ``trainer.history``) and to ``callback(i, record)``, and they are handed to the metrics service."""
    if not window.pending:
        return
    records, span, saving = window.read(trainer)
    for i, record in records:
        history.append(record)
        if callback is not None:
            callback(i, record)
    if watcher is not None:
        watcher.log(trainer, [r for _, r in records], span, saving)
    trainer.history = history


def check_until(trainer, steps: int, until: int | None) -> None:
    """``fit(steps, until=...)``: ``until`` (the last step of the run this fit is part of) is at
    least this fit's last step, and a profile window not yet traced ends by it."""
    last = trainer.step_count + steps
    if until is None:
        return
    if not isinstance(until, int) or isinstance(until, bool) or until < last:
        raise ValueError(f"Trainer.fit: until={until!r} must be an int >= {last}, the last step this fit "
                         f"runs (steps={steps} after step {trainer.step_count}): the last step of the whole run")
    if (profile := trainer.service("profile")) is not None:
        profile.check_until(trainer.step_count + 1, until)


def next_batch(trainer, it: Iterator):
    """``next(it)``, its wait added to ``trainer.data_wait_s`` (the goodput ledger's data time)."""
    start = time.perf_counter()
    try:
        return next(it)
    finally:
        trainer.data_wait_s += time.perf_counter() - start
