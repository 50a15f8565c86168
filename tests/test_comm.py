"""Communication and memory of compiled programs equal what theory says (read from the HLO)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from helpers import MEGATRON, TINY, batches
from jaxpar.models.gpt import GPT, Block, loss_fn
from jaxpar.nn.specs import state_specs, to_shardings
from jaxpar.report import collectives, memory


def _param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_data_parallel_all_reduces_the_gradient_bytes():
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(cfg)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh), optax.adamw(1e-3),
                             loss_fn, cfg, mesh)
    cols = collectives(trainer.lower(batches(1)[0]).compile(), mesh)
    assert {c.kind for c in cols} == {"all-reduce"}
    assert all(c.mesh_axes == ("data",) for c in cols)
    # XLA combines the gradients (and the scalar loss) into tuple all-reduces.
    scalars = sum(4 for c in cols for shape in c.shapes if shape == ())
    assert sum(c.bytes for c in cols) - scalars == _param_bytes(trainer.params)
    assert scalars <= 8      # the loss (and nothing else)


def test_megatron_block_one_all_reduce_per_sublayer():
    """Attention and MLP with heads / mlp split over 'model': one all-reduce each, of the activation size."""
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    graphdef, state = nnx.split(Block(TINY, nnx.Rngs(0)))
    shardings = to_shardings(state_specs(cfg, mesh, state), mesh)
    b, s, e = 8, TINY.seq_len, TINY.embed
    x_sharding = NamedSharding(mesh, P("data", None, None))

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    compiled = jax.jit(forward, in_shardings=(shardings, x_sharding), out_shardings=x_sharding).lower(
        jax.device_put(state, shardings), jax.device_put(jnp.ones((b, s, e)), x_sharding)).compile()
    cols = collectives(compiled, mesh)
    assert [c.kind for c in cols] == ["all-reduce", "all-reduce"], [(c.kind, c.shapes) for c in cols]
    activation_bytes = (b // 2) * s * e * 4
    assert [c.bytes for c in cols] == [activation_bytes, activation_bytes]
    assert all(c.mesh_axes == ("model",) for c in cols)


def test_parameter_split_8_ways_takes_one_eighth_of_argument_bytes():
    cfg = jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy={"w": (8, 1)})

    class Wide(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((1024, 256)))

        def __call__(self, x):
            return x @ self.w[...].T

    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(Wide, cfg, mesh)
    graphdef, state = nnx.split(model)
    shardings = to_shardings(state_specs(cfg, mesh, state), mesh)
    compiled = jax.jit(lambda st: nnx.merge(graphdef, st).w[...].sum(), in_shardings=(shardings,)).lower(state).compile()
    full = 1024 * 256 * 4
    assert memory(compiled).argument_bytes == full // 8
    # and through the Trainer: parameters + both Adam moments, each 1/8, plus the replicated batch.
    trainer = jaxpar.Trainer(model, optax.adam(1e-3), lambda m, b: jnp.mean(m(b["x"]) ** 2), cfg, mesh)
    batch = {"x": np.ones((8, 256), np.float32)}
    args = memory(trainer.lower(batch).compile()).argument_bytes
    assert args == 3 * full // 8 + 4 + 4 + batch["x"].nbytes    # + Adam's int32 count + the TrainState step
