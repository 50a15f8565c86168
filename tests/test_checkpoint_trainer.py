"""Trainer(checkpoint_dir=..., save_every=N): periodic asynchronous saves and automatic resume."""

import optax
from flax import nnx

import jaxpar
from helpers import TINY, batches
from jaxpar.models.gpt import GPT, loss_fn


def _trainer(config, mesh, directory):
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, checkpoint_dir=directory,
                          save_every=2, keep=2)


def test_periodic_save_and_resume(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    data = batches(6)
    first = _trainer(config, mesh, str(tmp_path))
    for b in data:
        first.step(b)
    first.checkpointer.wait()
    # A new trainer on the same directory resumes from the newest complete step (6), keeping 2.
    resumed = _trainer(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}), jaxpar.make_mesh({"data": 2, "model": 4}),
                       str(tmp_path))
    assert resumed.step_count == 6
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "6"]
    # and trains on as the first would have.
    nxt = batches(7)[6]
    a, b = float(first.step(nxt)["loss"]), float(resumed.step(nxt)["loss"])
    assert abs(a - b) <= 1e-5 * abs(a)
    first.checkpointer.close()
    resumed.checkpointer.close()
