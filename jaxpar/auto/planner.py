"""``plan_job``: the whole job for a device count and a memory budget, confirmed by a dry run.

The planner enumerates *job options*: a mesh shape ``data × model`` of the device count, a
number of micro-batches ``k`` (gradient accumulation), a ZeRO level and a recompute policy;
or a pipeline (``pipe × data × model``, micro-batches, schedule) with a ZeRO level. For each mesh shape
and ``k`` it searches operator strategies on the graph of one micro-batch (twice: the
fastest, and the fastest within the budget), then prices every ZeRO level on top of each
strategy with the formulas below. Options are sorted by predicted step time; the fastest
one that fits is compiled ahead of time on the local (simulated) devices — the *dry run* —
and its compiled memory (``memory_analysis``: arguments + outputs + temp − aliased) checked
against the budget; if it does not fit, the next one is tried.

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
  collectives once; ZeRO 3 adds an all-gather of ``P`` per micro-batch for the forward
  and one for the backward.

Recompute: with ``remat=("none", "full", ...)`` the planner builds the model once per
policy (``model_fn(remat=policy)``, e.g. `GPTConfig.remat` for each block) and prices it
like any other option: the graph marks each ``jax.checkpoint`` region, values its policy
does not keep live only during that region's backward (`jaxpar.auto.cost.temp_parts`) and
its forward runs twice (``+1/3`` of its FLOPs, its forward collectives again).

Pipeline stages: with ``pipeline_stages=(1, 2, ...)`` and ``loss_fn`` a
`jaxpar.pipeline.PipelineLoss`, a stage count ``p`` adds meshes ``pipe=p × data × model``
and micro-batch counts ``m`` (``microbatches``). Strategies for the data × model part are
searched on the graph of one pipeline micro-batch (the unpipelined loss, blocks in a scan),
then priced by `price_pipeline`: the schedule is lowered to the executor's lock-step
program and each step lasts as long as its slowest stage (a chunk forward ``f``, a
backward ``3f``: the executor recomputes the chunk forward; ``2f`` each for the split
backward's B and W; the last chunk's F is idle and its B and W add the head), plus two
``ppermute`` of one micro-batch's activations per step, the embedding and head on the whole batch, and the
gradient all-reduces. Memory: the blocks' parameters and optimizer states divided by
``p``; temp holds the executor's input and gradient buffers (``x_slots + g_slots``
micro-batch activations), the embedding output, its micro-batch view and its gradient for
the whole batch, one chunk's recomputed activations, the head's activations of one
micro-batch and the gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.auto.api import search
from jaxpar.auto.cost import CostParams, analyse, evaluate, local_bytes, op_terms, temp_parts, tensor_axes
from jaxpar.auto.graph import Graph, build_graph
from jaxpar.auto.plan import Plan


@dataclasses.dataclass(frozen=True)
class JobOption:
    """One priced candidate: mesh shape, micro-batches, ZeRO level, the strategy's `Plan`,
    predicted step time and per-device memory (arguments and temp)."""

    mesh: Mapping[str, int]
    grad_accum: int
    zero: int
    plan: Plan
    time_s: float
    argument_bytes: int
    temp_bytes: int
    verdict: str = ""
    remat: str = "none"
    pipeline: Mapping[str, Any] | None = None    # stages, microbatches, schedule, virtual_stages

    @property
    def memory_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes

    def label(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        text = f"{mesh}, zero={self.zero}"
        if self.pipeline:
            text += f", {self.pipeline['schedule']} m={self.pipeline['microbatches']}"
        else:
            text += f", grad_accum={self.grad_accum}"
        return text + (f", remat={self.remat}" if self.remat != "none" else "")

    def row(self) -> dict:
        return {"mesh": dict(self.mesh), "zero": self.zero, "grad_accum": self.grad_accum, "remat": self.remat,
                "pipeline": dict(self.pipeline) if self.pipeline else None, "time_s": self.time_s, "memory_bytes": self.memory_bytes, "argument_bytes": self.argument_bytes,
                "temp_bytes": self.temp_bytes, "verdict": self.verdict}


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The planner's answer: the winning option, its config, every candidate and the dry run."""

    chosen: JobOption
    config: Any
    candidates: tuple[JobOption, ...]
    dry_run: Mapping[str, Any] | None
    memory_budget: float

    @property
    def plan(self) -> Plan:
        return self.chosen.plan

    @property
    def remat(self) -> str:
        """The recompute policy chosen: build the model with ``model_fn(remat=job.remat)``."""
        return self.chosen.remat

    def explain(self, top: int = 12) -> str:
        c = self.chosen
        lines = [f"chosen: {c.label()}: predicted step {c.time_s * 1e3:.4g} ms, memory {c.memory_bytes:,} B "
                 f"(arguments {c.argument_bytes:,} + temp {c.temp_bytes:,}) of a {self.memory_budget:,.0f} B budget"]
        if self.dry_run:
            d = self.dry_run
            lines.append(f"dry run (compiled on {d['devices']} devices): {d['total']:,} B (arguments "
                         f"{d['argument_bytes']:,}, temp {d['temp_bytes']:,}; predicted / compiled "
                         f"{c.memory_bytes / max(d['total'], 1):.3f}) -> {'fits' if d['fits'] else 'does NOT fit'}")
        faster = [o for o in self.candidates if o.time_s < c.time_s]
        if faster:
            lines.append(f"why: {len(faster)} faster option(s) exceed the budget, the fastest "
                         f"({faster[0].label()}, {faster[0].time_s * 1e3:.4g} ms) by "
                         f"{faster[0].memory_bytes - self.memory_budget:,.0f} B")
        else:
            lines.append("why: the fastest option overall, and it fits")
        lines.append(f"candidates (fastest first, {min(top, len(self.candidates))} of {len(self.candidates)}):")
        lines.append(f"  {'option':<64} {'step ms':>9} {'memory B':>12}  verdict")
        for o in self.candidates[:top]:
            lines.append(f"  {o.label():<64} {o.time_s * 1e3:>9.4g} {o.memory_bytes:>12,}  {o.verdict}")
        if c.pipeline:
            lines.append(f"the table below is the {' x '.join(f'{k}={v}' for k, v in self.plan.mesh.items())} strategy "
                         f"of one micro-batch; the blocks' leading (layers) dimension goes on 'pipe' "
                         f"({c.mesh['pipe']} stages), so each stage holds 1/{c.mesh['pipe']} of their bytes")
        return "\n".join(lines) + "\n" + self.plan.table(operators=False)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen.row(), "remat": self.remat, "candidates": [o.row() for o in self.candidates],
                "dry_run": dict(self.dry_run) if self.dry_run else None, "memory_budget": self.memory_budget,
                "config": self.config.to_dict()}


def mesh_shapes(devices: int) -> list[dict[str, int]]:
    """Every ``{"data": d, "model": m}`` with ``d × m = devices``."""
    return [{"data": devices // m, "model": m} for m in range(1, devices + 1) if devices % m == 0]


def micro_batch(batch: Any, k: int) -> Any:
    """Abstract shapes of one of ``k`` micro-batches (the leading dimension divided by ``k``)."""
    def one(x):
        shape = tuple(np.shape(x))
        return jax.ShapeDtypeStruct((shape[0] // k, *shape[1:]), np.asarray(x).dtype
                                    if not hasattr(x, "dtype") else x.dtype)
    return jax.tree.map(one, batch)


def _zero_shardable(graph: Graph, axes, sizes: Mapping[str, int], zero_axis: str, threshold_kb: float,
                    scale: Mapping[int, float] | None = None) -> float:
    """Per-device bytes of the parameters ZeRO shards over ``zero_axis`` (``scale``: per
    parameter tensor, the share a device holds, e.g. ``1/p`` for a pipeline stage's blocks)."""
    from jax.sharding import PartitionSpec

    from jaxpar.auto.assign import spec_of
    from jaxpar.optim.zero import zero_spec

    total = 0.0
    for _, t in graph.params:
        tensor = graph.tensors[t]
        spec = PartitionSpec(*spec_of(graph, t, axes))
        out = zero_spec(spec, tensor.shape, tensor.itemsize, (zero_axis,), dict(sizes), threshold_kb)
        if out is not None and out != spec and zero_axis not in (tensor_axes(graph, t, axes) or ()):
            total += local_bytes(graph, t, axes, sizes) * (scale or {}).get(t, 1.0)
    return total


def _zero_terms(zero: int, shardable: float, d: int, params: CostParams) -> tuple[float, float, float]:
    """``(argument bytes saved, bytes ZeRO-3 gathers, bytes saved per device of P)``."""
    f = (1 - 1 / d) if d > 1 else 0.0
    saved = shardable * f
    args = (params.optimizer_states * saved if zero >= 1 else 0.0) + (saved if zero >= 3 else 0.0)
    return args, (saved if zero >= 3 else 0.0), saved


def price(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, *, zero: int = 0,
          grad_accum: int = 1, zero_axis: str = "data", threshold_kb: float = 0.0,
          flags=None) -> tuple[float, int, int]:
    """``(step seconds, argument bytes, temp bytes)`` per device of a strategy on the graph of
    one micro-batch, with ``grad_accum`` micro-batches and ZeRO level ``zero`` (module docstring)."""
    flags = analyse(graph) if flags is None else flags
    cost = evaluate(graph, axes, sizes, params, flags=flags)
    act, grads, reduced = temp_parts(graph, axes, sizes, flags)
    k, d = grad_accum, sizes.get(zero_axis, 1)
    batch = sum(local_bytes(graph, t, axes, sizes) for _, t in graph.batch)
    shardable = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb) if zero and d > 1 else 0.0
    args_saved, gathered, saved = _zero_terms(zero, shardable, d, params)
    args = cost.argument_bytes + (k - 1) * batch - args_saved
    if k == 1:
        during = params.temp_activation_factor * act + gathered
        end = grads + (reduced - saved if zero >= 2 else reduced)
        temp = max(during, end)
    else:
        # the accumulator (sharded at ZeRO >= 2, where each micro-batch's gradients are
        # reduced into it inside the loop) is a loop carry: old and new value both live
        # while a micro-batch's gradients are added
        acc = grads - (saved if zero >= 2 else 0.0)
        during = params.temp_activation_factor * act + acc + gathered
        add = grads + (reduced if zero >= 2 else 0.0) + 2 * acc + gathered
        end = acc + (reduced if zero < 2 else 0.0)
        temp = max(during, add, end)
    time = k * (cost.time_s - cost.grad_comm_s) + cost.grad_comm_s
    if zero >= 3 and shardable:
        time += k * 2 * params.collective_time("all-gather", (zero_axis,), shardable, sizes)
    return time, int(round(args)), int(round(temp))


def stacked_params(graph: Graph, layers: int) -> set[int]:
    """Parameter tensors a scan over ``layers`` iterations reads slice by slice (the blocks)."""
    params = {t for _, t in graph.params}
    return {op.ins[0] for op in graph.ops if op.prim == "copy" and op.get("scan") == "xs"
            and op.ins[0] in params and graph.tensors[op.ins[0]].shape[:1] == (layers,)}


def price_pipeline(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, *, stages: int,
                   microbatches: int, layers: int, activation_bytes: float, schedule: str = "1f1b",
                   virtual_stages: int = 1, zero: int = 0, zero_axis: str = "data", threshold_kb: float = 0.0,
                   axis: str = "pipe", flags=None) -> tuple[float, int, int]:
    """``(step seconds, argument bytes, temp bytes)`` per device of a pipelined job (module docstring).

    ``graph``: one pipeline micro-batch of the unpipelined loss, its blocks a scan over
    ``layers``; ``axes`` / ``sizes``: the strategy of the other mesh axes; ``activation_bytes``:
    one micro-batch's block input (global bytes; divided here by the batch split)."""
    from jaxpar.pipeline import build, lower
    from jaxpar.pipeline.executor import B, B_LAST, F, F_LAST, IDLE, OP, W, W_LAST

    flags = analyse(graph) if flags is None else flags
    p, m, v = stages, microbatches, virtual_stages
    stacked = stacked_params(graph, layers)
    # the blocks: from the scan's first slice of a stacked parameter to the end of its body
    starts = [i for i, op in enumerate(graph.ops) if op.prim == "copy" and op.get("scan") == "xs"
              and op.ins[0] in stacked]
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
    grad_s = 0.0
    # one chunk's layers run as a loop only if there are several (XLA removes a loop of one)
    chunk_flags = flags if layers // (p * v) > 1 else analyse(graph, loops=False)
    for op, where in zip(graph.ops, part):
        flops, comms, a, bad = op_terms(graph, op, axes, sizes, flags)
        if chunk_flags is not flags:
            a = op_terms(graph, op, axes, sizes, chunk_flags)[2]
        if bad:
            return math.inf, 0, 0
        share = 1 / p if where == "blocks" else 1.0
        full[where] += flops / params.flops_per_s + sum(params.collective_time(k, ax, b, sizes, c)
                                                    for k, ax, b, c in comms if not c)
        grad_s += share * sum(params.collective_time(k, ax, b, sizes, c) for k, ax, b, c in comms if c)
        act[where] += a
    program = lower(build(schedule, p, m, v))
    f, h = full["blocks"] / (3 * p * v), full["head"] / 3     # one chunk's / the head's forward
    back = 2 if program.split_backward else 3                # the executor recomputes the forward
    cost = np.zeros(7)
    # the last chunk's F is idle: its B runs the forward, the head and the backward at once
    cost[[IDLE, F, F_LAST, B, B_LAST, W, W_LAST]] = [0, f, 0, back * f, back * (f + h), 2 * f, 2 * (f + h)]
    pipe_s = float(cost[program.code[:, :, OP]].max(axis=1).sum())
    batch_class = graph.tensors[graph.batch[0][1]].classes[0] if graph.batch else -1
    split = math.prod(sizes[a] for a in axes[batch_class]) if batch_class >= 0 else 1
    x = activation_bytes / split
    bw = params.bandwidth.get(axis, params.default_bandwidth)
    p2p = 2 * (params.latency_per_axis.get(axis, params.latency) + x / bw)
    scale = {t: 1 / p for t in stacked}
    held = {t: local_bytes(graph, t, axes, sizes) * scale.get(t, 1.0) for _, t in graph.params}
    rest = sum(b for t, b in held.items() if t not in stacked)
    grad_s += params.collective_time("all-reduce", (axis,), rest, {**sizes, axis: p}, True)
    time = pipe_s + program.steps * p2p + m * full["embed"] + grad_s
    d = sizes.get(zero_axis, 1)
    shardable = _zero_shardable(graph, axes, sizes, zero_axis, threshold_kb, scale) if zero and d > 1 else 0.0
    args_saved, gathered, saved = _zero_terms(zero, shardable, d, params)
    grads = sum(held.values())
    others = sum(local_bytes(graph, t, axes, sizes) for _, t in graph.others)
    batch = m * sum(local_bytes(graph, t, axes, sizes) for _, t in graph.batch)
    args = params.optimizer_scalar_bytes + grads * (1 + params.optimizer_states) + others + batch - args_saved
    used = {a for c in range(graph.num_classes) for a in axes[c] if sizes[a] > 1}
    reduced = sum(b for t, b in held.items() if t not in stacked or used - set(tensor_axes(graph, t, axes) or ()))
    # the pipeline holds: its input and gradient buffers, the embedding output (and its micro-batch
    # view) and input gradient for the whole batch, one chunk's recomputed activations, the head's
    # activations of one micro-batch and the gradients it accumulates
    during = ((program.x_slots + program.g_slots + 3 * m) * x + grads + gathered
              + params.temp_activation_factor * (act["blocks"] / (p * v) + act["head"] + m * act["embed"]))
    end = grads + (reduced - saved if zero >= 2 else reduced)
    if zero >= 3 and shardable:   # gathered once per step, before the pipeline runs
        time += 2 * params.collective_time("all-gather", (zero_axis,), shardable, sizes)
    return time, int(round(args)), int(round(max(during, end)))


def _with_remat(model_fn: Callable, policy: str, policies: Sequence[str]) -> Callable:
    """``model_fn`` building the model with recompute ``policy`` (``model_fn(remat=policy)``)."""
    if tuple(policies) == ("none",):
        return model_fn
    try:
        accepts = any(p.name == "remat" or p.kind is inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model_fn).parameters.values())
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        raise TypeError(f"plan_job: remat={tuple(policies)} needs model_fn to take a remat= keyword (the policy for "
                        "its repeated blocks, e.g. lambda remat='none': GPT(dataclasses.replace(cfg, remat=remat), "
                        "rngs=nnx.Rngs(0))); or pass remat=('none',)")
    return functools.partial(model_fn, remat=policy)


def _pipeline_config(option: JobOption, base, block_paths: set[str]):
    """The semi-auto config of a pipelined option: the plan's specs, with the blocks' leading
    (layers) dimension on the pipe axis."""
    from jax.sharding import PartitionSpec

    from jaxpar.auto.plan import _glob_escape
    from jaxpar.config import PipelineConfig

    pipe = option.pipeline
    plan = {_glob_escape(path): PartitionSpec("pipe", *tuple(spec)[1:]) if path in block_paths else spec
            for path, _, spec, _ in option.plan.params}
    return dataclasses.replace(
        base, mode="semi_auto", mesh=dict(option.mesh), rules={}, grad_accum=1, parameter_plan=plan,
        dataset_strategy=option.plan.dataset_strategy(),
        pipeline=PipelineConfig(stages=pipe["stages"], microbatches=pipe["microbatches"],
                                schedule=pipe["schedule"], virtual_stages=pipe["virtual_stages"]))


def plan_job(model_fn: Callable, loss_fn: Callable, batch: Any, *, devices: int, memory_budget: float,
             base_config=None, tx=None, cost_params: CostParams | None = None,
             search_name: str = "dynamic_programming", dry_run: bool = True,
             meshes: Sequence[Mapping[str, int]] | None = None, zero_levels: Sequence[int] = (0, 1, 2, 3),
             grad_accum: Sequence[int] = (1, 2, 4), remat: Sequence[str] = ("none",),
             pipeline_stages: Sequence[int] = (1,), microbatches: Sequence[int] | None = None,
             schedule: str = "1f1b", pipeline_loss=None, progress: Callable[[str], None] | None = None) -> JobPlan:
    """Choose mesh shape, strategies, ZeRO level, recompute policy, micro-batches and
    pipeline stages for ``devices`` devices within ``memory_budget`` bytes per device,
    minimising predicted step time; confirm the winner by compiling it (``dry_run``).

    Args:
      model_fn: builds the model (called abstractly for the search, for real in the dry run);
        with ``remat`` other than ``("none",)`` it must take ``remat=`` (the policy of its
        repeated blocks, e.g. `GPTConfig.remat`).
      loss_fn, batch: as for `jaxpar.auto.search` (``batch``: the whole step's global batch).
      pipeline_loss: the `jaxpar.pipeline.PipelineLoss` for ``pipeline_stages`` above 1
        (default: ``loss_fn``, which must then be one).
      devices: device count to plan for (the dry run needs that many local devices).
      memory_budget: bytes per device.
      base_config: ``ParallelConfig`` whose other settings (``optimizer.threshold_kb``,
        ``dataset_strategy``, annotations in ``parameter_plan``) are kept.
      meshes: ``data × model`` shapes to try without a pipeline (default: all of ``devices``;
        beside a pipe axis of ``p``, all of ``devices / p``).
      zero_levels: ZeRO levels to try; grad_accum: micro-batch counts to try without a
        pipeline (those that do not divide the batch are skipped); remat: recompute
        policies to try (`jaxpar.remat` names; the pipeline's executor already recomputes
        each stage's forward, so pipelined options use the model as ``model_fn()`` builds it).
      pipeline_stages: stage counts to try (1: no pipeline); microbatches: the pipeline's
        micro-batch counts (default ``p, 2p, 4p``); schedule: its schedule (``"gpipe"``,
        ``"1f1b"``, ``"zb-h1"``, or ``"interleaved"`` with two chunks per stage).

    The answer's ``config`` is the chosen ``ParallelConfig``; build the model with
    ``model_fn(remat=job.remat)`` (when several policies were tried) and, for a pipelined
    config, train with the ``PipelineLoss``.
    """
    from flax import nnx

    from jaxpar.config import REMAT_POLICIES, SCHEDULES, OptimizerConfig, ParallelConfig

    if not memory_budget > 0:
        raise ValueError(f"plan_job: memory_budget={memory_budget!r} must be a positive number of bytes per device")
    for z in zero_levels:
        if z not in (0, 1, 2, 3):
            raise ValueError(f"plan_job: zero_levels has {z!r}; ZeRO levels are 0, 1, 2, 3")
    for name, values in (("zero_levels", zero_levels), ("grad_accum", grad_accum), ("remat", remat),
                         ("pipeline_stages", pipeline_stages)):
        if not len(values):
            raise ValueError(f"plan_job: {name}=() is empty; give at least one option")
    for r in remat:
        if r not in REMAT_POLICIES:
            raise ValueError(f"plan_job: remat has {r!r}; choose policies from {REMAT_POLICIES}")
        if r == "offload_dots":
            raise ValueError("plan_job: remat has 'offload_dots'; the planner does not price host transfers, "
                             "so an offloading policy would look free. Leave it out of remat and set it by hand")
    if schedule not in SCHEDULES:
        raise ValueError(f"plan_job: schedule={schedule!r}; choose one of {SCHEDULES}")
    for p in pipeline_stages:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1 or devices % p:
            raise ValueError(f"plan_job: pipeline_stages has {p!r}; use positive divisors of devices={devices}")
    base = base_config or ParallelConfig(mode="auto")
    params = cost_params or CostParams()
    rows = jax.tree.leaves(batch)[0].shape[0]
    shapes = [dict(m) for m in meshes] if meshes is not None else mesh_shapes(devices)
    for m in shapes:
        if math.prod(m.values()) != devices:
            raise ValueError(f"plan_job: mesh {m} has {math.prod(m.values())} devices, not devices={devices}")
    options: list[JobOption] = []
    builders = {r: _with_remat(model_fn, r, remat) for r in remat}
    if 1 in pipeline_stages:
        for policy in remat:
            abstract = nnx.eval_shape(builders[policy])
            for k in grad_accum:
                if k < 1 or rows % k:
                    continue
                graph = build_graph(abstract, loss_fn, micro_batch(batch, k) if k > 1 else batch)
                flags = analyse(graph)
                for shape in shapes:
                    if (rows // k) % shape.get("data", 1):
                        continue
                    for plan in _plans(graph, loss_fn, batch, base, shape, search_name, params, memory_budget):
                        axes = [a for _, _, a in plan.classes]
                        for z in zero_levels:
                            if z and shape.get("data", 1) == 1:
                                continue
                            t, a, tmp = price(graph, axes, shape, params, zero=z, grad_accum=k,
                                              threshold_kb=base.optimizer.threshold_kb, flags=flags)
                            if math.isfinite(t):
                                options.append(JobOption(shape, k, z, plan, t, a, tmp, remat=policy))
                    if progress:
                        progress(f"priced mesh {shape}, grad_accum={k}, remat={policy}")
    blocks: set[str] = set()
    pipe_loss = loss_fn if pipeline_loss is None else pipeline_loss
    staged = [p for p in pipeline_stages if p > 1]
    if staged:
        plain = model_fn if tuple(remat) == ("none",) else builders.get("none", model_fn)
        blocks = _pipeline_options(options, staged, nnx.eval_shape(plain), pipe_loss, batch, base, devices,
                                   microbatches, schedule, search_name, params, zero_levels, progress)
    if not options:
        raise ValueError(f"plan_job: no option for devices={devices}: the batch's {rows} rows divide by none of "
                         f"grad_accum={tuple(grad_accum)} x data sizes of {shapes}, nor the pipeline's micro-batches")
    options.sort(key=lambda o: (o.memory_bytes > memory_budget, o.time_s, o.memory_bytes))
    done: list[JobOption] = []
    chosen = report = config = None
    for o in options:
        fits = o.memory_bytes <= memory_budget
        verdict = "fits" if fits else f"over budget by {o.memory_bytes - memory_budget:,.0f} B (predicted)"
        if fits and chosen is None:
            zero = (dataclasses.replace(base.optimizer, level=o.zero, axis="data") if o.zero
                    else OptimizerConfig(level=0))
            if o.pipeline:
                cfg = dataclasses.replace(_pipeline_config(o, base, blocks), optimizer=zero)
                build = builders.get("none", model_fn) if tuple(remat) != ("none",) else model_fn
            else:
                cfg = o.plan.to_config(dataclasses.replace(base, mesh=dict(o.mesh), mode="auto", search=search_name,
                                                           rules={}, grad_accum=o.grad_accum, optimizer=zero))
                build = builders[o.remat]
            report = _dry_run(build, pipe_loss if o.pipeline else loss_fn, batch, cfg, tx, memory_budget) \
                if dry_run else None
            if report is None or report["fits"]:
                chosen, config = o, cfg
                verdict = "CHOSEN" + (" (dry run confirms)" if report else "")
            else:
                verdict = f"predicted to fit, dry run {report['total']:,} B does not"
        elif fits:
            verdict = "fits, slower"
        done.append(dataclasses.replace(o, verdict=verdict))
        if chosen is not None and o is chosen:
            chosen = done[-1]
    if chosen is None:
        smallest = min(options, key=lambda o: o.memory_bytes)
        raise ValueError(f"plan_job: nothing fits memory_budget={memory_budget:,.0f} B per device on {devices} "
                         f"devices; the smallest option ({smallest.label()}) needs {smallest.memory_bytes:,} B. "
                         "Raise the budget, add devices, or allow more grad_accum / zero_levels / remat / "
                         "pipeline_stages")
    done.sort(key=lambda o: o.time_s)
    return JobPlan(chosen, config, tuple(done), report, memory_budget)


def _plans(graph, loss_fn, batch, base, shape, search_name, params, memory_budget) -> list[Plan]:
    """The fastest strategy, and the fastest within the budget (once if they agree)."""
    cfg = dataclasses.replace(base, mesh=shape, mode="auto", search=search_name, rules={}, grad_accum=1)
    plans = {}
    for budget in (None, memory_budget):
        p = search(None, loss_fn, batch, cfg, shape, cost_params=params, memory_budget=budget, graph=graph)
        plans[tuple(a for _, _, a in p.classes)] = p
    return list(plans.values())


def _pipeline_options(options, stages, abstract, loss_fn, batch, base, devices, microbatches, schedule,
                      search_name, params, zero_levels, progress) -> set[str]:
    """Append the pipelined options to ``options``; return the block parameters' paths."""
    from flax import nnx

    from jaxpar.pipeline.model import PipelineLoss

    if not isinstance(loss_fn, PipelineLoss):
        raise TypeError(f"plan_job: pipeline_stages={tuple(stages)} needs pipeline_loss= (or loss_fn) as a "
                        "jaxpar.pipeline.PipelineLoss "
                        f"(embed / blocks / head / head_loss), got {type(loss_fn).__name__}; see docs/pipeline.md")
    rows = jax.tree.leaves(batch)[0].shape[0]
    layers = jax.tree.leaves(nnx.state(loss_fn.blocks(abstract), nnx.Param))[0].shape[0]
    v = 2 if schedule == "interleaved" else 1
    paths: set[str] = set()
    for p in stages:
        if layers % (p * v):
            raise ValueError(f"plan_job: pipeline_stages has {p}, but the {layers} stacked layers do not divide "
                             f"into {p} stages x {v} chunks; use stage counts that divide {layers // v}")
        for m in (microbatches or (p, 2 * p, 4 * p)):
            bad = m < 1 or rows % m or (schedule == "interleaved" and m % p)
            if bad and microbatches:
                raise ValueError(f"plan_job: microbatches has {m}, which does not divide the batch's {rows} rows"
                                 + (f" or is not a multiple of pipe={p} (interleaved)" if schedule == "interleaved"
                                    else "") + "; use divisors of the batch")
            if bad:
                continue
            part = micro_batch(batch, m)
            graph = build_graph(abstract, loss_fn, part)
            flags = analyse(graph)
            stacked = stacked_params(graph, layers)
            paths |= {path for path, t in graph.params if t in stacked}
            h = jax.eval_shape(loss_fn.embed, abstract, part)
            for inner in mesh_shapes(devices // p):
                if (rows // m) % inner["data"]:
                    continue
                plan = _plans(graph, loss_fn, part, base, inner, search_name, params, None)[0]
                axes = [a for _, _, a in plan.classes]
                for z in zero_levels:
                    if z and inner["data"] == 1:
                        continue
                    t, a, tmp = price_pipeline(graph, axes, inner, params, stages=p, microbatches=m, layers=layers,
                                               activation_bytes=h.size * h.dtype.itemsize, schedule=schedule,
                                               virtual_stages=v, zero=z, threshold_kb=base.optimizer.threshold_kb,
                                               flags=flags)
                    if math.isfinite(t):
                        pipe = {"stages": p, "microbatches": m, "schedule": schedule, "virtual_stages": v}
                        options.append(JobOption({"pipe": p, **inner}, 1, z, plan, t, a, tmp, pipeline=pipe))
            if progress:
                progress(f"priced pipe={p}, microbatches={m}")
    return paths


def _dry_run(model_fn, loss_fn, batch, config, tx, budget) -> dict | None:
    """Compile the config's step on ``jax.devices()`` (simulated CPU devices work) and read its memory."""
    import optax

    import jaxpar
    from jaxpar.report import memory

    n = math.prod(config.mesh.values())
    if len(jax.devices()) < n:
        return None
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    model = jaxpar.init(model_fn, config, mesh)
    trainer = jaxpar.Trainer(model, tx or optax.adamw(1e-3), loss_fn, config, mesh)
    m = memory(trainer.lower(batch).compile())
    return {"devices": n, "argument_bytes": m.argument_bytes, "temp_bytes": m.temp_bytes, "total": m.total,
            "fits": m.total <= budget}
