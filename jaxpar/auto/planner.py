"""``plan_job``: the whole job for a device count and a memory budget, confirmed by a dry run.

The planner enumerates *job options*: a mesh shape ``data × model`` of the device count, a
number of micro-batches ``k`` (gradient accumulation), and a ZeRO level. For each mesh shape
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

Recompute and pipeline stages are not chosen by this planner: the Trainer's ``remat``
wraps the whole loss, which does not lower the peak (the recomputed forward saves its
values again), and block-level recompute or pipeline stages change the model itself; set
them in ``base_config`` / the model and the planner prices the rest around them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.auto.api import search
from jaxpar.auto.cost import CostParams, analyse, evaluate, local_bytes, temp_parts, tensor_axes
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

    @property
    def memory_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes

    def label(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        return f"{mesh}, zero={self.zero}, grad_accum={self.grad_accum}"

    def row(self) -> dict:
        return {"mesh": dict(self.mesh), "zero": self.zero, "grad_accum": self.grad_accum,
                "time_s": self.time_s, "memory_bytes": self.memory_bytes, "argument_bytes": self.argument_bytes,
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
        lines.append(f"  {'option':<44} {'step ms':>9} {'memory B':>12}  verdict")
        for o in self.candidates[:top]:
            lines.append(f"  {o.label():<44} {o.time_s * 1e3:>9.4g} {o.memory_bytes:>12,}  {o.verdict}")
        return "\n".join(lines) + "\n" + self.plan.table(operators=False)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen.row(), "candidates": [o.row() for o in self.candidates],
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


def price(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, *, zero: int = 0,
          grad_accum: int = 1, zero_axis: str = "data", threshold_kb: float = 0.0,
          flags=None) -> tuple[float, int, int]:
    """``(step seconds, argument bytes, temp bytes)`` per device of a strategy on the graph of
    one micro-batch, with ``grad_accum`` micro-batches and ZeRO level ``zero`` (module docstring)."""
    from jax.sharding import PartitionSpec

    from jaxpar.auto.assign import spec_of
    from jaxpar.optim.zero import zero_spec

    flags = analyse(graph) if flags is None else flags
    cost = evaluate(graph, axes, sizes, params, flags=flags)
    act, grads, reduced = temp_parts(graph, axes, sizes, flags)
    k, d = grad_accum, sizes.get(zero_axis, 1)
    batch = sum(local_bytes(graph, t, axes, sizes) for _, t in graph.batch)
    shardable = 0.0
    if zero and d > 1:
        for _, t in graph.params:
            tensor = graph.tensors[t]
            spec = PartitionSpec(*spec_of(graph, t, axes))
            out = zero_spec(spec, tensor.shape, tensor.itemsize, (zero_axis,), dict(sizes), threshold_kb)
            if out is not None and out != spec and zero_axis not in (tensor_axes(graph, t, axes) or ()):
                shardable += local_bytes(graph, t, axes, sizes)
    f = (1 - 1 / d) if d > 1 else 0.0
    saved = shardable * f
    args = cost.argument_bytes + (k - 1) * batch
    if zero >= 1:
        args -= params.optimizer_states * saved
    if zero >= 3:
        args -= saved
    gathered = saved if zero >= 3 else 0.0
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


def plan_job(model_fn: Callable, loss_fn: Callable, batch: Any, *, devices: int, memory_budget: float,
             base_config=None, tx=None, cost_params: CostParams | None = None,
             search_name: str = "dynamic_programming", dry_run: bool = True,
             meshes: Sequence[Mapping[str, int]] | None = None, zero_levels: Sequence[int] = (0, 1, 2, 3),
             grad_accum: Sequence[int] = (1, 2, 4), progress: Callable[[str], None] | None = None) -> JobPlan:
    """Choose mesh shape, strategies, micro-batches and ZeRO level for ``devices`` devices
    within ``memory_budget`` bytes per device, minimising predicted step time; confirm the
    winner by compiling it (``dry_run``).

    Args:
      model_fn: builds the model (called abstractly for the search, for real in the dry run).
      loss_fn, batch: as for `jaxpar.auto.search` (``batch``: the whole step's global batch).
      devices: device count to plan for (the dry run needs that many local devices).
      memory_budget: bytes per device.
      base_config: ``ParallelConfig`` whose other settings (``optimizer.threshold_kb``,
        ``dataset_strategy``, annotations in ``parameter_plan``, ``remat``) are kept.
      meshes: mesh shapes to try (default: every ``data × model`` of ``devices``).
      zero_levels: ZeRO levels to try; grad_accum: micro-batch counts to try (those that do
        not divide the batch are skipped).
    """
    from flax import nnx

    from jaxpar.config import OptimizerConfig, ParallelConfig

    if not memory_budget > 0:
        raise ValueError(f"plan_job: memory_budget={memory_budget!r} must be a positive number of bytes per device")
    for z in zero_levels:
        if z not in (0, 1, 2, 3):
            raise ValueError(f"plan_job: zero_levels has {z!r}; ZeRO levels are 0, 1, 2, 3")
    base = base_config or ParallelConfig(mode="auto")
    params = cost_params or CostParams()
    abstract = nnx.eval_shape(model_fn)
    rows = jax.tree.leaves(batch)[0].shape[0]
    shapes = [dict(m) for m in meshes] if meshes is not None else mesh_shapes(devices)
    for m in shapes:
        if math.prod(m.values()) != devices:
            raise ValueError(f"plan_job: mesh {m} has {math.prod(m.values())} devices, not devices={devices}")
    options: list[JobOption] = []
    for k in grad_accum:
        if k < 1 or rows % k:
            continue
        graph = build_graph(abstract, loss_fn, micro_batch(batch, k) if k > 1 else batch)
        flags = analyse(graph)
        for shape in shapes:
            if (rows // k) % shape.get("data", 1):
                continue
            cfg = dataclasses.replace(base, mesh=shape, mode="auto", search=search_name, rules={}, grad_accum=1)
            plans = {}
            for budget in (None, memory_budget):
                p = search(None, loss_fn, batch, cfg, shape, cost_params=params, memory_budget=budget, graph=graph)
                plans[tuple(a for _, _, a in p.classes)] = p
            for plan in plans.values():
                axes = [a for _, _, a in plan.classes]
                d = shape.get("data", 1)
                for z in zero_levels:
                    if z and d == 1:
                        continue
                    t, a, tmp = price(graph, axes, shape, params, zero=z, grad_accum=k,
                                      threshold_kb=base.optimizer.threshold_kb, flags=flags)
                    if math.isfinite(t):
                        options.append(JobOption(shape, k, z, plan, t, a, tmp))
            if progress:
                progress(f"priced mesh {shape}, grad_accum={k}")
    if not options:
        raise ValueError(f"plan_job: no option for devices={devices}: the batch's {rows} rows divide by none of "
                         f"grad_accum={tuple(grad_accum)} x data sizes of {shapes}")
    options.sort(key=lambda o: (o.memory_bytes > memory_budget, o.time_s, o.memory_bytes))
    done: list[JobOption] = []
    chosen = report = config = None
    for o in options:
        fits = o.memory_bytes <= memory_budget
        verdict = "fits" if fits else f"over budget by {o.memory_bytes - memory_budget:,.0f} B (predicted)"
        if fits and chosen is None:
            cfg = dataclasses.replace(base, mesh=dict(o.mesh), mode="auto", search=search_name, rules={},
                                      grad_accum=o.grad_accum,
                                      optimizer=dataclasses.replace(base.optimizer, level=o.zero, axis="data")
                                      if o.zero else OptimizerConfig(level=0))
            config = o.plan.to_config(cfg)
            report = _dry_run(model_fn, loss_fn, batch, config, tx, memory_budget) if dry_run else None
            if report is None or report["fits"]:
                chosen = o
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
                         "Raise the budget, add devices, or allow more grad_accum / zero_levels")
    done.sort(key=lambda o: o.time_s)
    return JobPlan(chosen, config, tuple(done), report, memory_budget)


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
