"""``Trainer``: compiles one training step for a config and mesh, and runs the loop."""

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
from jaxpar.data import batch_axes, batch_shardings, leaf_spec, place_batch
from jaxpar.nn.plan import check_plan_covers, plan_state, to_shardings
from jaxpar.train.step import build_eval, build_step, make_hybrid_loss, make_loss

_is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


def _check_supported(config: ParallelConfig) -> None:
    if config.mode == "auto":
        raise NotImplementedError(
            "ParallelConfig(mode='auto') is not available yet: strategy search has not landed. "
            "Use mode='semi_auto' with rules / parameter_plan, or mode='data'."
        )
    for field, active in (("optimizer.level", config.optimizer.level > 0), ("grad_accum", config.grad_accum > 1),
                          ("pipeline.stages", config.pipeline.stages > 1)):
        if active:
            raise NotImplementedError(
                f"ParallelConfig.{field} is set, but this jaxpar build does not implement it yet; "
                "leave it at its default"
            )


class Trainer:
    """Compiles and runs training of an NNX ``model`` with an optax ``tx``.

    ``loss_fn(model, batch)`` returns a scalar loss or ``(loss, aux)``. Batches are pytrees of
    arrays whose leading dimension is the global batch.

    >>> trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    >>> metrics = trainer.step(batch)          # {"loss": ..., "grad_norm": ...}
    >>> history = trainer.fit(batches, steps=100)
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable,
                 config: ParallelConfig, mesh, *, global_batch: bool | None = None, donate: bool = True):
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
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.param_specs = plan_state(config, mesh, params, check_unused=False)
        self.rest_specs = plan_state(config, mesh, rest, check_unused=False)
        check_plan_covers(config, params, rest)
        self.param_shardings = to_shardings(self.param_specs, mesh)
        self.rest_shardings = to_shardings(self.rest_specs, mesh)
        self.params = jax.device_put(params, self.param_shardings)
        self.rest = jax.device_put(rest, self.rest_shardings)
        self.opt_specs = self._opt_state_specs()
        self.opt_shardings = to_shardings(self.opt_specs, mesh)
        self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(self.params)
        self.step_count = 0
        self._compiled: dict[Any, Any] = {}

    # ------------------------------------------------------------------ planning
    def _opt_state_specs(self):
        abstract = jax.eval_shape(self.tx.init, self.params)
        return optax.tree_map_params(
            self.tx, lambda _, spec: spec, abstract, self.param_specs,
            transform_non_params=lambda _: PartitionSpec(), is_leaf=_is_spec,
        )

    def _loss_for(self, batch):
        if self.config.mode == "hybrid":
            batch_specs = jax.tree.map(lambda x: leaf_spec(self.config, self.mesh, tuple(x.shape)), batch)
            specs = (self.param_specs, self.rest_specs, batch_specs)
            return make_hybrid_loss(self.graphdef, self.loss_fn, self.mesh, specs,
                                    batch_axes(self.config, self.mesh))
        return make_loss(self.graphdef, self.loss_fn)

    def _key(self, batch, kind: str):
        return kind, jax.tree.structure(batch), tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(batch))

    def _jitted(self, batch, kind: str = "train"):
        key = self._key(batch, kind)
        if key not in self._compiled:
            b_sh = batch_shardings(self.config, self.mesh, batch)
            compute = self._loss_for(batch)
            if kind == "train":
                fn = jax.jit(
                    build_step(compute, self.tx),
                    in_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, b_sh),
                    out_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, None),
                    donate_argnums=(0, 1, 2) if self._donate else (),
                )
            else:
                fn = jax.jit(build_eval(compute), in_shardings=(self.param_shardings, self.rest_shardings, b_sh))
            self._compiled[key] = fn
        return self._compiled[key]

    # ------------------------------------------------------------------ running
    def place(self, batch):
        """Put a host batch on the mesh by ``dataset_strategy``."""
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
        return metrics

    def lower(self, batch) -> jax.stages.Lowered:
        """The lowered step for ``batch`` (``.compile()`` gives the program for reports)."""
        placed = self.place(batch)
        return self._jitted(self._global_view(placed)).lower(self.params, self.rest, self.opt_state, placed)

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
        return nnx.merge(self.graphdef, self.params, self.rest)

    @property
    def shardings(self) -> dict[str, Any]:
        return {"params": self.param_shardings, "rest": self.rest_shardings, "opt_state": self.opt_shardings}
