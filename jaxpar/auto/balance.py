"""Balancing pipeline stages: modules of a ``StagedLoss`` split so the slowest stage is fastest.

Each module's cost is the cost model's time of its forward and backward on one micro-batch
(``3 ×`` the forward FLOPs over ``CostParams.flops_per_s``); the embedding adds to the first
stage and the head with its loss to the last. The modules stay in order, so a split is a list
of cut points, and ``jaxpar.pipeline.stages.best_split`` finds the one whose largest stage
cost is least.
"""
from __future__ import annotations

import re
from typing import Any

import jax
from flax import nnx

from jaxpar.auto.cost import CostParams
from jaxpar.pipeline.stages import StagedLoss, best_split, named_modules

__all__ = ["balance_stages", "module_costs"]


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))


def module_costs(model: nnx.Module, loss: StagedLoss, batch: Any, microbatches: int = 1,
                 cost_params: CostParams | None = None) -> tuple[list[str], list[float], float, float]:
    """``(paths, seconds per module, embedding seconds, head seconds)`` for one micro-batch.

    Example:
        >>> paths, costs, first, last = module_costs(model, loss, batch)   # doctest: +SKIP
    """
    _check_microbatches(batch, microbatches)
    params = cost_params or CostParams()
    micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // microbatches,) + a.shape[1:], a.dtype),
                         batch)
    seconds = lambda flops: 3 * flops / params.flops_per_s  # noqa: E731  forward + backward (2×)

    def cost(part, fn, *args):
        graphdef, state = nnx.split(part)
        return seconds(_flops(lambda s, *a: fn(nnx.merge(graphdef, s), *a), state, *args))

    x = jax.eval_shape(lambda: loss.embed_inputs(loss.embedding(model), micro))
    x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    modules = named_modules(model, loss.order)
    costs = [cost(module, lambda m, h: m(h), x) for _, module in modules]
    first = cost(loss.embedding(model), loss.embed_inputs, micro)
    last = cost(loss.head(model), loss.head_loss, x, micro)
    return [path for path, _ in modules], costs, first, last


def _check_microbatches(batch: Any, microbatches: int) -> None:
    """A ``ValueError`` unless ``microbatches`` is a positive int dividing every leaf's rows."""
    rows = sorted({int(a.shape[0]) for a in jax.tree.leaves(batch)})
    if (not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1
            or any(r % microbatches for r in rows)):
        raise ValueError(f"module_costs: microbatches={microbatches!r} must be a positive int dividing the batch's "
                         f"leading dimension (rows {rows}); use a divisor of {rows[0] if rows else 'the batch'}")


def balance_stages(model: nnx.Module, loss: StagedLoss, batch: Any, stages: int,
                   cost_params: CostParams | None = None, *, microbatches: int = 1) -> dict[str, int]:
    """``StagedLoss.stages`` for ``stages`` virtual stages, the largest stage cost least.

    Returns one exact pattern per module path, so ``dataclasses.replace(loss, stages=...)``
    uses it as is.

    Example:
        >>> split = balance_stages(model, loss, batch, 2, COSTS)    # doctest: +SKIP
        >>> loss = dataclasses.replace(loss, stages=split)           # doctest: +SKIP
    """
    if not isinstance(loss, StagedLoss):
        raise TypeError(f"balance_stages needs a jaxpar.pipeline.StagedLoss, got {type(loss).__name__}")
    count = len(named_modules(model, loss.order))     # checked before compiling every module
    if not isinstance(stages, int) or isinstance(stages, bool) or not 1 <= stages <= count:
        raise ValueError(f"balance_stages: stages={stages!r} must be an int from 1 to the {count} modules "
                         f"of StagedLoss.order {list(loss.order)} (each virtual stage holds at least one); "
                         f"pass pipeline stages × chunks per stage")
    paths, costs, first, last = module_costs(model, loss, batch, microbatches, cost_params)
    where = best_split(costs, stages, first, last)
    return {re.escape(path): k for path, k in zip(paths, where)}
