"""The LM head's matmul: logits accumulated and returned in fp32, its gradient in the inputs' dtype.

Differentiating ``einsum(x_bf16, w_bf16, preferred_element_type=f32)`` hands the two gradient
matmuls an fp32 cotangent, so XLA runs them as fp32 (TF32) GEMMs: on an H200, for a Llama-1B step
(16,384 tokens x vocab 128,256) those two took 61.6 of 266 ms (``benchmarks/gpu_probe.py``'s
profile, ``benchmarks/results/gpu_probe_h200.json``). `head_logits` keeps the fp32 logits that
the loss needs and casts the cotangent of the logits back to the inputs' dtype before the two
gradient matmuls (accumulated in fp32), as a bf16 head with fp32 loss math does in MaxText and
torchtitan. With fp32 inputs it is exactly the plain einsum and its gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.strategy import match_varying


def head_logits(x: jax.Array, table: jax.Array, *, tied: bool) -> jax.Array:
    """fp32 logits ``[..., vocab]`` of hidden states ``x [..., embed]``.

    ``table`` is the embedding table ``[vocab, embed]`` (``tied=True``) or the head kernel
    ``[embed, vocab]``; it is cast to ``x``'s dtype, and its gradient comes back in its own.

    >>> x = jnp.ones((2, 3, 4), jnp.bfloat16)
    >>> head_logits(x, jnp.ones((4, 10)), tied=False).dtype
    dtype('float32')
    """
    # inside a shard_map (hybrid's per-device loss, a pipeline's last stage) both operands vary
    # alike, so the custom_vjp returns each gradient with its input's type (jaxpar.strategy.match_varying)
    return _head(bool(tied), *match_varying(x, table.astype(x.dtype)))


def _spec(tied: bool) -> str:
    return "...e,ve->...v" if tied else "...e,ev->...v"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(tied, x, w):
    return jnp.einsum(_spec(tied), x, w, preferred_element_type=jnp.float32)


def _head_fwd(tied, x, w):
    return _head(tied, x, w), (x, w)


def _head_bwd(tied, res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...v,ve->...e" if tied else "...v,ev->...e", g, w, preferred_element_type=jnp.float32)
    xs, gs = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = jnp.einsum("tv,te->ve" if tied else "tv,te->ev", gs, xs, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_head.defvjp(_head_fwd, _head_bwd)
