"""What every ``jaxpar`` command shares: the parser whose errors are one paragraph, the
``type=`` functions that name the flag and the value, and `UserError` (exit code 2).

A user's mistake ends a command with one paragraph on stderr and exit code 2, never a
traceback: argparse's own errors through `Parser.error`, the commands' refusals as
`UserError`, and the ``ValueError``/``TypeError`` jaxpar's own checks raise (`jaxpar_raised`).
``jaxpar/cli/__init__.py`` turns them into that paragraph in one place.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import traceback
from collections.abc import Sequence

DEFAULT_DEVICES = 8       # simulated CPU devices when the machine has no accelerator
DEFAULT_BATCH = 32
# What jaxpar's validation of a config, a mesh or a flag raises: while the flags are being
# resolved into a job, these are the user's mistakes, never a bug.
JOB_ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError)


class UserError(Exception):
    """A mistake in the command line or its files; ``main`` prints it as one paragraph, exit 2."""


def refuse(message: str) -> None:
    raise UserError(message)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one paragraph (no usage block) and exit code 2."""

    def error(self, message: str):
        head, _, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith("--"):
            message = rest     # our type= functions name the flag and the value themselves
        elif rest == "expected one argument":
            message += f"; a value that starts with '-' is written {head.split()[-1].split('/')[0]}=VALUE"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def jaxpar_raised(error: BaseException) -> bool:
    """Whether a ``raise`` statement in jaxpar's own code raised ``error`` (a message jaxpar wrote)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return os.path.abspath(last.filename).startswith(root) and (last.line or "").lstrip().startswith("raise")


def set_simulated_devices(n: int) -> None:
    """Ask for ``n`` CPU devices; only possible before JAX starts a backend. Harmless on GPU/TPU."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX already runs (an in-process call): the devices it has are used, and checked


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether a flag whose default is None / False / [] was given."""
    return getattr(args, dest, None) not in (None, False, [])


def flags_text(dests: Sequence[str]) -> str:
    """``["zero_levels", "schedule"]`` -> ``"--zero-levels, --schedule"``."""
    return ", ".join("--" + d.replace("_", "-") for d in dests)


def verb(dests: Sequence[str]) -> str:
    return "applies" if len(dests) == 1 else "apply"


def print_text(text: str, file=None) -> None:
    """Print rendered tables as they are (rich would re-wrap them in a narrow log)."""
    print(text, flush=True, file=file)


def number(flag: str, kind: type = int, *, low: float | None = None, above: float | None = None):
    """An argparse ``type=`` for ``flag`` that accepts finite ``kind`` values ``>= low`` / ``> above``.

    Example:
        >>> number("--steps", int, low=1)("4")
        4
    """
    name = "an integer" if kind is int else "a finite number"
    want = name + (f" >= {low:g}" if low is not None else "") + (f" > {above:g}" if above is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not {name}; expected {want}") from None
        if (not math.isfinite(value) or (low is not None and value < low)
                or (above is not None and value <= above)):
            raise argparse.ArgumentTypeError(f"{flag} {text}: out of range; expected {want}")
        return value

    parse.__name__ = want
    return parse


def check_writable(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written, by creating its folder and a probe file."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        refuse(f"{flag} {path!r} is a directory; give a file path such as {os.path.join(path, 'out.json')!r}")
    folder = os.path.dirname(full)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxpar-probe-"):
            pass
        if os.path.exists(full) and not os.access(full, os.W_OK):
            raise PermissionError(13, "Permission denied", full)
    except OSError as e:
        refuse(f"{flag} {path!r} cannot be written ({e.strerror or e}); choose a path in a folder you can write, "
               f"e.g. {flag} runs/{os.path.basename(full) or 'out.json'}")


def check_mesh(config, devices, *, flag: str) -> None:
    """Refuse a mesh (``flag`` names where it was set) that does not fit ``devices``, with the
    command line's fix: ``--devices N`` runs on the first N of them (the Python API's fix,
    ``devices=jax.devices()[:N]``, is not one a command can take)."""
    import jax

    import jaxpar

    try:
        jaxpar.make_mesh(config, devices)
    except ValueError as e:
        sizes = list(config.mesh.values())
        fewer = math.prod(sizes) if -1 not in sizes else None
        hint = ""
        if fewer is not None and fewer < len(devices) and jax.process_count() == 1:
            hint = f"; or give --devices {fewer} to run on the first {fewer} of them"
        raise ValueError(f"{flag}: {e}{hint}") from None
