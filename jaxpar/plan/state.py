"""``TrainState``: what the compiled step takes and returns, and what checkpoints save.

A pytree of the parameters (as stored), the other NNX state (RNG streams, statistics), the
optimizer state and the step counter (a device scalar, advanced inside the step, so the loop
never waits on it), plus ``data``: the position of the data loader, a JSON-able dict kept on
the host (pytree metadata, never traced).

    >>> state = init_state(plan, mesh, model, tx)                     # doctest: +SKIP
    >>> state = state.replace(data={"epoch": 0, "index": 128})        # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.distributed import place
from jaxpar.optim.zero import shard_optimizer
from jaxpar.precision import cast_floats, with_precision


def check_data(data: Any, what: str = "data_state") -> dict[str, Any]:
    """``data`` as a JSON-able dict (numpy scalars become Python numbers), or a ``TypeError``
    naming the key whose value JSON cannot hold."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a dict of JSON-able values (the data position), got {type(data).__name__}")

    def plain(path: str, v: Any) -> Any:
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, Mapping):
            return {str(k): plain(f"{path}[{k!r}]", x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(f"{path}[{i}]", x) for i, x in enumerate(v)]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"{what}{path} = {v!r} ({type(v).__name__}) is not JSON-able; store plain numbers, "
                        "strings, lists and dicts (e.g. int(x) for a numpy or jax scalar)")

    return {str(k): plain(f"[{k!r}]", v) for k, v in data.items()}


class _Data:
    """Hashable host-side holder of the data position (pytree metadata)."""

    __slots__ = ("value", "_key")

    def __init__(self, value: Mapping[str, Any]):
        self.value = check_data(value)
        self._key = json.dumps(self.value, sort_keys=True)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Data) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


_NO_DATA = _Data({})


@jax.tree_util.register_pytree_with_keys_class
class TrainState:
    """Parameters (as stored), non-parameter state, optimizer state, step; and the data position.

    Attributes:
      params: the ``nnx.Param`` state, laid out as the plan stores it (ZeRO-3: sharded).
      rest: every other NNX variable (RNG keys and counts, batch statistics, ...).
      opt_state: the optax state, laid out as the plan's ``opt_state`` section.
      step: int32 scalar, the number of optimizer updates applied.
      data: the data loader's position, a JSON-able dict (host metadata, not traced).
    """

    __slots__ = ("params", "rest", "opt_state", "step", "_data")

    def __init__(self, params, rest, opt_state, step, data: Mapping[str, Any] | None = None):
        self.params, self.rest, self.opt_state, self.step = params, rest, opt_state, step
        self._data = data if isinstance(data, _Data) else _Data(data or {})

    @property
    def data(self) -> dict[str, Any]:
        return dict(self._data.value)

    def detach(self) -> tuple["TrainState", Any]:
        """``(state without its data position, a token for attach)``: what a jitted step takes,
        so that moving the data position never recompiles it."""
        return TrainState(self.params, self.rest, self.opt_state, self.step, _NO_DATA), self._data

    def attach(self, token) -> "TrainState":
        """The state with the data position of ``token`` (from `detach`)."""
        return TrainState(self.params, self.rest, self.opt_state, self.step, token)

    def replace(self, **changes) -> "TrainState":
        fields = {"params": self.params, "rest": self.rest, "opt_state": self.opt_state, "step": self.step,
                  "data": self._data}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"TrainState.replace: unknown fields {sorted(unknown)}; fields are {sorted(fields)}")
        fields.update(changes)
        return TrainState(**fields)

    def tree_flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey(n) for n in ("params", "rest", "opt_state", "step"))
        return tuple(zip(keys, (self.params, self.rest, self.opt_state, self.step))), self._data

    @classmethod
    def tree_unflatten(cls, data, children):
        return cls(*children, data=data)

    def __repr__(self) -> str:
        n = sum(np.size(x) for x in jax.tree.leaves(self.params))
        return f"TrainState(step={self.step}, {n:,} parameter values, data={self.data})"


def shaped(tree):
    """``jax.ShapeDtypeStruct`` of every leaf (NNX Variables kept)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def sharded_tx(plan, mesh, tx: optax.GradientTransformation, params_like) -> optax.GradientTransformation:
    """``tx`` whose update runs on the plan's ZeRO shards (``tx`` itself at level 0), its state
    stored in the plan's ``precision.opt_state`` dtype (cast inside the shards: nothing is
    gathered for it)."""
    tx = with_precision(tx, plan.precision)
    if not plan.zero_level:
        return tx
    return shard_optimizer(tx, mesh, plan.zero(params_like), shaped(params_like))


def init_state(plan, mesh, model: nnx.Module | tuple, tx: optax.GradientTransformation, *,
               data: Mapping[str, Any] | None = None) -> tuple[Any, TrainState]:
    """Place a model's state by ``plan`` and initialise the optimizer: ``(graphdef, TrainState)``.

    ``model``: an NNX module or its ``(graphdef, params, rest)`` split. The optimizer state
    is created by one jitted ``tx.init`` whose ``out_shardings`` are the plan's, so no device
    holds more of it than the plan gives it.
    """
    if isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    else:
        graphdef, params, rest = model
    stored = plan.shardings("stored", params, mesh)
    if plan.precision is not None:      # master weights in the stored dtype (float leaves only)
        params = cast_floats(params, plan.precision.params)
    params = place(params, stored)      # jax.device_put, also for shardings over several processes
    rest = place(rest, plan.shardings("rest", rest, mesh))
    tx = sharded_tx(plan, mesh, tx, params)
    opt_like = jax.eval_shape(tx.init, shaped(params))
    init = jax.jit(tx.init, out_shardings=plan.shardings("opt_state", opt_like, mesh))
    step = place(np.zeros((), np.int32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return graphdef, TrainState(params, rest, init(params), step, data)


def state_shardings(plan, mesh, state: TrainState) -> TrainState:
    """The ``NamedSharding`` of every leaf of ``state`` as the plan places it (a TrainState)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return TrainState(plan.shardings("stored", state.params, mesh), plan.shardings("rest", state.rest, mesh),
                      plan.shardings("opt_state", state.opt_state, mesh), replicated)
