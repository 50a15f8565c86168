"""Automatic parallelism: graph from a jaxpr, cost model, propagation and strategy search.

    >>> config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto",
    ...                                search="dynamic_programming")                  # doctest: +SKIP
    >>> strategy = jaxpar.auto.search(model, loss_fn, batch, config, mesh)            # doctest: +SKIP
    >>> print(strategy.table())                                                        # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, strategy.to_config(config), mesh) # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, config, mesh,                     # doctest: +SKIP
    ...                          plan=jaxpar.auto.plan_for(model, tx, loss_fn, config, mesh, example_batch=batch))

`search` gives a `Strategy` (one mesh's layouts); `search_job` searches a whole job — mesh
shapes, ZeRO levels, micro-batches, recompute, pipeline stages — over a `JobSearchSpace` and
gives a `JobSearchResult`. Everything here is a pure function of (config, mesh sizes, abstract
model, batch shapes, cost parameters): nothing compiles except `search_job`'s optional dry run.
"""

from jaxpar.deprecation import module_getattr
from jaxpar.auto.balance import balance_stages, module_costs
from jaxpar.auto.api import hand_strategy, make_strategy, mesh_sizes, plan_for, plan_training, search
from jaxpar.auto.cost import Cost, CostParams, evaluate
from jaxpar.auto.graph import Graph, build_graph
from jaxpar.auto.job_search import JobSearchResult, search_job
from jaxpar.auto.machine import calibrate
from jaxpar.auto.search_space import JobSearchSpace
from jaxpar.auto.strategy import Strategy

__all__ = [
    "balance_stages", "module_costs",
    "Cost",
    "CostParams",
    "Graph",
    "JobSearchResult",
    "JobSearchSpace",
    "Strategy",
    "build_graph",
    "calibrate",
    "evaluate",
    "hand_strategy",
    "make_strategy",
    "mesh_sizes",
    "plan_for",
    "plan_training",
    "search",
    "search_job",
]

__getattr__ = module_getattr(__name__)   # former names (CHANGELOG.md): warn and forward, or say what replaced them
