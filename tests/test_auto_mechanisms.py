"""Cost-model mechanisms the published runs (benchmarks/published.py) asked for: tensor-parallel
collectives hidden behind their layer's matmuls, ZeRO over an axis inside a host with data
parallel across hosts, and fused attention's score matrices kept off the device."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxpar
from jaxpar.auto import CostParams, build_graph
from jaxpar.auto.assign import hand_axes
from jaxpar.auto.cost import (attention_scores, evaluate, flags_for, local_bytes, matmul_hidden, op_terms,
                              pooled_hidden, tensor_axes)
from jaxpar.auto.derivatives import FREE
from jaxpar.auto.pricing import _zero_shardable, price
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

CFG = GPTConfig(vocab_size=64, seq_len=32, embed=64, heads=4, mlp=256, layers=2, scan_layers=True)
TP = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}


def graph_and_axes(sizes, rules, rows=8):
    model = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((rows, CFG.seq_len), jnp.int32)
    graph = build_graph(model, loss_fn, {"inputs": x, "targets": x})
    return graph, hand_axes(graph, jaxpar.ParallelConfig(mesh=sizes, rules=rules), sizes)


def test_tensor_parallel_collectives_hide_behind_their_layers_matmuls():
    sizes = {"data": 2, "model": 4}
    graph, axes = graph_and_axes(sizes, TP)
    slow = CostParams(flops_per_s=1e12, default_bandwidth=1e9, latency=0.0)
    exposed = evaluate(graph, axes, sizes, slow)
    behind = evaluate(graph, axes, sizes, dataclasses.replace(slow, matmul_overlap=True))
    flags = flags_for(graph, slow)
    on = dataclasses.replace(slow, matmul_overlap=True)
    alone = pools = 0.0
    per: dict[int, list[float]] = {}
    for op in graph.ops:
        f, comms, _, _ = op_terms(graph, op, axes, sizes, flags)
        alone += matmul_hidden(op, f, comms, sizes, on)
        if op.prim == "dot_general":
            wire = sum(on.collective_time(c.kind, c.axes, c.nbytes, sizes, True) for c in comms if not c.combined)
            pool = per.setdefault(op.repeat, [0.0, 0.0])
            pool[0], pool[1] = pool[0] + wire, pool[1] + f / on.flops_per_s
    pools = pooled_hidden(per)
    # a layer's collectives hide behind all of its matmuls: at least what each hides behind its own
    assert exposed.comm_s - behind.comm_s == pytest.approx(pools)
    assert pools > alone > 0
    assert behind.compute_s == exposed.compute_s


def test_zero_inside_a_host_all_reduces_each_shard_across_hosts():
    sizes = {"dp": 2, "fsdp": 4}
    graph, axes = graph_and_axes(sizes, {"batch": ("dp", "fsdp")})
    machine = CostParams(flops_per_s=1e12, default_bandwidth=1e11, latency=0.0, inter_host_bandwidth=1e9,
                         devices_per_host=4).placed({"dp": 2}, sizes)
    parts: dict = {}
    price(graph, axes, sizes, machine, zero=3, zero_axis="fsdp", breakdown=parts)
    cost = evaluate(graph, axes, sizes, machine)
    shardable = _zero_shardable(graph, axes, sizes, "fsdp", 0.0)
    share = shardable / cost.temp_parts[1]
    scatter = machine.collective_time("all-gather", ("fsdp",), shardable, sizes, True)
    across = machine.collective_time("all-reduce", ("dp",), shardable / 4, sizes, True)
    # a reduce-scatter inside the host, then an all-reduce (not a reduce-scatter) of each quarter
    # between the hosts: data parallel over dp replicates the fsdp shards
    assert parts["grad_comm_exposed_s"] == pytest.approx(cost.grad_comm_s * (1 - share) + scatter + across)
    assert across == pytest.approx(2 * 0.5 * (shardable / 4) / 1e9)
    assert parts["param_gather_after_s"] == 0.0       # ZeRO 3 keeps the parameters sharded


def test_fused_attention_keeps_the_score_matrices_off_the_device():
    sizes = {"data": 2}
    graph, axes = graph_and_axes(sizes, {"batch": "data"})
    scores = [t for t in range(len(graph.tensors)) if attention_scores(graph, t)]
    assert scores and all(graph.tensors[t].shape[-2:] == (CFG.seq_len, CFG.seq_len) for t in scores)
    plain = CostParams(flops_per_s=1e12, default_bandwidth=1e11)
    fused = dataclasses.replace(plain, fused_attention=True)
    a, b = evaluate(graph, axes, sizes, plain), evaluate(graph, axes, sizes, fused)
    kept = flags_for(graph, plain).saved
    assert any(kept[t] for t in scores) and not any(flags_for(graph, fused).saved[t] for t in scores)
    # the saved score matrices (per device: the batch split in 2) leave the peak, nothing else moves
    assert 0 < a.temp_bytes - b.temp_bytes <= sum(graph.tensors[t].nbytes / 2 * CFG.layers for t in scores if kept[t])
    assert a.compute_s == b.compute_s and a.comm_s == b.comm_s and a.argument_bytes == b.argument_bytes
    with pytest.raises(ValueError, match="CostParams.fused_attention=1 is invalid: use True or False"):
        CostParams(fused_attention=1)


def test_grouped_query_score_products_are_scores_and_half_precision_values_are_saved():
    """The Llama's grouped-query score product comes out of ``dot_general`` with its group after
    the key and query positions (``[B, K, S, T, G]``; a size-1 group when every head has its own
    keys): fused attention keeps those off the device too (they
    were 275 GB of a predicted 363 GB per H100 for Llama2-7B FSDP8), and bf16 values a loop's
    backward reads (its matmul outputs) count like fp32 ones (they were not counted at all)."""
    from jaxpar.models.llama import Llama, LlamaConfig
    from jaxpar.models.llama import loss_fn as llama_loss

    cfg = LlamaConfig(vocab_size=64, embed=64, heads=4, kv_heads=2, mlp=128, layers=2, max_seq_len=32,
                      scan_layers=True, dtype="bfloat16", attention="reference")
    x = jax.ShapeDtypeStruct((8, 32), jnp.int32)
    graph = build_graph(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), llama_loss, {"inputs": x, "targets": x})
    products = [op.outs[0] for op in graph.ops if op.prim == "dot_general" and graph.tensors[op.outs[0]].shape.count(32) == 2]
    assert products and all(graph.tensors[t].shape == (8, 2, 32, 32, 2) for t in products)   # [B, K, S, T, G]
    assert all(attention_scores(graph, t) for t in products)
    # the values product [B, K, D, G, T] and the activations are no score matrices
    assert not any(attention_scores(graph, t) for t in range(len(graph.tensors))
                   if graph.tensors[t].shape in ((8, 2, 16, 2, 32), (8, 32, 4, 16), (8, 32, 64), (8, 32, 128)))
    plain = CostParams(flops_per_s=1e12, default_bandwidth=1e11)
    kept, fused = flags_for(graph, plain).saved, flags_for(graph, dataclasses.replace(plain, fused_attention=True)).saved
    assert all(kept[t] for t in products) and not any(fused[t] for t in products)
    halves = [t for op in graph.ops if op.prim == "dot_general" and op.repeat > 1 for t in op.outs
              if graph.tensors[t].itemsize == 2 and graph.tensors[t].shape[-1] in (64, 128)]
    assert halves and all(kept[t] for t in halves)       # q/k/v/o and the MLP's products, in bf16


def test_the_updated_parameters_gather_moves_the_dtype_asked_for():
    sizes = {"data": 8}
    graph, axes = graph_and_axes(sizes, {"batch": "data"})
    machine = CostParams(flops_per_s=1e12, default_bandwidth=1e9, latency=0.0)
    own, half = {}, {}
    price(graph, axes, sizes, machine, zero=1, breakdown=own)
    price(graph, axes, sizes, dataclasses.replace(machine, gather_itemsize=2), zero=1, breakdown=half)
    # fp32 master weights gathered as they are, or bf16 model weights (Megatron's distributed optimizer)
    assert own["param_gather_after_s"] > 0
    assert half["param_gather_after_s"] == pytest.approx(own["param_gather_after_s"] / 2)
    assert half["grad_comm_exposed_s"] == own["grad_comm_exposed_s"]
    with pytest.raises(ValueError, match=r"CostParams.gather_itemsize=3 is invalid: use None .* 1, 2, 4 or 8"):
        CostParams(gather_itemsize=3)


def test_memory_bandwidth_prices_the_operators_that_are_not_matmuls_by_their_bytes():
    """`CostParams.memory_bandwidth`: an elementwise or reduction operator costs its largest
    operand's bytes three times at that rate (when slower than its FLOPs); matmuls and a fused
    kernel's score matrices do not change; a bad value is refused by name."""
    sizes = {"data": 2}
    graph, axes = graph_and_axes(sizes, {"batch": "data"})
    flags = flags_for(graph, CostParams(fused_attention=True))
    base = CostParams(flops_per_s=1e15, fused_attention=True)
    slow = dataclasses.replace(base, memory_bandwidth=1e9)
    seen = {"matmul": 0, "scores": 0, "moved": 0, "gather": 0}
    for op in graph.ops:
        f0 = op_terms(graph, op, axes, sizes, flags, base)[0]
        f1 = op_terms(graph, op, axes, sizes, flags, slow)[0]
        ts = [t for t in (*op.ins, *op.outs) if t >= 0]
        if op.prim == "gather":     # the embedding lookup: priced by its bytes as the others
            seen["gather"] += 1
        if op.prim == "dot_general" or op.prim in FREE:
            assert f1 == f0, op.prim
            seen["matmul"] += op.prim == "dot_general"
        elif any(attention_scores(graph, t) for t in ts):
            assert f1 == f0, op.prim        # on chip in the fused kernel
            seen["scores"] += 1
        elif op.repeat == 1 and op.keep == "device":
            moved = 3 * max(local_bytes(graph, t, axes, sizes) for t in ts)
            assert f1 == pytest.approx(max(f0, moved * 1e15 / 1e9), rel=1e-9), op.prim
            seen["moved"] += f1 > f0
    assert seen["matmul"] and seen["scores"] and seen["moved"] and seen["gather"]
    assert evaluate(graph, axes, sizes, slow).compute_s > evaluate(graph, axes, sizes, base).compute_s
    for bad in (0, -1.0, "2e12", True):
        with pytest.raises(ValueError, match=f"memory_bandwidth={bad!r}"):
            CostParams(memory_bandwidth=bad)


def test_a_gather_costs_its_largest_operand_on_one_device_not_a_one_hot_matmul():
    """An embedding lookup reads one table row per index and its backward writes a table-sized
    gradient: three times its largest operand's elements on one device. With the table split
    over vocab (``model``) and the lookup's output split over ``data`` only, each device holds
    its whole share of the output; with the table whole, its whole gradient."""
    cfg = dataclasses.replace(CFG, vocab_size=512)     # a table of many rows: a one-hot matmul would be dear
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((8, cfg.seq_len), jnp.int32)
    graph = build_graph(model, loss_fn, {"inputs": x, "targets": x})
    lookups = 0
    for sizes, rules in (({"data": 2}, {"batch": "data"}), ({"data": 2, "model": 4}, TP)):
        axes = hand_axes(graph, jaxpar.ParallelConfig(mesh=sizes, rules=rules), sizes)
        flags = flags_for(graph, CostParams())
        gathers = [op for op in graph.ops if op.prim == "gather"]
        assert gathers, sizes
        for op in gathers:
            ts = [t for t in (*op.ins, *op.outs) if t >= 0]
            flops = op_terms(graph, op, axes, sizes, flags, CostParams())[0]
            local = max(local_bytes(graph, t, axes, sizes) / graph.tensors[t].itemsize for t in ts)
            assert flops == pytest.approx(3 * local), (sizes, op)
            if op.ins[0] in {t for _, t in graph.params}:     # the embedding lookup (the loss picks too)
                table, out = graph.tensors[op.ins[0]], graph.tensors[op.outs[0]]
                one_hot = 3 * 2 * table.shape[0] * math.prod(out.shape) / math.prod(sizes.values())
                assert flops < one_hot / 4, (sizes, flops, one_hot)
                lookups += 1
    assert lookups == 2


def test_sequence_parallel_divides_the_bytes_of_the_work_between_tensor_parallel_matmuls():
    """`CostParams.sequence_parallel`: an operator none of whose values is split over the axis
    (a norm, a residual add) moves 1/size of its bytes; one split over it (the MLP's
    activation) and the matmuls are priced as before; the collectives do not change."""
    sizes = {"data": 2, "model": 4}
    graph, axes = graph_and_axes(sizes, TP)
    flags = flags_for(graph, CostParams(fused_attention=True))
    plain = CostParams(flops_per_s=1e15, fused_attention=True, memory_bandwidth=1e9)
    sp = dataclasses.replace(plain, sequence_parallel=("model",))
    divided = kept = 0
    for op in graph.ops:
        f0, c0, _, _ = op_terms(graph, op, axes, sizes, flags, plain)
        f1, c1, _, _ = op_terms(graph, op, axes, sizes, flags, sp)
        assert c1 == c0
        split = any("model" in (tensor_axes(graph, t, axes) or ()) for t in (*op.ins, *op.outs) if t >= 0)
        if op.prim in FREE or op.prim == "dot_general" or split or f0 == 0:
            assert f1 == f0, op.prim
            kept += split and f0 > 0
        elif f1 < f0:
            assert f1 == pytest.approx(f0 / 4, rel=1e-9), op.prim
            divided += 1
    assert divided and kept
    for bad in ("model", 4, ("model", 4)):
        with pytest.raises(ValueError, match=r"sequence_parallel=.*give a tuple of mesh axis names"):
            CostParams(sequence_parallel=bad)


def test_a_config_computing_in_bf16_is_priced_as_the_step_runs_it():
    """``ParallelConfig(precision="bf16")`` casts the fp32 parameters to bf16 inside the step's loss
    (`jaxpar.train.step.cast`). The search prices that program, not the fp32 one the model gives
    alone: the activations it keeps shrink as the step's own residuals do (those of
    ``jax.vjp`` of the step's cast loss, 0.50 of fp32's here), the parameters and optimizer
    state stay fp32."""
    import numpy as np
    import optax

    from jaxpar.auto.graph import compute_dtype
    from jaxpar.train.step import Setting, cast, merge

    tokens = np.zeros((8, CFG.seq_len), np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    model = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    sizes = {"data": 1}
    priced, kept, searched = {}, {}, {}
    for precision in ("fp32", "bf16"):
        config = jaxpar.ParallelConfig(mesh=sizes, precision=precision)
        graph = build_graph(model, loss_fn, batch, compute_dtype=compute_dtype(config))
        priced[precision] = evaluate(graph, hand_axes(graph, config, sizes), sizes, CostParams())
        searched[precision] = jaxpar.auto.search(model, loss_fn, batch, dataclasses.replace(config, mode="auto"),
                                                 sizes).cost
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        s = Setting(jaxpar.make_train_plan(config, mesh, (params, rest), optax.adamw(1e-3)), mesh, graphdef,
                    params, rest)
        loss = cast(s, merge(s, loss_fn, batch))          # the step's loss, as differentiate gets it
        residuals = jax.eval_shape(lambda p: jax.vjp(lambda q: loss(q, rest, batch)[0], p)[1], params)
        kept[precision] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))
    assert priced["bf16"].argument_bytes == priced["fp32"].argument_bytes
    predicted, actual = (priced["bf16"].temp_bytes / priced["fp32"].temp_bytes, kept["bf16"] / kept["fp32"])
    assert actual < 0.6 and abs(predicted - actual) < 0.1, (predicted, actual)
    # the search reads the precision from its config
    assert searched["bf16"]["temp_bytes"] < 0.7 * searched["fp32"]["temp_bytes"]
    assert searched["bf16"]["argument_bytes"] == searched["fp32"]["argument_bytes"]
    # data parallel: the gradients are reduced in fp32 under "bf16" (the fp32 master weights'),
    # so the gradient collectives move the same bytes as fp32's (the compiled step's all-reduces are f32)
    two = {"data": 2}
    grads = {}
    for precision in ("fp32", "bf16"):
        config = jaxpar.ParallelConfig(mesh=two, rules={"batch": "data"}, precision=precision)
        graph = build_graph(model, loss_fn, batch, compute_dtype=compute_dtype(config))
        grads[precision] = evaluate(graph, hand_axes(graph, config, two), two, CostParams()).grad_comm_bytes
    assert grads["bf16"] == grads["fp32"] > 0


def test_a_pipeline_priced_in_bf16_finds_its_stacked_blocks_through_the_cast():
    """Cast to the compute dtype at the loss's top, the blocks' parameters reach the layer scan
    as casts: `price_pipeline` and ZeRO still find them stacked (`jaxpar.auto.cost.param_of`),
    and price the same parameter state with less activation memory."""
    from jaxpar.auto.pricing import PipelineShape, price_pipeline, stacked_params
    from jaxpar.models.gpt_parallel import pipeline_loss

    cfg = dataclasses.replace(CFG, layers=4)
    x = jax.ShapeDtypeStruct((8, cfg.seq_len), jnp.int32)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    sizes = {"data": 2}
    priced = {}
    for dtype in (None, "bfloat16"):
        graph = build_graph(model, pipeline_loss(), {"inputs": x, "targets": x}, compute_dtype=dtype)
        axes = hand_axes(graph, jaxpar.ParallelConfig(mesh=sizes, rules={"batch": "data"}), sizes)
        shape = PipelineShape(stages=2, microbatches=4, layers=4, activation_bytes=8 * cfg.seq_len * cfg.embed * 2)
        assert len(stacked_params(graph, 4)) == 12, dtype      # every block parameter, stacked
        priced[dtype] = price_pipeline(graph, axes, sizes, CostParams(), shape, zero=1)
    assert priced["bfloat16"][1] == priced[None][1]                 # the same fp32 parameter state
    assert priced["bfloat16"][2] < 0.8 * priced[None][2]             # bf16 activations
