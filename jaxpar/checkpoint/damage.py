"""What a checkpoint that does not read back, or cannot be written, becomes: one error naming it.

orbax and tensorstore raise dozens of exception kinds for a damaged step (a file missing,
truncated or garbage) and for a failed write (a full disk, a quota, permissions), wrapped in
their own layers and echoed in their logs from their threads. ``reading`` and ``writing`` turn
each into one `CheckpointDamagedError` / `CheckpointWriteError` naming the directory, the step,
the stored leaf and the cause; ``check_meta`` and ``check_values`` raise the former for a step
that reads back with other values than were saved (its checksums, `jaxpar.checkpoint.checksum`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp

from jaxpar.checkpoint import checksum
from jaxpar.checkpoint import state as st
from jaxpar.checkpoint.echoes import Echoes, first_line, os_error, release_frames

__all__ = ["CheckpointDamagedError", "CheckpointWriteError", "META", "check_meta", "check_values", "damage_of",
           "reading", "writing"]


# tensorstore names the key it failed to read (``params.up/0.0``: the array ``params/up``, chunk
# ``0.0``); orbax's wrapper only holds the array's spec, whose inner ``path`` is that array's key.
_READ_KEY = re.compile(r'Error reading "([^"]+)" in OCDBT')
_SPEC_PATH = re.compile(r"""['"]path['"]\s*:\s*['"]([^'"/\\][^'"\\]*)/['"]""")
_SECTION = {"params": "parameter", "opt_state": "optimizer-state leaf", "rest": "model-state leaf"}
# orbax's wrapper of a failed array read: an index slice and the repr of a TensorStore's bound method
_WRAPPER = "Encountered error while reading array index"


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from, outermost first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def damage_of(error: BaseException) -> tuple[str | None, str]:
    """``(leaf, account)`` of a failed read: the stored leaf's path (``opt_state/0/nu/up``; None
    when the error names none) and one clean line saying what failed (the innermost error's first
    line, without orbax's index slice and TensorStore reprs or tensorstore's spec dump)."""
    chain = _causes(error)
    told = [e for e in chain if str(e).strip() and not str(e).startswith(_WRAPPER)] or chain
    root = told[-1]
    account = first_line(root).split(". See full TensorStore details")[0]
    key = None
    for pattern in (_READ_KEY, _SPEC_PATH):
        found = next((m[1] for e in reversed(chain) if (m := pattern.search(str(e)))), None)
        if found:
            key = found.rsplit("/", 1)[0] if pattern is _READ_KEY and "/" in found else found
            break
    return (key.replace(".", "/") if key else None), f"{type(root).__name__}: {account}"


class CheckpointDamagedError(ValueError):
    """A committed step that does not read back: names the step directory, the stored leaf whose
    read failed (``leaf``, its path, when the failure names one) and the damage.

    ``advice`` replaces the default way out (resume from the newest intact step)."""

    def __init__(self, directory: str, step: int, error: BaseException, advice: str | None = None):
        self.step = step
        self.leaf, account = damage_of(error)
        what = _SECTION.get(self.leaf.split("/")[0], "array") if self.leaf else None
        self.damage = f"{what} {self.leaf}: {account}" if self.leaf else account
        advice = advice or (f"Resume from the newest intact step with Trainer(..., services=jaxpar.Services("
                            f"checkpoint=jaxpar.CheckpointConfig(dir=..., resume='newest_intact'))) "
                            f"(a job file: `jaxpar train --config JOB --checkpoint.resume newest_intact`) or read "
                            f"an earlier step with restore(trainer, {directory!r}, step=N) "
                            f"(`jaxpar ckpt inspect {directory}` lists the complete steps), or delete "
                            f"{os.path.join(directory, str(step))}")
        super().__init__(f"checkpoint step {step} in {directory} is damaged ({self.damage}); the steps before "
                         f"it are untouched. {advice}")


@contextlib.contextmanager
def reading(directory, step: int, advice: str | None = None) -> Iterator[None]:
    """Read step ``step`` of ``directory`` inside this block: whatever orbax or tensorstore raise
    for a damaged file (missing, truncated, garbage; dozens of exception kinds) becomes one
    `CheckpointDamagedError` naming the step and the damage. The failed read's echoes (see
    `jaxpar.checkpoint.echoes`) are awaited and dropped inside the block."""
    echoes = Echoes().install()
    try:
        yield
    except (CheckpointDamagedError, st.CheckpointMismatchError):
        raise
    except Exception as e:
        error = CheckpointDamagedError(str(directory), step, e, advice)
        release_frames(e)
        echoes.settle()
        raise error from e
    finally:
        echoes.remove()


class CheckpointWriteError(OSError, ValueError):
    """A save that could not be written (disk full, quota, permissions): names the directory, the
    step and the cause. Nothing of that step was committed; the steps before it are intact.
    ``errno`` is the operating system's error number when there is one (``errno.ENOSPC``)."""

    def __init__(self, directory: str, step: int | None, error: BaseException, steps: list[int]):
        found = os_error(error)
        cause = found[1] if found else f"{type(error).__name__}: {first_line(error)}"
        what = f"step {step}" if step is not None else "a step"
        kept = f"the steps before it ({sorted(steps)}) are intact" if steps else "no earlier step was saved"
        self.step = step
        super().__init__(found[0] if found else None,
                         f"saving checkpoint {what} to {directory} failed: {cause}. Nothing of {what} was "
                         f"committed; {kept}. Free space on that disk (or give another checkpoint directory) "
                         "and save again")

    def __str__(self) -> str:
        return self.strerror


def _is_io_error(error: BaseException) -> bool:
    return os_error(error) is not None


@contextlib.contextmanager
def writing(manager: ocp.CheckpointManager, directory, step: int | None, echoes: Echoes | None = None,
            *, any_error: bool = False) -> Iterator[None]:
    """Save or wait for ``step`` of ``directory`` inside this block: a write that fails (an
    ``OSError`` or tensorstore's error with an OS error code; with ``any_error``, anything,
    as when waiting for a save orbax runs in its own threads) becomes one `CheckpointWriteError`
    naming the directory, the step and the cause. ``echoes``: the writer's installed `Echoes`
    (default: installed for this block), whose held orbax logs of the failure are dropped."""
    own = echoes is None
    echoes = Echoes(hold_orbax=True).install() if own else echoes
    try:
        yield
    except CheckpointWriteError:
        raise
    except Exception as e:
        if not (any_error or _is_io_error(e)):
            raise
        error = CheckpointWriteError(str(directory), step, e, _committed(manager))
        with contextlib.suppress(Exception):   # orbax keeps the failure for each layer that waits for it
            manager.check_for_errors()          # too (its finalize thread, its checkpointer): the same one
        release_frames(e)
        echoes.settle()
        echoes.drop_held()
        raise error from e
    else:
        if any_error:       # every save waited for was committed: what orbax logged was not about them
            echoes.emit_held()
    finally:
        if own:
            echoes.remove()
            echoes.emit_held()


def _committed(manager: ocp.CheckpointManager) -> list[int]:
    try:
        manager.reload()
        return list(manager.all_steps())
    except Exception:   # the disk that failed the write may fail this too: the message goes without
        return []


META = ("step", "data_state", "jaxpar_version", checksum.KEY, checksum.ROWS_KEY)   # what a step's meta holds


def check_meta(directory, step: int, meta: dict[str, Any], advice: str | None = None) -> None:
    """A step's ``meta`` holds the entries jaxpar writes and no other: an unknown one is a name
    damaged (a checksum record under another name would leave its check out), so
    `CheckpointDamagedError` names it."""
    unknown = sorted(k for k in meta if k not in META)
    if unknown:
        raise CheckpointDamagedError(str(directory), step, ValueError(
            f"its meta item has unknown entries {unknown} (it holds {list(META)}): a damaged name; a checksum "
            "record under another name would go unchecked"), advice)


def check_values(directory, step: int, flat: dict[str, Any], meta: dict[str, Any], advice: str | None = None) -> None:
    """Raise `CheckpointDamagedError` (with ``advice``) naming the leaves of ``flat`` (as read from
    step ``step``) whose checksums differ from those saved in ``meta`` (a step saved without them:
    nothing to check), or what is wrong with the record itself (`checksum.record_damage`: it must
    cover exactly the leaves read; `check_meta`)."""
    check_meta(directory, step, meta, advice)
    if checksum.KEY not in meta:
        return
    saved = meta[checksum.KEY]
    damage = checksum.record_damage(saved, flat)
    if damage:
        raise CheckpointDamagedError(str(directory), step, ValueError(damage), advice)
    bad = checksum.differing(flat, saved)
    if bad:
        listing = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointDamagedError(str(directory), step, ValueError(
            f"{len(bad)} array(s) read back without an error but with other values than were saved (their "
            f"checksums differ): {listing}"), advice)
