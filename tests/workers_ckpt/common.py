"""Models and trainers shared by the checkpoint tests and their worker processes."""

from __future__ import annotations

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from helpers import LR, MEGATRON, TINY, batches  # noqa: E402,F401
from jaxpar.models.gpt import GPT, loss_fn  # noqa: E402

DATA8 = dict(mesh={"data": 8}, mode="data")
MEGATRON_2x4 = dict(mesh={"data": 2, "model": 4}, rules=MEGATRON)
ONE = dict(mesh={"data": 1})


def mesh_for(config):
    sizes = config.mesh.values()
    n = math.prod(sizes) if -1 not in sizes else len(jax.devices())
    return jaxpar.make_mesh(config, devices=jax.devices()[:n])


def gpt_trainer(config: dict | jaxpar.ParallelConfig, **trainer_options) -> jaxpar.Trainer:
    """The tiny GPT with adamw under ``config`` (same initial model for every layout)."""
    config = config if isinstance(config, jaxpar.ParallelConfig) else jaxpar.ParallelConfig(**config)
    mesh = mesh_for(config)
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(LR), loss_fn, config, mesh, **trainer_options)


def run(trainer, steps: int) -> list[float]:
    """``steps`` steps on the step-indexed example data, from ``trainer.step_count``."""
    start = trainer.step_count
    return [float(trainer.step(b)["loss"]) for b in batches(start + steps)[start:]]


class DropoutMLP(nnx.Module):
    """A small MLP whose dropout layer keeps an RNG stream in the model (``nnx.RngState``).

    The dropout is deterministic: ``Trainer.step`` cannot yet advance an RNG stream held in the
    model (flax raises ``TraceContextError``), so the stream is only carried and checkpointed.
    """

    def __init__(self, width: int = 32, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.up = nnx.Param(init(rngs.params(), (TINY.vocab_size, width)), out_sharding=("vocab", "mlp"), eager_sharding=False)
        self.down = nnx.Param(init(rngs.params(), (width, TINY.vocab_size)), out_sharding=("mlp", "vocab"), eager_sharding=False)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)

    def __call__(self, tokens):
        return self.drop(jax.nn.relu(self.up[...][tokens])) @ self.down[...]


def mlp_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def mlp_trainer(config: dict | None = None, **trainer_options) -> jaxpar.Trainer:
    config = jaxpar.ParallelConfig(**(config or DATA8))
    mesh = mesh_for(config)
    model = jaxpar.init(lambda: DropoutMLP(rngs=nnx.Rngs(0, dropout=1)), config, mesh)
    return jaxpar.Trainer(model, optax.adam(1e-2), mlp_loss, config, mesh, **trainer_options)


class Big(nnx.Module):
    """One large weight, split over ``model`` by its logical names (for memory and kill tests)."""

    def __init__(self, rows: int, cols: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((rows, cols), jnp.float32), out_sharding=("embed", "mlp"), eager_sharding=False)

    def __call__(self, x):
        return x @ self.w[...]


def big_trainer(rows: int, cols: int, config: dict, tx=None) -> jaxpar.Trainer:
    config = jaxpar.ParallelConfig(**config)
    mesh = mesh_for(config)
    model = jaxpar.init(lambda: Big(rows, cols, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, tx or optax.sgd(0.1), lambda m, b: jnp.mean(m(b)), config, mesh)


def fill(trainer, base: np.ndarray, offset: float) -> None:
    """Set the big weight to ``base + offset``, sharded as planned."""
    sharding = trainer.params["w"].get_value().sharding
    value = jax.make_array_from_callback(base.shape, sharding, lambda idx: base[idx] + np.float32(offset))
    trainer.params["w"].set_value(value)


def sums(trainer) -> dict[str, list[int]]:
    """A checksum per leaf: jaxpar's two 32-bit sums of its bits, the same in any layout and for
    arrays spread over several processes (a float sum would differ with the reduction order)."""
    from jaxpar.checkpoint.checksum import checksums
    from jaxpar.checkpoint.state import flat_state, savable

    return checksums(savable(flat_state(trainer)))


def values(trainer) -> dict[str, np.ndarray]:
    """Every leaf as a host array (key arrays as their key data)."""
    from jaxpar.checkpoint.state import flat_state, savable

    return {p: np.asarray(x) for p, x in savable(flat_state(trainer)).items()}


def assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for path in expected:
        np.testing.assert_array_equal(actual[path], expected[path], err_msg=path)
