"""``Trainer``: a `TrainPlan`, a `TrainState`, a cache of compiled steps, and the loop.

The plan says where everything lives; it is made before the Trainer runs anything
(`jaxpar.train.plan_for`: `jaxpar.plan.make_train_plan`, or the strategy search for
``mode="auto"``). The state is what the step takes and returns; the step itself is built in one
place (`jaxpar.train.step.build_step`). The Trainer only compiles that step for each batch
shape, runs it, and keeps metrics on the device until they are logged. Checkpoints take the
plan and the state (`jaxpar.checkpoint.Checkpointer`); the Trainer assigns what they restore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.checkpoint import Checkpointer, restore_rows, restore_state, save_state
from jaxpar.config import ParallelConfig
from jaxpar.data import place_batch, process_view
from jaxpar.data.sequence import reorder_batch
from jaxpar.metrics import MetricsConfig, profile_window_outside, progress_text, read, tokens_per_example
from jaxpar.metrics.logger import ROUTING, examples_per_step
from jaxpar.optim import fusion
from jaxpar.optim import offload as host
from jaxpar.nn.specs import check_rules_used, declared_names
from jaxpar._deprecation import Removed, RemovedAttribute
from jaxpar.report.stage_collectives import checked_step
from jaxpar.plan import (IdleAxisWarning, TrainPlan, TrainState, check_combination, check_data, init_state,
                         state_shardings)
from jaxpar.strategy import recording_axes, recording_rules, spec_axes
from jaxpar.train.hooks import Preempted, Preemption, running, watchers
from jaxpar.train.planning import plan_for
from jaxpar.train.rows import RowPath, check_rows
from jaxpar.train.step import Setting, build_eval, build_grads, build_step

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")   # what Trainer.lower(platform=) may lower for


class Trainer:
    """Compiles and runs training of an NNX ``model`` with an optax ``tx``.

    ``loss_fn(model, batch)`` returns a scalar loss or ``(loss, aux)``. Batches are pytrees of
    arrays whose leading dimension is the global batch.

    >>> trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    >>> metrics = trainer.step(batch)          # {"loss": ..., "grad_norm": ...} (device arrays)
    >>> # with MoE layers also "moe_load_balance", "moe_z_loss", "moe_dropped" (see ``step``)
    >>> history = trainer.fit(batches, steps=100)
    >>> trainer.plan, trainer.state             # the TrainPlan and the TrainState

    ``plan``: the `TrainPlan` to train under (from `jaxpar.train.plan_for`, or loaded with
    ``TrainPlan.from_json``), made from ``config`` (a searched one: from mode ``"auto"``) and
    carrying its offload; without one, ``plan_for`` makes it from ``config`` before
    anything else. ``offload``: ``"opt_state"`` and/or ``"params"`` kept in host memory
    between steps. ``example_batch``: in mode ``"auto"`` without ``plan``, the batch the
    strategy search runs on, at construction (required: the Trainer never plans later).
    ``checkpoint_dir`` / ``save_every`` / ``keep``: save asynchronously every ``save_every``
    steps, keep the newest ``keep``, and resume from the newest complete one at construction.
    ``resume``: ``"newest"`` (a damaged newest step is an error naming it) or
    ``"newest_intact"`` (fall back to the newest step that reads back whole).
    ``nonfinite``: what a step whose loss or gradient is not finite, or whose update is not (a
    parameter it writes not finite, a NaN in the optimizer state it writes), does. ``"stop"`` (default):
    ``FloatingPointError`` naming the step when the flags are next read (before every save,
    at logging, every 100 steps), so such a state never reaches a checkpoint and a restart
    resumes from the newest finite one. ``"skip"``: the step keeps the previous parameters and
    optimizer state (a select on the device, which costs temporary memory for the old state)
    and is counted in ``trainer.skipped_steps``.
    ``pipeline.stages > 1`` needs ``loss_fn`` as a ``jaxpar.pipeline.PipelineLoss``.
    ``preemption`` (with ``checkpoint_dir``): on SIGTERM the Trainer saves at the next step
    boundary — the same step on every process (JAX's preemption sync point) — and raises
    ``Preempted`` (a ``SystemExit`` with code 0), so a restart resumes exactly there
    (``evaluate`` acts the same between its batches); more
    SIGTERMs while it runs (inside ``step``, ``fit`` or ``evaluate``) are the same request,
    while with none running a second one ends the process (docs/reliability.md).
    ``metrics``: a `jaxpar.metrics.MetricsConfig`; ``fit`` then writes loss, grad norm, lr,
    tokens/s, MFU and memory at its logging steps (``metrics.jsonl``, and TensorBoard event
    files with ``tensorboard=True``) and ``evaluate`` the eval loss and perplexity.
    ``profile_steps=(10, 13)`` (with ``metrics``): a ``jax.profiler`` trace of steps 10 to 12
    under ``metrics.dir/profile``; ``fit(..., until=N)`` refuses a window the run to step ``N``
    would not reach the end of, and a Trainer that closes before its window's end warns.
    ``rows``: a row source (`jaxpar.ps.rows`: a `jaxpar.ps.HostRows` table in host memory) for
    embedding rows the model does not hold: each step pulls the batch's rows before the
    compiled step, which differentiates ``loss_fn(model, batch, rows)`` with respect to them
    too, and pushes their gradients after it; every other option composes with it (the row
    path is `jaxpar.train.rows`). Checkpoints keep the source's tables: a source with
    ``snapshot()`` / ``load_snapshot(tables)`` (`jaxpar.ps.HostRows`) has them written into
    each checkpoint step with the state, in the same commit, and read back with it; one with
    ``save(step)`` / ``restore(step)`` (`jaxpar.ps.ServerRows`) saves them itself just before
    the Trainer saves, and goes back to the step the Trainer resumes or restores.
    Saves still in flight finish at ``close()`` (or leaving ``with trainer:``), at the end of
    ``fit``, and at interpreter exit.
    The Trainer owns the model's arrays from then on (they are donated to the step): read the
    trained model as ``trainer.model``.
    """

    # What it runs: the plan (made before the Trainer, see `plan_for`), on this mesh.
    plan: TrainPlan
    searched: Any                   # the strategy search's `jaxpar.auto.Strategy` when plan_for searched, else None
    mesh: jax.sharding.Mesh
    tx: optax.GradientTransformation
    loss_fn: Callable
    graphdef: Any                   # the model's NNX graph; the state holds its arrays
    global_batch: bool              # batches hold every process's rows (one process: always)
    # The state, as a flat list of device arrays between steps: the compiled step takes and
    # returns that list, so a step re-wraps no pytree node on the host. The TrainState object
    # is rebuilt only when something reads it (`_state`).
    _leaves: list
    _treedef: Any
    _data: dict                     # the data position (host metadata; never traced)
    _state_view: TrainState | None
    _steps: int                     # host mirror of state.step: the loop never waits on the device
    # Compiled programs, one per batch shape (and kind: "train" / "eval").
    _compiled: dict
    _donate: bool
    _offload: tuple[str, ...]
    _flops_per_token: Any           # model FLOPs per token for MFU (None: unknown)
    _rule_names: set                # the logical names the model declares (for check_rules_used)
    _model_name: str
    _rows: RowPath | None           # the row source's path (None: the model holds every parameter)
    # Loop services: checkpoints, preemption, non-finite checks, metrics, profiling. The first
    # three, and the user's, are hooks the step calls (`add_hook`); metrics are written where
    # `fit` reads them, and the profile window wraps the dispatch itself.
    _hooks: list                    # (every, hook(step, metrics)), called in this order after a step
    checkpointer: Checkpointer | None
    _preemption: Preemption | None
    _nonfinite: str                 # "stop" or "skip"
    _finite: list                   # (step, device flag) not yet read
    skipped_steps: list[int]
    _metrics: Any                   # jaxpar.metrics.MetricsLogger or None
    _profile: Any                   # jaxpar.metrics.ProfileWindow or None

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable,
                 config: ParallelConfig, mesh, *, plan: TrainPlan | None = None, global_batch: bool | None = None,
                 donate: bool = True, offload: str | tuple[str, ...] = (), example_batch: Any = None,
                 checkpoint_dir: str | None = None, save_every: int = 0, keep: int | None = 3,
                 nonfinite: str = "stop", resume: str = "newest", preemption: bool = True,
                 metrics: MetricsConfig | None = None, profile_steps: tuple[int, int] | str | None = None,
                 rows: Any = None):
        tx = _transformation(tx)
        _check_args(model, tx, loss_fn, config, mesh, plan, offload)    # refused combinations included
        try:     # a refused or failed construction leaves nothing open behind it (files, threads, handlers)
            check_rows(rows, config, plan)
            self._rows = None if rows is None else RowPath(rows, mesh)
            self._metrics, self._profile = watchers(metrics, profile_steps)
            if nonfinite not in ("stop", "skip"):
                raise ValueError(f"Trainer: nonfinite={nonfinite!r}; choose 'stop' (raise naming the step) or 'skip' "
                                 "(count the skipped updates and go on)")
            self.mesh, self.tx, self.loss_fn = mesh, tx, loss_fn
            self.global_batch = jax.process_count() == 1 if global_batch is None else global_batch
            self._donate = donate
            self._offload = host.check_targets(offload)
            if plan is not None:       # the plan carries what it offloads: offload= may only repeat it
                if self._offload and set(self._offload) != set(plan.offload):
                    raise ValueError(f"Trainer: offload={self._offload} but the plan offloads {plan.offload}; drop "
                                     "offload= (the plan's is used) or make the plan with this offload")
                self._offload = tuple(plan.offload)
            if self._offload and not host.host_memory_available(mesh):
                raise ValueError(f"Trainer: offload={self._offload} needs a '{host.HOST}' memory space, which "
                                 f"{mesh.devices.flat[0].platform} devices here do not have; drop offload")
            self.checkpointer = None       # opened first: a bad directory is refused before any planning
            if checkpoint_dir is not None:
                self.checkpointer = Checkpointer(checkpoint_dir, save_every=save_every, keep=keep, resume=resume)
            self._preemption = Preemption() if checkpoint_dir is not None and preemption else None
            self._hooks = []
            # In this order: a preempted step is saved and the run leaves before anything else; the
            # finite flags are read at least every 100 steps; a due checkpoint is saved.
            if self._preemption is not None:
                self.add_hook(self._on_preemption)
            self.add_hook(self._on_finite_window, every=100)
            if self.checkpointer is not None and self.checkpointer.save_every:
                self.add_hook(self._on_checkpoint, every=self.checkpointer.save_every)
            self.searched = None
            if plan is None:     # the planner runs up front; the Trainer itself never plans
                plan, self.searched = plan_for(model, tx, loss_fn, config, mesh, example_batch=example_batch,
                                               offload=self._offload)
            self.plan = plan
            self._idle_checked = False     # idle mesh axes: warned of once, at the first traced train step
            self._leaves, self._treedef, self._data, self._state_view = None, None, {}, None
            self._steps = 0
            self._diverges = None       # (step, from elsewhere) after a restore, till training goes on
            self._compiled = {}
            self._flops_per_token = getattr(model, "flops_per_token", None)
            self._rule_names = declared_names(plan.config, nnx.state(model))
            self._model_name = type(model).__name__
            self._nonfinite = nonfinite
            self._finite = []
            self._save_s = 0.0       # host seconds in checkpoint saves since fit last read it (not step time)
            self.skipped_steps = []
            self.graphdef, state = init_state(plan, mesh, model, tx)
            self._set(state)
            if self.checkpointer is not None:
                # the newest complete step, if any (with its row tables: a damaged table is a damaged step)
                resumed = self.checkpointer.resume(self._state, mesh, rows=self._rows is not None)
                if resumed is not None:
                    self._restore_rows(int(resumed[1]["step"]), None, *resumed[2:])
                    self._set(resumed[0])
        except BaseException:
            with contextlib.suppress(Exception):     # the construction's error is the one to see
                self.close()
            raise

    def _setting(self, rows=None, row_specs=None) -> Setting:
        s = self._state
        return Setting(self.plan, self.mesh, self.graphdef, s.params, s.rest, rows, row_specs)

    def _set(self, state: TrainState) -> None:
        self._state = state
        self._steps = int(state.step)

    @property
    def _state(self) -> TrainState | None:
        if self._state_view is None and self._leaves is not None:
            self._state_view = jax.tree.unflatten(self._treedef, self._leaves).attach(self._data)
        return self._state_view

    @_state.setter
    def _state(self, state: TrainState) -> None:
        detached, _ = state.detach()
        leaves, treedef = jax.tree.flatten(detached)
        if self._treedef is not None and treedef != self._treedef:
            self._compiled.clear()      # another tree (a restore into new leaves): compile anew
        self._leaves, self._treedef, self._data, self._state_view = leaves, treedef, state.data, state

    # ------------------------------------------------------------------ compiling
    def _program(self, batch, kind: str = "train", rows=None) -> tuple["_Program", list]:
        """``(program, the batch's leaves)``: the compiled step (or evaluation) for batches shaped
        like ``batch`` (and pulled ``rows`` shaped like these), with its batch shardings.
        Everything a step needs that depends only on the batch's shapes is found once per shape,
        not once per step; the batch is flattened once, here."""
        leaves, treedef = jax.tree.flatten(batch)
        key = (kind, treedef, tuple((np.shape(x), _dtype_of(x)) for x in leaves))
        if rows is not None:
            key += self._rows.key(rows)
        program = self._compiled.get(key)
        if program is None:
            _check_batch(batch)
            program = self._compiled[key] = self._build(batch, kind, treedef, rows)
        return program, leaves

    def _build(self, batch, kind: str, batch_def, rows=None) -> "_Program":
        fast = jax.process_count() == 1 and self.plan.config.context is None
        if not fast:    # context parallel reorders the sequence and adds its positions: the step sees that batch
            batch = reorder_batch(self.plan.config, self.mesh, batch)
            batch_def = jax.tree.structure(batch)
        shapes = self._global_view(batch, training=kind == "train")
        specs = self.plan.batch_specs(shapes, training=kind == "train")
        b_sh = jax.tree.leaves(jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                                            is_leaf=lambda x: isinstance(x, PartitionSpec)))
        s_sh = jax.tree.leaves(state_shardings(self.plan, self.mesh, self._state.detach()[0]),
                               is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        state_def = self._treedef
        # Pulled rows (a row source): one more input, and their gradients one more output.
        r_sh = () if rows is None else (self._rows.shardings(rows),)
        setting = self._setting(*(self._rows.abstract(rows, r_sh[0]) if r_sh else ()))
        if kind == "train":
            step = self._checking_rules(build_step(setting, self.loss_fn, self.tx, shapes,
                                                   skip_nonfinite=self._nonfinite == "skip"), r_sh)

            def flat_step(state_leaves, batch_leaves, *rows):
                state, metrics, *row_grads = step(jax.tree.unflatten(state_def, state_leaves),
                                                  jax.tree.unflatten(batch_def, batch_leaves), *rows)
                return state_def.flatten_up_to(state), metrics, *row_grads

            # keep_unused: a state leaf the step only overwrites (a counter of the model's) would be
            # pruned from the program's inputs, and donation would then alias the next input of the
            # same shape and dtype to its output, whatever its memory kind: with the optimizer state
            # on the host, Adam's count (pinned_host) to that leaf's output (device), a runtime error
            fn = jax.jit(flat_step, in_shardings=(s_sh, b_sh, *r_sh), out_shardings=(s_sh, None, *r_sh),
                         donate_argnums=(0,) if self._donate else (), keep_unused=True,
                         compiler_options=fusion.compiler_options(self.plan.config.comm_fusion,
                                                                  self.mesh.devices.flat[0].platform) or None)
        else:
            evaluate = build_eval(setting, self.loss_fn, shapes)

            def flat_eval(state_leaves, batch_leaves, *rows):
                return evaluate(jax.tree.unflatten(state_def, state_leaves),
                                jax.tree.unflatten(batch_def, batch_leaves), *rows)

            fn = jax.jit(flat_eval, in_shardings=(s_sh, b_sh, *r_sh))
        if self.plan.pipeline.stages > 1:   # compiled and checked before it runs (a stage's op must hold
            fn = checked_step(fn, self.mesh, self.plan.config.pipeline.axis)   # no cross-stage collective)
        return _Program(fn, b_sh, batch_def, fast, r_sh[0] if r_sh else None)

    def _placed(self, program: "_Program", batch, leaves: list) -> list:
        """The batch's leaves for the compiled step. In one process: host (numpy) leaves as they
        are — the step's ``in_shardings`` place them on the way in — and device arrays with one
        batched ``device_put`` to the shardings found when the program was built. Otherwise
        `place_batch` (process-local rows, context-parallel reordering)."""
        if program.fast:    # host arrays go straight into the compiled step, which places them itself
            if all(type(x) is np.ndarray for x in leaves):
                return leaves
            return jax.device_put(leaves, program.shardings)
        return jax.tree.leaves(place_batch(self.plan.config, self.mesh, batch, global_batch=self.global_batch))

    def _checking_rules(self, step: Callable, row_shardings: tuple = ()) -> Callable:
        """``step`` that, while it is traced, records the rules its activation constraints consult
        and refuses rules nothing uses (`check_rules_used`) before anything runs; at the first
        trace, it warns of mesh axes that neither the plan nor the traced step's strategies (the
        model's jaxpar.shard / jaxpar.ops / LogicalConstraint) nor the pulled rows split over."""
        def traced(*args):
            with recording_rules() as seen, recording_axes() as used:
                out = step(*args)
            check_rules_used(self.plan.config, self._rule_names | seen, self._model_name)
            if not self._idle_checked:
                self._idle_checked = True
                used.update(a for sh in jax.tree.leaves(row_shardings) for e in sh.spec for a in spec_axes(e))
                if note := self.plan.idle_axes_note(used):
                    warnings.warn(f"Trainer: {note}", IdleAxisWarning, stacklevel=_caller_level())
            return out
        return traced

    def _global_view(self, batch, *, training: bool | None = None):
        """Shapes of the global batch (for compile keys and shardings). In a run of several
        processes fed per process (``global_batch=False``), a leaf holds this process's own rows:
        the global batch has those rows times the process count, and they are checked against
        the batch shards this process's devices hold, not against the whole mesh
        (`jaxpar.data.process_view`; ``training``: cut into the step's parts)."""
        if jax.process_count() > 1 and not self.global_batch:
            return process_view(self.plan.config, self.mesh, batch, training=training)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)), batch)

    # ------------------------------------------------------------------ running
    def place(self, batch):
        """Put a host batch on the mesh by ``dataset_strategy`` (with ``rows``: the batch the step
        gets, its rows pulled; nothing is pushed)."""
        rows = None
        if self._rows is not None:
            batch, rows, _ = self._rows.pull(batch)
        program, leaves = self._program(batch, rows=rows)
        if program.fast:
            leaves = jax.device_put(leaves, program.shardings)
        else:
            leaves = self._placed(program, batch, leaves)
        return jax.tree.unflatten(program.batch_def, leaves)

    @running      # a SIGTERM inside a step is acted on at its end: SIGTERMs till then are one request
    def step(self, batch) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics (``"loss"``, ``"grad_norm"``, ...) as
        device arrays: reading one (``float(m["loss"])``) waits for the step, nothing else does.
        A model with MoE layers adds its routing, computed in the step: ``"moe_load_balance"``
        and ``"moe_z_loss"`` (means over the layers and the step's micro-batches) and
        ``"moe_dropped"`` (the assignments dropped in the step; 0 when dropless).

        The per-step host path is kept thin (a step is dispatched in about the time of a
        hand-written ``jax.jit`` loop): the compiled program and the batch shardings are found
        once per batch shape, the batch is placed with one ``device_put``, the state passes as
        a flat list of arrays. The services are hooks (`add_hook`) walked once per step, each
        called only at its steps (an integer test): non-finite flags are read in bulk (every
        100 steps, before saves, at logging), preemption is a flag set by SIGTERM, a checkpoint
        is saved every ``save_every`` steps. With ``rows`` the source pulls before and pushes
        after (`_step_rows`); without, nothing of that runs."""
        if self._rows is not None:
            return self._step_rows(batch)
        program, leaves = self._program(batch)
        step = self._steps + 1
        metrics, = self._run(program, step, self._placed(program, batch, leaves))
        return self._after(step, metrics)

    def _step_rows(self, batch) -> dict[str, Any]:
        """`step` with a row source (`jaxpar.train.rows`): pull the batch's rows (host), run the
        step on them, push their gradients (host), then the services."""
        batch, rows, handle = self._rows.pull(batch)
        program, leaves = self._program(batch, rows=rows)
        step = self._steps + 1
        metrics, row_grads = self._run(program, step, self._placed(program, batch, leaves),
                                       self._rows.placed(program.row_shardings, rows))
        self._rows.push(handle, row_grads, metrics["finite"], step, batch, rows)
        return self._after(step, metrics)

    def _run(self, program: "_Program", step: int, *inputs) -> list:
        """Dispatch the compiled step on the state and ``inputs`` (inside the profile window when
        there is one); the state is kept, the rest (metrics, row gradients) returned."""
        if self._diverges is not None:     # the first step after a restore: a new history starts
            self._diverge()
        if self._profile is not None:
            self._profile.before(step)
            with self._profile.annotate(step):
                self._leaves, *out = program.fn(self._leaves, *inputs)
            self._profile.after(step, out[0])
        else:
            self._leaves, *out = program.fn(self._leaves, *inputs)
        return out

    def _after(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """What follows a dispatched step: the host's step count, the finite flag, the hooks."""
        self._state_view = None
        self._steps = step
        self._finite.append((step, metrics["finite"]))
        for every, hook in self._hooks:
            if not step % every:
                hook(step, metrics)
        return metrics

    def add_hook(self, hook: Callable[[int, dict], None], *, every: int = 1) -> None:
        """Call ``hook(step, metrics)`` after every step whose number is a multiple of ``every``
        (after the Trainer's own services: preemption, the non-finite check, checkpoints).
        ``metrics`` are the step's device arrays: reading one waits for that step, so a hook
        that reads them every step keeps the host from running ahead.

        >>> trainer.add_hook(lambda step, m: print(step, float(m["loss"])), every=100)  # doctest: +SKIP
        """
        if not callable(hook):
            raise TypeError(f"Trainer.add_hook: hook must be callable as hook(step, metrics), got {type(hook).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"Trainer.add_hook: every={every!r} must be a positive int (1 = after every step)")
        self._hooks.append((every, hook))

    def _on_preemption(self, step: int, metrics: dict[str, Any]) -> None:
        if self._preemption.reached(step):
            self._save_and_exit(metrics)

    def _on_finite_window(self, step: int, metrics: dict[str, Any]) -> None:
        self.check_finite()

    def _on_checkpoint(self, step: int, metrics: dict[str, Any]) -> None:
        self.check_finite()          # a step that did not update must not pass silently into a save
        if self.checkpointer.due(step) and step not in self.checkpointer.manager.all_steps():
            self._save_now()

    def _save_and_exit(self, metrics: dict[str, Any] | None) -> None:
        """Preempted (SIGTERM): save this step, wait for it, and leave with exit code 0 (the
        step's ``metrics`` go with the exit, for ``fit`` to log; None from ``evaluate``, which
        at step 0 has nothing trained to save)."""
        self.check_finite()
        self._diverge()
        trained = self._steps > 0
        if trained and self._steps not in self.checkpointer.manager.all_steps():
            self._save_now()
        self.checkpointer.close()
        self._preemption.close()      # saved: a SIGTERM from now on gets its default action
        stop = Preempted(self._steps, self.checkpointer.directory, saved=trained)
        stop.metrics = metrics
        raise stop

    def check_finite(self) -> None:
        """Read the finite flags of the steps since the last read (one wait); see ``nonfinite``."""
        if not self._finite:
            return
        flags = read(_stacked([f for _, f in self._finite]))[:len(self._finite)]
        bad = [step for (step, _), ok in zip(self._finite, flags) if not ok]
        self._finite.clear()
        if not bad:
            return
        self.skipped_steps.extend(bad)
        if self._nonfinite == "stop":
            raise FloatingPointError(
                f"Trainer: step {bad[0]} had a non-finite loss, gradient norm or update (updated parameters "
                "not finite, or NaN in the updated optimizer state)"
                + (f" (and steps {bad[1:]})" if bad[1:] else "") + "; nothing after it was saved, so every "
                "checkpoint holds finite values and a restart resumes from the newest one. Inspect that batch, "
                "lower the learning rate, or pass Trainer(nonfinite='skip') to skip such updates and go on")

    def lower(self, batch, *, platform: str | None = None) -> jax.stages.Lowered:
        """The lowered step for ``batch`` (``.compile()`` gives the program for reports; with
        ``rows``, the batch's rows are pulled for it and nothing is pushed).

        ``platform`` (e.g. ``"cuda"``) lowers it for that backend instead of the mesh's: the
        StableHLO a GPU would compile, readable on a CPU machine (``.as_text()``); it compiles
        only where that backend is."""
        if platform is not None and platform not in LOWERING_PLATFORMS:
            raise ValueError(f"Trainer.lower: platform={platform!r} is not one of {LOWERING_PLATFORMS}; "
                             "e.g. platform='cuda' for the program an NVIDIA GPU would compile")
        return self._lowered(batch, "train", platform)

    def lower_eval(self, batch) -> jax.stages.Lowered:
        """The lowered evaluation for ``batch`` (what ``evaluate`` runs), for reports."""
        return self._lowered(batch, "eval")

    def _lowered(self, batch, kind: str, platform: str | None = None) -> jax.stages.Lowered:
        rows = ()
        if self._rows is not None:
            batch, pulled, _ = self._rows.pull(batch)
            rows = (pulled,)
        program, leaves = self._program(batch, kind, *rows)
        args = (self._leaves, self._placed(program, batch, leaves),
                *(self._rows.placed(program.row_shardings, r) for r in rows))
        if platform is None:
            return program.fn.lower(*args)
        return program.fn.trace(*args).lower(lowering_platforms=(platform,))

    def lower_grads(self, batch) -> jax.stages.Lowered:
        """The step up to the update for ``batch``: its outputs are the gradients as the update
        receives them (ZeRO gradient specs), e.g. to measure their bytes per device."""
        from jaxpar.train.step import enter

        if self._rows is not None:
            raise ValueError("Trainer.lower_grads: a Trainer with rows= differentiates the pulled rows too; "
                             "lower the whole step with Trainer.lower(batch) instead")

        placed = self.place(batch)
        s = self._setting()
        grads = build_grads(s, self.loss_fn, self._global_view(placed))
        sh = state_shardings(self.plan, self.mesh, self._state)
        b_sh = jax.tree.map(lambda x: x.sharding, placed)
        fn = jax.jit(lambda p, r, b: grads(enter(s, p), r, b)[3], in_shardings=(sh.params, sh.rest, b_sh),
                     out_shardings=s.shardings(s.zero.grads))
        return fn.lower(self._state.params, self._state.rest, placed)

    @running      # a SIGTERM inside a batch is acted on at its end: SIGTERMs till then are one request
    def evaluate(self, batches: Iterable, steps: int | None = None) -> float:
        """Mean loss over ``batches`` (the first ``steps`` of them: a positive int, or None for
        all), without updating, the model in evaluation mode (``model.eval()``: dropout off, batch
        norm on its running statistics).

        With ``checkpoint_dir`` (and ``preemption``), a SIGTERM stops the evaluation before its
        next batch as a step boundary would: the current step is saved unless it is already
        (nothing at step 0: nothing was trained) and ``Preempted`` (exit code 0) is raised, so
        a script that only evaluates ends promptly, and a run that evaluates between parts of its
        training keeps the save of the step it reached (one process; several stop at their next
        training step, where JAX's preemption sync point makes them agree)."""
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"Trainer.evaluate: steps={steps!r} must be a positive int (how many of the batches "
                             "to evaluate), or None to evaluate all of them")
        total, n = 0.0, 0
        for i, batch in enumerate(batches):
            if steps is not None and i >= steps:
                break
            if self._preemption is not None and self._preemption.asked(self._steps + i):
                self._save_and_exit(None)
            rows = ()
            if self._rows is not None:      # rows pulled, nothing pushed
                batch, pulled, _ = self._rows.pull(batch)
                rows = (pulled,)
            program, leaves = self._program(batch, "eval", *rows)
            total += float(program.fn(self._leaves, self._placed(program, batch, leaves),
                                      *(self._rows.placed(program.row_shardings, r) for r in rows)))
            n += 1
        if n == 0:
            raise ValueError("Trainer.evaluate got no batches; pass an iterable with at least one batch")
        if steps is not None and n < steps:     # as fit: a short iterable is said, not averaged silently
            raise ValueError(f"Trainer.evaluate: steps={steps} but the batches ran out after {n}; pass steps={n} "
                             "(or None to evaluate all of them), or an iterable with at least steps batches")
        if self._metrics is not None:
            self._metrics.log_eval(self._steps, total / n)
        return total / n

    @running      # the same between its steps (loading a batch, logging)
    def fit(self, batches: Iterable, steps: int, *, log_every: int | None = None, progress: bool = True,
            callback: Callable[[int, dict], None] | None = None,
            until: int | None = None) -> list[dict[str, float]]:
        """Run ``steps`` steps with a progress bar (loss, tokens/s, ETA); returns one metrics dict
        per step.

        Metrics stay on the device and are read every ``log_every`` steps (default: the
        ``metrics`` config's ``every``, else 10; and the first and last step), so the host keeps
        dispatching steps ahead of the device in between; the ``metrics`` writers write at those
        steps. ``callback(i, record)`` is called for every step when the records are read.

        A loader that keeps its position (``state()`` and ``restore(state)``, such as
        `jaxpar.data.TokenLoader`) continues from the data position of the TrainState (restored
        from a checkpoint), and its position is stored there before every step, so checkpoints
        save it.

        ``profile_steps`` are step numbers over the Trainer's life (a resumed one continues
        them). ``until``: the last step of the whole run when this fit is one part of it (fits
        between evaluations): the progress bar counts the run's steps, and a profile window not
        yet traced must end by ``until``, else ``ValueError`` before the first step. Without it
        a later fit may reach the window; a Trainer that closes before the window's end warns."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        if log_every is None:
            log_every = self._metrics.config.every if self._metrics is not None else 10
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"Trainer.fit: steps={steps!r} must be a positive int")
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"Trainer.fit: log_every={log_every!r} must be a positive int")
        self._check_profile_window(steps, until)
        history: list[dict[str, float]] = []
        pending: list[tuple[int, int, dict, float]] = []
        resumable = _keeps_position(batches)
        it = self._resume_loader(batches) if resumable else iter(batches)
        columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        with Progress(*columns, disable=not progress or jax.process_index() != 0) as bar:
            # part of a longer run (``until``): the bar counts the run's steps, not this part's
            task = bar.add_task("train", total=steps if until is None else until,
                                completed=0 if until is None else self._steps, info="")
            last, self._save_s = time.perf_counter(), 0.0
            for i in range(steps):
                try:
                    batch = next(it)
                except StopIteration:
                    self._flush(pending, history, callback, last)
                    raise ValueError(f"Trainer.fit: the batches ran out after {i} of {steps} steps; the "
                                     f"{len(history)} finished steps are in trainer.history") from None
                if resumable:    # set before the step, which may save: the position of the next batch
                    self.data_state = batches.state()
                try:
                    pending.append((i, self._steps + 1, self.step(batch), 0.0))
                except Preempted as stop:    # the saved step's record is logged before the exit
                    pending.append((i, stop.step, stop.metrics, 0.0))
                    self._flush(pending, history, callback, last)
                    raise
                if i == 0:
                    tokens = self._start_metrics(batch)
                if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
                    last = self._flush(pending, history, callback, last)
                    speed = tokens / history[-1]["time_s"]
                    bar.update(task, info=progress_text(history[-1]["loss"], speed, self._mfu(history[-1]["time_s"])))
                bar.update(task, advance=1)
        if self.checkpointer is not None:
            self.checkpointer.wait()     # the run is over: every save started is committed
        return history

    def _check_profile_window(self, steps: int, until: int | None) -> None:
        """With ``until`` (the last step of the run this fit is part of), a profile window not yet
        traced must end by it: `profile_window_outside`, the rule ``--profile-steps`` follows.
        Without, later fit calls may reach the window: a run that ends before the window's end
        says so when the Trainer closes (`ProfileWindow.close`). A window the Trainer resumed past
        is left alone: it was the interrupted run's to trace."""
        first, last = self._steps + 1, self._steps + steps
        if until is None:
            return
        if not isinstance(until, int) or isinstance(until, bool) or until < last:
            raise ValueError(f"Trainer.fit: until={until!r} must be an int >= {last}, the last step this fit "
                             f"runs (steps={steps} after step {self._steps}): the last step of the whole run")
        window = self._profile
        if window is None or window.active or window.done or window.stop - 1 < first:
            return
        inside = profile_window_outside((window.start, window.stop), first, until)
        if inside is None:
            return
        start, stop = window.start, window.stop
        what = "nothing would be traced" if start > until else f"the trace would stop short of step {stop - 1}"
        raise ValueError(f"Trainer.fit: profile_steps=({start}, {stop}) traces steps {start} to {stop - 1}, but "
                         f"the run this fit is part of ends at step until={until}, so {what}; run to step "
                         f"{stop - 1} (until={stop - 1} and the fits to reach it), or choose a window inside the "
                         f"run, e.g. profile_steps={inside}")

    def _resume_loader(self, batches) -> Iterator:
        """Iterate a loader that keeps its position from the TrainState's data position (restored
        with a checkpoint), so a resumed run reads the batches the interrupted one would have."""
        if self.data_state:
            batches.restore(self.data_state)
        return iter(batches)

    shardings = RemovedAttribute(Removed(    # a property of 0.1.0
        "use jaxpar.plan.state_shardings(trainer.plan, trainer.mesh, trainer.state), a TrainState of "
        "shardings (.params, .rest, .opt_state)", "docs/architecture.md"))

    def close(self) -> None:
        """Finish the saves in flight, close the checkpoint directory and the metric writers, stop
        a profile trace still running, and give SIGTERM back (`Preemption.close`). Safe on a
        Trainer whose construction failed part way (what was opened is closed). A part that
        fails to close (a save in flight that failed) does not keep the others open: its error
        is raised once they are closed."""
        failed = None
        for part in ("_profile", "_metrics", "checkpointer", "_preemption"):
            opened = getattr(self, part, None)
            if opened is not None:
                try:
                    opened.close()
                except Exception as e:    # noqa: BLE001  (raised below, after the rest)
                    failed = failed or e
        if failed is not None:
            raise failed

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _flush(self, pending, history, callback, since: float) -> float:
        """Read the pending steps' metrics (one wait for all of them). Their time is the window's
        since ``since`` less the checkpoint saves in it (`_save_now`: the host saving while no
        step runs), logged apart as ``checkpoint_s``."""
        if not pending:
            return since
        self.check_finite()
        values = read([{k: m[k] for k in ("loss", "grad_norm", *ROUTING) if k in m} for _, _, m, _ in pending])
        now = time.perf_counter()
        saving, self._save_s = self._save_s, 0.0
        window = max(now - since - saving, 1e-9)
        per_step = window / len(pending)
        records = []
        for (i, step, _, _), value in zip(pending, values):
            record = {"step": step, "loss": float(value["loss"]), "grad_norm": float(value["grad_norm"]),
                      "time_s": per_step}
            record |= {k: value[k].item() for k in ROUTING if k in value}     # an MoE model's routing
            records.append(record)
            history.append(record)
            if callback is not None:
                callback(i, record)
        if self._metrics is not None:
            self._metrics.log(records[-1]["step"], records, window, self._state.opt_state, checkpoint_s=saving)
        self.history = history
        pending.clear()
        return now

    def _mfu(self, step_time_s: float) -> float | None:
        """MFU of a step that took ``step_time_s`` from model FLOPs (None without a peak)."""
        if self._metrics is None or self._metrics.mfu_source not in ("given", "model"):
            return None
        return self._metrics.mfu(step_time_s)

    def _start_metrics(self, batch) -> int:
        """Tokens per step of ``batch``; with ``metrics``, also the compiled step's memory and
        FLOPs, read once per compiled step over the Trainer's life (a later fit of batches shaped
        alike reads nothing: the first record carried them). With ``rows``: of the batch and rows
        the last step pulled (pulling again would read the rows anew)."""
        if self._rows is not None:
            batch, rows = self._rows.pulled
            program, leaves = self._program(batch, rows=rows)
            if self._metrics is not None and self._metrics.started(program):
                return self._metrics.tokens_per_step
            placed = jax.tree.unflatten(program.batch_def, jax.device_put(self._placed(program, batch, leaves),
                                                                          program.shardings))
            lowered = lambda: program.fn.lower(self._leaves, placed,  # noqa: E731
                                               self._rows.placed(program.row_shardings, rows))
        else:
            program, _ = self._program(batch)
            if self._metrics is not None and self._metrics.started(program):
                return self._metrics.tokens_per_step
            placed = self.place(batch)   # global arrays: a process's host batch may hold only its rows
            lowered = lambda: self.lower(batch)  # noqa: E731
        if self._metrics is None:
            return examples_per_step(placed) * tokens_per_example(placed)
        self._metrics.start(lowered().compile(), placed, num_devices=self.mesh.devices.size,
                            resumed=self._steps > 1, model_flops_per_token=self._flops_per_token, key=program)
        return self._metrics.tokens_per_step

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | None = None, *, data_state: dict | None = None) -> int:
        """Save the whole state to ``directory`` (blocking), or without one asynchronously to
        ``checkpoint_dir``, as its newest step: steps after this one (another history, e.g.
        after a `restore` to an earlier step) are moved aside, a step of this number that holds
        exactly this state is kept as it is (nothing to write), and one that holds another state
        is moved aside to ``replaced-<step>`` (`Checkpointer.save_as_newest`). Returns the step."""
        self.check_finite()
        if data_state is not None:
            self.data_state = data_state
        if directory is None and self.checkpointer is None:
            raise ValueError("Trainer.save: give a directory or construct the Trainer with checkpoint_dir=")
        if directory is None:
            self._diverge()
        return self._save_now(directory, newest=directory is None)

    def _save_now(self, directory: str | None = None, *, newest: bool = False) -> int:
        """Save this step (blocking to ``directory``, else asynchronously with the checkpointer;
        ``newest``: as the checkpointer's newest step, `Checkpointer.save_as_newest`) with the
        row source's tables: those it saves itself first, so a complete checkpoint always has
        them, and those it hands over (a copy taken now) in the step's own commit."""
        start = time.perf_counter()     # every caller read the finite flags: the device has caught up
        try:
            tables = None if self._rows is None else self._rows.save(self._steps)
            if directory is not None:
                return save_state(directory, self.plan, self._state, self.mesh, rows=tables)
            if newest:
                return self.checkpointer.save_as_newest(self.plan, self._state, self.mesh, rows=tables)
            return self.checkpointer.save(self.plan, self._state, self.mesh, rows=tables)
        finally:
            self._save_s += time.perf_counter() - start

    def _restore_rows(self, step: int, directory: str | None, *read: Any) -> None:
        """The row source goes back to checkpoint ``step`` (of ``directory``, else of the
        checkpointer) before the Trainer takes its state: a refusal changes nothing. ``read``:
        the step's tables, when they were read already (resuming)."""
        if self._rows is None:
            return
        if read:
            self._rows.restore(step, lambda: read[0], self.checkpointer.directory)
        elif directory is not None:
            self._rows.restore(step, lambda: restore_rows(directory, step), str(directory))
        else:
            self._rows.restore(step, lambda: self.checkpointer.restore_rows(step), self.checkpointer.directory)

    def restore(self, directory: str | None = None, *, step: int | None = None) -> dict:
        """Restore a checkpoint saved under any layout into this trainer's layout; returns its
        ``{"step", "data_state", "jaxpar_version"}``.

        Reading changes nothing on disk (restoring step after step to evaluate each is safe). When
        training goes on from it — at the first ``step`` or save after the restore — the steps of
        ``checkpoint_dir`` after it (and the step itself, when it came from another directory)
        hold a history no longer continued and are moved aside to ``abandoned-<step>``
        (`jaxpar.checkpoint.Checkpointer.retire_after`, with a warning), so the new history's
        saves are the newest steps a restart resumes (docs/checkpoint.md)."""
        if directory is not None:
            state, meta = restore_state(directory, self._state, self.mesh, step=step)
        elif self.checkpointer is not None:
            state, meta = self.checkpointer.read(self._state, self.mesh, step)
        else:
            raise ValueError("Trainer.restore: give a directory or construct the Trainer with checkpoint_dir=")
        self._restore_rows(int(meta["step"]), directory)
        self._set(state)
        if self.checkpointer is not None:     # retired when training goes on (`_diverge`)
            self._diverges = (self._steps, directory is not None)
        return meta

    def _diverge(self) -> None:
        """Training goes on after a `restore`: retire the steps of ``checkpoint_dir`` that hold the
        history left (after the step restored; that step too when it came from elsewhere)."""
        if self._diverges is not None:
            step, elsewhere = self._diverges
            self._diverges = None
            self.checkpointer.retire_after(step, including=elsewhere)

    # ------------------------------------------------------------------ views
    @property
    def state(self) -> TrainState:
        """The `TrainState` (params as stored, rest, opt_state, step, data position)."""
        return self._state

    @state.setter
    def state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Trainer.state must be a jaxpar.TrainState, got {type(state).__name__}")
        if jax.tree.structure(state.replace(data=None)) != jax.tree.structure(self.state.replace(data=None)):
            raise ValueError("Trainer.state: the new state's tree differs from the trainer's (another model "
                             "or optimizer?); restore across layouts with Trainer.restore")
        self._set(state)

    @property
    def config(self) -> ParallelConfig:
        """The config the plan realises (after a search: the plan as a ``semi_auto`` config)."""
        return self.plan.config

    @property
    def params(self):
        return self.state.params

    @property
    def rest(self):
        return self.state.rest

    @rest.setter
    def rest(self, rest) -> None:
        self.state = self.state.replace(rest=rest)

    @property
    def opt_state(self):
        return self.state.opt_state

    @property
    def step_count(self) -> int:
        return self._steps

    @step_count.setter
    def step_count(self, step: int) -> None:
        self.state = self.state.replace(step=jax.device_put(jnp.asarray(step, jnp.int32), self._state.step.sharding))

    @property
    def data_state(self) -> dict:
        """The data position saved with checkpoints (a JSON-able dict)."""
        return self.state.data

    @data_state.setter
    def data_state(self, data: dict) -> None:
        self._data = check_data(data)          # host metadata: set every step by fit, so no re-wrap
        self._state_view = None

    @property
    def offload(self) -> tuple[str, ...]:
        return self._offload

    @property
    def compute_specs(self):
        """The plan's compute specs of the parameters, as a spec tree (where parameters are used)."""
        return self.plan.specs("params", self.params)

    @property
    def param_specs(self):
        """Where parameters are stored (sharded at ZeRO-3)."""
        return self.plan.specs("stored", self.params)

    @property
    def zero(self):
        return self.plan.zero(self.params)

    @property
    def model(self) -> nnx.Module:
        """The model with the current parameters (sharded as planned), in device memory: with
        ``offload="params"`` a device copy of the parameters the Trainer keeps on the host, so the
        model runs outside the step (generation, evaluation by hand) as without offload; each read
        makes a new copy (the parameters' bytes in device memory while it is held): read it once."""
        state = self.state
        params = state.params
        if "params" in self._offload:
            params = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), params)
        return nnx.merge(self.graphdef, params, state.rest)


class _Program:
    """A compiled step (or evaluation) for one batch shape, and what placing such a batch needs."""

    __slots__ = ("fn", "shardings", "batch_def", "fast", "row_shardings")

    def __init__(self, fn, shardings: list, batch_def, fast: bool, row_shardings=None):
        self.fn, self.shardings, self.batch_def, self.fast = fn, shardings, batch_def, fast
        self.row_shardings = row_shardings      # where the step takes pulled rows (None: no row source)


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning given while the step is traced at the first caller
    outside jaxpar and JAX (the line calling ``step`` / ``fit`` / ``lower``)."""
    frame, level = sys._getframe(1), 1     # 1: the function that warns
    while frame.f_back is not None and (frame.f_globals.get("__name__") or "").split(".")[0] in _INNER:
        frame, level = frame.f_back, level + 1
    return level


_INNER = {"jaxpar", "jax", "jaxlib", "flax", "contextlib", "functools"}


def _stacked(flags: list) -> jax.Array:
    """The device flags as one array, so reading them is one transfer, not one per step. The
    list is padded to a power of two (with its last flag) so at most a few tiny programs compile."""
    size = 1 << (len(flags) - 1).bit_length()
    return _stack(*flags, *[flags[-1]] * (size - len(flags)))


@jax.jit
def _stack(*flags):
    return jnp.stack(flags)


def _transformation(tx):
    """``tx`` as an ``optax.GradientTransformation``: an ``optax.MultiSteps`` (which is not one
    itself) becomes its ``gradient_transformation()``; anything else is returned as it is."""
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def _check_args(model, tx, loss_fn, config, mesh, plan, offload) -> None:
    """The Trainer's arguments: their types, the mesh against the config and the plan, and the
    combinations `check_combination` refuses (the same check `make_train_plan` runs)."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"Trainer: model must be a flax.nnx.Module, got {type(model).__name__}")
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"Trainer: tx must be an optax.GradientTransformation (optax.adamw(1e-3), optax.chain(...), "
                        f"optax.MultiSteps(...)), got {type(tx).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"Trainer: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"Trainer: config must be a ParallelConfig, got {type(config).__name__}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"Trainer: mesh must be a jax.sharding.Mesh (see jaxpar.make_mesh), got {type(mesh).__name__}")
    for axis, size in config.mesh.items():
        if axis not in mesh.shape or (size != -1 and mesh.shape[axis] != size):
            raise ValueError(f"Trainer: config.mesh {config.mesh} does not match the mesh {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(config)")
    offload = tuple(plan.offload) if isinstance(plan, TrainPlan) else host.check_targets(offload)
    check_combination(config, model, loss_fn, mesh=mesh, platform=mesh.devices.flat[0].platform, offload=offload,
                      who="Trainer")
    if plan is not None:
        if not isinstance(plan, TrainPlan):
            raise TypeError(f"Trainer: plan must be a jaxpar.TrainPlan, got {type(plan).__name__}")
        if dict(plan.mesh) != {a: int(s) for a, s in mesh.shape.items()}:
            raise ValueError(f"Trainer: plan is for mesh {dict(plan.mesh)} but the mesh is {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(plan.config)")
        # a searched plan realises mode "auto" as a semi_auto config; any other plan is its config's
        if config.mode != "auto" and plan.config != config:
            differ = {f.name: (getattr(config, f.name), getattr(plan.config, f.name)) for f in dataclasses.fields(config)
                      if getattr(config, f.name) != getattr(plan.config, f.name)}
            raise ValueError("Trainer: plan was made for another config than config= (field: (config, plan's): "
                             f"{differ}); pass config=plan.config, or make the plan from this config "
                             "(jaxpar.train.plan_for / jaxpar.make_train_plan)")


def _check_batch(batch) -> None:
    """A batch is a pytree of arrays with one leading (batch) dimension shared by every leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch has no arrays; pass a pytree of arrays whose leading dimension is the batch")
    rows = None
    for path, x in leaves:
        shape = np.shape(x)
        where = f"batch{jax.tree_util.keystr(path)}"
        if not shape:
            raise ValueError(f"{where} is a scalar; every batch leaf needs a leading batch dimension "
                             "(broadcast it to [batch, ...] or close over it in loss_fn)")
        dtype = _dtype_of(x)      # jnp: NumPy counts bfloat16 and the float8 types as no numbers
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
            raise TypeError(f"{where} has dtype {dtype}: batch leaves must be numeric or boolean arrays (they "
                            "are placed on the devices); encode strings as ids, or keep them out of the batch")
        if shape[0] == 0:
            raise ValueError(f"{where} has 0 rows (shape {tuple(shape)}); a batch needs at least one row: its mean "
                             "loss over no rows is NaN. Drop the empty batch or feed it rows")
        if rows is None:
            rows, first = shape[0], where
        elif shape[0] != rows:
            raise ValueError(f"{where} has {shape[0]} rows but {first} has {rows}; every batch leaf must have "
                             "the same leading (batch) dimension")


def _keeps_position(batches) -> bool:
    """Whether ``batches`` is a loader with ``state()`` / ``restore(state)`` (e.g. `jaxpar.data.TokenLoader`)."""
    return callable(getattr(batches, "state", None)) and callable(getattr(batches, "restore", None))


def _dtype_of(x):
    """An array's dtype, or the one NumPy gives a Python value (``np.result_type`` of an array
    object itself is deprecated); a JAX key array's ``key<...>`` dtype as it is (NumPy reads
    no such dtype)."""
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)
