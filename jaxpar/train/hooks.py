"""The services around the loop: preemption, metric writers and the profile window.

SIGTERM handling is a flag in one process and JAX's preemption sync point across several, so
every process stops at the same step.
"""

from __future__ import annotations

import signal
import sys
import threading

import jax

from jaxpar.metrics import MetricsConfig, MetricsLogger, ProfileWindow, check_profile_steps


class Preempted(SystemExit):
    """Raised by ``Trainer.step`` after a SIGTERM: the state of ``step`` is saved; exit code 0."""

    def __init__(self, step: int, directory: str):
        super().__init__(0)
        self.step, self.directory = step, directory
        print(f"jaxpar: preempted (SIGTERM): saved step {step} to {directory}; restart to resume", file=sys.stderr)


class Preemption:
    """Where a SIGTERM is noticed: a flag set by a signal handler (one process), or JAX's
    preemption sync point, which makes every process stop at the same step (several)."""

    def __init__(self):
        self.flag = threading.Event()
        self.multi = jax.process_count() > 1
        if not self.multi and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, lambda *_: self.flag.set())

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.flag.is_set()


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
