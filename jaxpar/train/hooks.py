"""The hook protocol of the loop, and the services that need nothing but it: the non-finite
read, preemption, and a user's function called every N steps.

A hook is an object with any of four methods, each called with the Trainer: ``on_start``
(the state is built and resumed), ``before_step(trainer, step)`` (before dispatch),
``after_step(trainer, step, metrics)`` (after it; ``metrics`` are device arrays: reading one
waits for the step) and ``on_close``. The Trainer walks its hooks in the order of
`jaxpar.train.Services.build` and owns none of their state; a service owns no loop.

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
from typing import Any

import jax

import jax.numpy as jnp

from jaxpar.metrics import read


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


class Hook:
    """A service around the loop: override what it needs (every method does nothing here).

    >>> class PrintLoss(Hook):
    ...     def after_step(self, trainer, step, metrics):
    ...         if step % 100 == 0:
    ...             print(step, float(metrics["loss"]))
    >>> services = jaxpar.Services(hooks=(PrintLoss(),))                   # doctest: +SKIP
    """

    service: str | None = None
    """The service a hook provides, by which the Trainer finds it (`Trainer.service`):
    ``"checkpoint"``, ``"preemption"``, ``"nonfinite"``, ``"metrics"``, ``"profile"``; a hook that
    replaces a built-in one says which (None: a hook of the user's own)."""

    def on_start(self, trainer) -> None:
        """The Trainer's state is built (and resumed, when a checkpoint hook came first)."""

    def before_step(self, trainer, step: int) -> None:
        """Step ``step`` is about to be dispatched."""

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` was dispatched; ``metrics`` are its device arrays."""

    def on_close(self, trainer) -> None:
        """The Trainer closes (``trainer`` is None when its construction failed)."""


class EveryHook(Hook):
    """``fn(step, metrics)`` after every step whose number is a multiple of ``every``
    (`jaxpar.Trainer.add_hook`)."""

    def __init__(self, fn: Callable[[int, dict], None], every: int = 1):
        if not callable(fn):
            raise TypeError(f"Trainer.add_hook: hook must be callable as hook(step, metrics), got {type(fn).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"Trainer.add_hook: every={every!r} must be a positive int (1 = after every step)")
        self.fn, self.every = fn, every

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        if not step % self.every:
            self.fn(step, metrics)


CHECK_EVERY = 100      # the finite flags are read at least this often


class NonfiniteHook(Hook):
    """Keeps each step's finite flag on the device and reads them in bulk: every ``CHECK_EVERY``
    steps, and whenever `check` is called (before every save, at logging). ``policy``
    ``"stop"`` raises ``FloatingPointError`` naming the first bad step; ``"skip"`` (the step
    kept the previous state) counts them in ``skipped``.

    >>> hook = NonfiniteHook("stop")
    >>> hook.after_step(None, 1, {"finite": jnp.asarray(True)}); hook.check()
    """

    service = "nonfinite"

    def __init__(self, policy: str = "stop"):
        if policy not in ("stop", "skip"):
            raise ValueError(f"NonfiniteHook: policy={policy!r}; choose 'stop' or 'skip'")
        self.policy = policy
        self.pending: list = []          # (step, device flag) not yet read
        self.skipped: list[int] = []

    def __repr__(self) -> str:
        return f"NonfiniteHook({self.policy!r})"

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        self.pending.append((step, metrics["finite"]))
        if not step % CHECK_EVERY:
            self.check()

    def check(self) -> None:
        """Read the flags of the steps since the last read (one wait)."""
        if not self.pending:
            return
        flags = read(_stacked([f for _, f in self.pending]))[:len(self.pending)]
        bad = [step for (step, _), ok in zip(self.pending, flags) if not ok]
        self.pending.clear()
        if not bad:
            return
        self.skipped.extend(bad)
        if self.policy == "stop":
            raise FloatingPointError(
                f"Trainer: step {bad[0]} had a non-finite loss or gradient norm"
                + (f" (and steps {bad[1:]})" if bad[1:] else "") + "; nothing after it was saved, so every "
                "checkpoint holds finite values and a restart resumes from the newest one. Inspect that batch, "
                "lower the learning rate, or pass Services(nonfinite='skip') to skip such updates and go on")


def _stacked(flags: list) -> jax.Array:
    """The device flags as one array, so reading them is one transfer, not one per step. The
    list is padded to a power of two (with its last flag) so at most a few tiny programs compile."""
    size = 1 << (len(flags) - 1).bit_length()
    return _stack(*flags, *[flags[-1]] * (size - len(flags)))


@jax.jit
def _stack(*flags):
    return jnp.stack(flags)


class PreemptionHook(Preemption, Hook):
    """On SIGTERM (`Preemption`), the Trainer's checkpoint service saves the step reached and the
    run leaves with `Preempted` (exit code 0); ``evaluate`` asks between its batches (`asked`)."""

    service = "preemption"

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.reached(step):
            self.leave(trainer, metrics)

    def leave(self, trainer, metrics: dict[str, Any] | None) -> None:
        """Save the step reached (unless it is saved, or nothing was trained), wait for it, give
        SIGTERM back and raise `Preempted` (carrying ``metrics`` for ``fit`` to log)."""
        checkpoint = trainer.service("checkpoint")
        trainer.check_finite()
        trained = trainer.step_count > 0
        checkpoint.diverge()
        if trained:
            checkpoint.save_unless_saved(trainer)
        checkpoint.checkpointer.close()
        self.close()      # saved: a SIGTERM from now on gets its default action
        stop = Preempted(trainer.step_count, checkpoint.checkpointer.directory, saved=trained)
        stop.metrics = metrics
        raise stop

    def on_close(self, trainer) -> None:
        self.close()
