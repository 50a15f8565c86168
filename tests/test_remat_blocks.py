"""``ParallelConfig.remat`` on each block: block discovery, memory, numerics, the fallback and refusals."""

import dataclasses
import doctest
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import assert_close, assert_losses_close
from jaxpar.models.data import ArithmeticData
from jaxpar.models.gpt import GPTConfig
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn
from jaxpar.nn.blocks import find_blocks
from jaxpar.report import memory

# wide enough that activations dominate the temp memory of a step
WIDE = LlamaConfig(vocab_size=64, embed=32, heads=4, kv_heads=2, mlp=128, layers=3, max_seq_len=32)


def _lin(rngs=None):
    return nnx.Linear(2, 2, rngs=rngs or nnx.Rngs(0))


class Unrolled(nnx.Module):
    def __init__(self):
        self.embed = _lin()
        self.layers = nnx.List([_lin() for _ in range(3)])


class Named(nnx.Module):
    jaxpar_blocks = ("stack", "extra")

    def __init__(self):
        self.stack = nnx.List([_lin(), nnx.LayerNorm(2, rngs=nnx.Rngs(0))])   # two classes: not found alone
        self.extra = _lin()


class Plain(nnx.Module):
    """No repeated blocks: two modules of one class, but not in a sequence."""

    def __init__(self):
        self.up, self.down = _lin(), _lin()

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_find_blocks_scanned_unrolled_named_and_none():
    llama = lambda **kw: nnx.eval_shape(lambda: Llama(LlamaConfig.named("tiny", **kw), rngs=nnx.Rngs(0)))  # noqa: E731
    assert find_blocks(llama(scan_layers=True)) == ("blocks",)     # the scan body, not its submodules
    assert find_blocks(llama(layers=3)) == ("blocks/0", "blocks/1", "blocks/2")
    assert find_blocks(Unrolled()) == ("layers/0", "layers/1", "layers/2")
    assert find_blocks(Named()) == ("stack/0", "stack/1", "extra")  # the hook wins over the search
    assert find_blocks(Plain()) == ()
    mixed = Plain()
    mixed.parts = nnx.List([_lin(), nnx.LayerNorm(2, rngs=nnx.Rngs(0))])
    assert find_blocks(mixed) == ()                                # items of different classes
    ten = Unrolled()
    ten.layers = nnx.List([_lin() for _ in range(11)])
    assert find_blocks(ten)[-2:] == ("layers/9", "layers/10")      # items by index, not as strings


def test_find_blocks_refuses_bad_names():
    m = Plain()
    m.jaxpar_blocks = ("layers",)
    with pytest.raises(ValueError, match=r"Plain.jaxpar_blocks: the model has no module at 'layers'"):
        find_blocks(m)
    m.jaxpar_blocks = "up"
    with pytest.raises(TypeError, match=r"jaxpar_blocks='up': give a sequence of module paths"):
        find_blocks(m)
    m.jaxpar_blocks = ("up/kernel",)
    with pytest.raises(TypeError, match=r"names 'up/kernel', which holds a Param"):
        find_blocks(m)


def _trainer(cfg: LlamaConfig, remat: str = "none", *, blocks=None, edit=None):
    config = jaxpar.ParallelConfig(mesh={"data": 1}, mode="data", remat=remat)
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    model = Llama(cfg, rngs=nnx.Rngs(0))
    if blocks is not None:
        model.jaxpar_blocks = blocks        # () = no blocks: the whole-loss recompute of before
    if edit is not None:
        edit(model)
    return jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, config, mesh)


SCANNED = dataclasses.replace(WIDE, scan_layers=True)
BATCHES = [ArithmeticData(WIDE.max_seq_len).batch(16, i) for i in range(2)]


@pytest.fixture(scope="module")
def scanned():
    """Scanned-layer trainers: without recompute, recomputing every block by hand
    (``jaxpar.remat`` on the scan body), by ``ParallelConfig.remat``, and by
    ``ParallelConfig.remat`` around the whole loss (the model names no blocks)."""
    return {"none": _trainer(SCANNED), "by hand": _trainer(SCANNED, edit=lambda m: jaxpar.remat(m.blocks, "full")),
            "config": _trainer(SCANNED, "full"), "whole loss": _trainer(SCANNED, "full", blocks=())}


def test_scanned_model_recomputes_each_block_not_the_whole_loss(scanned):
    """``ParallelConfig.remat`` costs what recomputing each block by hand does, well under the
    step without recompute and under the whole-loss wrap (XLA keeps the scan's stacked
    activations there)."""
    temp = {name: memory(t.lower(BATCHES[0]).compile()).temp_bytes for name, t in scanned.items()}
    print("scanned temp: " + "  ".join(f"{name} {b:,}" for name, b in temp.items()))
    assert temp["config"] <= 1.05 * temp["by hand"]
    assert temp["config"] < 0.5 * temp["none"]
    assert temp["config"] < 0.5 * temp["whole loss"]


def test_scanned_block_recompute_keeps_numerics(scanned):
    def run(trainer):
        losses = [float(trainer.step(b)["loss"]) for b in BATCHES]
        return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))

    ref_losses, ref_params = run(scanned["none"])
    losses, params = run(scanned["config"])
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, what="remat per block")
    assert not hasattr(type(scanned["config"].model.blocks), "_jaxpar_remat_policy")   # the swap stays in the step


def test_unscanned_model_recomputes_each_layer():
    """Unrolled: one recompute region per layer, the same numbers as the whole-loss wrap (= no
    recompute), and temp memory where the whole-loss wrap had it (the CPU compiler undoes
    recompute in straight-line code)."""
    batch = BATCHES[0]
    cfg = dataclasses.replace(WIDE, layers=2)
    per_layer, whole, plain = _trainer(cfg, "full"), _trainer(cfg, "full", blocks=()), _trainer(cfg, "none")
    lowered = [t.lower(batch) for t in (per_layer, whole, plain)]
    # barriers beyond those of the step without recompute (the SwiGLU recomputed in each MLP, jaxpar.ops.swiglu)
    barriers = [low.as_text().count("optimization_barrier") for low in lowered]
    added = [b - barriers[2] for b in barriers[:2]]
    assert added[0] == cfg.layers * added[1] > 0
    temps = [memory(low.compile()).temp_bytes for low in lowered[:2]]
    print(f"unscanned temp: ParallelConfig.remat {temps[0]:,}  whole loss {temps[1]:,}")
    assert temps[0] <= 1.05 * temps[1]
    losses = [float(t.step(batch)["loss"]) for t in (per_layer, whole)]
    assert_losses_close(losses[:1], losses[1:])
    params = [jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(t.model, nnx.Param))) for t in (per_layer, whole)]
    assert_close(*params, what="remat per layer")
    assert not hasattr(type(per_layer.model.blocks[0]), "_jaxpar_remat_policy")   # the swap stays in the step


def _plain_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _plain_trainer(model):
    config = jaxpar.ParallelConfig(mesh={"data": 1}, mode="data", remat="full")
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    return jaxpar.Trainer(model, optax.sgd(0.1), _plain_loss, config, mesh)


def test_model_without_blocks_recomputes_the_whole_loss_with_a_warning():
    batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}
    with pytest.warns(UserWarning, match=r"found no repeated blocks in Plain .* jaxpar_blocks = \('layers',\)"):
        trainer = _plain_trainer(Plain())
        loss = float(trainer.step(batch)["loss"])
    assert np.isfinite(loss)
    assert trainer.lower(batch).as_text().count("optimization_barrier") == 1   # one region: the loss
    named = Plain()
    named.jaxpar_blocks = ()            # chosen on purpose: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(_plain_trainer(named).step(batch)["loss"]) == loss


def test_policy_on_both_the_config_and_the_blocks_is_refused():
    cfg = LlamaConfig.named("tiny", scan_layers=True)
    batch = ArithmeticData(cfg.max_seq_len).batch(8, 0)
    with pytest.raises(ValueError, match=r"ParallelConfig.remat='full' and jaxpar.remat\(model.blocks, "
                                         r"'dots_saveable'\) both"):
        _trainer(cfg, "full", edit=lambda m: jaxpar.remat(m.blocks, "dots_saveable")).step(batch)


@pytest.mark.parametrize("build", [
    lambda: LlamaConfig(remat="full"),
    lambda: LlamaConfig.named("tiny", remat="full"),
    lambda: dataclasses.replace(LlamaConfig.named("tiny"), remat="full"),
    lambda: GPTConfig(layers=2, remat="full"),
    lambda: dataclasses.replace(GPTConfig(), remat="full"),
], ids=["LlamaConfig", "LlamaConfig.named", "replace Llama", "GPTConfig", "replace GPT"])
def test_model_configs_refuse_remat_naming_parallel_config(build):
    """Recompute is ``ParallelConfig.remat`` alone: a model config given ``remat=`` names it."""
    with pytest.raises(TypeError, match=r"\(remat='full'\): a model config has no recompute policy; set "
                                        r"ParallelConfig\(remat='full'\) \(in a job file: parallel.remat: full\)"):
        build()


@pytest.mark.parametrize("model", [{"name": "gpt"}, {"name": "llama", "size": "tiny"}])
def test_job_file_model_field_remat_names_parallel_remat(model):
    from jaxpar.job.config import JobConfig
    from jaxpar.job.run import model_config

    job = JobConfig.from_dict({"model": {**model, "fields": {"layers": 2, "remat": "full"}}})
    with pytest.raises(ValueError, match=r"model.fields.remat='full': a model has no recompute policy; set it "
                                         r"under parallel \(parallel.remat: full, i.e. ParallelConfig.remat\)"):
        model_config(job)
    fixed = JobConfig.from_dict({"model": {**model, "fields": {"layers": 2}}, "parallel": {"remat": "full"}})
    assert model_config(fixed).layers == 2 and fixed.parallel.remat == "full"


def test_remat_loss_recomputes_what_the_step_does():
    """What the job search traces to price a policy (`remat_loss`): one recompute region per
    block the step finds, or, for a model without blocks, one around the whole loss with the
    step's warning."""
    from jaxpar.auto import build_graph
    from jaxpar.nn.blocks import block_policy, remat_loss

    batch = ArithmeticData(8).batch(4, 0)
    for cfg in (LlamaConfig.named("tiny", layers=3), LlamaConfig.named("tiny", scan_layers=True)):
        model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))    # noqa: B023
        assert len(build_graph(model, loss_fn, batch).regions) == 0
        assert len(build_graph(model, remat_loss(model, loss_fn, "full"), batch).regions) == len(find_blocks(model))
        assert block_policy(model, find_blocks(model)) is None      # traced on a merged copy: its classes stay
    plain = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}
    with pytest.warns(UserWarning, match=r"found no repeated blocks in Plain"):
        whole = remat_loss(Plain(), _plain_loss, "full")
    assert len(build_graph(Plain(), whole, plain).regions) == 1


def test_blocks_doctests():
    from jaxpar.nn import blocks

    assert doctest.testmod(blocks).failed == 0


class Uneven(nnx.Module):
    """Layers of two classes in one list: no blocks to find, but a StagedLoss names them."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)])
        self.head = nnx.Linear(8, 16, rngs=rngs)


def test_staged_loss_names_the_blocks():
    staged = jaxpar.pipeline.StagedLoss(
        order=("layers",), stages={".*": 0}, embedding=lambda m: m.embed, embed_inputs=lambda e, b: e(b["inputs"]),
        head=lambda m: m.head,
        head_loss=lambda head, h, b: optax.softmax_cross_entropy_with_integer_labels(head(h), b["targets"]).mean())
    batch = ArithmeticData(8).batch(4, 0)

    def run(remat):
        config = jaxpar.ParallelConfig(mesh={"data": 1}, mode="data", remat=remat)
        trainer = jaxpar.Trainer(Uneven(), optax.sgd(0.1), staged, config, jaxpar.make_mesh(config, jax.devices()[:1]))
        trainer.step(batch)
        return trainer, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no "no blocks" warning: the loss named them
        trainer, params = run("full")
    assert trainer.lower(batch).as_text().count("optimization_barrier") == 3
    assert_close(params, run("none")[1], what="StagedLoss blocks")


@pytest.fixture(scope="module")
def dots_temp():
    return memory(_trainer(SCANNED, "dots_saveable").lower(BATCHES[0]).compile()).temp_bytes


@pytest.mark.parametrize("policy", ["dots_except_mlp", "dots_except_mlp_in"])
def test_named_policies_keep_numerics_and_save_between_full_and_dots(scanned, dots_temp, policy):
    """The policies that save the Llama's named attention projections (and its context or MLP
    output) and recompute the MLP: the same losses as no recompute, and temp
    memory between recomputing everything and saving every matmul."""
    trainer = _trainer(SCANNED, policy)
    temp = {name: memory(t.lower(BATCHES[0]).compile()).temp_bytes
            for name, t in (("full", scanned["config"]), ("named", trainer))}
    temp["dots"] = dots_temp
    print(f"{policy} temp: {temp}")
    assert temp["full"] < temp["named"] < temp["dots"]
    reference = _trainer(SCANNED)        # a fresh one: the fixture's trainers are stepped elsewhere
    ref_losses = [float(reference.step(b)["loss"]) for b in BATCHES]
    assert_losses_close([float(trainer.step(b)["loss"]) for b in BATCHES], ref_losses)
