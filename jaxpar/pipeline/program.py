"""A schedule table lowered to lock-step integer instructions for the executor (no JAX here).

Each step every stage receives up to three messages of each direction — from the stage
before it on the ring (``NEXT``: sent with ``s → s+1``), from the stage after it (``PREV``:
sent with ``s → s-1``) and from itself (``SELF``: the V's turn on stage ``p-1``) — writes
each into a buffer slot named by the instruction, then runs one op. Which channels a
placement uses is known from the table, so a loop placement moves activations one way and
gradients the other, as before, and a V placement uses both ways plus the local turn.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.pipeline.schedules import Kind, Op, Schedule, asap, location, validate, virtual_stage

__all__ = ["Program", "lower", "forward_only", "CHANNELS"]

# Branch codes of the per-step op; the "last" variants run on the last virtual stage, which
# applies the loss instead of sending activations on.
IDLE, F, F_LAST, B, B_LAST, W, W_LAST = range(7)
# Columns of the instruction table: the op, then one receive slot per (direction, channel).
OP, MB, CHUNK, X_SLOT, G_SLOT, FROM_INPUT, DX_MB = range(7)
CHANNELS = ("next", "prev", "self")   # next: from stage s-1 (sent s → s+1); prev: from s+1
RECV_X = {c: 7 + i for i, c in enumerate(CHANNELS)}
RECV_G = {c: 10 + i for i, c in enumerate(CHANNELS)}
COLUMNS = 13


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule lowered to lock-step instructions.

    ``code[step, stage]`` holds ``OP, MB, CHUNK, X_SLOT, G_SLOT, FROM_INPUT, DX_MB`` and the
    receive slots ``RECV_X[channel]``, ``RECV_G[channel]``. A stage writes the activation
    that arrived on each channel into its ``RECV_X`` slot (``x_slots`` = nowhere) and each
    gradient into its ``RECV_G`` slot, then runs ``OP`` on micro-batch ``MB`` of chunk
    ``CHUNK`` reading its input from slot ``X_SLOT`` (or from the pipeline inputs when
    ``FROM_INPUT``) and its output gradient from ``G_SLOT``; an input gradient of virtual
    stage 0 lands in row ``DX_MB`` (``microbatches`` = nowhere). ``sends_x`` / ``sends_g``:
    the channels activations / gradients travel on.
    """

    code: np.ndarray
    x_slots: int
    g_slots: int
    split_backward: bool
    sends_x: tuple[str, ...] = ("next",)
    sends_g: tuple[str, ...] = ("prev",)
    forward_only: bool = False

    @property
    def steps(self) -> int:
        return self.code.shape[0]


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, each stage taking them in the order their inputs can arrive.

    What evaluation and inference run: no backward, no activations kept past the next stage.

    Example:
        >>> from jaxpar.pipeline.schedules import build
        >>> forward_only(build("1f1b", 4, 8)).ticks
        11
    """
    p, where = schedule.stages, schedule.placement

    def ready(op: Op, s: int) -> tuple[int, int]:   # the tick its input could arrive at the earliest
        k = virtual_stage(where, p, s, op.chunk)
        return op.microbatch + k, -k

    orders = [sorted((op for _, op in schedule.ops(s) if op.kind is Kind.F), key=lambda op: ready(op, s))
              for s in range(p)]
    return asap(f"{schedule.name}-forward", schedule.stages, schedule.microbatches, schedule.virtual_stages,
                 False, orders, schedule.placement)


def lower(schedule: Schedule) -> Program:
    """Turn ``schedule`` into a ``Program``: one step per tick where some stage starts an op.

    A result computed at step ``k`` reaches its consumer at step ``k+1``; a validated table
    never uses it sooner. Buffer slots are reused as soon as their item's last reader ran.

    Example:
        >>> from jaxpar.pipeline.schedules import build
        >>> prog = lower(build("1f1b", 4, 8))
        >>> prog.steps, prog.x_slots
        (30, 4)
    """
    validate(schedule)
    p, m = schedule.stages, schedule.microbatches
    start = {(s, op): t for s in range(p) for t, op in schedule.ops(s)}
    ticks = sorted(set(start.values()))
    step_of = {t: k for k, t in enumerate(ticks)}
    step = {key: step_of[t] for key, t in start.items()}
    code = np.zeros((len(ticks), p, COLUMNS), np.int32)
    code[:, :, DX_MB] = m
    x_items, g_items = _buffer_items(schedule, step)
    x_slot, x_slots = _allocate(x_items, p)
    g_slot, g_slots = _allocate(g_items, p)
    for channel in CHANNELS:
        code[:, :, RECV_X[channel]], code[:, :, RECV_G[channel]] = x_slots, g_slots
    for items, slot, column in ((x_items, x_slot, RECV_X), (g_items, g_slot, RECV_G)):
        for key, (arrive, _, channel) in items.items():
            code[arrive, key[0], column[channel]] = slot[key]
    for (s, op), k in step.items():
        _fill(code[k, s], op, s, schedule, x_slot, g_slot)
    forward = not any(op.kind is not Kind.F for _, op in start)
    return Program(code, x_slots, g_slots, schedule.split_backward,
                   tuple(sorted({c for _, _, c in x_items.values()}, key=CHANNELS.index)),
                   tuple(sorted({c for _, _, c in g_items.values()}, key=CHANNELS.index)), forward)


def _fill(row: np.ndarray, op: Op, s: int, schedule: Schedule, x_slot: dict, g_slot: dict) -> None:
    p, v, i, c = schedule.stages, schedule.virtual_stages, op.microbatch, op.chunk
    k = virtual_stage(schedule.placement, p, s, c)
    first, last = k == 0, k == p * v - 1
    base = {Kind.F: F, Kind.B: B, Kind.W: W}[op.kind]
    row[OP] = base + 1 if last else base
    row[MB], row[CHUNK] = i, c
    row[FROM_INPUT] = first
    row[X_SLOT] = x_slot.get((s, i, c), 0)
    row[G_SLOT] = g_slot.get((s, i, c), 0)
    if op.kind is Kind.B and first:
        row[DX_MB] = i


def _channel(src: int, dst: int, p: int) -> str:
    if dst == src:
        return "self"
    if dst == (src + 1) % p:
        return "next"
    if dst == (src - 1) % p:
        return "prev"
    raise ValueError(f"pipeline placement sends from stage {src} to stage {dst}, which is not a neighbour "
                     f"on the ring of {p} stages; the executor only moves data between neighbours")


def _buffer_items(schedule: Schedule, step: dict) -> tuple[dict, dict]:
    """``(stage, mb, chunk) -> (arrival step, last use step, channel)`` for inputs and out-grads."""
    p, v, where = schedule.stages, schedule.virtual_stages, schedule.placement
    kinds = {op.kind for _, op in step}
    last_kind = Kind.W if Kind.W in kinds else Kind.B if Kind.B in kinds else Kind.F
    x_items, g_items = {}, {}
    for (s, op), k in step.items():
        i, vs = op.microbatch, virtual_stage(where, p, s, op.chunk)
        if op.kind is Kind.F and vs < p * v - 1:      # sends to the next virtual stage
            to_s, to_c = location(where, p, vs + 1)
            x_items[(to_s, i, to_c)] = (k + 1, step[(to_s, Op(last_kind, i, to_c))], _channel(s, to_s, p))
        if op.kind is Kind.B and vs > 0:              # sends to the previous one
            to_s, to_c = location(where, p, vs - 1)
            g_items[(to_s, i, to_c)] = (k + 1, step[(to_s, Op(last_kind, i, to_c))], _channel(s, to_s, p))
    return x_items, g_items


def _allocate(items: dict, p: int) -> tuple[dict, int]:
    """Give each item a slot of its stage's buffer, free again after its last use."""
    slot, size = {}, 0
    for s in range(p):
        busy_until: list[int] = []  # per slot, the last step it is read
        for key, (arrive, last, _) in sorted(
                ((k, span) for k, span in items.items() if k[0] == s), key=lambda kv: kv[1][:2]):
            free = [j for j, until in enumerate(busy_until) if until < arrive]
            j = free[0] if free else len(busy_until)
            busy_until[j:j + 1] = [last]
            slot[key] = j
        size = max(size, len(busy_until))
    return slot, size
