"""The checkpoint service: save every N steps, resume when the Trainer starts, retire the steps
a restore leaves behind, and keep a row source's tables with each step.

`CheckpointHook` is built from a `jaxpar.train.CheckpointConfig` (`jaxpar.train.Services`);
`save_now` and `restore_rows` are what ``Trainer.save`` / ``Trainer.restore`` call with or
without one. Everything here goes through the Trainer's public views (``plan``, ``state``,
``mesh``, ``step_count``, ``row_path``).
"""

from __future__ import annotations

import time
from typing import Any

from jaxpar.checkpoint import Checkpointer, restore_rows as read_rows, restore_state, save_state
from jaxpar.train.hooks import Hook


class CheckpointHook(Hook):
    """Opens ``config.dir`` when built (a bad directory is refused before anything is planned),
    resumes the newest complete step at ``on_start``, saves every ``config.save_every`` steps.

    >>> hook = CheckpointHook(CheckpointConfig(dir="ckpt", save_every=10))   # doctest: +SKIP
    >>> hook.checkpointer.directory                                          # doctest: +SKIP
    """

    service = "checkpoint"

    def __init__(self, config):
        self.config = config
        self.checkpointer = Checkpointer(config.dir, save_every=config.save_every, keep=config.keep,
                                         resume=config.resume)
        self.diverges: tuple[int, bool] | None = None    # (step, from elsewhere) after a restore
        self.local = None
        if config.local_dir is not None:
            from jaxpar.checkpoint.local import LocalTier

            self.local = LocalTier(config.local_dir, run=self.checkpointer.directory, peer=config.peer)

    def __repr__(self) -> str:
        return f"CheckpointHook({self.config!r})"

    def on_start(self, trainer) -> None:
        """Resume the newest complete step, if any (with its row tables: a damaged table is a
        damaged step): from the local tier when it holds a step every process can get that is at
        least as new as the persistent tier's newest, else from the persistent tier."""
        if self.local is not None:
            _check_rows_for_local(trainer, self.config)
            from jaxpar.checkpoint.manager import complete_steps

            newest = max(complete_steps(self.checkpointer.manager), default=None)
            resumed = self.local.resume(trainer.state, trainer.mesh, newer_than=newest)
            if resumed is not None:
                step = int(resumed[1]["step"])
                rows = trainer.row_path
                if rows is not None:
                    rows.restore(step, lambda: resumed[2], self.local.root)
                trainer.state = resumed[0]
                return
        resumed = self.checkpointer.resume(trainer.state, trainer.mesh, rows=trainer.row_path is not None)
        if resumed is not None:
            restore_rows(trainer, int(resumed[1]["step"]), None, self.checkpointer, *resumed[2:])
            trainer.state = resumed[0]
        if self.local is not None:       # local steps past the one resumed are of another history now
            self.local.drop_after(trainer.step_count)

    def before_step(self, trainer, step: int) -> None:
        self.diverge()           # the first step after a restore: a new history starts

    def after_step(self, trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.config.save_every and not step % self.config.save_every:
            trainer.check_finite()          # a step that did not update must not pass silently into a save
            self.save_unless_saved(trainer)
        if self.local is not None and not step % self.config.local_every:
            trainer.check_finite()
            start = time.perf_counter()
            rows = trainer.row_path
            self.local.save(trainer.step_count, trainer.state, rows=None if rows is None else rows.snapshot_tables())
            trainer.save_s += time.perf_counter() - start

    def save_unless_saved(self, trainer) -> None:
        if trainer.step_count not in self.checkpointer.manager.all_steps():
            save_now(trainer, checkpointer=self.checkpointer)

    def restored(self, step: int, elsewhere: bool) -> None:
        """The Trainer took ``step`` (from another directory: ``elsewhere``): when training goes on,
        the steps after it (and it, from elsewhere) are retired (`diverge`)."""
        self.diverges = (step, elsewhere)

    def diverge(self) -> None:
        """Training goes on after a restore: move aside the steps of the directory that hold the
        history left (`jaxpar.checkpoint.Checkpointer.retire_after`, with a warning)."""
        if self.diverges is not None:
            step, elsewhere = self.diverges
            self.diverges = None
            self.checkpointer.retire_after(step, including=elsewhere)
            if self.local is not None:
                self.local.drop_after(step)

    def on_close(self, trainer) -> None:
        try:
            if self.local is not None:
                self.local.close()
        finally:
            self.checkpointer.close()


def _check_rows_for_local(trainer, config) -> None:
    """A row source whose servers keep their own state at each checkpoint (``save(step)``, as
    `jaxpar.ps.ServerRows`) has no state of a local step to go back to: refused, naming both."""
    rows = trainer.row_path
    if rows is not None and getattr(rows.source, "save", None) is not None:
        raise ValueError(
            f"Trainer: CheckpointConfig(local_dir=..., local_every={config.local_every}) with the row source "
            f"{type(rows.source).__name__}, whose servers save their own tables at persistent checkpoints only: a "
            "local step would resume dense state newer than the servers' tables. Drop local_dir (the persistent "
            "tier saves both together), or use a row source whose tables the Trainer saves (jaxpar.ps.HostRows)")


def save_now(trainer, directory: str | None = None, *, checkpointer: Checkpointer | None = None,
             newest: bool = False) -> int:
    """Save the Trainer's step (blocking to ``directory``, else asynchronously with
    ``checkpointer``; ``newest``: as its newest step, `Checkpointer.save_as_newest`) with the row
    source's tables: those it saves itself first, so a complete checkpoint always has them, and
    those it hands over (a copy taken now) in the step's own commit. The host seconds it takes
    are added to ``trainer.save_s`` (not step time)."""
    start = time.perf_counter()     # every caller read the finite flags: the device has caught up
    try:
        rows = trainer.row_path
        tables = None if rows is None else rows.save(trainer.step_count)
        if directory is not None:
            return save_state(directory, trainer.plan, trainer.state, trainer.mesh, rows=tables)
        if newest:
            return checkpointer.save_as_newest(trainer.plan, trainer.state, trainer.mesh, rows=tables)
        return checkpointer.save(trainer.plan, trainer.state, trainer.mesh, rows=tables)
    finally:
        trainer.save_s += time.perf_counter() - start


def restore_rows(trainer, step: int, directory: str | None, checkpointer: Checkpointer | None, *read: Any) -> None:
    """The row source goes back to checkpoint ``step`` (of ``directory``, else of
    ``checkpointer``) before the Trainer takes its state: a refusal changes nothing. ``read``:
    the step's tables, when they were read already (resuming)."""
    rows = trainer.row_path
    if rows is None:
        return
    if read:
        rows.restore(step, lambda: read[0], checkpointer.directory)
    elif directory is not None:
        rows.restore(step, lambda: read_rows(directory, step), str(directory))
    else:
        rows.restore(step, lambda: checkpointer.restore_rows(step), checkpointer.directory)


NO_DIRECTORY = "services=jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=...))"


def save(trainer, directory: str | None = None) -> int:
    """``Trainer.save``: blocking to ``directory``, else asynchronously as the checkpoint
    service's newest step (`Checkpointer.save_as_newest`: later steps are moved aside, a step
    holding exactly this state is kept, one holding another is moved to ``replaced-<step>``)."""
    trainer.check_finite()
    if directory is not None:
        return save_now(trainer, directory)
    checkpoint = trainer.service("checkpoint")
    if checkpoint is None:
        raise ValueError(f"Trainer.save: give a directory or construct the Trainer with {NO_DIRECTORY}")
    checkpoint.diverge()
    return save_now(trainer, checkpointer=checkpoint.checkpointer, newest=True)


def restore(trainer, directory: str | None = None, step: int | None = None) -> tuple[Any, dict]:
    """``Trainer.restore``: ``(state, meta)`` of ``step`` (newest: None) of ``directory``, else of
    the checkpoint service's directory, whose later steps are retired when training goes on; the
    row source goes back to that step first."""
    checkpoint = trainer.service("checkpoint")
    if directory is not None:
        state, meta = restore_state(directory, trainer.state, trainer.mesh, step=step)
    elif checkpoint is not None:
        state, meta = checkpoint.checkpointer.read(trainer.state, trainer.mesh, step)
    else:
        raise ValueError(f"Trainer.restore: give a directory or construct the Trainer with {NO_DIRECTORY}")
    restore_rows(trainer, int(meta["step"]), directory, checkpoint and checkpoint.checkpointer)
    if checkpoint is not None:     # retired when training goes on
        checkpoint.restored(int(meta["step"]), directory is not None)
    return state, meta
