"""The pipeline composed with context parallel and with mixture-of-experts (expert parallel).

* Llama, pipe=2 × data=2 × context=2, Ulysses attention on a striped sequence, 1F1B: five
  adamw steps equal one device;
* an MoE GPT, pipe=2 × data=2 × context=2, ring attention on a zigzag sequence, experts split
  over the data axis, ZB-V with the embedding on the first stage, a nonzero aux_loss_weight:
  five steps equal one device accumulating gradients over the same 4 micro-batches (the
  load-balancing loss is per micro-batch, as in gradient accumulation); the routing metrics
  come out of the pipeline, and the compiled step exchanges tokens over data and K/V over
  context;
* inside a stage the model's constraints pin the automatic axes, and nested operators read
  their device position from data (no partition id XLA could not partition);
* a PipelineLoss that cannot hand the blocks their positions (no block_call) or carry their
  auxiliary losses (no aux_loss) is refused, naming both features.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import assert_close, assert_losses_close, batches
from jaxpar.models import gpt, gpt_parallel
from jaxpar.models.llama import Llama
from jaxpar.models.llama_parallel import pipeline_loss as llama_pipeline_loss
from jaxpar.nn import MoEConfig, moe_metrics
from jaxpar.ops import ContextParallel
from jaxpar.report import collectives
from test_llama import TRAIN, reference as llama_reference   # the one-device Llama run test_llama checks too

AUX = 0.05   # large enough that leaving the auxiliary loss out would fail the comparison by far
MOE = MoEConfig(experts=4, top_k=2, bucket_growth=2.0)   # a coarse capacity ladder compiles faster
MOE_GPT = gpt.GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=4, scan_layers=True, moe=MOE)
PIPE_CP = {"pipe": 2, "data": 2, "context": 2}


def _pipe(schedule: str, **extra) -> dict:
    return {"stages": 2, "microbatches": 4, "schedule": schedule, **extra}


def _params(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


def train_gpt(config, cfg: gpt.GPTConfig, steps: int = 5):
    """Losses, final parameters and the trainer of ``steps`` adamw steps under ``config``."""
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:math.prod(config.mesh.values())])
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    if config.context is not None:
        constrain = ContextParallel(constrain, mesh, config)
    model = jaxpar.init(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    loss = gpt_parallel.pipeline_loss() if config.pipeline.stages > 1 else gpt.loss_fn
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss, config, mesh)
    losses = [float(trainer.step(batch)["loss"]) for batch in batches(steps)]
    return losses, _params(trainer), trainer


def with_aux(weight: float) -> gpt.GPTConfig:
    return dataclasses.replace(MOE_GPT, moe=dataclasses.replace(MOE, aux_loss_weight=weight))


def one_device_accumulating():
    """One device, gradients accumulated over the pipeline's 4 micro-batches."""
    losses, params, _ = train_gpt(jaxpar.ParallelConfig(mesh={"data": 1}, grad_accum=4), with_aux(AUX))
    return losses, params


@pytest.mark.slow
def test_llama_pipeline_with_ulysses_context_matches_one_device():
    config = jaxpar.ParallelConfig(
        mesh=PIPE_CP, rules={"layers": "pipe", "batch": "data", "length": "context"},
        context={"strategy": "ulysses", "order": "striped"}, pipeline=_pipe("1f1b"))
    mesh = jaxpar.make_mesh(config)
    constrain = ContextParallel(jaxpar.LogicalConstraint(mesh, config.rules), mesh, config)
    model = jaxpar.init(lambda: Llama(TRAIN, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), llama_pipeline_loss(), config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(5, seq=TRAIN.max_seq_len)]
    ref_losses, ref_params = llama_reference()
    assert_losses_close(losses, ref_losses, rtol=1e-5)
    assert_close(_params(trainer), ref_params, rtol=5e-5, what="llama pipe x ulysses")


@pytest.mark.slow
def test_moe_gpt_pipeline_with_ring_context_and_expert_parallel_matches_one_device():
    """The auxiliary loss is added per micro-batch: the one-device run it equals accumulates
    gradients over the same micro-batches (with aux_loss_weight=0 that is the plain run)."""
    config = jaxpar.ParallelConfig(
        mesh=PIPE_CP, rules={"layers": "pipe", "batch": "data", "length": "context", "expert": "data"},
        context={"strategy": "ring", "order": "zigzag"}, pipeline=_pipe("zb-v", embedding="first"))
    losses, params, trainer = train_gpt(config, with_aux(AUX))
    ref_losses, ref_params = one_device_accumulating()
    assert_losses_close(losses, ref_losses, rtol=1e-5)
    assert_close(params, ref_params, rtol=5e-5, what="moe gpt pipe x ring x ep")
    gate = trainer.params["blocks"]["mlp"]["gate"].get_value()
    assert gate.addressable_shards[0].data.shape[:2] == (2, 2)   # 4 layers / 2 stages, 4 experts / 2 devices
    metrics = moe_metrics(trainer.model)   # recorded per layer by the pipeline's stages
    assert int(metrics["moe_dropped"]) == 0 and 0.9 < float(metrics["moe_load_balance"]) < 2
    found = {(c.kind, c.mesh_axes) for c in collectives(trainer.lower(batches(1)[0]).compile(), trainer.mesh)}
    assert ("all-to-all", ("data",)) in found         # tokens to their experts and back
    assert ("all-to-all", ("context",)) in found      # the ring's K/V shifts inside a stage


def test_a_pipeline_loss_that_cannot_carry_positions_or_aux_losses_is_refused_naming_both():
    config = jaxpar.ParallelConfig(
        mesh=PIPE_CP, rules={"layers": "pipe", "batch": "data", "length": "context", "expert": "data"},
        context={"strategy": "ulysses", "order": "striped"}, pipeline=_pipe("1f1b"))
    mesh = jaxpar.make_mesh(config)
    constrain = ContextParallel(jaxpar.LogicalConstraint(mesh, config.rules), mesh, config)
    model = gpt.GPT(MOE_GPT, rngs=nnx.Rngs(0), constrain=constrain)
    tx = optax.adamw(1e-3)
    no_positions = dataclasses.replace(gpt_parallel.pipeline_loss(), block_call=None)
    with pytest.raises(ValueError, match=r"context=.*pipeline\.stages=2.*block_call="):
        jaxpar.Trainer(model, tx, no_positions, config, mesh)
    plain = dataclasses.replace(config, context=None)
    no_aux = dataclasses.replace(gpt_parallel.pipeline_loss(), aux_loss=None)
    with pytest.raises(ValueError, match=r"pipeline\.stages=2 with a mixture-of-experts model.*aux_loss="):
        jaxpar.Trainer(gpt.GPT(MOE_GPT, rngs=nnx.Rngs(0)), tx, no_aux, plain, mesh)
    # experts split over an axis, but blocks run as block(h): they would not see the constraint
    with pytest.raises(ValueError, match=r"mixture-of-experts.*rules\['expert'\]='data'.*block_call="):
        jaxpar.Trainer(gpt.GPT(MOE_GPT, rngs=nnx.Rngs(0)), tx, no_positions, plain, mesh)
    with pytest.raises(TypeError, match=r"aux_loss=.*must be callable"):
        dataclasses.replace(gpt_parallel.pipeline_loss(), aux_loss=0.05)


def test_logical_constraints_pin_the_automatic_axes_inside_a_pipeline_stage():
    # inside the pipeline's shard_map (manual over "pipe") the model's constraints still pin the
    # other axes, so a stage's branches keep the layout of the plan (no resharding collective
    # the partitioner invents inside a branch)
    mesh = jaxpar.make_mesh({"data": 2, "model": 2, "pipe": 2})
    constrain = jaxpar.LogicalConstraint(mesh, {"batch": "data", "embed": "model", "layers": "pipe"})

    def stage(x):
        return constrain(x * 2, ("batch", "seq", "embed"))

    run = jax.shard_map(stage, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"})
    text = jax.jit(run).lower(np.ones((4, 4, 8), np.float32)).as_text()
    assert '[{"data"}, {}, {"model"}]' in text   # batch over data, embed over model
    # fully manual (hybrid code): nothing left to pin
    manual = jax.shard_map(stage, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"))
    assert '{"data"}' not in jax.jit(manual).lower(np.ones((4, 4, 8), np.float32)).as_text()


def test_nested_operators_read_their_position_from_data_not_the_partition_id():
    from jaxpar.ops._common import axis_position, inner_shard_map

    mesh = jaxpar.make_mesh({"context": 4, "pipe": 2})

    def positions(x):
        return x + axis_position("context").astype(x.dtype)

    def stage(x):
        return inner_shard_map(positions, mesh, "test", in_specs=(P("context"),), out_specs=P("context"))(x)

    run = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"pipe"}))
    assert "partition_id" not in run.lower(np.zeros(8, np.float32)).as_text()
    np.testing.assert_array_equal(np.asarray(run(np.zeros(8, np.float32))), [0, 0, 1, 1, 2, 2, 3, 3])


def test_nested_ring_attention_backward_reads_its_position_from_data_too():
    # the ring's custom_vjp traces its backward only when the per-device vjp applies the
    # cotangent; the positions must still be readable then (no partition id in the gradient)
    from jaxpar.ops import context_attention

    mesh = jaxpar.make_mesh({"context": 4, "pipe": 2})
    x = np.random.default_rng(0).standard_normal((2, 2, 16, 2, 4)).astype(np.float32)   # [pipe, B, S, H, D]

    def attend(q):
        return context_attention(q, q, q, axis="context", strategy="ring", mesh=mesh).sum()

    def stage(q):
        return jax.lax.psum(jax.grad(attend)(q[0])[None].sum(), "pipe")

    run = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P("pipe"), out_specs=P(), axis_names={"pipe"}))
    assert "partition_id" not in run.lower(x).as_text()
    want = sum(float(jax.grad(lambda q: context_attention(q, q, q, axis="context", strategy="ring",
                                                          mesh=mesh).sum())(x[i]).sum()) for i in range(2))
    np.testing.assert_allclose(float(run(x)), want, rtol=1e-5)


def test_positions_do_not_outlive_a_failed_trace():
    from jaxpar.ops import _common

    mesh = jaxpar.make_mesh({"context": 4, "pipe": 2})

    def broken(x):
        raise RuntimeError("trace fails")

    def stage(x):
        return _common.inner_shard_map(broken, mesh, "test", in_specs=(P("context"),), out_specs=P("context"))(x)

    with pytest.raises(RuntimeError, match="trace fails"):
        jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"pipe"}))(np.zeros(8))
    assert _common._stack() == []


def test_a_nested_operator_over_an_axis_already_per_device_is_refused():
    from jaxpar.ops._common import inner_shard_map

    mesh = jaxpar.make_mesh({"context": 4, "pipe": 2})

    def stage(x):   # the operator's tensors split over "pipe", which the enclosing shard_map runs per device
        return inner_shard_map(lambda y: y, mesh, "test_op", in_specs=(P("pipe"),), out_specs=P("pipe"))(x)

    run = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"pipe"}))
    with pytest.raises(ValueError, match=r"test_op: its mesh axes \['pipe'\] are already per-device"):
        run(np.zeros(8, np.float32))
