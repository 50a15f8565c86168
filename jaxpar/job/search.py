"""``jaxpar plan --search``: search a strategy for the example GPT job, or search the whole job
within a memory budget (`jaxpar.auto.search_job` over a `jaxpar.auto.JobSearchSpace`), print it
and save it.

The command's flags become a `SearchSettings` (``jaxpar/cli/plan.py``); this module runs it
on the job the other flags describe (`jaxpar.job.example.example_job`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.job.config import JobConfig

DEFAULT_ZERO_LEVELS = (0, 1, 2, 3)
DEFAULT_ACCUM = (1, 2, 4)
DEFAULT_REMAT = ("none",)
DEFAULT_STAGES = (1,)
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_CONTEXT = (1,)
DEFAULT_CONTEXT_STRATEGIES = ("ring",)
PLANNED_CONTEXT_STRATEGIES = ("ring", "ulysses", "all_gather")   # those jaxpar.auto prices


def _gpt(job: JobConfig):
    """The example job's GPTConfig."""
    from jaxpar.job.example import ARITHMETIC_VOCAB
    from jaxpar.job.run import model_config

    return model_config(job, ARITHMETIC_VOCAB)


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """What ``jaxpar plan --search`` does, resolved from its flags.

    Example:
        >>> SearchSettings(search="dynamic_programming").memory_budget is None
        True
    """

    search: str
    config: Any = None                 # ParallelConfig the search starts from (mode "auto")
    annotate: tuple = ()               # (glob, PartitionSpec) pairs
    memory_budget: float | None = None
    zero_levels: tuple = DEFAULT_ZERO_LEVELS
    accum: tuple = DEFAULT_ACCUM
    remat: tuple = DEFAULT_REMAT
    stages: tuple = DEFAULT_STAGES
    microbatches: tuple | None = None
    schedule: str = DEFAULT_SCHEDULE
    context: tuple = DEFAULT_CONTEXT
    context_strategies: tuple = DEFAULT_CONTEXT_STRATEGIES
    costs: Any = None                  # jaxpar.auto.CostParams
    plan_out: str | None = None
    meshes: tuple | None = None        # the job search's mesh shapes (None: every data x model shape)


def search_space(s: SearchSettings, devices: int):
    """The `jaxpar.auto.JobSearchSpace` of the CLI's option lists (checked as it is built, so a
    wrong list is refused before the job's model is built)."""
    from jaxpar.auto import JobSearchSpace
    from jaxpar.mesh import resolve_axes

    meshes = None if s.meshes is None else [resolve_axes(m, devices) if -1 in m.values() else dict(m)
                                            for m in s.meshes]
    return JobSearchSpace(devices=devices, memory_budget=s.memory_budget, search_name=s.search,
                          zero_levels=s.zero_levels, grad_accum=s.accum, remat=s.remat, pipeline_stages=s.stages,
                          microbatches=s.microbatches, schedule=s.schedule, context=s.context,
                          context_strategy=s.context_strategies, meshes=meshes)


def _search_job(s: SearchSettings, job: JobConfig, space, batch):
    """`jaxpar.auto.search_job` for the example GPT over ``space`` (`search_space`)."""
    from flax import nnx

    from jaxpar.auto import search_job
    from jaxpar.models.gpt import GPT, loss_fn
    from jaxpar.models.gpt_parallel import pipeline_loss
    from jaxpar.train import compile_step

    gpt = _gpt(job)
    if max(s.stages) > 1 and not gpt.scan_layers:
        # a pipeline cuts the stacked blocks: every option is searched on scanned layers
        print("note: --pipeline-options above 1 search the model with scanned layers (--scan); its parameter "
              "paths are those of GPTConfig(scan_layers=True)")
        gpt = dataclasses.replace(gpt, scan_layers=True)

    def model_fn(constrain=None):
        # a context-parallel option is built with its constraint: attention across the context axis
        extra = {} if constrain is None else {"constrain": constrain}
        return GPT(gpt, rngs=nnx.Rngs(job.train.seed), **extra)

    # --annotate reaches the job search through the base config, whose parameter_strategy it keeps.
    base = dataclasses.replace(s.config, parameter_strategy={**s.config.parameter_strategy, **dict(s.annotate)})
    found = search_job(model_fn, loss_fn, batch, space, base_config=base, cost_params=s.costs,
                       pipeline_loss=pipeline_loss(), dry_run=compile_step)
    print(found.explain())
    if found.remat != "none":
        print(f"recompute: remat={found.remat!r} in the config (parallel.remat), on each block of the model")
    if found.config.context is not None:
        print(f"context: the sequence split over {found.config.context.axis!r} "
              f"({found.config.context.strategy} attention, {found.config.context.order} order)")
    pipe = found.config.pipeline
    if pipe.stages > 1:
        print(f"pipeline: {pipe.stages} stages, {pipe.microbatches} micro-batches, schedule {pipe.schedule} "
              "(train with pipeline_loss(); the blocks' layers are split over the pipe axis)")
    return found


def _check_budget(s: SearchSettings, job: JobConfig, devices: int) -> None:
    """Refuse a budget no option can fit (`jaxpar.auto.job_search.check_memory_floor`) before the
    job's model is built: the floor needs only its parameters' shapes, and the model with
    scanned layers has the same parameters, stacked, and builds abstractly at once (unrolled,
    flax takes minutes for a deep model)."""
    from flax import nnx

    from jaxpar.auto import CostParams
    from jaxpar.auto.job_search import check_memory_floor
    from jaxpar.models.data import ArithmeticData
    from jaxpar.models.gpt import GPT

    gpt = _gpt(job)
    abstract = nnx.eval_shape(lambda: GPT(dataclasses.replace(gpt, scan_layers=True), rngs=nnx.Rngs(0)))
    batch = ArithmeticData(gpt.seq_len, seed=job.data.seed).batch(job.data.batch, 0)
    check_memory_floor(abstract, batch, devices=devices, memory_budget=s.memory_budget,
                       params=s.costs or CostParams())


def _save_job(plan_out: str, found) -> None:
    import json
    import os

    path = os.path.splitext(plan_out)[0] + ".job.json"
    with open(path, "w") as f:
        json.dump(found.to_dict(), f, indent=1, default=str)
    print(f"job (config, remat, pipeline, candidates) written to {path}")


def run_plan_search(s: SearchSettings, job: JobConfig, devices) -> int:
    """Search a strategy (or the whole job within ``memory_budget``) on ``devices``, print the
    table, save it. A ``hosts`` layout of more processes than this one (planned on its simulated
    devices) is built as one host and priced with ``s.costs`` placed on it (`CostParams.placed`)."""
    import math

    import jax

    from jaxpar.auto import CostParams, search
    from jaxpar.job.run import build
    from jaxpar.models.gpt import loss_fn

    space = search_space(s, len(devices)) if s.memory_budget is not None else None
    if space is not None:
        _check_budget(s, job, len(devices))
    hosts = dict(job.parallel.hosts)
    if hosts and math.prod(hosts.values()) != jax.process_count():
        job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, hosts={}))
    built = build(job, devices=devices)
    if hosts:
        s = dataclasses.replace(s, costs=(s.costs or CostParams()).placed(hosts, dict(built.mesh.shape)))
    batch = built.example_batch()
    if space is not None:
        found = _search_job(s, job, space, batch)
        strategy = found.strategy
        if s.plan_out:
            _save_job(s.plan_out, found)
    else:
        strategy = search(built.trainer.model, loss_fn, batch, s.config, built.mesh, cost_params=s.costs,
                          annotate=dict(s.annotate))
        print(strategy.table())
    if s.plan_out:
        strategy.to_json(s.plan_out)
        print(f"strategy written to {s.plan_out}")
    return 0
