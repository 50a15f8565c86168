"""Sequence orders for causal load balance, and the work each device gets under them.

With a causal mask, contiguous shards give the last device of the context axis ``2·cp - 1``
times the unmasked scores of the first. Reordering the sequence once, where the batch is
placed, evens this out; the mask follows positions, so nothing else changes:

* ``"contiguous"``: device i holds tokens ``[i·S/cp, (i+1)·S/cp)`` (no reorder);
* ``"zigzag"``: the sequence in ``2·cp`` chunks, device i holds chunks i and ``2·cp - 1 - i``;
* ``"striped"``: device i holds tokens ``i, i + cp, i + 2·cp, ...``.
"""

from __future__ import annotations

import numpy as np

from jaxpar.config import CONTEXT_ORDERS

ORDERS = CONTEXT_ORDERS


def check_order(order: str, seq_len: int, cp: int) -> None:
    """``ValueError`` when ``seq_len`` cannot be laid out in ``order`` over ``cp`` devices."""
    if order not in ORDERS:
        raise ValueError(f"unknown sequence order {order!r}; use one of {ORDERS}")
    need = 2 * cp if order == "zigzag" else cp
    if seq_len % need:
        fix = "or order='striped' / 'contiguous'" if order == "zigzag" else "or a smaller context axis"
        raise ValueError(
            f"order={order!r} over a context axis of size {cp} needs a sequence length divisible by {need}"
            f"{' (2·cp)' if order == 'zigzag' else ''}, got {seq_len}; use a sequence length that is a multiple "
            f"of {need} (e.g. {seq_len + need - seq_len % need}) {fix}")


def permutation(order: str, seq_len: int, cp: int) -> np.ndarray:
    """``perm`` with ``reordered = x[..., perm]``: position ``j`` of the new order holds token ``perm[j]``.

    >>> permutation("zigzag", 8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    >>> permutation("striped", 8, 2).tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
    """
    check_order(order, seq_len, cp)
    index = np.arange(seq_len)
    if order == "contiguous":
        return index
    if order == "striped":
        return index.reshape(-1, cp).T.reshape(-1)
    chunks = index.reshape(2 * cp, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def inverse(perm: np.ndarray) -> np.ndarray:
    """The permutation that undoes ``perm`` (``x[perm][inverse(perm)] == x``).

    >>> inverse(np.array([2, 0, 1])).tolist()
    [1, 2, 0]
    """
    out = np.empty_like(perm)
    out[perm] = np.arange(len(perm))
    return out


def unmasked_blocks(order: str, seq_len: int, cp: int, block: int) -> np.ndarray:
    """Per device, the causal score tiles (``block × block``) with at least one unmasked entry.

    Each device's shard (in the reordered layout) is cut into tiles of ``block`` tokens, for
    queries and keys alike; a tile pair counts when some key position is <= some query
    position. This is the work a blockwise kernel that skips fully masked tiles does.

    >>> unmasked_blocks("contiguous", 16, 2, 4).tolist(), unmasked_blocks("zigzag", 16, 2, 4).tolist()
    ([3, 7], [5, 5])
    """
    per_device = seq_len // cp
    if block < 1 or per_device % block or (order == "zigzag" and (per_device // 2) % block):
        raise ValueError(f"unmasked_blocks: block={block} must divide the {per_device} tokens per device"
                         f"{' and the zigzag chunk' if order == 'zigzag' else ''} (seq_len={seq_len}, cp={cp})")
    tiles = permutation(order, seq_len, cp).reshape(-1, block)      # original positions per tile
    q_max, k_min = tiles.max(1), tiles.min(1)
    live = k_min[None, :] <= q_max[:, None]                          # [query tile, key tile]
    return live.sum(1).reshape(cp, -1).sum(1)


def balance(order: str, seq_len: int, cp: int, block: int | None = None) -> float:
    """max / mean of `unmasked_blocks` over devices: 1.0 is perfectly even causal work.

    ``block`` defaults to 1/16 of a zigzag chunk, fine enough to approach the limits:
    contiguous ``(2·cp - 1) / cp`` (1.875 at cp=8), zigzag 1.0.

    >>> round(balance("contiguous", 4096, 8), 3), balance("zigzag", 4096, 8)
    (1.872, 1.0)
    """
    block = block or max(1, seq_len // (2 * cp * 16))
    counts = unmasked_blocks(order, seq_len, cp, block)
    return float(counts.max() / counts.mean())


def describe_balance(seq_len: int, cp: int, block: int | None = None) -> str:
    """A small table: causal work per device (max/mean) for each order.

    >>> print(describe_balance(4096, 8))
    causal balance at seq_len=4096, cp=8 (max/mean unmasked score blocks per device):
      contiguous  1.872
      zigzag      1.000
      striped     1.000
    """
    lines = [f"causal balance at seq_len={seq_len}, cp={cp} (max/mean unmasked score blocks per device):"]
    lines += [f"  {order:<11} {balance(order, seq_len, cp, block):.3f}" for order in ORDERS]
    return "\n".join(lines)
