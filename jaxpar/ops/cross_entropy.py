"""LM head + softmax cross-entropy in token chunks, never holding the full ``[tokens, vocab]`` logits.

The materialised loss computes ``logits = h @ W`` for every token at once (16,384 tokens ×
a 128,256 vocabulary is 8 GiB in fp32), then the softmax, then in the backward pass the
logits' gradient ``softmax - onehot`` of the same size. `chunked_cross_entropy` cuts the
sequence into ``chunks`` strided groups of tokens and runs them one after another in a
``lax.scan``, so only one chunk's logits ``[tokens / chunks, vocab]`` live at a time.

It costs no recompute: the gradient of a chunk's loss is known as soon as its logits are
(``softmax - onehot``), so when the loss is differentiated the forward pass of the
``jax.custom_vjp`` also computes, chunk by chunk, the gradient wrt the hidden states
``dh = g @ Wᵀ`` and accumulates the gradient wrt the head ``dW += hᵀ @ g`` in fp32; the
backward pass only scales them by the loss's cotangent. Three matmuls, as the materialised
loss does. The primal alone (evaluation, no gradient) computes only the loss::

    h [B, S, E] ──reshape──► [chunks, B, S/chunks, E] ──scan──► per chunk:
        logits = h_c @ W (fp32)      lse, target logit   g = (softmax - onehot) · weight
        loss  += Σ weight · (lse - target)
        dh_c   = g @ Wᵀ              dW += h_cᵀ @ g  (fp32)

Chunks are strided (chunk ``j`` holds positions ``j, j + chunks, ...``), so a split of the
batch over data axes or of the sequence over a context axis stays a split of every chunk;
a head split over the vocabulary (``rules["vocab"]``) stays split too: the logits, ``g`` and
``dW`` are pinned by the ``"vocab"`` logical axis, and only per-token sums cross devices.
A sequence length not divisible by ``chunks`` is padded with masked tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.strategy import manual_axes, match_varying, mesh_sizes

__all__ = ["chunked_cross_entropy"]


def _no_constraint(x, names):
    return x


def chunked_cross_entropy(x: jax.Array, table: jax.Array, targets: jax.Array, *, chunks: int,
                          mask: jax.Array | None = None, tied: bool = False,
                          constrain: Callable = _no_constraint) -> jax.Array:
    """Mean softmax cross-entropy of the logits ``x @ table`` against ``targets``, in ``chunks``.

    Equal to ``optax.softmax_cross_entropy_with_integer_labels(logits, targets)`` averaged over
    the tokens where ``mask`` is true (all tokens when ``mask`` is None; 0 when none is), with
    ``logits = einsum(x, table.astype(x.dtype), preferred_element_type=float32)``, and so are
    its gradients wrt ``x`` and ``table``.

    Args:
      x: the final-normed hidden states ``[B, S, E]``; their dtype is the matmuls' dtype.
      table: the head ``[E, V]``, or with ``tied=True`` the embedding table ``[V, E]``.
      targets: integer token ids ``[B, S]`` in ``[0, V)``.
      chunks: how many groups of tokens to run one after another (>= 1; at most ``S``).
      mask: ``[B, S]``, true for the tokens that count (e.g. ``segment_ids != 0``).
      tied: whether ``table`` is the ``[V, E]`` embedding table.
      constrain: a model's ``constrain(x, logical_names)``: pins each chunk's logits by
        ``("batch", "length", "vocab")`` and the head's gradient by the head's names.

    Example:
      >>> x, w = jnp.ones((2, 8, 4)), jnp.zeros((4, 32))
      >>> float(chunked_cross_entropy(x, w, jnp.zeros((2, 8), jnp.int32), chunks=4))  # log(32)
      3.465735912322998
    """
    _check(x, table, targets, mask, chunks, tied)
    keep = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    weights = jax.lax.stop_gradient(keep / jnp.maximum(keep.sum(), 1.0))
    # inside a shard_map every input varies over the manual axes any one does (so the gradient of a
    # table that does not is summed over them by pcast's transpose, as for a plain einsum)
    x, table, targets, weights = match_varying(x, table, targets, weights)
    return _fused(chunks, tied, constrain, jnp.dtype(table.dtype))(x, table, targets, weights)


def _check(x, table, targets, mask, chunks, tied) -> None:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunked_cross_entropy: chunks={chunks!r} must be a positive int (the number of "
                         "token groups the loss runs one after another), e.g. 8")
    if jnp.ndim(x) != 3:
        raise ValueError(f"chunked_cross_entropy: x must be the hidden states [batch, length, embed], got shape "
                         f"{jnp.shape(x)}")
    b, s, e = x.shape
    if chunks > s:
        raise ValueError(f"chunked_cross_entropy: chunks={chunks} exceeds the sequence length {s} of x "
                         f"{tuple(x.shape)}; use chunks <= {s}")
    want = "[vocab, embed]" if tied else "[embed, vocab]"
    if jnp.ndim(table) != 2 or table.shape[1 if tied else 0] != e:
        raise ValueError(f"chunked_cross_entropy: table {tuple(jnp.shape(table))} must be {want} with embed={e} "
                         f"(x is {tuple(x.shape)}, tied={tied})")
    for name, value in (("targets", targets), ("mask", mask)):
        if value is not None and tuple(jnp.shape(value)) != (b, s):
            raise ValueError(f"chunked_cross_entropy: {name} must be [batch, length] = {(b, s)} like x "
                             f"{tuple(x.shape)}, got {tuple(jnp.shape(value))}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"chunked_cross_entropy: targets must be integer token ids, got dtype {targets.dtype}")


def _fused(chunks: int, tied: bool, constrain: Callable, table_dtype):
    """The custom_vjp loss ``Σ weights · CE`` for one (chunks, tied, constrain, table dtype)."""
    head_names = ("vocab", "embed") if tied else ("embed", "vocab")

    def matmul(h, w):            # logits [B, c, V] in fp32
        return jnp.einsum("bce,ve->bcv" if tied else "bce,ev->bcv", h, w, preferred_element_type=jnp.float32)

    def chunk_loss(h, w, t, wt):
        logits = constrain(matmul(h, w), ("batch", "length", "vocab"))
        top = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
        shifted = logits - top
        lse = jnp.log(jnp.exp(shifted).sum(-1))
        hit = jnp.arange(logits.shape[-1]) == t[..., None]        # one-hot without a gather on "vocab"
        # per token: summed over the chunks in the loop and over the tokens once after it, so no
        # collective runs per chunk for the loss
        loss = constrain((lse - jnp.where(hit, shifted, 0.0).sum(-1)) * wt, ("batch", "length"))
        return loss, shifted, lse, hit

    def primal(x, table, targets, weights):
        w = table.astype(x.dtype)

        def body(total, xs):
            h, t, wt = xs
            return total + chunk_loss(h, w, t, wt)[0], None

        xs = _split(chunks, x, targets, weights)
        _, total0 = match_varying(x, jnp.zeros(xs[1].shape[1:], jnp.float32))   # a scan carry keeps its type
        return jax.lax.scan(body, total0, xs)[0].sum()

    def forward(x, table, targets, weights):
        w = table.astype(x.dtype)
        xs = _split(chunks, x, targets, weights)
        # the head's gradient is summed per device over its own tokens, then once across devices
        # after the loop (an all-reduce per chunk would move the whole head `chunks` times)
        db, dl, pin = _token_split(constrain, xs[0].shape[1:])
        partial_names = ("batch", "length", *head_names)

        def body(carry, xs):
            total, dw = carry
            h, t, wt = xs
            loss, shifted, lse, hit = chunk_loss(h, w, t, wt)
            g = ((jnp.exp(shifted - lse[..., None]) - hit) * wt[..., None]).astype(x.dtype)
            g = constrain(g, ("batch", "length", "vocab"))
            dh = jnp.einsum("bcv,ve->bce" if tied else "bcv,ev->bce", g, w, preferred_element_type=jnp.float32)
            h6, g6 = (a.reshape(db, a.shape[0] // db, dl, a.shape[1] // dl, a.shape[2]) for a in (h, g))
            step = jnp.einsum("ibjlv,ibjle->ijve" if tied else "ibjle,ibjlv->ijev", *((g6, h6) if tied else (h6, g6)),
                              preferred_element_type=jnp.float32)
            return (total + loss, pin(dw + step, partial_names)), dh.astype(x.dtype)

        carry = (jnp.zeros(xs[1].shape[1:], jnp.float32), jnp.zeros((db, dl, *table.shape), jnp.float32))
        _, total0, dw0 = match_varying(x, *carry)
        (total, dw), dh = jax.lax.scan(body, (total0, pin(dw0, partial_names)), xs)
        return total.sum(), (_join(dh, x.shape[1]), constrain(dw.sum((0, 1)), head_names))

    def backward(res, ct):
        dh, dw = res
        return dh * ct.astype(dh.dtype), (dw * ct).astype(table_dtype), None, None

    fused = jax.custom_vjp(primal)
    fused.defvjp(forward, backward)
    return fused


def _token_split(constrain: Callable, shape) -> tuple[int, int, Callable]:
    """Over how many devices a chunk's batch and length dimensions are split (``shape`` is
    ``[B, c, E]``), and the constraint that pins the per-device partial sums of the head's
    gradient. Read from a `jaxpar.LogicalConstraint` (also inside a `ContextParallel`); a batch
    with no ``"batch"`` rule is where jaxpar places it then, on a ``"data"`` axis when the mesh
    has one. ``(1, 1, constrain)`` for a constraint that does not say. Axes a ``shard_map`` runs
    manually split nothing here."""
    base = constrain
    while not hasattr(base, "spec") and hasattr(base, "constrain"):
        base = base.constrain
    if not all(hasattr(base, a) for a in ("spec", "mesh", "rules")):
        return 1, 1, constrain
    sizes, manual, rules = mesh_sizes(base.mesh), set(manual_axes()), dict(base.rules)
    if "batch" not in rules and "data" in sizes:
        base = type(base)(base.mesh, {**rules, "batch": "data"})
    spec = base.spec(tuple(shape), ("batch", "length", "embed"))

    def size(entry):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(sizes[a] for a in axes if a not in manual)

    return size(spec[0]), size(spec[1]), base


def _split(chunks: int, *arrays):
    """``[B, S, ...]`` → ``[chunks, B, S / chunks, ...]``, chunk ``j`` holding positions ``j::chunks``
    (padded at the end of the sequence to a multiple of ``chunks``; the padding's weight is 0)."""
    s = arrays[0].shape[1]
    pad = -s % chunks

    def one(a):
        if pad:
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(a.shape[0], (s + pad) // chunks, chunks, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0)

    return tuple(one(a) for a in arrays)


def _join(stacked: jax.Array, length: int) -> jax.Array:
    """Undo `_split`: ``[chunks, B, S' / chunks, E]`` → ``[B, length, E]``."""
    n, b, c = stacked.shape[:3]
    return jnp.moveaxis(stacked, 0, 2).reshape(b, n * c, *stacked.shape[3:])[:, :length]
