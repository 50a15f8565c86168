"""Batches placed by dataset_strategy: batch axes by default, full batch, and H/W splits of images."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.data import batch_axes, leaf_spec


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(8, 4, (3, 3), padding="SAME", rngs=rngs)

    def __call__(self, x):
        return self.conv2(jax.nn.relu(self.conv1(x)))


def _images():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16, 16, 3)).astype(np.float32)
    return {"x": x, "y": rng.normal(size=(4, 16, 16, 4)).astype(np.float32)}


def _mse(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)


def _train(config, n):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    model = jaxpar.init(lambda: ConvNet(nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adam(1e-2), _mse, config, mesh)
    return [float(trainer.step(_images())["loss"]) for _ in range(3)], trainer


def test_batch_and_spatial_split_matches_one_device():
    """Images NHWC split over batch (2), H (2) and W (2): XLA exchanges halos; numerics unchanged."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "h": 2, "w": 2}, dataset_strategy=(2, 2, 2, 1))
    losses, trainer = _train(config, 8)
    ref, _ = _train(jaxpar.ParallelConfig(mesh={"data": 1}), 1)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    placed = trainer.place(_images())
    assert placed["x"].sharding.spec == P("data", "h", "w", None)
    assert placed["x"].addressable_shards[0].data.shape == (2, 8, 8, 3)


def test_default_full_batch_and_mode_data():
    sizes = jaxpar.make_mesh({"data": 2, "model": 4})
    assert leaf_spec(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}), sizes, (8, 3)) == P("data")
    assert leaf_spec(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, dataset_strategy="full_batch"),
                     sizes, (8, 3)) == P()
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="data")
    assert batch_axes(cfg, sizes) == ("data", "model")
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"batch": ("data", "model")})
    assert leaf_spec(cfg, sizes, (8, 3)) == P(("data", "model"))


def test_batch_not_divisible_names_the_fix():
    mesh = jaxpar.make_mesh({"data": 8})
    with pytest.raises(ValueError, match=r"batch leaf of shape \(12, 3\).*not divisible by 8.*multiple of 8"):
        leaf_spec(jaxpar.ParallelConfig(mesh={"data": 8}), mesh, (12, 3))
    # grad_accum / interleave: the step splits a global batch of 16 (a multiple of 8) into 4
    # parts of 4 rows, which do not divide over 8: the fix is a multiple of 32, not of 8.
    # The step names the global batch before it cuts it.
    for extra, name, smaller in ((dict(grad_accum=4), "grad_accum=4", "grad_accum"),
                                 (dict(grad_accum=2, interleave=2), "grad_accum=2 x interleave=2",
                                  "grad_accum or interleave")):
        config = jaxpar.ParallelConfig(mesh={"data": 8}, **extra)
        model = jaxpar.init(lambda: nnx.Linear(3, 3, rngs=nnx.Rngs(0)), config, mesh)
        trainer = jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b: jnp.mean(m(b["x"]) ** 2), config, mesh)
        with pytest.raises(ValueError, match=rf"batch\['x'\] has 16 rows: {name} cuts it into 4 parts of 4 rows, "
                                             rf"and each part is split over the batch axes \('data',\) \(8 devices\), "
                                             rf"so the global batch must be a multiple of 32 = 8 x 4; use a global "
                                             rf"batch of 32, or a smaller {smaller}"):
            trainer.step({"x": np.ones((16, 3), np.float32)})
    # the advice matches what the batch is for: grad_accum cuts a training batch only
    accum = jaxpar.ParallelConfig(mesh={"data": 8}, grad_accum=4)
    with pytest.raises(ValueError, match=r"batch leaf of shape \(12, 3\): the batch dimension 12 is not divisible by 8, "
                                         r"the size of the batch axes \('data',\) of mesh \{'data': 8\}; use a batch "
                                         r"that is a multiple of 8 \(e.g. 8 or 16\)$"):
        leaf_spec(accum, mesh, (12, 3), training=False)          # an evaluation batch: grad_accum does not apply
    with pytest.raises(ValueError, match=r"multiple of 8 \(e.g. 8 or 16\)$"):
        jaxpar.data.place_batch(accum, mesh, {"x": np.ones((12, 3), np.float32)})    # placing splits it whole
    with pytest.raises(ValueError, match=r"batch leaf of shape \(16, 3\) has 16 rows: grad_accum=4 cuts it into 4 parts "
                                         r"of 4 rows.*multiple of 32 = 8 x 4; use a global batch of 32, or a smaller "
                                         r"grad_accum"):
        leaf_spec(accum, mesh, (16, 3), training=True)           # a training step's global batch
    # not known (a training batch, one of its parts, or an evaluation batch): both are named
    with pytest.raises(ValueError, match=r"shape \(4, 3\).*not divisible by 8.*use a training batch that is a multiple "
                                         r"of 32 = 8 x 4 \(a training step cuts it into 4 parts, grad_accum=4, .*\) and an "
                                         r"evaluation batch that is a multiple of 8$"):
        leaf_spec(accum, mesh, (4, 3))
    assert leaf_spec(accum, mesh, (8, 3), training=False) == P("data")
    with pytest.raises(ValueError, match="factor 2 does not divide dimension 1 of size 15"):
        leaf_spec(jaxpar.ParallelConfig(mesh={"data": 2, "h": 4}, dataset_strategy=(2, 2, 1)),
                  jaxpar.make_mesh({"data": 2, "h": 4}), (4, 15, 3))


def test_dataset_strategy_per_batch_key():
    """Images split over batch, H and W; their labels only over the batch (one strategy per key)."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "h": 2, "w": 2},
                                   dataset_strategy={"x": (2, 2, 2, 1), "y": (2, 1, 1, 1), "label": [2]})
    assert config.dataset_strategy["label"] == (2,)
    assert jaxpar.ParallelConfig.from_dict(config.to_dict()) == config
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: ConvNet(nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adam(1e-2), _mse, config, mesh)
    batch = {**_images(), "label": np.arange(4, dtype=np.int32)}
    placed = trainer.place(batch)
    assert placed["x"].sharding.spec == P("data", "h", "w", None)
    assert placed["label"].sharding.spec == P("data")
    assert np.isfinite(float(trainer.step(batch)["loss"]))
    with pytest.raises(ValueError, match=r"keys \['label', 'x', 'y'\].*under 'extra'"):
        trainer.place({**batch, "extra": np.ones(4)})


def test_the_batch_layout_is_a_value_the_plan_reads_once():
    """BatchLayout.of(config, mesh) is the whole batch layout of a job: it prints what it
    decided, equals the layout of the same inputs and differs when one of them does; the plan
    reads it once (plan.batch_layout) and its batch specs are the layout's."""
    from jaxpar.data import BatchLayout
    from jaxpar.models.gpt import GPT, GPTConfig

    config = jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, rules={"batch": "data", "mlp": "model"},
                                   grad_accum=2)
    layout = BatchLayout.of(config, {"data": 4, "model": 2})
    assert str(layout) == "batch over ('data',); a training step cuts it into grad_accum=2"
    assert "axes=('data',)" in repr(layout) and "parts={'grad_accum': 2}" in repr(layout)
    assert layout == BatchLayout.of(config, jaxpar.make_mesh(config)) and hash(layout) == hash(
        BatchLayout.of(config, {"data": 4, "model": 2}))
    assert layout != BatchLayout.of(jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, rules={"batch": "data"}),
                                    {"data": 4, "model": 2})
    assert layout.specs({"x": np.zeros((16, 3)), "n": np.zeros(())}, training=True) == {"x": P("data"), "n": P()}
    with pytest.raises(ValueError, match=r"batch\['x'\] has 12 rows: grad_accum=2 cuts it into 2 parts of 6 rows"):
        layout.check_parts({"x": np.zeros((12, 3))})
    assert layout.micro({"x": np.arange(4)})["x"].shape == (1, 4)       # no pipeline: one micro-batch

    piped = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"batch": "data", "layers": "pipe"},
                                  pipeline={"stages": 2, "microbatches": 4}, context=None)
    assert str(BatchLayout.of(piped, {"pipe": 2, "data": 4})) == (
        "batch over ('data',); the pipeline cuts each part into 4 micro-batches")
    assert BatchLayout.of(piped, {"pipe": 2, "data": 4}).micro({"x": np.arange(8)})["x"].tolist() == [
        [0, 4], [1, 5], [2, 6], [3, 7]]

    model = nnx.eval_shape(lambda: GPT(GPTConfig(vocab_size=16, seq_len=8, embed=16, heads=2, mlp=32, layers=1),
                                       rngs=nnx.Rngs(0)))
    plan = jaxpar.make_train_plan(config, {"data": 4, "model": 2}, model, optax.sgd(0.1))
    assert plan.batch_layout is plan.batch_layout and plan.batch_layout == layout
    assert plan.batch_specs({"x": np.zeros((16, 3))}) == {"x": P("data")}
    assert jaxpar.TrainPlan.from_dict(plan.to_dict()).batch_layout == layout
