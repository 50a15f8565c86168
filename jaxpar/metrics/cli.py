"""The ``jaxpar train`` flags that watch a run: ``--log-dir``, ``--tensorboard``, ``--log-every``,
``--profile-steps``, ``--peak-flops``; and the `MetricsConfig` they describe."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

from jaxpar.metrics.config import MetricsConfig, check_profile_steps, require_tensorboard

DEFAULT_LOG_DIR = "runs/train"


def _profile_steps(text: str) -> tuple[int, int]:
    try:
        return check_profile_steps(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--profile-steps {text!r} is not START:STOP with 1 <= START < STOP; e.g. --profile-steps 10:13 "
            "traces steps 10, 11 and 12") from None


def _every(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--log-every {text!r} is not an integer >= 1; e.g. --log-every 10")
    return int(text)


def _peak(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--peak-flops {text!r} is not a number > 0; give one device's peak "
                                         "FLOP/s, e.g. --peak-flops 989e12 for an H100 SXM in bf16")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the flags to ``jaxpar train``'s parser."""
    g = p.add_argument_group("watching the run")
    g.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="run directory: metrics.jsonl, TensorBoard event "
                   "files, profile traces (default %(default)s; '' = none)")
    g.add_argument("--log-every", type=_every, default=10, help="log every N steps (default %(default)s); "
                   "the device is read only then")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to --log-dir "
                   "(pip install 'jaxpar[tb]')")
    g.add_argument("--profile-steps", type=_profile_steps, metavar="START:STOP",
                   help="jax.profiler trace of steps START..STOP-1 under LOG_DIR/profile")
    g.add_argument("--peak-flops", type=_peak, help="peak FLOP/s of one device, for MFU (default: the datasheet table for this device and the compute dtype; none for CPU: MFU n/a)")


def mistake(args: argparse.Namespace, steps: int) -> str | None:
    """The paragraph for a combination of these flags that cannot work, or None."""
    if not args.log_dir:
        given = [f for f, on in (("--tensorboard", args.tensorboard), ("--profile-steps", args.profile_steps)) if on]
        if given:
            verb = "writes" if len(given) == 1 else "write"
            return f"{' and '.join(given)} {verb} into the run directory, but --log-dir is ''; give --log-dir DIR"
    if args.profile_steps and args.profile_steps[1] - 1 > steps:
        start, stop = args.profile_steps
        return (f"--profile-steps {start}:{stop} traces steps {start} to {stop - 1}, but the run has --steps {steps}; "
                f"choose a window inside it, e.g. --profile-steps {min(start, steps)}:{min(start, steps) + 1}")
    if args.tensorboard:
        try:
            require_tensorboard("--tensorboard")
        except ValueError as e:
            return str(e)
    return _unwritable(args.log_dir) if args.log_dir else None


def _unwritable(folder: str) -> str | None:
    """Why ``--log-dir folder`` cannot hold the run's files (probed by creating one), or None."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxpar-probe-"):
            pass
    except OSError as e:
        return (f"--log-dir {folder!r} cannot be written ({e.strerror or e}); choose a folder you can write, "
                "e.g. --log-dir runs/exp1")
    return None


def metrics_config(args: argparse.Namespace, learning_rate: float | Callable[[Any], Any] | None = None,
                   dtype: str = "float32") -> MetricsConfig | None:
    """The `MetricsConfig` of the flags (None with ``--log-dir ''``). Without ``--peak-flops``
    the peak comes from `jaxpar.report.peak_flops` for this device and ``dtype`` (none on CPU)."""
    if not args.log_dir:
        return None
    return MetricsConfig(dir=os.fspath(args.log_dir), every=args.log_every, tensorboard=args.tensorboard,
                         learning_rate=learning_rate, peak_flops=args.peak_flops or device_peak(dtype))


def device_peak(dtype: str = "float32") -> float | None:
    """The datasheet peak FLOP/s of this process's first device in ``dtype``, or None (a CPU, an
    unknown device)."""
    import jax

    from jaxpar.report import peak_flops

    return peak_flops(jax.devices()[0].device_kind, dtype)
