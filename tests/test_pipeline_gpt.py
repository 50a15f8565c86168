"""The example GPT pipelined by the Trainer: every schedule equals the one-device run."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import batches
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.gpt_parallel import pipeline_loss

# one worker runs this module: its module-scoped fixtures are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("test_pipeline_gpt")

GPT4 = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=4, scan_layers=True)
RULES = {"layers": "pipe", "batch": "data", "heads": "model", "mlp": "model"}


def _train(config, n=None, gpt=GPT4):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n] if n else None)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), pipeline_loss(), config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(5)]
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), trainer


@pytest.fixture(scope="module")
def reference():
    losses, params, _ = _train(jaxpar.ParallelConfig(mesh={"data": 1}), 1)
    return losses, params


def _assert_matches(result, reference):
    losses, params, _ = result
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1])):
        assert np.linalg.norm(a - e) / np.linalg.norm(e) <= 1e-5


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
MESHES = [{"pipe": 2, "data": 4}, {"pipe": 4, "data": 2}, {"pipe": 2, "data": 2, "model": 2}]
CASES = [(mesh, schedule, v) for mesh in MESHES for schedule, v in SCHEDULES
         if not (mesh["pipe"] == 4 and v == 2)]      # 4 layers cannot make 4 stages x 2 chunks


@pytest.mark.parametrize("mesh, schedule, v", CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_pipelined_gpt_matches_one_device(reference, mesh, schedule, v):
    config = jaxpar.ParallelConfig(mesh=mesh, rules={k: r for k, r in RULES.items() if r in mesh},
                                   pipeline={"stages": mesh["pipe"], "microbatches": 4, "schedule": schedule,
                                             "virtual_stages": v})
    result = _train(config)
    _assert_matches(result, reference)
    wq = result[2].params["blocks"]["attn"]["wq"].get_value()
    assert wq.sharding.spec[0] == "pipe"          # each stage holds only its layers
    assert wq.addressable_shards[0].data.shape[0] == GPT4.layers // mesh["pipe"]


def test_pipeline_needs_a_pipeline_loss():
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe"},
                                   pipeline={"stages": 2, "microbatches": 4})
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), config, mesh)
    from jaxpar.models.gpt import loss_fn

    with pytest.raises(TypeError, match="PipelineLoss"):
        jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)


def test_pipeline_composes_with_zero_accumulation_and_recompute(reference):
    """pipe × data × model with ZeRO-1, grad_accum=2 and full recompute, in one compiled step."""
    config = jaxpar.ParallelConfig(
        mesh={"pipe": 2, "data": 2, "model": 2}, rules=RULES, optimizer={"level": 1, "threshold_kb": 0},
        grad_accum=2, remat="full", pipeline={"stages": 2, "microbatches": 2, "schedule": "1f1b"})
    result = _train(config)
    _assert_matches(result, reference)
    mu = result[2].opt_state[0].mu["blocks"]["mlp"]["up"].get_value()
    assert "data" in str(mu.sharding.spec)        # optimizer state sharded over the data axis


def test_restore_into_another_stage_count(tmp_path, reference):
    """A checkpoint from pipe=2 restores into pipe=4 and into an unpipelined trainer."""
    two = _train(jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                       pipeline={"stages": 2, "microbatches": 4}))[2]
    two.save(str(tmp_path))
    nxt = batches(6)[5]
    expected = float(two.step(nxt)["loss"])
    for config in (jaxpar.ParallelConfig(mesh={"pipe": 4, "data": 2}, rules={"layers": "pipe", "batch": "data"},
                                         pipeline={"stages": 4, "microbatches": 4}),
                   jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")):
        mesh = jaxpar.make_mesh(config)
        trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(GPT4, rngs=nnx.Rngs(1)), config, mesh),
                                 optax.adamw(1e-3), pipeline_loss(), config, mesh)
        trainer.restore(str(tmp_path))
        assert trainer.step_count == 5
        np.testing.assert_allclose(float(trainer.step(nxt)["loss"]), expected, rtol=1e-5)


def test_the_models_parallel_modules_run_their_examples():
    """The pipeline parts beside each model (`jaxpar.models.gpt_parallel`, `llama_parallel`):
    their docstring examples run."""
    import doctest

    from jaxpar.models import gpt_parallel, llama_parallel

    for module in (gpt_parallel, llama_parallel):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
