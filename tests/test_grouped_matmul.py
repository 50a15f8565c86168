"""The experts' grouped matmul: one semantics (``jax.lax.ragged_dot``) for every kernel.

On a CPU the Mosaic GPU kernels cannot run, so the glue around them (padding of rows to the
tiles, zero rows past the groups, the custom gradient's three calls) is checked with stand-ins
that keep each kernel's contract and write NaN where a real kernel leaves memory unwritten.
On a Hopper GPU the real kernels are checked against XLA's (values and gradients).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.nn.moe import MoEConfig
from jaxpar.ops.moe_dispatch import ExpertDispatch, moe_dispatch

gm = importlib.import_module("jaxpar.ops.grouped_matmul")   # the module (jaxpar.ops.grouped_matmul is also its function)


def _problem(m=300, k=128, n=256, g=4, total=250, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(total, np.ones(g) / g).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(g, k, n)) * 0.1, dtype)
    dy = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return x, w, jnp.asarray(sizes), dy


def _ragged_kernel(lhs, rhs, *, group_sizes, transpose_rhs=False, **tiles):
    """The forward kernel's contract; rows past the groups are NaN (unwritten memory)."""
    assert lhs.shape[0] % tiles["block_m"] == 0, "rows padded to the tile"
    out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)
    return jnp.where((jnp.arange(lhs.shape[0]) < group_sizes.sum())[:, None], out, jnp.nan)


def _transposed_kernel(lhs, rhs, *, group_sizes, **tiles):
    """``out[g] = lhs[rows_g]^T @ rhs[rows_g]`` for lhs [K, M], rhs [K, N] grouped along K."""
    assert lhs.shape[0] % tiles["block_k"] == 0, "rows padded to the tile"
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
    onehot = (group[:, None] == jnp.arange(group_sizes.shape[0])[None]).astype(lhs.dtype)
    return jnp.einsum("tg,tm,tn->gmn", onehot, lhs, rhs)


def test_the_mosaic_glue_equals_ragged_dot_values_and_gradients(monkeypatch):
    monkeypatch.setattr(gm, "_kernels", lambda: (_ragged_kernel, _transposed_kernel))
    x, w, sizes, dy = _problem()

    def loss(f):
        return lambda x, w: jnp.vdot(f(x, w, sizes), dy)

    want = jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
    got = jax.jit(jax.value_and_grad(loss(gm._mosaic), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    out = gm._mosaic(x, w, sizes)
    assert (np.asarray(out)[int(sizes.sum()):] == 0).all()      # rows past the groups: zero, not NaN


def test_each_kernel_shape_is_traced_once_for_every_layer_and_the_backward(monkeypatch):
    """A model calls one shape from each layer: the kernels go through jitted callees, which JAX
    lowers (and Mosaic compiles) once per program, not once per call site."""
    traced = {"ragged": 0, "transposed": 0}

    def ragged(*a, **k):
        traced["ragged"] += 1
        return _ragged_kernel(*a, **k)

    def transposed(*a, **k):
        traced["transposed"] += 1
        return _transposed_kernel(*a, **k)

    monkeypatch.setattr(gm, "_kernels", lambda: (ragged, transposed))
    x, w, sizes, _ = _problem(m=256, k=128, n=128, g=2, total=200)

    def layers(x, w):
        for _ in range(4):
            x = gm._mosaic(x, w, sizes)
        return x.sum()

    jax.jit(jax.grad(layers, argnums=(0, 1))).lower(x, w)
    assert traced == {"ragged": 2, "transposed": 1}     # forward, rows' gradient; weights' gradient


def test_mosaic_is_refused_where_it_cannot_run_and_auto_takes_xla():
    x, w, sizes, _ = _problem()
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="kernel='mosaic' cannot run here: they need a GPU"):
            gm.grouped_matmul(x, w, sizes, kernel="mosaic")
    np.testing.assert_array_equal(gm.grouped_matmul(x, w, sizes), jax.lax.ragged_dot(x, w, sizes))
    with pytest.raises(ValueError, match="kernel='triton' is not one of"):
        gm.grouped_matmul(x, w, sizes, kernel="triton")
    with pytest.raises(ValueError, match="MoEConfig.kernel='cutlass' is not one of"):
        MoEConfig(experts=4, kernel="cutlass")
    ids = jnp.zeros((8, 2), jnp.int32)
    with pytest.raises(ValueError, match="ExpertDispatch: kernel='x' is not one of"):
        moe_dispatch(jnp.ones((8, 4)), ids, jnp.ones((8, 2)), jnp.ones((2, 4, 8)), jnp.ones((2, 4, 8)),
                     jnp.ones((2, 8, 4)), ExpertDispatch(kernel="x"))


def test_mosaic_needs_16_bit_operands_and_tile_multiples():
    class Hopper:
        platform, compute_capability, device_kind = "gpu", "9.0", "H100"
    x, w, _, _ = _problem(dtype=jnp.float32)
    assert "bfloat16 or float16" in gm.mosaic_unavailable(x, w, Hopper())
    x, w, _, _ = _problem(k=96, dtype=jnp.bfloat16)
    assert "K=96 and N=256 must be multiples of 128" in gm.mosaic_unavailable(x, w, Hopper())
    Hopper.compute_capability = "8.0"
    x, w, _, _ = _problem(dtype=jnp.bfloat16)
    assert "Hopper" in gm.mosaic_unavailable(x, w, Hopper())


@pytest.mark.skipif(gm.mosaic_unavailable(jnp.ones((1, 128), jnp.bfloat16), jnp.ones((1, 128, 128), jnp.bfloat16))
                    is not None, reason="the Mosaic GPU kernels need a Hopper GPU")
def test_mosaic_kernels_equal_xla_on_a_hopper_gpu():
    x, w, sizes, dy = _problem(m=4096, k=768, n=2048, g=8, total=4000, dtype=jnp.bfloat16)

    def loss(kernel):
        return lambda x, w: jnp.vdot(gm.grouped_matmul(x, w, sizes, kernel=kernel).astype(jnp.float32),
                                     dy.astype(jnp.float32))

    want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1)))(x, w)
    got = jax.jit(jax.value_and_grad(loss("mosaic"), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2)
    for a, b in zip(got[1], want[1]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


def test_the_mosaic_path_inside_a_shard_map_sums_a_replicated_weights_gradient(monkeypatch):
    """In moe_dispatch's shard_map the rows vary over the token axes and an expert weight may
    not: the Mosaic path's custom_vjp gets both varying alike, and equals ragged_dot there."""
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(gm, "_kernels", lambda: (_ragged_kernel, _transposed_kernel))
    monkeypatch.setattr(gm, "mosaic_unavailable", lambda x, w, device=None: None)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    x, w, _, _ = _problem(m=512, k=128, n=128, g=2, total=400)
    sizes = jnp.array([[150, 50], [100, 100]], jnp.int32)      # each device's groups

    def run(f):
        local = lambda x, w, s: jax.lax.psum(jnp.sum(f(x, w, s[0]) ** 2), "data")  # noqa: E731
        return jax.jit(jax.value_and_grad(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                                        out_specs=P()), argnums=(0, 1)))(x, w, sizes)

    got = run(lambda x, w, s: gm.grouped_matmul(x, w, s, kernel="mosaic"))
    want = run(jax.lax.ragged_dot)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
