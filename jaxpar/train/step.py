"""The compiled training step: loss → gradients → optimizer update, as one XLA program.

``build_train_step`` returns a pure function ``(params, rest, opt_state, batch) -> (params, rest,
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

from jaxpar.strategy import spec_axes


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
        # Fresh Variables for the non-parameter state, so the loss may update it in this trace
        # (e.g. dropout advancing its RNG count).
        rest = jax.tree.map(lambda x: x, rest)
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


def make_hybrid_grads(graphdef, loss_fn: Callable, mesh, specs: tuple, batch_axes: tuple[str, ...],
                      reduce: Callable, grad_specs, wrap_local: Callable = lambda f: f,
                      gather: Callable = lambda params: params) -> Callable:
    """Hybrid mode, gradients reduced by jaxpar: ``(params, rest, batch) -> (loss, aux, rest, grads)``.

    The gradients are taken per device (the parameters are made varying over the batch axes
    first, so nothing is reduced implicitly), then ``reduce(grads)`` averages them over the
    batch axes into ``grad_specs`` inside the same ``shard_map``: bucketed all-reduces
    (``comm_fusion``) and/or reduce-scatters to the ZeRO shards. ``wrap_local`` wraps the
    per-device loss ``(params, rest, batch) -> (loss, (aux, rest))`` (e.g. recompute, parts);
    ``gather`` runs first inside it (ZeRO-3: all-gather the parameter shards), so recompute
    gathers again in the backward."""
    param_specs, rest_specs, batch_specs = specs

    def local_loss(params, rest, batch):
        model = nnx.merge(graphdef, gather(params), rest)
        loss, aux = split_loss_output(loss_fn(model, batch))
        return loss, (aux, rest)

    local_loss = wrap_local(local_loss)

    def varying(x, spec):
        # a parameter is varying over the mesh axes of its spec, invariant over the others
        missing = tuple(a for a in batch_axes if a not in {b for e in spec for b in spec_axes(e)})
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def local(params, rest, batch):
        grad_fn = jax.value_and_grad(lambda p: local_loss(p, rest, batch), has_aux=True)
        (loss, (aux, _)), grads = grad_fn(jax.tree.map(varying, params, param_specs))
        mean = (lambda x: jax.lax.pmean(x, batch_axes)) if batch_axes else (lambda x: x)
        return mean(loss), jax.tree.map(mean, aux), reduce(grads) if batch_axes else grads

    def compute(params, rest, batch):
        loss, aux, grads = jax.shard_map(
            local, mesh=mesh, in_specs=(param_specs, rest_specs, batch_specs),
            out_specs=(PartitionSpec(), PartitionSpec(), grad_specs), check_vma=True,
        )(params, rest, batch)
        return loss, aux, rest, grads

    return compute


def value_and_grads(compute_loss: Callable) -> Callable:
    """``compute_loss`` → ``(params, rest, batch) -> (loss, aux, rest, grads)``."""

    def compute(params, rest, batch):
        (loss, (aux, rest)), grads = jax.value_and_grad(compute_loss, has_aux=True)(params, rest, batch)
        return loss, aux, rest, grads

    return compute


def build_train_step(compute_grads: Callable, tx: optax.GradientTransformation, *,
                     enter: Callable = lambda params, opt_state: (params, opt_state)) -> Callable:
    """One optimizer step: ``compute_grads(params, rest, batch) -> (loss, aux, rest, grads)``,
    then ``tx``. ``enter`` runs first (e.g. moves host-offloaded state into device memory)."""

    def step(params, rest, opt_state, batch):
        params, opt_state = enter(params, opt_state)
        loss, aux, rest, grads = compute_grads(params, rest, batch)
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
