"""``jaxpar train --config job.yaml [--section.field value ...]`` (and ``jaxpar plan --config
job.yaml``): the command line of a job file.

A ``--config`` file with a job section (``model``, ``data``, ``parallel``, ``train``,
``checkpoint``, ``logging`` or ``eval``) is a job file; one holding ``ParallelConfig`` fields
alone keeps configuring the built-in example. An empty file is refused as an empty job file. Every field of the job is set with a dotted flag;
the example's own flags (``--steps``, ``--mesh``...) are refused with the dotted flag to use
instead, so that no flag is silently ignored.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

JOB_ONLY = ("model", "data", "parallel", "train", "checkpoint", "logging", "eval")

# the example's flags -> the job field that does the same
INSTEAD = {
    "--steps": "--train.steps", "--lr": "--optimizer.lr", "--seed": "--train.seed", "--batch": "--data.batch",
    "--seq-len": "--data.seq_len", "--mesh": "--parallel.mesh", "--hosts": "--parallel.hosts", "--rules": "--parallel.rules",
    "--mode": "--parallel.mode", "--remat": "--parallel.remat", "--optimizer": "--parallel.optimizer",
    "--pipeline": "--parallel.pipeline", "--grad-accum": "--parallel.grad_accum", "--layers": "--model.fields",
    "--embed": "--model.fields", "--heads": "--model.fields", "--scan": "--model.fields",
    "--metrics": "--logging.dir", "--log-dir": "--logging.dir", "--log-every": "--logging.every",
    "--tensorboard": "--logging.tensorboard", "--profile-steps": "--logging.profile_steps",
    "--peak-flops": "--logging.peak_flops",
}
FILE_FLAGS = {"train": ("--config", "--samples", "--devices", "--quiet"), "plan": ("--config",)}


def job_file(argv: Sequence[str]) -> str | None:
    """The job file of a ``train|plan --config FILE`` command line, or None (not a job file)."""
    args = [a for a in argv if a != "--debug"]
    if not args or args[0] not in ("train", "plan"):
        return None
    path = None
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    if path is None or not os.path.isfile(path):
        return None
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None          # the example's --config check reports it (a binary file included)
    if data is None:         # empty, or comments only: refused by name as a job file (JobConfig.load)
        return path
    return path if isinstance(data, dict) and any(k in data for k in JOB_ONLY) else None


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(flags, overrides)``: ``--section.field value`` pairs apart from the other flags."""
    flags, overrides, it = [], [], iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name.startswith("--") and "." in name:
            overrides.append(a)
            if "=" not in a:
                overrides.append(next(it, ""))
        else:
            flags.append(a)
    return flags, overrides


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"jaxpar {command}", description=__doc__.splitlines()[0], exit_on_error=False)
    p.add_argument("--config", required=True, help="the job file")
    p.add_argument("--samples", type=int, default=0, help="greedy samples decoded at the end (default 0)")
    p.add_argument("--devices", type=int, help="use the first N devices (simulated CPU devices without one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def parse_job_command(command: str, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(flags, overrides)`` of ``jaxpar train|plan --config JOB ...`` (``argv`` without the
    command); a flag the job file's form does not take raises ``ValueError`` naming what to use."""
    flags, overrides = split_overrides(argv)
    for a in flags:
        name = a.split("=", 1)[0]
        if name in INSTEAD:
            raise ValueError(f"{name} configures the built-in example; in a job file run set "
                             f"{INSTEAD[name]} (or the field in the file)")
    args, unknown = _parser(command).parse_known_args(flags)
    unknown += [f for f in FILE_FLAGS["train"] if f not in FILE_FLAGS[command]
                and getattr(args, f[2:]) not in (None, False, 0)]
    if unknown:
        raise ValueError(f"unrecognized arguments {' '.join(unknown)}; 'jaxpar {command}' of a job file takes "
                         f"{', '.join(FILE_FLAGS[command])} and --section.field value overrides")
    if args.samples < 0:
        raise ValueError(f"--samples {args.samples}: out of range; expected an integer >= 0 (0: no samples)")
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices {args.devices}: out of range; expected an integer >= 1 (leave it out to use "
                         "every device)")
    return args, overrides
