"""Parameters streamed into device memory one layer at a time (``offload="params"``).

With ``jaxpar.Placement(offload="params")`` the parameters live in ``pinned_host`` memory between
steps. For a model whose layers are stacked and run by ``scan`` (a block `find_blocks` finds
with ``"layers"`` as the first logical axis of every parameter), the stacked parameters stay
in host memory through the step as well: the block's class is swapped (as ``jaxpar.remat``
swaps it) for one whose ``__call__`` first moves the parameters of the layer it runs into
device memory, cast to the compute dtype. The scan slices the host arrays, so the device
holds one layer's copy at a time (XLA may fetch the next while the current one computes),
and the copy is named `STREAMED` and never saved for the backward, nor are the layout
operations that could carry it (`_not_weights`): the backward fetches the layer again. A block
recomputed by ``jaxpar.remat`` (the model's, or ``ParallelConfig.remat`` on the blocks) gets one
checkpoint whose policy is the recompute's and `_not_weights` both (`policy_for`), not two
nested ones: a checkpoint's policy applies to the checkpoints nested in it. A loss that reads a
streamed parameter outside its block (a penalty on the weights) is refused by the step. Each layer's
gradient goes back to host memory as the backward produces it (the transpose of the copy);
the step brings the gradients and the parameters into device memory for the update
(`jaxpar.train.step`). That is JAX's parameter-offloading pattern (the memory-spaces guide:
``jax.device_put`` inside the scanned layer function), applied to the model's own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.nn.blocks import module_at
from jaxpar.optim.offload import in_host_memory
from jaxpar.remat import checkpoint_policy, checkpointed_method

__all__ = ["STREAMED", "stream_blocks", "streamed_loss"]

STREAMED = "jaxpar_streamed"
"""The ``checkpoint_name`` of a layer's parameters fetched into device memory."""

# Layout and copy operations: whatever a layer derives from its weights this way (a reshape of a
# projection, a cast) is weight-sized, so it is recomputed from a fresh fetch, never saved.
_LAYOUT = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim", "squeeze",
                     "expand_dims", "copy", "copy_p", "device_put", "slice", "rev", "reduce_precision"})


def _not_weights(prim, *_, **params) -> bool:
    """The streaming checkpoint's policy: save what the layer computes except its fetched
    parameters (named `STREAMED`) and the layout operations that could carry them."""
    if prim.name == "name":
        return params.get("name") != STREAMED
    return prim.name not in _LAYOUT


def policy_for(recompute: str | None):
    """The one checkpoint policy of a streamed block: `_not_weights`, and where the block is
    recomputed (``recompute``: its ``jaxpar.remat`` policy name) what that policy saves too.
    One checkpoint, not two nested: a checkpoint's policy applies to the checkpoints nested in
    it, so an outer streaming checkpoint would override the block's recompute, and an outer
    recompute that saves everything (``"everything_saveable"``) would keep the fetched copies."""
    if recompute is None:
        return _not_weights
    user = checkpoint_policy(recompute)
    if user is None:                  # "full": nothing is saved, the fetch is recomputed with the rest
        return jax.checkpoint_policies.nothing_saveable

    def both(prim, *args, **params):
        return user(prim, *args, **params) if _not_weights(prim, *args, **params) else False

    return both


def fetch(x, dtype=None):
    """Inside ``jit``: ``x`` moved from host into device memory (cast to ``dtype`` when it is a
    float and ``dtype`` is given) and named `STREAMED`; ``x`` as it is when not in host memory."""
    if not in_host_memory(x):
        return x
    x = jax.device_put(x, jax.memory.Space.Device)
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(dtype)
    return checkpoint_name(x, STREAMED)


def stream_blocks(model: nnx.Module, paths: Sequence[str], dtype=None) -> nnx.Module:
    """``model`` with each block at ``paths`` fetching its host-resident parameters into device
    memory where it runs (its class changes; its variables and paths stay)."""
    for path in paths:
        module = module_at(model, path, "stream_blocks")
        module.__class__ = _stream_class(type(module), None if dtype is None else jnp.dtype(dtype))
    return model


def streamed_loss(loss_fn, paths: Sequence[str], dtype=None):
    """``loss_fn(model, batch, *rest)`` run on the model with the blocks at ``paths`` streamed
    (`stream_blocks` on the model it gets, merged inside the traced function)."""
    paths = tuple(paths)

    def with_streamed_blocks(model, batch, *rows):
        return loss_fn(stream_blocks(model, paths, dtype), batch, *rows)

    return with_streamed_blocks


_CLASSES: dict[tuple[type, object, str | None], type] = {}


def _stream_class(cls: type, dtype) -> type:
    """``cls`` streaming its parameters. A block recomputed by ``jaxpar.remat`` (by the model, or
    by the step for ``ParallelConfig.remat``) gets one checkpoint of both policies (`policy_for`)
    around its original ``__call__``."""
    cls = getattr(cls, "_jaxpar_stream_base", cls)
    recompute = getattr(cls, "_jaxpar_remat_policy", None)
    base = getattr(cls, "_jaxpar_remat_base", cls) if recompute is not None else cls
    key = (base, dtype, recompute)
    if key not in _CLASSES:
        policy = policy_for(recompute)

        def fetched(module, *args, **kwargs):
            # the values (nnx.state shares the variables, which the update below changes)
            stored = jax.tree.map(lambda x: x, nnx.state(module, nnx.Param))
            nnx.update(module, jax.tree.map(lambda x: fetch(x, dtype), stored))
            try:
                return base.__call__(module, *args, **kwargs)
            finally:
                nnx.update(module, stored)      # the host arrays, not the device copies, leave the call

        _CLASSES[key] = type(base.__name__, (base,), {
            "__call__": checkpointed_method(fetched, policy, prevent_cse=False), "_jaxpar_stream_base": cls,
            "__module__": base.__module__, "__qualname__": base.__qualname__})
    return _CLASSES[key]
