"""The compiled training step of a config, for dry runs (the job search's, `jaxpar plan`'s)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import optax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.mesh import make_mesh
from jaxpar.nn import init
from jaxpar.report.stage_collectives import check_stage_collectives
from jaxpar.train.trainer import Trainer


def compile_step(model_fn: Callable[[], nnx.Module], loss_fn: Callable, batch, config: ParallelConfig,
                 tx: optax.GradientTransformation | None = None) -> jax.stages.Compiled:
    """The compiled training step of ``config`` on the first devices of ``jax.devices()``: the
    model built sharded (``jaxpar.init``), the Trainer's step lowered for ``batch`` and compiled.

    What the job search's dry run calls (``search_job(..., dry_run=compile_step)``). A pipelined
    step that the Trainer would refuse before running it (a collective a stage's op must not hold:
    `jaxpar.report.stage_collectives`) is refused here too, with a
    ``jaxpar.report.stage_collectives.StageCollectiveError`` naming the stage, the mesh axis and
    the model's line; the search rules such a candidate out.
    """
    if config.mode == "auto":
        raise ValueError("compile_step: config has mode='auto', whose strategies are searched before a step "
                         "exists; compile the searched config: plan, _ = jaxpar.auto.plan_for(model, tx, loss_fn, "
                         "config, mesh, example_batch=batch), then compile_step(..., plan.config)")
    n = math.prod(config.mesh.values())
    mesh = make_mesh(config, devices=jax.devices()[:n])
    trainer = Trainer(init(model_fn, config, mesh), tx or optax.adamw(1e-3), loss_fn, config, mesh)
    compiled = trainer.lower(batch).compile()
    if trainer.plan.pipeline.stages > 1:
        check_stage_collectives(compiled, mesh, config.pipeline.axis)
    return compiled
