"""jaxpar.shard on arrays (place / constrain), functions and NNX modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh({"data": 2, "model": 4})


def test_place_array_outside_jit(mesh):
    x = jaxpar.shard(np.arange(64.0).reshape(8, 8), (2, 4), mesh=mesh)
    assert x.sharding.spec == P("data", "model")
    assert x.addressable_shards[0].data.shape == (4, 2)


def test_constrain_inside_jit_with_set_mesh(mesh):
    @jax.jit
    def f(x):
        return jaxpar.shard(x * 2, (1, 4))

    with jax.set_mesh(mesh):
        y = f(jnp.ones((8, 8)))
    assert y.sharding.spec == P(None, "model")


def test_function_in_and_out_strategy(mesh):
    matmul = jaxpar.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)), out_strategy=((2, 4),), mesh=mesh)
    x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    y = jax.jit(matmul)(x, np.ones((8, 8), np.float32))
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_allclose(y, x @ np.ones((8, 8), np.float32), rtol=1e-5)


def test_module_wrapper_survives_split_merge(mesh):
    layer = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    wrapped = jaxpar.shard(layer, in_strategy=((2, 1),), out_strategy=((2, 4),), mesh=mesh)
    graphdef, state = nnx.split(wrapped)

    @jax.jit
    def f(state, x):
        return nnx.merge(graphdef, state)(x)

    y = f(state, jnp.ones((4, 8)))
    assert y.sharding.spec == P("data", "model")
    np.testing.assert_allclose(y, layer(jnp.ones((4, 8))), rtol=1e-6)


def test_wrong_number_of_strategies(mesh):
    f = jaxpar.shard(jnp.add, in_strategy=((2,),), mesh=mesh)
    with pytest.raises(ValueError, match="in_strategy has 1 entries but the function got/returned 2"):
        f(jnp.ones(4), jnp.ones(4))


def test_no_mesh_anywhere():
    with pytest.raises(ValueError, match="needs a mesh"):
        jaxpar.shard(np.ones(4), (2,))


def test_wrong_argument_kinds(mesh):
    with pytest.raises(TypeError, match="give in_strategy"):
        jaxpar.shard(jnp.add, (2,), mesh=mesh)
    with pytest.raises(TypeError, match="one strategy per value"):
        jaxpar.shard(jnp.add, in_strategy="data")


def test_logical_constraint_drops_conflicting_axes(mesh):
    constrain = jaxpar.LogicalConstraint(mesh, {"batch": "data", "embed": "data", "mlp": "model"})
    assert constrain.spec((4, 8, 8), ("batch", "seq", "embed")) == P("data", None, None)
    assert constrain.spec((4, 6), ("batch", "mlp")) == P("data", None)   # 6 not divisible by 4
