"""The models' SwiGLU (jaxpar.ops.swiglu): the plain expression's values and gradients, with
fewer bytes kept for the backward in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.ops import swiglu

T, D, F, LAYERS = 4096, 256, 1024, 3


def _plain_swiglu(g, u):
    return jax.nn.silu(g) * u


def test_values_and_gradients_are_the_plain_expressions():
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    np.testing.assert_array_equal(swiglu(x, y), _plain_swiglu(x, y))
    got = jax.grad(lambda *a: jnp.sum(jnp.sin(swiglu(*a))), argnums=(0, 1))(x, y)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(_plain_swiglu(*a))), argnums=(0, 1))(x, y)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _temp_bytes(act) -> int:
    """Temporaries of the gradient of LAYERS bf16 SwiGLU MLP blocks of T tokens using ``act``."""
    def loss(ws, x):
        for w_in, w_gate, w_out in ws:
            h = act(x @ w_gate.astype(jnp.bfloat16), x @ w_in.astype(jnp.bfloat16))
            x = x + h @ w_out.astype(jnp.bfloat16)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    ws = [(jnp.ones((D, F)), jnp.ones((D, F)), jnp.ones((F, D))) for _ in range(LAYERS)]
    compiled = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((T, D), jnp.bfloat16)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_backward_keeps_fewer_tensors():
    """Measured from the compiled program: one ``[T, F]`` bf16 array fewer per layer whose
    activations wait for the backward (all but the last: the backward starts with it)."""
    saved = _temp_bytes(_plain_swiglu) - _temp_bytes(swiglu)
    assert saved >= (LAYERS - 1) * T * F * 2, saved / (T * F * 2)


class _Dense(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 8)))
        self.v = nnx.Param(jnp.ones((8, 8)))


def _graph(loss):
    from jaxpar.auto import build_graph
    return build_graph(nnx.eval_shape(_Dense), loss, jax.ShapeDtypeStruct((4, 8), np.float32))


def test_the_strategy_search_reads_swiglu_as_fused_work_and_an_outer_checkpoint_as_a_region():
    """jaxpar.auto: the checkpoint of ``swiglu`` alone (elementwise work) is no recompute region,
    its operators marked ``recomputed``; a checkpoint of the user's around a block with a matmul
    and ``swiglu`` is still one region holding the SwiGLU's operators, under its policy; in a
    scan, what silu computes is not kept per iteration, the matmuls' values are."""
    from jaxpar.auto.cost import analyse

    def alone(model, x):
        return (swiglu(x @ model.w[...], x @ model.v[...]) @ model.v[...]).sum()

    graph = _graph(alone)
    assert not graph.regions
    act = [op for op in graph.ops if op.get("recomputed")]
    assert act and all(op.region == -1 and op.keep == "device" for op in act)
    assert all(op.prim != "dot_general" for op in act)

    def block(model, x):
        return jax.checkpoint(lambda x: swiglu(x @ model.w[...], x @ model.v[...]) @ model.v[...],
                              policy=jax.checkpoint_policies.dots_saveable)(x).sum()

    graph = _graph(block)
    (region,) = graph.regions
    inside = graph.ops[region.first:region.last + 1]
    assert sum(op.prim == "dot_general" for op in inside) == 3
    assert all(not op.get("recomputed") for op in graph.ops)
    assert {op.keep for op in inside if op.prim == "logistic"} == {"recompute"}

    def scanned(act):
        def loss(model, x):
            def body(h, _):
                return act(h @ model.w[...], h @ model.v[...]) @ model.v[...], None
            return jax.lax.scan(body, x, None, length=3)[0].sum()
        graph = _graph(loss)
        flags = analyse(graph)
        return {op.prim: flags.saved[op.outs[0]] for op in graph.ops if op.prim in ("logistic", "dot_general")}

    assert scanned(_plain_swiglu) == {"logistic": True, "dot_general": True}     # stacked for the backward
    assert scanned(swiglu) == {"logistic": False, "dot_general": True}           # recomputed from g and u
