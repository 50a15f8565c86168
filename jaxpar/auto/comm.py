"""Collectives of a strategy, and how XLA combines the gradients' into few.

The cost model (`jaxpar.auto.cost`) lists one `Comm` per collective an operator needs. Most
run where they are issued, one after the other (a forward all-reduce feeds the next
operator; Megatron's ``dx`` all-reduce feeds the previous layer's backward), and each pays
its own latency. The rest are **combined**: XLA's all-reduce combiner (and its
reduce-scatter twin) merges collectives that do not depend on each other into one
tuple-shaped collective per group of mesh axes, so a group pays one latency per *bucket*:

* ``"grad"``: the all-reduce of a gradient of a parameter, or of a value computed from
  parameters alone (a reshape, a broadcast, a cast of one: `derivations`). Nothing but the
  optimizer reads it, so all of them can wait for one another. A parameter read by two
  operators is reduced once per reader: XLA keeps one buffer per use in the combined
  all-reduce rather than summing them first (measured: ``tests/test_auto_comm.py``).
* ``"tail"``: a forward all-reduce whose result the backward pass never reads (the loss's
  own mean over the batch): it joins the gradients' group.
* ``"norm"``: the optimizer's gradient-norm partial sums (one scalar per split parameter),
  a group of their own (they read the reduced gradients).

A bucket holds at most ``CostParams.combine_threshold_bytes`` bytes and
``CostParams.combine_threshold_count`` collectives. XLA's defaults: GPU 30 MiB
(``--xla_gpu_all_reduce_combine_threshold_bytes``, ``kDefaultAllReduceCombineThreshold`` =
30 MiB + 7 B) and 256 per combined collective; CPU no byte limit and 256 (`CostParams`
defaults to the GPU figure; `jaxpar.auto.calibrate` on a CPU mesh sets no limit). Inside a
loop (``lax.scan`` layers), the combiner works per iteration: a group there runs once per
iteration.

    >>> from jaxpar.auto import CostParams
    >>> comms = [Comm("all-reduce", ("data",), 4096.0, "grad", 1, t) for t in range(10)]
    >>> combined_time(comms, {"data": 8}, CostParams(latency=1e-5)).count   # one latency, not ten
    1
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxpar.auto.derivatives import LINEAR, derivative_reads

SERIAL, GRAD, TAIL, NORM = "", "grad", "tail", "norm"
_GROUP = {GRAD: GRAD, TAIL: GRAD, NORM: NORM}       # tails ride with the gradients
# operators whose derivative does not read their result (with `derivatives.LINEAR`)
_OUTPUT_FREE = ("dot_general", "ragged_dot_general", "conv_general_dilated", "gather", "mul", "div")


class Comm(NamedTuple):
    """One collective of a strategy (``nbytes``: per device, over all its ``runs``).

    ``combined``: ``""`` for a collective with its own latency, else the combined group it
    joins (``"grad"``, ``"tail"``, ``"norm"``; see the module docstring). ``runs``: how many
    times it runs per step (the trip count of an enclosing loop). ``tensor``: the value it
    carries (an operator's result: its forward collective; an operand: that operand's
    gradient; ``-1``: neither, never combined). ``level``: set by `levels`."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    combined: str = SERIAL
    runs: int = 1
    tensor: int = -1
    level: int = -1


class Combined(NamedTuple):
    """The price of a list of `Comm`: seconds, of which the gradients' groups take
    ``grad_s`` (tails left out), collectives paying a latency per step (``count``; of them,
    ``grad_count`` combined), bytes per step of the combined ones (``grad_bytes``)."""

    seconds: float
    grad_s: float
    count: int
    grad_count: int
    grad_bytes: float


def derivations(graph: Any, grad: Sequence[bool]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per tensor: ``source`` (the parameter it is computed from when it depends on
    parameters and constants alone: the parameter itself when one, else the tensor; ``-1``
    when it depends on the batch or on other state) and ``tail`` (the backward pass never
    reads it: each reader is linear in it or its derivative does not read it, and the
    reader's results are tails too; the loss is one).

    Example:
      >>> source, tail = derivations(graph, needs_grad(graph))      # doctest: +SKIP
    """
    output_free = (*LINEAR, *_OUTPUT_FREE)

    n = len(graph.tensors)
    source = [-1] * n
    params = {t for _, t in graph.params}
    inputs = {t for _, t in (*graph.batch, *graph.others)}
    produced = {t for op in graph.ops for t in op.outs}
    # parameters, and the jaxpr's constants (no producer, not an input): free of the batch
    free = [t in params or (t not in produced and t not in inputs) for t in range(n)]
    for t in params:
        source[t] = t
    for op in graph.ops:
        if not all(free[t] for t in op.ins if t >= 0):
            continue
        roots = {source[t] for t in op.ins if t >= 0 and source[t] >= 0}
        for t in op.outs:
            free[t] = True
            source[t] = next(iter(roots)) if len(roots) == 1 else (t if roots else -1)
    tail = [True] * n
    for op in reversed(graph.ops):
        if op.prim not in output_free:     # its derivative reads its result
            for t in op.outs:
                tail[t] = False
        later = all(tail[o] for o in op.outs)
        needed = () if op.prim in LINEAR else set(derivative_reads(op, grad))
        for t in op.ins:
            if t >= 0 and (not later or t in needed):
                tail[t] = False
    return tuple(source), tuple(tail)


def levels(graph: Any, per_op: Sequence[Sequence[Comm]]) -> list[Comm]:
    """The comms of every operator (``per_op[i]``: operator ``i``'s), each serial one with its
    *level*: how many serial collectives precede it on the longest chain of data dependence.
    Two collectives at one level do not depend on each other, so XLA's combiner merges them
    (the ``dx`` all-reduces of the q, k and v projections that read one activation; the
    forward all-reduces of those three projections).

    Forward: a value's depth is the largest depth of the operator's operands, plus one when
    the operator's result is all-reduced. Backward (mirror order, after every forward one):
    an operand's cotangent is complete once every reader's backward has run, plus one where
    that reader all-reduces it."""
    depth = [0] * len(graph.tensors)
    out: list[Comm] = []
    for op, comms in zip(graph.ops, per_op):
        d = max((depth[t] for t in op.ins if t >= 0), default=0)
        forward = [c for c in comms if not c.combined and c.tensor >= 0 and c.tensor in op.outs]
        out += [c._replace(level=d) for c in forward]
        for t in op.outs:
            depth[t] = d + bool(forward)
    base = max(depth, default=0) + 1
    ready = [base] * len(graph.tensors)    # level at which a value's cotangent is complete
    for op, comms in zip(reversed(graph.ops), reversed(per_op)):
        level = max((ready[t] for t in op.outs), default=base)
        for t in op.ins:
            if t >= 0:
                ready[t] = max(ready[t], level)
        for c in comms:
            if c.combined or c.tensor < 0:
                out.append(c)
            elif c.tensor not in op.outs:
                out.append(c._replace(level=level))
                ready[c.tensor] = max(ready[c.tensor], level + 1)
    return out


def buckets(nbytes: float, count: int, params: Any) -> int:
    """Combined collectives XLA makes of ``count`` collectives of ``nbytes`` in all."""
    if count <= 0:
        return 0
    by_bytes = math.ceil(nbytes / params.combine_threshold_bytes) if math.isfinite(
        params.combine_threshold_bytes) else 1
    return max(1, by_bytes, math.ceil(count / params.combine_threshold_count))


def combined_time(comms: Iterable[Comm], sizes: Mapping[str, int], params: Any) -> Combined:
    """Seconds of ``comms`` with the combined ones grouped into buckets (module docstring)."""
    seconds, count = 0.0, 0
    groups: dict[tuple, list[Comm]] = {}
    serial: dict[tuple, list[Comm]] = {}
    for c in comms:
        if math.prod(sizes[a] for a in c.axes) <= 1:
            continue
        seconds += params.collective_time(c.kind, c.axes, c.nbytes, sizes, True)
        if c.combined:
            groups.setdefault((_GROUP[c.combined], c.kind, c.axes, c.runs), []).append(c)
        elif c.level >= 0:     # independent collectives at one level: combined too
            serial.setdefault((c.level, c.kind, c.axes, c.runs), []).append(c)
        else:
            seconds += c.runs * params.latency_of(c.axes)
            count += c.runs
    for (_, _, axes, runs), members in serial.items():
        n, lat = _latency(members, axes, runs, params)
        seconds, count = seconds + lat, count + n
    grad_s, grad_count, grad_bytes = 0.0, 0, 0.0
    for (_, kind, axes, runs), members in groups.items():
        n, lat = _latency(members, axes, runs, params)
        seconds, count, grad_count = seconds + lat, count + n, grad_count + n
        grad_bytes += sum(c.nbytes for c in members)
        own = [c for c in members if c.combined != TAIL]     # the step's gradients alone
        if own:
            grad_s += _latency(own, axes, runs, params)[1] + sum(
                params.collective_time(kind, axes, c.nbytes, sizes, True) for c in own)
    return Combined(seconds, grad_s, count, grad_count, grad_bytes)


def _latency(members: Sequence[Comm], axes, runs: int, params: Any) -> tuple[int, float]:
    """(combined collectives, their latency seconds) of one group, per step."""
    n = runs * buckets(sum(c.nbytes for c in members) / runs, len(members), params)
    return n, n * params.latency_of(axes)


def comm_share(c: Comm, sizes: Mapping[str, int], params: Any) -> float:
    """Seconds of one `Comm` on its own, for the searches' per-operator sums: a combined
    one pays its share of its bucket's latency (``bytes / threshold + 1 / count limit`` of
    one), not a latency of its own."""
    if math.prod(sizes[a] for a in c.axes) <= 1:
        return 0.0
    seconds = params.collective_time(c.kind, c.axes, c.nbytes, sizes, True)
    if not c.combined:
        return seconds + c.runs * params.latency_of(c.axes)
    share = c.nbytes / c.runs / params.combine_threshold_bytes + 1 / params.combine_threshold_count
    return seconds + c.runs * share * params.latency_of(c.axes)
