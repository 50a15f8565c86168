"""``Trainer``: a `TrainPlan`, a `TrainState`, its compiled programs, and the loop.

The plan says where everything lives; it is made before the Trainer runs anything (given none,
the Trainer calls `jaxpar.make_train_plan`; mode ``"auto"`` is searched before, with
`jaxpar.auto.plan_for`). The state is what the step takes and returns; the step is built in
one place (`jaxpar.train.step.build_step`) and compiled once per batch shape
(`jaxpar.train.programs`). What runs around a step — checkpoints, preemption, the non-finite
read, metrics, the profile window, the user's hooks — is a list of hook objects built from one
frozen value (`jaxpar.train.Services`); the loop walks them and owns none of their state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.deprecation import OFFLOAD, Removed, RemovedAttribute
from jaxpar.config import ParallelConfig
from jaxpar.metrics import progress_text
from jaxpar.nn.init import holds_placeholders
from jaxpar.nn.specs import declared_names
from jaxpar.plan import TrainPlan, TrainState, check_data, init_state, make_train_plan
from jaxpar.train.arguments import NO_PLAN, check_args, check_restored, plan_and_record, transformation
from jaxpar.train import checkpointing
from jaxpar.train.hooks import EveryHook, Preempted, running
from jaxpar.train.programs import Programs, StepOptions
from jaxpar.train.replicas import replica_hooks
from jaxpar.train.rows import RowPath, check_rows
from jaxpar.train.services import Placement, Services, former_keywords
from jaxpar.train.watch import Window, check_until, flush, next_batch, tokens_per_step


class Trainer:
    """Compiles and runs training of an NNX ``model`` with an optax ``tx``.

    ``loss_fn(model, batch)`` returns a scalar loss or ``(loss, aux)``. Batches are pytrees of
    arrays whose leading dimension is the global batch.

    >>> trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh,
    ...                          services=jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir="ckpt")))
    >>> metrics = trainer.step(batch)          # {"loss": ..., "grad_norm": ...} (device arrays)
    >>> history = trainer.fit(batches, steps=100)
    >>> trainer.plan, trainer.state             # the TrainPlan and the TrainState

    ``plan``: the `TrainPlan` to train under (``make_train_plan``'s, a loaded one, or what
    `jaxpar.auto.plan_for` returns: the plan and its search record, kept as ``searched``);
    without one the Trainer makes it from ``config`` with ``make_train_plan`` (mode ``"auto"``
    needs one: the search runs before the Trainer). ``services``: a `jaxpar.Services` — checkpoints
    (resumed at construction; with preemption, a SIGTERM saves at the next step boundary and
    raises `Preempted`, exit code 0), the non-finite policy, metrics, the profile window and the
    user's hooks (docs/reliability.md, docs/metrics.md). ``placement``: a `jaxpar.Placement` —
    donation, per-process batches, replica groups. ``rows``: a row source (`jaxpar.ps.HostRows`,
    `jaxpar.ps.ServerRows`) for embedding rows the model does not hold: pulled before each step,
    their gradients pushed after it, their tables kept with the checkpoints (`jaxpar.train.rows`).
    ``pipeline.stages > 1`` needs ``loss_fn`` as a ``jaxpar.pipeline.PipelineLoss``. Saves in
    flight finish at ``close()`` (or leaving ``with trainer:``), at the end of ``fit``, and at
    exit. The Trainer owns the model's arrays from then on (they are donated to the step): read
    the trained model as ``trainer.model``.
    """

    @former_keywords
    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable,
                 config: ParallelConfig, mesh, *, plan: TrainPlan | tuple | None = None,
                 services: Services | None = None, placement: Placement | None = None, rows: Any = None):
        tx = transformation(tx)
        plan, self.searched = plan_and_record(plan)
        services = Services() if services is None else services
        placement = Placement() if placement is None else placement
        check_args(model, tx, loss_fn, config, mesh, plan, services, placement)   # refused combinations included
        self._hooks: list = []
        self._preemption = None
        try:     # a refused or failed construction leaves nothing open behind it (files, threads, handlers)
            check_rows(rows, config, plan, placement.replicas)
            self.row_path = None if rows is None else RowPath(rows, mesh)
            self.mesh, self.tx, self.loss_fn = mesh, tx, loss_fn
            self.global_batch = jax.process_count() == 1 if placement.global_batch is None else placement.global_batch
            self._hooks = services.build() + replica_hooks(placement.replicas)   # opens the checkpoint directory
            self._preemption = self.service("preemption")
            if plan is None:                  # the Trainer makes the config's plan; it never searches
                if config.mode == "auto":
                    raise ValueError(NO_PLAN)
                plan = make_train_plan(config, mesh, model, tx, loss_fn=loss_fn)
            self.plan, replicas = plan, self.service("replicas")
            self._leaves, self._treedef, self._data, self._state_view = None, None, {}, None
            self._steps, self.save_s, self.data_wait_s, self.fitting, self.last_batch = 0, 0.0, 0.0, False, None
            self.flops_per_token = getattr(model, "flops_per_token", None)   # model FLOPs per token (MFU)
            options = StepOptions(donate=placement.donate, global_batch=self.global_batch,
                                  skip_nonfinite=getattr(self.service("nonfinite"), "policy", None) == "skip",
                                  rule_names=frozenset(declared_names(plan.config, nnx.state(model))),
                                  model_name=type(model).__name__, exchange=getattr(replicas, "average", None))
            self.programs = Programs(plan, mesh, None, loss_fn, tx, state=lambda: (self._state, self._treedef),
                                     leaves=lambda: self._leaves, rows=self.row_path, options=options)
            placeholders = holds_placeholders(model)
            self.graphdef, state = init_state(plan, mesh, model, tx)
            self.programs.graphdef = self.graphdef
            self._set(state)
            initial = self._leaves
            for hook in self._hooks:
                _call(hook, "on_start", self)
            if placeholders:
                check_restored(initial, self._leaves, self.service("checkpoint"))
        except BaseException:
            with contextlib.suppress(Exception):     # the construction's error is the one to see
                self.close()
            raise

    # ------------------------------------------------------------------ the state between steps
    def _set(self, state: TrainState) -> None:
        self._state = state
        self._steps = int(state.step)

    @property
    def _state(self) -> TrainState | None:
        """The state as a flat list of device arrays between steps (the compiled step takes and
        returns that list, so a step re-wraps no pytree node); the TrainState is rebuilt when read."""
        if self._state_view is None and self._leaves is not None:
            self._state_view = jax.tree.unflatten(self._treedef, self._leaves).attach(self._data)
        return self._state_view

    @_state.setter
    def _state(self, state: TrainState) -> None:
        detached, _ = state.detach()
        leaves, treedef = jax.tree.flatten(detached)
        if self._treedef is not None and treedef != self._treedef:
            self.programs.cache.clear()      # another tree (a restore into new leaves): compile anew
        self._leaves, self._treedef, self._data, self._state_view = leaves, treedef, state.data, state

    # ------------------------------------------------------------------ the loop
    def service(self, name: str):
        """The hook that provides service ``name`` (``"checkpoint"``, ``"preemption"``,
        ``"nonfinite"``, ``"metrics"``, ``"profile"``), or None."""
        return next((h for h in self._hooks if getattr(h, "service", None) == name), None)

    hooks = property(lambda self: tuple(self._hooks), doc="The hooks walked around each step, in their order.")

    def place(self, batch):
        """Put a host batch on the mesh by ``dataset_strategy`` (with ``rows``: its rows pulled)."""
        return self.programs.place(batch)

    @running      # a SIGTERM inside a step is acted on at its end: SIGTERMs till then are one request
    def step(self, batch) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics (``"loss"``, ``"grad_norm"``; MoE models
        ``"moe_load_balance"``, ``"moe_z_loss"``, ``"moe_dropped"``) as device arrays: reading one
        waits for the step. The host path is about a hand-written ``jax.jit`` loop's: the program is
        found once per batch shape, the state is a flat list of arrays, the hooks are walked once."""
        rows = self.row_path
        pulled = handle = None
        if rows is not None:                 # the row source pulls before the step and pushes after
            batch, pulled, handle = rows.pull(batch)
        program, leaves = self.programs.get(batch, rows=pulled)
        step = self._steps + 1
        inputs = [self.programs.placed(program, batch, leaves)]
        if rows is not None:
            inputs.append(rows.placed(program.row_shardings, pulled))
        for hook in self._hooks:
            _call(hook, "before_step", self, step)
        self._leaves, metrics, *row_grads = program.fn(self._leaves, *inputs)
        if rows is not None:
            rows.push(handle, row_grads[0], metrics["finite"], step, batch, pulled)
        self._state_view, self._steps, self.last_batch = None, step, batch
        for hook in self._hooks:
            _call(hook, "after_step", self, step, metrics)
        return metrics

    def add_hook(self, hook: Callable[[int, dict], None], *, every: int = 1) -> None:
        """Call ``hook(step, metrics)`` after every step whose number is a multiple of ``every``,
        after the hooks there are (hook objects, placed before or after the built-in services,
        go in ``Services(hooks=...)``). ``metrics`` are device arrays: reading one waits.

        >>> trainer.add_hook(lambda step, m: print(step, float(m["loss"])), every=100)  # doctest: +SKIP
        """
        self._hooks.append(EveryHook(hook, every))

    def check_finite(self) -> None:
        """Read the finite flags of the steps since the last read (one wait); see ``Services.nonfinite``."""
        nonfinite = self.service("nonfinite")
        if nonfinite is not None:
            nonfinite.check()

    skipped_steps = property(lambda self: getattr(self.service("nonfinite"), "skipped", []),
                             doc='The steps whose update was not finite (skipped under Services(nonfinite="skip")).')

    def lower(self, batch, *, platform: str | None = None) -> jax.stages.Lowered:
        """The lowered step for ``batch`` (``.compile()`` gives the program for reports; with
        ``rows``, its rows are pulled and nothing is pushed). ``platform`` (e.g. ``"cuda"``): the
        StableHLO that backend would compile, readable here; it compiles only there."""
        return self.programs.lowered(self._leaves, batch, "train", platform)

    def lower_eval(self, batch) -> jax.stages.Lowered:
        """The lowered evaluation for ``batch`` (what ``evaluate`` runs), for reports."""
        return self.programs.lowered(self._leaves, batch, "eval")

    def lower_grads(self, batch) -> jax.stages.Lowered:
        """The step up to the update: its outputs are the gradients as the update receives them."""
        return self.programs.lower_grads(batch)

    @running      # a SIGTERM inside a batch is acted on at its end: SIGTERMs till then are one request
    def evaluate(self, batches: Iterable, steps: int | None = None) -> float:
        """Mean loss over ``batches`` (the first ``steps``: a positive int, or None for all), without
        updating, the model in evaluation mode (dropout off, batch norm on its running statistics).
        With preemption, a SIGTERM stops it before its next batch as a step boundary would (the
        step saved unless it is, or nothing was trained; then `Preempted`)."""
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"Trainer.evaluate: steps={steps!r} must be a positive int (how many of the batches "
                             "to evaluate), or None to evaluate all of them")
        total, n = 0.0, 0
        for i, batch in enumerate(batches):
            if steps is not None and i >= steps:
                break
            if self._preemption is not None and self._preemption.asked(self._steps + i):
                self._preemption.leave(self, None)
            total += float(self.programs.evaluate(self._leaves, batch))
            n += 1
        if n == 0:
            raise ValueError("Trainer.evaluate got no batches; pass an iterable with at least one batch")
        if steps is not None and n < steps:     # as fit: a short iterable is said, not averaged silently
            raise ValueError(f"Trainer.evaluate: steps={steps} but the batches ran out after {n}; pass steps={n} "
                             "(or None to evaluate all of them), or an iterable with at least steps batches")
        if (watcher := self.service("metrics")) is not None:
            watcher.logger.log_eval(self._steps, total / n)
        return total / n

    @running      # the same between its steps (loading a batch, logging)
    def fit(self, batches: Iterable, steps: int, *, log_every: int | None = None, progress: bool = True,
            callback: Callable[[int, dict], None] | None = None,
            until: int | None = None) -> list[dict[str, float]]:
        """Run ``steps`` steps with a progress bar (loss, tokens/s, ETA); returns one metrics dict
        per step, read every ``log_every`` steps (default: the metrics' ``every``, else 10; and the
        first and last step) and handed to the metrics service; ``callback(i, record)`` per step.

        A loader with ``state()`` / ``restore(state)`` (`jaxpar.data.TokenLoader`) continues from
        the TrainState's data position, which is stored before every step. ``until``: the last
        step of the whole run when this fit is one part of it: the bar counts the run's steps,
        and a profile window not yet traced must end by ``until`` (else ``ValueError`` first)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        watcher = self.service("metrics")
        if log_every is None:
            log_every = watcher.config.every if watcher is not None else 10
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"Trainer.fit: steps={steps!r} must be a positive int")
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"Trainer.fit: log_every={log_every!r} must be a positive int")
        check_until(self, steps, until)
        if watcher is not None:
            watcher.flush(self, end=True)     # steps run outside fit are logged first
        history: list[dict[str, float]] = []
        resumable = callable(getattr(batches, "state", None)) and callable(getattr(batches, "restore", None))
        if resumable and self.data_state:
            batches.restore(self.data_state)
        it: Iterator = iter(batches)
        columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.fitting = True
        try:
            with Progress(*columns, disable=not progress or jax.process_index() != 0) as bar:
                task = bar.add_task("train", total=steps if until is None else until,
                                    completed=0 if until is None else self._steps, info="")
                self.save_s, window = 0.0, Window()
                for i in range(steps):
                    try:
                        batch = next_batch(self, it)
                    except StopIteration:
                        flush(self, window, history, callback, watcher)
                        raise ValueError(f"Trainer.fit: the batches ran out after {i} of {steps} steps; the "
                                         f"{len(history)} finished steps are in trainer.history") from None
                    if resumable:    # set before the step, which may save: the position of the next batch
                        self.data_state = batches.state()
                    try:
                        window.add(i, self._steps + 1, self.step(batch))
                    except Preempted as stop:    # the saved step's record is logged before the exit
                        window.add(i, stop.step, stop.metrics)
                        flush(self, window, history, callback, watcher)
                        raise
                    if i == 0:
                        tokens = watcher.start(self, batch) if watcher is not None else tokens_per_step(self, batch)
                    if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
                        flush(self, window, history, callback, watcher)
                        seconds = history[-1]["time_s"]
                        mfu = watcher.mfu(seconds) if watcher is not None else None
                        bar.update(task, info=progress_text(history[-1]["loss"], tokens / seconds, mfu))
                    bar.update(task, advance=1)
        finally:
            self.fitting = False
        if (checkpoint := self.service("checkpoint")) is not None:
            checkpoint.checkpointer.wait()     # the run is over: every save started is committed
        return history

    # ------------------------------------------------------------------ checkpoints
    checkpointer = property(lambda self: getattr(self.service("checkpoint"), "checkpointer", None),
                            doc="The checkpoint service's `jaxpar.checkpoint.Checkpointer` (None without one).")

    def save(self, directory: str | None = None, *, data_state: dict | None = None) -> int:
        """Save the whole state to ``directory`` (blocking), or without one asynchronously to the
        checkpoint directory as its newest step (`jaxpar.train.checkpointing.save`). Returns the step."""
        if data_state is not None:
            self.data_state = data_state
        return checkpointing.save(self, directory)

    def restore(self, directory: str | None = None, *, step: int | None = None) -> dict:
        """Restore a checkpoint saved under any layout into this trainer's layout; returns its
        ``{"step", "data_state", "jaxpar_version"}``. Reading changes nothing on disk; when training
        goes on from it, the checkpoint directory's later steps are moved aside (docs/checkpoint.md)."""
        state, meta = checkpointing.restore(self, directory, step)
        self._set(state)
        return meta

    shardings = RemovedAttribute(Removed(    # a property of 0.1.0
        "use jaxpar.plan.state_shardings(trainer.plan, trainer.mesh, trainer.state), a TrainState of "
        "shardings (.params, .rest, .opt_state)", "docs/architecture.md"))

    def close(self) -> None:
        """Close every hook, the last first (saves in flight finish, writers close, a profile trace
        stops, SIGTERM is given back). Safe on a Trainer whose construction failed part way; a hook
        that fails to close does not keep the others open: its error is raised once they are."""
        failed = None
        for hook in reversed(self._hooks):
            try:
                _call(hook, "on_close", self)
            except Exception as e:    # noqa: BLE001  (raised below, after the rest)
                failed = failed or e
        if failed is not None:
            raise failed

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    config = property(lambda self: self.plan.config, doc="The config the plan realises (searched: semi_auto).")
    params = property(lambda self: self.state.params)
    opt_state = property(lambda self: self.state.opt_state)
    offload = RemovedAttribute(OFFLOAD)    # a property of 0.1.0: host offload was removed
    compute_specs = property(lambda self: self.plan.specs("params", self.params),
                             doc="Where parameters are used (the plan's compute specs).")
    param_specs = property(lambda self: self.plan.specs("stored", self.params),
                           doc="Where parameters are stored (sharded at ZeRO-3).")
    zero = property(lambda self: self.plan.zero(self.params))
    _compiled = property(lambda self: self.programs.cache)

    @property
    def rest(self):
        return self.state.rest

    @rest.setter
    def rest(self, rest) -> None:
        self.state = self.state.replace(rest=rest)

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
    def model(self) -> nnx.Module:
        """The model with the current parameters."""
        state = self.state
        return nnx.merge(self.graphdef, state.params, state.rest)


def _call(hook, method: str, *args) -> None:
    """``hook.method(*args)`` when the hook has that method (a hook may define only some)."""
    fn = getattr(hook, method, None)
    if fn is not None:
        fn(*args)
