"""Optimizer parallel (ZeRO levels 1–3): parameter rules that shard more.

The parameter specs say where each parameter lives for *compute* (its ``PartitionSpec``).
Optimizer parallel adds the data-parallel axis to some of those specs for *storage*:

=====  ===================  ====================  =====================
level  optimizer state      gradients             parameters
=====  ===================  ====================  =====================
0      compute spec         compute spec          compute spec
1      sharded over data    compute spec          compute spec
2      sharded over data    sharded over data     compute spec
3      sharded over data    sharded over data     sharded (FSDP)
=====  ===================  ====================  =====================

The sharding rule (`zero_spec`), for a parameter of ``shape`` with compute ``spec``:

1. parameters smaller than ``threshold_kb`` (whole tensor, all devices together) keep
   their spec: their state is replicated (sharding tiny tensors costs more than it saves);
2. a spec that already uses one of the ZeRO axes is kept;
3. otherwise the ZeRO axes go on the *first dimension not already split* whose size the
   ZeRO group size divides, the stacked ``"layers"`` dimension of scanned blocks last: split
   there, each step of the scan would need a layer another device holds, so every layer's
   parameters would be gathered before the loop; split on another dimension, ZeRO 3 gathers
   one layer's in each step (`jaxpar.nn.blocks.stacked_blocks`);
4. failing that, on the first already-split dimension that still divides (the ZeRO axes
   are appended after the existing ones, e.g. ``("model", "data")``; ``"layers"`` last again);
5. failing that, the spec is kept (replicated over the ZeRO axes) and `ZeroSpecs.unsharded`
   lists the parameter.

``shard_size`` (hybrid sharding: shard within groups of ``s`` devices, replicate across
groups) is expressed with the mesh, not by re-slicing devices: ``optimizer.axis`` names
the data axes in mesh order, e.g. ``("replica", "data")``, and the ZeRO axes are the
trailing ones whose sizes multiply to ``shard_size``. A ``NamedSharding`` then shards over
those axes and replicates over the rest. If no trailing group multiplies to ``shard_size``
``zero_specs`` raises ``ValueError`` suggesting the mesh to build.

Everything here is a pure function of (optimizer config, mesh, specs, abstract params).

Example:
  >>> zero = zero_specs(OptimizerConfig(level=3, threshold_kb=0), mesh, specs, params)  # doctest: +SKIP
  >>> zero.params["wte"]                                                              # doctest: +SKIP
  PartitionSpec('data', None)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.deprecation import renamed_keywords
from jaxpar.config import OptimizerConfig
from jaxpar.strategy import mesh_sizes, spec_axes
from jaxpar.strategy.resolve import logical_names

_is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


class ZeroSpecs(NamedTuple):
    """Spec trees (like the parameter tree, leaves ``PartitionSpec``) for one ZeRO level.

    Attributes:
      compute: where parameters are used (the parameter specs, unchanged).
      params: where parameters are stored (= ``compute`` below level 3).
      grads: the layout gradients are kept in between backward and update, e.g. the
        gradient accumulation buffer (full at level 1, shards from level 2).
      state: the layout of every parameter-shaped optimizer-state leaf; from level 1 the
        update reduces the gradients to this layout and runs on the shards.
      axes: the mesh axes the ZeRO shards run over (``()`` at level 0).
      unsharded: paths of parameters above the threshold that no dimension could take.
    """

    compute: Any
    params: Any
    grads: Any
    state: Any
    axes: tuple[str, ...]
    unsharded: tuple[str, ...]


def zero_axes(config: OptimizerConfig, mesh) -> tuple[str, ...]:
    """The mesh axes ZeRO shards over: ``config.axis``, or its trailing ``shard_size`` group."""
    sizes = mesh_sizes(mesh)
    axes = (config.axis,) if isinstance(config.axis, str) else tuple(config.axis)
    missing = [a for a in axes if a not in sizes]
    if missing:
        raise ValueError(
            f"ParallelConfig.optimizer.axis={config.axis!r} names mesh axes {missing} that the mesh "
            f"{sizes} does not have; set optimizer.axis to the data-parallel axis")
    if config.shard_size is None:
        return axes
    for start in range(len(axes)):
        if math.prod(sizes[a] for a in axes[start:]) == config.shard_size:
            return axes[start:]
    total = math.prod(sizes[a] for a in axes)
    raise ValueError(
        f"ParallelConfig.optimizer.shard_size={config.shard_size}: no trailing group of the ZeRO axes "
        f"{axes} (sizes {[sizes[a] for a in axes]}) has {config.shard_size} devices. Factor the data axis: "
        f"e.g. mesh={{'replica': {total // config.shard_size if total % config.shard_size == 0 else '?'}, "
        f"'data': {config.shard_size}}}, optimizer.axis=('replica', 'data') and rules={{'batch': "
        "('replica', 'data')}")


def _spec(entries: list) -> PartitionSpec:
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return PartitionSpec(*entries)


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], itemsize: int, axes: tuple[str, ...],
              sizes: dict[str, int], threshold_kb: float, layers_dim: int = -1) -> PartitionSpec | None:
    """``spec`` with the ZeRO ``axes`` added (module docstring, rule 1–5); ``None`` if rule 5.
    ``layers_dim``: the dimension stacking scanned layers (`stacked_dim`), tried last; -1: none.

    >>> zero_spec(PartitionSpec(), (4, 8, 8), 4, ("data",), {"data": 4}, 0.0)
    PartitionSpec('data',)
    >>> zero_spec(PartitionSpec(), (4, 8, 8), 4, ("data",), {"data": 4}, 0.0, layers_dim=0)
    PartitionSpec(None, 'data')
    """
    n = math.prod(sizes[a] for a in axes)
    used = {a for entry in spec for a in spec_axes(entry)}
    if n == 1 or math.prod(shape) * itemsize < threshold_kb * 1024 or used & set(axes):
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    zero = axes[0] if len(axes) == 1 else tuple(axes)
    order = sorted(range(len(shape)), key=lambda d: d == layers_dim)
    for dim in order:
        if entries[dim] is None and shape[dim] % n == 0:
            return _spec([*entries[:dim], zero, *entries[dim + 1:]])
    for dim in order:
        have = spec_axes(entries[dim])
        if have and shape[dim] % (n * math.prod(sizes[a] for a in have)) == 0:
            return _spec([*entries[:dim], (*have, *axes), *entries[dim + 1:]])
    return None


def stacked_dim(x) -> int:
    """The dimension of a parameter whose logical name is ``"layers"`` (the stacking axis of
    scanned blocks), from an ``nnx.Variable``'s metadata; -1 for other leaves."""
    names = logical_names(x) if hasattr(x, "get_metadata") else None
    return names.index("layers") if names and "layers" in names else -1


def zero_specs(config: OptimizerConfig, mesh, param_specs, params, stacked=None) -> ZeroSpecs:
    """Storage specs for parameters, gradients and optimizer state at ``config.level``.

    Args:
      config: the ``OptimizerConfig`` (level, threshold_kb, axis, shard_size).
      mesh: the ``jax.sharding.Mesh``.
      param_specs: the parameter specs, a tree of ``PartitionSpec`` like ``params``.
      params: the parameters or their abstract shapes (anything with ``shape``/``dtype``).
      stacked: a tree like ``params`` of each one's stacked ``"layers"`` dimension (-1: none),
        for parameters given without their logical names; ``None``: read from ``params``
        (`stacked_dim` of each ``nnx.Variable``).

    Example:
      >>> zero = zero_specs(OptimizerConfig(level=1), mesh, specs, params)   # doctest: +SKIP
    """
    if config.level == 0:
        return ZeroSpecs(param_specs, param_specs, param_specs, param_specs, (), ())
    axes = zero_axes(config, mesh)
    sizes = mesh_sizes(mesh)
    unsharded: list[str] = []

    if stacked is None:     # shaped like params (a variable keeps its place, holding the number)
        stacked = jax.tree.map(lambda x: x.replace(stacked_dim(x)) if hasattr(x, "get_metadata") else -1, params,
                               is_leaf=lambda x: hasattr(x, "get_metadata"))

    def one(path, spec, x, layers_dim):
        layers_dim = layers_dim.get_value() if hasattr(layers_dim, "get_value") else layers_dim
        out = zero_spec(spec, tuple(x.shape), np.dtype(x.dtype).itemsize, axes, sizes, config.threshold_kb,
                        layers_dim)
        if out is None:
            unsharded.append(jax.tree_util.keystr(path))
            return spec
        return out

    sharded = jax.tree_util.tree_map_with_path(one, param_specs, params, stacked, is_leaf=_is_spec)
    level = config.level
    return ZeroSpecs(
        compute=param_specs,
        params=sharded if level >= 3 else param_specs,
        grads=sharded if level >= 2 else param_specs,
        state=sharded,
        axes=axes,
        unsharded=tuple(unsharded),
    )


def opt_state_specs(tx: optax.GradientTransformation, state_param_specs, params) -> Any:
    """Specs for ``tx.init(params)``: parameter-shaped leaves follow ``state_param_specs``,
    the rest (step counts, scalars, schedule state, factored moments) are replicated.

    A state leaf belongs to the parameter whose key path is the longest suffix of the leaf's
    path and whose shape it has (optax keeps per-parameter state in trees shaped like the
    parameters: ``mu['blocks'][0]['w']``). This works for any optax transformation: chains,
    ``optax.MultiSteps``, ``optax.masked`` (masked-out leaves are absent) and
    ``inject_hyperparams``."""
    abstract = jax.eval_shape(tx.init, params)
    index = param_index(params, jax.tree.leaves(state_param_specs, is_leaf=_is_spec))

    def one(path, leaf):
        spec = mirrored(path, leaf.shape, index)
        return PartitionSpec() if spec is None else spec

    return jax.tree_util.tree_map_with_path(one, abstract)


def param_index(params, values) -> dict:
    """``{parameter key path: (shape, value)}``: ``values`` one per leaf of ``params``, in order
    (their specs, their gradients...), for `mirrored`."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(path): (tuple(x.shape), v) for (path, x), v in zip(flat, values)}


def mirrored(path, shape, index: dict):
    """The value (from `param_index`) of the parameter an optimizer-state leaf at ``path`` of
    ``shape`` mirrors, or None: the parameter whose key path is the longest suffix of ``path``
    and whose shape it has (optax keeps per-parameter state in trees shaped like the
    parameters, ``mu['blocks'][0]['w']``)."""
    path = tuple(path)
    for start in range(len(path)):
        hit = index.get(path[start:])
        if hit is not None and hit[0] == tuple(shape):
            return hit[1]
    return None


def _constrain(tree, specs, mesh):
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                        tree, specs, is_leaf=lambda x: x is None)


@renamed_keywords("shard_optimizer", {"plan": "zero"})     # the keyword of 0.1.0, with a DeprecationWarning
def shard_optimizer(tx: optax.GradientTransformation, mesh, zero: ZeroSpecs, params) -> optax.GradientTransformation:
    """``tx`` whose state lives sharded as ``zero.state`` (and gradients as ``zero.grads``).

    ``init`` and ``update`` pin their state with ``with_sharding_constraint``, so inside
    ``jax.jit`` the state keeps the same shardings after init and after every update, and
    the optimizer arithmetic runs on the shards. ``update`` first pins the gradients to
    ``zero.state`` (the reduced gradients are needed only as shards; ideally a
    reduce-scatter) and its updates too (each device updates its shard; applying them to
    parameters stored whole all-gathers them).

    For your own loop::

      zero = jaxpar.optim.zero_specs(OptimizerConfig(level=2), mesh, specs, params)
      tx = jaxpar.optim.shard_optimizer(optax.adamw(1e-3), mesh, zero, params)
      state = jax.jit(tx.init)(params)              # sharded over 'data'
    """
    state_specs = opt_state_specs(tx, zero.state, params)

    def init(params):
        return _constrain(tx.init(params), state_specs, mesh)

    def update(grads, state, params=None, **extra):
        grads = _constrain(grads, zero.state, mesh)
        updates, state = tx.update(grads, state, params, **extra)
        return _constrain(updates, zero.state, mesh), _constrain(state, state_specs, mesh)

    return optax.GradientTransformationExtraArgs(init, update)


def _added_axes(source: PartitionSpec, target: PartitionSpec, ndim: int) -> list[tuple[int, tuple[str, ...]]]:
    """``(dim, axes)`` for each dimension where ``target`` splits over more mesh axes than ``source``."""
    pad = lambda spec: list(spec) + [None] * (ndim - len(spec))  # noqa: E731
    out = []
    for dim, (se, te) in enumerate(zip(pad(source), pad(target))):
        axes = tuple(a for a in spec_axes(te) if a not in spec_axes(se))
        if axes:
            out.append((dim, axes))
    return out


def gather_params(params, storage_specs, compute_specs):
    """Inside ``shard_map``: all-gather ZeRO-3 shards (``storage_specs``) to ``compute_specs``."""
    def one(x, storage, compute):
        for dim, axes in _added_axes(compute, storage, x.ndim):
            x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
        return x

    return jax.tree.map(one, params, storage_specs, compute_specs, is_leaf=lambda x: x is None)


def reduce_gradients(grads, source_specs, target_specs, batch_axes: tuple[str, ...], reduce_rest=None):
    """Inside ``shard_map``: average per-device gradients over ``batch_axes`` into ``target_specs``.

    ``source_specs`` are the specs the gradients come in (those of the parameters the loss
    was differentiated against). A gradient is summed over the batch axes its source spec
    does not use (along a used axis each device's loss saw only its own slice, or the
    transpose of an all-gather has summed already); where the target spec adds axes to a
    dimension (ZeRO), that sum is a reduce-scatter (``psum_scatter``) on that dimension.
    The plain sums go through ``reduce_rest(leaves, axes)`` (default: one ``psum`` each;
    e.g. bucketed), once per group of leaves with the same axes."""
    n = math.prod(jax.lax.axis_size(a) for a in batch_axes)
    reduce_rest = reduce_rest or (lambda leaves, axes: [jax.lax.psum(g, axes) for g in leaves])
    leaves, treedef = jax.tree.flatten(grads)
    sources = jax.tree.leaves(source_specs, is_leaf=_is_spec)
    targets = jax.tree.leaves(target_specs, is_leaf=_is_spec)
    out: list = list(leaves)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (g, src, tgt) in enumerate(zip(leaves, sources, targets)):
        used = {a for e in src for a in spec_axes(e)}
        axes = tuple(a for a in batch_axes if a not in used)
        added = _added_axes(src, tgt, g.ndim)
        if added:
            (dim, scatter), = added
            g = jax.lax.psum_scatter(g, scatter, scatter_dimension=dim, tiled=True)
            others = tuple(a for a in axes if a not in scatter)
            out[i] = jax.lax.psum(g, others) if others else g
        elif axes:
            groups.setdefault(axes, []).append(i)
    for axes, idx in groups.items():
        for i, g in zip(idx, reduce_rest([leaves[i] for i in idx], axes)):
            out[i] = g
    return jax.tree.unflatten(treedef, [g / n for g in out])
