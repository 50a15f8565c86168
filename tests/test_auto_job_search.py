"""The job search's recompute and pipeline choices: priced, confirmed by the dry run, and
trained to the one-device losses."""

import dataclasses
import math
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import COSTS, MEGATRON, batches
from jaxpar.auto import JobSearchSpace, build_graph, search_job
from jaxpar.auto.assign import hand_axes
from jaxpar.auto.cost import evaluate
from jaxpar.auto.job_search import memory_floor
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.nn.blocks import remat_loss
from jaxpar.report import memory
from jaxpar.train import compile_step

# one worker runs this module: its module-scoped fixtures are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("test_auto_job_search")

SCANNED = GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=4, mlp=256, layers=4, scan_layers=True)
BASE = jaxpar.ParallelConfig(mode="auto", optimizer=jaxpar.OptimizerConfig(threshold_kb=0))


def gpt_fn(gpt=SCANNED):
    def build():
        return GPT(gpt, rngs=nnx.Rngs(0))
    return build


def policy_loss(policy: str):
    """``loss_fn`` with ``ParallelConfig.remat=policy`` on each block, as the step applies it."""
    return remat_loss(nnx.eval_shape(gpt_fn()), loss_fn, policy)


def _losses(model_fn, loss, config, steps=3, rows=32):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.adamw(1e-3), loss, config, mesh)
    return [float(trainer.step(b)["loss"]) for b in batches(steps, batch=rows, seq=SCANNED.seq_len)]


@pytest.fixture(scope="module")
def one_device():
    return _losses(gpt_fn(), loss_fn, jaxpar.ParallelConfig(mesh={"data": 1}))


def test_recompute_regions_in_the_graph_and_their_price():
    """``jax.checkpoint`` regions: what the policy does not keep is recomputed (FLOPs +1/3
    of those operators) and lives only during the region's backward."""
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    costs = {}
    for remat in ("none", "full", "dots_saveable"):
        graph = build_graph(nnx.eval_shape(gpt_fn()), policy_loss(remat), batch)
        assert len(graph.regions) == (0 if remat == "none" else 1)         # one block body, scanned
        keeps = {op.keep for op in graph.ops}
        assert keeps == ({"device"} if remat == "none" else {"device", "recompute"})
        axes = hand_axes(graph, jaxpar.ParallelConfig(mesh={"data": 8}), {"data": 8})
        costs[remat] = evaluate(graph, axes, {"data": 8}, COSTS)
    none, full, dots = costs["none"], costs["full"], costs["dots_saveable"]
    assert full.temp_bytes < dots.temp_bytes < none.temp_bytes
    assert none.compute_s < dots.compute_s < full.compute_s < 4 / 3 * none.compute_s
    assert full.argument_bytes == none.argument_bytes and full.comm_bytes == none.comm_bytes  # data only
    megatron = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    comm = {}
    for remat in ("none", "full"):
        graph = build_graph(nnx.eval_shape(gpt_fn()), policy_loss(remat), batch)
        sizes = {"data": 2, "model": 4}
        comm[remat] = evaluate(graph, hand_axes(graph, megatron, sizes), sizes, COSTS).comm_bytes
    assert comm["full"] > comm["none"]           # the recomputed forward all-reduces again


class Dense(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.numpy.ones((8, 8)))
        self.v = nnx.Param(jax.numpy.ones((8, 8)))


def _graph(loss):
    x = jax.ShapeDtypeStruct((4, 8), np.float32)
    return build_graph(nnx.eval_shape(Dense), loss, x)


def test_region_results_read_later_are_saved_and_nested_regions_follow_the_outer_policy():
    from jax.ad_checkpoint import checkpoint_name
    from jaxpar.auto.cost import analyse

    pol = jax.checkpoint_policies

    def later(model, x):       # y leaves the region and a matmul reads it: y is saved
        y = jax.checkpoint(lambda x: jax.numpy.sin(x @ model.w[...]) @ model.w[...])(x)
        return (y @ model.v[...]).sum()

    graph = _graph(later)
    flags = analyse(graph)
    (region,) = graph.regions
    inner = [op for op in graph.ops[region.first:region.last + 1] if op.prim == "dot_general"]
    y = inner[-1].outs[0]
    assert flags.saved[y] and not flags.recomputed[y]
    assert flags.recomputed[inner[0].outs[0]]       # x @ w inside the region is redone

    def nested(model, x):      # the outer region saves nothing: the inner policy does not matter
        inner_fn = jax.checkpoint(lambda h: jax.numpy.sin(h @ model.w[...]), policy=pol.everything_saveable)
        return jax.checkpoint(lambda x: inner_fn(jax.numpy.cos(x)) @ model.v[...],
                              policy=pol.nothing_saveable)(x).sum()

    graph = _graph(nested)
    assert len(graph.regions) == 1
    (region,) = graph.regions
    assert {op.keep for op in graph.ops[region.first:region.last + 1]} == {"recompute"}

    def named(model, x):       # save_only_these_names answers with jax.ad_checkpoint.Saveable / Recompute
        f = lambda x: jax.numpy.sin(checkpoint_name(x @ model.w[...], "a")) @ model.v[...]  # noqa: E731
        return jax.checkpoint(f, policy=pol.save_only_these_names("a"))(x).sum()

    ops = [op for op in _graph(named).ops if op.region >= 0]
    keeps = {op.prim: op.keep for op in ops}
    # the name is the value it names (no operator of its own); what made it is kept, not redone
    assert "name" not in keeps and keeps["sin"] == "recompute"
    assert [op.keep for op in ops if op.prim == "dot_general"] == ["device", "recompute"]

    def shared(model, x):      # the named value's maker feeds another operator too: JAX redoes it
        def f(x):
            h = x @ model.w[...]
            return (jax.numpy.sin(checkpoint_name(h.T, "s")).T * jax.numpy.tanh(h)).sum()
        return jax.checkpoint(f, policy=pol.save_only_these_names("s"))(x)

    keeps = [(op.prim, op.keep) for op in _graph(shared).ops if op.region >= 0]
    assert keeps[:2] == [("dot_general", "recompute"), ("transpose", "device")]

    def odd(model, x):
        return jax.checkpoint(lambda x: jax.numpy.sin(x @ model.w[...]), policy=lambda *a, **k: 3)(x).sum()

    with pytest.raises(TypeError, match="returned 3"):
        _graph(odd)


def test_grouped_matmuls_and_sorts_make_a_region_elementwise_work_alone_does_not():
    """A checkpoint around an expert FFN of grouped matmuls (``ragged_dot``, SwiGLU inside) or
    around a sort holds work to recompute: a region, whose matmul values are recomputed.
    SwiGLU's own checkpoint (elementwise work alone) is no region."""
    from jaxpar.auto.cost import analyse
    from jaxpar.ops import swiglu

    jnp, groups = jax.numpy, np.array([1, 3], np.int32)

    def experts(model, x):
        w = jnp.stack([model.w[...], model.v[...]])          # two experts [2, 8, 8]
        def ffn(x):
            h = swiglu(jax.lax.ragged_dot(x, w, groups), jax.lax.ragged_dot(x, w, groups))
            return jax.lax.ragged_dot(h, w, groups)
        return jax.checkpoint(ffn)(x).sum()

    graph = _graph(experts)
    (region,) = graph.regions
    grouped = [op for op in graph.ops[region.first:region.last + 1] if op.prim == "ragged_dot_general"]
    assert len(grouped) == 3 and analyse(graph).recomputed[grouped[0].outs[0]]

    def sort(model, x):
        return jax.checkpoint(lambda h: jnp.sort(jnp.sin(h), axis=0))(x @ model.w[...]).sum()

    assert len(_graph(sort).regions) == 1

    def plain(model, x):
        return (swiglu(x @ model.w[...], x @ model.v[...]) @ model.w[...]).sum()

    graph = _graph(plain)
    assert graph.regions == () and any(op.get("recomputed") for op in graph.ops)


def test_scatters_make_a_region_and_linear_operators_save_nothing():
    """An MoE dispatch's ``.at[order].set`` (scatter), ``jnp.bincount`` (scatter-add) and
    ``lax.dynamic_update_slice`` are work of their own: a checkpoint around one alone is a
    region. What the backward reads of them is kept: a scatter's indices, nothing of a
    running sum or of a linear collective (psum, ppermute, all-to-all, ...), whose
    derivatives read neither operand nor result; a pmax's are kept."""
    from jaxpar.auto.cost import analyse

    jnp = jax.numpy

    def dispatch(model, x):
        order = jnp.argsort(x[:, 0])
        return jax.checkpoint(lambda h, o: jnp.zeros_like(h).at[o].set(jnp.sin(h)))(x @ model.w[...], order).sum()

    def bincount(model, x):
        ids = (x[:, 0] > 0).astype(jnp.int32)
        return jax.checkpoint(lambda h, i: jnp.sin(h) * jnp.bincount(i, length=8))(x @ model.w[...], ids).sum()

    def update(model, x):
        return jax.checkpoint(lambda h: jax.lax.dynamic_update_slice(h, jnp.sin(h[:2]), (1, 0)))(x @ model.w[...]).sum()

    for loss in (dispatch, bincount, update):
        assert len(_graph(loss).regions) == 1, loss.__name__

    def plain(model, x):
        return jnp.sin(jnp.zeros_like(x).at[jnp.argsort(x[:, 0])].set(x @ model.w[...])).sum()

    graph = _graph(plain)
    (scatter,) = [op for op in graph.ops if op.prim == "scatter"]
    saved = analyse(graph).saved
    assert saved[scatter.ins[1]] and not saved[scatter.outs[0]]      # its indices, not its result

    def running(model, x):
        return jnp.sin(jnp.cumsum(x @ model.w[...], axis=0)).sum()

    graph = _graph(running)
    (i,) = [k for k, op in enumerate(graph.ops) if op.prim == "cumsum"]
    out = graph.ops[i].outs[0]
    assert not analyse(graph).saved[out]
    for prim, kept in (("psum", False), ("ppermute", False), ("all_to_all", False), ("all_gather", False),
                       ("pmax", True)):    # the same graph with a collective in the cumsum's place
        ops = (*graph.ops[:i], dataclasses.replace(graph.ops[i], prim=prim), *graph.ops[i + 1:])
        assert analyse(dataclasses.replace(graph, ops=ops)).saved[out] == kept, prim


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable", "dots_except_mlp", "dots_except_mlp_in"])
def test_scanned_recompute_temp_matches_the_compiled_step(remat):
    """Predicted temp of the scanned GPT under each policy (each block recomputed, as the job
    search prices it), against memory_analysis of the step with ``ParallelConfig.remat`` (15%)."""
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    model_fn = gpt_fn()
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", remat=remat)
    graph = build_graph(nnx.eval_shape(model_fn), policy_loss(remat), batch)
    cost = evaluate(graph, hand_axes(graph, config, {"data": 8}), {"data": 8}, COSTS)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.adamw(1e-3), loss_fn, config, mesh)
    mem = memory(trainer.lower(batch).compile())
    assert cost.argument_bytes == mem.argument_bytes
    assert 0.85 <= cost.temp_bytes / mem.temp_bytes <= 1.15, (cost.temp_bytes, mem.temp_bytes)


def test_job_search_chooses_recompute_to_fit_and_trains_like_one_device(one_device):
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    space = JobSearchSpace(devices=8, memory_budget=1e12, meshes=[{"data": 8}], zero_levels=(0,), grad_accum=(1,),
                           remat=("none", "full", "dots_saveable"))
    common = dict(cost_params=COSTS, base_config=BASE)
    free = search_job(gpt_fn(), loss_fn, batch, space, dry_run=False, **common)
    by = {}
    for o in free.candidates:       # fastest first: each policy's fastest strategy
        by.setdefault(o.remat, o)
    assert by["full"].memory_bytes >= memory_floor(nnx.eval_shape(gpt_fn()), batch, 8, COSTS)[0]
    assert by["none"].time_s < by["dots_saveable"].time_s < by["full"].time_s
    assert by["full"].memory_bytes < by["dots_saveable"].memory_bytes < by["none"].memory_bytes
    budget = (by["full"].memory_bytes + by["dots_saveable"].memory_bytes) / 2 * 1.05
    job = search_job(gpt_fn(), loss_fn, batch, dataclasses.replace(space, memory_budget=budget),
                     dry_run=compile_step, **common)
    assert job.remat == "full" and job.config.remat == "full" and job.dry_run["fits"]   # the Trainer applies it
    assert 0.85 <= job.chosen.memory_bytes / job.dry_run["total"] <= 1.15
    assert "remat=full" in job.explain() and "over budget" in job.explain()
    losses = _losses(gpt_fn(), loss_fn, job.config)
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)


def test_job_search_chooses_pipeline_stages_to_fit_and_trains_like_one_device(one_device):
    """A budget that no unpipelined option fits: the search picks stages and micro-batches,
    the dry run compiles the pipelined step within the budget, and it trains exactly."""
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    space = JobSearchSpace(devices=8, memory_budget=1e12, zero_levels=(0,), grad_accum=(1,),
                           pipeline_stages=(1, 2, 4), microbatches=(4, 8))
    common = dict(cost_params=COSTS, base_config=BASE)
    free = search_job(gpt_fn(), pipeline_loss(), batch, space, dry_run=False, **common)
    flat = min(o.memory_bytes for o in free.candidates if not o.pipeline)
    piped = min(o.memory_bytes for o in free.candidates if o.pipeline)
    assert piped >= memory_floor(nnx.eval_shape(gpt_fn()), batch, 8, COSTS)[0]     # the floor bounds every option
    budget = 1.3 * piped
    assert budget < flat                                   # nothing unpipelined fits
    job = search_job(gpt_fn(), pipeline_loss(), batch, dataclasses.replace(space, memory_budget=budget),
                     dry_run=compile_step, **common)
    pipe = job.config.pipeline
    assert job.chosen.pipeline and pipe.stages == job.chosen.mesh["pipe"] > 1
    assert job.dry_run["fits"] and job.dry_run["total"] <= budget
    assert 0.8 <= job.chosen.memory_bytes / job.dry_run["total"] <= 1.25
    spec = job.config.parameter_strategy["blocks/mlp/up"]
    assert tuple(spec)[0] == "pipe"                         # each stage holds its layers
    losses = _losses(gpt_fn(), pipeline_loss(), job.config)
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)


def test_explain_says_when_the_batch_is_replicated():
    """A winner that leaves the batch unsplit on data=4 read as a data-parallel option
    ("pipe=2 x data=4"): its label and explain() now say the batch is replicated."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.auto.job_search import JobOption, JobSearchResult
    from jaxpar.auto.strategy import Strategy

    cost = dict(compute_s=1e-7, comm_s=0.0, comm_bytes=0, comm_by_axes={}, time_s=1e-7, argument_bytes=8, temp_bytes=8)

    def option(batch_spec, mesh):
        strategy = Strategy("dynamic_programming", {"data": 4, "model": 1}, (("w", (2,), P(), 8),),
                            (("['x']", batch_spec),), (), cost)
        return JobOption(mesh=mesh, grad_accum=1, zero=0, strategy=strategy, time_s=1e-4, argument_bytes=8,
                         temp_bytes=8, pipeline={"stages": 2, "microbatches": 2, "schedule": "1f1b",
                                                 "virtual_stages": 1} if "pipe" in mesh else None)

    replicated, split = option(P(), {"pipe": 2, "data": 4}), option(P("data"), {"pipe": 2, "data": 4})
    assert replicated.label() == "pipe=2 x data=4, zero=0, 1f1b m=2, batch replicated"
    assert split.label() == "pipe=2 x data=4, zero=0, 1f1b m=2"
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, dataset_strategy="full_batch")
    text = JobSearchResult(replicated, config, (replicated, split), None, 1e9).explain()
    assert ("the batch dimension is not split (dataset_strategy='full_batch'): the 4 devices of data=4 each "
            "run the whole micro-batch") in text
    assert "not split" not in JobSearchResult(split, config, (split,), None, 1e9).explain()


def test_pipeline_price_follows_the_schedule():
    """More micro-batches: a smaller bubble per micro-batch and fewer activations in flight;
    the head runs in the last stage's backward (its F is idle), so the table's length rules."""
    from jaxpar.auto.pricing import PipelineShape, micro_batch, price_pipeline
    from jaxpar.pipeline import build, lower

    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    model = nnx.eval_shape(gpt_fn())
    loss = pipeline_loss()
    rows = {}
    for schedule, m in (("gpipe", 8), ("1f1b", 4), ("1f1b", 8), ("zb-h1", 8)):
        part = micro_batch(batch, m)
        graph = build_graph(model, loss, part)
        axes = hand_axes(graph, jaxpar.ParallelConfig(mesh={"data": 2}), {"data": 2})
        h = jax.eval_shape(loss.embed, model, part)
        shape = PipelineShape(stages=4, microbatches=m, layers=4, activation_bytes=h.size * 4, schedule=schedule)
        rows[schedule, m] = price_pipeline(graph, axes, {"data": 2}, COSTS, shape)
    assert rows["gpipe", 8][1] == rows["1f1b", 4][1]                     # same parameters per stage
    assert rows["1f1b", 8][2] < rows["1f1b", 4][2]                       # smaller micro-batches
    assert rows["1f1b", 8][2] < rows["gpipe", 8][2]                      # 1F1B holds fewer inputs
    assert lower(build("1f1b", 4, 8)).x_slots < lower(build("gpipe", 4, 8)).x_slots
    # the same work in half-size micro-batches: the (p-1)-step bubble is half as long
    assert rows["1f1b", 8][0] < rows["1f1b", 4][0]
    # ZB-H1 fills the bubble with weight-gradient work: in lock-step, its steps are shorter
    # (2f for B and W, not 3f) and the idle ones fewer, even with the chunk recomputed twice
    assert rows["zb-h1", 8][0] < rows["1f1b", 8][0]


def test_job_search_errors_name_the_fix():
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    with pytest.raises(ValueError, match=r"base_config.remat='full', but the search chooses the recompute policy "
                                         r"itself.*JobSearchSpace\(remat=\('full',\)\)"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9),
                   base_config=dataclasses.replace(BASE, remat="full"), dry_run=False)
    with pytest.raises(ValueError, match=r"base_config.rules=\{'batch': 'data'\} would be replaced by the search.*"
                                         r"parameter_strategy"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9),
                   base_config=dataclasses.replace(BASE, mode="semi_auto", rules={"batch": "data"}), dry_run=False)
    with pytest.raises(ValueError, match=r"base_config.mode='data', but the job search places every parameter"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9),
                   base_config=dataclasses.replace(BASE, mode="data"), dry_run=False)
    with pytest.raises(TypeError, match="PipelineLoss"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9, pipeline_stages=(2,)),
                   dry_run=False)
    with pytest.raises(ValueError, match="microbatches has 5"):
        search_job(gpt_fn(), pipeline_loss(), batch,
                   JobSearchSpace(devices=8, memory_budget=1e9, pipeline_stages=(2,), microbatches=(5,)), dry_run=False)
    with pytest.raises(ValueError, match="do not divide into 8 stages"):
        search_job(gpt_fn(), pipeline_loss(), batch, JobSearchSpace(devices=8, memory_budget=1e9, pipeline_stages=(8,)),
                   dry_run=False)
    with pytest.raises(TypeError, match="space=.*must be a jaxpar.auto.JobSearchSpace"):
        search_job(gpt_fn(), loss_fn, batch, {"devices": 8, "memory_budget": 1e9})


def test_a_larger_budget_never_loses_the_option_a_smaller_one_found():
    """The strategy search prices memory without ZeRO or micro-batches: its fastest strategy
    within 1.55 MB had, under every ZeRO level, more than 1.55 MB, while its strategy within
    1.54 MB fits it. Each mesh's least-memory strategy is priced too, at every budget: the
    smallest option is the same whatever the budget, and a larger budget's choice is never
    slower (`jaxpar plan`'s example GPT)."""
    from jaxpar.job.example import example_job
    from jaxpar.job.search import _gpt
    from jaxpar.models.data import ArithmeticData

    gpt = _gpt(example_job(jaxpar.ParallelConfig(mesh={"data": 8})))
    batch = ArithmeticData(gpt.seq_len, seed=0).batch(32, 0)
    found = [search_job(lambda: GPT(gpt, rngs=nnx.Rngs(0)), loss_fn, batch,
                        JobSearchSpace(devices=8, memory_budget=b, search_name="dynamic_programming"),
                        base_config=jaxpar.ParallelConfig(mode="auto")) for b in (1.54e6, 1.55e6)]
    assert found[0].chosen.memory_bytes <= 1.54e6
    assert found[1].chosen.time_s <= found[0].chosen.time_s
    smallest = [min(o.memory_bytes for o in f.candidates) for f in found]
    assert smallest[0] == smallest[1] <= found[0].chosen.memory_bytes, smallest


def test_when_every_option_compiles_over_the_budget_the_error_says_so(monkeypatch):
    """The dry run rejects every option predicted to fit: the error names the dry run and the
    compiled bytes (it had quoted the smallest predicted option, below the budget)."""
    import jaxpar.auto.job_search as js

    monkeypatch.setattr(js, "_dry_run", lambda *args: {"devices": 8, "argument_bytes": 1, "temp_bytes": 2,
                                                       "total": 2_000_000_000, "fits": False})
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    with pytest.raises(ValueError, match=r"nothing fits memory_budget=1,000,000,000 B per device on 8 devices once "
                                         r"compiled: \d+ option\(s\) predicted to fit, and the dry run of each "
                                         r"compiled over it; the smallest, .*compiled 2,000,000,000 B"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9, meshes=[{"data": 8}],
                                                            zero_levels=(0,), grad_accum=(1,)),
                   base_config=BASE, cost_params=COSTS, dry_run=compile_step)


def test_machine_numbers_per_axis_are_checked():
    """Per-axis bandwidths and latencies: positive (latency >= 0) numbers, on axes the search's
    meshes have."""
    from jaxpar.auto import CostParams, search

    for bad, message in ((dict(bandwidth={"model": -1e9}), r"CostParams.bandwidth=\{'model': -1000000000.0\} is "
                                                           r"invalid at .*positive bytes/s"),
                         (dict(bandwidth={"model": 0}), "CostParams.bandwidth=.* is invalid"),
                         (dict(bandwidth={"model": True}), "CostParams.bandwidth=.* is invalid"),
                         (dict(latency_per_axis={"data": -1}), r"latency_per_axis=.* is invalid .*seconds >= 0")):
        with pytest.raises(ValueError, match=message):
            CostParams(**bad)
    assert CostParams(bandwidth={"model": np.float32(1e9)}, latency_per_axis={"data": np.int64(0)}).bandwidth
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    typo = CostParams(bandwidth={"modle": 1e9})
    with pytest.raises(ValueError, match=r"search_job: CostParams.bandwidth names \['modle'\], which no mesh"):
        search_job(gpt_fn(), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e9), cost_params=typo)
    with pytest.raises(ValueError, match=r"search: CostParams.bandwidth names \['modle'\].*\['data', 'model'\]"):
        search(nnx.eval_shape(gpt_fn()), loss_fn, batch, BASE, {"data": 4, "model": 2}, cost_params=typo)


@pytest.mark.parametrize("options, message", [
    (dict(devices=0), "devices=0 must be a positive device count"),
    (dict(devices=True), "devices=True must be a positive device count"),
    (dict(memory_budget=0), "memory_budget=0 must be a positive number"),
    (dict(memory_budget="1e9"), "memory_budget='1e9' must be a positive number"),
    (dict(search_name="greedy"), "search_name='greedy'; choose one of"),
    (dict(pipeline_stages=(3,)), r"pipeline_stages has 3; use positive divisors of devices=8"),
    (dict(context=(1, 3)), r"context has 3; use positive divisors of devices=8"),
    (dict(remat=("sometimes",)), "remat has 'sometimes'"),
    (dict(remat=("none", "offload_dots")), "remat has 'offload_dots': host offload was removed .* ZeRO-3"),
    (dict(remat=("none", "full"), pipeline_stages=(2, 4)),
     r"remat=\('none', 'full'\) with pipeline_stages=\(2, 4\): recompute policies are priced for options without "
     r"a pipeline only .* add 1 to pipeline_stages or leave remat at \('none',\)"),
    (dict(zero_levels=()), r"zero_levels=\(\) is empty"),
    (dict(zero_levels=(0, 4)), "zero_levels has 4; ZeRO levels are 0, 1, 2, 3"),
    (dict(grad_accum=(1, 0)), "grad_accum has 0; use positive micro-batch counts"),
    (dict(microbatches=(4, -1)), "microbatches has -1"),
    (dict(schedule="zigzag"), "schedule has 'zigzag'; choose one or several of"),
    (dict(context_strategy=("ring", "star")), "context_strategy has 'star'; choose from"),
    (dict(moe_imbalance=0.5), "moe_imbalance=0.5 must be >= 1"),
    (dict(meshes=[{"data": 2, "model": 2}]), r"meshes has \{'data': 2, 'model': 2\}, 4 devices, not devices=8"),
])
def test_a_search_space_refuses_a_wrong_choice_when_built(options, message):
    """Every choice of a `JobSearchSpace` is checked as it is built, before any model is traced."""
    with pytest.raises(ValueError, match=f"JobSearchSpace: {message}"):
        JobSearchSpace(**{"devices": 8, "memory_budget": 1e9, **options})


@pytest.mark.parametrize("options, message", [
    (dict(zero_levels=1), r"zero_levels=1 must be a sequence of choices, e.g. \(1, 2\)"),
    (dict(context=2), "context=2 must be a sequence of choices"),
    (dict(microbatches=4), "microbatches=4 must be a sequence of choices"),
    (dict(meshes={"data": 8}), r"meshes=\{'data': 8\} is one mesh; give a list of them, e.g. meshes=\[\{'data': 8\}\]"),
    (dict(meshes=[8]), "meshes has 8; each mesh is a mapping of axis sizes"),
])
def test_a_search_space_refuses_one_bare_choice_by_name(options, message):
    """A bare number (or one mesh) where a list of choices goes is refused naming the field,
    not iterated into a Python error."""
    with pytest.raises(TypeError, match=f"JobSearchSpace: {message}"):
        JobSearchSpace(**{"devices": 8, "memory_budget": 1e9, **options})


def test_a_search_space_is_a_frozen_value():
    a = JobSearchSpace(devices=8, memory_budget=1e9, schedule="zb-h1", remat=["none", "full"],
                       meshes=[{"data": 4, "model": 2}])
    assert a.schedule == ("zb-h1",) and a.remat == ("none", "full") and a.context_strategy == ("ring",)
    assert JobSearchSpace(devices=8, memory_budget=1e9, remat="full").remat == ("full",)   # one name, as schedule
    assert a == JobSearchSpace(devices=8, memory_budget=1e9, schedule=("zb-h1",), remat=("none", "full"),
                               meshes=({"data": 4, "model": 2},))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.devices = 4
    with pytest.raises(TypeError):
        JobSearchSpace(8, 1e9)                     # keyword-only: which number is which is never guessed
    import doctest

    from jaxpar.auto import cost, search_space
    for module in (search_space, cost):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_a_budget_below_the_floor_is_refused_at_once():
    """No option can hold the parameters, their optimizer states and the batch in less than
    their bytes spread over every device: such a budget is refused before any search."""
    deep = dataclasses.replace(SCANNED, layers=64)
    batch = batches(1, batch=32, seq=SCANNED.seq_len)[0]
    floor, weights, rows = memory_floor(nnx.eval_shape(gpt_fn(deep)), batch, 8, COSTS)
    assert weights > 64 * 4 * 64 * 64 * 4 and floor == math.ceil((3 * weights + rows) / 8)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"memory budget of 1,000,000 B per device on 8 devices.* at least "
                                         rf"{floor:,} B per device .*above {floor:,} B, use at least "
                                         rf"{math.ceil((3 * weights + rows) / 1e6)} devices"):
        search_job(gpt_fn(deep), loss_fn, batch, JobSearchSpace(devices=8, memory_budget=1e6, pipeline_stages=(1, 2, 4)),
                   cost_params=COSTS, pipeline_loss=pipeline_loss(), dry_run=compile_step)
    assert time.perf_counter() - start < 5          # the search it replaces took minutes


def test_jaxpar_plan_refuses_a_hopeless_budget_before_building_the_model(capsys):
    """`jaxpar plan --search`: 64 unrolled layers in 1 MB per device. Building the model first
    (flax traces a deep unrolled init in minutes) would come before any refusal."""
    from jaxpar.cli import main

    start = time.perf_counter()
    assert main(["plan", "--layers", "64", "--search", "dynamic_programming", "--memory-budget", "1e6"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 5
    assert "memory budget of 1,000,000 B per device on 8 devices" in err and "Traceback" not in err, err
    assert "(memory_budget, --memory-budget) above 4,781,248 B, use at least 39 devices" in err, err


def test_the_strategy_search_weighs_every_micro_batch_against_the_gradient_all_reduce():
    """A pipelined (or accumulated) step runs the graph of one micro-batch m times and reduces
    the gradients once; the strategy search weighed one micro-batch's compute against the whole
    all-reduce, so on pipe=2 x data=4 with 8 micro-batches it kept the batch whole on the 4 data
    devices ('batch replicated'), which price_pipeline itself prices slower than the split."""
    from jaxpar.auto import search
    from jaxpar.auto.cost import CostParams
    from jaxpar.auto.pricing import PipelineShape, micro_batch, price_pipeline

    costs = CostParams()
    batch = batches(1, batch=256, seq=SCANNED.seq_len)[0]
    space = JobSearchSpace(devices=8, memory_budget=1e12, pipeline_stages=(2,), microbatches=(8,),
                           schedule="1f1b", zero_levels=(0,))
    job = search_job(gpt_fn(), pipeline_loss(), batch, space, dry_run=False, cost_params=costs)
    split = next(o for o in job.candidates if o.mesh == {"pipe": 2, "data": 4, "model": 1})
    assert not split._batch_replicated(), split.label()
    # the same pipeline with the batch whole on every data device is priced slower
    model, loss, inner = nnx.eval_shape(gpt_fn()), pipeline_loss(), {"data": 4, "model": 1}
    part = micro_batch(batch, 8)
    graph = build_graph(model, loss, part)
    h = jax.eval_shape(loss.embed, model, part)
    whole = hand_axes(graph, jaxpar.ParallelConfig(mesh=inner, dataset_strategy="full_batch"), inner)
    shape = PipelineShape(stages=2, microbatches=8, layers=4, activation_bytes=h.size * h.dtype.itemsize)
    full = price_pipeline(graph, whole, inner, costs, shape)[0]
    assert split.time_s < full
    # the search alone: one run of the graph keeps the batch whole, the step's 9 runs split it
    config = jaxpar.ParallelConfig(mesh=inner, mode="auto", search="dynamic_programming")
    once = search(None, loss, part, config, inner, cost_params=costs, graph=graph)
    nine = search(None, loss, part, config, inner, cost_params=costs, graph=graph, runs=9)
    assert {tuple(s) for _, s in once.batch} == {()}
    assert {tuple(s)[:1] for _, s in nine.batch} == {("data",)}
    with pytest.raises(ValueError, match=r"runs=0 must be a number >= 1"):
        search(None, loss, part, config, inner, cost_params=costs, graph=graph, runs=0)
