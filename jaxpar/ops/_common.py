"""Helpers shared by the operators: the mesh, axis checks, specs and constraints."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxpar.strategy import manual_axes, mesh_sizes, record_axes, spec_axes, spec_entry

AnyMesh = Mesh | AbstractMesh


def resolve_mesh(mesh: AnyMesh | None, op: str) -> AnyMesh:
    """``mesh`` itself, else the mesh set with ``jax.set_mesh`` (concrete outside jit)."""
    if mesh is not None:
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise TypeError(
                f"{op}: mesh must be a jax.sharding.Mesh (e.g. jaxpar.make_mesh({{'x': 2, 'y': 4}})), "
                f"got {type(mesh).__name__}"
            )
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        raise ValueError(
            f"{op} needs a mesh: pass mesh=jaxpar.make_mesh(...) or call it inside "
            "`with jax.set_mesh(mesh):`"
        )
    try:
        return jax.sharding.get_mesh()  # outside jit: concrete, so arrays can be placed
    except ValueError:
        return abstract  # inside jit only the abstract mesh is known, which is all we need


def inner_shard_map(fn, mesh: AnyMesh, op: str, *, in_specs, out_specs, diff: tuple[int, ...] = (),
                    diff_out: int | None = None):
    """``jax.shard_map(fn, mesh=mesh, ...)`` that also works inside another shard_map.

    Inside one (the pipeline's, manual over ``pipe``) JAX requires the context's abstract
    mesh, whose axes must be ``mesh``'s, and the new shard_map is manual over the axes that
    are still automatic. Differentiating a nested shard_map would hand residuals across its
    boundary with the outer manual axis in their sharding, which XLA's verifier rejects
    ("manual axes come before free axes"); so there the result is a ``custom_vjp`` whose
    backward is a second shard_map running ``jax.vjp`` per device: only the inputs are kept.
    Nested, ``fn`` reads its device's position with `axis_position`, which takes it from an
    ``arange`` split over each axis: an ``axis_index`` (XLA's partition id) that JAX's partial
    evaluation hoists out of the enclosing shard_map (under recomputation and loops) is one
    XLA cannot partition.
    ``diff``: the positions of the arguments to differentiate (the others get no cotangent);
    ``diff_out``: the output to differentiate when ``fn`` returns a tuple (others: none).
    """
    outer = manual_axes()
    if not outer:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    abstract = jax.sharding.get_abstract_mesh()
    sizes = mesh_sizes(abstract)
    if sizes != mesh_sizes(mesh):
        raise ValueError(f"{op}: called inside a shard_map over mesh {sizes} with mesh={mesh_sizes(mesh)}; "
                         "pass the mesh the enclosing shard_map runs on")
    busy = sorted({a for s in _tuple((in_specs, out_specs)) for e in s for a in spec_axes(e)} & set(outer))
    if busy:
        raise ValueError(f"{op}: its mesh axes {busy} are already per-device here (inside a shard_map manual over "
                         f"{list(outer)}, mesh {sizes}); map its tensors to axes the enclosing shard_map "
                         "leaves automatic (a pipeline's is manual over its pipe axis only), or call it outside")
    names = tuple(a for a in abstract.axis_names if a not in outer)
    if not names:
        raise ValueError(f"{op}: called inside a shard_map that is already manual over every mesh axis "
                         f"{tuple(outer)} (mesh {sizes}), where it has no axis left to run over; call it "
                         "outside that shard_map, or make the enclosing one manual over fewer axes (axis_names=)")
    n_args = len(in_specs)

    @contextlib.contextmanager
    def positions_of(args):   # this device's positions (the trailing arguments) readable by axis_position
        stack = _stack()
        stack.append({a: (p[0], sizes[a]) for a, p in zip(names, args[n_args:])})
        try:
            yield
        finally:
            stack.pop()

    def placed(*args):
        with positions_of(args):
            return fn(*args[:n_args])

    smap = functools.partial(jax.shard_map, mesh=abstract, axis_names=frozenset(names))
    specs = tuple(in_specs) + tuple(PartitionSpec(a) for a in names)
    forward = smap(placed, in_specs=specs, out_specs=out_specs)
    positions = lambda: tuple(jnp.arange(sizes[a], dtype=jnp.int32) for a in names)  # noqa: E731
    if not diff:
        return lambda *args: forward(*args, *positions())

    def picked(args, values):   # fn's differentiated output as a function of the arguments in diff
        full = list(args)
        for i, x in zip(diff, values):
            full[i] = x
        out = placed(*full)
        return out if diff_out is None else out[diff_out]

    def per_device_vjp(args, cotangent):
        # the positions stay readable while the cotangent is applied: a custom_vjp inside fn
        # (ring attention's) traces its backward only then
        with positions_of(args):
            return jax.vjp(lambda *values: picked(args, values), *(args[i] for i in diff))[1](cotangent)

    backward = smap(per_device_vjp, in_specs=(specs, out_specs if diff_out is None else out_specs[diff_out]),
                    out_specs=tuple(in_specs[i] for i in diff))

    @jax.custom_vjp
    def run(*args):
        return forward(*args)

    def bwd(args, cotangent):
        grads = dict(zip(diff, backward(args, cotangent if diff_out is None else cotangent[diff_out])))
        return tuple(grads.get(i) for i in range(len(args)))

    run.defvjp(lambda *args: (forward(*args), args), bwd)
    return lambda *args: run(*args, *positions())


def _tuple(specs) -> tuple:
    """Every ``PartitionSpec`` in nested specs."""
    return tuple(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)))


# The positions `inner_shard_map` hands the per-device code it is tracing, {axis: (index, size)},
# a stack per thread (tracing is per thread).
_POSITIONS = threading.local()


def _stack() -> list[dict[str, tuple[jax.Array, int]]]:
    if not hasattr(_POSITIONS, "stack"):
        _POSITIONS.stack = []
    return _POSITIONS.stack


def axis_position(axes: str | Sequence[str]) -> jax.Array:
    """``lax.axis_index(axes)`` (row-major over several axes) for per-device operator code:
    read from data inside a nested `inner_shard_map` (see there), else the axis index."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    stack = _stack()
    given = stack[-1] if stack else {}
    if not all(a in given for a in axes):
        return jax.lax.axis_index(axes)
    index = jnp.zeros((), jnp.int32)
    for a in axes:
        position, size = given[a]
        index = index * size + position
    return index


def axes_of(op: str, arg: str, value: Any, mesh: AnyMesh) -> tuple[str, ...]:
    """The mesh axes named by an ``*_axis`` argument (a name, a tuple of names, or None)."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple) or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{op}: {arg} must be a mesh axis name, a tuple of names or None, got {value!r}")
    for a in names:
        if a not in mesh.axis_names:
            raise ValueError(
                f"{op}: {arg}={value!r} names mesh axis {a!r}, which is not in the mesh "
                f"{mesh_sizes(mesh)}; use one of {list(mesh.axis_names)}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"{op}: {arg}={value!r} repeats a mesh axis")
    record_axes(names)       # the operator splits over them (a Trainer's idle-axis check)
    return names


def axes_size(mesh: AnyMesh, axes: Sequence[str]) -> int:
    return math.prod(mesh_sizes(mesh)[a] for a in axes)


def padded(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes of ``spec`` (missing trailing entries are empty)."""
    entries = [spec_axes(e) for e in spec]
    return tuple(entries + [()] * (ndim - len(entries)))


def to_spec(entries: Sequence[Sequence[str]]) -> PartitionSpec:
    return PartitionSpec(*(spec_entry(e) for e in entries))


def check_divides(op: str, what: str, shape, dim: int, mesh: AnyMesh, axes: Sequence[str], fix: str) -> None:
    n = axes_size(mesh, axes)
    if shape[dim] % n:
        raise ValueError(
            f"{op}: {what} (shape {tuple(shape)}) dimension {dim} of size {shape[dim]} is not "
            f"divisible by {n}, the size of mesh axes {tuple(axes)} of mesh {mesh_sizes(mesh)}; {fix}"
        )


def constrain(x: jax.Array, spec: PartitionSpec, mesh: AnyMesh) -> jax.Array:
    """``with_sharding_constraint`` that also places concrete arrays outside jit."""
    if isinstance(mesh, Mesh):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)
