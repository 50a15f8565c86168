"""The chunked LM head + cross-entropy (`jaxpar.ops.chunked_cross_entropy`) and the models'
``loss_chunks`` switch: equal to the materialised loss and its gradients, in less memory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import requires_devices
from flax import nnx
from helpers import TINY, assert_close, assert_losses_close, batches, reference, train_gpt

import jaxpar
from jaxpar.models.gpt import GPTConfig
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn
from jaxpar.models.llama_parallel import pipeline_loss
from jaxpar.ops import chunked_cross_entropy


def _data(b=2, s=10, e=8, v=40, tied=False, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (b, s, e), dtype)
    w = jax.random.normal(k[1], (v, e) if tied else (e, v), jnp.float32)
    return x, w, jax.random.randint(k[2], (b, s), 0, v), jax.random.bernoulli(k[3], 0.7, (b, s))


def _materialised(x, w, targets, mask, tied):
    logits = jnp.einsum("bse,ve->bsv" if tied else "bse,ev->bsv", x, w.astype(x.dtype),
                        preferred_element_type=jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return losses.mean()
    keep = mask.astype(jnp.float32)
    return (losses * keep).sum() / jnp.maximum(keep.sum(), 1.0)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunks,masked", [(1, True), (4, True), (5, False), (10, True)])
def test_loss_and_gradients_equal_the_materialised_ones(tied, chunks, masked):
    """4 chunks of a 10-token sequence: padded with masked tokens; 10: one position per chunk."""
    x, w, targets, mask = _data(tied=tied)
    mask = mask if masked else None
    chunked = jax.jit(jax.value_and_grad(
        lambda x, w: chunked_cross_entropy(x, w, targets, chunks=chunks, mask=mask, tied=tied), (0, 1)))
    loss, grads = chunked(x, w)
    want, want_grads = jax.value_and_grad(lambda x, w: _materialised(x, w, targets, mask, tied), (0, 1))(x, w)
    assert_losses_close([float(loss)], [float(want)])
    assert_close(grads, want_grads, what="grads")
    # the primal alone (no gradient: evaluation) gives the same loss
    alone = jax.jit(lambda x, w: chunked_cross_entropy(x, w, targets, chunks=chunks, mask=mask, tied=tied))(x, w)
    assert_losses_close([float(alone)], [float(want)])


def test_bfloat16_matmuls_with_fp32_weights():
    """Hidden states in bf16, the table in fp32: the matmuls run in bf16 (as the materialised
    loss's ``table.astype(x.dtype)``), the gradient comes back in the table's fp32."""
    x, w, targets, mask = _data(s=16, dtype=jnp.bfloat16)
    f = lambda x, w: chunked_cross_entropy(x, w, targets, chunks=4, mask=mask)  # noqa: E731
    (loss, (dx, dw)) = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
    want, (wx, ww) = jax.value_and_grad(lambda x, w: _materialised(x, w, targets, mask, False), (0, 1))(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
    assert_losses_close([float(loss)], [float(want)], rtol=1e-3)
    assert_close((dx, dw), (wx, ww), rtol=2e-2)


def test_all_tokens_masked_gives_zero():
    x, w, targets, _ = _data()
    loss, grads = jax.value_and_grad(
        lambda w: chunked_cross_entropy(x, w, targets, chunks=2, mask=jnp.zeros(targets.shape, bool)))(w)
    assert float(loss) == 0.0 and not np.asarray(grads).any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunks=0), "chunks=0 must be a positive int"),
    (dict(chunks=True), "chunks=True must be a positive int"),
    (dict(chunks=11), r"chunks=11 exceeds the sequence length 10 .* use chunks <= 10"),
    (dict(chunks=2, tied=True), r"table \(8, 40\) must be \[vocab, embed\] with embed=8"),
    (dict(chunks=2, mask=jnp.ones((2, 9), bool)), r"mask must be \[batch, length\] = \(2, 10\)"),
])
def test_bad_arguments_are_refused(kwargs, match):
    x, w, targets, _ = _data()
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(x, w, targets, **kwargs)


def test_the_compiled_gradient_never_holds_the_full_logits():
    """512 tokens × vocab 8192: the materialised value_and_grad needs several [tokens, vocab]
    fp32 temporaries (16 MiB each); 8 chunks need one chunk's (2 MiB) plus the head's gradient."""
    b, s, e, v = 2, 256, 64, 8192
    args = (jax.ShapeDtypeStruct((b, s, e), jnp.float32), jax.ShapeDtypeStruct((e, v), jnp.float32),
            jax.ShapeDtypeStruct((b, s), jnp.int32))

    def temp(f):
        return jaxpar.report.memory(jax.jit(jax.value_and_grad(f, (0, 1))).lower(*args).compile()).temp_bytes

    full = temp(lambda x, w, t: _materialised(x, w, t, None, False))
    chunked = temp(lambda x, w, t: chunked_cross_entropy(x, w, t, chunks=8))
    logits = b * s * v * 4
    assert full >= 2 * logits, (full, logits)
    assert chunked < logits / 2, (chunked, logits)


# ----------------------------------------------------------------------------- the models' switch


@pytest.mark.parametrize("owner,kwargs,match", [
    (LlamaConfig, dict(loss_chunks=-1), r"LlamaConfig.loss_chunks=-1 must be an int >= 0"),
    (LlamaConfig, dict(loss_chunks=17), r"LlamaConfig.loss_chunks=17 exceeds max_seq_len=16.*<= 16"),
    (GPTConfig, dict(loss_chunks=2.0), r"GPTConfig.loss_chunks=2.0 must be an int >= 0"),
    (GPTConfig, dict(loss_chunks=64), r"GPTConfig.loss_chunks=64 exceeds seq_len=32"),
])
def test_configs_refuse_bad_loss_chunks(owner, kwargs, match):
    with pytest.raises(ValueError, match=match):
        owner(**kwargs)


def _llama_grads(cfg, batch):
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params):
        return loss_fn(nnx.merge(graphdef, params, rest), batch)

    loss, grads = jax.jit(jax.value_and_grad(f))(params)
    return float(loss), nnx.to_pure_dict(grads)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_loss_chunks_equals_the_materialised_loss(tied):
    """Loss and every parameter's gradient, with packed segments (segment 0 = padding, masked)
    and a sequence of 12 tokens in 5 chunks (padded)."""
    cfg = LlamaConfig.named("tiny", tie_embeddings=tied)
    inputs = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    segments = jnp.array([[1] * 7 + [2] * 3 + [0] * 2, [1] * 12])
    batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1), "segment_ids": segments}
    want, want_grads = _llama_grads(cfg, batch)
    loss, grads = _llama_grads(dataclasses.replace(cfg, loss_chunks=5), batch)
    assert_losses_close([loss], [want])
    assert_close(grads, want_grads, what="grads")


def test_llama_pipeline_head_loss_follows_the_switch():
    cfg = LlamaConfig.named("tiny", tie_embeddings=True, scan_layers=True)
    h = jax.random.normal(jax.random.key(2), (2, 16, cfg.embed))
    batch = {"targets": jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)}
    losses = []
    for chunks in (0, 4):
        model = Llama(dataclasses.replace(cfg, loss_chunks=chunks), rngs=nnx.Rngs(0))
        loss = pipeline_loss()
        losses.append(jax.value_and_grad(lambda h: loss.head_loss(loss.head(model), h, batch))(h))
    assert_losses_close([float(losses[1][0])], [float(losses[0][0])])
    assert_close(losses[1][1], losses[0][1], what="dh")


@requires_devices(8)
@pytest.mark.parametrize("config", [
    jaxpar.ParallelConfig(mesh={"data": 8}),
    jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"batch": "data", "vocab": "model"}),
], ids=["data=8", "data=2,vocab=model=4"])
def test_trainer_with_loss_chunks_equals_one_device(config):
    """The GPT with its loss in 4 chunks, trained on 8 devices (batch split; and the head split
    by vocabulary), equals the materialised loss trained on one. Without a "batch" rule the loss
    takes the batch to be where jaxpar places it then, on the "data" axis."""
    losses, params, trainer = train_gpt(config, gpt=dataclasses.replace(TINY, loss_chunks=4), steps=3)
    want_losses, want_params = reference(steps=3)
    assert_losses_close(losses, want_losses)
    assert_close(params, want_params)
    # each device sums the head's gradient over its own tokens through the chunks; it crosses the
    # data axis once, after the loop (not once per chunk), and the vocab-split head is never gathered
    cols = jaxpar.report.collectives(trainer.lower(batches(1)[0]).compile(), trainer.mesh)
    assert not [c for c in cols if c.in_loop and "data" in (c.mesh_axes or ())], cols
    assert not [c for c in cols if c.kind == "all-gather"], cols


def test_job_yaml_reaches_the_switch():
    from jaxpar.job.config import JobConfig
    from jaxpar.job.run import model_config

    job = JobConfig.from_dict({"model": {"name": "llama", "size": "tiny", "fields": {"loss_chunks": 8}}})
    assert model_config(job).loss_chunks == 8
    bad = JobConfig.from_dict({"model": {"name": "gpt", "fields": {"loss_chunks": -2}}})
    with pytest.raises(ValueError, match=r"model.fields=.*GPTConfig.loss_chunks=-2 must be an int >= 0"):
        model_config(bad)


@requires_devices(8)
def test_tokens_split_over_batch_and_length_axes_stay_split():
    """x split over ``data`` (batch) and ``context`` (length), the head over ``model`` (vocab):
    equal to the materialised loss, and no collective over data or context runs per chunk."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    constrain = jaxpar.LogicalConstraint(mesh, {"batch": "data", "length": "context", "vocab": "model"})
    x, w, targets, mask = _data(b=4, s=16, v=32)
    put = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.P(*spec)))  # noqa: E731
    x, w, targets, mask = put(x, "data", "context"), put(w, None, "model"), put(targets, "data", "context"), put(
        mask, "data", "context")
    f = jax.jit(jax.value_and_grad(
        lambda x, w: chunked_cross_entropy(x, w, targets, chunks=4, mask=mask, constrain=constrain), (0, 1)))
    loss, grads = f(x, w)
    want, want_grads = jax.value_and_grad(lambda x, w: _materialised(x, w, targets, mask, False), (0, 1))(x, w)
    assert_losses_close([float(loss)], [float(want)])
    assert_close(grads, want_grads, what="grads")
    cols = jaxpar.report.collectives(f.lower(x, w).compile(), mesh)
    assert not [c for c in cols if c.in_loop and {"data", "context"} & set(c.mesh_axes or ())], cols


def test_the_memory_estimate_counts_the_chunked_loss_gradients_not_the_logits():
    from jaxpar.models.llama_report import ReportRequest, llama_report

    config = jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"})
    cfg = LlamaConfig.named("1b")
    full, chunked = (llama_report(dataclasses.replace(cfg, loss_chunks=n), config, ReportRequest(batch=64, seq_len=2048))
                     .memory.activations for n in (0, 8))
    tokens, itemsize = 8 * 2048, 4   # per device; fp32 parameters as used
    assert full - chunked == tokens * cfg.vocab_size * 4 - (tokens * cfg.embed * itemsize + cfg.embed * cfg.vocab_size * 4)


def test_docstring_examples_run():
    import doctest

    import jaxpar.ops.cross_entropy as module

    result = doctest.testmod(module, extraglobs={"jnp": jnp})
    assert result.attempted and not result.failed


@requires_devices(2)
def test_inside_shard_map_with_inputs_varying_over_a_manual_axis():
    """As in a pipeline stage or per-device code: x, targets and mask differ per device, the
    table does not; the scan's carries must vary like them."""
    mesh = jax.make_mesh((2,), ("p",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, targets, mask = _data(b=4)

    def local(x, w, t, m):
        f = lambda fn: jax.value_and_grad(lambda x, w: fn(x, w), (0, 1))(x, w)  # noqa: E731
        (a, (ax, aw)), (b, (bx, bw)) = (f(lambda x, w: chunked_cross_entropy(x, w, t, chunks=4, mask=m)),
                                        f(lambda x, w: _materialised(x, w, t, m, False)))
        return jnp.stack([a, b])[None], jnp.stack([ax, bx])[None], jax.lax.psum(jnp.stack([aw, bw]), "p")

    spec = jax.P("p")
    losses, dx, dw = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, jax.P(), spec, spec),
                                           out_specs=(spec, spec, jax.P())))(x, w, targets, mask)
    assert_close((losses[:, 0], dx[:, 0], dw[0]), (losses[:, 1], dx[:, 1], dw[1]))
