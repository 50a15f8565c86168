"""Gradient accumulation, multi-copy (interleave) and recompute: numerics, program shape, memory."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import MEGATRON, TINY, assert_close, assert_losses_close, batches, reference, train_gpt
from jaxpar.models.data import ArithmeticData
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.report import flops, memory

DP = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")


def _with(config, **kw):
    return jaxpar.ParallelConfig.from_dict({**config.to_dict(), **kw})


def test_grad_accum_equals_one_step_on_the_whole_batch():
    """grad_accum=4 on a batch of 64 = one plain step on the same 64 rows (5 adamw steps).

    Parameters within 5e-5 (the matrix's bound): the sums run in a different order and Adam's
    normalisation magnifies the fp32 rounding of near-zero gradient entries (seen: 1.1e-5 on
    one machine, 2.4e-5 on another with the same packages: XLA:CPU's vectorisation follows
    the host CPU)."""
    big = [b for b in batches(5, batch=64)]
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)

    def run(config):
        mesh = jaxpar.make_mesh(config)
        model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
        trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
        losses = [float(trainer.step(b)["loss"]) for b in big]
        return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), trainer

    ref_losses, ref_params, _ = run(cfg)
    losses, params, trainer = run(_with(cfg, grad_accum=4))
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, rtol=5e-5, what="grad_accum=4")
    hlo = trainer.lower(big[0]).compile().as_text()
    assert " while(" in hlo or "while" in hlo            # the micro-batches are a lax.scan


def test_interleave_matches_one_device_and_is_unrolled():
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON, interleave=2)
    ref_losses, ref_params = reference()
    losses, params, trainer = train_gpt(cfg)
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, what="interleave=2")
    # copies run one after another: no loop but those XLA:CPU may expand a scatter-add into
    loops = [line for line in trainer.lower(batches(1)[0]).compile().as_text().splitlines()
             if " while(" in line and "scatter" not in line]
    assert not loops, loops[:2]


def test_accumulation_memory_well_under_the_big_batch():
    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=32, heads=4, mlp=128, layers=2)
    batch = ArithmeticData(gpt.seq_len).batch(256, 0)

    def temp(k):
        cfg = _with(DP, grad_accum=k)
        mesh = jaxpar.make_mesh(cfg)
        trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), cfg, mesh), optax.adamw(1e-3),
                                 loss_fn, cfg, mesh)
        return memory(trainer.lower(batch).compile()).temp_bytes

    one, four = temp(1), temp(4)
    print(f"temp bytes: grad_accum=1 {one:,}  grad_accum=4 {four:,}  ratio {one / four:.2f}")
    assert four < 0.5 * one


def _remat_step(policy: str, *, scan: bool = True):
    """The compiled step with ``ParallelConfig.remat=policy`` (on each block: the scan body)."""
    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=32, heads=4, mlp=128, layers=4, scan_layers=scan)
    cfg = _with(DP, remat=policy)
    mesh = jaxpar.make_mesh(cfg)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), cfg, mesh), optax.sgd(0.1), loss_fn,
                             cfg, mesh)
    return trainer.lower(ArithmeticData(gpt.seq_len).batch(128, 0)).compile()


def test_remat_full_cuts_temp_memory_with_scanned_layers():
    none, full, dots = (_remat_step(p) for p in ("none", "full", "dots_saveable"))
    t_none, t_full, t_dots = (memory(c).temp_bytes for c in (none, full, dots))
    f_none, f_full = flops(none), flops(full)
    print(f"temp none {t_none:,} dots_saveable {t_dots:,} full {t_full:,} ({t_none / t_full:.1f}x); "
          f"flops none {f_none:,.0f} full {f_full:,.0f} ({f_full / f_none:.2f}x)")
    assert t_none >= 3 * t_full
    assert t_full <= t_dots <= t_none
    assert 1.1 < f_full / f_none < 1.6          # about one more forward of the blocks


def test_jaxpar_remat_on_a_module_matches_and_keeps_paths():
    gpt = GPTConfig(**{**TINY.__dict__, "scan_layers": True})
    model = GPT(gpt, rngs=nnx.Rngs(0))
    before = nnx.state(model, nnx.Param)
    jaxpar.remat(model.blocks, "dots_saveable")
    assert type(model.blocks).__name__ == "Block" and type(model.blocks)._jaxpar_remat_policy == "dots_saveable"
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(before)
    batch = batches(1)[0]
    grads = nnx.grad(loss_fn)(model, batch)
    ref = nnx.grad(loss_fn)(GPT(gpt, rngs=nnx.Rngs(0)), batch)
    assert_close(jax.tree.map(np.asarray, nnx.to_pure_dict(grads)), jax.tree.map(np.asarray, nnx.to_pure_dict(ref)))


@pytest.mark.parametrize("policy", ["save_collectives", "everything_except_collectives"])
def test_policies_by_name_keep_numerics(policy):
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", remat=policy)
    ref_losses, ref_params = reference(TINY, 2)
    losses, params, _ = train_gpt(cfg, steps=2)
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, what=policy)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="remat policy 'bogus'"):
        jaxpar.remat(lambda x: x, "bogus")
