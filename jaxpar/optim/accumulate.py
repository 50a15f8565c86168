"""Gradient accumulation and multi-copy (interleaved) batches, inside one compiled step.

Both split the local batch into equal parts the same way (`split_batch`): part ``j`` holds
rows ``j, j + k, j + 2k, ...`` of the global batch. With the batch split over the data axes
in contiguous blocks, every device then holds ``1/k`` of its own rows in each part: no data
moves between devices, and every part stays split over the same axes.

* `accumulate_grads` (``grad_accum=k``, MindSpore ``GradAccumulation``): a ``lax.scan``
  over the ``k`` parts; the carry holds the gradient sum (laid out as the ZeRO plan's
  gradient specs, i.e. sharded over the data axis at optimizer level ≥ 2, MindSpore's
  ``gradient_accumulation_shard``) and the non-parameter state. One optimizer update
  follows. For a loss that is a mean over the batch, the result equals one step on the
  whole batch: mean of ``k`` equal-sized means = the mean.
* `interleave_loss` (``interleave=n``, MindSpore ``MicroBatchInterleaved``): the loss of
  the ``n`` parts, unrolled one after another in the same program (not a loop), so the
  scheduler can overlap the collectives of one part with the compute of the next.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.data import split_rows


def split_batch(batch, k: int, constrain: Callable = lambda x: x):
    """Every leaf ``[B, ...]`` → ``[k, B/k, ...]``; part ``j`` holds rows ``j::k``.

    ``constrain`` pins the split tree (e.g. to ``P(None, "data", ...)``)."""

    return constrain(jax.tree.map(lambda x: split_rows(x, k), batch))


def mean_parts(aux):
    """The parts' aux values (each leaf stacked on a leading parts axis) as one: float leaves
    averaged, integer leaves the last part's. What `accumulate_grads` and `interleave_loss`
    do with aux unless given another ``combine_aux``.

    >>> mean_parts({"f": jnp.array([1.0, 2.0]), "i": jnp.array([3, 4])})["f"].item()
    1.5
    """
    return jax.tree.map(lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1], aux)


def accumulate_grads(compute_grads: Callable, k: int, *, constrain_grads: Callable = lambda g: g,
                     constrain_parts: Callable = lambda b: b, dtype=None,
                     combine_aux: Callable = mean_parts) -> Callable:
    """``compute_grads(params, rest, batch) -> (loss, aux, rest, grads)`` over ``k`` parts.

    Returns a function of the same signature whose loss and gradients are the means over the
    parts and whose aux is ``combine_aux`` of the parts' (stacked on a leading axis; the default
    `mean_parts`: float values averaged, integer values the last part's). The running sum is
    kept in ``dtype`` (``None``: the parameters' dtypes)."""
    if k == 1:
        return compute_grads

    def run(params, rest, batch):
        parts = split_batch(batch, k, constrain_parts)
        zeros = constrain_grads(jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), params))

        def body(carry, part):
            acc, rest = carry
            loss, aux, rest, grads = compute_grads(params, rest, part)
            acc = constrain_grads(jax.tree.map(jnp.add, acc, grads))
            return (acc, rest), (loss, aux)

        (acc, rest), (losses, aux) = jax.lax.scan(body, (zeros, rest), parts)
        grads = constrain_grads(jax.tree.map(lambda g: g / k, acc))
        return losses.mean(), combine_aux(aux), rest, grads

    return run


def interleave_loss(compute_loss: Callable, n: int, *, constrain_parts: Callable = lambda b: b,
                    combine_aux: Callable = mean_parts) -> Callable:
    """``compute_loss(params, rest, batch) -> (loss, (aux, rest))`` over ``n`` unrolled parts:
    the mean loss, and ``combine_aux`` of the parts' aux (as in `accumulate_grads`)."""
    if n == 1:
        return compute_loss

    def run(params, rest, batch):
        parts = split_batch(batch, n, constrain_parts)
        losses, auxes = [], []
        for j in range(n):
            loss, (aux, rest) = compute_loss(params, rest, jax.tree.map(lambda x: x[j], parts))
            losses.append(loss)
            auxes.append(aux)
        aux = combine_aux(jax.tree.map(lambda *xs: jnp.stack(xs), *auxes)) if auxes[0] is not None else None
        return sum(losses) / n, (aux, rest)

    return run
