"""Save and restore a whole `TrainState` (laid out by a `TrainPlan`) with orbax-checkpoint, in any layout.

A checkpoint directory holds one sub-directory per saved step (``DIR/10``, ``DIR/20``), each
written by ``orbax.checkpoint.CheckpointManager`` into a temporary directory and renamed into
place only when every process has finished writing: a save killed at any point leaves the
previous steps untouched, and the half-written temporary directory is never read. Each step
has three items:

- ``state``: parameters, optimizer state and other NNX state (RNG keys and counts), one
  array per leaf, every process writing only the shards it holds;
- ``meta``: ``{"step", "data_state", "jaxpar_version", "checksums"}`` — the step counter is
  the data position of step-indexed data; ``data_state`` is any JSON-able dict of the caller's;
  ``checksums`` two per leaf, checked at restore (see ``jaxpar.checkpoint.checksum``), and
  ``row_checksums`` one per row table when there is a ``rows`` item;
- ``strategy``: the strategy file (see ``jaxpar.checkpoint.strategy``);
- ``rows`` (only with a row source that keeps its tables in the checkpoint, such as
  `jaxpar.ps.HostRows`): its tables and their optimizer state, a dict of numpy arrays copied
  when the save starts, so the step's commit holds the tables of that very step even when the
  files are written in the background (`restore_rows` reads them back).

Restoring reads every array straight into the shards of the *target* state's layout
(``jax.ShapeDtypeStruct(..., sharding=...)`` targets), so any layout restores into any other.
Everything here takes a plan and a state and returns states; nothing assigns into a Trainer
(``save(trainer, dir)`` reads a trainer's plan and state; ``restore(trainer, dir)`` is
``Trainer.restore``, which assigns the state read).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.deprecation import RenamedAttribute
from jaxpar.checkpoint import checksum
from jaxpar.checkpoint import state as st
from jaxpar.checkpoint.agreement import agreed, barrier, from_first_process
from jaxpar.checkpoint.damage import CheckpointDamagedError, CheckpointWriteError, check_meta, check_values, reading, writing
from jaxpar.checkpoint.echoes import Echoes
from jaxpar.checkpoint.strategy import build_strategy
from jaxpar.plan import TrainPlan, TrainState, check_data
from jaxpar.version import __version__

ITEMS = ("state", "meta", "strategy", "rows")
RESUME = ("newest", "newest_intact")


class StateHandler(ocp.StandardCheckpointHandler):
    """orbax's handler of the ``state`` item, writing each shard from one replica.

    orbax splits a replicated array among its replicas on CPU and TPU by default ("replica-
    parallel" writing; not on a GPU when ``JAX_PLATFORMS`` names it, but on a GPU left unnamed
    it does): each replica's slice is cut by a program compiled per array and per device at
    a process's first save, which every restart paid again (`benchmarks/first_save.py`: on one
    process with ``{"data": 8}`` and a 4-layer GPT with ZeRO-1, 80 programs). Here every shard is
    written whole by its first replica (``ArrayHandler(use_replica_parallel=False)``), except on
    TPU, where orbax's default stays. Restoring reads the same files either way, and a step
    written by either restores through either (`restore`, the tree metadata and the commit are
    orbax's own). Two differences in what a step holds: no ``array_metadatas/`` (orbax's
    per-process record of each array's written shape, which it compares across processes at the
    commit; jaxpar's value checksums are checked at every restore instead), and the step's
    metadata names this class as the ``state`` item's handler, so an orbax ``restore`` without
    arguments needs jaxpar imported (with ``args``, or ``StandardCheckpointer().restore`` of the
    item's directory, plain orbax reads it).
    """

    def __init__(self):
        super().__init__()
        arrays = ocp.type_handlers.ArrayHandler(
            use_replica_parallel=None if jax.default_backend() == "tpu" else False)
        scalars = ocp.type_handlers.ScalarHandler()
        registry = ocp.type_handlers.create_type_handler_registry(
            (int, scalars), (float, scalars), (bytes, scalars), (np.number, scalars),
            (np.ndarray, ocp.type_handlers.NumpyHandler()), (jax.Array, arrays),
            (str, ocp.type_handlers.StringHandler()))
        self._writer = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)

    async def async_save(self, directory, item=None, save_args=None, args=None):
        if args is None:
            args = ocp.args.StandardSave(item, save_args)
        item = self._validate_save_state(args.item, save_args=args.save_args)
        return await self._writer.async_save(directory, args=ocp.args.PyTreeSave(
            item, save_args=args.save_args, custom_metadata=args.custom_metadata))

    def close(self):
        self._writer.close()
        super().close()


@ocp.args.register_with_handler(StateHandler, for_save=True)
class StateSave(ocp.args.StandardSave):
    """``ocp.args.StandardSave`` of the ``state`` item (its own class, so that orbax hands it to
    `StateHandler` without changing where its ``StandardSave`` goes)."""


@ocp.args.register_with_handler(StateHandler, for_restore=True)
class StateRestore(ocp.args.StandardRestore):
    """``ocp.args.StandardRestore`` of the ``state`` item (see `StateSave`)."""


class _ReaderNote(logging.Filter):
    """Drops orbax's "Given directory is read only" line: jaxpar opens a second, reading manager on
    a folder it also writes (every restore of a job of several processes), and the line read as
    if the folder could not be written."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith("Given directory is read only"))


logging.getLogger("absl").addFilter(_ReaderNote())


def open_manager(directory: str, *, keep: int | None = None, read_only: bool = False,
                 asynchronous: bool = True) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for a jaxpar checkpoint directory."""
    local = {}
    if read_only and jax.process_count() > 1:
        # Reading is each process's own (its shards): no barrier of orbax's joins the processes, so
        # a process whose read fails cannot leave the others waiting at one; they agree on the
        # outcome afterwards (`agreed`).
        me = jax.process_index()
        local["multiprocessing_options"] = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=asynchronous,
        # Leftovers of a killed save are removed by the next writer, never by a reader.
        cleanup_tmp_directories=not read_only, **local,
    )
    handlers = {"state": StateHandler(), "meta": ocp.JsonCheckpointHandler(),
                "strategy": ocp.JsonCheckpointHandler(), "rows": ocp.StandardCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options, item_handlers=handlers)


def _save_args(plan, state, mesh, model: dict | None = None, rows: dict | None = None) -> ocp.args.Composite:
    flat = st.savable(st.flat_state(state))
    meta = {"step": int(state.step), "data_state": state.data, "jaxpar_version": __version__,
            checksum.KEY: checksum.checksums_to_save(flat, int(state.step))}
    strategy = build_strategy(plan, state, mesh)
    if model is not None:
        strategy["model"] = model          # what the parameters are (e.g. a Llama config): export needs it
    items = {"state": StateSave(st.nest(flat)), "meta": ocp.args.JsonSave(meta),
             "strategy": ocp.args.JsonSave(strategy)}
    if rows is not None:
        items["rows"] = ocp.args.StandardSave(rows)
        meta[checksum.ROWS_KEY] = checksum.host_checksums(rows)
    return ocp.args.Composite(**items)


def saved_leaves(manager: ocp.CheckpointManager, step: int) -> dict[str, st.Leaf]:
    """``{path: Leaf(shape, dtype)}`` of a stored step, from its metadata (no array read)."""
    tree = manager.item_metadata(step)["state"]
    leaves = st.unnest(tree) if tree is not None else {}
    missing = sorted(path for path, m in leaves.items() if getattr(m, "shape", None) is None)
    if not leaves or missing:
        what = "state/_METADATA" if not leaves else missing[:3]
        raise FileNotFoundError(f"the array metadata of item 'state' ({what}) is missing or unreadable")
    return {path: st.leaf_info(m) for path, m in leaves.items()}


def complete_steps(manager: ocp.CheckpointManager) -> list[int]:
    """The complete (committed) steps, read from storage now."""
    manager.reload()
    return list(manager.all_steps())


def complete_step(manager: ocp.CheckpointManager, directory, step: int | None) -> int:
    """``step``, or the newest complete step; ``FileNotFoundError`` naming the directory otherwise."""
    steps = complete_steps(manager)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        return max(steps)
    if step not in steps:
        raise FileNotFoundError(f"checkpoint {directory} has no complete step {step}; complete steps: {sorted(steps)}")
    return step


def restore_from(manager: ocp.CheckpointManager, step: int, state, mesh, directory: str = ""):
    """``(TrainState, meta)``: ``step`` read into ``state``'s layout (any layout saved), its
    values checked against the checksums saved with it."""
    state = st.as_state(state)
    target = st.target(state, mesh)

    def read():         # each process its own shards; no collective until the processes agree
        with reading(directory, step):
            saved = saved_leaves(manager, step)
        problems = st.differences(saved, {p: st.leaf_info(t) for p, t in target.items()})
        if problems:
            params_only = (not any(p.startswith("opt_state/") for p in saved)
                           and any(p.startswith("opt_state/") for p in target))
            raise st.CheckpointMismatchError(str(directory), step, problems, params_only=params_only)
        with reading(directory, step):
            restored = manager.restore(step, args=ocp.args.Composite(
                state=StateRestore(st.nest(target)), meta=ocp.args.JsonRestore()))
            meta = dict(restored["meta"])
            int(meta["step"])
        return restored, meta

    restored, meta = agreed(read, directory, step)
    flat = st.unnest(restored["state"])
    check_values(directory, step, flat, meta)
    meta.pop(checksum.KEY, None)
    meta.pop(checksum.ROWS_KEY, None)
    new = st.install(state, flat)
    step_value = jax.device_put(jnp.asarray(int(meta["step"]), jnp.int32), state.step.sharding)
    return new.replace(step=step_value, data=dict(meta.get("data_state") or {})), meta


def save_state(directory, plan, state, mesh, *, keep: int | None = None, force: bool = False,
               model: dict | None = None, rows: dict | None = None) -> int:
    """Save ``state`` (laid out by ``plan`` on ``mesh``) as step ``state.step`` of ``directory``
    and wait; returns the step. ``keep``: delete all but the newest ``keep`` steps. ``model``:
    a JSON-able description of the model, kept in the strategy file under ``"model"``.
    ``rows``: a row source's tables (a dict of numpy arrays), saved as the step's ``rows`` item."""
    with Checkpointer(directory, keep=keep, asynchronous=False) as ckpt:
        return ckpt.save(plan, state, mesh, force=force, model=model, rows=rows)


def read_rows(manager: ocp.CheckpointManager, step: int, directory: str = "") -> dict | None:
    """The ``rows`` item of ``step`` (a dict of numpy arrays), or None when the step has none;
    checked against the CRC-32 of each table saved in ``meta`` (`CheckpointDamagedError` names
    the tables that read back with other values; a step saved without them: nothing to check).
    On several processes the outcome is agreed (`agreed`)."""
    return agreed(lambda: _read_rows(manager, step, directory), directory, step)


def _read_rows(manager: ocp.CheckpointManager, step: int, directory: str) -> dict | None:
    with reading(directory, step):
        if manager.item_metadata(step).get("rows") is None:
            return None
        read = manager.restore(step, args=ocp.args.Composite(rows=ocp.args.StandardRestore(),
                                                             meta=ocp.args.JsonRestore()))
    rows, meta = read["rows"], dict(read["meta"])
    check_meta(directory, step, meta)
    if checksum.ROWS_KEY not in meta:      # saved before the tables had checksums: nothing to check
        return rows
    saved = meta[checksum.ROWS_KEY]
    damage = checksum.record_damage(saved, checksum.host_paths(rows), rows=True)
    if damage:
        raise CheckpointDamagedError(str(directory), step, ValueError(damage))
    bad = checksum.host_differing(rows, saved)
    if bad:
        raise CheckpointDamagedError(str(directory), step, ValueError(
            f"{len(bad)} row table(s) read back without an error but with other values than were saved (their "
            f"checksums differ): {', '.join(bad)}"))
    return rows


def _read_meta(manager: ocp.CheckpointManager, directory, step: int) -> dict:
    with reading(directory, step):
        manager.reload()
        return dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])


def restore_rows(directory, step: int) -> dict | None:
    """A row source's tables saved with step ``step`` of ``directory`` (the ``rows`` item: a
    dict of numpy arrays), or None when that step was saved without them.

    >>> jaxpar.checkpoint.restore_rows("ckpt", 5)["table"].shape    # doctest: +SKIP
    (1000, 16)
    """
    with open_manager(directory, read_only=True) as manager:
        return read_rows(manager, complete_step(manager, directory, step), directory)


def restore_state(directory, state, mesh, *, step: int | None = None):
    """``(TrainState, meta)``: the newest complete step (or ``step``) of ``directory`` read into
    the layout of ``state`` (a `TrainState` of arrays or of ``ShapeDtypeStruct``s with
    shardings). Raises ``FileNotFoundError`` when there is no complete step and
    ``CheckpointMismatchError`` (a ``ValueError``) listing every path whose presence, shape or
    dtype differs."""
    with open_manager(directory, read_only=True) as manager:
        return restore_from(manager, complete_step(manager, directory, step), state, mesh, directory)


def save(trainer, directory, *, data_state: dict | None = None, keep: int | None = None,
         force: bool = False) -> int:
    """Save a trainer's whole state as step ``trainer.step_count`` of ``directory`` and wait.

    Returns the step. ``data_state``: a JSON-able dict stored with it (default: the state's
    own data position). ``keep``: delete all but the newest ``keep`` steps. For saves that
    overlap training use ``Checkpointer``.

    >>> jaxpar.checkpoint.save(trainer, "ckpt")
    5
    """
    state = trainer.state if data_state is None else trainer.state.replace(data=check_data(data_state))
    return save_state(directory, trainer.plan, state, trainer.mesh, keep=keep, force=force)


def restore(trainer, directory, *, step: int | None = None) -> dict[str, Any]:
    """Restore the newest complete step (or ``step``) of ``directory`` into ``trainer``.

    The trainer may use any layout (mesh, device count, tensor/data parallel, ZeRO level):
    arrays are read straight into its shards. Sets the trainer's step and data position;
    returns ``{"step", "data_state", "jaxpar_version"}``. Raises ``FileNotFoundError`` when
    there is no complete step and ``CheckpointMismatchError`` (a ``ValueError``) listing every
    path whose presence, shape or dtype differs.

    >>> jaxpar.checkpoint.restore(trainer, "ckpt")["step"]
    5
    """
    return trainer.restore(directory, step=step)


def _check_plan_state(method: str, plan, state) -> None:
    """Refuse what is not a (`TrainPlan`, `TrainState`) pair, such as a Trainer (``plan=None``: no plan to check)."""
    fix = ("pass (trainer.plan, trainer.state, trainer.mesh)" if method in ("save", "maybe_save", "save_as_newest")
           else "pass (trainer.state, trainer.mesh) and assign the state it returns")
    if plan is not None and not isinstance(plan, TrainPlan):
        raise TypeError(f"Checkpointer.{method}: plan must be a jaxpar.TrainPlan, got {type(plan).__name__}; "
                        f"{fix} (or use jaxpar.checkpoint.save/restore(trainer, directory))")
    if not isinstance(state, TrainState):
        raise TypeError(f"Checkpointer.{method}: state must be a jaxpar.TrainState, got {type(state).__name__}; "
                        f"{fix} (or use jaxpar.checkpoint.save/restore(trainer, directory))")


def latest_step(directory) -> int | None:
    """The newest complete step in ``directory`` (``None`` if none or no directory)."""
    if not os.path.isdir(directory):
        return None
    with open_manager(directory, read_only=True) as manager:
        steps = complete_steps(manager)
    return max(steps) if steps else None


def _free_name(path: str) -> str:
    """``path``, or ``path.1``, ``path.2``, ...: the first that does not exist."""
    n = 0
    while os.path.exists(path if not n else f"{path}.{n}"):
        n += 1
    return path if not n else f"{path}.{n}"


def _at_exit(ref: weakref.ref) -> None:
    """Close the checkpointer behind ``ref`` (if still open) when the interpreter exits.

    Registered with the hooks that run when the main thread ends, before the thread pools shut
    down: orbax finishes a save through them, so a plain ``atexit`` handler comes too late
    ("cannot schedule new futures after shutdown") and the step would be lost. Python has that
    hook only as ``threading._register_atexit`` (3.9+); without it, ``atexit`` is the fallback.
    """
    def finish():
        ckpt = ref()
        if ckpt is not None:
            try:
                ckpt.close()
            except CheckpointWriteError as e:    # nobody is left to catch it: one line, no traceback
                print(f"jaxpar: {e}", file=sys.stderr)

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(finish)
    except RuntimeError:     # already shutting down: nothing more can be scheduled anyway
        pass


class Checkpointer:
    """Periodic asynchronous checkpoints of a `TrainState` into ``directory``, keeping the last ``keep``.

    Every method takes the plan and the state (and the mesh they live on) and returns states;
    the caller assigns what is restored. ``save`` returns once the arrays are copied off the
    devices; the files are written in the background while training goes on (``wait()`` blocks
    until they are committed). ``resume`` restores the newest complete step if there is one;
    ``restore`` goes back to a step (the steps after it are retired: `retire_after`), ``read``
    only reads one.

    >>> ckpt = Checkpointer("ckpt", save_every=100, keep=3)
    >>> resumed = ckpt.resume(trainer.state, trainer.mesh)         # None on a fresh directory
    >>> if resumed is not None:
    ...     trainer.state = resumed[0]
    >>> for batch in data:
    ...     trainer.step(batch)
    ...     ckpt.maybe_save(trainer.plan, trainer.state, trainer.mesh)
    >>> ckpt.close()
    """

    def __init__(self, directory, *, save_every: int = 0, keep: int | None = 3, asynchronous: bool = True,
                 resume: str = "newest"):
        if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 0:
            raise ValueError(f"Checkpointer: save_every={save_every!r} must be an int >= 0 (0 = only explicit saves)")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpointer: keep={keep!r} must be a positive int or None (keep all)")
        if resume not in RESUME:
            raise ValueError(f"Checkpointer: resume={resume!r}; choose one of {RESUME}")
        path = os.path.abspath(os.fspath(directory))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"the checkpoint directory {directory!r} is a file, not a directory; give a directory "
                             "path (it is created if missing)")
        self.directory = path
        self.save_every = save_every
        self.resume_policy = resume
        self.manager = open_manager(self.directory, keep=keep, asynchronous=asynchronous)
        # reads go through a manager of this process alone on several (`open_manager`, `agreed`)
        self._reader = open_manager(self.directory, read_only=True) if jax.process_count() > 1 else self.manager
        self._closed = False
        self._saving: int | None = None      # the step of the newest save started
        # orbax logs a save that fails in its threads, with tracebacks, before anyone waits for
        # it: held back until the save is waited for, and reported there as one error
        self._echoes = Echoes(hold_orbax=True).install()
        # A script that trains and returns must not lose the save still being written.
        _at_exit(weakref.ref(self))

    def due(self, step: int) -> bool:
        """Whether ``maybe_save`` would save at ``step``."""
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, plan: TrainPlan, state: TrainState, mesh, *, force: bool = False, model: dict | None = None,
             rows: dict | None = None) -> int:
        """Start saving ``state`` (laid out by ``plan`` on ``mesh``) as step ``state.step``;
        returns the step. ``force``: replace a step already saved. ``model``, ``rows``: see
        `save_state` (``rows`` must not change after the call: the files may be written later)."""
        _check_plan_state("save", plan, state)
        step = int(state.step)
        self.wait()         # a failed earlier save is reported as itself, before this one starts
        if step in self.manager.all_steps():
            if not force:
                raise FileExistsError(f"{self.directory} already holds step {step}; pass force=True to replace it")
            self.manager.delete(step)
        args = _save_args(plan, state, mesh, model, rows)
        self._saving = step
        with writing(self.manager, self.directory, step, self._echoes):
            self.manager.save(step, args=args, force=True)
        return step

    def save_as_newest(self, plan: TrainPlan, state: TrainState, mesh, *, rows: dict | None = None) -> int:
        """Leave ``state`` saved as the newest step, ``state.step`` (an explicit save: after a
        restore to an earlier step, or of a state assigned by hand). Steps after it hold another
        history and are moved aside (`retire_after`). A step ``state.step`` that holds exactly
        this state (`holds`: its checksums, data position and row tables) is kept: nothing to
        write. One that holds another state is moved aside to ``DIR/replaced-<step>`` (an atomic
        rename: a crash leaves it there, never half deleted) before this one is saved. Returns
        the step."""
        _check_plan_state("save_as_newest", plan, state)
        step = int(state.step)
        self.retire_after(step)
        if step in complete_steps(self.manager):
            if self.holds(state, rows=rows):
                return step
            path, = self._move_aside([step], "replaced", lambda s, path, e: OSError(
                e.errno, f"checkpoint {self.directory}: step {s} holds another state than the one to save as step "
                f"{s}, and could not be moved aside to {path} ({e}); delete or move "
                f"{os.path.join(self.directory, str(s))} and save again"))
            warnings.warn(f"checkpoint {self.directory}: step {step} on disk holds another state than the one saved "
                          f"now as step {step}; it was moved aside to {path} (no longer a step; delete it once not "
                          "wanted)", stacklevel=3)
        return self.save(plan, state, mesh, rows=rows)

    def holds(self, state: TrainState, *, rows: dict | None = None) -> bool:
        """Whether the directory's step ``state.step`` holds exactly ``state``: the same values
        (its saved checksums against those of ``state``), the same data position and the same
        row tables (``rows``: a row source's tables; their CRC-32s). A step that cannot be read,
        or one saved without checksums, is not known to hold it."""
        _check_plan_state("holds", None, state)
        step = int(state.step)
        self.wait()
        if step not in complete_steps(self.manager):
            return False
        try:
            meta = agreed(lambda: _read_meta(self._reader, self.directory, step), self.directory, step)
        except CheckpointDamagedError:
            return False
        saved, flat = meta.get(checksum.KEY), st.savable(st.flat_state(state))
        if not isinstance(saved, dict) or set(saved) != set(flat):
            return False
        if json.loads(json.dumps(state.data)) != meta.get("data_state"):
            return False
        if (rows is None) != (checksum.ROWS_KEY not in meta) or (
                rows is not None and meta[checksum.ROWS_KEY] != checksum.host_checksums(rows)):
            return False
        return checksum.checksums(flat) == {path: list(pair) for path, pair in saved.items()}

    def maybe_save(self, plan: TrainPlan, state: TrainState, mesh) -> int | None:
        """Save if ``state.step`` is a multiple of ``save_every`` and not saved yet; returns
        the step saved, or ``None``."""
        _check_plan_state("maybe_save", plan, state)
        step = int(state.step)
        if self.due(step) and step not in self.manager.all_steps():
            return self.save(plan, state, mesh)
        return None

    def restore(self, state: TrainState, mesh, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """``(TrainState, meta)``: ``step`` (default the newest complete one) read into the layout
        of ``state`` (arrays, or ``ShapeDtypeStruct``s with shardings); the caller assigns it.
        Reading changes nothing on disk; a caller that trains on from an earlier step retires the
        later ones before its first save (`retire_after`; ``Trainer.restore`` does it at its
        first step or save after the restore)."""
        return self.read(state, mesh, step)

    def read(self, state: TrainState, mesh, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """``step`` read into ``state``'s layout, the directory left as it is (`restore`)."""
        _check_plan_state("read", None, state)
        self.wait()
        return restore_from(self._reader, complete_step(self._reader, self.directory, step), state, mesh,
                            self.directory)

    def retire_after(self, step: int, *, including: bool = False) -> list[str]:
        """Training went back to ``step`` (a restore of it) and goes on: the complete steps after
        it (``including``: and ``step`` itself, when the state came from another directory) hold
        a history training no longer continues. Left as steps, a restart would resume the newest
        of them instead of the new history's saves (or its step before them), a save of a step
        they hold would be skipped as done, and ``keep`` would rotate the new saves out first.
        They are moved aside to ``DIR/abandoned-<step>`` (one rename each, newest first: atomic,
        so a crash leaves every step either in place or aside, and the step gone back to, the
        newest of the current history, is never touched), kept for inspection (not counted by ``keep``;
        rename one back to make it a step again), with a warning naming them. Returns their
        new paths."""
        self.wait()         # a save in flight of a later step would commit after the renames
        later = sorted(s for s in complete_steps(self.manager) if s > step or (including and s == step))
        if not later:
            return []
        # newest first: a crash part way leaves the old history's steps up to one (as if the
        # restore had not happened; nothing of the new history exists yet to be lost)
        aside = self._move_aside(later[::-1], "abandoned", lambda s, path, e: OSError(
            e.errno, f"checkpoint {self.directory}: went back to step {step}, but the later step {s} could not be "
            f"moved aside to {path} ({e}); delete or move {os.path.join(self.directory, str(s))}, or a restart "
            "resumes the abandoned history"))
        warnings.warn(f"checkpoint {self.directory}: went back to step {step}; the steps {later} hold the "
                      f"history abandoned and were moved aside to {', '.join(aside[::-1])} (no longer steps: a restart "
                      "resumes the new history; delete them once not wanted, or rename one back to make it a step "
                      "again)", stacklevel=3)
        return aside[::-1]

    def restore_rows(self, step: int) -> dict | None:
        """The row tables saved with ``step`` (see `restore_rows`), or None when it has none."""
        self.wait()
        return read_rows(self._reader, complete_step(self._reader, self.directory, step), self.directory)

    def resume(self, state: TrainState, mesh, *, rows: bool = False) -> tuple | None:
        """``(TrainState, meta)`` of the newest complete step in ``state``'s layout; ``None`` if
        there is none. The caller assigns it (``trainer.state = resumed[0]``). ``rows=True``:
        ``(TrainState, meta, tables)``, the step's row tables too (`restore_rows`; None when it
        has none), read as part of the step, so a damaged ``rows`` item is a damaged step.

        A newest step that does not read back whole raises `CheckpointDamagedError` naming it,
        or, with ``resume="newest_intact"``, is passed over (with a warning) for the newest
        step that does, and moved aside to ``DIR/damaged-<step>``: kept for inspection, it no
        longer counts as saved, so the retrained step is saved again and the next restart
        resumes from it."""
        _check_plan_state("resume", None, state)
        self.wait()
        steps = sorted(complete_steps(self.manager), reverse=True)
        damaged: list[CheckpointDamagedError] = []
        for i, step in enumerate(steps):
            try:
                restored = self.read(state, mesh, step)
                if rows:
                    restored = (*restored, read_rows(self._reader, step, self.directory))
            except CheckpointDamagedError as e:
                if self.resume_policy != "newest_intact" or i + 1 == len(steps):
                    raise
                damaged.append(e)
                continue
            for error, aside in zip(damaged, self._set_aside([e.step for e in damaged])):
                warnings.warn(f"checkpoint step {error.step} in {self.directory} is damaged ({error.damage}); "
                              f"resuming from the previous step {step}; step {error.step} moved aside to {aside} "
                              "(delete it once inspected), so the retrained step is saved again", stacklevel=2)
            return restored
        return None

    def _set_aside(self, steps: list[int]) -> list[str]:
        """Rename the damaged ``steps`` to ``DIR/damaged-<step>`` (a name that is no step, so they
        no longer block saving those steps again); returns the new paths."""
        return self._move_aside(steps, "damaged", lambda step, path, e: CheckpointDamagedError(
            self.directory, step, e, f"It could not be moved aside to {path}; delete "
            f"{os.path.join(self.directory, str(step))} (or move it) and resume again"))

    def _move_aside(self, steps: list[int], prefix: str, failed) -> list[str]:
        """Rename ``steps`` to ``DIR/<prefix>-<step>`` (a free name that is no step); returns the
        new paths. The first process renames, on the file system all processes share, between two
        barriers; a rename that fails raises ``failed(step, path, error)``."""
        aside = [_free_name(os.path.join(self.directory, f"{prefix}-{step}")) for step in steps]
        barrier(f"jaxpar: set aside {aside}")        # every process named them before one renames
        failure, cause = (-1, 0), None        # (index of the step whose rename failed, errno)
        if jax.process_index() == 0:
            for i, (step, path) in enumerate(zip(steps, aside)):
                try:
                    os.rename(os.path.join(self.directory, str(step)), path)
                except OSError as e:
                    failure, cause = (i, e.errno or 0), e
                    break
        # every process learns the outcome (the second barrier), so none waits for one that raised,
        # and each raises the same error
        failure = from_first_process(failure)
        self.manager.reload()
        if failure[0] >= 0:
            i, code = failure
            source = os.path.join(self.directory, str(steps[i]))
            error = OSError(code, os.strerror(code) if code else "rename failed", source, None, aside[i])
            raise failed(steps[i], aside[i], error) from cause
        return aside

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    save_state = RenamedAttribute("save")          # 0.1.0's names, with a DeprecationWarning
    restore_state = RenamedAttribute("restore")

    def wait(self) -> None:
        """Block until every started save is committed; a save that could not be written raises
        `CheckpointWriteError` (once) naming the directory, the step and the cause."""
        with writing(self.manager, self.directory, self._saving, self._echoes, any_error=True):
            self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for every started save to commit, then close (idempotent); a save that could not
        be written raises `CheckpointWriteError`, and the checkpointer is closed all the same."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            try:
                with writing(self.manager, self.directory, self._saving, self._echoes, any_error=True):
                    self.manager.close()
            finally:
                if self._reader is not self.manager:
                    with contextlib.suppress(Exception):    # a reader holds nothing to lose
                        self._reader.close()
                self._echoes.remove()
                self._echoes.emit_held()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
