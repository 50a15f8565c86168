"""``Trainer``: compiles one training step for a config and mesh, and runs the loop.

The step is assembled in one place (``Trainer._train_fn``), from the inside out; the order
matters:

1. the loss of the merged model (jit modes) or per device in ``shard_map`` (hybrid);
2. ZeRO-3 gathers the sharded parameters to their compute layout *inside* the loss, so
   that recompute (next) gathers them again in the backward instead of keeping them;
3. ``remat`` wraps the whole loss (gather included) in ``jax.checkpoint``;
4. ``interleave`` runs the loss as ``n`` parts one after another (multi-copy parallel);
5. gradients (hybrid + ``comm_fusion``: per device, then bucketed all-reduces);
6. ``grad_accum`` scans 1–5 over ``k`` micro-batches, the gradient sum laid out as the ZeRO
   gradient specs (sharded at level ≥ 2);
7. the optimizer update, state sharded by the ZeRO plan; host-offloaded state is moved in
   first and written back by ``out_shardings``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.data import batch_axes, batch_shardings, batch_specs, place_batch
from jaxpar.nn.plan import check_plan_covers, plan_state, to_shardings
from jaxpar.optim import accumulate, fusion
from jaxpar.optim import offload as host
from jaxpar.optim.zero import gather_params, opt_state_specs, reduce_gradients, shard_optimizer, zero_plan
from jaxpar.remat import checkpoint_policy
from jaxpar.train.step import (build_eval, build_train_step, make_hybrid_grads, make_hybrid_loss, make_loss,
                               value_and_grads)

_is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


def _check_supported(config: ParallelConfig) -> None:
    if config.pipeline.stages > 1 and config.mode == "hybrid":
        raise ValueError(
            "ParallelConfig: pipeline.stages > 1 with mode='hybrid' is not supported (the pipeline is "
            "itself a shard_map over the pipe axis); use mode='semi_auto' or 'data' with the pipeline"
        )


class Trainer:
    """Compiles and runs training of an NNX ``model`` with an optax ``tx``.

    ``loss_fn(model, batch)`` returns a scalar loss or ``(loss, aux)``. Batches are pytrees of
    arrays whose leading dimension is the global batch.

    >>> trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    >>> metrics = trainer.step(batch)          # {"loss": ..., "grad_norm": ...}
    >>> history = trainer.fit(batches, steps=100)

    ``offload``: ``"opt_state"`` and/or ``"params"`` to keep them in host memory
    (``pinned_host``) between steps (see ``jaxpar.optim.offload``).
    ``example_batch``: in mode ``"auto"``, plan at construction from this batch (otherwise the
    search runs on the first batch given to ``step`` / ``lower`` / ``place``).
    ``checkpoint_dir`` / ``save_every`` / ``keep``: save asynchronously every ``save_every``
    steps, keep the newest ``keep``, and resume from the newest complete one at construction.
    ``pipeline.stages > 1`` needs ``loss_fn`` as a ``jaxpar.pipeline.PipelineLoss``.
    The Trainer owns the model's arrays from then on (they are donated to the step): read the
    trained model as ``trainer.model``.

    Attributes: ``params`` / ``param_shardings`` (as stored: sharded at ZeRO level 3),
    ``compute_specs`` (the parameter plan, where parameters are used), ``opt_state`` /
    ``opt_shardings``, ``rest`` / ``rest_shardings``, ``zero`` (the ``ZeroPlan``),
    ``step_count``, ``config``, ``mesh``.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable,
                 config: ParallelConfig, mesh, *, global_batch: bool | None = None, donate: bool = True,
                 offload: str | tuple[str, ...] = (), example_batch: Any = None,
                 checkpoint_dir: str | None = None, save_every: int = 0, keep: int | None = 3):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"Trainer: model must be a flax.nnx.Module, got {type(model).__name__}")
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"Trainer: tx must be an optax.GradientTransformation, got {type(tx).__name__}")
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
        _check_supported(config)
        self.config, self.mesh, self.tx, self.loss_fn = config, mesh, tx, loss_fn
        self.global_batch = jax.process_count() == 1 if global_batch is None else global_batch
        self._donate = donate
        self.offload = host.check_targets(offload)
        if self.offload and not host.host_memory_available(mesh):
            raise ValueError(f"Trainer: offload={self.offload} needs a '{host.HOST}' memory space, which "
                             f"{mesh.devices.flat[0].platform} devices here do not have; drop offload")
        self.plan = None              # the strategy search's Plan, in mode "auto"
        self.data_state: dict = {}    # user data position, saved with checkpoints
        self.step_count = 0
        self._compiled: dict[Any, Any] = {}
        self._pending = model         # set up now, or (mode "auto" without example_batch) at the first batch
        self.checkpointer = None
        if checkpoint_dir is not None:
            from jaxpar.checkpoint import Checkpointer   # checkpoints come after training in the data flow

            self.checkpointer = Checkpointer(checkpoint_dir, save_every=save_every, keep=keep)
        if config.mode != "auto" or example_batch is not None:
            self._setup(example_batch)

    # ------------------------------------------------------------------ planning
    def _setup(self, batch) -> None:
        """Plan and place everything: the auto search (if any), pipeline, ZeRO, optimizer state."""
        model, self._pending = self._pending, None
        config, mesh, tx = self.config, self.mesh, self.tx
        if config.mode == "auto":
            from jaxpar.auto import search

            self.plan = search(model, self.loss_fn, batch, config, mesh)
            config = self.config = self.plan.to_config(config)
        if config.pipeline.stages > 1:
            from jaxpar.pipeline.model import pipelined

            self.loss_fn = pipelined(self.loss_fn, config, mesh)
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.compute_specs = plan_state(config, mesh, params, check_unused=False)
        self.rest_specs = plan_state(config, mesh, rest, check_unused=False)
        check_plan_covers(config, params, rest)
        self.zero = zero_plan(config.optimizer, mesh, self.compute_specs, params)
        self.param_specs = self.zero.params
        self._device_param_shardings = to_shardings(self.param_specs, mesh)
        self.param_shardings = self._placed(self._device_param_shardings, "params")
        self.rest_shardings = to_shardings(self.rest_specs, mesh)
        self.params = jax.device_put(params, self.param_shardings)
        self.rest = jax.device_put(rest, self.rest_shardings)
        self._tx = shard_optimizer(tx, mesh, self.zero, params) if config.optimizer.level else tx
        self.opt_specs = opt_state_specs(tx, self.zero.state, params)
        self._device_opt_shardings = to_shardings(self.opt_specs, mesh)
        self.opt_shardings = self._placed(self._device_opt_shardings, "opt_state")
        init = lambda p: self._tx.init(host.to_device(p, self.param_shardings))  # noqa: E731
        self.opt_state = jax.jit(init, out_shardings=self.opt_shardings)(self.params)
        if self.checkpointer is not None:
            self.checkpointer.resume(self)                # the newest complete step, if any

    def _placed(self, shardings, target: str):
        return host.on_host(shardings) if target in self.offload else shardings

    def _enter(self, params, opt_state):
        """Inside the step: host-offloaded parameters / optimizer state into device memory."""
        if "params" in self.offload:
            params = host.to_device(params, self.param_shardings)
        if "opt_state" in self.offload and opt_state is not None:
            opt_state = host.to_device(opt_state, self.opt_shardings)
        return params, opt_state

    def _part_view(self, batch, parts: int):
        """Shapes of one of ``parts`` equal parts of ``batch``, and a constraint for the split tree."""
        def view(x):
            if x.shape[0] % parts:
                raise ValueError(
                    f"batch leaf of shape {tuple(x.shape)}: grad_accum × interleave = {parts} parts do not "
                    f"divide the batch dimension {x.shape[0]}; use a batch that is a multiple of {parts}")
            return jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype)

        part = jax.tree.map(view, batch)

        specs = batch_specs(self.config, self.mesh, part)

        def constrain(split):
            return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(
                x, NamedSharding(self.mesh, PartitionSpec(None, *s))), split, specs, is_leaf=_is_spec)

        return part, constrain

    def _gather(self, compute_loss):
        """ZeRO-3: parameters stored sharded are gathered to their compute layout where used."""
        if self.config.optimizer.level < 3:
            return compute_loss
        shardings = to_shardings(self.compute_specs, self.mesh)

        def gathered(params, rest, batch):
            params = jax.tree.map(jax.lax.with_sharding_constraint, params, shardings)
            return compute_loss(params, rest, batch)

        return gathered

    def _train_fn(self, batch):
        """The step function for ``batch`` (global shapes); the order is the module docstring's."""
        return build_train_step(self._grads_fn(batch), self._tx, enter=self._enter)

    def _grads_fn(self, batch):
        """Steps 1–6 of the module docstring: ``(params, rest, batch) -> (loss, aux, rest, grads)``."""
        cfg = self.config
        k, n = cfg.grad_accum, cfg.interleave
        micro, micro_constrain = self._part_view(batch, k)
        part, part_constrain = self._part_view(batch, k * n)
        remat = (lambda f: f) if cfg.remat == "none" else (
            lambda f: jax.checkpoint(f, policy=checkpoint_policy(cfg.remat)))
        if cfg.mode == "hybrid" and (cfg.comm_fusion is not None or cfg.optimizer.level > 0):
            grads = self._hybrid_grads(micro, lambda f: accumulate.interleave_loss(remat(f), n))
        else:
            loss = remat(self._gather(self._loss_for(part)))
            grads = value_and_grads(accumulate.interleave_loss(loss, n, constrain_parts=part_constrain))
        constrain_grads = lambda g: jax.tree.map(  # noqa: E731
            jax.lax.with_sharding_constraint, g, to_shardings(self.zero.grads, self.mesh))
        return accumulate.accumulate_grads(grads, k, constrain_grads=constrain_grads,
                                           constrain_parts=micro_constrain)

    def _hybrid_grads(self, micro, wrap_local):
        """Hybrid mode: per-device gradients reduced by jaxpar (bucketed and/or to ZeRO shards)."""
        cfg, axes, zero = self.config, batch_axes(self.config, self.mesh), self.zero
        if set(zero.axes) - set(axes):
            raise ValueError(f"optimizer.axis {zero.axes} must be batch axes {axes} in mode='hybrid'")
        specs = batch_specs(cfg, self.mesh, micro)
        bucket = fusion.bucket_bytes(cfg.comm_fusion) if cfg.comm_fusion is not None else None
        rest = (lambda leaves, on: fusion.bucketed_psum(leaves, on, bucket)) if bucket else None
        target = zero.state if cfg.optimizer.level else zero.compute
        reduce = lambda g: reduce_gradients(g, zero.params, target, axes, rest)  # noqa: E731
        gather = lambda p: gather_params(p, zero.params, zero.compute)  # noqa: E731
        return make_hybrid_grads(self.graphdef, self.loss_fn, self.mesh, (zero.params, self.rest_specs, specs),
                                 axes, reduce, target, wrap_local=wrap_local, gather=gather)

    def _loss_for(self, batch):
        if self.config.mode == "hybrid":
            specs = (self.compute_specs, self.rest_specs, batch_specs(self.config, self.mesh, batch))
            return make_hybrid_loss(self.graphdef, self.loss_fn, self.mesh, specs,
                                    batch_axes(self.config, self.mesh))
        return make_loss(self.graphdef, self.loss_fn)

    def _key(self, batch, kind: str):
        return kind, jax.tree.structure(batch), tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(batch))

    def _jitted(self, batch, kind: str = "train"):
        key = self._key(batch, kind)
        if key not in self._compiled:
            b_sh = batch_shardings(self.config, self.mesh, batch)
            if kind == "train":
                fn = jax.jit(
                    self._train_fn(batch),
                    in_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, b_sh),
                    out_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, None),
                    donate_argnums=(0, 1, 2) if self._donate else (),
                    compiler_options=fusion.compiler_options(self.config.comm_fusion,
                                                             self.mesh.devices.flat[0].platform) or None,
                )
            else:
                compute = self._gather(self._loss_for(batch))
                fn = jax.jit(lambda p, r, b: build_eval(compute)(host.to_device(p, self.param_shardings), r, b),
                             in_shardings=(self.param_shardings, self.rest_shardings, b_sh))
            self._compiled[key] = fn
        return self._compiled[key]

    # ------------------------------------------------------------------ running
    def place(self, batch):
        """Put a host batch on the mesh by ``dataset_strategy``."""
        if self._pending is not None:
            self._setup(batch)
        return place_batch(self.config, self.mesh, batch, global_batch=self.global_batch)

    def _global_view(self, batch):
        """Shapes of the global batch (for compile keys and shardings)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)

    def step(self, batch) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics (``"loss"``, ``"grad_norm"``, ...)."""
        placed = self.place(batch)
        fn = self._jitted(self._global_view(placed))
        self.params, self.rest, self.opt_state, metrics = fn(self.params, self.rest, self.opt_state, placed)
        self.step_count += 1
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(self)
        return metrics

    def save(self, directory: str | None = None, *, data_state: dict | None = None) -> int:
        """Save the whole state to ``directory`` (blocking), or without one asynchronously to
        ``checkpoint_dir``. Returns the step saved."""
        from jaxpar import checkpoint

        self._require_setup("save")
        if directory is not None:
            return checkpoint.save(self, directory, data_state=data_state)
        if self.checkpointer is None:
            raise ValueError("Trainer.save: give a directory or construct the Trainer with checkpoint_dir=")
        return self.checkpointer.save(self, data_state=data_state)

    def restore(self, directory: str | None = None, *, step: int | None = None) -> dict:
        """Restore a checkpoint saved under any layout into this trainer's layout."""
        from jaxpar import checkpoint

        self._require_setup("restore")
        if directory is not None:
            return checkpoint.restore(self, directory, step=step)
        if self.checkpointer is None:
            raise ValueError("Trainer.restore: give a directory or construct the Trainer with checkpoint_dir=")
        return self.checkpointer.restore(self, step)

    def _require_setup(self, what: str) -> None:
        if self._pending is not None:
            raise ValueError(f"Trainer.{what}: mode='auto' plans at the first batch; call step() first or "
                             "pass example_batch= to the Trainer")

    def lower(self, batch) -> jax.stages.Lowered:
        """The lowered step for ``batch`` (``.compile()`` gives the program for reports)."""
        placed = self.place(batch)
        return self._jitted(self._global_view(placed)).lower(self.params, self.rest, self.opt_state, placed)

    def lower_grads(self, batch) -> jax.stages.Lowered:
        """The step up to the update for ``batch``: its outputs are the gradients as the update
        receives them (ZeRO gradient specs), e.g. to measure their bytes per device."""
        placed = self.place(batch)
        grads_fn = self._grads_fn(self._global_view(placed))
        grad_shardings = to_shardings(self.zero.grads, self.mesh)
        fn = jax.jit(lambda p, r, b: grads_fn(self._enter(p, None)[0], r, b)[3],
                     in_shardings=(self.param_shardings, self.rest_shardings,
                                   batch_shardings(self.config, self.mesh, placed)),
                     out_shardings=grad_shardings)
        return fn.lower(self.params, self.rest, placed)

    def evaluate(self, batches: Iterable, steps: int | None = None) -> float:
        """Mean loss over ``batches`` (the first ``steps`` of them), without updating."""
        total, n = 0.0, 0
        for i, batch in enumerate(batches):
            if steps is not None and i >= steps:
                break
            placed = self.place(batch)
            total += float(self._jitted(self._global_view(placed), "eval")(self.params, self.rest, placed))
            n += 1
        if n == 0:
            raise ValueError("Trainer.evaluate got no batches")
        return total / n

    def fit(self, batches: Iterable, steps: int, *, log_every: int = 10, progress: bool = True,
            callback: Callable[[int, dict], None] | None = None) -> list[dict[str, float]]:
        """Run ``steps`` steps with a progress bar; returns one metrics dict per step."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        history: list[dict[str, float]] = []
        it = iter(batches)
        columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        with Progress(*columns, disable=not progress or jax.process_index() != 0) as bar:
            task = bar.add_task("train", total=steps, info="")
            for i in range(steps):
                t0 = time.perf_counter()
                metrics = self.step(next(it))
                record = {"step": self.step_count, "loss": float(metrics["loss"]),
                          "grad_norm": float(metrics["grad_norm"]), "time_s": time.perf_counter() - t0}
                history.append(record)
                if callback is not None:
                    callback(i, record)
                if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
                    bar.update(task, info=f"loss {record['loss']:.4f}")
                bar.update(task, advance=1)
        return history

    @property
    def model(self) -> nnx.Module:
        """The model with the current parameters (sharded as planned)."""
        self._require_setup("model")
        return nnx.merge(self.graphdef, self.params, self.rest)

    @property
    def shardings(self) -> dict[str, Any]:
        return {"params": self.param_shardings, "rest": self.rest_shardings, "opt_state": self.opt_shardings}
