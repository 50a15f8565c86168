"""The stage layout: stacked layers ``[L, ...]`` ↔ ``[p·v, L/(p·v), ...]``, one row per chunk.

Sharding the leading axis of the stage layout over the pipe axis gives each stage exactly
its chunks, for the loop and the V placement (``jaxpar.pipeline.schedules``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401  (the doctests use it)
import numpy as np

from jaxpar.pipeline.schedules import virtual_stage

__all__ = ["to_stage_layout", "from_stage_layout"]


def _stage_rows(stages: int, virtual_stages: int, placement: str) -> np.ndarray:
    """Row ``s·v + c`` of the stage layout holds virtual stage ``rows[s·v + c]``."""
    return np.array([virtual_stage(placement, stages, s, c)
                     for s in range(stages) for c in range(virtual_stages)])


def to_stage_layout(tree: Any, stages: int, virtual_stages: int = 1, placement: str = "loop") -> Any:
    """Stacked layers ``[L, ...]`` → stage layout ``[p·v, L/(p·v), ...]``.

    Row ``s·v + c`` holds chunk ``c`` of stage ``s``: virtual stage ``c·p + s`` for the loop
    placement (``s, s+p, ...``), ``s`` and ``2p-1-s`` for the V placement (see
    ``jaxpar.pipeline.schedules``), so sharding the leading axis over the pipe axis gives
    each stage exactly its chunks.

    Example:
        >>> to_stage_layout(jnp.arange(8), 2, 2)[:, 0].tolist()  # chunks 0,2 | 1,3
        [0, 4, 2, 6]
        >>> to_stage_layout(jnp.arange(8), 2, 2, "v")[:, 0].tolist()  # chunks 0,3 | 1,2
        [0, 6, 2, 4]
    """
    pv = stages * virtual_stages
    rows = _stage_rows(stages, virtual_stages, placement)

    def one(a):
        if a.shape[0] % pv:
            raise ValueError(f"a stacked layer axis of size {a.shape[0]} does not split into "
                             f"stages*virtual_stages={pv} equal chunks; use a multiple of {pv}")
        return a.reshape(pv, a.shape[0] // pv, *a.shape[1:])[rows]

    return jax.tree.map(one, tree)


def from_stage_layout(tree: Any, stages: int, virtual_stages: int = 1, placement: str = "loop") -> Any:
    """Inverse of ``to_stage_layout``: ``[p·v, n, ...]`` → stacked layers ``[p·v·n, ...]``."""
    order = np.argsort(_stage_rows(stages, virtual_stages, placement))
    return jax.tree.map(lambda a: a[order].reshape(-1, *a.shape[2:]), tree)
