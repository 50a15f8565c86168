"""What a run logs and where: `MetricsConfig`, and the profiled step window."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where and how often ``Trainer.fit`` writes metrics.

    Example:
      >>> cfg = MetricsConfig(dir="runs/demo", every=10, tensorboard=False, peak_flops=989e12)
      >>> cfg.jsonl_path
      'runs/demo/metrics.jsonl'
    """

    dir: str | os.PathLike
    """The run directory: ``metrics.jsonl``, TensorBoard event files, and ``profile/`` traces."""
    every: int = 10
    """Log every ``every`` steps (and the first and last step). Metrics stay on the device in
    between: only logging steps wait for the device. ``fit(log_every=...)`` overrides it."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the ``tb`` extra: ``pip install 'jaxpar[tb]'``)."""
    learning_rate: float | Callable[[Any], Any] | None = None
    """The learning rate or the optax schedule given to the optimizer, to log ``lr``. Without it
    ``lr`` is read from an ``optax.inject_hyperparams`` state when there is one."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for the dtype trained in, for MFU (None: MFU is not logged)."""
    flops_per_token: float | None = None
    """Model FLOPs of one training step per token (forward + backward), for MFU. None: the
    model's own ``flops_per_token(seq_len)`` (the Llama and GPT models have one), else the
    FLOPs XLA counts for the compiled step, logged with ``mfu_source: "xla"``."""
    tokens_per_example: int | None = None
    """Tokens in one example, for tokens/s. None: the second dimension of the batch's first
    integer array with two or more dimensions (token ids ``(batch, seq)``), else 1."""

    def __post_init__(self):
        if not isinstance(self.dir, (str, os.PathLike)) or not os.fspath(self.dir):
            raise TypeError(f"MetricsConfig: dir={self.dir!r} must be a non-empty path, e.g. dir='runs/exp1'")
        _positive_int("every", self.every)
        if not isinstance(self.tensorboard, bool):
            raise TypeError(f"MetricsConfig: tensorboard={self.tensorboard!r} must be True or False")
        if self.tensorboard:
            require_tensorboard("MetricsConfig(tensorboard=True)")
        lr = self.learning_rate
        if lr is not None and not callable(lr):
            _positive_number("learning_rate", lr, allow_zero=True)
        if self.peak_flops is not None:
            _positive_number("peak_flops", self.peak_flops)
        if self.flops_per_token is not None:
            _positive_number("flops_per_token", self.flops_per_token)
        if self.tokens_per_example is not None:
            _positive_int("tokens_per_example", self.tokens_per_example)

    @property
    def jsonl_path(self) -> str:
        """The JSON-lines file: one object per logged step."""
        return os.path.join(os.fspath(self.dir), "metrics.jsonl")

    @property
    def profile_dir(self) -> str:
        """Where the ``Services(profile=...)`` window's traces go (TensorBoard's profile plugin layout)."""
        return os.path.join(os.fspath(self.dir), "profile")


def require_tensorboard(what: str) -> None:
    """Raise a ``ValueError`` naming the fix when the ``tensorboard`` package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{what} needs the tensorboard package, which is not installed; "
                         "pip install 'jaxpar[tb]' (or drop tensorboard=True: metrics.jsonl is always "
                         "written)")


def check_profile_steps(steps: Any) -> tuple[int, int] | None:
    """``(start, stop)`` checked: trace steps ``start`` to ``stop - 1`` (1-based step numbers,
    half-open like a slice). Accepts a pair of ints or the text ``"10:13"``; None passes through.

    Example:
      >>> check_profile_steps("10:13")
      (10, 13)
    """
    if steps is None:
        return None
    fix = "give (start, stop) with 1 <= start < stop, e.g. (10, 13) or \"10:13\" for steps 10, 11 and 12"
    if isinstance(steps, str):
        head, sep, tail = steps.partition(":")
        try:
            if not sep:
                raise ValueError
            steps = (int(head), int(tail))
        except ValueError:
            raise ValueError(f"the profile window {steps!r} is not START:STOP; {fix}") from None
    if (not isinstance(steps, (tuple, list)) or len(steps) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
        raise TypeError(f"the profile window {steps!r} is not a pair of ints; {fix}")
    start, stop = steps
    if not 1 <= start < stop:
        raise ValueError(f"the profile window {tuple(steps)!r} is empty or negative; {fix}")
    return int(start), int(stop)


def profile_window_outside(window: tuple[int, int], first: int, last: int) -> tuple[int, int] | None:
    """None when a run of steps ``first`` to ``last`` reaches the end of ``window`` (steps
    ``start`` to ``stop - 1``); else a one-step window inside the run to suggest instead. The one
    rule of ``jaxpar train --profile-steps`` (the run: steps 1 to ``--steps``) and ``Trainer.fit``
    (the steps that call runs).

    Example:
      >>> profile_window_outside((10, 13), 1, 5), profile_window_outside((3, 5), 1, 5)
      ((5, 6), None)
    """
    start, stop = window
    if stop - 1 <= last:
        return None
    inside = min(max(start, first), last)
    return inside, inside + 1


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MetricsConfig: {name}={value!r} must be an int >= 1")


def _positive_number(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"MetricsConfig: {name}={value!r} must be a finite number {bound}")
