"""Pipeline schedules as plain data: a table of ticks × stages, built by pure functions.

No JAX here: a schedule is a value that can be printed, tested and diffed without devices.
The executor (``jaxpar.pipeline.executor``) lowers any table to one compiled program.

Cost convention (all bubble fractions in this module use it):

- one tick is the time of one forward of one model chunk (``F = 1``);
- schedules whose backward is one op (GPipe, 1F1B, interleaved) draw ``B`` over 2 ticks:
  the input gradient and the weight gradient together cost twice a forward;
- split-backward schedules (ZB-H1) cost ``B = 1`` (input gradient) and ``W = 1`` (weight
  gradient);
- with ``v`` virtual stages a tick is one chunk's forward, ``1/v`` of a full stage's;
- sending a result to a neighbour takes no tick of its own: an op that runs in ticks
  ``[a, b)`` can be consumed from tick ``b`` on (the executor sends it with a
  ``ppermute`` at the end of the tick where it was computed).

With these costs, ``bubble_fraction`` = idle cells / (stages × ticks) equals the closed
forms exactly: GPipe and 1F1B ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v·m+p-1)`` and
ZB-H1 ``(p-1)/(3m+p-1)`` (for ``m >= p``; fewer micro-batches than stages is allowed but
leaves ZB-H1 nothing to fill its bubble with).

A schedule's ``placement`` says which stage (device) holds which virtual stage ``k``
(``k = 0`` takes the inputs, ``k = p·v-1`` computes the loss):

- ``"loop"``: ``k = chunk·p + stage``: micro-batch data runs through chunk 0 of stages
  ``0..p-1``, then chunk 1 of stages ``0..p-1``, and so on (GPipe, 1F1B, interleaved, ZB-H1);
- ``"v"``: odd chunks run the other way, ``k = chunk·p + (p-1-stage)``: with two chunks stage
  ``s`` holds ``s`` and ``2p-1-s``, so the turn ``p-1 → p`` stays on stage ``p-1`` and both
  the first and the last virtual stage live on stage 0 (ZB-V, DualPipeV).

Example:
    >>> s = build("1f1b", 2, 3)
    >>> print(timeline(s))
    1f1b  p=2 m=3 v=1  ticks=12  bubble=1/4  peak activations per stage=[2, 1]
    tick    0  1  2  3  4  5  6  7  8  9 10 11
    stage0 F0 F1  .  . B0 B0 F2 B1 B1  . B2 B2
    stage1  . F0 B0 B0 F1 B1 B1 F2 B2 B2  .  .
"""
from __future__ import annotations

import dataclasses
import enum
from fractions import Fraction

from jaxpar.config import SCHEDULES

__all__ = [
    "Kind", "Op", "Schedule", "SCHEDULES", "PLACEMENTS", "build", "virtual_stage", "location", "gpipe",
    "one_f_one_b", "interleaved", "zb_h1", "bubble_fraction", "peak_activations", "validate", "timeline", "plot_timeline",
]


class Kind(enum.Enum):
    """What a stage does in a tick; an idle cell of a table is ``None``."""

    F = "F"  # forward of one micro-batch through one chunk
    B = "B"  # backward: input gradient (and weight gradient when there is no W)
    W = "W"  # weight gradient, split from B (zero-bubble schedules)


@dataclasses.dataclass(frozen=True)
class Op:
    """One unit of work: ``kind`` for ``microbatch`` on model ``chunk`` of a stage."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def label(self, virtual_stages: int = 1) -> str:
        """``F3``, or ``F3b`` (chunk 1) when there are several virtual stages."""
        suffix = chr(ord("a") + self.chunk) if virtual_stages > 1 else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"


Table = tuple[tuple["Op | None", ...], ...]
PLACEMENTS = ("loop", "v")


def virtual_stage(placement: str, p: int, stage: int, chunk: int) -> int:
    """The virtual stage ``k`` that ``chunk`` of ``stage`` runs (see the module docstring).

    Example:
        >>> [virtual_stage("v", 4, s, 1) for s in range(4)]
        [7, 6, 5, 4]
    """
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - stage
    return chunk * p + stage


def location(placement: str, p: int, k: int) -> tuple[int, int]:
    """``(stage, chunk)`` holding virtual stage ``k``; the inverse of ``virtual_stage``.

    Example:
        >>> location("v", 4, 4), location("loop", 4, 4)
        ((3, 1), (0, 1))
    """
    chunk, stage = divmod(k, p)
    if placement == "v" and chunk % 2:
        stage = p - 1 - stage
    return stage, chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """A pipeline schedule: ``table[tick][stage]`` is the ``Op`` that stage runs, or ``None``.

    An op that costs ``c`` ticks (see ``cost``) fills ``c`` consecutive cells of its stage;
    ``placement`` (``"loop"`` or ``"v"``) maps a stage's chunks to virtual stages.
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    table: Table
    placement: str = "loop"

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into ``B`` (input grad) and ``W`` (weight grad)."""
        return any(op is not None and op.kind is Kind.W for row in self.table for op in row)

    def cost(self, kind: Kind) -> int:
        """Ticks one op of ``kind`` takes (see the module docstring)."""
        return 2 if kind is Kind.B and not self.split_backward else 1

    def ops(self, stage: int) -> list[tuple[int, Op]]:
        """``(start tick, op)`` for every op of ``stage``, in time order."""
        out: list[tuple[int, Op]] = []
        for t, row in enumerate(self.table):
            op = row[stage]
            # A run of equal cells is one op; a run longer than the op's cost is several.
            if op is not None and not (out and out[-1][1] == op
                                       and t - out[-1][0] < self.cost(op.kind)):
                out.append((t, op))
        return out


# --------------------------------------------------------------------------- checks


def check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("stages", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {name} must be an integer >= 1, got {value!r}")


# --------------------------------------------------------------------------- dependencies


def _deps(op: Op, stage: int, p: int, v: int, placement: str = "loop") -> list[tuple[int, Op]]:
    """``(stage, op)`` pairs that must finish before ``op`` may start on ``stage``."""
    i, c = op.microbatch, op.chunk
    k = virtual_stage(placement, p, stage, c)
    if op.kind is Kind.F:
        if k == 0:
            return []
        s, c_prev = location(placement, p, k - 1)
        return [(s, Op(Kind.F, i, c_prev))]
    if op.kind is Kind.W:
        return [(stage, Op(Kind.B, i, c))]
    deps = [(stage, Op(Kind.F, i, c))]
    if k < p * v - 1:
        s, c_next = location(placement, p, k + 1)
        deps.append((s, Op(Kind.B, i, c_next)))
    return deps


def _all_ops(m: int, v: int, split: bool, forward: bool = False) -> list[Op]:
    kinds = (Kind.F,) if forward else (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    return [Op(k, i, c) for k in kinds for i in range(m) for c in range(v)]


# --------------------------------------------------------------------------- simulation


def asap(name: str, p: int, m: int, v: int, split: bool, orders: list[list[Op]],
          placement: str = "loop") -> Schedule:
    """Each stage runs its own list of ops in order, each as early as its dependencies allow."""
    cost = {Kind.F: 1, Kind.B: 1 if split else 2, Kind.W: 1}
    end: dict[tuple[int, Op], int] = {}
    placed: list[tuple[int, int, Op]] = []
    position, free = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                deps = _deps(op, s, p, v, placement)
                if any(d not in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                end[(s, op)] = free[s] = start + cost[op.kind]
                placed.append((start, s, op))
                position[s], progress = position[s] + 1, True
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError(f"pipeline schedule {name!r} deadlocked; this is a bug in jaxpar")
    table: list[list[Op | None]] = [[None] * p for _ in range(max(free, default=0))]
    for start, s, op in placed:
        for t in range(start, start + cost[op.kind]):
            table[t][s] = op
    return Schedule(name=name, stages=p, microbatches=m, virtual_stages=v,
                    table=tuple(tuple(row) for row in table), placement=placement)


# --------------------------------------------------------------------------- builders


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards, then all backwards; every stage holds all ``m`` micro-batches.

    ``p=4, m=4`` (``B`` takes 2 ticks); bubble ``(p-1)/(m+p-1) = 3/7``::

        tick    0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20
        stage0 F0 F1 F2 F3  .  .  .  .  .  .  .  .  . B0 B0 B1 B1 B2 B2 B3 B3
        stage1  . F0 F1 F2 F3  .  .  .  .  .  . B0 B0 B1 B1 B2 B2 B3 B3  .  .
        stage2  .  . F0 F1 F2 F3  .  .  . B0 B0 B1 B1 B2 B2 B3 B3  .  .  .  .
        stage3  .  .  . F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3  .  .  .  .  .  .
    """
    check_sizes(p, m)
    orders = [[Op(Kind.F, i) for i in range(m)] + [Op(Kind.B, i) for i in range(m)]
              for _ in range(p)]
    return asap("gpipe", p, m, 1, False, orders)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): after ``p-1-s`` warm-up forwards, stage ``s`` alternates F and B.

    Same bubble as GPipe, ``(p-1)/(m+p-1)``, but stage ``s`` holds at most ``p-s`` micro-batch
    activations instead of ``m``. Any ``m >= 1`` works (``m < p`` degenerates to GPipe).
    ``p=4, m=6``, bubble ``3/9``, peak activations ``[4, 3, 2, 1]``::

        tick    0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
        stage0 F0 F1 F2 F3  .  .  .  .  .  . B0 B0 F4 B1 B1 F5 B2 B2  . B3 B3  . B4 B4  . B5 B5
        stage1  . F0 F1 F2  .  .  .  . B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3  . B4 B4  . B5 B5  .  .
        stage2  .  . F0 F1  .  . B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4  . B5 B5  .  .  .  .
        stage3  .  .  . F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5  .  .  .  .  .  .
    """
    check_sizes(p, m)
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        order = [Op(Kind.F, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Op(Kind.F, warm + i), Op(Kind.B, i)]
        order += [Op(Kind.B, i) for i in range(m - warm, m)]
        orders.append(order)
    return asap("1f1b", p, m, 1, False, orders)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron interleaved 1F1B: each stage holds ``v`` model chunks (virtual stages).

    Stage ``s`` holds chunks ``s, s+p, s+2p, ...`` of the model. Micro-batches move through
    the chunks in groups of ``p``, so ``m`` must be a multiple of ``p``. A tick is one chunk's
    forward (``1/v`` of a stage's); bubble ``(p-1)/(v·m+p-1)``. ``p=4, m=8, v=2``
    (chunk 0 = ``a``, chunk 1 = ``b``), bubble ``3/19`` against 1F1B's ``3/11``::

        tick     0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18
        stage0 F0a F1a F2a F3a F0b F1b F2b F3b F4a F5a F6a   .   .   . B0b B0b F7a B1b B1b
        stage1   . F0a F1a F2a F3a F0b F1b F2b F3b F4a   .   . B0b B0b F5a B1b B1b F6a B2b
        stage2   .   . F0a F1a F2a F3a F0b F1b F2b   . B0b B0b F3b B1b B1b F4a B2b B2b F5a
        stage3   .   .   . F0a F1a F2a F3a F0b B0b B0b F1b B1b B1b F2b B2b B2b F3b B3b B3b
        tick    19  20  21  22  23  24  25  26  27  28  29  30  31  32  33  34  35  36  37
        stage0   . F4b B2b B2b F5b B3b B3b F6b B0a B0a F7b B1a B1a B2a B2a   . B3a B3a   .
        stage1 B2b F7a B3b B3b F4b B0a B0a F5b B1a B1a F6b B2a B2a F7b B3a B3a   . B4b B4b
        stage2 B3b B3b F6a B0a B0a F7a B1a B1a F4b B2a B2a F5b B3a B3a F6b B4b B4b F7b B5b
        stage3 F4a B0a B0a F5a B1a B1a F6a B2a B2a F7a B3a B3a F4b B4b B4b F5b B5b B5b F6b
        tick    38  39  40  41  42  43  44  45  46  47  48  49  50  51  52  53  54  55  56
        stage0 B4b B4b   . B5b B5b   . B6b B6b   . B7b B7b B4a B4a B5a B5a B6a B6a B7a B7a
        stage1   . B5b B5b   . B6b B6b   . B7b B7b B4a B4a B5a B5a B6a B6a B7a B7a   .   .
        stage2 B5b   . B6b B6b   . B7b B7b B4a B4a B5a B5a B6a B6a B7a B7a   .   .   .   .
        stage3 B6b B6b F7b B7b B7b B4a B4a B5a B5a B6a B6a B7a B7a   .   .   .   .   .   .
    """
    check_sizes(p, m, v)
    if m % p:
        lo, hi = (m // p) * p, -(-m // p) * p
        fix = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(
            f"interleaved schedule needs microbatches to be a multiple of stages "
            f"(micro-batches go through each chunk in groups of p={p}), got microbatches={m}; "
            f"use microbatches={fix}, or schedule='1f1b'")
    return asap("interleaved", p, m, v, False, _megatron_orders(p, m, v))


def _megatron_orders(p: int, m: int, v: int) -> list[list[Op]]:
    def op(kind: Kind, k: int) -> Op:
        chunk = (k % (p * v)) // p
        return Op(kind, (k // (p * v)) * p + k % p, chunk if kind is Kind.F else v - 1 - chunk)

    total, orders = m * v, []
    for s in range(p):
        warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [op(Kind.F, k) for k in range(warm)]
        for k in range(total - warm):
            order += [op(Kind.F, warm + k), op(Kind.B, k)]
        order += [op(Kind.B, k) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2024): backward split into ``B`` (input grad) and ``W``.

    Stage ``s`` runs ``p-s`` warm-up forwards, then for each micro-batch ``j``: ``B_j``, the
    ``W`` that is ``s`` micro-batches behind, and the next forward; the ``W`` it held back run
    at the end, where 1F1B would idle. Bubble ``(p-1)/(3m+p-1)`` with ``F = B = W = 1`` (for
    ``m >= p``), a third of 1F1B's; stage ``s`` holds at most ``p-s`` micro-batches awaiting
    ``B`` and at most ``p`` awaiting ``W``, as much as 1F1B's first stage. ``p=4, m=8``,
    bubble ``3/27`` against 1F1B's ``3/11``::

        tick    0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
        stage0 F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
        stage1  . F0 F1 F2  .  . B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
        stage2  .  . F0 F1  . B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
        stage3  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
    """
    check_sizes(p, m)
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order, next_w = [Op(Kind.F, i) for i in range(warm)], 0
        for j in range(m):
            order.append(Op(Kind.B, j))
            if j >= s:
                order.append(Op(Kind.W, next_w))
                next_w += 1
            if warm + j < m:
                order.append(Op(Kind.F, warm + j))
        orders.append(order + [Op(Kind.W, i) for i in range(next_w, m)])
    return asap("zb-h1", p, m, 1, True, orders)


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}
V_SCHEDULES = ("zb-v", "dualpipe-v")   # built by jaxpar.pipeline.vshape; two chunks per stage


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``) for ``p`` stages, ``m`` micro-batches.

    ``v`` (virtual stages per stage) is only for ``"interleaved"``; the others need ``v=1``
    (the V schedules ``"zb-v"`` and ``"dualpipe-v"`` always place two chunks per stage).

    Example:
        >>> build("gpipe", 4, 8).ticks
        33
    """
    if name not in BUILDERS and name not in V_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {list(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ValueError(
            f"schedule {name!r} has one chunk per stage, got virtual_stages={v}; "
            f"use virtual_stages=1, or schedule='interleaved'")
    if name in V_SCHEDULES:
        from jaxpar.pipeline import vshape  # lazy: vshape builds on this module's simulator

        return {"zb-v": vshape.zb_v, "dualpipe-v": vshape.dualpipe_v}[name](p, m)
    return BUILDERS[name](p, m)


# --------------------------------------------------------------------------- derived


def bubble_fraction(schedule: Schedule) -> Fraction:
    """Idle cells / (stages × ticks), exact (see the module docstring for the costs)."""
    idle = sum(op is None for row in schedule.table for op in row)
    return Fraction(idle, schedule.stages * schedule.ticks)


def peak_activations(schedule: Schedule, *, until: str = "B") -> list[int]:
    """Per stage, the most micro-batch chunks held at once: their F has started, their B not ended.

    ``until="W"`` counts a micro-batch until its weight gradient ends instead (what a
    split-backward executor really keeps: W needs the stage input and the output gradient).
    For interleaved schedules the unit is one chunk's activations (``1/v`` of a stage's).

    Example:
        >>> peak_activations(build("1f1b", 4, 8))
        [4, 3, 2, 1]
    """
    if until not in ("B", "W"):
        raise ValueError(f"peak_activations until must be 'B' or 'W', got {until!r}")
    last = Kind.W if until == "W" and schedule.split_backward else Kind.B
    peaks = []
    for s in range(schedule.stages):
        events = []
        for start, op in schedule.ops(s):
            if op.kind is Kind.F:
                events.append((start, 1))
            elif op.kind is last:
                events.append((start + schedule.cost(op.kind), -1))
        held = peak = 0
        for _, delta in sorted(events):  # a release at tick t sorts before an F starting at t
            held += delta
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def validate(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless ``schedule`` is complete and respects every dependency.

    Rules, with ``end = start + cost`` and virtual stage ``k`` from the placement:
    every ``(kind, micro-batch, chunk)`` runs exactly once on every stage, filling ``cost``
    consecutive cells; ``F`` on virtual stage ``k`` starts at or after the ``F`` of the same
    micro-batch ends on ``k-1``; ``B`` on ``k`` starts at or after the ``B`` ends on ``k+1``
    and after its own ``F`` ends; ``W`` starts at or after its own ``B`` ends. A schedule has
    ``W`` ops for every micro-batch or for none; a forward-only table (evaluation) has only ``F``.
    """
    p, m, v, split = (schedule.stages, schedule.microbatches, schedule.virtual_stages,
                      schedule.split_backward)
    forward = not any(op is not None and op.kind is not Kind.F for row in schedule.table for op in row)
    if any(len(row) != p for row in schedule.table):
        raise ValueError(f"schedule {schedule.name!r}: every tick needs {p} cells")
    start, end = {}, {}
    for s in range(p):
        _check_stage_ops(schedule, s, start, end)
        missing = set(_all_ops(m, v, split, forward)) - {op for (st, op) in start if st == s}
        if missing:
            raise ValueError(f"schedule {schedule.name!r}: stage {s} never runs "
                             f"{sorted(o.label(v) for o in missing)}")
    for (s, op), t in sorted(start.items(), key=lambda item: (item[1], item[0][0])):
        for dep in _deps(op, s, p, v, schedule.placement):
            if dep not in end or end[dep] > t:
                raise ValueError(
                    f"schedule {schedule.name!r}: {op.label(v)} on stage {s} starts at tick {t} "
                    f"before {dep[1].label(v)} on stage {dep[0]} ends (tick {end.get(dep)})")


def _check_stage_ops(schedule: Schedule, s: int, start: dict, end: dict) -> None:
    v = schedule.virtual_stages
    for t, op in schedule.ops(s):
        if (s, op) in start:
            raise ValueError(f"schedule {schedule.name!r}: {op.label(v)} runs twice on stage {s}")
        if not (0 <= op.microbatch < schedule.microbatches and 0 <= op.chunk < v):
            raise ValueError(f"schedule {schedule.name!r}: {op.label(v)} is out of range")
        cells = schedule.table[t:t + schedule.cost(op.kind)]
        if len(cells) < schedule.cost(op.kind) or any(r[s] != op for r in cells):
            raise ValueError(f"schedule {schedule.name!r}: {op.label(v)} on stage {s} at tick "
                             f"{t} must fill {schedule.cost(op.kind)} consecutive ticks")
        start[(s, op)], end[(s, op)] = t, t + schedule.cost(op.kind)


# The drawings read the derived values above; re-exported here, their historical home.
from jaxpar.pipeline.drawing import grid, plot_timeline, timeline  # noqa: E402,F401
