"""Helpers shared by the operators: the mesh, axis checks, specs and constraints."""

from __future__ import annotations

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
