"""``plan_job``: the whole job for a device count and a memory budget, confirmed by a dry run.

The planner enumerates *job options*: a mesh shape ``data × model`` of the device count, a
number of micro-batches ``k`` (gradient accumulation), a ZeRO level and a recompute policy;
or a pipeline (``pipe × data × model``, micro-batches, schedule) with a ZeRO level. For each mesh shape
and ``k`` it searches operator strategies on the graph of one micro-batch (twice: the
fastest, and the fastest within the budget), then prices every ZeRO level on top of each
strategy with `jaxpar.auto.pricing` (the formulas are there). Options are sorted by predicted step time; the fastest
one that fits is compiled ahead of time on the local (simulated) devices — the *dry run* —
and its compiled memory (``memory_analysis``: arguments + outputs + temp − aliased) checked
against the budget; if it does not fit, the next one is tried.

Recompute: with ``remat=("none", "full", ...)`` the planner builds the model once per
policy (``model_fn(remat=policy)``, e.g. `GPTConfig.remat` for each block) and prices it
like any other option: the graph marks each ``jax.checkpoint`` region, values its policy
does not keep live only during that region's backward (`jaxpar.auto.cost.temp_parts`) and
its forward runs twice (``+1/3`` of its FLOPs, its forward collectives again).

Pipeline stages: with ``pipeline_stages=(1, 2, ...)`` and a `jaxpar.pipeline.PipelineLoss`
(``pipeline_loss``, or ``loss_fn`` itself), a stage count ``p`` adds meshes
``pipe=p × data × model`` and micro-batch counts ``m`` (``microbatches``). Strategies for
the data × model part are searched on the graph of one pipeline micro-batch (the
unpipelined loss, blocks in a scan), then priced by `jaxpar.auto.pricing.price_pipeline`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.auto.api import search
from jaxpar.auto.cost import CostParams, analyse
from jaxpar.auto.graph import build_graph
from jaxpar.auto.job_options import needs_constraint, option_config, plain_options, takes_keyword, with_constraint
from jaxpar.auto.plan import Plan, glob_escape
from jaxpar.auto.pricing import micro_batch, price_pipeline, stacked_params
from jaxpar.nn.plan import declared_names


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
    context: Mapping[str, Any] | None = None     # size, strategy, bytes (collective bytes per device and step)
    experts: Mapping[str, Any] | None = None     # axis, size, bytes (all-to-all bytes per device and step)

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
        if self.context:
            text += f", {self.context['strategy']}"
        if self.experts:
            text += f", experts on {self.experts['axis']}" if self.experts["size"] > 1 else ", experts replicated"
        return text + (f", remat={self.remat}" if self.remat != "none" else "")

    def collective_bytes(self) -> int:
        """Per-device bytes of the context attention's and the experts' collectives per step."""
        return int(sum(x["bytes"] for x in (self.context, self.experts) if x))

    def row(self) -> dict:
        return {"mesh": dict(self.mesh), "zero": self.zero, "grad_accum": self.grad_accum, "remat": self.remat,
                "context": dict(self.context) if self.context else None,
                "experts": dict(self.experts) if self.experts else None,
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
            f = faster[0]
            over = (f"by {f.memory_bytes - self.memory_budget:,.0f} B (predicted)" if f.memory_bytes > self.memory_budget
                    else f"in its dry run ({f.verdict})")
            lines.append(f"why: {len(faster)} faster option(s) exceed the budget, the fastest "
                         f"({f.label()}, {f.time_s * 1e3:.4g} ms) {over}")
        else:
            lines.append("why: the fastest option overall, and it fits")
        lines.append(f"candidates (fastest first, {min(top, len(self.candidates))} of {len(self.candidates)}):")
        extra = any(o.context or o.experts for o in self.candidates)
        head = f" {'cp/ep coll. B':>13}" if extra else ""
        lines.append(f"  {'option':<64} {'step ms':>9} {'memory B':>12}{head}  verdict")
        for o in self.candidates[:top]:
            coll = f" {o.collective_bytes():>13,}" if extra else ""
            lines.append(f"  {o.label():<64} {o.time_s * 1e3:>9.4g} {o.memory_bytes:>12,}{coll}  {o.verdict}")
        if c.pipeline:
            lines.append(f"the table below is the {' x '.join(f'{k}={v}' for k, v in self.plan.mesh.items())} strategy "
                         f"of one micro-batch; the blocks' leading (layers) dimension goes on 'pipe' "
                         f"({c.mesh['pipe']} stages), so each stage holds 1/{c.mesh['pipe']} of their bytes")
        if c.context:
            lines.append(f"the table below is the strategy of the folded graph ([B x {c.context['size']}, S / "
                         f"{c.context['size']}] tokens): its 'data' axis is data x context; {c.context['strategy']} "
                         f"attention moves {c.context['bytes']:,} B per device and step over 'context'")
        if c.experts and c.experts["size"] > 1:
            lines.append(f"experts split over '{c.experts['axis']}' ({c.experts['size']} ways): "
                         f"{c.experts['bytes']:,} B of all-to-alls per device and step (predicted)")
        return "\n".join(lines) + "\n" + self.plan.table(operators=False)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen.row(), "remat": self.remat, "candidates": [o.row() for o in self.candidates],
                "dry_run": dict(self.dry_run) if self.dry_run else None, "memory_budget": self.memory_budget,
                "config": self.config.to_dict()}


def mesh_shapes(devices: int) -> list[dict[str, int]]:
    """Every ``{"data": d, "model": m}`` with ``d × m = devices``."""
    return [{"data": devices // m, "model": m} for m in range(1, devices + 1) if devices % m == 0]


def _with_remat(model_fn: Callable, policy: str, policies: Sequence[str]) -> Callable:
    """``model_fn`` building the model with recompute ``policy`` (``model_fn(remat=policy)``)."""
    if tuple(policies) == ("none",):
        return model_fn
    if not takes_keyword(model_fn, "remat"):
        raise TypeError(f"plan_job: remat={tuple(policies)} needs model_fn to take a remat= keyword (the policy for "
                        "its repeated blocks, e.g. lambda remat='none': GPT(dataclasses.replace(cfg, remat=remat), "
                        "rngs=nnx.Rngs(0))); or pass remat=('none',)")
    return functools.partial(model_fn, remat=policy)


def _pipeline_config(option: JobOption, base, block_paths: set[str]):
    """The semi-auto config of a pipelined option: the plan's specs, with the blocks' leading
    (layers) dimension on the pipe axis."""
    from jax.sharding import PartitionSpec

    from jaxpar.config import PipelineConfig

    pipe = option.pipeline
    plan = {glob_escape(path): PartitionSpec("pipe", *tuple(spec)[1:]) if path in block_paths else spec
            for path, _, spec, _ in option.plan.params}
    return dataclasses.replace(
        base, mode="semi_auto", mesh=dict(option.mesh), rules={}, grad_accum=1, parameter_plan=plan,
        dataset_strategy=option.plan.dataset_strategy(),
        pipeline=PipelineConfig(stages=pipe["stages"], microbatches=pipe["microbatches"],
                                schedule=pipe["schedule"], virtual_stages=pipe["virtual_stages"]))


def plan_job(model_fn: Callable, loss_fn: Callable, batch: Any, *, devices: int, memory_budget: float,
             base_config=None, tx=None, cost_params: CostParams | None = None,
             search_name: str = "dynamic_programming", dry_run: Callable | None = None,
             meshes: Sequence[Mapping[str, int]] | None = None, zero_levels: Sequence[int] = (0, 1, 2, 3),
             grad_accum: Sequence[int] = (1, 2, 4), remat: Sequence[str] = ("none",),
             pipeline_stages: Sequence[int] = (1,), microbatches: Sequence[int] | None = None,
             schedule: str | Sequence[str] = "1f1b", pipeline_loss=None, progress: Callable[[str], None] | None = None,
             context: Sequence[int] = (1,), context_strategy: str | Sequence[str] = ("ring",),
             moe_imbalance: float = 1.0) -> JobPlan:
    """Choose mesh shape, strategies, ZeRO level, recompute policy, micro-batches and
    pipeline stages for ``devices`` devices within ``memory_budget`` bytes per device,
    minimising predicted step time; confirm the winner by compiling it (``dry_run``).

    ``dry_run``: ``compile_fn(model_fn, loss_fn, batch, config, tx) -> jax.stages.Compiled``
    (``jaxpar.train.compile_step`` compiles the Trainer's step), called on the winner; its
    ``memory_analysis`` is compared with the budget. ``None`` or ``False``: no dry run.

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
      context: context-parallel sizes to try (1: none); a size ``cp > 1`` adds meshes
        ``context=cp × data × model`` whose attention runs with each of ``context_strategy``
        (``"ring"``, ``"ulysses"``, ``"all_gather"``; zigzag order), priced by
        `jaxpar.auto.context`. Such an option's model is built with ``model_fn(constrain=...)``.
      moe_imbalance: for models with `jaxpar.nn.MoE` layers, the routing imbalance the
        all-to-all buffers are priced for (1: balanced; `jaxpar.auto.experts`). Their experts
        are priced replicated and split over ``data`` (``"expert": "data"``, whose option's
        model is built with ``model_fn(constrain=...)``).
      pipeline_stages: stage counts to try (1: no pipeline); microbatches: the pipeline's
        micro-batch counts (default ``p, 2p, 4p``); schedule: its schedule, or a tuple of
        schedules to choose from (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved"`` with
        two chunks per stage, ``"zb-v"``, ``"dualpipe-v"``).

    The answer's ``config`` is the chosen ``ParallelConfig``; build the model with
    ``model_fn(remat=job.remat)`` (when several policies were tried) and, for a pipelined
    config, train with the ``PipelineLoss``.
    """
    from flax import nnx

    from jaxpar.config import REMAT_POLICIES, SCHEDULES, OptimizerConfig, ParallelConfig

    if not memory_budget > 0:
        raise ValueError(f"plan_job: memory_budget={memory_budget!r} must be a positive number of bytes per device")
    if dry_run not in (None, False) and not callable(dry_run):
        raise TypeError(f"plan_job: dry_run={dry_run!r} must be a compile function such as "
                        "jaxpar.train.compile_step, or None for no dry run")
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
    schedules = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    if not schedules or any(s not in SCHEDULES for s in schedules):
        raise ValueError(f"plan_job: schedule={schedule!r}; choose one or several of {SCHEDULES}")
    for p in pipeline_stages:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1 or devices % p:
            raise ValueError(f"plan_job: pipeline_stages has {p!r}; use positive divisors of devices={devices}")
    strategies = (context_strategy,) if isinstance(context_strategy, str) else tuple(context_strategy)
    for cp in context:
        if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1 or devices % cp:
            raise ValueError(f"plan_job: context has {cp!r}; use positive divisors of devices={devices}")
    if not len(context) or not strategies:
        raise ValueError(f"plan_job: context={tuple(context)!r} / context_strategy={context_strategy!r} is empty; "
                         "give at least one size (1: no context axis) and one strategy")
    if not moe_imbalance >= 1:
        raise ValueError(f"plan_job: moe_imbalance={moe_imbalance!r} must be >= 1 (the fullest peer's rows over "
                         "the balanced load)")
    base = base_config or ParallelConfig(mode="auto")
    params = cost_params or CostParams()
    rows = jax.tree.leaves(batch)[0].shape[0]
    shapes = [dict(m) for m in meshes] if meshes is not None else mesh_shapes(devices)
    for m in shapes:
        if math.prod(m.values()) != devices:
            raise ValueError(f"plan_job: mesh {m} has {math.prod(m.values())} devices, not devices={devices}")
    options: list[JobOption] = []
    builders = {r: _with_remat(model_fn, r, remat) for r in remat}

    @functools.cache
    def abstract(policy: str):
        return nnx.eval_shape(builders[policy])

    # every policy has the same parameters: a budget below the floor is refused before any search
    check_memory_floor(abstract(remat[0]), batch, devices=devices, memory_budget=memory_budget, params=params)

    @functools.cache
    def model_names(policy: str) -> set[str]:
        return declared_names(base, nnx.state(abstract(policy), nnx.Param))
    if 1 in pipeline_stages:
        options += plain_options(JobOption, abstract, loss_fn, batch, base,
                                 shapes, devices=devices, context=context, strategies=strategies, remat=remat,
                                 grad_accum=grad_accum, zero_levels=zero_levels, search_name=search_name,
                                 params=params, memory_budget=memory_budget, plans=_plans, progress=progress,
                                 imbalance=moe_imbalance)
    blocks: set[str] = set()
    pipe_loss = loss_fn if pipeline_loss is None else pipeline_loss
    staged = [p for p in pipeline_stages if p > 1]
    if staged:
        plain = model_fn if tuple(remat) == ("none",) else builders.get("none", model_fn)
        blocks = _pipeline_options(options, staged, nnx.eval_shape(plain), pipe_loss, batch, base, devices,
                                   microbatches, schedules, search_name, params, zero_levels, progress)
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
                cfg = option_config(o, base, search_name, zero, model_names(o.remat))
                build = with_constraint(builders[o.remat], cfg) if needs_constraint(o) else builders[o.remat]
            report = _dry_run(dry_run, build, pipe_loss if o.pipeline else loss_fn, batch, cfg, tx, memory_budget) \
                if dry_run not in (None, False) else None
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


def memory_floor(abstract, batch, devices: int, params: CostParams) -> tuple[int, int, int]:
    """``(floor, parameter bytes, batch bytes)``: the fewest bytes per device any option can be
    priced at. Every option holds the parameters with their ``optimizer_states`` and the step's
    batch, at best split evenly over all ``devices`` (every mesh axis, ZeRO 3, a pipeline
    stage's share); activations and gradients only add to that.

    >>> memory_floor(nnx.eval_shape(model_fn), batch, 8, CostParams())[0]    # doctest: +SKIP
    """
    from flax import nnx

    def nbytes(tree) -> int:
        return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    weights, rows = nbytes(nnx.state(abstract, nnx.Param)), nbytes(batch)
    return math.ceil((weights * (1 + params.optimizer_states) + rows) / devices), weights, rows


def check_memory_floor(abstract, batch, *, devices: int, memory_budget: float, params: CostParams) -> None:
    """Refuse a budget below `memory_floor` with a ``ValueError`` naming the budget, the floor
    and what to change: no option could fit it, and pricing them all first takes minutes."""
    floor, weights, rows = memory_floor(abstract, batch, devices, params)
    if floor <= memory_budget:
        return
    fewest = math.ceil((weights * (1 + params.optimizer_states) + rows) / memory_budget)
    raise ValueError(
        f"plan_job: nothing can fit a memory budget of {memory_budget:,.0f} B per device on {devices} devices: the "
        f"parameters ({weights:,} B) with {params.optimizer_states} optimizer state(s) each and the batch "
        f"({rows:,} B) need at least {floor:,} B per device even split evenly over all {devices} devices, before "
        f"any activation or gradient. Raise the budget (memory_budget, --memory-budget) above {floor:,} B, plan "
        f"for at least {fewest} devices, or plan a smaller model or batch")


def _plans(graph, loss_fn, batch, base, shape, search_name, params, memory_budget) -> list[Plan]:
    """The fastest strategy, and the fastest within the budget (once if they agree)."""
    cfg = dataclasses.replace(base, mesh=shape, mode="auto", search=search_name, rules={}, grad_accum=1)
    plans = {}
    for budget in (None, memory_budget):
        p = search(None, loss_fn, batch, cfg, shape, cost_params=params, memory_budget=budget, graph=graph)
        plans[tuple(a for _, _, a in p.classes)] = p
    return list(plans.values())


def _pipeline_options(options, stages, abstract, loss_fn, batch, base, devices, microbatches, schedules,
                      search_name, params, zero_levels, progress) -> set[str]:
    """Append the pipelined options (every schedule of ``schedules``) to ``options``; return the
    block parameters' paths."""
    from flax import nnx

    from jaxpar.pipeline.model import PipelineLoss

    if not isinstance(loss_fn, PipelineLoss):
        raise TypeError(f"plan_job: pipeline_stages={tuple(stages)} needs pipeline_loss= (or loss_fn) as a "
                        "jaxpar.pipeline.PipelineLoss "
                        f"(embed / blocks / head / head_loss), got {type(loss_fn).__name__}; see docs/pipeline.md")
    rows = jax.tree.leaves(batch)[0].shape[0]
    layers = jax.tree.leaves(nnx.state(loss_fn.blocks(abstract), nnx.Param))[0].shape[0]
    paths: set[str] = set()
    for p in stages:
        usable = _usable_schedules(schedules, p, layers)
        for m in (microbatches or (p, 2 * p, 4 * p)):
            fits = [name for name in usable if _fits(name, p, m, rows)]
            if not fits and microbatches:
                raise ValueError(f"plan_job: microbatches has {m}, which does not divide the batch's {rows} rows "
                                 f"or does not suit pipe={p} with schedule {schedules} (interleaved needs a "
                                 f"multiple of pipe, dualpipe-v at least 2 * pipe); use divisors of the batch")
            if not fits:
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
                    for name in fits:
                        v = 2 if name == "interleaved" else 1       # the config's virtual_stages
                        t, a, tmp = price_pipeline(graph, axes, inner, params, stages=p, microbatches=m,
                                                   layers=layers, activation_bytes=h.size * h.dtype.itemsize,
                                                   schedule=name, virtual_stages=v, zero=z,
                                                   threshold_kb=base.optimizer.threshold_kb, flags=flags)
                        if math.isfinite(t):
                            pipe = {"stages": p, "microbatches": m, "schedule": name, "virtual_stages": v}
                            options.append(JobOption({"pipe": p, **inner}, 1, z, plan, t, a, tmp, pipeline=pipe))
            if progress:
                progress(f"priced pipe={p}, microbatches={m}")
    return paths


def _usable_schedules(schedules, p: int, layers: int) -> list[str]:
    """The schedules whose chunks (two per stage for interleaved and the V ones) split ``layers``."""
    chunks = {name: 2 if name in ("interleaved", "zb-v", "dualpipe-v") else 1 for name in schedules}
    usable = [name for name in schedules if layers % (p * chunks[name]) == 0]
    if not usable:
        raise ValueError(f"plan_job: pipeline_stages has {p}, but the {layers} stacked layers do not divide "
                         f"into {p} stages x {max(chunks.values())} chunks for schedule {schedules}; use stage "
                         f"counts that divide {layers // max(chunks.values())}")
    return usable


def _fits(name: str, p: int, m: int, rows: int) -> bool:
    if m < 1 or rows % m:
        return False
    return not ((name == "interleaved" and m % p) or (name == "dualpipe-v" and m < 2 * p))


def _dry_run(compile_fn, model_fn, loss_fn, batch, config, tx, budget) -> dict | None:
    """Compile the config's step with ``compile_fn`` on ``jax.devices()`` (simulated CPU devices
    work) and read its memory; ``None`` when there are too few devices."""
    from jaxpar.report import memory

    n = math.prod(config.mesh.values())
    if len(jax.devices()) < n:
        return None
    m = memory(compile_fn(model_fn, loss_fn, batch, config, tx))
    return {"devices": n, "argument_bytes": m.argument_bytes, "temp_bytes": m.temp_bytes, "total": m.total,
            "fits": m.total <= budget}
