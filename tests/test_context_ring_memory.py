"""Ring attention inside a scan over layers keeps no per-tile masks of its ring steps.

With the layers scanned, the positions and segment ids are the same in every layer; when the
scan is differentiated, JAX computes what depends on them alone once, before the loop. The
ring's forward used to hand the loop every ring step's per-tile masks and masked fills from
there, stacked ``[cp - 1, B, K, G, tq, tk]``: several times the temp of the same layers
unrolled. The kernel ties the ids to the layer's activations, so each tile's mask is computed
in the tile's own step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

import jaxpar
from conftest import requires_devices
from jaxpar.ops import AttentionMask, context_attention

CP, B, S, H, KVH, D = 4, 2, 256, 2, 1, 8


def _layer(x, mesh, positions, segment_ids):
    # keys and values come from the layer's input, as in a model; the ids are the same in every layer
    return context_attention(x, x[:, :, :KVH] * 0.5, x[:, :, KVH:] * 0.25,
                             AttentionMask(q_positions=positions, segment_ids=segment_ids), axis="context",
                             strategy="ring", mesh=mesh)


def _grad(mesh, scan: bool):
    def loss(x, positions, segment_ids):
        if scan:
            x, _ = lax.scan(lambda h, _: (_layer(h, mesh, positions, segment_ids), None), x, length=2)
        else:
            for _ in range(2):
                x = _layer(x, mesh, positions, segment_ids)
        return x.sum()

    return jax.grad(loss)


def _shapes(jaxpr):
    """Every value's shape in ``jaxpr`` and the jaxprs inside it (scan, cond, shard_map bodies)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    yield from _shapes(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    yield from _shapes(sub)


@requires_devices(CP)
@pytest.mark.parametrize("segments", [False, True], ids=["causal", "causal+segments"])
def test_ring_attention_in_a_scan_keeps_no_stacked_tile_masks(segments):
    mesh = jaxpar.make_mesh({"context": CP}, devices=jax.devices()[:CP])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, S, H, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    segment_ids = (jnp.broadcast_to((jnp.arange(S) >= S // 3).astype(jnp.int32) + 1, (B, S))
                   if segments else None)
    args = (x, positions, segment_ids)
    with jax.set_mesh(mesh):
        temp = {scan: jax.jit(_grad(mesh, scan)).lower(*args).compile().memory_analysis().temp_size_in_bytes
                for scan in (True, False)}
        jaxpr = jax.make_jaxpr(_grad(mesh, True))(*args)
    # one tile of one ring step: [B, K, G, tq, tk], two tiles per shard under the causal mask
    tile = S // CP // 2
    stacked = sorted({s for s in _shapes(jaxpr.jaxpr) if len(s) >= 6 and s[0] == CP - 1 and s[-2:] == (tile, tile)})
    assert not stacked, f"per-tile values of every ring step kept for the scan: {stacked}"
    # without the tie: 986,464 B scanned against 239,024 B unrolled (causal)
    assert temp[True] <= 1.25 * temp[False], temp
    # the same gradient either way
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(jax.jit(_grad(mesh, True))(*args), jax.jit(_grad(mesh, False))(*args),
                                   rtol=1e-5, atol=1e-6)
