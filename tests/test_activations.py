"""The models' SwiGLU (jaxpar.ops.swiglu): the plain expression's values and gradients, with
fewer bytes kept for the backward in the compiled program, whatever checkpoint encloses it."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.models.llama import MLP, LlamaConfig
from jaxpar.ops import swiglu

T, D, F, LAYERS = 4096, 256, 1024, 3


def _plain_swiglu(g, u):
    return jax.nn.silu(g) * u


def _grads(act, x, y):
    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(act(*a)).astype(jnp.float32)), argnums=(0, 1)))(x, y)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -8)])
def test_values_and_gradients_are_the_plain_expressions(dtype, tol):
    """Computed in the inputs' dtype as JAX's derivative of the plain expression: fp32 within
    1e-6, bf16 within one bf16 rounding (8 bits of mantissa)."""
    x = 4 * jax.random.normal(jax.random.key(0), (64, 32), dtype)
    y = jax.random.normal(jax.random.key(1), (64, 32), dtype)
    np.testing.assert_array_equal(swiglu(x, y), _plain_swiglu(x, y))
    for a, b in zip(_grads(swiglu, x, y), _grads(_plain_swiglu, x, y)):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)


def test_it_works_under_vmap_scan_and_shard_map():
    x = jax.random.normal(jax.random.key(0), (8, 4, 16), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (8, 4, 16), jnp.float32)

    def scanned(act):
        return lambda g, u: jax.lax.scan(lambda c, gu: (c + act(*gu) * c, None), jnp.ones((4, 16)), (g, u))[0]

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def mapped(act):
        return jax.shard_map(act, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))

    for wrap in (jax.vmap, scanned, mapped):
        got, want = wrap(swiglu)(x, y), wrap(_plain_swiglu)(x, y)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for a, b in zip(_grads(wrap(swiglu), x, y), _grads(wrap(_plain_swiglu), x, y)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


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

    assert _scanned(_plain_swiglu) == {"logistic": True, "dot_general": True}     # stacked for the backward
    assert _scanned(swiglu) == {"logistic": False, "dot_general": True}          # recomputed from g and u


def _scanned(act) -> dict:
    """Whether the strategy search's cost model keeps silu's sigmoid and the matmuls of three
    scanned layers ``act(h @ w, h @ v) @ v`` for the backward."""
    from jaxpar.auto.cost import analyse

    def loss(model, x):
        def body(h, _):
            return act(h @ model.w[...], h @ model.v[...]) @ model.v[...], None
        return jax.lax.scan(body, x, None, length=3)[0].sum()
    graph = _graph(loss)
    flags = analyse(graph)
    return {op.prim: flags.saved[op.outs[0]] for op in graph.ops if op.prim in ("logistic", "dot_general")}


@jax.custom_vjp
def _keeps_sigmoid(g, u):
    return jax.nn.silu(g) * u


def _keeps_sigmoid_fwd(g, u):
    s = jax.nn.sigmoid(g)
    return g * s * u, (g, u, s)


def _keeps_sigmoid_bwd(res, ct):
    g, u, s = res
    return ct * u * s * (1 + g * (1 - s)), ct * g * s


_keeps_sigmoid.defvjp(_keeps_sigmoid_fwd, _keeps_sigmoid_bwd)


def test_the_strategy_search_reads_what_the_custom_vjp_keeps():
    """swiglu is a custom_vjp: the graph reads what its forward keeps (its inputs), so in a loop
    silu's values are not stacked (another elementwise custom_vjp keeping its sigmoid is read
    as its primal: stacked), and under a user's checkpoint saving everything they are
    recomputed all the same (the product, which the down projection reads, stays the policy's)."""
    assert _scanned(swiglu) == {"logistic": False, "dot_general": True}
    assert _scanned(_keeps_sigmoid) == {"logistic": True, "dot_general": True}

    def block(model, x):
        return jax.checkpoint(lambda x: swiglu(x @ model.w[...], x @ model.v[...]) @ model.v[...],
                              policy=jax.checkpoint_policies.everything_saveable)(x).sum()

    graph = _graph(block)
    (region,) = graph.regions
    inside = graph.ops[region.first:region.last + 1]
    keep = [(op.prim, op.keep) for op in inside if op.prim in ("logistic", "mul")]
    assert keep == [("logistic", "recompute"), ("mul", "recompute"), ("mul", "device")], keep


def _saved(fn, *args) -> list[str]:
    """print_saved_residuals of ``fn``, less the arguments."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


def _shapes(lines) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in re.match(r"\w+\[([\d,]*)\]", line).group(1).split(",")) for line in lines]


CFG = LlamaConfig.named("tiny", scan_layers=True, layers=3, mlp=96)     # mlp: no other width is 96


def test_an_enclosing_checkpoint_keeps_no_intermediate_of_silu():
    """A checkpoint's policy applies to the checkpoints nested in it; swiglu's backward keeps
    its inputs whatever encloses it: of a Llama MLP under everything_saveable the [tokens, mlp]
    residuals are gate, up and their product (the down projection's input, which the plain
    program keeps too), not silu's."""
    graph, params = nnx.split(MLP(CFG, nnx.Rngs(0)))
    x = jnp.ones((2, 16, CFG.embed))
    mlp = jax.checkpoint(lambda p: jnp.sum(jnp.sin(nnx.merge(graph, p)(x))),
                         policy=jax.checkpoint_policies.everything_saveable)
    assert _shapes(_saved(mlp, params)).count((2, 16, CFG.mlp)) == 3, _saved(mlp, params)
