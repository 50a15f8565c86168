"""`ProfileWindow`: a ``jax.profiler`` trace of a window of training steps."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import jax


class ProfileWindow:
    """Traces steps ``start`` to ``stop - 1`` (1-based step numbers) into ``directory``.

    The trace starts before step ``start`` is dispatched and stops once step ``stop - 1`` has
    finished on the device (the one wait it adds), so the device work of every step in the
    window is in it. The files are ``directory/plugins/profile/<run>/*.xplane.pb`` (TensorBoard's
    profile plugin / XProf) and ``*.trace.json.gz`` (Perfetto, chrome://tracing).

    Example:
      >>> window = ProfileWindow("runs/exp1/profile", (10, 13))    # doctest: +SKIP
      >>> window.before(step)   # ... run the step ...
      >>> window.after(step, metrics)                               # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike, steps: tuple[int, int]):
        self.directory = os.fspath(directory)
        if jax.process_count() > 1:     # processes on one host would write the same file names
            self.directory = os.path.join(self.directory, f"process_{jax.process_index()}")
        self.start, self.stop = steps
        self.active = False
        self.done = False
        self.first = self.last = None    # the first and last steps dispatched since

    def before(self, step: int) -> None:
        """Call before dispatching step ``step``: starts the trace at the window's first step."""
        self.first = step if self.first is None else self.first
        self.last = step
        if not self.active and not self.done and self.start <= step < self.stop:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def annotate(self, step: int):
        """A step marker for the trace viewer while tracing; nothing otherwise."""
        if self.active:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def after(self, step: int, outputs: Any) -> None:
        """Call after dispatching step ``step``: at the window's last step, wait and stop."""
        if self.active and step >= self.stop - 1:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stop a trace still running (a run that ended inside the window). A window the run did
        not trace whole is said, with a warning: steps ran, but it ended before the window's end
        (a window the run started past, resumed after it, was the interrupted run's)."""
        note = self.shortfall()
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
        if note is not None:
            self.done = True    # said once
            warnings.warn(note, stacklevel=2)

    def shortfall(self) -> str | None:
        """What the window misses of its steps when the run ends now, or None."""
        if self.done or self.first is None or self.first >= self.stop or self.last >= self.stop - 1:
            return None
        window = f"Services(profile=({self.start}, {self.stop})) (steps {self.start} to {self.stop - 1})"
        fix = f"run to step {self.stop - 1}, or choose a window inside steps {self.first} to {self.last}"
        if self.active:
            return (f"{window}: the run ended at step {self.last}, so the trace holds steps "
                    f"{max(self.start, self.first)} to {self.last} only; {fix}")
        return f"{window}: the run ended at step {self.last}, before the window: nothing was traced; {fix}"

    def files(self) -> list[str]:
        """The trace files written so far."""
        return sorted(os.path.join(root, name) for root, _, names in os.walk(self.directory) for name in names)
