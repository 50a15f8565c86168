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

from jaxpar.config import SCHEDULES
from jaxpar.pipeline.drawing import grid, plot_timeline, timeline
from jaxpar.pipeline.table import (
    PLACEMENTS,
    Kind,
    Op,
    Schedule,
    asap,
    bubble_fraction,
    check_sizes,
    location,
    peak_activations,
    validate,
    virtual_stage,
)
from jaxpar.pipeline.vshape import dualpipe_v, zb_v

__all__ = [
    "Kind", "Op", "Schedule", "SCHEDULES", "PLACEMENTS", "build", "virtual_stage", "location", "gpipe",
    "one_f_one_b", "interleaved", "zb_h1", "bubble_fraction", "peak_activations", "validate", "grid", "timeline",
    "plot_timeline",
]


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
        return {"zb-v": zb_v, "dualpipe-v": dualpipe_v}[name](p, m)
    return BUILDERS[name](p, m)
