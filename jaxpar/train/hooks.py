"""The services around the loop: preemption, metric writers and the profile window.

SIGTERM handling is a flag in one process and JAX's preemption sync point across several, so
every process stops at the same step.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable

import jax

from jaxpar.metrics import MetricsConfig, MetricsLogger, ProfileWindow, check_profile_steps


class Preempted(SystemExit):
    """Raised by ``Trainer.step`` (at a step boundary) or ``Trainer.evaluate`` (between two of its
    batches) after a SIGTERM: the state of ``step`` is saved; exit code 0. ``saved`` is False only
    for an evaluation of a Trainer that has trained nothing (step 0): there is nothing to save."""

    def __init__(self, step: int, directory: str, *, saved: bool = True):
        super().__init__(0)
        self.step, self.directory, self.saved = step, directory, saved
        what = (f"saved step {step} to {directory}; restart to resume" if saved
                else f"stopped at step {step}, nothing trained to save to {directory}")
        print(f"jaxpar: preempted (SIGTERM): {what}", file=sys.stderr)


_listening: "weakref.WeakSet[Preemption]" = weakref.WeakSet()    # the open ones the handler tells


SAME_REQUEST_S = 1.0    # SIGTERMs this soon after the first are the same request (a scheduler and a launcher both sending it)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM while Trainers listen: each saves and leaves at its next step boundary.

    Every SIGTERM after the first is the same request until a Trainer has saved and stopped,
    as long as one is running (`running`: inside ``step``, ``fit`` or ``evaluate``, the first
    step's compile included): it will reach a step boundary, or in ``evaluate`` the end of the
    batch it runs, and act, however long the step or batch takes, and a scheduler or launcher that sends SIGTERM again (SLURM's ``--signal`` warning and then its
    time limit, a launcher forwarding it) must not cut that save short; a stuck process is
    ended by SIGKILL, as schedulers send after their grace period. With no Trainer running,
    nothing would act on the request: the default action (the process ends, as it would
    without jaxpar) for a SIGTERM with none listening (closed, or garbage), and for a second
    one over ``SAME_REQUEST_S`` after the first (fit has returned and the user's code runs,
    or nothing has stepped yet); one sooner than that is the same request (a scheduler and a
    launcher both sending it). One while a Trainer saves for the first (``acting``) changes
    nothing: that save is the point."""
    listening = list(_listening)
    if not listening:
        _default_action()
        return
    if any(p.acting for p in listening):
        return
    now = time.monotonic()
    pending = [p.noticed_at for p in listening if p.flag.is_set()]
    if pending:
        if not any(p.running for p in listening) and now - min(pending) >= SAME_REQUEST_S:
            _default_action()
        return
    for p in listening:
        p.noticed_at = now
        p.flag.set()


def _default_action() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class Preemption:
    """Where a SIGTERM is noticed: a flag set by a signal handler (one process), or JAX's
    preemption sync point, which makes every process stop at the same step (several).

    In one process the handler is installed where SIGTERM had its default action (a handler of
    the user's is left alone) and shared by every open Trainer; ``close`` stops listening, and
    the last one to close gives SIGTERM its default action back."""

    def __init__(self):
        self.flag = threading.Event()
        self.multi = jax.process_count() > 1
        self.listening = False
        self.acting = False      # a step noticed the SIGTERM: its Trainer saves and leaves
        self.noticed_at = 0.0    # time.monotonic() of the SIGTERM that set the flag
        self.running = 0         # open `step` / `fit` / `evaluate` calls of its Trainer (`running`): it will act on a SIGTERM
        if not self.multi and threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGTERM)
            if current is _on_sigterm or current in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
                _listening.add(self)
                self.listening = True

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        noticed = self.flag.is_set()       # read once: the Trainer acts on exactly what this returns
        self.acting = self.acting or noticed
        return noticed

    def asked(self, count: int) -> bool:
        """Before an evaluation batch: whether a SIGTERM asks the Trainer to save and stop now (then
        it acts, as at a step boundary). ``count`` goes up by one a batch (the Trainer's step plus
        the batch's index): on several processes it is the counter of JAX's preemption sync point,
        so a SIGTERM to any process makes every process stop before the same batch, as training
        steps do (the processes evaluate the same batches)."""
        return self.reached(count)

    def close(self) -> None:
        """Stop listening for SIGTERM (the last listener restores its default action)."""
        if not self.listening:
            return
        self.listening = False
        _listening.discard(self)
        if (not _listening and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is _on_sigterm):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def running(method: Callable) -> Callable:
    """A Trainer method (``step``, ``fit``, ``evaluate``) during which the Trainer is running:
    it will reach a step boundary (``evaluate``: the end of a batch) and act on a SIGTERM, so a
    repeated one is the same request (`_on_sigterm`)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        preemption = getattr(self, "_preemption", None)
        if preemption is None:
            return method(self, *args, **kwargs)
        preemption.running += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            preemption.running -= 1

    return wrapped


def watchers(metrics, profile_steps) -> tuple[MetricsLogger | None, ProfileWindow | None]:
    """The metric writers and the profile window a Trainer was asked for."""
    if metrics is not None and not isinstance(metrics, MetricsConfig):
        raise TypeError(f"Trainer: metrics must be a jaxpar.metrics.MetricsConfig, got {type(metrics).__name__}; "
                        "e.g. metrics=MetricsConfig(dir='runs/exp1')")
    window = check_profile_steps(profile_steps)
    if window is not None and metrics is None:
        raise ValueError(f"Trainer: profile_steps={window} writes its trace under the run directory; pass "
                         "metrics=MetricsConfig(dir=...) as well")
    if metrics is None:
        return None, None
    return MetricsLogger(metrics), ProfileWindow(metrics.profile_dir, window) if window else None
