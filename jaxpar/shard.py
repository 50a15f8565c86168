"""``shard``: operator-level parallel for arrays, functions and Flax NNX modules.

Like MindSpore's ``Primitive.shard`` / ``Cell.shard`` / functional operator splitting:

    >>> mesh = jaxpar.make_mesh({"data": 2, "model": 4})
    >>> x = jaxpar.shard(np.ones((8, 16)), (2, 4), mesh=mesh)      # placed on the mesh
    >>> f = jaxpar.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)), out_strategy=((2, 4),), mesh=mesh)

Outside ``jit`` an array is placed (``device_put``); inside ``jit`` it is constrained
(``with_sharding_constraint``), and XLA propagates shardings to everything not constrained.
The mesh is the ``mesh=`` argument, else the one set with ``jax.set_mesh``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.strategy import manual_axes, mesh_sizes, record_axes, to_partition_spec


def _current_mesh(mesh):
    if mesh is not None:
        return mesh
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:  # inside jit only the abstract mesh is known
        concrete = None
    if concrete is not None and not getattr(concrete, "empty", False) and concrete.axis_names:
        return concrete
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and abstract.axis_names:
        return abstract
    raise ValueError(
        "jaxpar.shard needs a mesh: pass mesh=... or run inside `with jax.set_mesh(mesh):`"
    )


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _shard_array(x, strategy, mesh, rules):
    mesh = _current_mesh(mesh)
    spec = to_partition_spec(strategy, mesh_sizes(mesh), np.shape(x), rules=rules)
    if _is_tracer(x):
        if isinstance(mesh, jax.sharding.Mesh):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        return jax.lax.with_sharding_constraint(x, spec)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError("placing an array outside jit needs a concrete mesh: pass mesh=...")
    return jax.device_put(x, NamedSharding(mesh, spec))


def _shard_tree(tree, strategies, mesh, rules, what: str):
    """Apply one strategy per positional value (``None`` leaves it to XLA)."""
    if strategies is None:
        return tree
    if len(strategies) != len(tree):
        raise ValueError(
            f"{what} has {len(strategies)} entries but the function got/returned {len(tree)} "
            "values; give one strategy (or None) per value"
        )
    return tuple(
        v if s is None else jax.tree.map(lambda a, s=s: _shard_array(a, s, mesh, rules), v)
        for v, s in zip(tree, strategies)
    )


def _check_strategy_tuple(name: str, value) -> None:
    if value is not None and not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a tuple with one strategy per value, got {value!r}")


def shard(
    target: Any,
    strategy: Any = None,
    *,
    in_strategy: Sequence[Any] | None = None,
    out_strategy: Sequence[Any] | None = None,
    mesh=None,
    rules: Mapping[str, Any] | None = None,
):
    """Shard an array, or wrap a function / NNX module so its inputs and outputs are sharded.

    Args:
      target: an array (placed or constrained with ``strategy``), a function, or an
        ``nnx.Module`` (wrapped; call it as before).
      strategy: for arrays — any strategy form (integer tuple, logical names, ``Layout``
        spec, ``PartitionSpec``).
      in_strategy: for functions/modules — one strategy (or None) per positional input.
      out_strategy: one strategy (or None) per output (a single output counts as one).
      mesh: the mesh; default the one set by ``jax.set_mesh``.
      rules: logical axis name → mesh axis, for logical-name strategies.
    """
    _check_strategy_tuple("in_strategy", in_strategy)
    _check_strategy_tuple("out_strategy", out_strategy)
    if isinstance(target, nnx.Module):
        return ShardedModule(target, in_strategy=in_strategy, out_strategy=out_strategy, mesh=mesh, rules=rules)
    if callable(target) and not hasattr(target, "shape"):
        if strategy is not None:
            raise TypeError("for a function, give in_strategy= / out_strategy=, not strategy=")
        return _shard_function(target, in_strategy, out_strategy, mesh, rules)
    if in_strategy is not None or out_strategy is not None:
        raise TypeError("for an array, give strategy=, not in_strategy= / out_strategy=")
    return jax.tree.map(lambda a: _shard_array(a, strategy, mesh, rules), target)


def _shard_function(fn: Callable, in_strategy, out_strategy, mesh, rules) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = _shard_tree(args, in_strategy, mesh, rules, "in_strategy")
        out = fn(*args, **kwargs)
        if out_strategy is None:
            return out
        single = not isinstance(out, tuple)
        out = _shard_tree((out,) if single else out, out_strategy, mesh, rules, "out_strategy")
        return out[0] if single else out

    return wrapped


class ShardedModule(nnx.Module):
    """An NNX module whose call constrains its inputs and outputs (MindSpore ``Cell.shard``).

    The wrapped module's parameters live under ``.module``. Strategies are kept as static
    (hashable) attributes so the wrapper survives ``nnx.split`` / ``nnx.merge``.
    """

    def __init__(self, module: nnx.Module, *, in_strategy=None, out_strategy=None, mesh=None, rules=None):
        self.module = module
        self.in_strategy = None if in_strategy is None else tuple(in_strategy)
        self.out_strategy = None if out_strategy is None else tuple(out_strategy)
        self.mesh = mesh
        self.rules = None if rules is None else tuple(sorted(dict(rules).items()))

    def __call__(self, *args, **kwargs):
        rules = None if self.rules is None else dict(self.rules)
        fn = _shard_function(self.module, self.in_strategy, self.out_strategy, self.mesh, rules)
        return fn(*args, **kwargs)


class LogicalConstraint:
    """``constrain(x, logical_names)`` for model code: pins activations by logical names.

    Built from the config's rules and the mesh; a model stores it and calls it on its
    activations (the example GPT does so on the residual stream). Mesh axes that would split
    two dimensions of one activation, or a dimension they do not divide, are left out for
    that activation (activations are free to be replicated; parameters are not).

    >>> constrain = LogicalConstraint(mesh, {"batch": "data", "embed": "model"})
    >>> y = constrain(x, ("batch", "seq", "embed"))      # inside jit
    """

    def __init__(self, mesh, rules):
        self.mesh = mesh
        self.rules = tuple(sorted(dict(rules).items()))

    def __hash__(self):
        return hash((self.mesh, self.rules))

    def __eq__(self, other):
        return isinstance(other, LogicalConstraint) and (self.mesh, self.rules) == (other.mesh, other.rules)

    def spec(self, shape, names) -> PartitionSpec:
        from jaxpar.strategy import logical_axes

        sizes, rules, used, entries = mesh_sizes(self.mesh), dict(self.rules), set(), []
        for dim, name in zip(shape, names):
            axes = tuple(a for a in logical_axes(name, sizes, rules) if a not in used)
            n = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if not axes or dim % n:
                entries.append(None)
                continue
            used.update(axes)
            entries.append(axes[0] if len(axes) == 1 else axes)
        record_axes(used)      # the axes it splits over, for a Trainer's idle-axis check
        return PartitionSpec(*entries)

    def __call__(self, x, names):
        spec = self.spec(x.shape, names)   # first: it records which rules the model consults
        if not _is_tracer(x):
            return x  # outside jit nothing to pin
        manual = manual_axes()
        if manual:   # inside a shard_map: pin over the axes still automatic (a pipeline stage's), if any
            spec = PartitionSpec(*(_without(e, manual) for e in spec))
        if all(e is None for e in spec):
            return x
        if manual:
            return jax.lax.with_sharding_constraint(x, spec)   # on the context's (abstract) mesh
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def _without(entry, axes):
    """A spec entry without the mesh ``axes``."""
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
