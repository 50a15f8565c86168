"""Save and restore a ``Trainer``'s whole state with orbax-checkpoint, in any layout.

A checkpoint directory holds one sub-directory per saved step (``DIR/10``, ``DIR/20``), each
written by ``orbax.checkpoint.CheckpointManager`` into a temporary directory and renamed into
place only when every process has finished writing: a save killed at any point leaves the
previous steps untouched, and the half-written temporary directory is never read. Each step
has three items:

- ``state``: parameters, optimizer state and other NNX state (RNG keys and counts), one
  array per leaf, every process writing only the shards it holds;
- ``meta``: ``{"step", "data_state", "jaxpar_version"}`` — the step counter is the data
  position of step-indexed data; ``data_state`` is any JSON-able dict of the caller's;
- ``strategy``: the strategy file (see ``jaxpar.checkpoint.strategy``).

Restoring reads every array straight into the shards of the *target* trainer's layout
(``jax.ShapeDtypeStruct(..., sharding=...)`` targets), so any layout restores into any other.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from jaxpar.checkpoint import state as st
from jaxpar.checkpoint.strategy import build_strategy

ITEMS = ("state", "meta", "strategy")


def open_manager(directory: str, *, keep: int | None = None, read_only: bool = False,
                 asynchronous: bool = True) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for a jaxpar checkpoint directory."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=asynchronous,
        # Leftovers of a killed save are removed by the next writer, never by a reader.
        cleanup_tmp_directories=not read_only,
    )
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "strategy": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options, item_handlers=handlers)


def _save_args(trainer, data_state: dict | None) -> ocp.args.Composite:
    import jaxpar

    meta = {"step": int(trainer.step_count), "data_state": dict(data_state or {}),
            "jaxpar_version": jaxpar.__version__}
    return ocp.args.Composite(
        state=ocp.args.StandardSave(st.nest(st.savable(st.flat_state(trainer)))),
        meta=ocp.args.JsonSave(meta),
        strategy=ocp.args.JsonSave(build_strategy(trainer)),
    )


def saved_leaves(manager: ocp.CheckpointManager, step: int) -> dict[str, st.Leaf]:
    """``{path: Leaf(shape, dtype)}`` of a stored step, from its metadata (no array read)."""
    tree = manager.item_metadata(step)["state"]
    return {path: st.leaf_info(m) for path, m in st.unnest(tree).items()}


def _steps(manager: ocp.CheckpointManager) -> list[int]:
    """The complete (committed) steps, read from storage now."""
    manager.reload()
    return list(manager.all_steps())


def _complete_step(manager: ocp.CheckpointManager, directory, step: int | None) -> int:
    steps = _steps(manager)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        return max(steps)
    if step not in steps:
        raise FileNotFoundError(f"checkpoint {directory} has no complete step {step}; complete steps: {sorted(steps)}")
    return step


def restore_into(trainer, manager: ocp.CheckpointManager, step: int, directory: str = "") -> dict[str, Any]:
    """Restore ``step`` into ``trainer`` (any layout); returns the ``meta`` dict."""
    target = st.target(trainer)
    problems = st.differences(saved_leaves(manager, step), {p: st.leaf_info(t) for p, t in target.items()})
    if problems:
        raise st.CheckpointMismatchError(str(directory), step, problems)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(st.nest(target)), meta=ocp.args.JsonRestore()))
    st.install(trainer, st.unnest(restored["state"]))
    meta = dict(restored["meta"])
    trainer.step_count = int(meta["step"])
    trainer.data_state = dict(meta.get("data_state") or {})
    return meta


def save(trainer, directory, *, data_state: dict | None = None, keep: int | None = None,
         force: bool = False) -> int:
    """Save ``trainer``'s whole state as step ``trainer.step_count`` of ``directory`` and wait.

    Returns the step. ``data_state``: a JSON-able dict stored with it (default
    ``trainer.data_state`` when the trainer has one). ``keep``: delete all but the newest
    ``keep`` steps. For saves that overlap training use ``Checkpointer``.

    >>> jaxpar.checkpoint.save(trainer, "ckpt")
    5
    """
    with Checkpointer(directory, keep=keep, asynchronous=False) as ckpt:
        return ckpt.save(trainer, data_state=data_state, force=force)


def restore(trainer, directory, *, step: int | None = None) -> dict[str, Any]:
    """Restore the newest complete step (or ``step``) of ``directory`` into ``trainer``.

    The trainer may use any layout (mesh, device count, tensor/data parallel, ZeRO level):
    arrays are read straight into its shards. Sets ``trainer.step_count`` and
    ``trainer.data_state``; returns ``{"step", "data_state", "jaxpar_version"}``. Raises
    ``FileNotFoundError`` when there is no complete step and ``CheckpointMismatchError``
    (a ``ValueError``) listing every path whose presence, shape or dtype differs.

    >>> jaxpar.checkpoint.restore(trainer, "ckpt")["step"]
    5
    """
    with open_manager(directory, read_only=True) as manager:
        return restore_into(trainer, manager, _complete_step(manager, directory, step), directory)


def latest_step(directory) -> int | None:
    """The newest complete step in ``directory`` (``None`` if none or no directory)."""
    if not os.path.isdir(directory):
        return None
    with open_manager(directory, read_only=True) as manager:
        steps = _steps(manager)
    return max(steps) if steps else None


class Checkpointer:
    """Periodic asynchronous checkpoints of one trainer into ``directory``, keeping the last ``keep``.

    ``save`` returns once the arrays are copied off the devices; the files are written in the
    background while training goes on (``wait()`` blocks until they are committed).
    ``resume`` restores the newest complete step if there is one.

    >>> ckpt = Checkpointer("ckpt", save_every=100, keep=3)
    >>> ckpt.resume(trainer)                     # None on a fresh directory
    >>> for batch in data:
    ...     trainer.step(batch)
    ...     ckpt.maybe_save(trainer)
    >>> ckpt.close()
    """

    def __init__(self, directory, *, save_every: int = 0, keep: int | None = 3, asynchronous: bool = True):
        if not isinstance(save_every, int) or save_every < 0:
            raise ValueError(f"Checkpointer: save_every={save_every!r} must be an int >= 0 (0 = only explicit saves)")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpointer: keep={keep!r} must be a positive int or None (keep all)")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = save_every
        self.manager = open_manager(self.directory, keep=keep, asynchronous=asynchronous)

    def save(self, trainer, *, data_state: dict | None = None, force: bool = False) -> int:
        """Start saving the trainer's state as step ``trainer.step_count``; returns the step."""
        if data_state is None:
            data_state = getattr(trainer, "data_state", None)
        step = int(trainer.step_count)
        if step in self.manager.all_steps():
            if not force:
                raise FileExistsError(f"{self.directory} already holds step {step}; pass force=True to replace it")
            self.manager.wait_until_finished()
            self.manager.delete(step)
        self.manager.save(step, args=_save_args(trainer, data_state), force=True)
        return step

    def maybe_save(self, trainer) -> int | None:
        """Save if ``trainer.step_count`` is a multiple of ``save_every``."""
        step = int(trainer.step_count)
        if self.save_every and step % self.save_every == 0 and step not in self.manager.all_steps():
            return self.save(trainer)
        return None

    def resume(self, trainer) -> dict[str, Any] | None:
        """Restore the newest complete step into ``trainer``; ``None`` if there is none."""
        self.manager.wait_until_finished()
        steps = _steps(self.manager)
        if not steps:
            return None
        return restore_into(trainer, self.manager, max(steps), self.directory)

    def restore(self, trainer, step: int | None = None) -> dict[str, Any]:
        self.manager.wait_until_finished()
        return restore_into(trainer, self.manager, _complete_step(self.manager, self.directory, step), self.directory)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def wait(self) -> None:
        """Block until every started save is committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
