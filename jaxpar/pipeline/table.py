"""A pipeline schedule as data: its ops, its table of ticks × stages, the simulator that fills
a table from each stage's order of ops (`asap`), and what is read off a table (`bubble_fraction`,
`peak_activations`, `validate`).

The builders (``jaxpar.pipeline.schedules``, ``jaxpar.pipeline.vshape``) and the drawings
(``jaxpar.pipeline.drawing``) build on this module; the cost convention and the placements are
described in ``jaxpar.pipeline.schedules``, which re-exports every name here.
"""
from __future__ import annotations

import dataclasses
import enum
from fractions import Fraction

__all__ = [
    "Kind", "Op", "Schedule", "PLACEMENTS", "virtual_stage", "location", "check_sizes", "asap",
    "bubble_fraction", "peak_activations", "validate",
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
    """The virtual stage ``k`` that ``chunk`` of ``stage`` runs (see `jaxpar.pipeline.schedules`).

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


# --------------------------------------------------------------------------- derived


def bubble_fraction(schedule: Schedule) -> Fraction:
    """Idle cells / (stages × ticks), exact (see `jaxpar.pipeline.schedules` for the costs)."""
    idle = sum(op is None for row in schedule.table for op in row)
    return Fraction(idle, schedule.stages * schedule.ticks)


def peak_activations(schedule: Schedule, *, until: str = "B") -> list[int]:
    """Per stage, the most micro-batch chunks held at once: their F has started, their B not ended.

    ``until="W"`` counts a micro-batch until its weight gradient ends instead (what a
    split-backward executor really keeps: W needs the stage input and the output gradient).
    For interleaved schedules the unit is one chunk's activations (``1/v`` of a stage's).

    Example:
        >>> from jaxpar.pipeline.schedules import build
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
