"""Per-device memory of a training job from its `TrainPlan` alone: nothing is built or compiled.

Bytes of each array on one device are its shard's bytes under the plan's spec (a dimension
split ``k`` ways holds ``ceil(size / k)`` entries):

- parameters: ``plan.shapes`` under ``plan.stored`` (sharded over the ZeRO axes at level 3);
- gradients: the same shapes under ``plan.grads`` (sharded from level 2);
- optimizer state: ``jax.eval_shape(tx.init, params)`` (so any optax optimizer's real state
  structure: Adam's ``mu`` and ``nu``, step counts, ...) under ``plan.opt_state``;
- activations: a model-specific estimate passed in (e.g. `jaxpar.models.llama_report.llama_activation_bytes`).

Dtypes are arguments so that a precision setting can be applied: ``param_dtype`` (default:
each parameter's own dtype), ``grad_dtype`` (default: the parameter dtype) and
``opt_state_dtype`` (default: each state leaf's own dtype, which optax takes from the
parameters; integer leaves such as step counts always keep theirs).

    >>> est = estimate_memory(plan, optax.adamw(1e-3))           # doctest: +SKIP
    >>> est.params, est.grads, est.opt_state                     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxpar.deprecation import OFFLOAD, RemovedAttribute, removed_keywords
from jaxpar.nn.specs import itemsize
from jaxpar.plan.train_plan import TrainPlan, flat_paths
from jaxpar.strategy import spec_axes

PARTS = ("params", "grads", "opt_state", "activations")


@removed_keywords("MemoryEstimate", {"host": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Analytic bytes on one device, by what they hold.

    Attributes:
      params: parameters as stored between steps (``plan.stored``).
      grads: gradients as kept before the update (``plan.grads``).
      opt_state: every optimizer-state leaf (``plan.opt_state``).
      activations: saved forward values for the backward pass; ``None`` when not estimated.
      zero_level: the plan's optimizer-parallel level.
      dtypes: the dtypes used, ``{"params", "grads", "opt_state"}`` (``"own"`` = each array's).

    ``total`` sums the four device parts (activations counted as 0 when ``None``).
    """

    params: int
    grads: int
    opt_state: int
    activations: int | None
    zero_level: int
    dtypes: Mapping[str, str]
    host = RemovedAttribute(OFFLOAD)     # a field of 0.1.0 (bytes offloaded): host offload was removed

    @property
    def total(self) -> int:
        return self.params + self.grads + self.opt_state + (self.activations or 0)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly: the parts, the total, the level and dtypes."""
        return {**{p: getattr(self, p) for p in PARTS}, "total": self.total, "zero_level": self.zero_level,
                "dtypes": dict(self.dtypes)}


def shard_elements(shape: tuple[int, ...], spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    """Entries of one device's shard of an array of ``shape`` laid out as ``spec``.

    >>> shard_elements((10, 8), PartitionSpec("data", None), {"data": 4})     # ceil(10 / 4) * 8
    24
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return math.prod(-(-d // math.prod(sizes[a] for a in spec_axes(e))) for d, e in zip(shape, entries))


def _check_dtype(name: str, dtype) -> str | None:
    if dtype is None:
        return None
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"estimate_memory(): {name}={dtype!r} is not a dtype; pass e.g. 'bfloat16', "
                        f"'float32' or None (each array's own dtype)") from None


def _nested(shapes: Mapping[str, tuple[tuple[int, ...], str]], dtype: str | None) -> dict:
    # The plan's paths as nested dicts: tx.init then names its state leaves exactly as the plan did.
    tree: dict = {}
    for path, (shape, own) in shapes.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(shape), dtype or own)
    return tree


def _param_bytes(plan: TrainPlan, section: str, dtype: str | None) -> int:
    specs = getattr(plan, section)
    return sum(shard_elements(shape, specs[path], plan.mesh) * itemsize(dtype or own)
               for path, (shape, own) in plan.shapes.items())


def _opt_state_bytes(plan: TrainPlan, tx: optax.GradientTransformation, param_dtype, dtype) -> int:
    state = jax.eval_shape(tx.init, _nested(plan.shapes, param_dtype))
    total = 0
    for path, leaf in flat_paths(state):
        if path not in plan.opt_state:
            raise ValueError(f"estimate_memory(): the optimizer's state leaf {path!r} is not in the plan (it plans "
                             f"{list(plan.opt_state)[:3]} ...); pass the optimizer the plan was made with")
        own = np.dtype(leaf.dtype)
        use = dtype if dtype is not None and jnp.issubdtype(own, jnp.floating) else own
        total += shard_elements(tuple(leaf.shape), plan.opt_state[path], plan.mesh) * itemsize(use)
    return total


def estimate_memory(plan: TrainPlan, tx: optax.GradientTransformation, *, param_dtype=None, grad_dtype=None,
                    opt_state_dtype=None, activations: int | None = None) -> MemoryEstimate:
    """Per-device parameter, gradient, optimizer-state (and given activation) bytes of ``plan``.

    Args:
      plan: a `jaxpar.TrainPlan` (``make_train_plan`` accepts mesh sizes, so a plan for 64
        devices can be made on a laptop).
      tx: the optax optimizer the plan was made with.
      param_dtype: storage dtype of parameters (default: each one's own).
      grad_dtype: dtype of gradients (default: the parameter dtype).
      opt_state_dtype: dtype of floating optimizer-state leaves (default: their own).
      activations: bytes of saved activations per device, if estimated elsewhere.

    Raises:
      TypeError: ``plan`` is not a ``TrainPlan`` or a dtype is not one.
      ValueError: ``tx``'s state does not match the plan, or ``activations`` is negative.

    Example:
      >>> import optax
      >>> from flax import nnx
      >>> import jaxpar
      >>> model = nnx.eval_shape(lambda: nnx.Linear(1024, 1024, rngs=nnx.Rngs(0)))
      >>> plan = jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 8}, optimizer={"level": 1}),
      ...                               {"data": 8}, model, optax.adam(1e-3))
      >>> est = estimate_memory(plan, optax.adam(1e-3))
      >>> est.params, est.opt_state   # fp32 kernel + bias; mu, nu of the kernel / 8, of the bias whole, count
      (4198400, 1056772)
    """
    if not isinstance(plan, TrainPlan):
        raise TypeError(f"estimate_memory() takes a jaxpar.TrainPlan (make_train_plan(config, mesh, model, tx)), "
                        f"got {type(plan).__name__}")
    if activations is not None and (not isinstance(activations, (int, np.integer)) or activations < 0):
        raise ValueError(f"estimate_memory(): activations={activations!r} must be a byte count >= 0 or None")
    p_dtype = _check_dtype("param_dtype", param_dtype)
    g_dtype = _check_dtype("grad_dtype", grad_dtype) or p_dtype
    o_dtype = _check_dtype("opt_state_dtype", opt_state_dtype)
    parts = {"params": _param_bytes(plan, "stored", p_dtype), "grads": _param_bytes(plan, "grads", g_dtype),
             "opt_state": _opt_state_bytes(plan, tx, p_dtype, o_dtype)}
    return MemoryEstimate(**parts, activations=None if activations is None else int(activations),
                          zero_level=plan.zero_level,
                          dtypes={"params": p_dtype or "own", "grads": g_dtype or "own", "opt_state": o_dtype or "own"})
