"""Recompute (activation checkpointing) policies by name, for a whole function or a module.

A policy decides which intermediate values of the forward pass are *saved* for the
backward pass; everything else is recomputed there (``jax.checkpoint``):

================================  ===================================================
name                              saves
================================  ===================================================
``"none"``                        everything (no recompute; no ``jax.checkpoint``)
``"full"``                        nothing but the inputs (recompute the whole forward)
``"nothing_saveable"``            same as ``"full"``
``"everything_saveable"``         everything (checkpoint boundary, no recompute)
``"dots_saveable"``               matmul outputs; elementwise work is recomputed
``"dots_with_no_batch_dims_saveable"``  matmuls without batch dims (weights × activations)
``"dots_except_mlp"``              the attention's matmuls (query, key, value and output
                                  projections) and its output; the MLP is recomputed
``"dots_except_mlp_in"``           the attention's projections and the MLP's output
                                  projection; the MLP's input projections and the
                                  attention itself are recomputed
``"save_collectives"``            only results of collectives (psum, all_gather, ...):
                                  recompute compute, never communication
``"everything_except_collectives"``  everything but collective results (they are redone)
================================  ===================================================

``"offload_dots"`` (matmul outputs moved to host memory) was removed with host offload: it
made the step 1.88x slower on a GPU (see ``docs/offload.md``); it is refused naming what to use.

The two ``dots_except_*`` policies save values by name (``jax.ad_checkpoint.checkpoint_name``):
the models of ``jaxpar.models`` name them (``query_proj``, ``key_proj``, ``value_proj`` or a
fused ``qkv_proj``, ``context``, ``out_proj``, ``mlp_in``, ``mlp_out``); in a model of your own,
name the same values, or these policies find nothing to save and recompute everything. They
save less than ``"dots_saveable"`` (a large model's MLP matmuls are most of its activations)
and recompute less than ``"full"``.

The collective policies see collectives that are explicit in the program (``shard_map``
code, ``mode="hybrid"``, the ``jaxpar.ops`` operators); collectives that XLA inserts
during sharding propagation do not exist yet when the policy runs.

On CPU, XLA undoes recompute in straight-line (unrolled) code: the memory saving shows
only when the recomputed region is the body of a loop, e.g. scanned layers
(``GPTConfig(scan_layers=True)``). On GPU and TPU it works in both.

``ParallelConfig.remat`` applies its policy to each of the model's repeated blocks
(``jaxpar.nn.blocks.find_blocks``: the scan body of stacked layers, or each unrolled layer),
the way ``remat(model.blocks, policy)`` does: around the whole loss XLA keeps a scan's
stacked activations.

Example:
  >>> block_fn = remat(lambda block, x: block(x), "dots_saveable")      # doctest: +SKIP
  >>> model.blocks = remat(model.blocks, "full")                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxpar.deprecation import check_policy

# JAX and Flax are imported where they are used: the package face binds `jaxpar.remat` (the
# function) from this module, and `import jaxpar` must not import JAX (the launcher does not).


def _jax():
    import jax

    return jax

COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant", "all_to_all",
    "ppermute", "reduce_scatter", "psum_scatter", "ragged_all_to_all",
})


# the attention's projections, as the models of jaxpar.models name them (`checkpoint_name`)
ATTENTION_NAMES = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj")


def _is_collective(prim, *_, **__) -> bool:
    return prim.name in COLLECTIVES


def _save_collectives(prim, *_, **__) -> bool:
    return _is_collective(prim)


def _everything_except_collectives(prim, *_, **__) -> bool:
    return not _is_collective(prim)


_POLICIES: dict[str, Callable[[], Any]] = {
    "full": lambda: None,
    "nothing_saveable": lambda: _jax().checkpoint_policies.nothing_saveable,
    "everything_saveable": lambda: _jax().checkpoint_policies.everything_saveable,
    "dots_saveable": lambda: _jax().checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": lambda: _jax().checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_except_mlp": lambda: _jax().checkpoint_policies.save_only_these_names(*ATTENTION_NAMES, "context"),
    "dots_except_mlp_in": lambda: _jax().checkpoint_policies.save_only_these_names(*ATTENTION_NAMES, "mlp_out"),
    "save_collectives": lambda: _save_collectives,
    "everything_except_collectives": lambda: _everything_except_collectives,
}
POLICY_NAMES = ("none", *_POLICIES)


def checkpoint_policy(name: str):
    """The ``jax.checkpoint`` policy for ``name`` (``None`` = save nothing, for ``"full"``)."""
    check_policy(name, f"jaxpar.remat policy {name!r}")
    if name not in _POLICIES:
        raise ValueError(f"remat policy {name!r} is unknown; choose one of {POLICY_NAMES}")
    return _POLICIES[name]()


def remat(fn_or_module, policy: str = "full"):
    """Recompute ``fn_or_module`` in the backward pass, saving what ``policy`` allows.

    * a function (it may take NNX modules as arguments): returns the wrapped function;
    * an ``nnx.Module`` instance: changes its class to a subclass whose ``__call__`` is
      recomputed, and returns it. Its variables, their paths and the plan stay the same,
      and it keeps working inside ``nnx.scan`` / ``nnx.vmap`` (scanned layers):
      ``model.blocks = jaxpar.remat(model.blocks, "full")``.

    ``policy="none"`` returns ``fn_or_module`` unchanged.

    Example:
      >>> f = remat(lambda x: jnp.sin(jnp.sin(x)), "full")
      >>> float(jax.grad(f)(0.0))
      1.0
    """
    if policy == "none":
        checkpoint_policy("full")   # nothing to wrap, but still a known name
        return fn_or_module
    from flax import nnx

    pol = checkpoint_policy(policy)
    if isinstance(fn_or_module, nnx.Module):
        module = fn_or_module
        module.__class__ = _remat_class(type(module), policy)
        return module
    if not callable(fn_or_module):
        raise TypeError(f"remat expects a function or an nnx.Module, got {type(fn_or_module).__name__}")
    return nnx.remat(fn_or_module, policy=pol)


_CLASSES: dict[tuple[type, str], type] = {}


def checkpointed_method(method: Callable, policy) -> Callable:
    """A ``__call__`` that runs ``method(self, *args, **kwargs)`` under ``nnx.remat`` with
    ``policy``: arrays (and pytrees of them) go through the checkpoint; other arguments (hooks,
    flags) are closed over as constants."""
    def __call__(self, *args, **kwargs):
        import jax
        from flax import nnx

        is_data = [all(hasattr(x, "dtype") for x in jax.tree.leaves(a)) for a in args]
        data = [a for a, d in zip(args, is_data) if d]

        def call(module, *data_args):
            it = iter(data_args)
            return method(module, *[next(it) if d else a for a, d in zip(args, is_data)], **kwargs)

        return nnx.remat(call, policy=policy)(self, *data)

    return __call__


def _remat_class(cls: type, policy: str) -> type:
    base = getattr(cls, "_jaxpar_remat_base", cls)
    key = (base, policy)
    if key not in _CLASSES:
        _CLASSES[key] = type(base.__name__, (base,), {
            "__call__": checkpointed_method(base.__call__, checkpoint_policy(policy)), "_jaxpar_remat_base": base, "_jaxpar_remat_policy": policy,
            "__module__": base.__module__, "__qualname__": base.__qualname__})
    return _CLASSES[key]
