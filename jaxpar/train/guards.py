"""What the Trainer checks of its arguments and batches, and how it notices a preemption.

Refused combinations of features are decided once, for every entry point: by
``ParallelConfig`` (the config alone) and `jaxpar.plan.check_combination` (model, loss,
backend), which `check_args` calls. SIGTERM handling: a flag in one process, JAX's
preemption sync point across several.
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
from jaxpar.plan import TrainPlan, check_combination


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
    check_combination(config, model, loss_fn, platform=mesh.devices.flat[0].platform, who="Trainer")
    if plan is not None:
        if not isinstance(plan, TrainPlan):
            raise TypeError(f"Trainer: plan must be a jaxpar.TrainPlan, got {type(plan).__name__}")
        if dict(plan.mesh) != {a: int(s) for a, s in mesh.shape.items()}:
            raise ValueError(f"Trainer: plan is for mesh {dict(plan.mesh)} but the mesh is {dict(mesh.shape)}; "
                             "build the mesh with jaxpar.make_mesh(plan.config)")


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
