"""fp8 matmuls (the "fp8" precision preset): checked on CPU against a fake-quantised reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.nn import fp8


def _fake(x, dtype, largest):
    """Quantise and dequantise, per tensor: the values an fp8 matmul multiplies."""
    q, s = fp8.quantize(x, dtype, largest)
    return q.astype(jnp.float32) * s


def _ref(spec, x, w):
    """The fake-quantised reference: e4m3 forward, e5m2 incoming gradient, exact products."""
    @jax.custom_vjp
    def f(x, w):
        return jnp.einsum(spec, _fake(x, fp8.E4M3, 448.0), _fake(w, fp8.E4M3, 448.0), precision="highest")

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        a, b, out = fp8._parse(spec)
        fg, fx, fw = _fake(g, fp8.E5M2, 57344.0), _fake(x, fp8.E4M3, 448.0), _fake(w, fp8.E4M3, 448.0)
        # exact fp32 products of the dequantised values (a GPU's default fp32 matmul is TF32)
        return (jnp.einsum(f"{out},{b}->{a}", fg, fw, precision="highest"),
                jnp.einsum(f"{a},{out}->{b}", fx, fg, precision="highest"))

    f.defvjp(fwd, bwd)
    return f(x, w)


@pytest.mark.parametrize("spec,xs,ws", [("bse,ef->bsf", (2, 8, 32), (32, 48)),
                                        ("bse,ehd->bshd", (2, 8, 32), (32, 4, 16)),
                                        ("bshd,hde->bse", (2, 8, 4, 16), (4, 16, 32))])
def test_fp8_einsum_equals_the_fake_quantised_reference(spec, xs, ws):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=xs) * 3, jnp.float32)
    w = jnp.asarray(rng.normal(size=ws) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.normal(size=jnp.einsum(spec, x, w).shape) * 1e-3, jnp.float32)

    def loss(f):
        return lambda x, w: jnp.vdot(f(spec, x, w), dy)

    got = jax.jit(jax.value_and_grad(loss(fp8.fp8_einsum), argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(loss(_ref), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    # and fp8 is not the exact product: the check above would pass for a plain einsum otherwise
    exact = jax.grad(loss(lambda s, x, w: jnp.einsum(s, x, w)), argnums=1)(x, w)
    assert float(jnp.abs(exact - got[1][1]).max()) > 1e-4 * float(jnp.abs(exact).max())


def test_einsum_is_plain_outside_the_fp8_context_and_fp8_inside():
    x, w = jnp.linspace(-1, 1, 64).reshape(4, 16), jnp.linspace(0, 1, 256).reshape(16, 16)
    np.testing.assert_array_equal(fp8.einsum("be,ef->bf", x, w), jnp.einsum("be,ef->bf", x, w))
    with fp8.matmuls("fp8"):
        got = fp8.einsum("be,ef->bf", x, w)
        with fp8.matmuls("compute"):
            np.testing.assert_array_equal(fp8.einsum("be,ef->bf", x, w), jnp.einsum("be,ef->bf", x, w))
    np.testing.assert_array_equal(got, fp8.fp8_einsum("be,ef->bf", x, w))
    assert not np.array_equal(got, jnp.einsum("be,ef->bf", x, w))
    with pytest.raises(ValueError, match="kind='fp4' is not one of"):
        with fp8.matmuls("fp4"):
            pass
    with pytest.raises(ValueError, match="no '...'"):
        fp8.fp8_einsum("...e,ef->...f", x, w)
    with pytest.raises(ValueError, match="sums axes \\['e'\\] of x alone"):
        fp8.fp8_einsum("be,ff->bf", x, w)


def test_a_llama_under_fp8_matmuls_tracks_its_full_precision_loss_and_gradients():
    from flax import nnx

    from jaxpar.models.llama import Llama, LlamaConfig, loss_fn

    model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return loss_fn(nnx.merge(graph, p, rest), batch)

    exact, g_exact = jax.value_and_grad(loss)(params)
    with fp8.matmuls("fp8"):
        got, g_fp8 = jax.jit(jax.value_and_grad(loss))(params)
    assert got != exact and abs(float(got) / float(exact) - 1) < 0.01
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in (g_fp8, g_exact))
    assert np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b) > 0.99


def test_the_fp8_preset_is_refused_without_fp8_matmuls_naming_both():
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.llama import Llama, LlamaConfig, loss_fn
    from jaxpar.precision import Precision

    if fp8.fp8_unavailable() is None:
        pytest.skip("this device has fp8 matmuls")
    config = jaxpar.ParallelConfig(mesh={"data": 1}, precision="fp8")
    mesh = jaxpar.make_mesh(config, jax.devices()[:1])
    model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="precision 'fp8' runs the matmuls in fp8, but the cpu backend has no fp8"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, config, mesh)
    with pytest.raises(ValueError, match="Precision.matmuls='fp8' with compute='float32'"):
        Precision(matmuls="fp8")
    with pytest.raises(ValueError, match="Precision.matmuls='int4' is not one of"):
        Precision(compute="bfloat16", matmuls="int4")
    assert Precision.named("fp8").label == "fp8"


def test_fp8_einsum_inside_a_shard_map_with_a_weight_that_does_not_vary():
    """Hybrid's per-device loss and pipeline stages run the model in a ``shard_map``, where the
    activations vary over the manual axis and a replicated weight does not: the weight's gradient
    is the sum of each device's (as an einsum's), each device quantising its own operands."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 32)) * 0.1, jnp.float32)
    spec = "bse,ef->bsf"

    def local(x, w):
        return jax.lax.psum(jnp.sum(fp8.fp8_einsum(spec, x, w) ** 2), "data")

    got = jax.jit(jax.value_and_grad(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()),
                                     argnums=(0, 1)))(x, w)
    shard = jax.value_and_grad(lambda x, w: jnp.sum(fp8.fp8_einsum(spec, x, w) ** 2), argnums=(0, 1))
    parts = [shard(x[:2], w), shard(x[2:], w)]
    np.testing.assert_allclose(got[0], parts[0][0] + parts[1][0], rtol=1e-6)
    np.testing.assert_allclose(got[1][0], jnp.concatenate([parts[0][1][0], parts[1][1][0]]), rtol=1e-6)
    np.testing.assert_allclose(got[1][1], parts[0][1][1] + parts[1][1][1], rtol=1e-5, atol=1e-6)
