"""Parameter specs: (config, mesh, abstract state) → one ``PartitionSpec`` per variable.

A pure function: the same inputs always give the same specs, which can be printed and saved.
Where a parameter's strategy comes from, first match wins in this order:

1. ``config.parameter_strategy``: glob pattern on the parameter path (``"blocks/*/mlp/up"``) →
   strategy. For models you did not write. A path matching two patterns is an error, and so
   is a pattern matching nothing (a typo would otherwise replicate silently).
2. ``mode="data"``: replicated.
3. The variable's logical names (``nnx.with_partitioning``) mapped through ``config.rules``.
4. Otherwise replicated.
"""

from __future__ import annotations

import fnmatch
import functools
import io
import math
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.strategy import shard_count, to_partition_spec
from jaxpar.strategy.resolve import logical_names


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_str(path) -> str:
    """``blocks/0/attn/wq`` from a pytree key path (the Variable's own ``value`` key dropped)."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(name))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def matching_patterns(path: str, plan: dict[str, Any]) -> list[str]:
    """The ``parameter_strategy`` glob patterns that match ``path``."""
    return [p for p in plan if fnmatch.fnmatchcase(path, p)]


def resolve_spec(config: ParallelConfig, mesh, path: str, shape: tuple[int, ...],
                 logical: tuple | None) -> PartitionSpec:
    """The ``PartitionSpec`` of one variable (see the module docstring for the order).

    The one place a parameter's layout is decided: init, the Trainer's plan, the strategy
    search and checkpoint transforms all call it. ``mesh``: a ``Mesh``, ``AbstractMesh`` or
    ``{axis: size}``; ``logical``: the variable's logical axis names or ``None``.
    """
    patterns = matching_patterns(path, config.parameter_strategy)
    if len(patterns) > 1:
        raise ValueError(
            f"parameter {path!r} {tuple(shape)} matches several parameter_strategy patterns "
            f"{patterns}; make the patterns disjoint"
        )
    try:
        if patterns:
            strategy = config.parameter_strategy[patterns[0]]
            return to_partition_spec(strategy, mesh, shape, rules=config.rules)
        if config.mode == "data" or logical is None or not shape:
            return PartitionSpec()
        return to_partition_spec(logical, mesh, shape, rules=config.rules)
    except ValueError as e:
        raise ValueError(f"parameter {path!r}: {e}") from None


def variable_spec(config: ParallelConfig, mesh, path: str, var: nnx.Variable) -> PartitionSpec:
    """`resolve_spec` of an NNX variable."""
    return resolve_spec(config, mesh, path, np.shape(var.get_value()), logical_names(var))


def state_specs(config: ParallelConfig, mesh, state, *, check_unused: bool = True) -> Any:
    """A tree like ``state`` (an ``nnx.State``) whose variables hold ``PartitionSpec`` values.

    ``check_unused``: raise if a ``parameter_strategy`` pattern matches no variable of ``state``
    (turn off when giving the specs of one part of a model; see ``check_strategy_covers``).
    """

    def one(path, var):
        return var.replace(variable_spec(config, mesh, path_str(path), var))

    specs = jax.tree_util.tree_map_with_path(one, state, is_leaf=is_variable)
    if check_unused:
        check_strategy_covers(config, state)
    return specs


def _paths(state) -> list[str]:
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]]


def check_strategy_covers(config: ParallelConfig, *states) -> None:
    """Raise ``ValueError`` for ``parameter_strategy`` patterns matching no variable of ``states``."""
    paths = [p for state in states for p in _paths(state)]
    used = {pat for p in paths for pat in matching_patterns(p, config.parameter_strategy)}
    unused = sorted(set(config.parameter_strategy) - used)
    if unused:
        raise ValueError(
            f"parameter_strategy patterns {unused} match no parameter; paths look like {paths[:4]}..."
        )


def _strategy_names(strategy: Any) -> set[str]:
    if isinstance(strategy, str):
        return {strategy}
    if isinstance(strategy, (tuple, list)):
        return set().union(*map(_strategy_names, strategy)) if strategy else set()
    return set()


def declared_names(config: ParallelConfig, *states) -> set[str]:
    """Logical names that parameters, ``parameter_strategy`` / ``dataset_strategy`` entries and the
    default batch split consult (activation constraints are recorded when the step is traced)."""
    names: set[str] = set()
    for state in states:
        for _, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]:
            if is_variable(var):
                for entry in logical_names(var) or ():
                    names |= _strategy_names(entry)
    for strategy in (*config.parameter_strategy.values(), config.dataset_strategy):
        names |= _strategy_names(strategy)
    if config.dataset_strategy is None:
        names.add("batch")      # the default batch split reads the "batch" rule
    return names


def check_rules_used(config: ParallelConfig, used: set[str], where: str = "the model") -> None:
    """Raise ``ValueError`` for rules that name a logical axis nothing in ``used`` consults.

    A rule such as ``{"mlpp": "model"}`` (a typo of ``"mlp"``) would otherwise leave the
    parameters it meant to split replicated, silently. ``allow_unused_rules=True`` keeps them.
    """
    if config.allow_unused_rules:
        return
    unused = sorted(set(config.rules) - set(used))
    if not unused:
        return
    import difflib

    hints = []
    for name in unused:
        close = difflib.get_close_matches(name, sorted(used), n=1)
        hints.append(f"{name!r} -> {config.rules[name]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"ParallelConfig.rules: {', '.join(hints)} names a logical axis that no parameter, activation "
        f"constraint or batch of {where} uses, so it would change nothing; the names in use are "
        f"{sorted(used)}. Fix the name, drop the rule, or set ParallelConfig(allow_unused_rules=True) "
        "where the rule is deliberate")


def to_shardings(specs, mesh) -> Any:
    """``PartitionSpec`` tree → ``NamedSharding`` tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def itemsize(dtype) -> int:
    """Bytes per element as JAX stores it, of a dtype or its name (``"bfloat16"``, ``"key<fry>"``).

    A PRNG key array's element is its key data: a threefry key is two ``uint32``, 8 bytes (an
    ``rbg`` key 16). jaxpar's one dtype → bytes rule (spec rows, train plans, the memory
    estimate, the auto-parallel graph).

    >>> itemsize("bfloat16"), itemsize(jax.random.key(0).dtype), itemsize("key<fry>")
    (2, 8, 8)
    """
    if isinstance(dtype, str) and dtype.startswith("key<"):     # a plan keeps dtypes by name
        keys = _key_itemsizes()
        if dtype not in keys:
            raise ValueError(f"itemsize: dtype {dtype!r} is no PRNG key dtype of this JAX (those are "
                             f"{sorted(keys)}); pass a dtype or the name of one")
        return keys[dtype]
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return dtype.itemsize
    return np.dtype(dtype).itemsize


@functools.cache
def _key_itemsizes() -> dict[str, int]:
    """``{name: bytes}`` of the key dtypes of JAX's PRNG implementations."""
    dtypes = [jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl)).dtype
              for impl in ("threefry2x32", "rbg", "unsafe_rbg")]
    return {str(d): d.itemsize for d in dtypes}


class SpecRow(NamedTuple):
    """One variable's row of `spec_rows`: its path, shape, logical names, spec and bytes."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple | None
    spec: PartitionSpec
    bytes_total: int
    bytes_per_device: int


def spec_rows(state, specs, mesh) -> list[SpecRow]:
    """One row per variable: path, shape, logical names, ``PartitionSpec``, bytes."""
    rows = []
    flat_state = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, var), spec in zip(flat_state, flat_specs):
        value = var.get_value()
        shape = tuple(np.shape(value))
        nbytes = math.prod(shape) * itemsize(value.dtype)
        rows.append(
            SpecRow(path_str(path), shape, str(value.dtype), logical_names(var), spec,
                    nbytes, nbytes // shard_count(spec, mesh))
        )
    return rows


def format_specs(rows: list[SpecRow], title: str = "parameter specs") -> str:
    """A table of parameters → strategy → bytes per device, as text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "bytes", "bytes/device"):
        table.add_column(col, justify="right" if "bytes" in col else "left")
    for r in rows:
        table.add_row(r.path, str(r.shape), str(r.logical or "-"), str(tuple(r.spec)),
                      f"{r.bytes_total:,}", f"{r.bytes_per_device:,}")
    total = sum(r.bytes_total for r in rows)
    per_dev = sum(r.bytes_per_device for r in rows)
    table.add_row("total", "", "", "", f"{total:,}", f"{per_dev:,}", style="bold")
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(table)
    return console.export_text()
