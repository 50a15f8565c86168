"""The job search with a context axis and with MoE experts: it picks them when memory asks for
them, the dry run confirms, and the predicted collective bytes match the compiled step's."""

import dataclasses
import doctest
import re

import numpy as np
import pytest
from flax import nnx

import jaxpar
from helpers import COSTS
from jaxpar.auto import context as auto_context
from jaxpar.auto import experts as auto_experts
from jaxpar.auto import JobSearchSpace, search_job
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn, no_constraint
from jaxpar.train import compile_step

BASE = jaxpar.ParallelConfig(mode="auto", optimizer=jaxpar.OptimizerConfig(threshold_kb=0))
COMMON = dict(base_config=BASE, cost_params=COSTS)


def space(**choices) -> JobSearchSpace:
    """8 devices, ZeRO 0, no accumulation, and ``choices``."""
    return JobSearchSpace(**{"devices": 8, "zero_levels": (0,), "grad_accum": (1,), **choices})


def llama_fn(cfg):
    def build(constrain=no_constraint):
        return Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain)
    return build


def tokens(rows, seq):
    t = np.arange(rows * seq, dtype=np.int32).reshape(rows, seq) % 64
    return {"inputs": t, "targets": t}


def test_formulas_and_doc_examples():
    assert doctest.testmod(auto_context).failed == 0 and doctest.testmod(auto_experts).failed == 0
    att = auto_context.Attention(layers=2, heads=8, kv_heads=8, head_dim=32, itemsize=4, flops=0.0, saved_bytes=0.0)
    # docs/context_parallel.md, S = 2048, H = Hkv = 8, D = 32, one row: ring at cp = 2 reuses one shift
    kv = 2 * 1024 * 8 * 32 * 4
    assert auto_context.collective_bytes(att, "ring", 2, 2048, rows=1) == 2 * ((2 - 1) * (kv + 4 * 1024) + 2 * kv)
    with pytest.raises(ValueError, match="multiple of 2 \\* 8 = 16"):
        auto_context.check_sequence(tokens(2, 24), 8, "ring")
    with pytest.raises(ValueError, match="context has 3"):
        space(memory_budget=1e9, context=(1, 3))


def test_long_sequences_pick_a_context_axis_and_short_ones_do_not():
    """One device's attention temporaries at S = 512 exceed a 4 MB budget: the search
    splits the sequence (ring keeps no probabilities) and the compiled step fits; at S = 16
    the context axis only adds collectives, so it is not chosen."""
    strategies = ("ring", "ulysses", "all_gather")
    long = LlamaConfig.named("tiny", max_seq_len=512, attention="reference")
    job = search_job(llama_fn(long), loss_fn, tokens(2, 512),
                     space(memory_budget=4e6, context=(1, 4), context_strategy=strategies), dry_run=compile_step,
                     **COMMON)
    chosen = job.chosen
    assert chosen.context and chosen.context["size"] == 4 and chosen.context["strategy"] == "ring"
    assert job.config.context.strategy == "ring" and job.config.mesh["context"] == 4
    assert job.dry_run["fits"]
    # measured 0.92: the folded graph's liveness walk against XLA:CPU's temp
    assert 0.8 <= chosen.memory_bytes / job.dry_run["total"] <= 1.2, (chosen.memory_bytes, job.dry_run)
    by = {(o.context or {}).get("strategy"): o for o in job.candidates if o.mesh.get("context") == 4}
    assert set(by) == set(strategies)
    assert by["ring"].temp_bytes < by["ulysses"].temp_bytes       # the ring's custom VJP keeps no scores
    assert all(not o.context for o in job.candidates if o.mesh.get("context", 1) == 1)
    assert min(o.memory_bytes for o in job.candidates if not o.context) > 4e6
    assert "ring" in job.explain() and "cp/ep coll. B" in job.explain()
    assert job.to_dict()["chosen"]["context"]["bytes"] == chosen.context["bytes"] > 0

    # at S = 16 on a machine whose collectives cost what a GPU's do against its FLOPs (the suite's
    # COSTS make FLOPs so dear that halving a 16-token causal attention pays for any collective)
    gpu_like = dataclasses.replace(COSTS, flops_per_s=4e14, default_bandwidth=1e11, latency=5e-6)
    short = search_job(llama_fn(LlamaConfig.named("tiny")), loss_fn, tokens(8, 16),
                       space(memory_budget=1e9, context=(1, 4), context_strategy=strategies), dry_run=False,
                       base_config=BASE, cost_params=gpu_like)
    assert not short.chosen.context and "context" not in short.config.mesh
    assert any(o.context for o in short.candidates)


def test_experts_that_do_not_fit_go_on_the_data_axis_with_the_predicted_all_to_alls():
    """Replicated experts' weights and Adam state alone (9.5 MB) exceed a 9.2 MB budget: the
    search splits them over data (EP = 8) and the dry run fits; the predicted all-to-all
    buffer is the compiled step's for balanced routing (the first rung of the ladder)."""
    cfg = LlamaConfig.named("tiny", embed=64, mlp=256, moe={"experts": 8, "top_k": 2, "bucket_growth": 2.0})
    compiled = []

    def keep(*args):
        compiled.append(compile_step(*args))
        return compiled[-1]

    batch = tokens(8, 16)
    job = search_job(llama_fn(cfg), loss_fn, batch, space(memory_budget=9.2e6, meshes=[{"data": 8}]), dry_run=keep,
                     **COMMON)
    replicated = [o for o in job.candidates if o.experts["size"] == 1]
    assert replicated and all(o.argument_bytes > 9.2e6 for o in replicated)
    assert job.chosen.experts == {"axis": "data", "size": 8, "bytes": job.chosen.experts["bytes"]}
    assert job.config.rules == {"batch": "data", "expert": "data"} and job.dry_run["fits"]
    assert job.chosen.argument_bytes == job.dry_run["argument_bytes"]   # measured: exact (the step keeps every state input)
    hlo = compiled[-1].as_text()
    # each all-to-all's result: one array or a tuple of one piece per peer (counted like jaxpar.report)
    sizes = [sum(int(np.prod([int(x) for x in dims.split(",")])) * 4 for dims in re.findall(r"f32\[([\d,]+)\]", out))
             for out in re.findall(r"= (.*?) all-to-all\(", hlo)]
    layers = cfg.layers
    rungs = len(auto_experts.capacity_ladder(4, 32, 2.0))        # 16 tokens x top-2 per device, EP = 8
    assert len(sizes) == 4 * layers * rungs                      # two forward, two backward per layer and rung
    assert 4 * layers * min(sizes) == job.chosen.experts["bytes"] == 4 * layers * 8 * 4 * 64 * 4


def test_the_graph_prices_the_experts_flops_and_experts_cost_adds_only_the_all_to_alls():
    """The graph prices the grouped matmuls itself (three ``ragged_dot`` per MoE layer, each
    ``2 · a · embed · mlp`` forward and twice that backward, ``a`` = tokens x top-2 rows);
    `experts_cost` must not add them again: it leaves ``compute_s`` as it is and adds the
    all-to-alls for ``ep > 1``. Each candidate's step time is the graph's cost with those."""
    from jaxpar.auto.cost import analyse, evaluate, op_terms
    from jaxpar.auto.graph import build_graph
    from jaxpar.auto.pricing import price

    cfg = LlamaConfig.named("tiny", embed=64, mlp=256, moe={"experts": 8, "top_k": 2, "bucket_growth": 2.0})
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    batch = tokens(8, 16)
    graph = build_graph(model, loss_fn, batch)
    flags, moe = analyse(graph), auto_experts.moe_layers(model)
    whole = [()] * graph.num_classes
    grouped = [op for op in graph.ops if op.prim == "ragged_dot_general"]
    rows = 8 * 16 * 2
    assert sum(op_terms(graph, op, whole, {}, flags)[0] for op in grouped) == \
        cfg.layers * 3 * 3 * 2 * rows * cfg.embed * cfg.mlp
    cost = evaluate(graph, whole, {}, COSTS, flags=flags)
    for ep in (1, 8):
        priced, nbytes = auto_experts.experts_cost(cost, moe, 8 * 16, ep, COSTS)
        assert priced.compute_s == cost.compute_s and (priced.comm_s > cost.comm_s) == (ep > 1) == (nbytes > 0)

    job = search_job(llama_fn(cfg), loss_fn, batch, space(memory_budget=1e9, meshes=[{"data": 8}]), dry_run=False,
                     **COMMON)
    assert {o.experts["size"] for o in job.candidates} == {1, 8}
    for option in job.candidates:
        axes, sizes = [a for _, _, a in option.strategy.classes], dict(option.strategy.mesh)
        own = evaluate(graph, axes, sizes, COSTS, flags=flags)
        assert option.strategy.cost["compute_s"] == own.compute_s
        with_experts, _ = auto_experts.experts_cost(own, moe, auto_experts.tokens_per_device(batch, 8),
                                                    option.experts["size"], COSTS)
        assert option.time_s == pytest.approx(price(graph, axes, sizes, COSTS, cost=with_experts)[0], rel=1e-12)


def test_attention_is_found_by_its_sequence_dimensions_not_their_length():
    """A folded sequence as long as the head width (32 / 4 = 8 = head_dim) or the heads
    (16 / 4 = 4) used to make every [B, S, H, D] activation count as attention scores: twice
    the layers, 16x the heads. Found by the batch's sequence class, the terms are the same
    at every length and the saved scores grow as S²."""
    from flax import nnx

    from jaxpar.auto.cost import analyse
    from jaxpar.auto.graph import build_graph

    cfg = LlamaConfig.named("tiny")
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    found = {}
    for seq in (16, 32, 64):
        graph = build_graph(model, loss_fn, auto_context.fold(tokens(2, seq), 4))
        axes = [()] * graph.num_classes
        found[seq // 4] = auto_context.attention_terms(graph, axes, {}, analyse(graph), seq // 4)
    assert {(a.layers, a.heads, a.kv_heads, a.head_dim) for a in found.values()} == \
        {(cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim)}
    assert found[16].saved_bytes == 4 * found[8].saved_bytes == 16 * found[4].saved_bytes


def test_experts_of_one_scanned_layer_keep_their_layer_dimension():
    """A scanned block of one layer still stacks its expert weights [1, E, embed, mlp]: the
    expert pin must leave dimension 0 whole (it used to put the experts' axis there)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    cfg = LlamaConfig.named("tiny", layers=1, scan_layers=True, moe={"experts": 8, "top_k": 2})
    layers = auto_experts.moe_layers(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    assert [(m.layers, m.stacked) for m in layers] == [(1, True)]
    assert set(auto_experts.pins(layers, "data").values()) == {P(None, "data", None, None)}


def test_experts_beside_a_context_axis_are_priced_replicated_on_their_tokens():
    """With context=2 a device holds B·S / (d·2) tokens. Experts split over data inside a
    context mesh would be placed over data × context but dispatched over data: not offered."""
    cfg = LlamaConfig.named("tiny", moe={"experts": 8, "top_k": 2, "bucket_growth": 2.0})
    job = search_job(llama_fn(cfg), loss_fn, tokens(8, 32), space(memory_budget=1e9, context=(1, 2), meshes=[{"data": 8}]),
                     dry_run=False, **COMMON)
    with_context = [o for o in job.candidates if o.context]
    assert with_context and all(o.experts["size"] == 1 for o in with_context)
    assert any(o.experts["size"] == 8 for o in job.candidates if not o.context)
    assert auto_experts.tokens_per_device(tokens(8, 32), 4, context=2) == 32
