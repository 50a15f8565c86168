"""The embedding on the first virtual stage, the head on the last, and a tied table across both."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import requires_devices
from helpers import batches
from jaxpar.models import llama_parallel
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn as llama_loss_fn
from jaxpar.pipeline import pipelined

# one worker runs this module: its module-scoped fixtures are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("test_pipeline_stages")

GPT4 = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=4, scan_layers=True)
# Megatron TP with the vocabulary split over the tensor axis *and* the pipe axis: each stage
# stores 1/pipe of the embedding and the head (and of their optimizer state)
MEGATRON_PIPE = {"layers": "pipe", "batch": "data", "heads": "model", "mlp": "model", "vocab": ("model", "pipe")}


def _train(model_fn, loss, config, steps=5):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.adamw(1e-3), loss, config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(steps)]
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), trainer


def _pipe(schedule, rules, mesh=None, embedding="first"):
    mesh = mesh or {"pipe": 2, "data": 2, "model": 2}
    return jaxpar.ParallelConfig(mesh=mesh, rules={k: r for k, r in rules.items() if r},
                                 pipeline={"stages": mesh["pipe"], "microbatches": 4, "schedule": schedule,
                                           "embedding": embedding})


def _assert_trained_alike(actual, expected, rtol=2e-5):
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5)
    for a, e in zip(jax.tree.leaves(actual[1]), jax.tree.leaves(expected[1]), strict=True):
        # 2e-5: the vocabulary-split loss sums its parts in another order than one device
        assert np.linalg.norm(a - e) / np.linalg.norm(e) <= rtol


@pytest.fixture(scope="module")
def gpt_reference():
    return _train(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), pipeline_loss(), jaxpar.ParallelConfig(mesh={"data": 1}))


def _argument_bytes(trainer) -> int:
    """Per-device argument bytes of the compiled step: under SPMD every device's are the same."""
    return trainer.lower(batches(1)[0]).compile().memory_analysis().argument_size_in_bytes


@requires_devices(8)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_embedding_on_the_first_stage_trains_like_one_device(gpt_reference, schedule):
    """pipe=2 × data=2 × Megatron TP, the vocabulary split over the tensor and the pipe axes.

    Storage: each stage holds 1/(model·pipe) of the embedding table and the head, so the
    per-device argument bytes of the compiled step (``memory_analysis``) are those of the same
    job with the vocabulary split over "model" only, less ``(1 - 1/pipe)`` of its embedding +
    head bytes times three (the parameters, adam's mu and nu)."""
    trained = _train(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), pipeline_loss(), _pipe(schedule, MEGATRON_PIPE))
    _assert_trained_alike(trained, gpt_reference)
    wte = trained[2].params["wte"].get_value()
    assert wte.addressable_shards[0].data.shape == (GPT4.vocab_size // 4, GPT4.embed)   # 1/(model·pipe)
    if schedule == "1f1b":
        baseline = _train(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), pipeline_loss(),
                          _pipe(schedule, {**MEGATRON_PIPE, "vocab": "model"}), steps=0)[2]
        per_model_shard = 2 * GPT4.vocab_size * GPT4.embed * 4 // 2    # table + head, fp32, over "model"
        assert _argument_bytes(baseline) - _argument_bytes(trained[2]) == 3 * per_model_shard // 2
    else:
        # evaluation runs the forward-only table, the embedding inside it too: the loss the
        # next step reports (taken before its update)
        batch = batches(6)[5]
        np.testing.assert_allclose(trained[2].evaluate([batch]), float(trained[2].step(batch)["loss"]), rtol=1e-5)


def _shard_map_inputs(config, mesh_devices=4):
    """The avals entering the pipeline's ``shard_map`` in the traced GPT loss."""
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:mesh_devices])
    model = GPT(GPT4, rngs=nnx.Rngs(0))
    loss = pipelined(pipeline_loss(), config, mesh)
    jaxpr = jax.make_jaxpr(lambda b: loss(model, b))(batches(1)[0]).jaxpr
    (eqn,) = _find(jaxpr, "shard_map")
    return [v.aval for v in eqn.invars]


def _find(jaxpr, name):
    """Equations named ``name`` in ``jaxpr`` and the jaxprs inside its equations (a custom_vjp)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
            continue
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _find(inner, name)
    return found


@requires_devices(4)
def test_only_token_ids_enter_the_pipeline():
    """With the embedding inside, the pipeline takes the micro-batches' token ids (int) and no
    ``[m, micro_batch, seq, embed]`` activations replicated on every stage (traced, not run)."""
    shape = (4, 4, GPT4.seq_len, GPT4.embed)   # m, rows per micro-batch, seq, embed
    rules = {"layers": "pipe", "batch": "data"}
    outside = _shard_map_inputs(_pipe("1f1b", rules, {"pipe": 2, "data": 2}, embedding="outside"))
    first = _shard_map_inputs(_pipe("1f1b", rules, {"pipe": 2, "data": 2}))
    assert shape in [a.shape for a in outside]
    assert shape not in [a.shape for a in first]
    assert not [a for a in first if a.shape[:1] == (4,) and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]


@pytest.fixture(scope="module")
def tied_reference():
    cfg = LlamaConfig.named("tiny", layers=2, tie_embeddings=True, scan_layers=True)
    return cfg, _train(lambda: Llama(cfg, rngs=nnx.Rngs(0)), llama_loss_fn, jaxpar.ParallelConfig(mesh={"data": 1}))


@requires_devices(4)
def test_tied_embeddings_train_like_one_device(tied_reference, schedule="1f1b"):
    """One table read by the first stage (embedding) and the last (head): under 1F1B they are
    different devices (stages 0 and 1). The table is replicated over the pipe axis and its
    two gradients meet in the executor's psum over it (under a V both uses are on device 0
    and the same psum adds them)."""
    cfg, reference = tied_reference
    rules = {"layers": "pipe", "batch": "data"}
    trained = _train(lambda: Llama(cfg, rngs=nnx.Rngs(0)), llama_parallel.pipeline_loss(),
                     _pipe(schedule, rules, {"pipe": 2, "data": 2}))
    assert "head" not in trained[1]
    _assert_trained_alike(trained, reference)


def test_pipeline_embedding_is_validated():
    with pytest.raises(ValueError, match="pipeline.embedding='last' is invalid: choose 'first' or 'outside'"):
        jaxpar.ParallelConfig(pipeline={"embedding": "last"})
    with pytest.raises(TypeError, match="embedding and embed_inputs together"):
        jaxpar.pipeline.PipelineLoss(embed=None, blocks=None, head=None, head_loss=None, embedding=len)


@requires_devices(4)
def test_the_first_stage_refuses_token_ids_the_gpt_cannot_embed():
    """With the embedding on the first stage the token ids meet ``check_tokens`` there, as in
    ``GPT.embed``: sequences longer than the position table and float ids are refused with the
    unpipelined path's message (naming the micro-batch's shape), not by JAX's indexing."""
    cfg = dataclasses.replace(GPT4, seq_len=8, layers=2)
    config = _pipe("1f1b", {"layers": "pipe", "batch": "data"}, {"pipe": 2, "data": 2})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:4])
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config, mesh), optax.adam(1e-3),
                             pipeline_loss(), config, mesh)
    with pytest.raises(ValueError, match=r"GPT: the inputs hold sequences of 16 tokens \(shape \(4, 16\)\) but "
                                         r"GPTConfig.seq_len=8.*at most 8 tokens, or build the model with "
                                         r"GPTConfig\(seq_len=16\)"):
        trainer.step(batches(1, seq=16)[0])
    floats = {k: np.asarray(v, np.float32) for k, v in batches(1, seq=8)[0].items()}
    with pytest.raises(TypeError, match=r"GPT takes integer token ids \[batch, length\].*got float32 \(4, 8\)"):
        trainer.step(floats)


# --------------------------------------------------------------------------- modules by path


class _Mixer(nnx.Module):
    """Mixes along the sequence (a different kind of layer from ``_MLP``)."""

    def __init__(self, seq, rngs):
        self.w = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (seq, seq)))

    def __call__(self, h):
        return h + jax.numpy.tanh(jax.numpy.einsum("st,btd->bsd", self.w[...], h))


class _MLP(nnx.Module):
    def __init__(self, width, hidden, rngs):
        self.up, self.down = nnx.Linear(width, hidden, rngs=rngs), nnx.Linear(hidden, width, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class _Uneven(nnx.Module):
    """Embedding → 8 layers of two kinds and widths → head: no stack of identical blocks."""

    def __init__(self, hidden=(8, 16, 8, 64, 8, 32, 8, 16), vocab=16, width=16, seq=16):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.layers = nnx.List([_Mixer(seq, rngs) if n == 8 else _MLP(width, n, rngs) for n in hidden])
        self.head = nnx.Linear(width, vocab, rngs=rngs)


def _xent(head, h, batch):
    return optax.softmax_cross_entropy_with_integer_labels(head(h), batch["targets"]).mean()


def _staged(stages):
    return jaxpar.pipeline.StagedLoss(order=("layers",), stages=stages, embedding=lambda m: m.embed,
                                      embed_inputs=lambda e, b: e(b["inputs"]), head=lambda m: m.head,
                                      head_loss=_xent)


@pytest.fixture(scope="module")
def uneven_reference():
    return _train(_Uneven, _staged({".*": 0}), jaxpar.ParallelConfig(mesh={"data": 1}))


@requires_devices(4)
def test_modules_assigned_by_path_train_like_one_device(uneven_reference):
    """3 + 5 layers of different kinds on pipe=2 beside data=2 (1F1B), 5 adamw steps. (Under
    ZB-V the same split is ``{"layers/0": 0, "layers/[1-3]": 1, "layers/[4-5]": 2,
    "layers/[6-7]": 3}``: device 0 holds virtual stages 0 and 3, device 1 stages 1 and 2.)"""
    reference = uneven_reference
    stages = {r"layers/[0-2]": 0, r"layers/[3-7]": 1}
    trained = _train(_Uneven, _staged(stages), _pipe("1f1b", {"batch": "data"}, {"pipe": 2, "data": 2}))
    np.testing.assert_allclose(trained[0], reference[0], rtol=1e-5)
    for a, e in zip(jax.tree.leaves(trained[1]), jax.tree.leaves(reference[1]), strict=True):
        # atol: adam divides near-zero bias gradients by their own size, so their last bits
        # (summed in another order over micro-batches) move a parameter by a few 1e-6 (2.7e-6
        # for one element under the suite's codegen, tests/suite_xla.py; 2e-6 held elsewhere)
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=3e-6)


def test_balance_stages_minimises_the_slowest_stage():
    """On layers of unequal cost the planner's split has the least maximal stage cost of all
    contiguous splits, and it is not the even one."""
    import itertools

    from helpers import COSTS
    from jaxpar.auto import balance_stages, module_costs
    from jaxpar.pipeline.stages import assign, stage_costs

    model, loss, batch = _Uneven(), _staged({".*": 0}), batches(1)[0]
    paths, costs, first, last = module_costs(model, loss, batch, 4, COSTS)
    assert len(set(costs)) > 2 and first >= 0 and last > 0
    split = balance_stages(model, loss, batch, 3, COSTS, microbatches=4)
    chosen = max(stage_costs(costs, assign(paths, split, 3), first, last))
    every = [max(stage_costs(costs, [0] * a + [1] * (b - a) + [2] * (8 - b), first, last))
             for a, b in itertools.combinations(range(1, 8), 2)]
    assert chosen == min(every)
    assert assign(paths, split, 3) != [0, 0, 0, 1, 1, 1, 2, 2]


def test_staged_loss_errors():
    model = _Uneven()
    with pytest.raises(ValueError, match="'layers/3' matches 0 patterns"):
        jaxpar.pipeline.stages.assign(jaxpar.pipeline.module_paths(model, ("layers",)),
                                      {r"layers/[0-2]": 0, r"layers/[4-7]": 1}, 2)
    with pytest.raises(ValueError, match=r"virtual stages \[1, 1, 0\]: they must run 0, 1"):
        jaxpar.pipeline.stages.assign(["a", "b", "c"], {"a|b": 1, "c": 0}, 2)
    with pytest.raises(ValueError, match="no module at 'blocks'"):
        jaxpar.pipeline.module_paths(model, ("blocks",))
    from jaxpar.auto import balance_stages
    with pytest.raises(ValueError, match="stages=9 must be an int from 1 to the 8 modules"):
        balance_stages(model, _staged({".*": 0}), batches(1)[0], 9)


def test_docstring_examples_run():
    import doctest

    from jaxpar.pipeline import stages

    result = doctest.testmod(stages)
    assert result.failed == 0 and result.attempted >= 5


@requires_devices(8)
def test_micro_batches_smaller_than_the_data_axis_are_refused_naming_the_sizes():
    """A micro-batch is split over the batch axes like the unpipelined step's batch: 16 rows
    under grad_accum=2 and 4 micro-batches leave 2 rows for data=4 (and 16 micro-batches 1 row
    for data=2), which trained with the rows shared and no data parallelism, without an error.
    Refused where the pipeline loss is traced, before anything compiles."""
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                   pipeline={"stages": 2, "microbatches": 4}, grad_accum=2)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                             pipeline_loss(), config, mesh)
    with pytest.raises(ValueError, match=r"pipeline.microbatches=4 cuts the batch of 8 rows the pipeline runs \(in a "
                                         r"training step, its global batch of 16 / \(grad_accum=2\); in an evaluation, "
                                         r"its whole batch\) into micro-batches of 2 rows, but each micro-batch is "
                                         r"split over the batch axes \{'data': 4\}, 4 devices.*a training batch that "
                                         r"is a "
                                         r"multiple of 32 .* and an evaluation batch that is a multiple of 16.*"
                                         r"at most 2 micro-batches.*a smaller grad_accum"):
        trainer.step(batches(1)[0])
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 2}, rules={"batch": "data"},
                                   pipeline={"stages": 2, "microbatches": 16})
    loss = pipelined(_staged({r"layers/[0-3]": 0, r"layers/[4-7]": 1}), config,
                     jaxpar.make_mesh(config, devices=jax.devices()[:4]))
    with pytest.raises(ValueError, match=r"pipeline.microbatches=16 cuts the batch of 16 rows the pipeline runs into "
                                         r"micro-batches of 1 row, but .* \{'data': 2\}, 2 devices: its rows must be "
                                         r"a multiple of 2.*at most 8 micro-batches"):
        jax.eval_shape(lambda b: loss(_Uneven(), b), batches(1)[0])


@requires_devices(8)
def test_a_batch_whole_on_every_device_pipelines_with_micro_batches_of_any_rows():
    """dataset_strategy='full_batch' leaves the rows unsplit, so micro-batches of 2 rows on
    pipe=2 × data=4 are no loss of data parallelism: the step trains (its loss that of the
    unpipelined model on the same batch), and the rows follow the batch's own split, not the
    default batch axes."""
    from jaxpar.data import BatchLayout
    from jaxpar.pipeline.rows import row_axes

    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe"},
                                   dataset_strategy="full_batch", pipeline={"stages": 2, "microbatches": 4})
    mesh = jaxpar.make_mesh(config)
    batch = batches(1, batch=8)[0]
    assert row_axes(BatchLayout.of(config, mesh), batch) == ()
    assert row_axes(BatchLayout.of(dataclasses.replace(config, dataset_strategy=None), mesh), batch) == ("data",)
    layout = jaxpar.Layout((2, 4), ("pipe", "data"))
    assert row_axes(BatchLayout.of(dataclasses.replace(config, dataset_strategy={
        "inputs": layout(("pipe", "data"), "None"), "targets": None}), mesh), batch) == ("data",)
    model = GPT(GPT4, rngs=nnx.Rngs(0))
    expected = float(pipeline_loss()(model, batch))
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                             pipeline_loss(), config, mesh)
    np.testing.assert_allclose(float(trainer.step(batch)["loss"]), expected, rtol=1e-5)
