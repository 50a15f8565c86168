"""The three searches over class assignments (pure functions of graph, mesh sizes and costs).

* `dynamic_programming`: the exact optimum of the cost model. The step's cost is a sum of
  per-operator terms, each depending only on the classes its tensors carry, so the problem
  is min-sum over a factor graph; it is solved by variable elimination (the "elimination DP"
  of MindSpore / Alpa's graph DP): eliminate the class whose neighbourhood table is
  smallest, keep the arg-min, back-substitute at the end. Operators of repeated layers have
  identical tables, which are computed once (keyed by the operator's structure).
  A memory budget is met by Lagrangian relaxation: minimise time + λ·memory, bisecting λ.
* `recursive_programming`: double recursion, near-instant on huge graphs and meshes. The
  outer recursion walks the mesh axes (largest first; a hypercube mesh of 2-axes is the
  "split the device count by two" form); for each, the inner pass visits classes heaviest
  first and gives them the axis when that lowers the cost of the operators touching them.
* `sharding_propagation`: start from the user's annotations (a few parameters and/or the
  batch); visit the remaining classes outward from them, each taking the value that costs
  least given its already-decided neighbours; annotations that disagree are resolved by
  the cost model and reported.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxpar.config import SEARCHES as SEARCH_NAMES
from jaxpar.auto.assign import Axes, domains
from jaxpar.auto.cost import CostParams, Flags, evaluate, flags_for, op_scalar, param_scalar
from jaxpar.auto.graph import Graph


@dataclasses.dataclass
class Problem:
    """A graph with its per-tensor flags and a memo of operator cost tables."""

    graph: Graph
    sizes: dict[str, int]
    params: CostParams
    flags: Flags
    op_classes: list[tuple[int, ...]]
    op_keys: list[tuple]
    class_ops: list[list[int]]
    cache: dict
    runs: float = 1.0        # times a step runs the graph (micro-batches): `jaxpar.auto.cost.op_scalar`

    @classmethod
    def make(cls, graph: Graph, sizes: Mapping[str, int], params: CostParams, runs: float = 1.0) -> "Problem":
        flags = flags_for(graph, params)
        op_classes, op_keys = [], []
        class_ops: list[list[int]] = [[] for _ in range(graph.num_classes)]
        for i, op in enumerate(graph.ops):
            cs = _op_classes(graph, op)
            op_classes.append(cs)
            op_keys.append(_op_key(graph, op, cs, flags))
            for c in cs:
                class_ops[c].append(i)
        return cls(graph, dict(sizes), params, flags, op_classes, op_keys, class_ops, {}, runs)

    def op_cost(self, i: int, axes: Sequence[Axes]) -> tuple[float, float]:
        """(time, temp bytes) of operator ``i``, memoised by structure and the axes it sees."""
        key = (self.op_keys[i], tuple(axes[c] for c in self.op_classes[i]))
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = op_scalar(self.graph, self.graph.ops[i], axes, self.sizes, self.params, self.flags,
                                              self.runs)
        return hit

    def param_cost(self, t: int, axes) -> tuple[float, float]:
        key = ("param", self.graph.tensors[t], tuple(axes[c] if c >= 0 else () for c in self.graph.tensors[t].classes))
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = param_scalar(self.graph, t, axes, self.sizes, self.params)
        return hit

    def total(self, axes, mem_weight: float = 0.0) -> float:
        time = mem = 0.0
        for i in range(len(self.graph.ops)):
            t, m = self.op_cost(i, axes)
            time, mem = time + t, mem + m
        for _, t in self.graph.params:
            a, m = self.param_cost(t, axes)
            time, mem = time + a, mem + m
        if not math.isfinite(time):
            return math.inf
        return time + mem_weight * mem if mem_weight else time


def _op_classes(graph: Graph, op) -> tuple[int, ...]:
    seen: dict[int, None] = {}
    for t in (*op.ins, *op.outs):
        if t >= 0:
            for c in graph.tensors[t].classes:
                if c >= 0:
                    seen[c] = None
    return tuple(seen)


def _op_key(graph: Graph, op, cs, flags: Flags) -> tuple:
    rel = {c: k for k, c in enumerate(cs)}
    tens = tuple((graph.tensors[t].shape, graph.tensors[t].itemsize,
                  tuple(rel.get(c, -1) for c in graph.tensors[t].classes),
                  flags.grad[t], flags.param[t], flags.saved[t],
                  # combined or not: a value of parameters alone, a tail (`jaxpar.auto.comm`)
                  bool(flags.source) and flags.source[t] >= 0, bool(flags.tail) and flags.tail[t])
                 if t >= 0 else None
                 for t in (*op.ins, *op.outs))
    return (op.prim, op.info, op.repeat, op.keep, len(op.ins), tens)


# --------------------------------------------------------------------------- dynamic programming

def dynamic_programming(problem: Problem, fixed: Sequence[Axes | None] | None = None,
                        memory_budget: float | None = None) -> list[Axes]:
    """The assignment minimising predicted step time (within ``memory_budget`` bytes of
    predicted memory when given; the least-memory assignment if nothing fits)."""
    doms = _domains(problem, fixed)
    tables = _factor_tables(problem, doms)
    best = _eliminate(tables, doms, 0.0)
    if memory_budget is None or _memory(problem, best) <= memory_budget:
        return best
    lo, hi = 0.0, 1e-9
    while _memory(problem, _eliminate(tables, doms, hi)) > memory_budget and hi < 1e6:
        hi *= 10
    best = _eliminate(tables, doms, hi)
    if _memory(problem, best) > memory_budget:
        return best         # nothing fits: the least memory, no bisection towards a fit
    for _ in range(30):
        mid = (lo + hi) / 2
        cand = _eliminate(tables, doms, mid)
        if _memory(problem, cand) <= memory_budget:
            hi, best = mid, cand
        else:
            lo = mid
    return best


def _memory(problem: Problem, axes) -> float:
    """Predicted per-device bytes of the assignment: arguments + the liveness peak of temp
    (`cost.evaluate`); the searches minimise an additive stand-in (saved values + parameter
    state) weighted by λ and check the budget with this."""
    return evaluate(problem.graph, axes, problem.sizes, problem.params, flags=problem.flags).memory_bytes


def _domains(problem: Problem, fixed) -> list[list[Axes]]:
    doms = domains(problem.graph, problem.sizes)
    if fixed is not None:
        doms = [d if f is None else [f] for d, f in zip(doms, fixed)]
    return doms


def _factor_tables(problem: Problem, doms):
    """One (scope, time table, memory table) per operator and parameter, scope = free classes."""
    base = [d[0] for d in doms]
    factors = []
    items = [("op", i, problem.op_classes[i]) for i in range(len(problem.graph.ops))]
    items += [("param", t, tuple(c for c in problem.graph.tensors[t].classes if c >= 0)) for _, t in problem.graph.params]
    merged: dict[tuple, list] = {}
    for kind, i, cs in items:
        scope = tuple(sorted({c for c in cs if len(doms[c]) > 1}))
        shape = tuple(len(doms[c]) for c in scope)
        time, mem = np.zeros(shape), np.zeros(shape)
        axes = list(base)
        for idx in itertools.product(*(range(n) for n in shape)):
            for c, k in zip(scope, idx):
                axes[c] = doms[c][k]
            time[idx], mem[idx] = problem.op_cost(i, axes) if kind == "op" else problem.param_cost(i, axes)
        if scope in merged:
            merged[scope][0] += time
            merged[scope][1] += mem
        else:
            merged[scope] = [time, mem]
    for scope, (time, mem) in merged.items():
        factors.append((scope, time, mem))
    return factors


def _eliminate(factors, doms, mem_weight: float) -> list[Axes]:
    live = [(scope, np.where(np.isfinite(t), t + mem_weight * np.where(np.isfinite(m), m, 0.0), np.inf))
            for scope, t, m in factors]
    free = sorted({c for scope, _ in live for c in scope})
    trace = []
    while free:
        def width(c):
            return math.prod(len(doms[v]) for v in set().union(*(s for s, _ in live if c in s)))
        c = min(free, key=width)
        free.remove(c)
        touching = [f for f in live if c in f[0]]
        live = [f for f in live if c not in f[0]]
        scope = tuple(sorted(set().union(*(s for s, _ in touching))))
        total = np.zeros(tuple(len(doms[v]) for v in scope))
        for s, table in touching:
            total = total + _expand(table, s, scope)
        k = scope.index(c)
        rest = scope[:k] + scope[k + 1:]
        trace.append((c, rest, np.argmin(total, axis=k)))
        live.append((rest, np.min(total, axis=k)))
    choice: dict[int, int] = {}
    for c, rest, arg in reversed(trace):
        choice[c] = int(arg[tuple(choice[v] for v in rest)])
    return [d[choice.get(c, 0)] for c, d in enumerate(doms)]


def _expand(table, scope, target):
    """Broadcast ``table`` (axes = ``scope``) to the axes of ``target``."""
    order = [scope.index(v) for v in target if v in scope]
    t = np.transpose(table, order) if order else table
    shape = [t.shape[order.index(scope.index(v))] if v in scope else 1 for v in target]
    return t.reshape(shape)


# --------------------------------------------------------------------------- recursive programming

def recursive_programming(problem: Problem, fixed: Sequence[Axes | None] | None = None,
                          memory_budget: float | None = None) -> list[Axes]:
    """Greedy double recursion: mesh axes (largest first) × classes (heaviest first)."""
    g = problem.graph
    axes: list[Axes] = [() if f is None else f for f in (fixed or [None] * g.num_classes)]
    free = [c for c in range(g.num_classes) if (fixed is None or fixed[c] is None) and c not in g.unsplittable]
    weight = _weights(g)
    order = sorted(free, key=lambda c: (-weight[c], c))
    param_of = [[] for _ in range(g.num_classes)]
    for _, t in g.params:
        for c in g.tensors[t].classes:
            if c >= 0:
                param_of[c].append(t)
    mem_weight = 0.0
    for _ in range(8):
        axes = _recursive_pass(problem, list(axes), order, param_of, mem_weight, fixed)
        if memory_budget is None or _memory(problem, axes) <= memory_budget:
            return axes
        mem_weight = mem_weight * 10 if mem_weight else 1e-12
    return axes


def _weights(g: Graph) -> list[float]:
    """Bytes of all tensors carrying each class: how much splitting it can save."""
    weight = [0.0] * g.num_classes
    for t in g.tensors:
        for c in set(t.classes):
            if c >= 0:
                weight[c] += t.nbytes
    return weight


def _recursive_pass(problem, axes, order, param_of, mem_weight, fixed):
    sizes = problem.sizes
    for axis in sorted((a for a in sizes if sizes[a] > 1), key=lambda a: -sizes[a]):
        for _ in range(2):
            changed = False
            for c in order:
                if axis in axes[c] or problem.graph.class_sizes[c] % (
                        math.prod(sizes[a] for a in axes[c]) * sizes[axis]):
                    continue
                before = _local(problem, c, axes, param_of, mem_weight)
                old = axes[c]
                axes[c] = tuple(a for a in sizes if a in old or a == axis)
                if _local(problem, c, axes, param_of, mem_weight) < before:
                    changed = True
                else:
                    axes[c] = old
            if not changed:
                break
    return axes


def _local(problem: Problem, c: int, axes, param_of, mem_weight: float) -> float:
    total = 0.0
    for i in problem.class_ops[c]:
        t, m = problem.op_cost(i, axes)
        total += t + mem_weight * m
    for t in param_of[c]:
        a, m = problem.param_cost(t, axes)
        total += a + mem_weight * m
    return total


# --------------------------------------------------------------------------- propagation

def sharding_propagation(problem: Problem, fixed: Sequence[Axes | None],
                         memory_budget: float | None = None) -> list[Axes]:
    """Annotated classes keep their axes; the others, visited outward from them (breadth
    first over shared operators), take the value of least cost given the decided ones."""
    g = problem.graph
    doms = domains(g, problem.sizes)
    axes: list[Axes] = [() if f is None else f for f in fixed]
    decided = [f is not None for f in fixed]
    frontier = [c for c in range(g.num_classes) if decided[c]]
    seen = set(frontier)
    param_of = [[] for _ in range(g.num_classes)]
    for _, t in g.params:
        for c in g.tensors[t].classes:
            if c >= 0:
                param_of[c].append(t)
    weight = _weights(g)
    while frontier:
        nxt = []
        for c in frontier:
            for i in problem.class_ops[c]:
                for d in problem.op_classes[i]:
                    if d not in seen:
                        seen.add(d)
                        nxt.append(d)
        nxt.sort(key=lambda d: (-weight[d], d))       # heaviest first: the batch before a head dim
        for d in nxt:
            _choose(problem, d, axes, doms, decided, param_of)
        frontier = nxt
    for d in sorted(range(g.num_classes), key=lambda d: (-weight[d], d)):   # classes no annotation reaches
        if d not in seen:
            _choose(problem, d, axes, doms, decided, param_of)
    return axes


def _choose(problem, d, axes, doms, decided, param_of):
    best, best_cost = (), math.inf
    for v in doms[d]:
        axes[d] = v
        cost = _local(problem, d, axes, param_of, 0.0)
        if cost < best_cost - 1e-15:
            best, best_cost = v, cost
    axes[d] = best
    decided[d] = True


# The algorithms by the names jaxpar.config validates (one table of names).
SEARCHES = dict(zip(SEARCH_NAMES, (sharding_propagation, dynamic_programming, recursive_programming)))
