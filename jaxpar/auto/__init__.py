"""Automatic parallelism: graph from a jaxpr, cost model, propagation and strategy search.

    >>> config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto",
    ...                                search="dynamic_programming")              # doctest: +SKIP
    >>> plan = jaxpar.auto.search(model, loss_fn, batch, config, mesh)            # doctest: +SKIP
    >>> print(plan.table())                                                        # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, plan.to_config(config), mesh) # doctest: +SKIP

Everything here is a pure function of (config, mesh sizes, abstract model, batch shapes, cost
parameters): nothing compiles except `plan_job`'s optional dry run.
"""

from jaxpar.auto.balance import balance_stages, module_costs
from jaxpar.auto.api import hand_plan, make_plan, mesh_sizes, plan_training, search
from jaxpar.auto.cost import Cost, CostParams, evaluate
from jaxpar.auto.graph import Graph, build_graph
from jaxpar.auto.machine import calibrate
from jaxpar.auto.plan import Plan
from jaxpar.auto.planner import JobPlan, plan_job

__all__ = [
    "balance_stages", "module_costs",
    "Cost",
    "CostParams",
    "Graph",
    "JobPlan",
    "Plan",
    "build_graph",
    "calibrate",
    "evaluate",
    "hand_plan",
    "make_plan",
    "mesh_sizes",
    "plan_job",
    "plan_training",
    "search",
]
