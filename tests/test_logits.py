"""The LM head's matmul: fp32 logits, gradient matmuls in the inputs' dtype (no fp32 GEMMs)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.nn.logits import head_logits


def _dots(fn, *args):
    """(operand dtypes) of every dot_general in the jaxpr of ``fn``, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("tied", [False, True])
def test_head_gradient_runs_in_the_inputs_dtype_and_matches_fp32(tied):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(40, 16) if tied else (16, 40)) * 0.3, jnp.float32)
    y = jnp.asarray(rng.integers(0, 40, (2, 8)))

    def loss(x, t, head):
        logits = head(x, t)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()

    spec = "bse,ve->bsv" if tied else "bse,ev->bsv"
    plain = lambda x, t: jnp.einsum(spec, x, t.astype(x.dtype), preferred_element_type=jnp.float32)  # noqa: E731
    ours = lambda x, t: head_logits(x, t, tied=tied)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    # fp32: exactly the einsum and its gradient
    for a, b in zip(grad(x, table, ours), grad(x, table, plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # bf16 inputs: every gradient matmul takes bf16 operands (the plain einsum's take an fp32 cotangent)
    xb = x.astype(jnp.bfloat16)
    assert all(d == ("bfloat16", "bfloat16") for d in _dots(lambda x, t: grad(x, t, ours), xb, table))
    assert any("float32" in d for d in _dots(lambda x, t: grad(x, t, plain), xb, table))
    gx, gt = grad(xb, table, ours)
    assert gx.dtype == jnp.bfloat16 and gt.dtype == jnp.float32
    rx, rt = grad(xb.astype(jnp.float32), table, plain)
    np.testing.assert_allclose(np.asarray(gx, np.float32), rx, rtol=0.05, atol=2e-3)
    np.testing.assert_allclose(gt, rt, rtol=0.05, atol=2e-3)


def test_inside_a_shard_map_a_replicated_head_gets_the_sum_of_the_devices_gradients():
    """Hybrid's per-device loss and a pipeline's last stage call the head in a ``shard_map``, the
    hidden states varying over the manual axis and the table not: equal to the plain einsum's
    gradients there (the custom_vjp once refused to trace: its cotangent's type did not match)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(16, 40)) * 0.3, jnp.float32)

    def run(head):
        local = lambda x, t: jax.lax.psum(jnp.sum(head(x, t) ** 2), "data")  # noqa: E731
        return jax.jit(jax.value_and_grad(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()),
                                          argnums=(0, 1)))(x, table)

    got = run(lambda x, t: head_logits(x, t, tied=False))
    want = run(lambda x, t: jnp.einsum("bse,ev->bsv", x, t, preferred_element_type=jnp.float32))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
