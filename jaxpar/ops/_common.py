"""Helpers shared by the operators: the mesh, axis checks, specs and constraints."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxpar.strategy import spec_axes

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
    ``diff``: the positions of the arguments to differentiate (the others get no cotangent);
    ``diff_out``: the output to differentiate when ``fn`` returns a tuple (others: none).
    """
    outer = manual_axes()
    if not outer:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    abstract = jax.sharding.get_abstract_mesh()
    if sizes(abstract) != sizes(mesh):
        raise ValueError(f"{op}: called inside a shard_map over mesh {sizes(abstract)} with mesh={sizes(mesh)}; "
                         "pass the mesh the enclosing shard_map runs on")
    names = frozenset(a for a in abstract.axis_names if a not in outer)
    smap = functools.partial(jax.shard_map, mesh=abstract, axis_names=names)
    forward = smap(fn, in_specs=in_specs, out_specs=out_specs)
    if not diff:
        return forward

    def picked(args, values):   # fn's differentiated output as a function of the arguments in diff
        full = list(args)
        for i, x in zip(diff, values):
            full[i] = x
        out = fn(*full)
        return out if diff_out is None else out[diff_out]

    def per_device_vjp(args, cotangent):
        return jax.vjp(lambda *values: picked(args, values), *(args[i] for i in diff))[1](cotangent)

    backward = smap(per_device_vjp, in_specs=(tuple(in_specs), out_specs if diff_out is None else out_specs[diff_out]),
                    out_specs=tuple(in_specs[i] for i in diff))

    @jax.custom_vjp
    def run(*args):
        return forward(*args)

    def bwd(args, cotangent):
        grads = dict(zip(diff, backward(args, cotangent if diff_out is None else cotangent[diff_out])))
        return tuple(grads.get(i) for i in range(len(args)))

    run.defvjp(lambda *args: (forward(*args), args), bwd)
    return run


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced runs per device (inside a ``shard_map``)."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return ()
    return tuple(a for a, t in zip(abstract.axis_names, abstract.axis_types) if t == jax.sharding.AxisType.Manual)


def sizes(mesh: AnyMesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh, in axis order."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


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
                f"{sizes(mesh)}; use one of {list(mesh.axis_names)}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"{op}: {arg}={value!r} repeats a mesh axis")
    return names


def axes_size(mesh: AnyMesh, axes: Sequence[str]) -> int:
    return math.prod(sizes(mesh)[a] for a in axes)


def entry(axes: Sequence[str]) -> Any:
    """A ``PartitionSpec`` entry for ``axes``: None, one name, or a tuple of names."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def padded(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes of ``spec`` (missing trailing entries are empty)."""
    entries = [spec_axes(e) for e in spec]
    return tuple(entries + [()] * (ndim - len(entries)))


def to_spec(entries: Sequence[Sequence[str]]) -> PartitionSpec:
    return PartitionSpec(*(entry(e) for e in entries))


def check_divides(op: str, what: str, shape, dim: int, mesh: AnyMesh, axes: Sequence[str], fix: str) -> None:
    n = axes_size(mesh, axes)
    if shape[dim] % n:
        raise ValueError(
            f"{op}: {what} (shape {tuple(shape)}) dimension {dim} of size {shape[dim]} is not "
            f"divisible by {n}, the size of mesh axes {tuple(axes)} of mesh {sizes(mesh)}; {fix}"
        )


def constrain(x: jax.Array, spec: PartitionSpec, mesh: AnyMesh) -> jax.Array:
    """``with_sharding_constraint`` that also places concrete arrays outside jit."""
    if isinstance(mesh, Mesh):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)
