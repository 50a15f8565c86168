"""The per-device pieces of context-parallel attention: masked score blocks, the online
softmax, and ring attention's forward and backward (a ``jax.custom_vjp``).

Everything here runs inside ``jax.shard_map`` on one device's shards. Shapes: queries are
grouped ``[B, Tq, K, G, D]`` (K key/value heads, G query heads per key/value head, so K/V are
never repeated), keys and values ``[B, Tk, K, D]``, positions and segment ids ``[B, T]``.
Softmax statistics and accumulators are fp32 whatever the input dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.ops._common import axis_position

# A finite "minus infinity": exp(NEG - NEG) stays finite, and masked scores are zeroed anyway.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def block_mask(ids_q, ids_k, causal: bool):
    """``[B, 1, 1, Tq, Tk]`` bool: key allowed for query (positions, then segment ids), or None.

    ``ids_*`` are ``(positions, segment_ids or None)``. Causality compares positions, not
    indices, so a reordered (zigzag / striped) sequence masks exactly like the original one.
    """
    (qpos, qseg), (kpos, kseg) = ids_q, ids_k
    mask = None
    if causal:
        mask = kpos[:, None, :] <= qpos[:, :, None]
    if qseg is not None:
        same = qseg[:, :, None] == kseg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def scores(q, k, ids_q, ids_k, causal: bool, scale: float):
    """Masked fp32 scores ``[B, K, G, Tq, Tk]`` of one block, and the mask (or None)."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    mask = block_mask(ids_q, ids_k, causal)
    return (s if mask is None else jnp.where(mask, s, NEG)), mask


def _varying(x, vary: tuple[str, ...]):
    """``x`` marked as varying over the mesh axes ``vary`` (a scan carry must keep its type)."""
    return lax.pcast(x, vary, to="varying") if vary else x


def zeros_like(x, vary: tuple[str, ...] = ()):
    """fp32 zeros shaped like ``x``, varying over ``vary``."""
    return _varying(jnp.zeros(x.shape, jnp.float32), vary)


def init_stats(q, vary: tuple[str, ...] = ()):
    """Running max, sum and output of the online softmax for queries ``q`` (zero blocks seen)."""
    b, t, kh, g, d = q.shape
    m = _varying(jnp.full((b, kh, g, t), NEG, jnp.float32), vary)
    return m, zeros_like(m, vary), _varying(jnp.zeros((b, kh, g, t, d), jnp.float32), vary)


def update(stats, q, k, v, ids_q, ids_k, causal: bool, scale: float):
    """Fold one key/value block into the online-softmax statistics (flash attention's recurrence)."""
    m, l, acc = stats
    s, mask = scores(q, k, ids_q, ids_k, causal, scale)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)   # a block with every key masked adds nothing
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv


def finish(stats, dtype):
    """Output ``[B, Tq, K, G, D]`` in ``dtype`` and the log-sum-exp ``[B, K, G, Tq]`` (fp32)."""
    m, l, acc = stats
    # a query that sees no key at all (possible with separate kv_positions) gets 0, not 0/0, and
    # a log-sum-exp so large that its backward probabilities are 0
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    return jnp.moveaxis(out, 3, 1).astype(dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -NEG)


def local_attention(q, k, v, ids_q, ids_k, causal: bool, scale: float):
    """One-block attention (all-gather and Ulysses run this on their gathered tensors)."""
    return finish(update(init_stats(q), q, k, v, ids_q, ids_k, causal, scale), q.dtype)[0]


# ----------------------------------------------------------------------------- ring

def _shift(tree, axis: str, n: int, nested: bool = False):
    """Pass every leaf to the next device of ``axis`` (device i sends to i + 1).

    ``nested``: inside another shard_map's per-device branches (a pipeline stage's op), where
    the devices of other stages run other ops. A collective-permute's participants are every
    device of the program (XLA:CPU waits for all of them: a deadlock there), an all-to-all's
    only the devices of ``axis`` in this stage; so the shift is an all-to-all whose one real
    chunk goes to the next device: the same bytes at ``n = 2``, ``n - 1`` times more above.
    """
    if not nested:
        perm = [(i, (i + 1) % n) for i in range(n)]
        return jax.tree.map(lambda x: lax.ppermute(x, axis, perm), tree)
    me = axis_position(axis)

    def one(x):
        chunks = jnp.zeros((n,) + x.shape, x.dtype).at[(me + 1) % n].set(x)
        got = lax.all_to_all(chunks, axis, 0, 0, tiled=True)   # got[j]: what device j sent here
        return got[(me - 1) % n]

    return jax.tree.map(one, tree)


def _tied(q, k, v, ids_q, ids_k):
    """The inputs, with the positions and segment ids tied to q, k, v (an optimization barrier).

    Inside a ``lax.scan`` over layers the positions are the same in every layer, so when the
    scan is differentiated JAX's partial evaluation computes whatever depends on them alone
    once, before the loop: every ring step's shifted ids, per-tile masks, skip predicates and
    the fills of the masked ``where`` s, handed to the forward loop stacked ``[n - 1, ...]``
    (``bool`` and ``f32[3, 16, 2, 2, 128, 128]`` per tile pair for the tiny Llama at batch 32,
    seq 1024, data=2 x context=4: 236 MB of compiled temp against 48 MB). Through the barrier
    the ids depend on the layer's activations, so each tile's mask is an integer compare in
    the tile's own step, as with the layers unrolled.
    """
    return lax.optimization_barrier((q, k, v, ids_q, ids_k))


class Ring(NamedTuple):
    """The ring of ``ring_attention``: mesh axis ``axis`` of size ``n``, the mask's ``causal``, the
    logits' ``scale``, the mesh axes the inputs vary over (``vary``: all the axes of their
    ``shard_map`` specs) and whether it runs inside a pipeline stage's op (``nested``, see ``_shift``)."""

    axis: str
    n: int
    causal: bool
    scale: float
    vary: tuple[str, ...]
    nested: bool = False


def _ring_forward(ring: Ring, q, k, v, ids_q, ids_k):
    axis, n, causal, scale, vary, nested = ring
    q, k, v, ids_q, ids_k = _tied(q, k, v, ids_q, ids_k)

    def body(carry, _):
        stats, kv = carry
        nxt = _shift(kv, axis, n, nested)   # issued before this block's compute, so the two can overlap
        return (_fold(stats, q, kv[0], kv[1], ids_q, kv[2], causal, scale), nxt), None

    (stats, kv), _ = lax.scan(body, (init_stats(q, vary), (k, v, ids_k)), length=n - 1)
    return finish(_fold(stats, q, kv[0], kv[1], ids_q, kv[2], causal, scale), q.dtype)


# ----------------------------------------------------------------------------- tiles a causal mask skips
#
# Each device's shard is cut into TILES tiles of queries and of keys (for a zigzag shard: its
# two chunks). Under a causal mask a (query tile, key tile) pair whose smallest key position
# is after its largest query position has nothing to add; `lax.cond` skips its compute. This
# is where the zigzag / striped orders pay: every device then skips the same number of tiles.

TILES = 2


def _tiles(t: int, causal: bool) -> int:
    return TILES if causal and t % TILES == 0 else 1


def _cut(x, i: int, n: int, axis: int):
    size = x.shape[axis] // n
    return lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis)


def _cut_ids(ids, i: int, n: int):
    return jax.tree.map(lambda x: _cut(x, i, n, 1), ids)


def _live(ids_q, ids_k):
    """Some key of the tile is at or before some query of the tile (over every row)."""
    return ids_k[0].min() <= ids_q[0].max()


def _fold(stats, q, k, v, ids_q, ids_k, causal: bool, scale: float):
    """`update` tile by tile, skipping the tiles the causal mask hides entirely."""
    n = _tiles(q.shape[1], causal) if q.shape[1] == k.shape[1] else 1
    if n == 1:
        return update(stats, q, k, v, ids_q, ids_k, causal, scale)
    parts = []
    for a in range(n):
        st, qa, ida = tuple(_cut(x, a, n, 3) for x in stats), _cut(q, a, n, 1), _cut_ids(ids_q, a, n)
        for b in range(n):
            kb, vb, idb = _cut(k, b, n, 1), _cut(v, b, n, 1), _cut_ids(ids_k, b, n)
            st = lax.cond(_live(ida, idb), lambda st, kb=kb, vb=vb, idb=idb: update(
                st, qa, kb, vb, ida, idb, causal, scale), lambda st: st, st)
        parts.append(st)
    return tuple(jnp.concatenate([p[i] for p in parts], axis=3) for i in range(3))


def _grads(ring: Ring, q, k, v, do, softmax, ids_q, ids_k):
    """`_block_grads` tile by tile, skipping the tiles the causal mask hides entirely; ``softmax``:
    ``(delta, lse)`` of the forward."""
    causal, scale, vary = ring.causal, ring.scale, ring.vary
    delta, lse = softmax
    n = _tiles(q.shape[1], causal) if q.shape[1] == k.shape[1] else 1
    if n == 1:
        return _block_grads(q, k, v, do, delta, lse, ids_q, ids_k, causal, scale)
    dq, dk, dv = [], [zeros_like(_cut(k, 0, n, 1), vary)] * n, [zeros_like(_cut(v, 0, n, 1), vary)] * n
    for a in range(n):
        qa, doa, ida = _cut(q, a, n, 1), _cut(do, a, n, 1), _cut_ids(ids_q, a, n)
        da, la = _cut(delta, a, n, 3), _cut(lse, a, n, 3)
        dqa = zeros_like(qa, vary)
        for b in range(n):
            kb, vb, idb = _cut(k, b, n, 1), _cut(v, b, n, 1), _cut_ids(ids_k, b, n)
            g = lax.cond(_live(ida, idb),
                         lambda kb=kb, vb=vb, idb=idb: _block_grads(qa, kb, vb, doa, da, la, ida, idb, causal, scale),
                         lambda qa=qa, kb=kb, vb=vb: (zeros_like(qa, vary), zeros_like(kb, vary), zeros_like(vb, vary)))
            dqa, dk[b], dv[b] = dqa + g[0], dk[b] + g[1], dv[b] + g[2]
        dq.append(dqa)
    return jnp.concatenate(dq, 1), jnp.concatenate(dk, 1), jnp.concatenate(dv, 1)


def _block_grads(q, k, v, do, delta, lse, ids_q, ids_k, causal, scale):
    s, mask = scores(q, k, ids_q, ids_k, causal, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    f32 = jnp.float32
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do, v, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k, preferred_element_type=f32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q, preferred_element_type=f32)
    return dq, dk, dv


def ring_attention(ring: Ring, q, k, v, ids_q, ids_k):
    """Ring attention over mesh axis ``ring.axis`` of size ``ring.n`` (inside ``shard_map``; see `Ring`).

    Each device keeps its queries and passes its key/value block (with its positions and
    segment ids) around the ring with ``ppermute``: after ``n - 1`` shifts every query block
    has met every key block. Returns ``[B, Tq, K, G, D]``. The backward pass (``custom_vjp``)
    keeps only q, k, v, the output and the log-sum-exp, and passes K/V around the ring again
    together with their gradient accumulators, which arrive home after ``n`` shifts: no
    block's probabilities are kept. Under a causal mask, tiles the mask hides entirely are
    skipped (`_fold`, `_grads`).
    """
    return _ring_vjp(Ring(*ring), q, k, v, ids_q, ids_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_vjp(statics, q, k, v, ids_q, ids_k):
    return _ring_forward(statics, q, k, v, ids_q, ids_k)[0]


def _fwd(statics, q, k, v, ids_q, ids_k):
    out, lse = _ring_forward(statics, q, k, v, ids_q, ids_k)
    return out, (q, k, v, ids_q, ids_k, out, lse)


def _bwd(statics, res, do):
    q, k, v, ids_q, ids_k, out, lse = res
    axis, n, vary, nested = statics.axis, statics.n, statics.vary, statics.nested
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", do.astype(jnp.float32), out.astype(jnp.float32))
    do = do.astype(q.dtype)

    def step(dq, kv, dkv):
        gq, gk, gv = _grads(statics, q, kv[0], kv[1], do, (delta, lse), ids_q, kv[2])
        return dq + gq, (dkv[0] + gk, dkv[1] + gv)

    def body(carry, _):
        dq, kv, dkv = carry
        nxt = _shift(kv, axis, n, nested)
        dq, dkv = step(dq, kv, dkv)
        return (dq, nxt, _shift(dkv, axis, n, nested)), None

    carry = (zeros_like(q, vary), (k, v, ids_k), (zeros_like(k, vary), zeros_like(v, vary)))
    (dq, kv, dkv), _ = lax.scan(body, carry, length=n - 1)
    dq, dkv = step(dq, kv, dkv)
    dk, dv = _shift(dkv, axis, n, nested)        # the n-th shift brings each block's gradient home
    none = jax.tree.map(lambda _: None, (ids_q, ids_k))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *none


_ring_vjp.defvjp(_fwd, _bwd)
