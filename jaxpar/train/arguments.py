"""The Trainer's arguments checked before anything is opened: their types, the mesh against the
config and the plan, and the combinations `jaxpar.plan.check_combination` refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.plan import TrainPlan, check_combination
from jaxpar.train.services import Placement, Services

NO_PLAN = ("Trainer: mode='auto' searches the strategies on a batch before training, and no plan was given: pass "
           "example_batch=<one global batch> to jaxpar.auto.plan_for(model, tx, loss_fn, config, mesh, "
           "example_batch=batch) (or searched=jaxpar.auto.Strategy.from_json(path)) and give its result as plan=; "
           "the Trainer never searches (docs/parallel_modes.md)")


def transformation(tx):
    """``tx`` as an ``optax.GradientTransformation``: an ``optax.MultiSteps`` (which is not one
    itself) becomes its ``gradient_transformation()``; anything else is returned as it is."""
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def plan_and_record(plan) -> tuple[TrainPlan | None, Any]:
    """``(plan, search record)`` from ``plan=``: a `TrainPlan`, or the pair `jaxpar.auto.plan_for`
    returns (its plan and its `jaxpar.auto.Strategy`, or None)."""
    if isinstance(plan, tuple):
        if len(plan) != 2 or not isinstance(plan[0], TrainPlan):
            raise TypeError(f"Trainer: plan= as a pair must be (TrainPlan, search record), what jaxpar.auto.plan_for "
                            f"returns; got a tuple of {[type(p).__name__ for p in plan]}")
        return plan
    return plan, None


def check_args(model, tx, loss_fn, config, mesh, plan, services, placement) -> None:
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
    if not isinstance(services, Services):
        raise TypeError(f"Trainer: services must be a jaxpar.Services, got {type(services).__name__}; e.g. "
                        "services=jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir='ckpt'))")
    if not isinstance(placement, Placement):
        raise TypeError(f"Trainer: placement must be a jaxpar.Placement, got {type(placement).__name__}; e.g. "
                        "placement=jaxpar.Placement(donate=False)")
    for axis, size in config.mesh.items():
        if axis not in mesh.shape or (size != -1 and mesh.shape[axis] != size):
            raise ValueError(f"Trainer: config.mesh {config.mesh} does not match the mesh {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(config)")
    check_combination(config, model, loss_fn, mesh=mesh, platform=mesh.devices.flat[0].platform, who="Trainer")
    if plan is not None:
        if not isinstance(plan, TrainPlan):
            raise TypeError(f"Trainer: plan must be a jaxpar.TrainPlan (or what jaxpar.auto.plan_for returns), got "
                            f"{type(plan).__name__}")
        if dict(plan.mesh) != {a: int(s) for a, s in mesh.shape.items()}:
            raise ValueError(f"Trainer: plan is for mesh {dict(plan.mesh)} but the mesh is {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(plan.config)")
        # a searched plan realises mode "auto" as a semi_auto config; any other plan is its config's
        if config.mode != "auto" and plan.config != config:
            differ = {f.name: (getattr(config, f.name), getattr(plan.config, f.name)) for f in dataclasses.fields(config)
                      if getattr(config, f.name) != getattr(plan.config, f.name)}
            raise ValueError("Trainer: plan was made for another config than config= (field: (config, plan's): "
                             f"{differ}); pass config=plan.config, or make the plan from this config "
                             "(jaxpar.make_train_plan)")


def check_restored(initial: list, leaves: list, checkpoint) -> None:
    """Refuses a Trainer whose model was built with ``jaxpar.init(..., values="restored")`` when
    a leaf of its state is still one it started with (``initial``): nothing restored it, and
    placeholders must never train. ``checkpoint``: the Trainer's checkpoint hook, or None."""
    if not any(x is y for x, y in zip(leaves, initial)):
        return
    where = (f"services.checkpoint.dir={getattr(getattr(checkpoint, 'config', None), 'dir', None)!r} holds no step "
             "to resume" if checkpoint is not None else "services has no checkpoint to resume")
    raise ValueError(f"Trainer: the model was built with jaxpar.init(..., values='restored'), whose variables are "
                     f"zeros for a checkpoint to overwrite, but {where}; build it with values='computed' (the default) "
                     "when there is no step to resume")
