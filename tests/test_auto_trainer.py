"""mode="auto" plans before the Trainer runs (jaxpar.train.plan_for): the search on an example
batch, or a search saved earlier; the Trainer trains that plan, equal to one device."""

import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, assert_losses_close, batches, reference
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.train import plan_for


@pytest.mark.parametrize("search", ["dynamic_programming", "sharding_propagation"])
def test_auto_trains_like_one_device(search):
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto", search=search)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, mesh,
                             example_batch=batches(1)[0])
    assert trainer.plan.source == f"searched:{search}" and trainer.searched.search == search
    losses = [float(trainer.step(b)["loss"]) for b in batches()]
    assert trainer.config.mode == "semi_auto"
    assert_losses_close(losses, reference()[0])
    assert "blocks/0/mlp/up" in trainer.plan.table()


def test_auto_without_a_batch_is_refused_at_construction():
    """The Trainer never plans at its first step: without example_batch (or a plan) mode "auto"
    is refused up front, naming both ways to give one."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="auto", search="recursive_programming")
    with pytest.raises(ValueError, match=r"mode='auto' searches .* example_batch=.*plan_for"):
        jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, jaxpar.make_mesh(config))



def test_a_refused_plan_leaves_no_checkpointer_open(tmp_path, monkeypatch):
    """The checkpoint directory is opened before planning (a bad one is refused first); a plan
    refused after it closes it again."""
    import jaxpar.train.checkpointing as trainer_module      # where the checkpoint service opens it

    closed = []

    class Recording(trainer_module.Checkpointer):
        def close(self):
            closed.append(True)
            super().close()

    monkeypatch.setattr(trainer_module, "Checkpointer", Recording)
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="auto", search="recursive_programming")
    with pytest.raises(ValueError, match="example_batch="):
        jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, jaxpar.make_mesh(config),
                       checkpoint_dir=str(tmp_path / "ckpt"))
    assert closed == [True]


def test_plan_for_from_a_batch_or_a_saved_search(tmp_path):
    """``plan_for`` on a batch, the search saved and read back, and the Trainer given the plan:
    the same plan each way, and the Trainer trains it without searching."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="auto", search="recursive_programming")
    mesh = jaxpar.make_mesh(config)
    model, tx = GPT(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-3)
    plan, found = plan_for(model, tx, loss_fn, config, mesh, example_batch=batches(1)[0])
    found.to_json(str(tmp_path / "search.json"))
    again, saved = plan_for(model, tx, loss_fn, config, mesh, searched=jaxpar.auto.Strategy.from_json(str(tmp_path / "search.json")))
    assert again == plan and saved == found
    trainer = jaxpar.Trainer(model, tx, loss_fn, config, mesh, plan=plan)
    assert trainer.plan is plan and trainer.searched is None
    assert np.isfinite(float(trainer.step(batches(1)[0])["loss"]))
    with pytest.raises(TypeError, match="searched must be a jaxpar.auto.Strategy"):
        plan_for(model, tx, loss_fn, config, mesh, searched=str(tmp_path / "search.json"))
