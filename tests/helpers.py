"""Shared pieces of the tests: the tiny GPT, a one-device reference, tree comparisons."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import warnings

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.auto import CostParams
from jaxpar.models.data import ArithmeticData
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

TINY = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=2)
MEGATRON = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
BATCH = 16
STEPS = 5
LR = 1e-3
# machine numbers for strategy-search tests: slow enough devices that splitting pays off
COSTS = CostParams(flops_per_s=1e9, default_bandwidth=1e9, latency=1e-6)


def batches(n: int = STEPS, batch: int = BATCH, seq: int = TINY.seq_len):
    data = ArithmeticData(seq)
    return [data.batch(batch, i) for i in range(n)]


def mesh_for(config):
    n = math.prod(config.mesh.values()) if -1 not in config.mesh.values() else len(jax.devices())
    return jaxpar.make_mesh(config, devices=jax.devices()[:n])


def train_gpt(config, *, gpt: GPTConfig = TINY, steps: int = STEPS, tx=None):
    """Losses and final parameters (numpy) of ``steps`` adamw steps under ``config``."""
    mesh = mesh_for(config)
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    trainer = jaxpar.Trainer(model, tx or optax.adamw(LR), loss_fn, config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(steps)]
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    return losses, params, trainer


@functools.lru_cache(maxsize=4)
def reference(gpt: GPTConfig = TINY, steps: int = STEPS):
    """The same training on one device."""
    losses, params, _ = train_gpt(jaxpar.ParallelConfig(mesh={"data": 1}), gpt=gpt, steps=steps)
    return losses, params


def assert_close(actual, expected, rtol=1e-5, what="tree"):
    """Every leaf within ``rtol`` relative (in norm), and losses elementwise."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [p for p, _ in flat_a] == [p for p, _ in flat_e], f"{what}: structures differ"
    for (path, a), (_, e) in zip(flat_a, flat_e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, f"{what}{jax.tree_util.keystr(path)}: shape {a.shape} vs {e.shape}"
        err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
        assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol:.0e}"


def assert_losses_close(actual, expected, rtol=1e-5):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=0)


@contextlib.contextmanager
def no_unclosed_files():
    """Fails when the code inside leaves a file open (Python's ResourceWarning when it is collected)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked, f"files left open: {leaked}"
