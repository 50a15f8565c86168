"""The ``jaxpar`` command: train, plan, report, launch, k8s, ckpt, data, goodput.

One module per command group (``train``, ``plan``, ``report``, ``ckpt``, ``data``,
``launch``, ``goodput``), each registering its sub-parser; this module dispatches to them and turns a
user's mistake into one paragraph on stderr and exit code 2 (`run_guarded`), for every command.

``jaxpar train`` with flags and ``jaxpar train --config job.yaml`` make the same value, a
`jaxpar.job.JobConfig`, and run it with `jaxpar.job.run.run_job`; ``jaxpar plan`` and
``jaxpar report`` build the same job.

Every flag is checked before any work starts: a value out of range, a missing or malformed
config file, an output path that cannot be written, or a flag that the chosen command would
ignore ends the command with one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from jaxpar.deprecation import module_getattr
from jaxpar.cli.common import DEFAULT_DEVICES, JOB_ERRORS, Parser, UserError, jaxpar_raised, set_simulated_devices
from jaxpar.cli.jobfile import job_file, parse_job_command

__all__ = ["main", "make_parser", "UserError"]

_DESCRIPTION = """\
jaxpar: SPMD parallel training with JAX.

'jaxpar COMMAND --help' lists a command's flags. A mistaken flag or value ends the command
with exit code 2 and one paragraph naming it; 'jaxpar --debug COMMAND ...' shows the Python
traceback instead.
"""


# Commands that need no JAX: run alone, their parser is built without the others, whose modules
# import JAX, Flax and orbax (a second and a half), so the launcher starts in a fraction of one.
_LIGHT = ("launch", "k8s")


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``jaxpar`` argument parser with every subcommand (with ``command`` one of `_LIGHT`:
    that command's only)."""
    from jaxpar.cli import launch

    parser = Parser(prog="jaxpar", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in _LIGHT:
        (launch.add_launch_parser if command == "launch" else launch.add_k8s_parser)(sub)
        return parser
    from jaxpar.cli import ckpt, data, goodput, plan, report, train

    train.add_parser(sub)
    plan.add_parser(sub)
    report.add_parser(sub)
    launch.add_launch_parser(sub)
    launch.add_k8s_parser(sub)
    ckpt.add_parser(sub)
    data.add_parser(sub)
    goodput.add_parser(sub)
    return parser


def _unknown_flags(command: str, unknown: Sequence[str]) -> str:
    text = f"unrecognized arguments {' '.join(unknown)}"
    train_only = sorted({u.split("=")[0] for u in unknown} & {"--steps", "--lr", "--seed"})
    if train_only and command != "train":
        verb = "is" if len(train_only) == 1 else "are"
        text += (f"; {', '.join(train_only)} {verb} for 'jaxpar train' only: nothing 'jaxpar {command}' prints "
                 "depends on them")
    return f"{text}; 'jaxpar {command} --help' lists its flags"


def _fail(name: str, message: str) -> int:
    print(f"jaxpar {name}: error: {message}", file=sys.stderr)
    return 2


def run_guarded(name: str, work: Callable[[], int | None], *, debug: bool = False) -> int:
    """``work()``'s exit code; a user's mistake is one paragraph on stderr and exit code 2: a
    `UserError`, an argparse error, or a ``ValueError``/``TypeError``... that jaxpar's own checks
    raised (one raised elsewhere is a bug and keeps its traceback, as everything does under
    ``debug``)."""
    try:
        return int(work() or 0)
    except (UserError, argparse.ArgumentError) as e:
        if debug:
            raise
        return _fail(name, str(e))
    except JOB_ERRORS as e:
        if debug or not jaxpar_raised(e):
            raise
        return _fail(name, str(e))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``jaxpar`` command; returns the exit code (2 for a mistake in the input).

    Example:
        >>> main(["train", "--batch", "0"])  # doctest: +SKIP
        jaxpar train: error: --batch 0: out of range; expected an integer >= 1 ...
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if job_file(argv):       # train|plan --config JOB.yaml: the job's own flags and --section.field overrides
        from jaxpar.cli import plan, train

        command = next(a for a in argv if a in ("train", "plan"))
        rest = [a for a in argv if a not in (command, "--debug")]
        run_file = train.train_file if command == "train" else plan.plan_file
        return run_guarded(command, lambda: run_file(*parse_job_command(command, rest)), debug="--debug" in argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    try:
        args, unknown = make_parser(first if first in _LIGHT else None).parse_known_args(argv)
    except SystemExit as e:   # --help (0) or a flag argparse refused (2, the paragraph is printed)
        return e.code if isinstance(e.code, int) else 2
    if unknown:
        return _fail(args.command, _unknown_flags(args.command, unknown))
    if hasattr(args, "devices"):
        set_simulated_devices(args.devices or DEFAULT_DEVICES)
    return run_guarded(getattr(args, "cli_name", args.command), lambda: args.func(args), debug=args.debug)


__getattr__ = module_getattr(__name__)   # 0.1.0's names of this module (CHANGELOG.md): an error saying what to use
