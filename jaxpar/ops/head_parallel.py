"""Multi-head attention split over heads (and batch): MindSpore ``FlashAttention`` head split.

Heads are independent, so with q/k/v ``[B, S, H, D]`` split over ``heads_axis`` on H (and
``batch_axis`` on B) each device runs ordinary attention on its ``H / n`` heads and nothing
is communicated: 0 bytes per device. The communication of a Megatron-style attention block
lives in the projections around it (``matmul`` with K split → all-reduce or reduce-scatter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.ops._common import AnyMesh, axes_of, axes_size, resolve_mesh
from jaxpar.strategy import mesh_sizes, spec_entry


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    heads_axis: str | tuple[str, ...],
    batch_axis: str | tuple[str, ...] | None = None,
    mesh: AnyMesh | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention on ``[B, S, H, D]`` tensors, heads split over ``heads_axis``.

    Args:
      q: queries ``[B, S, H, D]``.
      k, v: keys and values ``[B, T, Hkv, D]``; ``Hkv`` divides ``H`` (grouped-query
        attention: query head ``h`` reads key/value head ``h // (H / Hkv)``).
      heads_axis: mesh axis (or axes) splitting H and Hkv.
      batch_axis: mesh axis (or axes) splitting B, or None.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      causal: mask out keys after each query (query ``i`` sees keys ``0..i``).
      scale: logits scale; default ``1 / sqrt(D)``.

    Returns ``[B, S, H, D]``, split like q. The local computation is
    ``jax.nn.dot_product_attention`` (XLA's fused kernel, or cuDNN flash attention on GPUs
    where JAX picks it).

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> q = k = v = jnp.ones((2, 8, 4, 16))
      >>> out = attention(q, k, v, heads_axis="y", batch_axis="x", mesh=mesh)
      >>> out.sharding.spec
      P('x', None, 'y', None)
    """
    mesh = resolve_mesh(mesh, "attention")
    heads = axes_of("attention", "heads_axis", heads_axis, mesh)
    batch = axes_of("attention", "batch_axis", batch_axis, mesh)
    _check(q, k, v, heads, batch, mesh)

    def local(qb, kb, vb):
        return jax.nn.dot_product_attention(qb, kb, vb, scale=scale, is_causal=causal)

    spec = PartitionSpec(spec_entry(batch), None, spec_entry(heads), None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)


def _check(q, k, v, heads, batch, mesh) -> None:
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(qs) != 4 or ks != vs or len(ks) != 4 or ks[0] != qs[0] or ks[3] != qs[3]:
        raise ValueError(
            f"attention: needs q [B, S, H, D] and k, v [B, T, Hkv, D] of the same shape, got "
            f"q {qs}, k {ks}, v {vs}"
        )
    if qs[2] % ks[2]:
        raise ValueError(f"attention: k/v heads ({ks[2]}) must divide q heads ({qs[2]}); q {qs}, k {ks}")
    if set(heads) & set(batch):
        raise ValueError(f"attention: heads_axis {heads} and batch_axis {batch} must be different mesh axes")
    n = axes_size(mesh, heads)
    for what, count in (("q", qs[2]), ("k/v", ks[2])):
        if count % n:
            raise ValueError(
                f"attention: {what} has {count} heads (q {qs}, k {ks}), not divisible by {n}, the "
                f"size of heads_axis {heads} of mesh {mesh_sizes(mesh)}; use a heads axis whose size "
                f"divides {count}, or more heads"
            )
    nb = axes_size(mesh, batch)
    if qs[0] % nb:
        raise ValueError(
            f"attention: batch {qs[0]} (q {qs}) is not divisible by {nb}, the size of batch_axis "
            f"{batch} of mesh {mesh_sizes(mesh)}"
        )
