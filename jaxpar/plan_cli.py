"""``jaxpar plan --search ...``: search a plan for the example GPT, print it, save it.

Wiring (in ``jaxpar/cli.py``, which imports this module, never the other way)::

    add_plan_search_arguments(p)                  # on the "plan" sub-parser
    # in cmd_plan: if args.search: return run_plan_search(args, build_job, model_config)
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxpar.config import SCHEDULES, SEARCHES


def add_plan_search_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("strategy search (jaxpar.auto)")
    g.add_argument("--search", choices=SEARCHES, help="search a plan with this algorithm instead of printing "
                   "the configured one")
    g.add_argument("--annotate", action="append", default=[], metavar="GLOB=SPEC",
                   help="fix a parameter's split, e.g. 'blocks/*/mlp/up=None,model' (repeatable)")
    g.add_argument("--memory-budget", type=float, help="per-device bytes the plan must fit (plans the whole job)")
    g.add_argument("--zero-levels", default="0,1,2,3", help="ZeRO levels the job planner may choose (with "
                   "--memory-budget), e.g. 0,1")
    g.add_argument("--accum-options", default="1,2,4", help="micro-batch counts the job planner may choose "
                   "(with --memory-budget)")
    g.add_argument("--remat-options", default="none", help="recompute policies of each block the job planner "
                   "may choose (with --memory-budget), e.g. none,full,dots_saveable")
    g.add_argument("--pipeline-options", default="1", help="pipeline stage counts the job planner may choose "
                   "(with --memory-budget), e.g. 1,2,4; above 1 the model's layers are scanned")
    g.add_argument("--microbatch-options", help="the pipeline's micro-batch counts (default p, 2p, 4p)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule the job planner "
                   "prices")
    g.add_argument("--flops", type=float, help="device FLOP/s for the cost model")
    g.add_argument("--bandwidth", type=float, help="collective bandwidth, bytes/s")
    g.add_argument("--latency", type=float, help="seconds per collective")
    g.add_argument("--plan-out", help="write the plan (strategy file, JSON)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated integers such as 0,1,2") from None


def _parse_annotation(text: str):
    if "=" not in text:
        raise SystemExit(f"--annotate {text!r}: expected GLOB=SPEC such as 'blocks/*/mlp/up=None,model'")
    glob, spec = text.split("=", 1)
    from jax.sharding import PartitionSpec

    entries = [None if e in ("None", "") else tuple(e.split("+")) if "+" in e else e for e in spec.split(",")]
    return glob, PartitionSpec(*entries)


def _plan_job(args, config, mesh, batch, costs, model_config):
    """`jaxpar.auto.plan_job` for the example GPT, with the CLI's option lists."""
    from flax import nnx

    from jaxpar.auto import plan_job
    from jaxpar.models.gpt import GPT, loss_fn, pipeline_loss
    from jaxpar.train import compile_step

    stages = _ints(args.pipeline_options, "--pipeline-options")
    remat = tuple(r.strip() for r in args.remat_options.split(",") if r.strip())
    gpt = model_config(args, config)
    if stages and max(stages) > 1 and not gpt.scan_layers:
        # a pipeline cuts the stacked blocks: every option is planned on scanned layers
        print("note: --pipeline-options above 1 plan the model with scanned layers (--scan); its parameter "
              "paths are those of GPTConfig(scan_layers=True)")
        gpt = dataclasses.replace(gpt, scan_layers=True)

    def model_fn(remat="none"):
        return GPT(dataclasses.replace(gpt, remat=remat), rngs=nnx.Rngs(args.seed))

    job = plan_job(model_fn, loss_fn, batch, pipeline_loss=pipeline_loss(), devices=mesh.devices.size,
                   memory_budget=args.memory_budget, cost_params=costs, search_name=args.search, base_config=config,
                   zero_levels=_ints(args.zero_levels, "--zero-levels"),
                   grad_accum=_ints(args.accum_options, "--accum-options"), remat=remat, pipeline_stages=stages,
                   microbatches=_ints(args.microbatch_options, "--microbatch-options")
                   if args.microbatch_options else None, schedule=args.schedule, dry_run=compile_step)
    print(job.explain())
    if job.remat != "none":
        print(f"recompute: build the model with GPTConfig(remat={job.remat!r})")
    pipe = job.config.pipeline
    if pipe.stages > 1:
        print(f"pipeline: {pipe.stages} stages, {pipe.microbatches} micro-batches, schedule {pipe.schedule} "
              "(train with pipeline_loss(); the blocks' layers are split over the pipe axis)")
    return job


def run_plan_search(args, build_job, model_config) -> int:
    """Handler: search (or plan the job within ``--memory-budget``), print the table, save it."""
    from jaxpar.auto import CostParams, search
    from jaxpar.models.gpt import loss_fn

    config, mesh, trainer, data = build_job(args)
    batch = data.batch(args.batch, 0)
    costs = CostParams(**{k: v for k, v in (("flops_per_s", args.flops), ("default_bandwidth", args.bandwidth),
                                            ("latency", args.latency)) if v is not None})
    config = dataclasses.replace(config, mode="auto", search=args.search, rules={})
    annotate = dict(_parse_annotation(a) for a in args.annotate)
    if args.memory_budget:
        job = _plan_job(args, config, mesh, batch, costs, model_config)
        plan = job.plan
        if args.plan_out:
            import json
            import os

            path = os.path.splitext(args.plan_out)[0] + ".job.json"
            with open(path, "w") as f:
                json.dump(job.to_dict(), f, indent=1, default=str)
            print(f"job (config, remat, pipeline, candidates) written to {path}")
    else:
        plan = search(trainer.model, loss_fn, batch, config, mesh, cost_params=costs, annotate=annotate)
        print(plan.table())
    if args.plan_out:
        plan.to_json(args.plan_out)
        print(f"plan written to {args.plan_out}")
    return 0
