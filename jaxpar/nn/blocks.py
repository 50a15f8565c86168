"""A model's repeated blocks, found or named by path: where ``ParallelConfig.remat`` goes.

Around the whole loss, ``jax.checkpoint`` makes XLA keep the stacked activations of scanned
layers (on an H100, a Llama 1B took 70.6 GiB that way against 43.4 GiB with the same policy
on each block). So the step applies the policy to each block ``find_blocks`` returns (the
scan body of stacked layers, or each unrolled layer) with ``jaxpar.remat`` on the module,
and to the whole loss only for a model without blocks. The job search prices a policy with
the same functions (`remat_loss`), so it recomputes the blocks the Trainer will. Models carry
no recompute setting of their own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from flax import nnx

from jaxpar.nn.specs import logical_names
from jaxpar.remat import remat

__all__ = ["BLOCKS_HOOK", "block_policy", "find_blocks", "layer_constrained_loss", "module_at", "recompute_paths",
           "recomputed_loss", "remat_blocks", "remat_loss", "stacked_blocks"]

BLOCKS_HOOK = "jaxpar_blocks"
"""The model attribute that names its blocks: module paths, as ``StagedLoss.order``."""


def find_blocks(model: nnx.Module, order: Sequence[str] | None = None) -> tuple[str, ...]:
    """The paths of ``model``'s repeated blocks: what ``ParallelConfig.remat`` recomputes one by one.

    * Named by the model: its ``jaxpar_blocks`` attribute (class or instance), a sequence of
      module paths as ``StagedLoss.order`` takes them (``"blocks"``, ``"encoder/layers"``); a
      path naming a sequence (an ``nnx.List``) stands for its items ``path/0``, ``path/1``, ...
      ``()`` names none.
    * Named by the loss: ``order``, the module paths of a ``StagedLoss`` (same form).
    * Otherwise found, top-down (no block is looked for inside a block): a module whose
      parameters all have ``"layers"`` as their first logical axis (layers stacked with
      ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` for ``scan``: the
      scan body is the block), and the items of an ``nnx.List`` / list / tuple of two or more
      modules of one class (unrolled layers).

    The same model always gives the same paths, in attribute order (names sorted, items by index).

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(3)])
        >>> find_blocks(M())
        ('layers/0', 'layers/1', 'layers/2')
    """
    named = getattr(model, BLOCKS_HOOK, None)
    if named is not None:
        return tuple(path for path, _ in _named_blocks(model, named, f"{type(model).__name__}.{BLOCKS_HOOK}"))
    if order is not None:
        return tuple(path for path, _ in _named_blocks(model, order, "StagedLoss.order"))
    nodes = dict(nnx.iter_graph(model))
    params = [(path, var) for path, var in nodes.items() if isinstance(var, nnx.Param)]
    found: list[tuple] = []
    for path in sorted(nodes, key=_order):          # a parent sorts before its children
        if any(path[:len(b)] == b for b in found):
            continue
        node = nodes[path]
        if isinstance(node, (nnx.List, list, tuple)):
            if _repeated(node):
                found += [(*path, i) for i in range(len(node))]
        elif path and isinstance(node, nnx.Module) and _stacked(path, params):
            found.append(path)
    return tuple("/".join(map(str, path)) for path in found)


def block_policy(model: nnx.Module, paths: Sequence[str]) -> str | None:
    """The recompute policy ``model`` already puts on its blocks, as a setting to name, or ``None``:
    a block recomputed by ``jaxpar.remat(block, policy)``.

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])
        >>> m = M()
        >>> block_policy(m, find_blocks(m)) is None
        True
        >>> _ = remat(m.layers[1], "dots_saveable")
        >>> block_policy(m, find_blocks(m))
        "jaxpar.remat(model.layers.1, 'dots_saveable')"
    """
    for path in paths:
        own = getattr(type(module_at(model, path)), "_jaxpar_remat_policy", None)
        if own is not None:
            return f"jaxpar.remat(model.{path.replace('/', '.')}, {own!r})"
    return None


def recompute_paths(model: nnx.Module, policy: str, order: Sequence[str] | None = None) -> tuple[str, ...]:
    """The blocks ``ParallelConfig.remat=policy`` recomputes in ``model`` (`find_blocks`; ``order``:
    a ``StagedLoss``'s module paths), for the step and the job search alike. ``()`` when there
    are none, so the policy wraps the whole loss (with a ``UserWarning`` unless the model names
    no blocks on purpose, ``jaxpar_blocks = ()``). A model whose blocks carry their own policy
    too (`block_policy`) is refused with a ``ValueError`` naming both.

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])
        >>> recompute_paths(M(), "full")
        ('layers/0', 'layers/1')
    """
    paths = find_blocks(model, order)
    name = type(model).__name__
    if not paths:
        if getattr(model, BLOCKS_HOOK, None) is None:
            warnings.warn(
                f"ParallelConfig.remat={policy!r}: found no repeated blocks in {name} (no module stacked on a "
                f"'layers' axis, no nnx.List of two or more modules of one class), so the policy wraps the whole "
                f"loss, where XLA keeps scanned layers' stacked activations. Name the blocks with a "
                f"{BLOCKS_HOOK} = ('layers',) attribute on {name} (module paths), or {BLOCKS_HOOK} = () to keep "
                f"the whole-loss recompute", UserWarning, stacklevel=3)
        return ()
    own = block_policy(model, paths)
    if own is not None:
        raise ValueError(f"ParallelConfig.remat={policy!r} and {own} both set a recompute policy for the blocks "
                         f"of {name} ({', '.join(paths)}); set one of them (ParallelConfig.remat applies its "
                         f"policy to each block, as jaxpar.remat on a block does)")
    return paths


def recomputed_loss(loss_fn: Callable, paths: Sequence[str], policy: str) -> Callable:
    """``loss_fn(model, batch, *rest)`` run on the model with each block at ``paths`` recomputed
    with ``policy`` (`remat_blocks` on the model it gets: a model merged inside the traced
    function, so the caller's model keeps its classes)."""
    paths = tuple(paths)

    def with_recomputed_blocks(model, batch, *rows):
        return loss_fn(remat_blocks(model, paths, policy), batch, *rows)

    return with_recomputed_blocks


def remat_blocks(model: nnx.Module, paths: Sequence[str], policy: str) -> nnx.Module:
    """``model`` with each block at ``paths`` (``find_blocks``) recomputed with ``policy``
    (``remat`` on the module: its class changes, its variables and paths stay)."""
    for path in paths:
        remat(module_at(model, path), policy)
    return model


def remat_loss(model: nnx.Module, loss_fn: Callable, policy: str, order: Sequence[str] | None = None) -> Callable:
    """``loss_fn`` as the step runs it for ``model`` under ``ParallelConfig.remat=policy``: each
    block recomputed (`recompute_paths`, `recomputed_loss`), or, for a model without blocks, the
    whole loss (``jaxpar.remat`` on the function). What the job search traces to price a policy.

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])
        >>> def loss(m, x):
        ...     for layer in m.layers:
        ...         x = layer(x)
        ...     return (x ** 2).sum()
        >>> remat_loss(M(), loss, "none") is loss
        True
        >>> import jax.numpy as jnp
        >>> m = M()
        >>> _ = remat_loss(m, loss, "full")(m, jnp.ones((1, 2)))   # recomputes the blocks of the model it runs
        >>> [type(layer)._jaxpar_remat_policy for layer in m.layers]
        ['full', 'full']
    """
    if policy == "none":
        return loss_fn
    paths = recompute_paths(model, policy, order)
    return recomputed_loss(loss_fn, paths, policy) if paths else remat(loss_fn, policy)


def stacked_blocks(model: nnx.Module, order: Sequence[str] | None = None) -> tuple[str, ...]:
    """The blocks of `find_blocks` whose parameters are all stacked on a leading ``"layers"``
    axis: the bodies of scans, each call of which runs one layer.

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])
        >>> stacked_blocks(M())     # unrolled layers: no stack
        ()
    """
    params = [(path, var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)]
    return tuple(path for path in find_blocks(model, order)
                 if _stacked(tuple(int(k) if k.isdigit() else k for k in path.split("/")), params))


def layer_constrained_loss(loss_fn: Callable, constraints: dict[str, dict[str, tuple]]) -> Callable:
    """``loss_fn(model, batch, *rest)`` with each block at a path of ``constraints`` (a stacked
    block: `stacked_blocks`) pinning, at each of its calls (one layer in the scan's step), its
    parameters to the shardings ``constraints[path][param path in the block]`` in turn (e.g. the
    ZeRO 3 shard, then the compute layout: the gather happens there, one layer at a time). The
    parameters get their own values back when the call returns, so the block's state is what
    it was; a recompute policy on the block (`remat_blocks`, applied inside this, or
    ``jaxpar.remat`` the model put on the block itself) redoes the constraints in its backward."""
    frozen = {path: tuple(sorted(by_param.items())) for path, by_param in constraints.items()}

    def with_constrained_layers(model, batch, *rest):
        for path, by_param in frozen.items():
            module = module_at(model, path)
            cls = type(module)
            policy = getattr(cls, "_jaxpar_remat_policy", None)
            # a block recomputed by the model itself: the constraints go inside its recompute
            module.__class__ = _constrained_class(getattr(cls, "_jaxpar_remat_base", cls), by_param)
            if policy is not None:
                remat(module, policy)
        return loss_fn(model, batch, *rest)

    return with_constrained_layers


_CONSTRAINED: dict[tuple, type] = {}


def _constrained_class(cls: type, by_param: tuple) -> type:
    """``cls`` whose calls pin its parameters (``by_param``: sorted ``(path, shardings)``
    pairs), one class per block class and constraints, so the recompute classes built on it
    are made once too."""
    key = (cls, by_param)
    if key not in _CONSTRAINED:
        _CONSTRAINED[key] = _make_constrained(cls, dict(by_param))
    return _CONSTRAINED[key]


def _make_constrained(cls: type, by_param: dict[str, tuple]) -> type:
    from jax.lax import with_sharding_constraint as constrain

    def __call__(self, *args, **kwargs):
        kept = []
        for path, var in nnx.iter_graph(self):
            shardings = by_param.get("/".join(str(k) for k in path)) if isinstance(var, nnx.Param) else None
            if shardings:
                value = var.get_value()
                kept.append((var, value))
                for sharding in shardings:
                    value = constrain(value, sharding)
                var.set_value(value)
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            for var, value in kept:
                var.set_value(value)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _order(path: tuple) -> tuple:
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in path)


def _base(cls: type) -> type:
    return getattr(cls, "_jaxpar_remat_base", cls)


def _repeated(seq) -> bool:
    items = list(seq)
    return (len(items) >= 2 and all(isinstance(x, nnx.Module) for x in items)
            and len({_base(type(x)) for x in items}) == 1)


def _stacked(path: tuple, params: list[tuple[tuple, nnx.Param]]) -> bool:
    mine = [var for p, var in params if p[:len(path)] == path]
    return bool(mine) and all((logical_names(var) or (None,))[0] == "layers" for var in mine)


def _named_blocks(model: nnx.Module, named, where: str) -> list[tuple[str, nnx.Module]]:
    if isinstance(named, str) or not isinstance(named, Sequence) or not all(isinstance(p, str) for p in named):
        raise TypeError(f"{where}={named!r}: give a sequence of module paths, e.g. ('layers',) or "
                        f"('encoder/layers', 'decoder/layers'); () names no blocks")
    out = []
    for path in named:
        node = module_at(model, path, where)
        items = ([(f"{path}/{i}", x) for i, x in enumerate(node)] if isinstance(node, (nnx.List, list, tuple))
                 else [(path, node)])
        for item_path, item in items:
            if not isinstance(item, nnx.Module):
                raise TypeError(f"{where} names {item_path!r}, which holds a {type(item).__name__}, not an "
                                f"nnx.Module; name the modules that run as blocks")
        out += items
    return out


def module_at(model: nnx.Module, path: str, where: str = "find_blocks"):
    """The module of ``model`` at ``path`` (attribute names and item indices joined by ``/``, as
    `find_blocks` gives them); a path the model lacks is a ValueError naming ``where``."""
    node = model
    for part in path.split("/"):
        try:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        except (AttributeError, IndexError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: the model has no module at {path!r} "
                             f"({part!r} not found in {type(node).__name__}); name modules by attribute "
                             f"path, e.g. 'layers' or 'blocks/3'") from e
    return node
