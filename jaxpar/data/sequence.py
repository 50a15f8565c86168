"""Context parallel batches: the sequence dimension split over the context axes, reordered once.

With ``ParallelConfig.context`` set, `jaxpar.data.place_batch` splits dimension 1 of every
``[B, S, ...]`` leaf over the context axes and, for a causal load-balancing order
(``"zigzag"`` / ``"striped"``), permutes that dimension once on the host. It adds
``batch["positions"]``: each token's position in the original order (restarting at every
segment when the batch has ``segment_ids``), so rotary embeddings and the attention mask see
the original sequence; the mean loss does not depend on the order of tokens.

A batch that already has ``"positions"`` is taken as already ordered and left alone (a batch
placed once and stepped on again is not reordered twice).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpar.config import ParallelConfig
from jaxpar.ops.context_order import check_order, permutation
from jaxpar.strategy import mesh_sizes


def context_axes(config: ParallelConfig, mesh) -> tuple[str, ...]:
    """The mesh axes the sequence dimension is split over (empty without ``config.context``)."""
    return () if config.context is None else config.context.axes


def context_size(config: ParallelConfig, mesh) -> int:
    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for a in context_axes(config, mesh))


def _run_starts(segment_ids: np.ndarray) -> np.ndarray:
    """True where a run of equal segment ids begins, per row."""
    return np.concatenate([np.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Host version of the model's ``segment_positions``: positions restart at each segment.

    >>> segment_positions(np.array([[1, 1, 2, 2, 2]])).tolist()
    [[0, 1, 0, 1, 2]]
    """
    index = np.broadcast_to(np.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = _run_starts(segment_ids)
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def check_segments(segment_ids: np.ndarray) -> None:
    """Each segment id must be one contiguous run in its row: the mask compares positions, which
    restart at every run, so a reused id would let a token see a later run's tokens."""
    for row, (ids, first) in enumerate(zip(segment_ids, _run_starts(segment_ids))):
        runs = ids[first]
        if len(np.unique(runs)) != len(runs):
            values, counts = np.unique(runs, return_counts=True)
            raise ValueError(f"context parallel: segment_ids row {row} uses segment id(s) {values[counts > 1].tolist()} "
                             f"in more than one run ({runs.tolist()}); give every packed sequence of a row its own id "
                             "(e.g. 1, 2, 3, ... in order)")


def reorder_batch(config: ParallelConfig, mesh, batch: Any) -> Any:
    """``batch`` with ``"positions"`` added and its sequence dimension in ``config.context.order``.

    Every ``[B, S, ...]`` leaf (``S`` = the length of ``batch["inputs"]``) is permuted along
    dimension 1. Raises ``ValueError`` when ``S`` does not fit the order (zigzag: a multiple
    of ``2·cp``).
    """
    return reorder_sequence(config.context, mesh, batch)


def reorder_sequence(context, mesh, batch: Any) -> Any:
    """`reorder_batch` by a ``ContextConfig`` (``None``: no context axis, ``batch`` as it is)."""
    if context is None or (isinstance(batch, Mapping) and "positions" in batch):
        return batch
    if not isinstance(batch, Mapping) or "inputs" not in batch:
        if context.order == "contiguous":
            return batch
        raise ValueError(f"context.order={context.order!r} reorders the sequence of batch['inputs'], but the "
                         f"batch is a {type(batch).__name__} without 'inputs'; give a dict with 'inputs' [batch, "
                         "length] (and the other [batch, length] leaves), or use context.order='contiguous'")
    inputs = np.asarray(batch["inputs"])
    if inputs.ndim < 2:
        raise ValueError(f"context parallel needs batch['inputs'] [batch, length], got shape {inputs.shape}")
    b, s = inputs.shape[:2]
    sizes = mesh_sizes(mesh)
    cp = math.prod(sizes[a] for a in context.axes)
    check_order(context.order, s, cp)
    segs = batch.get("segment_ids")
    if segs is not None:
        check_segments(np.asarray(segs))
    positions = (np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)) if segs is None
                 else segment_positions(np.asarray(segs)).astype(np.int32))
    perm = permutation(context.order, s, cp)
    out = {k: _permute(np.asarray(v), perm, s) for k, v in batch.items()}
    out["positions"] = np.ascontiguousarray(positions[:, perm])
    return out


def _permute(x: np.ndarray, perm: np.ndarray, s: int) -> np.ndarray:
    return np.ascontiguousarray(x[:, perm]) if x.ndim >= 2 and x.shape[1] == s else x
