"""Strategies as class assignments, and the way to and from ``PartitionSpec``s.

A strategy is one tuple of mesh axes per dimension class (see `jaxpar.auto.graph`). Its
parameter layouts are read off directly (parameter dim ``d`` → the axes of its class), and
user annotations (``PartitionSpec``s of some parameters, the batch's split) are read back
into a *partial* assignment, with the classes they disagree on listed as conflicts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from jaxpar.auto.graph import Graph
from jaxpar.data import leaf_spec
from jaxpar.nn.specs import resolve_spec

Axes = tuple[str, ...]


def domains(graph: Graph, sizes: Mapping[str, int]) -> list[list[Axes]]:
    """Candidate axes per class: every set of mesh axes (in mesh order) whose size divides the class."""
    names = [a for a in sizes if sizes[a] > 1]
    subsets = [c for r in range(len(names) + 1) for c in itertools.combinations(names, r)]
    out = []
    for c, n in enumerate(graph.class_sizes):
        if c in graph.unsplittable:
            out.append([()])
        else:
            out.append([s for s in subsets if n % math.prod(sizes[a] for a in s) == 0])
    return out


def _entry_axes(entry) -> Axes:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def from_specs(graph: Graph, specs: Mapping[str, PartitionSpec], sizes: Mapping[str, int]):
    """A partial assignment from ``{path: PartitionSpec}`` (parameter paths or batch leaf paths).

    Returns ``(axes, sources, conflicts)``: ``axes[c]`` is a tuple or ``None`` (free);
    ``sources[c]`` the first path that set it; ``conflicts`` lists ``(class, [(path, axes)...])``
    for classes that annotations set differently (the first one is kept; the search decides).
    """
    tensors = dict(graph.params) | dict(graph.batch)
    axes: list[Axes | None] = [None] * graph.num_classes
    sources: list[str | None] = [None] * graph.num_classes
    seen: dict[int, list[tuple[str, Axes]]] = {}
    for path, spec in specs.items():
        if path not in tensors:
            raise ValueError(f"annotation for {path!r}: no such parameter or batch leaf; "
                             f"known paths look like {[p for p, _ in graph.params[:3]]}")
        t = graph.tensors[tensors[path]]
        entries = tuple(spec) + (None,) * (len(t.shape) - len(tuple(spec)))
        for c, entry in zip(t.classes, entries):
            if c < 0:
                continue
            a = _entry_axes(entry)
            seen.setdefault(c, [])
            if (path, a) not in seen[c]:
                seen[c].append((path, a))
            if axes[c] is None:
                axes[c], sources[c] = a, path
    conflicts = [(c, v) for c, v in sorted(seen.items()) if len({a for _, a in v}) > 1]
    return axes, sources, conflicts


def spec_of(graph: Graph, t: int, axes: Sequence[Axes]) -> PartitionSpec:
    entries = []
    for c in graph.tensors[t].classes:
        a = axes[c] if c >= 0 else ()
        entries.append(None if not a else a[0] if len(a) == 1 else tuple(a))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def param_specs(graph: Graph, axes: Sequence[Axes]) -> dict[str, PartitionSpec]:
    return {path: spec_of(graph, t, axes) for path, t in graph.params}


def batch_specs(graph: Graph, axes: Sequence[Axes]) -> dict[str, PartitionSpec]:
    return {path: spec_of(graph, t, axes) for path, t in graph.batch}


def fill(axes: Sequence[Axes | None]) -> list[Axes]:
    """Free classes → not split."""
    return [() if a is None else a for a in axes]


def config_specs(graph: Graph, config, mesh_sizes: Mapping[str, int]) -> dict[str, PartitionSpec]:
    """The ``PartitionSpec`` of every parameter and batch leaf under a ``ParallelConfig``
    (parameters by `jaxpar.nn.specs.resolve_spec`, batch leaves by `jaxpar.data.leaf_spec`)."""
    specs = {}
    for (path, t), logical in zip(graph.params, graph.param_logical):
        specs[path] = resolve_spec(config, mesh_sizes, path, graph.tensors[t].shape, logical)
    for path, t in graph.batch:
        specs[path] = leaf_spec(config, mesh_sizes, graph.tensors[t].shape)
    return specs


def hand_axes(graph: Graph, config, mesh_sizes: Mapping[str, int]) -> list[Axes]:
    """The assignment a hand-written ``ParallelConfig`` gives (classes that no parameter or
    batch layout touches stay whole)."""
    return fill(from_specs(graph, config_specs(graph, config, mesh_sizes), mesh_sizes)[0])
