"""``jaxpar plan --search ...``: search a plan for the example GPT, print it, save it.

Wiring (in ``jaxpar/cli.py``, which imports this module, never the other way)::

    add_plan_search_arguments(p)                  # on the "plan" sub-parser
    # in cmd_plan: if args.search: run_plan_search(search_settings(args, job), job, build_job)

Every flag is parsed by an argparse ``type=`` function (`number`, `int_list`, `annotation`), so a
malformed value ends the command at once with exit code 2 and a line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from jaxpar.config import REMAT_POLICIES, SCHEDULES, SEARCHES

DEFAULT_ZERO_LEVELS = (0, 1, 2, 3)
DEFAULT_ACCUM = (1, 2, 4)
DEFAULT_REMAT = ("none",)
DEFAULT_STAGES = (1,)
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_CONTEXT = (1,)
DEFAULT_CONTEXT_STRATEGIES = ("ring",)
PLANNED_CONTEXT_STRATEGIES = ("ring", "ulysses", "all_gather")   # those jaxpar.auto prices


def number(flag: str, kind: type = int, *, low: float | None = None, above: float | None = None):
    """An argparse ``type=`` for ``flag`` that accepts finite ``kind`` values ``>= low`` / ``> above``.

    Example:
        >>> number("--steps", int, low=1)("4")
        4
    """
    name = "an integer" if kind is int else "a finite number"
    want = name + (f" >= {low:g}" if low is not None else "") + (f" > {above:g}" if above is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not {name}; expected {want}") from None
        if (not math.isfinite(value) or (low is not None and value < low)
                or (above is not None and value <= above)):
            raise argparse.ArgumentTypeError(f"{flag} {text}: out of range; expected {want}")
        return value

    parse.__name__ = want
    return parse


def int_list(flag: str, low: int):
    """An argparse ``type=`` for comma-separated integers ``>= low`` (``"0,1"`` → ``(0, 1)``)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            values = ()
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not a list of integers >= {low}; expected "
                                             f"comma-separated integers such as {low},{low + 1}")
        return values

    return parse


def name_list(flag: str, choices: tuple[str, ...], what: str):
    """An argparse ``type=`` for comma-separated names among ``choices``."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(r.strip() for r in text.split(",") if r.strip())
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: unknown {what} {unknown}; choose among "
                                             f"{', '.join(choices)}")
        return names

    return parse


remat_list = name_list("--remat-options", REMAT_POLICIES, "policies")
context_strategy_list = name_list("--context-strategies", PLANNED_CONTEXT_STRATEGIES, "strategies")


def annotation(text: str) -> tuple[str, Any]:
    """``--annotate GLOB=SPEC``: ``"blocks/*/mlp/up=None,model"`` → (glob, PartitionSpec)."""
    from jax.sharding import PartitionSpec

    glob, sep, spec = text.partition("=")
    if not sep or not glob:
        raise argparse.ArgumentTypeError(f"--annotate {text!r}: not GLOB=SPEC; expected e.g. "
                                         "'blocks/*/mlp/up=None,model'")
    entries = [None if e in ("None", "") else tuple(e.split("+")) if "+" in e else e for e in spec.split(",")]
    return glob, PartitionSpec(*entries)


def add_plan_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--search`` flags of ``jaxpar plan`` (all default to None: given = used, or refused)."""
    g = parser.add_argument_group("strategy search (jaxpar.auto)")
    g.add_argument("--search", choices=SEARCHES, help="search a plan with this algorithm instead of printing "
                   "the configured one")
    g.add_argument("--annotate", action="append", type=annotation, default=[], metavar="GLOB=SPEC",
                   help="fix a parameter's split, e.g. 'blocks/*/mlp/up=None,model' (repeatable)")
    g.add_argument("--memory-budget", type=number("--memory-budget", float, above=0),
                   help="per-device bytes the plan must fit (plans the whole job)")
    g.add_argument("--zero-levels", type=int_list("--zero-levels", 0), help="ZeRO levels the job planner may "
                   "choose (with --memory-budget; default 0,1,2,3), e.g. 0,1")
    g.add_argument("--accum-options", type=int_list("--accum-options", 1), help="micro-batch counts the job "
                   "planner may choose (with --memory-budget; default 1,2,4)")
    g.add_argument("--remat-options", type=remat_list, help="recompute policies of each block the job planner "
                   "may choose (with --memory-budget; default none), e.g. none,full,dots_saveable")
    g.add_argument("--pipeline-options", type=int_list("--pipeline-options", 1), help="pipeline stage counts "
                   "the job planner may choose (with --memory-budget; default 1), e.g. 1,2,4; above 1 the model's "
                   "layers are scanned")
    g.add_argument("--microbatch-options", type=int_list("--microbatch-options", 1),
                   help="the pipeline's micro-batch counts (with --memory-budget; default p, 2p, 4p)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule the job planner prices (with "
                   f"--memory-budget; default {DEFAULT_SCHEDULE})")
    g.add_argument("--context-options", type=int_list("--context-options", 1), help="context-parallel sizes "
                   "the job planner may choose (with --memory-budget; default 1), e.g. 1,2,4: the sequence split "
                   "over a context axis")
    g.add_argument("--context-strategies", type=context_strategy_list, help="context-parallel attention the job "
                   "planner prices (with --context-options; default ring), e.g. ring,ulysses")
    g.add_argument("--flops", type=number("--flops", float, above=0), help="device FLOP/s for the cost model")
    g.add_argument("--bandwidth", type=number("--bandwidth", float, above=0), help="collective bandwidth, bytes/s")
    g.add_argument("--latency", type=number("--latency", float, low=0), help="seconds per collective")
    g.add_argument("--plan-out", help="write the plan (strategy file, JSON)")


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


def search_settings(args: argparse.Namespace, job) -> SearchSettings:
    """The `SearchSettings` of parsed ``plan --search`` flags for the resolved ``job``."""
    from jaxpar.auto import CostParams

    costs = CostParams(**{k: v for k, v in (("flops_per_s", args.flops), ("default_bandwidth", args.bandwidth),
                                            ("latency", args.latency)) if v is not None})
    if args.context_strategies and max(args.context_options or DEFAULT_CONTEXT) == 1:
        raise ValueError(f"--context-strategies {','.join(args.context_strategies)} prices context-parallel "
                         "attention, but no context size above 1 is offered; add --context-options 1,2,4 "
                         "(for example)")
    config = dataclasses.replace(job.config, mode="auto", search=args.search, rules={})
    return SearchSettings(
        search=args.search, config=config, annotate=tuple(args.annotate), memory_budget=args.memory_budget,
        zero_levels=args.zero_levels or DEFAULT_ZERO_LEVELS, accum=args.accum_options or DEFAULT_ACCUM,
        remat=args.remat_options or DEFAULT_REMAT, stages=args.pipeline_options or DEFAULT_STAGES,
        microbatches=args.microbatch_options, schedule=args.schedule or DEFAULT_SCHEDULE,
        context=args.context_options or DEFAULT_CONTEXT,
        context_strategies=args.context_strategies or DEFAULT_CONTEXT_STRATEGIES, costs=costs,
        plan_out=args.plan_out)


def _plan_job(s: SearchSettings, job, batch):
    """`jaxpar.auto.plan_job` for the example GPT, with the CLI's option lists."""
    from flax import nnx

    from jaxpar.auto import plan_job
    from jaxpar.models.gpt import GPT, loss_fn, pipeline_loss
    from jaxpar.train import compile_step

    gpt = job.model
    if max(s.stages) > 1 and not gpt.scan_layers:
        # a pipeline cuts the stacked blocks: every option is planned on scanned layers
        print("note: --pipeline-options above 1 plan the model with scanned layers (--scan); its parameter "
              "paths are those of GPTConfig(scan_layers=True)")
        gpt = dataclasses.replace(gpt, scan_layers=True)

    def model_fn(remat="none", constrain=None):
        # a context-parallel option is built with its constraint: attention across the context axis
        extra = {} if constrain is None else {"constrain": constrain}
        return GPT(dataclasses.replace(gpt, remat=remat), rngs=nnx.Rngs(job.seed), **extra)

    # --annotate reaches the planner through the base config, whose parameter_plan it keeps.
    base = dataclasses.replace(s.config, parameter_plan={**s.config.parameter_plan, **dict(s.annotate)})
    plan = plan_job(model_fn, loss_fn, batch, pipeline_loss=pipeline_loss(), devices=len(job.devices),
                    memory_budget=s.memory_budget, cost_params=s.costs, search_name=s.search, base_config=base,
                    zero_levels=s.zero_levels, grad_accum=s.accum, remat=s.remat, pipeline_stages=s.stages,
                    microbatches=s.microbatches, schedule=s.schedule, context=s.context,
                    context_strategy=s.context_strategies, dry_run=compile_step)
    print(plan.explain())
    if plan.remat != "none":
        print(f"recompute: build the model with GPTConfig(remat={plan.remat!r})")
    if plan.config.context is not None:
        print(f"context: the sequence split over {plan.config.context.axis!r} "
              f"({plan.config.context.strategy} attention, {plan.config.context.order} order)")
    pipe = plan.config.pipeline
    if pipe.stages > 1:
        print(f"pipeline: {pipe.stages} stages, {pipe.microbatches} micro-batches, schedule {pipe.schedule} "
              "(train with pipeline_loss(); the blocks' layers are split over the pipe axis)")
    return plan


def _check_budget(s: SearchSettings, job) -> None:
    """Refuse a budget no option can fit (`jaxpar.auto.planner.check_memory_floor`) before the
    job's model is built: the floor needs only its parameters' shapes, and the model with
    scanned layers has the same parameters, stacked, and builds abstractly at once (unrolled,
    flax takes minutes for a deep model)."""
    from flax import nnx

    from jaxpar.auto import CostParams
    from jaxpar.auto.planner import check_memory_floor
    from jaxpar.models.data import ArithmeticData
    from jaxpar.models.gpt import GPT

    abstract = nnx.eval_shape(lambda: GPT(dataclasses.replace(job.model, scan_layers=True), rngs=nnx.Rngs(0)))
    batch = ArithmeticData(job.model.seq_len, seed=job.seed).batch(job.batch, 0)
    check_memory_floor(abstract, batch, devices=len(job.devices), memory_budget=s.memory_budget,
                       params=s.costs or CostParams())


def _save_job(plan_out: str, plan) -> None:
    import json
    import os

    path = os.path.splitext(plan_out)[0] + ".job.json"
    with open(path, "w") as f:
        json.dump(plan.to_dict(), f, indent=1, default=str)
    print(f"job (config, remat, pipeline, candidates) written to {path}")


def run_plan_search(s: SearchSettings, job, build_job) -> int:
    """Handler: search (or plan the job within ``--memory-budget``), print the table, save it."""
    from jaxpar.auto import search
    from jaxpar.models.gpt import loss_fn

    if s.memory_budget is not None:
        _check_budget(s, job)
    mesh, trainer, data = build_job(job)
    batch = data.batch(job.batch, 0)
    if s.memory_budget is not None:
        planned = _plan_job(s, job, batch)
        plan = planned.plan
        if s.plan_out:
            _save_job(s.plan_out, planned)
    else:
        plan = search(trainer.model, loss_fn, batch, s.config, mesh, cost_params=s.costs,
                      annotate=dict(s.annotate))
        print(plan.table())
    if s.plan_out:
        plan.to_json(s.plan_out)
        print(f"plan written to {s.plan_out}")
    return 0
