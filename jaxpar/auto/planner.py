"""``plan_job``: the whole job for a device count and a memory budget, confirmed by a dry run.

For every mesh shape ``data × model`` of the device count, the strategy search (with the
budget as a constraint) gives the fastest predicted plan; the fastest one that fits wins.
The winner is compiled ahead of time on simulated devices (``dry_run``) and its compiled
memory (``memory_analysis``: arguments + outputs + temp − aliased) checked against the
budget; if it does not fit, the next candidate is tried. ZeRO level, recompute,
micro-batches and pipeline stages are not searched yet (this build's Trainer does not run
them); the planner keeps the base config's values for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxpar.auto.api import search
from jaxpar.auto.cost import CostParams
from jaxpar.auto.graph import build_graph
from jaxpar.auto.plan import Plan


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The planner's answer: the winning `Plan`, its config, every candidate and the dry run."""

    plan: Plan
    config: Any
    candidates: tuple[Mapping[str, Any], ...]
    dry_run: Mapping[str, Any] | None
    memory_budget: float

    def explain(self) -> str:
        lines = [f"chosen: mesh {dict(self.plan.mesh)}, predicted step {self.plan.cost['time_s'] * 1e3:.4g} ms, "
                 f"memory {self.plan.cost['memory_bytes']:,} B of a {self.memory_budget:,.0f} B budget"]
        if self.dry_run:
            lines.append(f"dry run (compiled on {self.dry_run['devices']} devices): {self.dry_run['total']:,} B "
                         f"({'fits' if self.dry_run['fits'] else 'does NOT fit'})")
        lines.append("candidates (fastest first):")
        for c in self.candidates:
            lines.append(f"  mesh {c['mesh']}: step {c['time_s'] * 1e3:.4g} ms, memory {c['memory_bytes']:,} B"
                         f" -> {c['verdict']}")
        return "\n".join(lines) + "\n" + self.plan.table(operators=False)


def mesh_shapes(devices: int) -> list[dict[str, int]]:
    """Every ``{"data": d, "model": m}`` with ``d × m = devices``."""
    return [{"data": devices // m, "model": m} for m in range(1, devices + 1) if devices % m == 0]


def plan_job(model_fn: Callable, loss_fn: Callable, batch: Any, *, devices: int, memory_budget: float,
             base_config=None, tx=None, cost_params: CostParams | None = None,
             search_name: str = "dynamic_programming", dry_run: bool = True) -> JobPlan:
    """Choose the mesh shape and strategies for ``devices`` devices within ``memory_budget``
    bytes per device, minimising predicted step time; confirm the winner by compiling it."""
    from flax import nnx

    from jaxpar.config import ParallelConfig

    base = base_config or ParallelConfig(mode="auto")
    graph = build_graph(nnx.eval_shape(model_fn), loss_fn, batch)
    params = cost_params or CostParams()
    cands = []
    for shape in mesh_shapes(devices):
        cfg = dataclasses.replace(base, mesh=shape, mode="auto", search=search_name, rules={})
        plan = search(None, loss_fn, batch, cfg, shape, cost_params=params, memory_budget=memory_budget,
                      graph=graph)
        cands.append((plan.cost["memory_bytes"] <= memory_budget, plan.cost["time_s"], plan, cfg))
    cands.sort(key=lambda c: (not c[0], c[1]))
    rows, chosen, report = [], None, None
    for fits, _, plan, cfg in cands:
        verdict = "fits" if fits else "over budget (predicted)"
        if fits and chosen is None:
            report = _dry_run(model_fn, loss_fn, batch, plan, cfg, tx, memory_budget) if dry_run else None
            if report is None or report["fits"]:
                chosen, verdict = (plan, cfg), "CHOSEN" + (" (dry run confirms)" if report else "")
            else:
                verdict = f"predicted to fit, dry run {report['total']:,} B does not"
        elif fits:
            verdict = "fits, slower"
        rows.append({"mesh": dict(plan.mesh), "time_s": plan.cost["time_s"],
                     "memory_bytes": plan.cost["memory_bytes"], "verdict": verdict})
    if chosen is None:
        raise ValueError(f"plan_job: no mesh shape of {devices} devices fits {memory_budget:,.0f} B per device; "
                         f"smallest predicted: {min(c[2].cost['memory_bytes'] for c in cands):,} B")
    plan, cfg = chosen
    return JobPlan(plan, plan.to_config(cfg), tuple(rows), report, memory_budget)


def _dry_run(model_fn, loss_fn, batch, plan: Plan, cfg, tx, budget) -> dict | None:
    """Compile the plan's step on ``jax.devices()`` (simulated CPU devices work) and read its memory."""
    import jax
    import optax

    import jaxpar
    from jaxpar.report import memory

    n = 1
    for v in plan.mesh.values():
        n *= v
    if len(jax.devices()) < n:
        return None
    config = plan.to_config(cfg)
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    model = jaxpar.init(model_fn, config, mesh)
    trainer = jaxpar.Trainer(model, tx or optax.adamw(1e-3), loss_fn, config, mesh)
    m = memory(trainer.lower(batch).compile())
    return {"devices": n, "argument_bytes": m.argument_bytes, "temp_bytes": m.temp_bytes, "total": m.total,
            "fits": m.total <= budget}
