"""jaxpar.ops on 8 simulated CPU devices: numerics and gradients against the unsharded
computation, the collectives XLA emits (from the optimized HLO), and the input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import ops
from jaxpar.report import collectives
from tests.conftest import requires_devices

pytestmark = requires_devices(8)

TOL = dict(rtol=1e-5, atol=1e-5)
CONV_DIMS = ("NHWC", "HWIO", "NHWC")


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh({"x": 2, "y": 4})


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def found(fn, mesh, *args):
    """Sorted (kind, mesh axes) of every collective in ``fn``'s optimized HLO."""
    compiled = jax.jit(fn).lower(*args).compile()
    return sorted((c.kind, c.mesh_axes) for c in collectives(compiled, mesh))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def grads_close(fn, ref, argnums, *args):
    """Gradients of a fixed random projection of the output: sharded vs unsharded."""
    probe = rand(*jax.eval_shape(ref, *args).shape, seed=99)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * probe), argnums))(*args)
    r = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * probe), argnums))(*args)
    jax.tree.map(close, g, r)


# ----------------------------------------------------------------------------- matmul

X, W = rand(16, 32, seed=1), rand(32, 8, seed=2)
K_SPLIT = ((2, 4), (4, 1))  # M over x, K over y


def test_matmul_k_split_all_reduces_by_default(mesh):
    f = lambda x, w: ops.matmul(x, w, in_strategy=K_SPLIT, mesh=mesh)
    y = jax.jit(f)(X, W)
    close(y, X @ W)
    assert y.sharding.spec == P("x", None) or y.sharding.spec == P("x")
    assert found(f, mesh, X, W) == [("all-reduce", ("y",))]


@pytest.mark.parametrize("out, spec", [(((8, 1),), P(("x", "y"), None)), (((2, 4),), P("x", "y"))])
def test_matmul_out_split_over_k_reduce_scatters(mesh, out, spec):
    f = lambda x, w: ops.matmul(x, w, in_strategy=K_SPLIT, out_strategy=out, mesh=mesh)
    y = f(X, W)  # eagerly
    close(y, X @ W)
    assert y.sharding.spec == spec
    assert found(f, mesh, X, W) == [("reduce-scatter", ("y",))]


def test_matmul_without_k_split_needs_no_communication(mesh):
    f = lambda x, w: ops.matmul(x, w, in_strategy=((2, 1), (1, 4)), mesh=mesh)
    close(f(X, W), X @ W)
    assert found(f, mesh, X, W) == []


@pytest.mark.parametrize("out", [None, ((8, 1),)])
def test_matmul_gradients(mesh, out):
    f = lambda x, w: ops.matmul(x, w, in_strategy=K_SPLIT, out_strategy=out, mesh=mesh)
    grads_close(f, jnp.matmul, (0, 1), X, W)


def test_matmul_strategy_forms_and_batch_dims(mesh):
    x3 = rand(4, 6, 32, seed=3)
    layout = jaxpar.Layout((2, 4), ("x", "y"))
    forms = [
        ((P("x", None, "y"), P("y", None)), ((2, 1, 1),)),
        ((layout("x", "None", "y"), None), None),  # w derived: K over y
        ((("batch", None, "embed"), ("embed", "mlp")), None),
    ]
    rules = {"batch": "x", "embed": "y"}
    for in_s, out_s in forms:
        y = jax.jit(lambda x, w: ops.matmul(x, w, in_strategy=in_s, out_strategy=out_s,
                                            mesh=mesh, rules=rules))(x3, W)
        close(y, x3 @ W)


def test_matmul_uses_the_mesh_from_set_mesh(mesh):
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: ops.matmul(x, w, in_strategy=K_SPLIT, out_strategy=((8, 1),)))(X, W)
    close(y, X @ W)
    assert y.sharding.spec == P(("x", "y"))


def test_dense_adds_the_bias_once(mesh):
    b = rand(8, seed=4)
    for in_s in [K_SPLIT, ((2, 1), (1, 4)), ((2, 4), (4, 1), (1,))]:
        f = lambda x, w, b: ops.dense(x, w, b, in_strategy=in_s, mesh=mesh)
        close(jax.jit(f)(X, W, b), X @ W + b)
    grads_close(lambda x, w, b: ops.dense(x, w, b, in_strategy=K_SPLIT, mesh=mesh),
                lambda x, w, b: x @ w + b, (0, 1, 2), X, W, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(in_strategy=((2, 4), (2, 1))), "K must be split the same way"),
    (dict(in_strategy=((P("x", "y"), P("y", "x")))), "already uses"),
    (dict(in_strategy=((P("x", "y"), P("x", None)))), "same axes"),
    (dict(in_strategy=((P("x", "z"), None))), "'z' is not in the mesh"),
    (dict(in_strategy=((2, 4), (4, 1)), out_strategy=((3, 1),)), "factor 3 does not divide dimension 0"),
])
def test_matmul_bad_strategies(mesh, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ops.matmul(X, W, mesh=mesh, **kwargs)


def test_matmul_bad_inputs(mesh):
    with pytest.raises(ValueError, match="does not divide dimension 0 of size 6"):
        ops.matmul(rand(6, 32), W, in_strategy=((4, 1), (1, 1)), mesh=mesh)
    with pytest.raises(TypeError, match="one strategy per tensor"):
        ops.matmul(X, W, in_strategy=(2, 4), mesh=mesh)
    with pytest.raises(ValueError, match="must equal w's first"):
        ops.matmul(X, rand(16, 8), mesh=mesh)
    with pytest.raises(ValueError, match="needs a mesh"):
        ops.matmul(X, W, in_strategy=K_SPLIT)


# ----------------------------------------------------------------------------- matmul_2d


def test_matmul_2d_numerics_gradients_and_collectives(mesh):
    f = lambda x, w: ops.matmul_2d(x, w, row_axis="x", col_axis="y", mesh=mesh)
    y = f(X, W)
    close(y, X @ W)
    assert y.sharding.spec == P("x", "y")
    assert found(f, mesh, X, W) == [("all-gather", ("x",)), ("reduce-scatter", ("y",))]
    grads_close(f, jnp.matmul, (0, 1), X, W)


def test_matmul_2d_bad_inputs(mesh):
    with pytest.raises(ValueError, match="both 'x'"):
        ops.matmul_2d(X, W, row_axis="x", col_axis="x", mesh=mesh)
    with pytest.raises(ValueError, match="mesh axis 'model', which is not in the mesh"):
        ops.matmul_2d(X, W, row_axis="model", col_axis="y", mesh=mesh)
    with pytest.raises(ValueError, match="not divisible by 4"):
        ops.matmul_2d(rand(16, 6), rand(6, 8), row_axis="x", col_axis="y", mesh=mesh)


# ----------------------------------------------------------------------------- embedding

TABLE = rand(10, 4, seed=5)
IDS = jnp.array([[0, 9, 3, 5], [4, 1, 2, 8]])
SPLIT = (4, 2, 3, 1)


def test_embedding_even_split(mesh):
    table = rand(8, 4, seed=6)
    ids = IDS % 8
    f = lambda ids, t: ops.embedding(ids, t, vocab_axis="y", batch_axis="x", mesh=mesh)
    close(f(ids, table), table[ids])
    assert found(f, mesh, ids, table) == [("all-reduce", ("y",))]
    grads_close(lambda t: f(ids, t), lambda t: t[ids], 0, table)


def test_embedding_manual_split(mesh):
    padded = ops.pad_for_manual_split(TABLE, SPLIT)
    assert padded.shape == (16, 4)
    close(ops.unpad(padded, SPLIT), TABLE)
    f = lambda ids, t: ops.embedding(ids, t, vocab_axis="y", manual_split=SPLIT, mesh=mesh)
    close(jax.jit(f)(IDS, padded), TABLE[IDS])
    assert found(f, mesh, IDS, padded) == [("all-reduce", ("y",))]
    close(f(IDS, TABLE), TABLE[IDS])  # an unpadded table is padded on the way
    probe = rand(2, 4, 4, seed=7)
    g = jax.jit(jax.grad(lambda t: jnp.sum(f(IDS, t) * probe)))(padded)
    r = jax.grad(lambda t: jnp.sum(t[IDS] * probe))(TABLE)
    close(ops.unpad(g, SPLIT), r)
    assert not np.asarray(g).reshape(4, 4, 4)[3, 1:].any()  # padding rows get no gradient


@pytest.mark.parametrize("split, message", [
    ((4, 2, 3, 2), "neither as the"),
    ((5, 5), "has 2 entries but vocab_axis"),
    ((4, 0, 3, 3), "at least one row"),
])
def test_embedding_bad_manual_split(mesh, split, message):
    with pytest.raises(ValueError, match=message):
        ops.embedding(IDS, TABLE, vocab_axis="y", manual_split=split, mesh=mesh)


def test_embedding_bad_inputs(mesh):
    with pytest.raises(ValueError, match="sums to 11 rows"):
        ops.pad_for_manual_split(TABLE, (4, 2, 3, 2))
    with pytest.raises(ValueError, match="not divisible by 4"):
        ops.embedding(IDS, TABLE, vocab_axis="y", mesh=mesh)
    with pytest.raises(ValueError, match="mesh axis 'vocab', which is not in the mesh"):
        ops.embedding(IDS, TABLE, vocab_axis="vocab", mesh=mesh)
    with pytest.raises(TypeError, match="must be integers"):
        ops.embedding(IDS * 1.0, TABLE, vocab_axis="x", mesh=mesh)


# ----------------------------------------------------------------------------- attention


def reference_attention(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("kv_heads, causal", [(8, True), (4, False)])
def test_attention_numerics_gradients_no_communication(mesh, kv_heads, causal):
    q, k, v = rand(2, 8, 8, 4, seed=8), rand(2, 8, kv_heads, 4, seed=9), rand(2, 8, kv_heads, 4, seed=10)
    f = lambda q, k, v: ops.attention(q, k, v, heads_axis="y", batch_axis="x", mesh=mesh, causal=causal)
    ref = lambda q, k, v: reference_attention(q, k, v, causal)
    out = f(q, k, v)
    close(out, jax.jit(ref)(q, k, v))
    assert out.sharding.spec == P("x", None, "y", None)
    assert found(f, mesh, q, k, v) == []
    grads_close(f, ref, (0, 1, 2), q, k, v)


def test_attention_bad_inputs(mesh):
    q = rand(2, 8, 6, 4)
    with pytest.raises(ValueError, match="6 heads .* not divisible by 4"):
        ops.attention(q, q, q, heads_axis="y", mesh=mesh)
    with pytest.raises(ValueError, match="mesh axis 'heads', which is not in the mesh"):
        ops.attention(q, q, q, heads_axis="heads", mesh=mesh)
    with pytest.raises(ValueError, match="must be different mesh axes"):
        ops.attention(q, q, q, heads_axis="x", batch_axis="x", mesh=mesh)


# ----------------------------------------------------------------------------- conv2d

IMG = rand(2, 16, 16, 3, seed=11)


def reference_conv(x, w, stride=1, padding="SAME"):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=CONV_DIMS)


@pytest.mark.parametrize("kwargs, kernel, permutes", [
    (dict(spatial_axes=("x", "y")), 3, {("x",): 2, ("y",): 2}),
    (dict(strategy=(1, 8, 1, 1)), 3, {("x", "y"): 2}),
    (dict(strategy=(2, 1, 4, 1), stride=2), 3, {("y",): 1}),  # SAME, stride 2: halo (0, 1)
    (dict(spatial_axes=("y", None)), 4, {("y",): 2}),          # even kernel: halo (1, 2)
    (dict(spatial_axes=(None, "y"), padding=((1, 1), (2, 2))), 5, {("y",): 2}),
])
def test_conv2d_matches_whole_image(mesh, kwargs, kernel, permutes):
    w = rand(kernel, kernel, 3, 5, seed=12)
    f = lambda x, w: ops.conv2d(x, w, mesh=mesh, **kwargs)
    ref = reference_conv(IMG, w, kwargs.get("stride", 1), kwargs.get("padding", "SAME"))
    close(jax.jit(f)(IMG, w), ref)
    kinds = found(f, mesh, IMG, w)
    assert {k for k, _ in kinds} == {"collective-permute"}
    assert {a: kinds.count(("collective-permute", a)) for _, a in kinds} == permutes


def test_conv2d_gradients(mesh):
    w = rand(3, 3, 3, 5, seed=13)
    f = lambda x, w: ops.conv2d(x, w, spatial_axes=("x", "y"), mesh=mesh)
    grads_close(f, reference_conv, (0, 1), IMG, w)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(spatial_axes=("y", None), padding="VALID"), ValueError, "does not split evenly"),
    (dict(spatial_axes=("y", None), stride=3), ValueError, "not divisible by the stride 3"),
    (dict(spatial_axes=("h", None)), ValueError, "mesh axis 'h', which is not in the mesh"),
    (dict(strategy=(1, 3, 1, 1)), ValueError, "factor 3 does not divide dimension 1"),
    (dict(spatial_axes=("x", "y"), strategy=(1, 2, 4, 1)), TypeError, "not both"),
])
def test_conv2d_bad_inputs(mesh, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.conv2d(IMG, rand(3, 3, 3, 5), mesh=mesh, **kwargs)


def test_conv2d_does_not_split_channels(mesh):
    with pytest.raises(ValueError, match="splits the channels"):
        ops.conv2d(rand(1, 8, 8, 4), rand(3, 3, 4, 2), strategy=(1, 1, 1, 2), mesh=mesh)


def test_public_names():
    assert sorted(ops.__all__) == sorted(
        ["AttentionMask", "ContextParallel", "ExpertDispatch", "attention", "chunked_cross_entropy", "context_attention", "context_order", "conv2d",
         "dense", "describe_balance", "embedding", "grouped_matmul", "matmul", "matmul_2d", "moe_dispatch", "pad_for_manual_split", "ragged_all_to_all_supported",
         "swiglu", "unpad"]
    )
