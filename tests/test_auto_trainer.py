"""mode="auto" in the Trainer: search on the first batch, then train the plan, equal to one device."""

import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, assert_losses_close, batches, reference
from jaxpar.models.gpt import GPT, loss_fn


@pytest.mark.parametrize("search", ["dynamic_programming", "sharding_propagation"])
def test_auto_trains_like_one_device(search):
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto", search=search)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, mesh)
    with pytest.raises(ValueError, match="plans at the first batch"):
        trainer.model
    losses = [float(trainer.step(b)["loss"]) for b in batches()]
    assert trainer.config.mode == "semi_auto" and trainer.plan is not None
    assert_losses_close(losses, reference()[0])
    assert "blocks/0/mlp/up" in trainer.plan.table()


def test_auto_with_example_batch_plans_at_construction():
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="auto", search="recursive_programming")
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, mesh,
                             example_batch=batches(1)[0])
    assert trainer.plan is not None and trainer.params is not None
    assert np.isfinite(float(trainer.step(batches(1)[0])["loss"]))
