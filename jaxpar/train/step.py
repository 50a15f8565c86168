"""The compiled training step: loss → gradients → optimizer update, as one XLA program.

``build_step`` returns a pure function ``(params, rest, opt_state, batch) -> (params, rest,
opt_state, metrics)``; the ``Trainer`` jits it with the plan's shardings. In modes ``"data"``
and ``"semi_auto"`` the loss runs under the compiler's sharding propagation; in ``"hybrid"``
the user's loss runs per device inside ``jax.shard_map`` and jaxpar averages it over the
batch axes, so gradients of replicated parameters are reduced by the transpose of the
implicit broadcast (``check_vma=True`` keeps this exact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec


def split_loss_output(out) -> tuple[jax.Array, Any]:
    """``loss_fn`` may return a scalar or ``(loss, aux)``."""
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if not hasattr(loss, "shape") or loss.shape != ():
        raise ValueError(
            f"loss_fn must return a scalar loss (or (loss, aux)); got shape {getattr(loss, 'shape', type(loss))}"
        )
    return loss, aux


def make_loss(graphdef, loss_fn: Callable) -> Callable:
    """``(params, rest, batch) -> (loss, (aux, new_rest))`` for the merged model."""

    def compute(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        loss, aux = split_loss_output(loss_fn(model, batch))
        return loss, (aux, nnx.state(model, nnx.Not(nnx.Param)))

    return compute


def make_hybrid_loss(graphdef, loss_fn: Callable, mesh, specs: tuple, batch_axes: tuple[str, ...]) -> Callable:
    """The user's loss run per device in ``shard_map``, averaged over the batch axes."""
    param_specs, rest_specs, batch_specs = specs

    def local(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        loss, aux = split_loss_output(loss_fn(model, batch))
        mean = (lambda x: jax.lax.pmean(x, batch_axes)) if batch_axes else (lambda x: x)
        return mean(loss), jax.tree.map(mean, aux)

    def compute(params, rest, batch):
        loss, aux = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(param_specs, rest_specs, batch_specs),
            out_specs=(PartitionSpec(), PartitionSpec()),
            check_vma=True,
        )(params, rest, batch)
        return loss, (aux, rest)

    return compute


def build_step(compute_loss: Callable, tx: optax.GradientTransformation) -> Callable:
    """One optimizer step on one batch."""

    def step(params, rest, opt_state, batch):
        grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
        (loss, (aux, rest)), grads = grad_fn(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if aux is not None:
            metrics["aux"] = aux
        return params, rest, opt_state, metrics

    return step


def build_eval(compute_loss: Callable) -> Callable:
    def evaluate(params, rest, batch):
        loss, (aux, _) = compute_loss(params, rest, batch)
        return loss

    return evaluate
