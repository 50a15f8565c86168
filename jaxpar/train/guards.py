"""What the Trainer checks before it builds anything, and how it notices a preemption.

Combinations refused up front (each naming both features and the alternative), the
arguments and batches it is given, and SIGTERM handling (a flag in one process, JAX's
preemption sync point across several).
"""

from __future__ import annotations

import signal
import sys
import threading

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.metrics import MetricsConfig, MetricsLogger, ProfileWindow, check_profile_steps
from jaxpar.nn.moe import MoE
from jaxpar.ops import ContextParallel
from jaxpar.pipeline import PipelineLoss, StagedLoss
from jaxpar.plan import TrainPlan


class Preempted(SystemExit):
    """Raised by ``Trainer.step`` after a SIGTERM: the state of ``step`` is saved; exit code 0."""

    def __init__(self, step: int, directory: str):
        super().__init__(0)
        self.step, self.directory = step, directory
        print(f"jaxpar: preempted (SIGTERM): saved step {step} to {directory}; restart to resume", file=sys.stderr)


class Preemption:
    """Where a SIGTERM is noticed: a flag set by a signal handler (one process), or JAX's
    preemption sync point, which makes every process stop at the same step (several)."""

    def __init__(self):
        self.flag = threading.Event()
        self.multi = jax.process_count() > 1
        if not self.multi and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, lambda *_: self.flag.set())

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.flag.is_set()


def check_supported(config: ParallelConfig) -> None:
    """Combinations refused when the Trainer is built, each naming both features and the alternative."""
    if config.pipeline.stages > 1 and config.mode == "hybrid":
        raise ValueError(
            "ParallelConfig: pipeline.stages > 1 with mode='hybrid' is not supported (the pipeline is "
            "itself a shard_map over the pipe axis); use mode='semi_auto' or 'data' with the pipeline")
    if config.pipeline.stages > 1 and config.mode == "auto":
        raise ValueError(
            "ParallelConfig: pipeline.stages > 1 with mode='auto' is not supported (the strategy search does "
            "not place pipeline stages); plan the pipeline with jaxpar.auto.plan_job(pipeline_stages=...) and "
            "train its config, or use mode='semi_auto' with rules {'layers': 'pipe'}")


def check_platform(config: ParallelConfig, platform: str) -> None:
    """Combinations one backend cannot compile, refused before it aborts the process."""
    half = config.precision is not None and config.precision.compute != "float32"
    if half and config.pipeline.stages > 1 and platform == "cpu":
        raise ValueError(
            f"ParallelConfig: pipeline.stages={config.pipeline.stages} with precision compute="
            f"{config.precision.compute!r} is not supported on CPU (XLA:CPU aborts while widening the "
            "pipeline's half-precision collectives to fp32); on CPU use precision='fp32' or None with the "
            "pipeline, or precision without the pipeline")


def check_args(model, tx, loss_fn, config, mesh, plan) -> None:
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
    check_supported(config)
    check_platform(config, mesh.devices.flat[0].platform)
    if config.pipeline.stages > 1 and not isinstance(loss_fn, (PipelineLoss, StagedLoss)):
        raise TypeError(
            f"Trainer: pipeline.stages={config.pipeline.stages} needs loss_fn as a jaxpar.pipeline.PipelineLoss "
            f"(embed / blocks / head / head_loss) or StagedLoss (modules by path), got {type(loss_fn).__name__}; "
            "see docs/pipeline.md")
    check_context(model, config, loss_fn)
    check_experts(model, config, loss_fn)
    if plan is not None:
        if not isinstance(plan, TrainPlan):
            raise TypeError(f"Trainer: plan must be a jaxpar.TrainPlan, got {type(plan).__name__}")
        if dict(plan.mesh) != {a: int(s) for a, s in mesh.shape.items()}:
            raise ValueError(f"Trainer: plan is for mesh {dict(plan.mesh)} but the mesh is {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(plan.config)")


def check_context(model, config, loss_fn=None) -> None:
    """A context axis needs attention that masks by position (batches are reordered and split),
    and refuses the techniques it does not compose with, naming both."""
    if config.context is None:
        return
    if config.pipeline.stages > 1 and not (isinstance(loss_fn, PipelineLoss) and loss_fn.block_call is not None):
        raise ValueError(f"Trainer: context={config.context} with pipeline.stages={config.pipeline.stages} needs a "
                         f"PipelineLoss with block_call= (got {type(loss_fn).__name__}): without it the stages pass "
                         "only the hidden state, not the positions context attention masks by; use the GPT / Llama "
                         "pipeline_loss(), give block_call=lambda model: lambda block, h, batch: ..., or drop one")
    if config.mode in ("hybrid", "auto"):
        why = ("per-device code sees one shard of the sequence and no context attention" if config.mode == "hybrid"
               else "the strategy search does not place the sequence over a context axis")
        raise ValueError(f"Trainer: context={config.context} with mode={config.mode!r} is not supported ({why}); "
                         "use mode='semi_auto' with the context axis (jaxpar.auto.plan_job(context=(1, 2, 4, 8)) "
                         "plans one and returns such a config), or drop context")
    if not isinstance(getattr(model, "constrain", None), ContextParallel):
        raise ValueError(
            f"Trainer: ParallelConfig.context={config.context} reorders and splits the sequence, but the model's "
            "constrain is not a jaxpar.ops.ContextParallel, so its attention would mask by index; build the model "
            "with constrain=jaxpar.ops.ContextParallel(jaxpar.LogicalConstraint(mesh, config.rules), mesh, config)")


def check_experts(model, config, loss_fn=None) -> None:
    """A ``PipelineLoss`` carries an MoE layer's auxiliary loss (``aux_loss``) out of each stage;
    a ``StagedLoss`` hands on only the hidden state, so the loss recorded on the layer during
    the forward would never reach the last stage's loss."""
    staged = config.pipeline.stages > 1 and not (isinstance(loss_fn, PipelineLoss) and loss_fn.aux_loss is not None)
    if not staged and config.mode not in ("hybrid", "auto") and config.pipeline.stages == 1:
        return
    where = next(("/".join(str(p) for p in path) for path, node in nnx.iter_graph(model) if isinstance(node, MoE)),
                 None)
    if where is None:
        return
    if (not staged and config.pipeline.stages > 1 and loss_fn.block_call is None
            and "expert" in dict(config.rules or {})):
        raise ValueError(f"Trainer: pipeline.stages={config.pipeline.stages} with a mixture-of-experts model "
                         f"(jaxpar.nn.MoE at {where!r}) and rules['expert']={dict(config.rules)['expert']!r} needs a "
                         "PipelineLoss with block_call= (the GPT / Llama pipeline_loss() set it): without it the "
                         "stages run block(h), whose experts do not see the model's constraint and would all run "
                         "where the tokens are, with no expert parallelism")
    if staged:
        raise ValueError(f"Trainer: pipeline.stages={config.pipeline.stages} with a mixture-of-experts model "
                         f"(jaxpar.nn.MoE at {where!r}) needs a PipelineLoss with aux_loss= (e.g. the GPT / Llama "
                         f"pipeline_loss(), or aux_loss=jaxpar.nn.moe_aux_loss), got {type(loss_fn).__name__}: the "
                         "experts' auxiliary losses would not reach the last stage's loss")
    if config.mode not in ("hybrid", "auto"):
        return
    why = ("per-device code would run every expert on every device, with no expert parallelism"
           if config.mode == "hybrid" else "the strategy search does not read the expert dispatch's scatters")
    raise ValueError(f"Trainer: mode={config.mode!r} with a mixture-of-experts model (jaxpar.nn.MoE at {where!r}) is "
                     f"not supported ({why}); use mode='semi_auto' with an 'expert' rule, e.g. "
                     "rules={'batch': 'data', 'expert': 'data'} (jaxpar.auto.plan_job prices expert parallel "
                     "and returns such a config)")


def check_batch(batch) -> None:
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
        if rows is None:
            rows, first = shape[0], where
        elif shape[0] != rows:
            raise ValueError(f"{where} has {shape[0]} rows but {first} has {rows}; every batch leaf must have "
                             "the same leading (batch) dimension")


def keeps_position(batches) -> bool:
    """Whether ``batches`` is a loader with ``state()`` / ``restore(state)`` (e.g. `jaxpar.data.TokenLoader`)."""
    return callable(getattr(batches, "state", None)) and callable(getattr(batches, "restore", None))


def watchers(metrics, profile_steps) -> tuple[MetricsLogger | None, ProfileWindow | None]:
    """The metric writers and the profile window a Trainer was asked for."""
    if metrics is not None and not isinstance(metrics, MetricsConfig):
        raise TypeError(f"Trainer: metrics must be a jaxpar.metrics.MetricsConfig, got {type(metrics).__name__}; "
                        "e.g. metrics=MetricsConfig(dir='runs/exp1')")
    window = check_profile_steps(profile_steps)
    if window is not None and metrics is None:
        raise ValueError(f"Trainer: profile_steps={window} writes its trace under the run directory; pass "
                         "metrics=MetricsConfig(dir=...) as well")
    if metrics is None:
        return None, None
    return MetricsLogger(metrics), ProfileWindow(metrics.profile_dir, window) if window else None
