"""``search_job``: the whole job for a device count and a memory budget, confirmed by a dry run.

The search enumerates *job options*: a mesh shape ``data × model`` of the device count, a
number of micro-batches ``k`` (gradient accumulation), a ZeRO level and a recompute policy;
or a pipeline (``pipe × data × model``, micro-batches, schedule) with a ZeRO level. For each mesh shape
and ``k`` it searches operator strategies on the graph of one micro-batch (twice: the
fastest, and the fastest within the budget), weighing each operator ``k`` times against the
gradient collectives that run once per step (``search(..., runs=k)``; a pipeline's
``m + p - 1`` micro-batch slots), then prices every ZeRO level on top of each
strategy with `jaxpar.auto.pricing` (the formulas are there). Options are sorted by predicted step time; the fastest
one that fits is compiled ahead of time on the local (simulated) devices — the *dry run* —
and its compiled memory (``memory_analysis``: arguments + outputs + temp − aliased) checked
against the budget; if it does not fit, the next one is tried. What it may choose from is one
value, a `jaxpar.auto.JobSearchSpace`.

Recompute: with ``remat=("none", "full", ...)`` the search builds the model once and
prices each policy the way the Trainer applies ``ParallelConfig.remat``: on the loss with
each of the model's blocks recomputed (`jaxpar.nn.blocks.remat_loss`, the functions the
step uses, so both recompute the same blocks). The graph marks each ``jax.checkpoint``
region, values its policy does not keep live only during that region's backward
(`jaxpar.auto.cost.temp_parts`) and its forward runs twice (``+1/3`` of its FLOPs, its
forward collectives again). The chosen policy is the chosen config's ``remat``.

Two networks: with `CostParams.devices_per_host` below ``space.devices`` (and
``inter_host_bandwidth``), the job spans ``devices / devices_per_host`` hosts, and each mesh
shape is tried with every layout of them (`host_layouts`: which factor of each axis spans hosts,
the rest inside a host), its strategies searched and priced with `CostParams.placed`. The
tensor axis's all-reduces, the context attention and the experts' all-to-alls then cost what
the network they fall on gives, so the search keeps them inside a host where that is faster
and puts data (or pipe) across; the chosen layout is the config's ``hosts``.

Pipeline stages: with ``pipeline_stages=(1, 2, ...)`` and a `jaxpar.pipeline.PipelineLoss`
(``pipeline_loss``, or ``loss_fn`` itself), a stage count ``p`` adds meshes
``pipe=p × data × model`` and micro-batch counts ``m`` (``microbatches``). Strategies for
the data × model part are searched on the graph of one pipeline micro-batch (the
unpipelined loss, blocks in a scan), then priced by `jaxpar.auto.pricing.price_pipeline`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxpar.deprecation import RenamedAttribute
from jaxpar.auto.api import search
from jaxpar.auto.cost import CostParams, flags_for
from jaxpar.auto.graph import build_graph, compute_dtype
from jaxpar.auto.job_options import needs_constraint, option_config, plain_options, with_constraint
from jaxpar.auto.pricing import PipelineShape, micro_batch, price_pipeline, stacked_params
from jaxpar.auto.search_space import JobSearchSpace
from jaxpar.auto.strategy import Strategy, glob_escape
from jaxpar.nn.blocks import remat_loss
from jaxpar.nn.specs import declared_names
from jaxpar.pipeline.stages import StagedLoss
from jaxpar.report.stage_collectives import StageCollectiveError


@dataclasses.dataclass(frozen=True)
class JobOption:
    """One priced candidate: mesh shape, micro-batches, ZeRO level, the searched `Strategy`,
    predicted step time and per-device memory (arguments and temp)."""

    mesh: Mapping[str, int]
    grad_accum: int
    zero: int
    strategy: Strategy
    time_s: float
    argument_bytes: int
    temp_bytes: int
    verdict: str = ""
    remat: str = "none"
    pipeline: Mapping[str, Any] | None = None    # stages, microbatches, schedule, virtual_stages
    context: Mapping[str, Any] | None = None     # size, strategy, bytes (collective bytes per device and step)
    experts: Mapping[str, Any] | None = None     # axis, size, bytes (all-to-all bytes per device and step)
    hosts: Mapping[str, int] | None = None       # the hosts each axis spans (ParallelConfig.hosts); None: one host

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
        if self._batch_replicated():
            text += ", batch replicated"
        if self.hosts:
            text += ", hosts " + " x ".join(f"{k}={v}{self._splits(k)}" for k, v in self.hosts.items())
        return text + (f", remat={self.remat}" if self.remat != "none" else "")

    def _splits(self, axis: str) -> str:
        """What the searched strategy splits over ``axis`` (``" (batch)"``, ``" (weights)"``, both,
        activations only, or nothing): in mode auto an axis's name does not say which it carries, and across hosts it
        matters (a batch axis moves gradients once a step, a weight axis activations every layer)."""
        from jaxpar.strategy import spec_axes

        def on(specs):
            return any(axis in spec_axes(entry) for spec in specs for entry in tuple(spec))

        what = [name for name, specs in (("batch", [s for _, s in self.strategy.batch]),
                                         ("weights", [s for _, _, s, _ in self.strategy.params])) if on(specs)]
        what += [name for name, carries in ((f"ZeRO-{self.zero} shards", self.zero and axis == "data"),
                                            ("stages", self.pipeline and axis == "pipe"),
                                            ("sequence", self.context and axis == "context")) if carries]
        if not what:
            split = any(axis in axes for _, _, axes in self.strategy.classes)
            what = ["activations only" if split else "nothing: its devices repeat the same work"]
        return f" ({', '.join(what)})"

    def _batch_replicated(self) -> bool:
        """Whether the searched strategy leaves the batch dimension unsplit on a mesh of several
        devices (besides the pipeline stages): its replicas then run the same rows."""
        replicas = math.prod(self.strategy.mesh.values())
        return replicas > 1 and all(not tuple(s) or tuple(s)[0] is None for _, s in self.strategy.batch)

    def collective_bytes(self) -> int:
        """Per-device bytes of the context attention's and the experts' collectives per step."""
        return int(sum(x["bytes"] for x in (self.context, self.experts) if x))

    def row(self) -> dict:
        return {"mesh": dict(self.mesh), "zero": self.zero, "grad_accum": self.grad_accum, "remat": self.remat,
                "context": dict(self.context) if self.context else None,
                "experts": dict(self.experts) if self.experts else None,
                "hosts": dict(self.hosts) if self.hosts else None,
                "pipeline": dict(self.pipeline) if self.pipeline else None, "time_s": self.time_s, "memory_bytes": self.memory_bytes, "argument_bytes": self.argument_bytes,
                "temp_bytes": self.temp_bytes, "verdict": self.verdict}


@dataclasses.dataclass(frozen=True)
class JobSearchResult:
    """What `search_job` found: the winning option, its config, every candidate and the dry run."""

    chosen: JobOption
    config: Any
    candidates: tuple[JobOption, ...]
    dry_run: Mapping[str, Any] | None
    memory_budget: float
    plan = RenamedAttribute("strategy")       # the name of 0.1.0's JobPlan, with a DeprecationWarning

    @property
    def strategy(self) -> Strategy:
        """The winner's searched strategy (of one micro-batch; see `explain`)."""
        return self.chosen.strategy

    @property
    def remat(self) -> str:
        """The recompute policy chosen: ``config.remat``, which the Trainer applies to each block."""
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
        at = next((i for i, o in enumerate(self.candidates) if o is c), None)
        shown = self.candidates[:top]
        if at is not None and at >= top:     # the chosen option's row is always shown
            shown = [*shown, None, c]
        for o in shown:
            if o is None:
                lines.append(f"  ... ({at - top} more, then the chosen one)")
                continue
            coll = f" {o.collective_bytes():>13,}" if extra else ""
            lines.append(f"  {o.label():<64} {o.time_s * 1e3:>9.4g} {o.memory_bytes:>12,}{coll}  {o.verdict}")
        if c.pipeline:
            lines.append(f"the table below is the {' x '.join(f'{k}={v}' for k, v in self.strategy.mesh.items())} strategy "
                         f"of one micro-batch; the blocks' leading (layers) dimension goes on 'pipe' "
                         f"({c.mesh['pipe']} stages), so each stage holds 1/{c.mesh['pipe']} of their bytes")
        if c.context:
            lines.append(f"the table below is the strategy of the folded graph ([B x {c.context['size']}, S / "
                         f"{c.context['size']}] tokens): its 'data' axis is data x context; {c.context['strategy']} "
                         f"attention moves {c.context['bytes']:,} B per device and step over 'context'")
        if c._batch_replicated():
            n = math.prod(c.strategy.mesh.values())
            axes = " x ".join(f"{k}={v}" for k, v in c.strategy.mesh.items() if v > 1)
            lines.append(f"the batch dimension is not split (dataset_strategy={self.config.dataset_strategy!r}): the {n} "
                         f"devices of {axes} each run the whole {'micro-' if c.pipeline else ''}batch, "
                         f"as the searched strategy below predicts is fastest")
        if c.experts and c.experts["size"] > 1:
            lines.append(f"experts split over '{c.experts['axis']}' ({c.experts['size']} ways): "
                         f"{c.experts['bytes']:,} B of all-to-alls per device and step (predicted)")
        return "\n".join(lines) + "\n" + self.strategy.table(operators=False)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen.row(), "remat": self.remat, "candidates": [o.row() for o in self.candidates],
                "dry_run": dict(self.dry_run) if self.dry_run else None, "memory_budget": self.memory_budget,
                "config": self.config.to_dict()}


def host_layouts(sizes: Mapping[str, int], hosts: int) -> list[dict[str, int]]:
    """Every way ``hosts`` hosts split over the axes of a mesh of ``sizes``: ``{axis: factor}``
    with each factor dividing its axis and their product ``hosts`` (``[{}]`` for one host).

    >>> host_layouts({"data": 4, "model": 2}, 2)
    [{'data': 2}, {'model': 2}]
    """
    out: list[dict[str, int]] = [{}]
    for axis, size in sizes.items():
        out = [{**lay, **({axis: f} if f > 1 else {})} for lay in out for f in range(size, 0, -1)
               if size % f == 0 and hosts % (math.prod(lay.values()) * f) == 0]
    return [lay for lay in out if math.prod(lay.values()) == hosts]


def host_count(devices: int, params: CostParams) -> int:
    """Hosts a job of ``devices`` spans under ``params`` (1 with one network); a ``ValueError``
    when ``devices_per_host`` does not divide ``devices``."""
    per = params.devices_per_host
    if per is None or params.inter_host_bandwidth is None or devices <= per:
        return 1
    if devices % per:
        raise ValueError(f"search_job: devices={devices} do not fill hosts of CostParams.devices_per_host={per}; "
                         f"search a multiple of {per} devices, or set devices_per_host to the devices of one host")
    return devices // per


def mesh_shapes(devices: int) -> list[dict[str, int]]:
    """Every ``{"data": d, "model": m}`` with ``d × m = devices``."""
    return [{"data": devices // m, "model": m} for m in range(1, devices + 1) if devices % m == 0]


def _pipeline_config(option: JobOption, base, block_paths: set[str]):
    """The semi-auto config of a pipelined option: its strategy's specs, with the blocks' leading
    (layers) dimension on the pipe axis."""
    from jax.sharding import PartitionSpec

    from jaxpar.config import PipelineConfig

    pipe = option.pipeline
    specs = {glob_escape(path): PartitionSpec("pipe", *tuple(spec)[1:]) if path in block_paths else spec
             for path, _, spec, _ in option.strategy.params}
    return dataclasses.replace(
        base, mode="semi_auto", mesh=dict(option.mesh), rules={}, grad_accum=1, remat=option.remat,
        parameter_strategy=specs,
        dataset_strategy=option.strategy.dataset_strategy(),
        pipeline=PipelineConfig(stages=pipe["stages"], microbatches=pipe["microbatches"],
                                schedule=pipe["schedule"], virtual_stages=pipe["virtual_stages"]))


def search_job(model_fn: Callable, loss_fn: Callable, batch: Any, space: JobSearchSpace, *, base_config=None,
               tx=None, cost_params: CostParams | None = None, dry_run: Callable | None = None,
               pipeline_loss=None) -> JobSearchResult:
    """Choose mesh shape, strategies, ZeRO level, recompute policy, micro-batches and
    pipeline stages from ``space`` (a `JobSearchSpace`: ``space.devices`` devices within
    ``space.memory_budget`` bytes per device), minimising predicted step time; confirm the
    winner by compiling it (``dry_run``).

    Args:
      model_fn: builds the model (called abstractly once for the search, for real in the dry
        run); with a context size or MoE layers it is built with ``model_fn(constrain=...)``.
        Recompute policies are applied to its blocks from outside, as ``ParallelConfig.remat``.
      loss_fn, batch: as for `jaxpar.auto.search` (``batch``: the whole step's global batch).
      space: the choices to search over, checked when it was built.
      base_config: ``ParallelConfig`` whose other settings (``optimizer.threshold_kb``,
        ``dataset_strategy``, annotations in ``parameter_strategy``) are kept; its ``remat``
        must be ``"none"`` (the search chooses it from ``space.remat``), its ``rules`` empty
        and its mode ``"auto"`` or ``"semi_auto"`` (the result's config has mode ``"auto"``).
      tx: the optimizer the dry run compiles with.
      cost_params: the `CostParams` to price with (default ``CostParams()``).
      dry_run: ``compile_fn(model_fn, loss_fn, batch, config, tx) -> jax.stages.Compiled``
        (``jaxpar.train.compile_step`` compiles the Trainer's step), called on the winner; its
        ``memory_analysis`` is compared with the budget. ``None`` or ``False``: no dry run.
      pipeline_loss: the `jaxpar.pipeline.PipelineLoss` for ``space.pipeline_stages`` above 1
        (default: ``loss_fn``, which must then be one).

    The answer's ``config`` is the chosen ``ParallelConfig``, its recompute policy in
    ``config.remat`` (``job.remat``), which the Trainer applies to each of the model's blocks;
    build the model with ``model_fn()`` and, for a pipelined config, train with the
    ``PipelineLoss``.

    >>> space = JobSearchSpace(devices=8, memory_budget=16e9, remat=("none", "full"))   # doctest: +SKIP
    >>> job = search_job(model_fn, loss_fn, batch, space, dry_run=compile_step)          # doctest: +SKIP
    >>> print(job.explain()); train_config = job.config                                   # doctest: +SKIP
    """
    from flax import nnx

    from jaxpar.config import OptimizerConfig, ParallelConfig

    if not isinstance(space, JobSearchSpace):
        raise TypeError(f"search_job: space={space!r} must be a jaxpar.auto.JobSearchSpace, e.g. "
                        "JobSearchSpace(devices=8, memory_budget=16e9)")
    if dry_run not in (None, False) and not callable(dry_run):
        raise TypeError(f"search_job: dry_run={dry_run!r} must be a compile function such as "
                        "jaxpar.train.compile_step, or None for no dry run")
    devices, memory_budget = space.devices, space.memory_budget
    base = base_config or ParallelConfig(mode="auto")
    if base.remat != "none":
        raise ValueError(f"search_job: base_config.remat={base.remat!r}, but the search chooses the recompute "
                         f"policy itself, from space.remat={space.remat}; give JobSearchSpace(remat=({base.remat!r},)) "
                         f"(jaxpar plan: --remat-options {base.remat}) and leave base_config.remat at 'none'")
    if base.rules:
        raise ValueError(f"search_job: base_config.rules={dict(base.rules)} would be replaced by the search (it plans "
                         "every parameter); pin parameters with base_config.parameter_strategy (path glob -> "
                         "strategy), which it keeps, and leave rules empty (jaxpar plan: --annotate GLOB=SPEC)")
    if base.mode in ("data", "hybrid"):
        raise ValueError(f"search_job: base_config.mode={base.mode!r}, but the job search places every parameter "
                         "itself (mode 'auto' in the config it returns); give mode='auto'")
    params = cost_params or CostParams()
    rows = jax.tree.leaves(batch)[0].shape[0]
    shapes = [dict(m) for m in space.meshes] if space.meshes is not None else mesh_shapes(devices)
    axes = {a for m in shapes for a in m} | {"data", "model"} | ({"context"} if max(space.context) > 1 else set())
    params.check_axes(axes | ({"pipe"} if max(space.pipeline_stages) > 1 else set()), "search_job")
    options: list[JobOption] = []
    abstract = nnx.eval_shape(model_fn)      # one model: recompute goes on its blocks from outside
    check_memory_floor(abstract, batch, devices=devices, memory_budget=memory_budget, params=params)
    if 1 in space.pipeline_stages:
        # each policy on the blocks the Trainer's step recomputes (a StagedLoss names them)
        order = loss_fn.order if isinstance(loss_fn, StagedLoss) else None
        loss_of = {r: remat_loss(abstract, loss_fn, r, order) for r in space.remat}
        options += _placed_options(abstract, loss_of, batch, base, shapes, space, params)
    blocks: set[str] = set()
    pipe_loss = loss_fn if pipeline_loss is None else pipeline_loss
    staged = [p for p in space.pipeline_stages if p > 1]
    if staged:
        blocks = _pipeline_options(options, staged, abstract, pipe_loss, batch, base, space, params)
    if not options:
        raise ValueError(f"search_job: no option for devices={devices}: the batch's {rows} rows divide by none of "
                         f"grad_accum={space.grad_accum} x data sizes of {shapes}, nor the pipeline's micro-batches")
    options.sort(key=lambda o: (o.memory_bytes > memory_budget, o.time_s, o.memory_bytes))
    done: list[JobOption] = []
    refused: list[str] = []
    compiled_over: list[tuple[int, JobOption]] = []      # predicted to fit, over the budget compiled
    chosen = report = config = None
    for o in options:
        fits = o.memory_bytes <= memory_budget
        verdict = "fits" if fits else f"over budget by {o.memory_bytes - memory_budget:,.0f} B (predicted)"
        if fits and chosen is None:
            zero = (dataclasses.replace(base.optimizer, level=o.zero, axis="data") if o.zero
                    else OptimizerConfig(level=0))
            if o.pipeline:
                cfg = dataclasses.replace(_pipeline_config(o, base, blocks), optimizer=zero)
                build = model_fn
            else:
                names = declared_names(base, nnx.state(abstract, nnx.Param))
                cfg = option_config(o, base, space.search_name, zero, names)
                build = with_constraint(model_fn, cfg) if needs_constraint(o) else model_fn
            cfg = dataclasses.replace(cfg, hosts=dict(o.hosts or {}))
            # a layout's memory does not depend on which devices share a host: on fewer processes
            # than its hosts (the simulated devices of one) the dry run compiles it as one host
            local = cfg if math.prod(cfg.hosts.values()) == jax.process_count() else dataclasses.replace(cfg, hosts={})
            try:
                report = _dry_run(dry_run, build, pipe_loss if o.pipeline else loss_fn, batch, local, tx,
                                  memory_budget) if dry_run not in (None, False) else None
            except StageCollectiveError as e:     # a program the Trainer would refuse: the next candidate
                refused.append(f"{o.label()}: {e}")
                done.append(dataclasses.replace(o, verdict="refused by its dry run (a collective inside a "
                                                          "pipeline stage's op)"))
                continue
            if report is None or report["fits"]:
                chosen, config = o, cfg
                verdict = "CHOSEN" + (" (dry run confirms)" if report else "")
            else:
                verdict = f"predicted to fit, dry run {report['total']:,} B does not"
                compiled_over.append((report["total"], o))
        elif fits:
            verdict = "fits, slower"
        done.append(dataclasses.replace(o, verdict=verdict))
        if chosen is not None and o is chosen:
            chosen = done[-1]
    if chosen is None and compiled_over:
        total, o = min(compiled_over, key=lambda x: x[0])
        also = f" ({len(refused)} more refused by their dry run; the first: {refused[0]})" if refused else ""
        raise ValueError(f"search_job: nothing fits memory_budget={memory_budget:,.0f} B per device on {devices} "
                         f"devices once compiled: {len(compiled_over)} option(s) predicted to fit, and the dry run "
                         f"of each compiled over it{also}; the smallest, {o.label()}, predicted {o.memory_bytes:,} "
                         f"B, compiled {total:,} B. Raise the budget (that option needs {total:,} B), add devices, "
                         "or allow more grad_accum / zero_levels / remat / pipeline_stages")
    if chosen is None and refused:
        raise ValueError(f"search_job: every option that fits memory_budget={memory_budget:,.0f} B and was "
                         f"compiled was refused by its dry run; the first: {refused[0]}")
    if chosen is None:
        smallest = min(options, key=lambda o: o.memory_bytes)
        raise ValueError(f"search_job: nothing fits memory_budget={memory_budget:,.0f} B per device on {devices} "
                         f"devices; the smallest option ({smallest.label()}) needs {smallest.memory_bytes:,} B. "
                         "Raise the budget, add devices, or allow more grad_accum / zero_levels / remat / "
                         "pipeline_stages")
    done.sort(key=lambda o: o.time_s)
    return JobSearchResult(chosen, config, tuple(done), report, memory_budget)


def _placed_options(abstract, loss_of, batch, base, shapes, space: JobSearchSpace, params: CostParams) -> list:
    """The unpipelined options (`plain_options`); on several hosts, those of every mesh shape
    under each of its `host_layouts`, priced with `CostParams.placed`."""
    hosts = host_count(space.devices, params)
    if hosts == 1:
        return plain_options(JobOption, abstract, loss_of, batch, base, shapes, space, params=params,
                             strategies_of=_strategies)
    out = []
    for cp in space.context:
        n = space.devices // cp
        meshes = shapes if cp == 1 else [{"data": n // m, "model": m} for m in range(1, n + 1) if n % m == 0]
        for shape in meshes:
            real = dict(shape) if cp == 1 else {"context": cp, **shape}
            # the search sees data x context folded into one 'data' axis (`jaxpar.auto.context.fold`)
            seen = dict(shape) if cp == 1 else {**shape, "data": shape["data"] * cp}
            for layout in host_layouts(real, hosts):
                placed = params.placed(layout, real)
                if cp > 1:
                    folded = {"data": layout.get("data", 1) * layout.get("context", 1), "model": layout.get("model", 1)}
                    placed = dataclasses.replace(placed, hosts=folded)

                def only(graph, loss_fn, part, cfg, sizes, *args, seen=seen, **kw):
                    return _strategies(graph, loss_fn, part, cfg, sizes, *args, **kw) if dict(sizes) == seen else []

                found = plain_options(JobOption, abstract, loss_of, batch, base, [shape],
                                      dataclasses.replace(space, context=(cp,)), params=placed, strategies_of=only)
                out += [dataclasses.replace(o, hosts=layout) for o in found]
    return out


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
        f"search_job: nothing can fit a memory budget of {memory_budget:,.0f} B per device on {devices} devices: the "
        f"parameters ({weights:,} B) with {params.optimizer_states} optimizer state(s) each and the batch "
        f"({rows:,} B) need at least {floor:,} B per device even split evenly over all {devices} devices, before "
        f"any activation or gradient. Raise the budget (memory_budget, --memory-budget) above {floor:,} B, use "
        f"at least {fewest} devices, or a smaller model or batch")


def _strategies(graph, loss_fn, batch, base, shape, search_name, params, memory_budget, runs: float = 1) -> list[Strategy]:
    """The fastest strategy, the fastest within the budget and the one of least memory (each
    once); ``runs``: how many times one step runs the graph (`jaxpar.auto.search`), so that the
    search weighs the whole step's compute against the gradient collectives that run once per
    step. The strategy search prices a strategy's memory without ZeRO or micro-batches, which
    the job's price then applies: the least-memory strategy keeps what fits a budget fitting
    every larger one (without it, a larger budget could trade it for a faster strategy that
    no ZeRO level brings under the budget, and nothing would fit)."""
    cfg = dataclasses.replace(base, mesh=shape, mode="auto", search=search_name, rules={}, grad_accum=1)
    found = {}
    for budget in (None,) if memory_budget is None else (None, memory_budget, 0.0):
        s = search(None, loss_fn, batch, cfg, shape, cost_params=params.only(shape), memory_budget=budget,
                   graph=graph, runs=runs)
        found[tuple(a for _, _, a in s.classes)] = s
    return list(found.values())


def _pipeline_options(options, stages, abstract, loss_fn, batch, base, space: JobSearchSpace, params) -> set[str]:
    """Append the pipelined options (every schedule of ``space.schedule``) to ``options``; return the
    block parameters' paths."""
    from flax import nnx

    from jaxpar.pipeline.model import PipelineLoss

    if not isinstance(loss_fn, PipelineLoss):
        raise TypeError(f"search_job: pipeline_stages={tuple(stages)} needs pipeline_loss= (or loss_fn) as a "
                        "jaxpar.pipeline.PipelineLoss "
                        f"(embed / blocks / head / head_loss), got {type(loss_fn).__name__}; see docs/pipeline.md")
    rows = jax.tree.leaves(batch)[0].shape[0]
    layers = jax.tree.leaves(nnx.state(loss_fn.blocks(abstract), nnx.Param))[0].shape[0]
    paths: set[str] = set()
    for p in stages:
        usable = _usable_schedules(space.schedule, p, layers)
        for m in (space.microbatches or (p, 2 * p, 4 * p)):
            fits = [name for name in usable if _fits(name, p, m, rows)]
            if not fits and space.microbatches:
                raise ValueError(f"search_job: microbatches has {m}, which does not divide the batch's {rows} rows "
                                 f"or does not suit pipe={p} with schedule {space.schedule} (interleaved needs a "
                                 f"multiple of pipe, dualpipe-v at least 2 * pipe); use divisors of the batch")
            if not fits:
                continue
            part = micro_batch(batch, m)
            graph = build_graph(abstract, loss_fn, part, compute_dtype=compute_dtype(base))
            flags = flags_for(graph, params)
            stacked = stacked_params(graph, layers)
            paths |= {path for path, t in graph.params if t in stacked}
            h = jax.eval_shape(loss_fn.embed, abstract, part)
            # what crosses between stages: the embedding's output, at most the step's compute dtype wide
            h_bytes = h.size * min(h.dtype.itemsize, jax.numpy.dtype(compute_dtype(base) or h.dtype).itemsize)
            for inner, layout in [(inner, layout) for inner in mesh_shapes(space.devices // p)
                                  for layout in host_layouts({"pipe": p, **inner}, host_count(space.devices, params))]:
                if (rows // m) % inner["data"]:
                    continue
                placed = params.placed(layout, {"pipe": p, **inner}) if layout else params
                # a stage runs its chunk on m micro-batches in m + p - 1 slots (GPipe, 1F1B: the
                # bubble's p - 1), and all-reduces its gradients once per step
                strategy = _strategies(graph, loss_fn, part, base, inner, space.search_name, placed, None,
                                       runs=m + p - 1)[0]
                axes = [a for _, _, a in strategy.classes]
                for z in space.zero_levels:
                    if z and inner["data"] == 1:
                        continue
                    for name in fits:
                        v = 2 if name == "interleaved" else 1       # the config's virtual_stages
                        shape = PipelineShape(stages=p, microbatches=m, layers=layers,
                                              activation_bytes=h_bytes, schedule=name,
                                              virtual_stages=v)
                        t, a, tmp = price_pipeline(graph, axes, inner, placed, shape, zero=z,
                                                   threshold_kb=base.optimizer.threshold_kb, flags=flags)
                        if math.isfinite(t):
                            pipe = {"stages": p, "microbatches": m, "schedule": name, "virtual_stages": v}
                            options.append(JobOption({"pipe": p, **inner}, 1, z, strategy, t, a, tmp, pipeline=pipe,
                                                     hosts=layout or None))
    return paths


def _usable_schedules(schedules, p: int, layers: int) -> list[str]:
    """The schedules whose chunks (two per stage for interleaved and the V ones) split ``layers``."""
    chunks = {name: 2 if name in ("interleaved", "zb-v", "dualpipe-v") else 1 for name in schedules}
    usable = [name for name in schedules if layers % (p * chunks[name]) == 0]
    if not usable:
        raise ValueError(f"search_job: pipeline_stages has {p}, but the {layers} stacked layers do not divide "
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
