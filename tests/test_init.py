"""jaxpar.init: sharded from the start; parameter plans by logical names or by path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import MEGATRON, TINY, batches
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.nn import init_program


class ThirdPartyMLP(nnx.Module):
    """A model with no sharding annotations at all (written elsewhere)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_logical_rules_plan():
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh)
    state = nnx.state(model, nnx.Param)
    assert state["wte"].get_value().sharding.spec == P("model", None)
    assert state["blocks"][1]["attn"]["wo"].get_value().sharding.spec == P("model", None, None)
    assert state["ln_f"]["scale"].get_value().sharding.spec == P(None)


def test_no_device_holds_a_full_replica():
    """Every device holds 1/8 of a parameter split 8 ways — also inside the init program."""
    cfg = jaxpar.ParallelConfig(mesh={"model": 8}, parameter_plan={"up/kernel": (1, 8), "down/kernel": (8, 1)})
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), cfg, mesh)
    kernel = model.up.kernel.get_value()
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 8)}
    # The init program's outputs per device are the shards, not the full arrays.
    _, make = init_program(lambda: ThirdPartyMLP(nnx.Rngs(0)), cfg, mesh)
    compiled = make.lower().compile()
    out = jaxpar.report.memory(compiled).output_bytes
    full = (16 * 64 + 64 + 64 * 16 + 16) * 4
    split = (16 * 64 + 64 * 16) * 4 // 8 + (64 + 16) * 4
    assert split <= out <= split + 8 * 4 < full   # + the output tuple's pointer table


def test_parameter_plan_trains_third_party_model_like_one_device():
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x)}

    def mse(model, b):
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    def run(cfg, n):
        mesh = jaxpar.make_mesh(cfg, devices=jax.devices()[:n])
        model = jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), cfg, mesh)
        trainer = jaxpar.Trainer(model, optax.adam(1e-2), mse, cfg, mesh)
        return [float(trainer.step(batch)["loss"]) for _ in range(4)]

    plan = {"up/kernel": (1, 4), "up/bias": (4,), "down/kernel": (4, 1)}
    sharded = run(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, parameter_plan=plan), 8)
    np.testing.assert_allclose(sharded, run(jaxpar.ParallelConfig(mesh={"data": 1}), 1), rtol=1e-5)


def test_parameter_plan_errors():
    mesh = jaxpar.make_mesh({"model": 8})
    fn = lambda: ThirdPartyMLP(nnx.Rngs(0))  # noqa: E731
    with pytest.raises(ValueError, match=r"patterns \['upp/\*'\] match no parameter"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_plan={"upp/*": (1, 8)}), mesh)
    with pytest.raises(ValueError, match="matches several parameter_plan patterns"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_plan={"up/*": (1,), "*/bias": (1,)}), mesh)
    with pytest.raises(ValueError, match=r"parameter 'down/bias'.*factor 3 does not divide dimension 0 of size 16"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_plan={"down/bias": (3,)}), mesh)


def test_init_type_errors():
    mesh = jaxpar.make_mesh({"data": 8})
    with pytest.raises(TypeError, match="function that builds the model"):
        jaxpar.init(ThirdPartyMLP(nnx.Rngs(0)), jaxpar.ParallelConfig(), mesh)
    with pytest.raises(TypeError, match="expects a ParallelConfig"):
        jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), {"mesh": {"data": 8}}, mesh)


def test_trainer_errors():
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh)
    with pytest.raises(ValueError, match="pipeline.stages > 1 with mode='hybrid' is not supported"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, jaxpar.ParallelConfig(
            mesh={"data": 4, "pipe": 2}, mode="hybrid", pipeline={"stages": 2}), jaxpar.make_mesh({"data": 4, "pipe": 2}))
    with pytest.raises(ValueError, match="does not match the mesh"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}), mesh)
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jaxpar.Trainer(model, "adam", loss_fn, cfg, mesh)
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        jaxpar.Trainer({"w": 1}, optax.sgd(0.1), loss_fn, cfg, mesh)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, cfg, mesh)
    bad = {k: v[:6] for k, v in batches(1)[0].items()}
    with pytest.raises(ValueError, match=r"batch dimension 6 is not divisible by 8.*multiple of 8"):
        trainer.step(bad)
    with pytest.raises(ValueError, match="scalar loss"):
        jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b: m(b["inputs"]), cfg, mesh).step(batches(1)[0])
