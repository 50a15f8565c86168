"""Every strategy form to one ``PartitionSpec``.

Forms (all mean the same thing when they describe the same split):

* ``PartitionSpec`` — returned as is (checked against the mesh and shape).
* MindSpore integer tuple, e.g. ``(2, 1)``: dimension ``i`` is split into ``strategy[i]``
  parts. Each factor > 1 is matched to mesh axes, dimension by dimension, by this rule:
  the first unused mesh axis (in mesh order) whose size equals the factor; otherwise the
  first combination of unused axes (fewest axes first, in mesh order) whose sizes multiply
  to the factor. A mesh axis never splits two dimensions of one tensor. Axes left unused
  replicate the tensor (a product smaller than the mesh means "replicated over the rest").
* ``Layout`` spec, e.g. ``layout("dp", ("sp", "mp"))``: aliases are mesh axes.
* Logical names, e.g. ``("embed", "mlp")``, mapped by ``rules`` (logical name → mesh axis,
  tuple of mesh axes, or None). A name that is neither a rule nor a mesh axis is
  replicated (as in Flax's logical partitioning).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxpar.strategy.layout import Layout, LayoutSpec

Strategy = Any  # tuple[int, ...] | tuple[str | None | tuple[str, ...], ...] | LayoutSpec | PartitionSpec


_LOGICAL_KEYS = ("out_sharding", "sharding_names", "sharding")


def logical_names(var) -> tuple | None:
    """A variable's logical axis names (an ``nnx.Variable``'s sharding metadata), or ``None``."""
    meta = var.get_metadata()
    for key in _LOGICAL_KEYS:
        names = meta.get(key)
        if names:
            return tuple(names)
    return None


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """``{axis: size}`` in axis order, of a ``Mesh``, an ``AbstractMesh`` or a mapping.

    The one place that turns a mesh into axis sizes: everything that only needs sizes (the
    plan, the search, the cost model) accepts any of the three.

    >>> mesh_sizes({"data": 2, "model": 4})
    {'data': 2, 'model': 4}
    """
    if isinstance(mesh, Mapping):
        return {str(k): _axis_size(k, v) for k, v in mesh.items()}
    shape = getattr(mesh, "shape", None)
    if shape is None or not hasattr(mesh, "axis_names"):
        raise TypeError(f"expected a Mesh, an AbstractMesh or a mapping axis -> size, got {type(mesh).__name__}")
    return {str(a): int(shape[a]) for a in mesh.axis_names}


def _axis_size(axis, size) -> int:
    """A mapping's axis size as an ``int``: a whole positive number (``4``, ``np.int64(4)``,
    ``4.0``); ``2.5``, ``-4``, ``0``, ``True`` or ``"4"`` are refused naming the axis (``int()``
    would have made 2.5 into 2 and left -4 to fail far from here)."""
    if isinstance(size, bool) or not isinstance(size, numbers.Real) or size != int(size) or int(size) < 1:
        raise ValueError(f"mesh axis {axis!r}: size {size!r} is not a whole number of devices >= 1; give each axis "
                         "a positive integer (e.g. {'data': 2, 'model': 4})")
    return int(size)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced runs per device (inside a ``shard_map``): the
    context's abstract mesh's manual axes; none outside one."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return ()
    return tuple(a for a, t in zip(abstract.axis_names, abstract.axis_types) if t == jax.sharding.AxisType.Manual)


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (inside a ``shard_map``); empty outside one."""
    aval = jax.typeof(x)   # the set is ``vma`` in some JAX versions, ``manual_axis_type.varying`` in others
    return frozenset(getattr(aval, "vma", None) or getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def match_varying(*arrays):
    """``arrays``, each made to vary over the manual axes any one of them varies over.

    What a ``jax.custom_vjp`` over per-device operands needs: its backward must return each
    cotangent with its input's type, and an operand that does not vary (a replicated weight
    beside per-device activations) would get a varying gradient. Made varying first, its
    gradient is summed over those axes by ``pcast``'s transpose, as a plain einsum's is.
    Outside a ``shard_map`` the arrays come back as they are.
    """
    axes = frozenset().union(*(varying_axes(a) for a in arrays))

    def one(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(one(a) for a in arrays)


def _where(shape, strategy) -> str:
    return f"strategy {strategy!r} for a tensor of shape {tuple(shape) if shape is not None else '?'}"


def is_integer_strategy(strategy: Any) -> bool:
    return isinstance(strategy, tuple) and all(
        isinstance(f, int) and not isinstance(f, bool) for f in strategy
    ) and len(strategy) > 0


def to_partition_spec(
    strategy: Strategy,
    mesh: Mesh | Mapping[str, int],
    shape: Sequence[int] | None = None,
    *,
    rules: Mapping[str, Any] | None = None,
) -> PartitionSpec:
    """Turn any strategy form into a ``PartitionSpec`` for ``mesh``.

    >>> sizes = {"data": 2, "model": 4}
    >>> to_partition_spec((2, 4), sizes)
    P('data', 'model')
    >>> to_partition_spec((8, 1), sizes)
    P(('data', 'model'), None)
    >>> to_partition_spec(("embed", "mlp"), sizes, rules={"mlp": "model"})
    P(None, 'model')
    """
    spec = _to_spec(strategy, mesh, shape, rules)
    check_spec(spec, mesh, shape, strategy)
    record_axes(a for entry in spec for a in spec_axes(entry))
    return spec


def _to_spec(strategy, mesh, shape, rules) -> PartitionSpec:
    if strategy is None:
        return PartitionSpec()
    if isinstance(strategy, PartitionSpec):
        return strategy
    if isinstance(strategy, Layout):
        raise TypeError(
            f"got the Layout {strategy} itself; call it with one entry per tensor dimension, "
            "e.g. layout('dp', 'None')"
        )
    if isinstance(strategy, LayoutSpec):
        _check_layout_matches(strategy.layout, mesh)
        return strategy.to_partition_spec()
    if is_integer_strategy(strategy):
        return _integer_spec(strategy, mesh_sizes(mesh), shape)
    if isinstance(strategy, tuple):
        return _logical_spec(strategy, mesh_sizes(mesh), rules or {})
    raise TypeError(
        f"strategy {strategy!r} of type {type(strategy).__name__} is not a strategy: use an "
        "integer tuple like (2, 1), logical names like ('embed', 'mlp'), a Layout spec, or a "
        "PartitionSpec"
    )


def _check_layout_matches(layout: Layout, mesh) -> None:
    sizes = mesh_sizes(mesh)
    for name, size in layout.axis_sizes().items():
        if sizes.get(name) != size:
            raise ValueError(
                f"Layout{layout.device_matrix, layout.alias_name}: alias {name!r} of size {size} "
                f"does not match the mesh {sizes}; build the mesh with layout.mesh() or use the "
                "mesh's axis names and sizes as aliases"
            )


def _integer_spec(strategy: tuple[int, ...], sizes: dict[str, int], shape) -> PartitionSpec:
    if shape is not None and len(strategy) != len(shape):
        raise ValueError(
            f"{_where(shape, strategy)}: the strategy has {len(strategy)} entries but the tensor "
            f"has {len(shape)} dimensions (mesh {sizes}); give one factor per dimension"
        )
    total = math.prod(sizes.values())
    if any(f < 1 for f in strategy) or math.prod(strategy) > total:
        raise ValueError(
            f"{_where(shape, strategy)}: factors must be >= 1 and multiply to at most the "
            f"{total} devices of mesh {sizes}"
        )
    used: set[str] = set()
    entries = []
    for dim, factor in enumerate(strategy):
        if shape is not None and shape[dim] % factor:
            raise ValueError(
                f"{_where(shape, strategy)}: factor {factor} does not divide dimension {dim} "
                f"of size {shape[dim]} (mesh {sizes}); use a divisor of {shape[dim]}"
            )
        axes = _match_factor(factor, sizes, used)
        if axes is None:
            free = {a: s for a, s in sizes.items() if a not in used}
            raise ValueError(
                f"{_where(shape, strategy)}: no unused mesh axes multiply to {factor} for dimension "
                f"{dim} (mesh {sizes}, still free {free}); use a factor that is a product of free "
                "axis sizes, or a Layout to name the axes"
            )
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _match_factor(factor: int, sizes: dict[str, int], used: set[str]) -> tuple[str, ...] | None:
    if factor == 1:
        return ()
    free = [a for a in sizes if a not in used and sizes[a] > 1]
    for r in range(1, len(free) + 1):
        for combo in itertools.combinations(free, r):
            if math.prod(sizes[a] for a in combo) == factor:
                return combo
    return None


_RECORDING = threading.local()


@contextlib.contextmanager
def recording_rules() -> Iterator[set[str]]:
    """Collects the rule names that `logical_axes` looks up while the block runs.

    What the Trainer wraps around tracing its step, so that a rule no parameter and no
    activation constraint consulted (a typo such as ``"mlpp"``) is reported, not ignored.

    >>> with recording_rules() as seen:
    ...     _ = logical_axes("mlp", {"model": 2}, {"mlp": "model"})
    >>> seen
    {'mlp'}
    """
    with _recording("stack") as seen:
        yield seen


@contextlib.contextmanager
def recording_axes() -> Iterator[set[str]]:
    """Collects the mesh axes that jaxpar's strategies split over while the block runs: every
    ``PartitionSpec`` `to_partition_spec` resolves (``jaxpar.shard``, ``Layout``, the operators'
    strategies), each ``LogicalConstraint``'s, and the axes an operator's ``*_axis`` argument names.

    What the Trainer wraps around tracing its step, so that a mesh axis the model splits over in
    its own code is not reported idle (`TrainPlan.idle_axes_note`).

    >>> with recording_axes() as used:
    ...     _ = to_partition_spec((2, 1), {"data": 2, "model": 4})
    >>> used
    {'data'}
    """
    with _recording("axes") as used:
        yield used


@contextlib.contextmanager
def _recording(key: str) -> Iterator[set[str]]:
    """A set that collects names for as long as the block runs, on this thread's stack ``key``."""
    stack = _RECORDING.__dict__.setdefault(key, [])
    names: set[str] = set()
    stack.append(names)
    try:
        yield names
    finally:
        stack.remove(names)


def record_axes(axes: Iterable[str]) -> None:
    """Note mesh ``axes`` some strategy splits over, for each `recording_axes` block running."""
    stack = getattr(_RECORDING, "axes", ())
    if stack:
        axes = tuple(axes)
        for used in stack:
            used.update(axes)


def logical_axes(entry: Any, sizes: Mapping[str, int], rules: Mapping[str, Any]) -> tuple[str, ...]:
    """The mesh axes one logical dimension name maps to."""
    if entry is None:
        return ()
    names = entry if isinstance(entry, tuple) else (entry,)
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"logical axis {name!r} must be a str or None")
        if name in rules:
            for seen in getattr(_RECORDING, "stack", ()):
                seen.add(name)
            target = rules[name]
            out.extend(() if target is None else (target,) if isinstance(target, str) else target)
        elif name in sizes:
            out.append(name)
    for a in out:
        if a not in sizes:
            raise ValueError(
                f"logical axis {entry!r} maps to mesh axis {a!r}, which is not in the mesh "
                f"{dict(sizes)}; fix the rule or add the axis to the mesh"
            )
    return tuple(out)


def _logical_spec(strategy: tuple, sizes: dict[str, int], rules: Mapping[str, Any]) -> PartitionSpec:
    return PartitionSpec(*(spec_entry(logical_axes(entry, sizes, rules)) for entry in strategy))


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> Any:
    """The ``PartitionSpec`` entry of ``axes`` (the inverse of `spec_axes`): None, one name, or a
    tuple of names.

    >>> spec_entry(()), spec_entry(("data",)), spec_entry(("data", "model"))
    (None, 'data', ('data', 'model'))
    """
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def check_spec(spec: PartitionSpec, mesh, shape=None, strategy=None) -> None:
    """Raise ``ValueError`` if ``spec`` names unknown axes, reuses one, or does not divide ``shape``."""
    sizes = mesh_sizes(mesh)
    strategy = spec if strategy is None else strategy
    if shape is not None and len(spec) > len(shape):
        raise ValueError(
            f"{_where(shape, strategy)}: PartitionSpec {spec} has {len(spec)} entries for a "
            f"{len(shape)}-dimensional tensor"
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        for a in axes:
            if a not in sizes:
                raise ValueError(
                    f"{_where(shape, strategy)}: mesh axis {a!r} is not in the mesh {sizes}; "
                    f"use one of {list(sizes)}"
                )
            if a in seen:
                raise ValueError(
                    f"{_where(shape, strategy)}: mesh axis {a!r} splits two dimensions; one mesh "
                    "axis can split only one dimension of a tensor"
                )
            seen.add(a)
        n = math.prod(sizes[a] for a in axes)
        if shape is not None and shape[dim] % n:
            raise ValueError(
                f"{_where(shape, strategy)}: dimension {dim} of size {shape[dim]} is not divisible "
                f"by {n} (mesh axes {axes} of mesh {sizes}); pick a size divisible by {n} or "
                "split it over fewer devices"
            )


def shard_count(spec: PartitionSpec, mesh) -> int:
    """How many distinct pieces a tensor with ``spec`` is cut into."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
