"""A model's repeated blocks, found or named by path: where ``ParallelConfig.remat`` goes.

Around the whole loss, ``jax.checkpoint`` makes XLA keep the stacked activations of scanned
layers (on an H100, a Llama 1B took 70.6 GiB that way against 43.4 GiB with the same policy
on each block). So the step applies the policy to each block ``find_blocks`` returns (the
scan body of stacked layers, or each unrolled layer) with ``jaxpar.remat`` on the module,
and to the whole loss only for a model without blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from jaxpar.nn.specs import logical_names
from jaxpar.remat import remat

__all__ = ["BLOCKS_HOOK", "block_policy", "find_blocks", "remat_blocks"]

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
    a config field ``cfg.remat`` / ``config.remat`` (``LlamaConfig``, ``GPTConfig``), or a block
    recomputed by ``jaxpar.remat(block, policy)``.

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
    for name in ("cfg", "config"):
        own = getattr(getattr(model, name, None), "remat", "none")
        if isinstance(own, str) and own != "none":
            return f"{type(getattr(model, name)).__name__}.remat={own!r}"
    for path in paths:
        own = getattr(type(_resolve(model, path)), "_jaxpar_remat_policy", None)
        if own is not None:
            return f"jaxpar.remat(model.{path.replace('/', '.')}, {own!r})"
    return None


def remat_blocks(model: nnx.Module, paths: Sequence[str], policy: str) -> nnx.Module:
    """``model`` with each block at ``paths`` (``find_blocks``) recomputed with ``policy``
    (``remat`` on the module: its class changes, its variables and paths stay)."""
    for path in paths:
        remat(_resolve(model, path), policy)
    return model


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
        node = _resolve(model, path, where)
        items = ([(f"{path}/{i}", x) for i, x in enumerate(node)] if isinstance(node, (nnx.List, list, tuple))
                 else [(path, node)])
        for item_path, item in items:
            if not isinstance(item, nnx.Module):
                raise TypeError(f"{where} names {item_path!r}, which holds a {type(item).__name__}, not an "
                                f"nnx.Module; name the modules that run as blocks")
        out += items
    return out


def _resolve(model: nnx.Module, path: str, where: str = "find_blocks"):
    node = model
    for part in path.split("/"):
        try:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        except (AttributeError, IndexError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: the model has no module at {path!r} "
                             f"({part!r} not found in {type(node).__name__}); name modules by attribute "
                             f"path, e.g. 'layers' or 'blocks/3'") from e
    return node
