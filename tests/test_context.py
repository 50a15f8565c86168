"""Context parallel: attention across a sequence split over devices equals one device.

* each strategy (all-gather, ring, Ulysses, ring × Ulysses) against a one-device reference:
  outputs and gradients wrt q, k, v, causal and full, GQA and MQA, segment ids, reordered
  sequences, at cp = 2, 4, 8;
* causal load balance of the zigzag / striped orders (pure counting);
* bad input named with its numbers;
* Llama training (5 adamw steps) with a context axis equals one device, and a checkpoint
  from cp=4 continues at cp=1.
"""

from __future__ import annotations

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import assert_close, assert_losses_close, batches
from jaxpar.data import place_batch
from jaxpar.models.llama import Llama, loss_fn
from jaxpar.ops import AttentionMask, ContextParallel, context_attention, context_order
from jaxpar.report import collectives
from test_llama import TRAIN, reference as one_device_training   # the one-device run test_llama checks too

B, S, H, D = 2, 32, 8, 4


def reference_attention(q, k, v, positions, segment_ids, causal):
    """Plain softmax attention on one device, K/V heads repeated for GQA / MQA."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    allowed = jnp.ones((q.shape[0], q.shape[1], k.shape[1]), bool)
    if causal:
        allowed &= positions[:, None, :] <= positions[:, :, None]
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _output_and_grads(fn, cotangent, q, k, v):
    """``fn(q, k, v)`` and the gradients of ``sum(fn(q, k, v) * cotangent)`` wrt q, k, v."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cotangent)


# name -> (strategy, mesh, kv heads, causal, segment ids, sequence order)
CASES = {
    "ring cp=8 GQA causal segments": ("ring", {"context": 8}, 2, True, True, "contiguous"),
    "ring cp=2 MQA full zigzag": ("ring", {"context": 2}, 1, False, False, "zigzag"),
    "all_gather cp=4 MQA causal segments striped": ("all_gather", {"context": 4}, 1, True, True, "striped"),
    "ulysses cp=8 MQA causal segments": ("ulysses", {"context": 8}, 1, True, True, "contiguous"),
    "ulysses cp=4 GQA kv<cp full": ("ulysses", {"context": 4}, 2, False, False, "contiguous"),
    "hybrid 2x4 GQA causal segments zigzag": ("hybrid", {"context": 2, "ulysses": 4}, 2, True, True, "zigzag"),
}


@pytest.mark.parametrize("name", CASES)
def test_strategy_matches_one_device(name):
    strategy, axes, kv_heads, causal, segmented, order = CASES[name]
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, S, kv_heads, D)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, S)), axis=1)) if segmented else None
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    cotangent = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)   # d(loss)/d(output)

    # the one-device run on the original order, then everything permuted into `order`
    expected = _output_and_grads(lambda q, k, v: reference_attention(q, k, v, positions, segments, causal),
                                 cotangent, q, k, v)
    perm = context_order.permutation(order, S, math.prod(axes.values()))
    q, k, v, positions, cotangent = (x[:, perm] for x in (q, k, v, positions, cotangent))
    segments = None if segments is None else segments[:, perm]
    expected = jax.tree.map(lambda x: x[:, perm], expected)

    axis = tuple(axes) if strategy == "hybrid" else "context"
    run = lambda q, k, v: context_attention(  # noqa: E731
        q, k, v, AttentionMask(causal=causal, segment_ids=segments, q_positions=positions), axis=axis,
        strategy=strategy, mesh=mesh)
    actual = jax.jit(lambda *a: _output_and_grads(run, cotangent, *a))(q, k, v)
    assert_close(actual, expected, rtol=1e-5, what=name)
    assert actual[0].sharding.spec[1] == axis          # the output stays split over the sequence


# ----------------------------------------------------------------------------- load balance

def test_zigzag_balances_causal_work():
    assert context_order.balance("zigzag", 8192, 8) <= 1.05
    assert context_order.balance("striped", 8192, 8) <= 1.05
    contiguous = context_order.balance("contiguous", 8192, 8)
    assert 1.85 < contiguous <= 1.875                      # (2·cp - 1) / cp in the limit
    assert context_order.unmasked_blocks("contiguous", 16, 2, 4).tolist() == [3, 7]
    assert "zigzag      1.000" in jaxpar.ops.describe_balance(4096, 8)
    perm = context_order.permutation("zigzag", 32, 4)
    assert sorted(perm.tolist()) == list(range(32))
    assert (perm[context_order.inverse(perm)] == np.arange(32)).all()
    assert doctest.testmod(context_order).failed == 0


def test_placement_reorders_and_carries_positions():
    config = jaxpar.ParallelConfig(mesh={"data": 2, "context": 4}, rules={"batch": "data", "length": "context"},
                                   context={"order": "zigzag"})
    mesh = jaxpar.make_mesh(config)
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16)
    segments = np.repeat([[1, 2], [1, 2]], 8, axis=1).astype(np.int32)      # two packed sequences of 8
    placed = place_batch(config, mesh, {"inputs": tokens, "targets": tokens, "segment_ids": segments})
    perm = context_order.permutation("zigzag", 16, 4)
    np.testing.assert_array_equal(placed["inputs"], tokens[:, perm])
    np.testing.assert_array_equal(placed["positions"], np.tile(np.arange(8), 2)[None, perm].repeat(2, 0))
    assert placed["inputs"].sharding.spec == jax.P("data", "context")
    again = place_batch(config, mesh, placed)                # a placed batch is not reordered twice
    np.testing.assert_array_equal(again["inputs"], placed["inputs"])


def test_a_query_that_sees_no_key_gives_zeros_not_nan():
    """Keys placed one step after the queries: query 0 sees nothing. Its output is 0 and every
    gradient stays finite, for each strategy (0/0 would spread NaN through the backward)."""
    mesh = jaxpar.make_mesh({"context": 2}, devices=jax.devices()[:2])
    q, k = (jax.random.normal(jax.random.key(i), (1, 8, 2, 4)) for i in (0, 1))
    qp = jnp.arange(8)[None]
    for strategy in ("all_gather", "ring", "ulysses"):
        def f(q, k, v):
            return context_attention(q, k, v, AttentionMask(q_positions=qp, kv_positions=qp + 1), axis="context",
                                     strategy=strategy, mesh=mesh)
        out = jax.jit(f)(q, k, 2 * k)
        np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
        grads = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))(q, k, 2 * k)
        assert all(bool(jnp.isfinite(g).all()) for g in grads), strategy


# ----------------------------------------------------------------------------- bad input

def test_bad_input_names_the_numbers():
    mesh = jaxpar.make_mesh({"context": 8})
    config = jaxpar.ParallelConfig(mesh={"context": 8}, context={"order": "zigzag"})
    with pytest.raises(ValueError, match=r"divisible by 16 \(2·cp\), got 24.*multiple of 16"):
        place_batch(config, mesh, {"inputs": np.zeros((1, 24), np.int32)})
    q = jnp.ones((1, 16, 4, 2))
    with pytest.raises(ValueError, match=r"4 query heads .* size 8.*multiple of 8 query heads"):
        context_attention(q, q, q, axis="context", strategy="ulysses", mesh=mesh)
    with pytest.raises(ValueError, match=r"unknown strategy='rng'.*'ring'"):
        context_attention(q, q, q, axis="context", strategy="rng", mesh=mesh)
    with pytest.raises(ValueError, match=r"sequence length 12 .* not divisible by 8"):
        context_attention(jnp.ones((1, 12, 8, 2)), jnp.ones((1, 12, 8, 2)), jnp.ones((1, 12, 8, 2)),
                          axis="context", mesh=mesh)
    loaded = jaxpar.ParallelConfig.from_overrides(["--mesh", "context=8", "--context.strategy", "ulysses"])
    assert loaded.context == jaxpar.ParallelConfig.from_dict(loaded.to_dict()).context
    assert (loaded.context.strategy, loaded.context.order) == ("ulysses", "zigzag")
    with pytest.raises(ValueError, match=r"context.strategy='rng'.*'ring'"):
        jaxpar.ParallelConfig(mesh={"context": 8}, context={"strategy": "rng"})
    with pytest.raises(ValueError, match=r"context.axis='seq'.*not in the mesh"):
        jaxpar.ParallelConfig(mesh={"context": 8}, context={"axis": "seq"})
    reused = np.array([[1, 1, 2, 2, 1, 1, 2, 2] * 3], np.int32)   # id 1 in three runs: would see later runs
    with pytest.raises(ValueError, match=r"segment_ids row 0 uses segment id\(s\) \[1, 2\] in more than one run"):
        place_batch(config, mesh, {"inputs": np.zeros((1, 16), np.int32), "segment_ids": reused[:, :16]})
    with pytest.raises(ValueError, match=r"context.order='zigzag'.*without 'inputs'"):
        place_batch(config, mesh, {"tokens": np.zeros((1, 16), np.int32)})
    plain = nnx.Linear(2, 2, rngs=nnx.Rngs(0))         # no ContextParallel to attend with
    with pytest.raises(ValueError, match=r"not a jaxpar.ops.ContextParallel.*"
                                         r"constrain=jaxpar.nn.model_constraint\(mesh, config\)"):
        jaxpar.Trainer(plain, optax.adamw(1e-3), loss_fn, config, mesh)


# ----------------------------------------------------------------------------- Llama training

MEGATRON_CP = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model",
               "length": "context"}


def trainer_for(config, sequence_parallel=False, cfg=TRAIN):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:math.prod(config.mesh.values())])
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    if config.context is not None:
        # Megatron-style: the residual stream split over the sequence by context and model
        residual = jaxpar.LogicalConstraint(mesh, {**config.rules, "length": ("context", "model")})
        constrain = ContextParallel(constrain, mesh, config, residual=residual if sequence_parallel else None)
    model = Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)


def params_of(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


TRAINING = {
    "data=2 context=2 model=2 ulysses striped, sequence parallel": jaxpar.ParallelConfig(
        mesh={"data": 2, "context": 2, "model": 2}, rules=MEGATRON_CP,
        context={"strategy": "ulysses", "order": "striped"}),
    "context=8 ring zigzag": jaxpar.ParallelConfig(mesh={"context": 8}, rules={"length": "context"},
                                                   context={"strategy": "ring", "order": "zigzag"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINING)
def test_llama_training_matches_one_device(name):
    trainer = trainer_for(TRAINING[name], sequence_parallel="sequence parallel" in name)
    losses = [float(trainer.step(b)["loss"]) for b in batches(5, seq=TRAIN.max_seq_len)]
    ref_losses, ref_params = one_device_training()
    assert_losses_close(losses, ref_losses, rtol=1e-5)
    assert_close(params_of(trainer), ref_params, rtol=5e-5, what=name)
    found = {(c.kind, c.mesh_axes) for c in collectives(trainer.lower(batches(1, seq=16)[0]).compile(), trainer.mesh)}
    assert ("collective-permute" if "ring" in name else "all-to-all", ("context",)) in found   # attention
    if "sequence parallel" in name:         # the residual stream is gathered over model before the TP blocks
        assert ("all-gather", ("model",)) in found


@pytest.mark.slow
def test_checkpoint_from_cp4_continues_at_cp1(tmp_path):
    # the cp=4 run also stores parameters and optimizer state split over data (ZeRO-3) and
    # recomputes every block: the same numbers, and a checkpoint in yet another layout
    data = batches(5, seq=TRAIN.max_seq_len)
    config = jaxpar.ParallelConfig(mesh={"data": 2, "context": 4}, rules={"batch": "data", "length": "context"},
                                   context={"strategy": "all_gather"}, optimizer={"level": 3, "threshold_kb": 0},
                                   remat="full")
    first = trainer_for(config)
    losses = [float(first.step(b)["loss"]) for b in data[:3]]
    assert "data" in str(first.params["blocks"]["mlp"]["up"].get_value().sharding.spec)   # ZeRO-3 storage
    first.save(str(tmp_path))
    second = trainer_for(jaxpar.ParallelConfig(mesh={"data": 1}))
    second.restore(str(tmp_path))
    losses += [float(second.step(b)["loss"]) for b in data[3:]]
    ref_losses, ref_params = one_device_training()
    assert_losses_close(losses, ref_losses, rtol=1e-5)
    assert_close(params_of(second), ref_params, rtol=5e-5, what="cp=4 -> cp=1")


def test_report_with_a_context_axis_trains_the_gpt_and_prints_the_balance(tmp_path, capsys):
    """`jaxpar report --config` with a context section: the example GPT is built with
    ContextParallel (the Trainer refuses it otherwise) and the report prints the causal balance."""
    from jaxpar.cli import main

    config = tmp_path / "cp.yaml"
    config.write_text("mesh: {data: 4, context: 2}\nrules: {batch: data, length: context}\n"
                      "context: {strategy: ring, order: zigzag}\n")
    assert main(["report", "--config", str(config), "--layers", "1", "--embed", "16", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "causal balance at seq_len=32, cp=2" in out and "zigzag      1.000" in out


def test_fewer_kv_heads_than_the_tensor_axis_repeat_and_match():
    """4 query heads, 2 K/V heads, heads split 4 ways: K/V heads are repeated up to 4 inside
    ContextParallel (each device keeps one query head) and attention still equals one device."""
    from jaxpar.models.llama import attention as one_device

    config = jaxpar.ParallelConfig(mesh={"context": 2, "model": 4}, rules={"heads": "model"},
                                   context={"strategy": "ring", "order": "contiguous"})
    mesh = jaxpar.make_mesh(config)
    cp = ContextParallel(jaxpar.LogicalConstraint(mesh, config.rules), mesh, config)
    q = jax.random.normal(jax.random.key(0), (1, 16, 4, 8))
    k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 8)) for i in (1, 2))
    positions = jnp.arange(16)[None]
    out = jax.jit(lambda q, k, v: cp.attention(q, k, v, None, positions))(q, k, v)
    np.testing.assert_allclose(out, one_device(q, k, v, kind="reference"), rtol=1e-5, atol=1e-5)
    assert "model" in str(out.sharding.spec)       # the heads stay split over the tensor axis


def test_the_former_mask_keywords_warn_and_give_the_same_values():
    """0.1.0's ``context_attention(..., causal=, segment_ids=, q_positions=, kv_positions=)`` still
    runs, warning with the ``AttentionMask`` spelling."""
    mesh = jaxpar.make_mesh({"context": 4}, devices=jax.devices()[:4])
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    qp = jnp.arange(8)[None]
    want = context_attention(q, q, q, AttentionMask(causal=False, q_positions=qp), axis="context", mesh=mesh)
    with pytest.warns(DeprecationWarning, match=r"call jaxpar.ops.context_attention\(q, k, v, jaxpar.ops.AttentionMask"):
        got = context_attention(q, q, q, axis="context", mesh=mesh, causal=False, q_positions=qp)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(TypeError, match="mask must be a jaxpar.ops.AttentionMask, got bool"):
        context_attention(q, q, q, False, axis="context", mesh=mesh)
