"""Context parallel attention: the sequence split over a ``context`` mesh axis.

With q, k, v ``[B, S, H, D]`` split over ``axis`` on S, each device holds ``S / cp`` queries
and ``S / cp`` keys; attention needs every key for every query. Four ways to get them:

* ``"all_gather"``: gather K/V (and their positions) over the axis, attend locally. Forward
  moves ``(cp - 1) / cp`` of K and V per device; the backward reduce-scatters dK, dV.
* ``"ring"``: pass K/V blocks around the ring with ``ppermute`` (``cp - 1`` shifts), folding
  each into an online softmax in fp32; a ``custom_vjp`` passes K/V and their gradients around
  again in the backward instead of keeping every block's probabilities.
* ``"ulysses"``: ``all_to_all`` from sequence-split to head-split, ordinary attention on
  ``H / cp`` heads over the whole sequence, ``all_to_all`` back. K/V heads that ``cp`` does not
  divide (GQA with few K/V heads, MQA) are repeated up to ``lcm(kv_heads, cp)`` first.
* ``"hybrid"``: ``axis=(ring_axis, ulysses_axis)``: Ulysses inside ``ulysses_axis``, ring
  across ``ring_axis``.

The mask comes from positions and segment ids, never from indices, so a sequence reordered
for causal load balance (`jaxpar.ops.context_order`) masks exactly like the original.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.deprecation import FormerForm, accepts_former_form, former_signature
from jaxpar.config import CONTEXT_STRATEGIES
from jaxpar.ops import context_kernels as kernels
from jaxpar.ops._common import AnyMesh, axes_of, axes_size, inner_shard_map, resolve_mesh
from jaxpar.strategy import manual_axes, mesh_sizes, spec_entry

STRATEGIES = CONTEXT_STRATEGIES


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionMask:
    """Which keys a query sees, from positions and segment ids (never from indices).

    >>> AttentionMask().causal
    True
    """

    causal: bool = True
    """A query at position p sees keys at positions <= p."""
    segment_ids: jax.Array | None = None
    """``[B, S]`` ints; a query sees only keys of its own segment."""
    q_positions: jax.Array | None = None
    """``[B, S]`` positions of the queries in the original sequence (default ``arange(S)``): pass
    them when the sequence was reordered; with segment ids, positions inside a segment work as well."""
    kv_positions: jax.Array | None = None
    """``[B, S]`` positions of the keys (default ``q_positions``)."""


class _Split(NamedTuple):
    """How one call splits its work: the strategy, the ring / Ulysses / batch / heads axes of the
    mesh, the mask's ``causal``, the logits' ``scale`` and the manual axes of an enclosing
    ``shard_map`` (``outer``: the pipeline's ``"pipe"``)."""

    strategy: str
    mesh: Any
    ring: tuple[str, ...]
    uly: tuple[str, ...]
    batch: tuple[str, ...]
    heads: tuple[str, ...]
    causal: bool = True
    scale: float = 1.0
    outer: tuple[str, ...] = ()

    @property
    def vary(self) -> tuple[str, ...]:
        """The axes the scan carries vary over: the inputs' and the enclosing shard_map's manual ones."""
        return self.batch + self.ring + self.uly + self.heads + self.outer


_MASK = ("causal", "segment_ids", "q_positions", "kv_positions")
_FORMER = FormerForm(
    "jaxpar.ops.context_attention",
    former_signature("q k v", {"*": None, "axis": dataclasses.MISSING, "strategy": "ring", "mesh": None,
                                    "causal": True, "segment_ids": None, "q_positions": None, "kv_positions": None,
                                    "batch_axis": None, "heads_axis": None, "scale": None}),
    lambda args, kwargs: any(name in kwargs for name in _MASK),
    lambda a: ((a["q"], a["k"], a["v"], AttentionMask(**{n: a[n] for n in _MASK})),
               {n: a[n] for n in ("axis", "strategy", "mesh", "batch_axis", "heads_axis", "scale")}),
    "jaxpar.ops.context_attention(q, k, v, jaxpar.ops.AttentionMask(causal=..., segment_ids=..., q_positions=..., "
    "kv_positions=...), axis=..., strategy=..., mesh=...)")


@accepts_former_form(_FORMER)
def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask | None = None,
    *,
    axis: str | tuple[str, str],
    strategy: str = "ring",
    mesh: AnyMesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    heads_axis: str | tuple[str, ...] | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention on ``[B, S, H, D]`` tensors whose sequence is split over ``axis``.

    Args:
      q: queries ``[B, S, H, D]``.
      k, v: keys and values ``[B, S, Hkv, D]``; ``Hkv`` divides ``H`` (GQA; 1 = MQA).
      mask: an ``AttentionMask`` (causal, segment ids, query and key positions); default causal
        over ``arange(S)``.
      axis: the context mesh axis; for ``strategy="hybrid"`` a pair ``(ring_axis, ulysses_axis)``.
      strategy: ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"hybrid"``.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      batch_axis: mesh axes splitting B (data parallel), or None.
      heads_axis: mesh axes splitting H and Hkv (tensor parallel), or None.
      scale: logits scale; default ``1 / sqrt(D)``.

    Returns ``[B, S, H, D]`` split like q.

    Example:
      >>> mesh = jaxpar.make_mesh({"context": 4})
      >>> q = k = v = jnp.ones((1, 16, 4, 8))
      >>> out = context_attention(q, k, v, axis="context", strategy="ring", mesh=mesh)
      >>> out.shape, out.sharding.spec
      ((1, 16, 4, 8), P(None, 'context', None, None))
    """
    mask = AttentionMask() if mask is None else mask
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"context_attention: mask must be a jaxpar.ops.AttentionMask, got {type(mask).__name__}; "
                        f"e.g. AttentionMask(causal=True, segment_ids=ids)")
    mesh = resolve_mesh(mesh, "context_attention")
    ring, uly = _strategy_axes(strategy, axis, mesh)
    batch = axes_of("context_attention", "batch_axis", batch_axis, mesh)
    heads = axes_of("context_attention", "heads_axis", heads_axis, mesh)
    split = _Split(strategy, mesh, ring, uly, batch, heads)
    check_inputs(q, k, v, mask, split)
    b, s = q.shape[:2]
    q_positions = mask.q_positions
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_positions = q_positions if mask.kv_positions is None else mask.kv_positions
    # the scan carries vary as the inputs do: over these axes, and over the manual axes of an
    # enclosing shard_map (the pipeline's "pipe"), over which the stage's values differ
    split = split._replace(causal=mask.causal, scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
                           outer=tuple(manual_axes()))
    seq = ring + uly
    big = PartitionSpec(spec_entry(batch), spec_entry(seq), spec_entry(heads), None)
    ids = PartitionSpec(spec_entry(batch), spec_entry(seq))
    segs = () if mask.segment_ids is None else (mask.segment_ids,)

    def local(q, k, v, qpos, kpos, *seg):
        seg = seg[0] if seg else None
        return _attend(q, k, v, (qpos, seg), (kpos, seg), split)

    fn = inner_shard_map(local, mesh, "context_attention",
                         in_specs=(big, big, big, ids, ids) + (ids,) * len(segs), out_specs=big, diff=(0, 1, 2))
    return fn(q, k, v, q_positions, kv_positions, *segs)


def _attend(q, k, v, ids_q, ids_k, split: _Split):
    """Per device: Ulysses (if any) around the ring or all-gather core."""
    ring, uly, mesh, causal, scale = split.ring, split.uly, split.mesh, split.causal, split.scale
    n_uly = axes_size(mesh, uly)
    if uly:
        k, v = _repeat_kv(k, v, n_uly)
        q, k, v = (lax.all_to_all(x, uly, 2, 1, tiled=True) for x in (q, k, v))
        ids_q, ids_k = (jax.tree.map(lambda x: lax.all_gather(x, uly, axis=1, tiled=True), i) for i in (ids_q, ids_k))
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    n_ring = axes_size(mesh, ring)
    if split.strategy == "all_gather":
        k, v = (lax.all_gather(x, ring, axis=1, tiled=True) for x in (k, v))
        ids_k = jax.tree.map(lambda x: lax.all_gather(x, ring, axis=1, tiled=True), ids_k)
    if ring and split.strategy != "all_gather" and n_ring > 1:
        out = kernels.ring_attention(kernels.Ring(ring[0], n_ring, causal, scale, split.vary, bool(split.outer)),
                                     qg, k, v, ids_q, ids_k)
    else:
        out = kernels.local_attention(qg, k, v, ids_q, ids_k, causal, scale)
    out = out.reshape(b, t, h, d)
    return lax.all_to_all(out, uly, 1, 2, tiled=True) if uly else out


def _repeat_kv(k, v, n: int):
    """K/V heads repeated up to ``lcm(kv_heads, n)`` so the head split is even (GQA, MQA).

    ``jnp.repeat`` keeps copies of one head next to each other, so query head ``h`` still
    reads a copy of K/V head ``h // groups``.
    """
    reps = n // math.gcd(k.shape[2], n)
    return (k, v) if reps == 1 else (jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2))


def _strategy_axes(strategy, axis, mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ring axes, Ulysses axes) of ``strategy``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context_attention: unknown strategy={strategy!r}; use one of {STRATEGIES}")
    axes = axes_of("context_attention", "axis", axis, mesh)
    if strategy == "hybrid":
        if len(axes) != 2:
            raise ValueError(f"context_attention: strategy='hybrid' needs axis=(ring_axis, ulysses_axis), got "
                             f"axis={axis!r}; e.g. axis=('context', 'ulysses') on mesh {mesh_sizes(mesh)}")
        return axes[:1], axes[1:]
    if len(axes) != 1:
        raise ValueError(f"context_attention: strategy={strategy!r} takes one mesh axis, got axis={axis!r}; "
                         "use strategy='hybrid' for a (ring_axis, ulysses_axis) pair")
    return (axes, ()) if strategy != "ulysses" else ((), axes)


def check_inputs(q, k, v, mask: AttentionMask, split: _Split):
    """``ValueError`` naming the shapes, mesh sizes and a fix when the inputs cannot be split."""
    op = "context_attention"
    segment_ids, q_positions, kv_positions = mask.segment_ids, mask.q_positions, mask.kv_positions
    strategy, mesh, ring, uly, batch, heads = split.strategy, split.mesh, split.ring, split.uly, split.batch, split.heads
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(qs) != 4 or ks != vs or len(ks) != 4 or ks[:2] != qs[:2] or ks[3] != qs[3]:
        raise ValueError(f"{op}: needs q [B, S, H, D] and k, v [B, S, Hkv, D] (same B, S, D), got q {qs}, "
                         f"k {ks}, v {vs}")
    if qs[2] % ks[2]:
        raise ValueError(f"{op}: k/v heads ({ks[2]}) must divide q heads ({qs[2]}); q {qs}, k {ks}")
    for name, x in (("segment_ids", segment_ids), ("q_positions", q_positions), ("kv_positions", kv_positions)):
        if x is not None and tuple(jnp.shape(x)) != qs[:2]:
            raise ValueError(f"{op}: {name} has shape {tuple(jnp.shape(x))}, expected [B, S] = {qs[:2]} (q {qs})")
    used = ring + uly + batch + heads
    if len(set(used)) != len(used):
        raise ValueError(f"{op}: the context axes {ring + uly}, batch_axis {batch} and heads_axis {heads} "
                         "must be different mesh axes")
    cp = axes_size(mesh, ring + uly)
    if qs[1] % cp:
        raise ValueError(f"{op}: sequence length {qs[1]} (q {qs}) is not divisible by {cp}, the size of the "
                         f"context axes {ring + uly} of mesh {mesh_sizes(mesh)}; use a sequence length that is a "
                         f"multiple of {cp}")
    nb, nh, nu = axes_size(mesh, batch), axes_size(mesh, heads), axes_size(mesh, uly)
    if qs[0] % nb:
        raise ValueError(f"{op}: batch {qs[0]} (q {qs}) is not divisible by {nb}, the size of batch_axis {batch}")
    for what, count in (("q", qs[2]), ("k/v", ks[2])):
        if count % nh:
            raise ValueError(f"{op}: {what} has {count} heads (q {qs}, k {ks}), not divisible by {nh}, the size "
                             f"of heads_axis {heads} of mesh {mesh_sizes(mesh)}; use a heads axis dividing {count}")
    if uly and (qs[2] // nh) % nu:
        raise ValueError(
            f"{op}: strategy={strategy!r} splits the {qs[2] // nh} query heads per device (q {qs}, heads_axis "
            f"{heads} of size {nh}) over the Ulysses axes {uly} of size {nu}, which does not divide them; use "
            f"a multiple of {nu * nh} query heads, a smaller Ulysses axis, or strategy='ring'")
