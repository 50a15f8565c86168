"""V-shape schedules: two chunks per stage placed in a V (ZB-V, DualPipeV), as plain tables.

Stage ``s`` holds virtual stages ``s`` (chunk 0, ``a``) and ``2p-1-s`` (chunk 1, ``b``):
micro-batches go down the stages through chunk 0, turn on stage ``p-1`` without a transfer,
and come back up through chunk 1, so stage 0 both embeds and computes the loss. The backward
is split into ``B`` (input gradient) and ``W`` (weight gradient), ``F = B = W = 1`` tick of
one chunk (half a stage). See ``jaxpar.pipeline.schedules`` for the table conventions.
"""
from __future__ import annotations

from jaxpar.pipeline.table import Kind, Op, Schedule, asap, check_sizes

__all__ = ["zb_v", "zb_v_ticks", "dualpipe_v"]


def zb_v_ticks(p: int, m: int) -> int:
    """Length in ticks of ``zb_v(p, m)``, in closed form (derivation in ``zb_v``).

    Example:
        >>> [zb_v_ticks(2, 1), zb_v_ticks(4, 2), zb_v_ticks(4, 8)]
        [10, 21, 51]
    """
    check_sizes(p, m)
    return 6 * m + p - 1 + max(0, 2 * p - 2 - m, 3 * (p - m))


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024): zero-bubble V schedule at 1F1B's activation memory.

    Example:
        >>> from jaxpar.pipeline import bubble_fraction
        >>> bubble_fraction(zb_v(4, 8))       # 1F1B: 3/11, ZB-H1: 1/9
        Fraction(1, 17)

    Stage ``r`` runs the order of PyTorch's ``ScheduleZBVZeroBubble``: ``2(p-r)-1`` forwards
    of chunk ``a``, ``r`` pairs of forwards ``b a``, ``p-r`` times ``F B W`` on chunk ``b``;
    then the steady state ``F B W`` on ``a``, ``F B W`` on ``b`` per micro-batch; the
    cool-down runs the last input gradients first and the weight gradients after them, in the
    ticks where the pipeline would otherwise idle. Counts are clamped to ``m``, so any
    ``m >= 1`` works. Ticks ``T = 6m + p - 1 + max(0, 2p - 2 - m, 3(p - m))`` (``zb_v_ticks``):
    ``6m + p - 1`` for ``m >= 2p - 2``, bubble ``(p-1)/(6m+p-1)`` (only the warm-up of the
    last stage is left); ``5m + 3p - 3`` in between (the cool-down is not filled); and
    ``3m + 4p - 1`` for ``m <= (p+2)/2``, where one micro-batch's chain sets the length
    (``2p`` forwards, ``2p`` input gradients, the ``W`` stage ``p-1`` runs between its two
    ``B`` and the last ``W``: ``4p + 2`` ticks) and each further micro-batch adds 3. Every
    stage holds at most ``2p`` chunk activations until their W (``p`` stages' worth, 1F1B's
    first stage).
    ``p=2, m=4`` (chunk 0 = ``a``, chunk 1 = ``b``), bubble ``1/25``::

        tick     0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
        stage0 F0a F1a F2a F0b B0b W0b F1b B1b W1b F3a B0a W0a F2b B2b W2b B1a W1a F3b B3b W3b B2a W2a B3a W3a   .
        stage1   . F0a F0b F1a F1b B0b W0b F2a B0a W0a F2b B1b W1b F3a B1a W1a F3b B2b W2b B2a B3b B3a W2a W3b W3a
    """
    check_sizes(p, m)
    return asap("zb-v", p, m, 2, True, [_zb_v_order(r, p, m) for r in range(p)], placement="v")


def _zb_v_order(rank: int, p: int, m: int) -> list[Op]:
    """One stage's op order (see ``zb_v``); each op is skipped once its chunk ran ``m``."""
    order: list[Op] = []
    done = {(kind, chunk): 0 for kind in Kind for chunk in (0, 1)}

    def run(kind: Kind, chunk: int) -> None:
        i = done[(kind, chunk)]
        # past m there is nothing left to run; a W needs its own B first
        if i < m and (kind is not Kind.W or i < done[(Kind.B, chunk)]):
            order.append(Op(kind, i, chunk))
            done[(kind, chunk)] += 1

    for _ in range(2 * (p - rank) - 1):              # warm-up: chunk a down the V
        run(Kind.F, 0)
    for _ in range(rank):                            # a and b forwards
        run(Kind.F, 1)
        run(Kind.F, 0)
    for _ in range(p - rank):                        # the first backwards of chunk b
        for kind in (Kind.F, Kind.B, Kind.W):
            run(kind, 1)
    while done[(Kind.F, 1)] < done[(Kind.F, 0)] or done[(Kind.F, 0)] < m:   # steady state
        for chunk in (0, 1):
            for kind in (Kind.F, Kind.B, Kind.W):
                run(kind, chunk)
    for _ in range(rank):                            # cool-down: input gradients first
        run(Kind.B, 0)
        run(Kind.B, 1)
    for _ in range(p - rank):
        run(Kind.B, 0)
        run(Kind.W, 0)
    for chunk in (1, 0):                             # then the weight gradients left
        while done[(Kind.W, chunk)] < m:
            run(Kind.W, chunk)
    return order


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half): the V placement with its 8-phase order.

    Example:
        >>> from jaxpar.pipeline import peak_activations
        >>> peak_activations(dualpipe_v(4, 8), until="W")
        [9, 9, 9, 9]

    Each stage runs the op order of DeepSeek's reference ``dualpipev.py``: warm-up forwards
    of chunk ``a``, then ``a``/``b`` forwards, a zero-bubble section (``B`` then a held-back
    ``W``), the main phase pairing a forward of one chunk with a full backward (``B`` then
    ``W``) of the other — the pairs whose communication DualPipe overlaps with compute —, and
    the cool-down that drains the held-back ``W``. Needs ``m >= 2p``. With equal costs its
    table has ZB-V's bubble, ``(p-1)/(6m+p-1)``, and holds one more chunk activation per
    stage (``2p+1``); what the pairing buys is overlap of one op's communication with the
    other's compute, which a table of equal ticks does not show. ``p=2, m=4``, bubble ``1/25``::

        tick     0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
        stage0 F0a F1a F2a F0b B0b W0b F1b F3a B1b W1b F2b B0a W0a B2b W2b F3b B1a W1a B3b W3b B2a W2a   . B3a W3a
        stage1   . F0a F0b F1a F1b F2a B0b W0b F2b B0a W0a F3a B1b W1b F3b B1a W1a B2b W2b B2a W2a B3b B3a W3b W3a
    """
    check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipe-v needs microbatches >= 2 * stages = {2 * p}, got microbatches={m}; "
                         f"use microbatches={2 * p} or more, or schedule='zb-v'")
    return asap("dualpipe-v", p, m, 2, True, [_dualpipe_order(r, p, m) for r in range(p)], placement="v")


def _dualpipe_order(rank: int, p: int, m: int) -> list[Op]:
    """One stage's op order, phase by phase as in DeepSeek's ``dualpipev.py``."""
    order: list[Op] = []
    nxt = {(Kind.F, 0): 0, (Kind.F, 1): 0, (Kind.B, 0): 0, (Kind.B, 1): 0}
    held_w: list[Op] = []   # weight gradients held back by a zero-bubble backward, run first-in first-out

    def f(chunk: int) -> None:
        order.append(Op(Kind.F, nxt[(Kind.F, chunk)], chunk))
        nxt[(Kind.F, chunk)] += 1

    def b(chunk: int, zero_bubble: bool = False) -> None:
        i = nxt[(Kind.B, chunk)]
        nxt[(Kind.B, chunk)] += 1
        order.append(Op(Kind.B, i, chunk))
        (held_w.append if zero_bubble else order.append)(Op(Kind.W, i, chunk))

    def w() -> None:
        order.append(held_w.pop(0))

    for _ in range((p - rank - 1) * 2):              # 1: warm-up forwards of chunk a
        f(0)
    for _ in range(rank + 1):                        # 2: a and b forwards
        f(0)
        f(1)
    for _ in range(p - rank - 1):                    # 3: zero-bubble B, held W, forward b
        b(1, True)
        w()
        f(1)
    for _ in range(m - 2 * p + rank + 1):            # 4: main phase, forward one chunk + backward the other
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - rank - 1):                    # 5: backward b, forward b + backward a
        b(1)
        f(1)
        b(0)
    zero_bubble = False
    for i in range(rank + 1):                        # 6: backwards, the second half zero-bubble
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        b(1, zero_bubble)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        b(0, zero_bubble)
    for _ in range(p - rank - 1):                    # 7: held W, backward a (zero-bubble)
        w()
        b(0, True)
    while held_w:                                    # 8: the rest of the held W
        w()
    return order
