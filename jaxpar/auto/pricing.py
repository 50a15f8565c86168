"""Prices of job options: step time, argument bytes and temp bytes per device.

`price` prices a strategy with ``grad_accum`` micro-batches and a ZeRO level on the graph of
one micro-batch; `price_pipeline` a pipelined option. `jaxpar.auto.job_search.search_job` sorts
the options by these prices.

With ``d`` the size of the ZeRO axis (``data``), ``P`` the per-device bytes of the
parameters ZeRO shards (replicated over ``data``, at least ``threshold_kb``, a dimension
divisible by ``d``), ``f = 1 − 1/d`` and ``s`` the optimizer states per parameter:

* arguments: ZeRO ≥ 1 saves ``s · P · f`` (optimizer state), ZeRO 3 also ``P · f``
  (parameters); the batch is the whole step's batch.
* temp: the liveness peak of one micro-batch (`jaxpar.auto.cost.temp_parts`); at the end of
  the step the gradients and their all-reduced sums are live together (the sums sharded at
  ZeRO ≥ 2); ZeRO 3 holds the gathered parameters (``P · f`` more) while the passes run.
  ``k > 1`` adds the gradient accumulator, a loop carry (old and new value live while a
  micro-batch's gradients, and at ZeRO ≥ 2 their all-reduced sum, are added), sharded
  over ``data`` at ZeRO ≥ 2.
* time: ``k ×`` (compute + activation collectives of one micro-batch) + the gradient
  collectives once (combined as XLA combines them: `jaxpar.auto.comm`). At ZeRO ≥ 1 the
  shardable gradients' collective is a reduce-scatter of ``P`` over the ZeRO axis and an
  all-reduce of each device's ``P / d`` shard over the other batch axes (FSDP inside a host,
  data parallel across hosts: MaxText's ``ici_fsdp`` × ``dcn_data``); ZeRO 1-2 then all-gather
  the updated parameters over the ZeRO axis. ZeRO 3 adds an all-gather of ``P`` per micro-batch
  (the scanned layers' in the compute dtype, as the step gathers their casts), and one more in
  the backward of the parameters a recompute region reads (`regathered`; XLA keeps the others'
  gathered values for the backward). With `CostParams.overlap` the gradient collectives run behind the
  last micro-batch's backward (``2/3`` of its compute) and each gather behind a third of a
  micro-batch's compute; only the excess counts (`hidden`).

Recompute needs no formula of its own: the graph marks each ``jax.checkpoint`` region and
the cost model (`jaxpar.auto.cost`) prices what its policy recomputes.

Pipeline (`price_pipeline`): the schedule is lowered to the executor's lock-step
program and each step lasts as long as its slowest stage (a chunk forward ``f``, a
backward ``3f``: the executor recomputes the chunk forward; ``2f`` each for the split
backward's B and W; the last chunk's F is idle and its B and W add the head), plus one
``ppermute`` of one micro-batch's activations per step and channel the placement uses (two
for a loop, four for the V schedules), the embedding and head on the
whole batch, and the gradient all-reduces (combined: one latency per group of mesh axes and
bucket, `jaxpar.auto.comm`). Memory: the blocks' parameters and optimizer states divided by ``p``; temp holds the executor's input and gradient buffers (``x_slots + g_slots``
micro-batch activations), the embedding output, its micro-batch view and its gradient for
the whole batch, one chunk's recomputed activations, the head's activations of one
micro-batch and the gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxpar.auto.comm import GRAD, Comm, combined_time, comm_share
from jaxpar.auto.cost import (Cost, CostParams, evaluate, flags_for, local_bytes, matmul_terms, op_terms,
                              param_of, stacked_slices, tensor_axes)
from jaxpar.auto.graph import Graph


def micro_batch(batch: Any, k: int) -> Any:
    """Abstract shapes of one of ``k`` micro-batches (the leading dimension divided by ``k``)."""
    def one(x):
        shape = tuple(np.shape(x))
        return jax.ShapeDtypeStruct((shape[0] // k, *shape[1:]), np.asarray(x).dtype
                                    if not hasattr(x, "dtype") else x.dtype)
    return jax.tree.map(one, batch)


def _zero_shardable(graph: Graph, axes, sizes: Mapping[str, int], zero_axis: str, threshold_kb: float,
                    scale: Mapping[int, float] | None = None, *, per_layer: bool = False,
                    only_stacked: bool = False, gathered: bool = False) -> float:
    """The sum of `_zero_bytes`."""
    return sum(_zero_bytes(graph, axes, sizes, zero_axis, threshold_kb, scale, per_layer=per_layer,
                           only_stacked=only_stacked, gathered=gathered).values())


def _zero_bytes(graph: Graph, axes, sizes: Mapping[str, int], zero_axis: str, threshold_kb: float,
                scale: Mapping[int, float] | None = None, *, per_layer: bool = False,
                only_stacked: bool = False, gathered: bool = False) -> dict[int, float]:
    """Per parameter tensor, the per-device bytes ZeRO shards over ``zero_axis`` (``scale``: per
    parameter tensor, the share a device holds, e.g. ``1/p`` for a pipeline stage's blocks).
    ``per_layer``: what ZeRO 3 holds gathered at once instead, a scan's stacked parameters
    counting one layer's (`jaxpar.train.step.gather_by_layer` gathers them one at a time,
    unless only their layers axis could be split); ``only_stacked``: the scan's stacked
    parameters alone. ``gathered`` (and ``per_layer``) count what ZeRO 3's all-gathers move and
    the passes hold: a stacked parameter's slices as the scan reads them, its compute-dtype
    cast where the loss reads one (``build_graph(compute_dtype=...)``), at the cast's bytes."""
    from jax.sharding import PartitionSpec

    from jaxpar.auto.assign import spec_of
    from jaxpar.optim.zero import zero_spec

    slices = stacked_slices(graph) if per_layer or only_stacked or gathered else []
    stacked = {p for _, p in slices} if per_layer or only_stacked else set()
    # a stacked parameter is gathered as the scan slices it (its cast; `gather_by_layer` pins
    # the slices), the others in their stored dtype (the partitioned step gathers them before
    # the cast: XLA:CPU's program after SPMD partitioning, a bf16 GPT under ZeRO 3)
    read = {p: op.ins[0] for op, p in slices} if per_layer or gathered else {}
    total: dict[int, float] = {}
    for _, t in graph.params:
        if only_stacked and t not in stacked:
            continue
        tensor = graph.tensors[t]
        spec = PartitionSpec(*spec_of(graph, t, axes))
        out = zero_spec(spec, tensor.shape, tensor.itemsize, (zero_axis,), dict(sizes), threshold_kb,
                        0 if t in stacked else -1)
        if out is not None and out != spec and zero_axis not in (tensor_axes(graph, t, axes) or ()):
            layers = tensor.shape[0] if per_layer and t in stacked and tuple(out)[:1] in ((), (None,)) else 1
            total[t] = local_bytes(graph, read.get(t, t), axes, sizes) * (scale or {}).get(t, 1.0) / layers
    return total


def regathered(graph: Graph) -> set[int]:
    """Parameters a recompute region reads (itself, its cast or a scan's slice of either): ZeRO 3
    gathers them again for the backward pass, where the region is redone. The others are
    gathered once a micro-batch: XLA keeps what the forward gathered for the backward
    (XLA's program after SPMD partitioning, tests/workers/zero3_gathers.py: without recompute
    every parameter is gathered once; with each layer recomputed the layers twice, the
    embeddings and the final norm once)."""
    of = param_of(graph)
    of.update({t: p for op, p in stacked_slices(graph) for t in op.outs})
    return {of[t] for op in graph.ops if op.region >= 0 for t in op.ins if t in of}


def _zero_terms(zero: int, shardable: float, d: int, params: CostParams,
                at_once: float | None = None) -> tuple[float, float, float]:
    """``(argument bytes saved, bytes ZeRO-3 gathers, bytes saved per device of P)``;
    ``at_once``: the shardable bytes ZeRO 3 holds gathered at once (default: all of them)."""
    f = (1 - 1 / d) if d > 1 else 0.0
    saved = shardable * f
    args = (params.optimizer_states * saved if zero >= 1 else 0.0) + (saved if zero >= 3 else 0.0)
    gathered = (shardable if at_once is None else at_once) * f if zero >= 3 else 0.0
    return args, gathered, saved


def price(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, *, zero: int = 0,
          grad_accum: int = 1, zero_axis: str = "data", threshold_kb: float = 0.0,
          cost: Cost | None = None, breakdown: dict | None = None) -> tuple[float, int, int]:
    """``(step seconds, argument bytes, temp bytes)`` per device of a strategy on the graph of
    one micro-batch, with ``grad_accum`` micro-batches and ZeRO level ``zero`` (module docstring).
    ``cost``: the strategy's `evaluate` result, when the caller prices several levels of it
    (without it the graph is analysed and the strategy evaluated here);
    ``breakdown``: a dict filled with the step's parts (seconds: compute, serial and exposed
    collectives; bytes: activations, gradients), for reports. The updated parameters' all-gather
    at ZeRO 1-2 moves `CostParams.gather_itemsize` bytes per element."""
    if cost is None:
        cost = evaluate(graph, axes, sizes, params, flags=flags_for(graph, params))
    act, grads, reduced = cost.temp_parts
    k, d = grad_accum, sizes.get(zero_axis, 1)
    batch = sum(local_bytes(graph, t, axes, sizes) for _, t in graph.batch)
    shardable = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb) if zero and d > 1 else 0.0
    recomputed = zero >= 2 and d > 1 and blocks_recomputed(graph)     # read below at ZeRO >= 2 only
    # ZeRO 3's all-gathers of every shardable parameter: the scanned layers' in the compute
    # dtype (as the scan slices their casts), the others in their stored dtype; once a
    # micro-batch, again in the backward for those a recompute region reads (`regathered`)
    by_param = _zero_bytes(graph, axes, sizes, zero_axis, threshold_kb, gathered=True) if zero >= 3 and d > 1 else {}
    moved = sum(by_param.values())
    redone = regathered(graph) if by_param else set()
    again = sum(b for t, b in by_param.items() if t in redone)
    at_once = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb, per_layer=True) \
        if zero >= 3 and d > 1 and recomputed else moved
    args_saved, gathered, saved = _zero_terms(zero, shardable, d, params, at_once)
    # a scan's stacked gradients are a loop carry: where it is sharded as the update reads it,
    # XLA reduce-scatters each layer's gradient as the backward pass makes it and the passes
    # hold 1/d of them -- at ZeRO 1-2 without micro-batches, and wherever the layers are
    # recomputed at ZeRO >= 2 (measured against the compiled step, XLA:CPU; without recompute
    # ZeRO 3 and the micro-batch loop keep them whole until the backward pass ends; unrolled
    # layers' gradients stay whole until the step's end)
    scatter = d > 1 and ((zero in (1, 2) and k == 1) or (zero >= 2 and recomputed))
    scattered = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb, only_stacked=True) * (1 - 1 / d) \
        if scatter else 0.0
    args = cost.argument_bytes + (k - 1) * batch - args_saved
    if k == 1:
        during = params.temp_activation_factor * (act - scattered) + gathered
        # (ZeRO 2: the compiled step ends with one whole copy, the scattered sum beside it; measured)
        end = grads + (reduced - saved if zero >= 2 else reduced) - (scattered if zero != 2 else 0.0)
        temp = max(during, end)
    else:
        # the accumulator (sharded at ZeRO >= 2, where each micro-batch's gradients are
        # reduced into it inside the loop) is a loop carry: old and new value both live
        # while a micro-batch's gradients are added
        acc = grads - (saved if zero >= 2 else 0.0)
        during = params.temp_activation_factor * (act - scattered) + acc + gathered
        add = grads - scattered + (reduced - scattered if zero >= 2 else 0.0) + 2 * acc + gathered
        end = acc + (reduced if zero < 2 else 0.0)
        temp = max(during, add, end)
    grad_s, after_s = zero_collectives(graph, axes, sizes, params, cost.grad_comm_s, cost.temp_parts[1], shardable,
                                       zero=zero, zero_axis=zero_axis, gather_itemsize=params.gather_itemsize)
    gather_s = params.collective_time("all-gather", (zero_axis,), moved, sizes) if moved else 0.0
    again_s = params.collective_time("all-gather", (zero_axis,), again, sizes) if again else 0.0
    if params.overlap:      # behind compute: the gradients behind the last backward, gathers behind a pass
        grad_s = hidden(grad_s, 2 / 3 * cost.compute_s)
        gather_s, again_s = hidden(gather_s, cost.compute_s / 3), hidden(again_s, cost.compute_s / 3)
        # the updated parameters' gather behind the next step's first forward, layer by layer
        # (Megatron's --overlap-param-gather)
        after_s = hidden(after_s, cost.compute_s / 3)
    time = k * (cost.time_s - cost.grad_comm_s) + grad_s + after_s + k * (gather_s + again_s)
    if breakdown is not None:
        breakdown.update(compute_s=k * cost.compute_s, serial_comm_s=k * (cost.comm_s - cost.grad_comm_s),
                         grad_comm_exposed_s=grad_s, param_gather_after_s=after_s,
                         zero3_gather_s=k * (gather_s + again_s),
                         activation_bytes=act, gradient_bytes=grads)
    return time, int(round(args)), int(round(temp))


def zero_collectives(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, grad_s: float,
                     grads: float, shardable: float, *, zero: int, zero_axis: str,
                     gather_itemsize: int | None = None) -> tuple[float, float]:
    """``(gradient collectives' seconds, seconds of the updated parameters' all-gather)`` at ZeRO
    level ``zero``: ``grad_s``, the gradients' all-reduce time (``grads`` bytes), with the
    ``shardable`` bytes' share replaced by a reduce-scatter over ``zero_axis`` and an
    all-reduce of each device's ``1 / d`` shard over the other batch axes (those that do not
    shard the parameters: FSDP inside a host, data parallel across hosts). ZeRO 1-2 then
    all-gather the updated parameters over ``zero_axis`` (``gather_itemsize``: bytes per
    element it moves, `price`); ZeRO 3 keeps them sharded (gathered per pass instead)."""
    d = sizes.get(zero_axis, 1)
    if not (zero and d > 1 and shardable and grads):
        return grad_s, 0.0
    share = min(1.0, shardable / grads)
    scatter = params.collective_time("all-gather", (zero_axis,), shardable, sizes, True)
    others = tuple(a for a in batch_axes(graph, axes) if a != zero_axis and sizes[a] > 1)
    rest = params.collective_time("all-reduce", others, shardable / d, sizes, True) if others else 0.0
    if zero >= 3:
        return grad_s * (1 - share) + scatter + rest, 0.0
    itemsize = max((graph.tensors[t].itemsize for _, t in graph.params), default=4)
    return grad_s * (1 - share) + scatter + rest, scatter * (gather_itemsize or itemsize) / itemsize


def blocks_recomputed(graph: Graph) -> bool:
    """Whether each layer of the scan is recomputed: a recompute region called once per
    iteration (inside the loop body, not around the whole loop) reads every per-layer parameter
    slice. ZeRO 3's gathered layer is then redone in the backward pass, one layer at a time;
    otherwise the scan keeps every layer's gathered parameters for its backward (its
    residuals), the whole model at once."""
    slices = {t for op, _ in stacked_slices(graph) for t in op.outs}
    read = {t for op in graph.ops if op.region >= 0 and graph.regions[op.region].repeat > 1
            for t in op.ins if t in slices}
    return bool(slices) and read == slices


def batch_axes(graph: Graph, axes) -> tuple[str, ...]:
    """The mesh axes splitting the batch (its leading dimension's class)."""
    if not graph.batch:
        return ()
    c = graph.tensors[graph.batch[0][1]].classes[0]
    return tuple(axes[c]) if c >= 0 else ()


def hidden(comm_s: float, compute_s: float) -> float:
    """Seconds of ``comm_s`` left exposed when it runs behind ``compute_s`` of compute
    (`CostParams.overlap`).

    >>> hidden(3.0, 2.0), hidden(1.0, 2.0)
    (1.0, 0.0)
    """
    return max(0.0, comm_s - compute_s)


def stacked_params(graph: Graph, layers: int) -> set[int]:
    """Parameter tensors a scan over ``layers`` iterations reads slice by slice (the blocks)."""
    return {p for op, p in stacked_slices(graph) if graph.tensors[op.ins[0]].shape[:1] == (layers,)}


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """The pipeline `price_pipeline` prices: ``stages`` stages on mesh axis ``axis``, a step of
    ``microbatches`` micro-batches under ``schedule`` with ``virtual_stages`` chunks a stage (the
    config's; the V schedules place two whatever it says), over the model's ``layers`` stacked
    blocks, and ``activation_bytes``: one micro-batch's block input (global bytes; divided by the
    batch split when priced). ``executor``: ``"lockstep"``, jaxpar's executor (every stage runs one
    step of the lowered program at a time, a backward recomputes its chunk's forward);
    ``"async"``, a framework whose stages run as soon as their inputs arrive and keep their
    activations (Megatron's 1F1B / interleaved schedules, no recompute): the step is the
    schedule's critical path ``(m·v + p − 1)`` chunk forwards and backwards (``B = 2F``) plus
    the head's passes, its sends behind compute under `CostParams.overlap`
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", §2.2: bubble ``(p − 1) / (v·m)``).

    >>> PipelineShape(stages=4, microbatches=8, layers=16, activation_bytes=2**20).schedule
    '1f1b'
    """

    stages: int
    microbatches: int
    layers: int
    activation_bytes: float
    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str = "pipe"
    executor: str = "lockstep"


def price_pipeline(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, pipe: PipelineShape, *,
                   zero: int = 0, zero_axis: str = "data", threshold_kb: float = 0.0,
                   flags=None, breakdown: dict | None = None) -> tuple[float, int, int]:
    """``(step seconds, argument bytes, temp bytes)`` per device of a pipelined job (module docstring;
    ``breakdown``: as `price`'s).

    ``graph``: one pipeline micro-batch of the unpipelined loss, its blocks a scan over
    ``pipe.layers``; ``axes`` / ``sizes``: the strategy of the other mesh axes; ``pipe``: the
    pipeline (`PipelineShape`)."""
    from jaxpar.pipeline import build, lower
    from jaxpar.pipeline.executor import B, B_LAST, F, F_LAST, IDLE, OP, W, W_LAST

    if not isinstance(pipe, PipelineShape):
        raise TypeError(f"price_pipeline: pipe={pipe!r} must be a jaxpar.auto.pricing.PipelineShape(stages=..., "
                        "microbatches=..., layers=..., activation_bytes=...)")
    flags = flags_for(graph, params) if flags is None else flags
    p, m, v = pipe.stages, pipe.microbatches, pipe.virtual_stages
    layers, schedule, axis = pipe.layers, pipe.schedule, pipe.axis
    # the blocks: from the scan's first slice of a stacked parameter to the end of its body
    position = {id(op): i for i, op in enumerate(graph.ops)}
    slices = [(op, q) for op, q in stacked_slices(graph) if graph.tensors[op.ins[0]].shape[:1] == (layers,)]
    stacked = {q for _, q in slices}
    starts = sorted(position[id(op)] for op, _ in slices)
    if not starts:
        raise ValueError(f"price_pipeline: no lax.scan of the loss reads parameters stacked over layers={layers}; "
                         "the loss must be a jaxpar.pipeline.PipelineLoss whose blocks are stacked on a leading "
                         "dimension of that size")
    lo = hi = starts[0]
    while hi + 1 < len(graph.ops) and (graph.ops[hi + 1].repeat >= layers or graph.ops[hi + 1].repeat == 0):
        hi += 1
    part = ["embed" if i < lo else "blocks" if i <= hi else "head" for i in range(len(graph.ops))]
    full = {"embed": 0.0, "blocks": 0.0, "head": 0.0}     # forward + backward seconds, one micro-batch
    act = dict(full)
    grads: list[Comm] = []       # combined once per step, as XLA combines them
    pools: dict[tuple, list[float]] = {}     # `CostParams.matmul_overlap`: `cost.pooled_hidden`
    # one chunk's layers run as a loop only if there are several (XLA removes a loop of one)
    chunk_flags = flags if layers // (p * v) > 1 else flags_for(graph, params, loops=False)
    for op, where in zip(graph.ops, part):
        flops, comms, a, bad = op_terms(graph, op, axes, sizes, flags, params)
        if chunk_flags is not flags:
            a = op_terms(graph, op, axes, sizes, chunk_flags)[2]
        if bad:
            return math.inf, 0, 0
        share = 1 / p if where == "blocks" else 1.0
        full[where] += flops / params.flops_per_s + sum(comm_share(c, sizes, params) for c in comms
                                                        if not c.combined)
        wire, compute = matmul_terms(op, flops, comms, sizes, params)
        pool = pools.setdefault((where, op.repeat), [0.0, 0.0])
        pool[0], pool[1] = pool[0] + wire, pool[1] + compute
        grads += [c._replace(nbytes=share * c.nbytes) for c in comms if c.combined]
        act[where] += a
    for (where, _), (wire, compute) in pools.items():     # TP collectives behind their layer's GEMMs
        full[where] -= min(wire, compute)
    table = build(schedule, p, m, v)
    program = lower(table)
    v = table.virtual_stages                                 # the V schedules place two chunks per stage
    f, h = full["blocks"] / (3 * p * v), full["head"] / 3     # one chunk's / the head's forward
    back = 2 if program.split_backward else 3                # the executor recomputes the forward
    cost = np.zeros(7)
    # the last chunk's F is idle: its B runs the forward, the head and the backward at once
    cost[[IDLE, F, F_LAST, B, B_LAST, W, W_LAST]] = [0, f, 0, back * f, back * (f + h), 2 * f, 2 * (f + h)]
    pipe_s = float(cost[program.code[:, :, OP]].max(axis=1).sum())
    if pipe.executor == "async":    # critical path: m·v chunks through, p − 1 chunks of fill and drain
        back = 2
        pipe_s = (m * v + p - 1) * 3 * f + m * 3 * h
    elif pipe.executor != "lockstep":
        raise ValueError(f"PipelineShape.executor={pipe.executor!r}: use 'lockstep' or 'async'")
    split = math.prod(sizes[a] for a in batch_axes(graph, axes))
    x = pipe.activation_bytes / split
    bw = params.bandwidth.get(axis, params.default_bandwidth)
    # one ppermute per step and channel between stages (a V sends both ways; its turn is local)
    sends = sum(c != "self" for c in program.sends_x + program.sends_g)
    p2p = sends * (params.latency_per_axis.get(axis, params.latency) + x / bw)
    scale = {t: 1 / p for t in stacked}
    held = {t: local_bytes(graph, t, axes, sizes) * scale.get(t, 1.0) for _, t in graph.params}
    rest = sum(b for t, b in held.items() if t not in stacked)
    # the embedding's and head's gradients: every stage holds them, summed over the pipeline
    grads.append(Comm("all-reduce", (axis,), rest, GRAD))
    grad_s = combined_time(grads, {**sizes, axis: p}, params).seconds
    d = sizes.get(zero_axis, 1)
    shardable = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb, scale) if zero and d > 1 else 0.0
    args_saved, gathered, saved = _zero_terms(zero, shardable, d, params)
    grads = sum(held.values())
    grad_s, after_s = zero_collectives(graph, axes, sizes, params, grad_s, grads, shardable, zero=zero,
                                       zero_axis=zero_axis, gather_itemsize=params.gather_itemsize)
    if params.overlap:      # behind the backward passes of the last micro-batch's chunks
        grad_s = hidden(grad_s, back * f * v)
        after_s = hidden(after_s, f * v)     # behind the next step's first forward
    p2p_s = program.steps * p2p
    if pipe.executor == "async" and params.overlap:     # sends behind the next chunk's compute
        p2p_s = 0.0
    time = pipe_s + p2p_s + m * full["embed"] + grad_s + after_s
    others = sum(local_bytes(graph, t, axes, sizes) for _, t in graph.others)
    batch = m * sum(local_bytes(graph, t, axes, sizes) for _, t in graph.batch)
    args = params.optimizer_scalar_bytes + grads * (1 + params.optimizer_states) + others + batch - args_saved
    used = {a for c in range(graph.num_classes) for a in axes[c] if sizes[a] > 1}
    reduced = sum(b for t, b in held.items() if t not in stacked or used - set(tensor_axes(graph, t, axes) or ()))
    # the pipeline holds: its input and gradient buffers, the embedding output (and its micro-batch
    # view) and input gradient for the whole batch, one chunk's recomputed activations, the head's
    # activations of one micro-batch and the gradients it accumulates
    # (async: no recompute; the first stage holds the activations of its chunks for the min(m, p)
    # micro-batches in flight)
    chunk = act["blocks"] / (p * v) if pipe.executor == "lockstep" else min(m, p) * act["blocks"] / p
    during = ((program.x_slots + program.g_slots + 3 * m) * x + grads + gathered
              + params.temp_activation_factor * (chunk + act["head"] + m * act["embed"]))
    end = grads + (reduced - saved if zero >= 2 else reduced)
    gather_s = 0.0
    if zero >= 3 and shardable:   # gathered once per step, before the pipeline runs
        gather_s = params.collective_time("all-gather", (zero_axis,), shardable, sizes)
        gather_s = 2 * (hidden(gather_s, f) if params.overlap else gather_s)
        time += gather_s
    if breakdown is not None:
        busy = m * v * (1 + back) * f + m * (1 + back) * h
        breakdown.update(pipeline_s=pipe_s, pipeline_busy_s=busy, bubble_s=pipe_s - busy, p2p_s=p2p_s,
                         embed_s=m * full["embed"], grad_comm_exposed_s=grad_s, param_gather_after_s=after_s,
                         zero3_gather_s=gather_s, steps=program.steps, activation_bytes=during)
    return time, int(round(args)), int(round(max(during, end)))
