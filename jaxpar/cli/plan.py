"""``jaxpar plan``: print the parameter specs of the example job, search a strategy (``--search``), or
plan a job file from shapes alone (``--config job.yaml``).

Every flag is parsed by an argparse ``type=`` function (`number`, `int_list`, `annotation`), so a
malformed value ends the command at once with exit code 2 and a line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from jaxpar.cli.common import (DEFAULT_DEVICES, check_writable, flags_text, given, number, refuse,
                               set_simulated_devices, verb)
from jaxpar.cli.jobflags import add_job_args, hosts_note, on_this_machine, resolve_job
from jaxpar.config import REMAT_POLICIES, SCHEDULES, SEARCHES
from jaxpar.deprecation import check_policy
from jaxpar.job.search import (DEFAULT_ACCUM, DEFAULT_CONTEXT, DEFAULT_CONTEXT_STRATEGIES, DEFAULT_REMAT,
                               DEFAULT_SCHEDULE, DEFAULT_STAGES, DEFAULT_ZERO_LEVELS, PLANNED_CONTEXT_STRATEGIES,
                               SearchSettings)


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
        for n in names:      # a removed policy says why it went (offload_dots), not "unknown"
            try:
                check_policy(n, f"{flag} {n}")
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
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
    g.add_argument("--search", choices=SEARCHES, help="search a strategy with this algorithm instead of printing "
                   "the configured specs")
    g.add_argument("--annotate", action="append", type=annotation, default=[], metavar="GLOB=SPEC",
                   help="fix a parameter's split, e.g. 'blocks/*/mlp/up=None,model' (repeatable)")
    g.add_argument("--memory-budget", type=number("--memory-budget", float, above=0),
                   help="per-device bytes the job must fit (searches the whole job)")
    g.add_argument("--zero-levels", type=int_list("--zero-levels", 0), help="ZeRO levels the job search may "
                   "choose (with --memory-budget; default 0,1,2,3), e.g. 0,1")
    g.add_argument("--accum-options", type=int_list("--accum-options", 1), help="micro-batch counts the job "
                   "search may choose (with --memory-budget; default 1,2,4)")
    g.add_argument("--remat-options", type=remat_list, help="recompute policies of each block the job search "
                   "may choose (with --memory-budget; default none), e.g. none,full,dots_saveable")
    g.add_argument("--pipeline-options", type=int_list("--pipeline-options", 1), help="pipeline stage counts "
                   "the job search may choose (with --memory-budget; default 1), e.g. 1,2,4; above 1 the model's "
                   "layers are scanned")
    g.add_argument("--microbatch-options", type=int_list("--microbatch-options", 1),
                   help="the pipeline's micro-batch counts (with --memory-budget; default p, 2p, 4p)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule the job search prices (with "
                   f"--memory-budget; default {DEFAULT_SCHEDULE})")
    g.add_argument("--context-options", type=int_list("--context-options", 1), help="context-parallel sizes "
                   "the job search may choose (with --memory-budget; default 1), e.g. 1,2,4: the sequence split "
                   "over a context axis")
    g.add_argument("--context-strategies", type=context_strategy_list, help="context-parallel attention the job "
                   "search prices (with --context-options; default ring), e.g. ring,ulysses")
    g.add_argument("--flops", type=number("--flops", float, above=0), help="device FLOP/s for the cost model")
    g.add_argument("--bandwidth", type=number("--bandwidth", float, above=0), help="collective bandwidth, bytes/s")
    g.add_argument("--latency", type=number("--latency", float, low=0), help="seconds per collective")
    g.add_argument("--inter-host-bandwidth", type=number("--inter-host-bandwidth", float, above=0),
                   help="two networks: collective bandwidth between hosts, bytes/s per device (--bandwidth is then "
                   "the links inside a host); priced on the --hosts layout, or with --memory-budget on every layout "
                   "of --devices-per-host")
    g.add_argument("--inter-host-latency", type=number("--inter-host-latency", float, low=0),
                   help="seconds per collective between hosts (with --inter-host-bandwidth; default --latency)")
    g.add_argument("--devices-per-host", type=number("--devices-per-host", low=1),
                   help="devices one host holds (with --memory-budget and --inter-host-bandwidth): the job search "
                   "tries which axes span the hosts and chooses the layout (the config's hosts)")
    g.add_argument("--plan-out", help="write the searched strategy (strategy file, JSON)")


def search_settings(args: argparse.Namespace, job) -> SearchSettings:
    """The `SearchSettings` of parsed ``plan --search`` flags for the resolved ``job``."""
    from jaxpar.auto import CostParams

    costs = CostParams(**{k: v for k, v in (("flops_per_s", args.flops), ("default_bandwidth", args.bandwidth),
                                            ("latency", args.latency),
                                            ("inter_host_bandwidth", args.inter_host_bandwidth),
                                            ("inter_host_latency", args.inter_host_latency),
                                            ("devices_per_host", args.devices_per_host)) if v is not None})
    if args.context_strategies and max(args.context_options or DEFAULT_CONTEXT) == 1:
        raise ValueError(f"--context-strategies {','.join(args.context_strategies)} prices context-parallel "
                         "attention, but no context size above 1 is offered; add --context-options 1,2,4 "
                         "(for example)")
    config = dataclasses.replace(job.parallel, mode="auto", search=args.search, rules={})
    return SearchSettings(
        search=args.search, config=config, annotate=tuple(args.annotate), memory_budget=args.memory_budget,
        zero_levels=args.zero_levels or DEFAULT_ZERO_LEVELS, accum=args.accum_options or DEFAULT_ACCUM,
        remat=args.remat_options or DEFAULT_REMAT, stages=args.pipeline_options or DEFAULT_STAGES,
        microbatches=args.microbatch_options, schedule=args.schedule or DEFAULT_SCHEDULE,
        context=args.context_options or DEFAULT_CONTEXT,
        context_strategies=args.context_strategies or DEFAULT_CONTEXT_STRATEGIES, costs=costs,
        plan_out=args.plan_out, meshes=fixed_meshes(args, job))


def fixed_meshes(args: argparse.Namespace, job) -> tuple | None:
    """The job search's meshes (`jaxpar.auto.JobSearchSpace.meshes`): the one ``--mesh`` (or the
    ``--config`` file's ``mesh``) gives, or None (every data x model shape of the devices); a
    mesh the search cannot keep to is refused, naming both flags."""
    import yaml

    if args.memory_budget is None:
        return None
    if args.mesh:
        where = f"--mesh {args.mesh}"
    elif args.config:
        with open(args.config) as f:          # checked by the --config type: a YAML mapping
            data = yaml.safe_load(f) or {}
        if "mesh" not in data:
            return None
        where = f"--config {args.config!r} (mesh {dict(data['mesh'])})"
    else:
        return None
    sizes = job.parallel.mesh          # an axis of -1 is resolved by `search_space` on the devices
    stray = sorted(set(sizes) - {"data", "model"})
    if stray:
        refuse(f"{where} names axes {stray}, but the job search under --memory-budget plans data x model meshes "
               "(its ZeRO levels shard over data); name the axes data and model, e.g. --mesh "
               f"data={math.prod(sizes.values()) if -1 not in sizes.values() else -1}, or leave the mesh out to let "
               "it choose")
    grown = [f"{flag} {','.join(map(str, values))}" for flag, values in (
        ("--context-options", args.context_options or ()), ("--pipeline-options", args.pipeline_options or ()))
        if max(values, default=1) > 1]
    if grown:
        refuse(f"{where} fixes the mesh, but {' and '.join(grown)} add meshes with a context or pipe axis that the "
               "job search chooses itself; leave the mesh out to search them, or leave those options out to plan "
               "on this mesh")
    return (dict(sizes),)



def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the parameter specs, or search a strategy (--search)")
    add_job_args(p, train=False)
    p.add_argument("--save", help="write the configured specs as JSON (without --search)")
    add_plan_search_arguments(p)
    p.set_defaults(func=cmd_plan)


def check_plan_flags(args) -> None:
    """Refuse the ``plan`` flags that the chosen form of the command would ignore."""
    if args.search is None:
        search_only = [f for f in ("annotate", "memory_budget", "zero_levels", "accum_options", "remat_options",
                                   "pipeline_options", "microbatch_options", "schedule", "flops", "bandwidth",
                                   "latency", "inter_host_bandwidth", "inter_host_latency", "devices_per_host",
                                   "plan_out") if given(args, f)]
        if search_only:
            refuse(f"{flags_text(search_only)} {verb(search_only)} to --search only (without it, jaxpar plan prints "
                   "the configured specs, which do not depend on it); add --search dynamic_programming, or leave "
                   "it out")
        return
    if given(args, "save"):
        refuse(f"--save {args.save!r} writes the configured specs, which --search replaces; write the searched "
               f"strategy with --plan-out {args.save!r}")
    if given(args, "mode"):
        refuse(f"--mode {args.mode} is replaced by mode 'auto' under --search; leave --mode out")
    if given(args, "rules"):
        refuse(f"--rules {args.rules} is replaced by the search under --search (it plans every parameter); pin "
               "parameters with --annotate PATH=STRATEGY instead, or leave --rules out")
    if args.memory_budget is not None and given(args, "remat"):
        refuse(f"--remat {args.remat} is chosen by the job search under --memory-budget (it prices each policy "
               f"on the model's blocks); offer it with --remat-options {args.remat} (or none,{args.remat}), or "
               "leave --remat out")
    network = [f for f in ("inter_host_latency", "devices_per_host") if given(args, f)]
    if network and args.inter_host_bandwidth is None:
        refuse(f"{flags_text(network)} {verb(network)} to the network between hosts, which only "
               "--inter-host-bandwidth BYTES_PER_S prices (without it there is one network); add it, or leave "
               f"{flags_text(network)} out")
    if args.memory_budget is None:
        budget_only = [f for f in ("zero_levels", "accum_options", "remat_options", "pipeline_options",
                                   "microbatch_options", "schedule", "devices_per_host") if given(args, f)]
        if budget_only:
            refuse(f"{flags_text(budget_only)} {verb(budget_only)} only when the whole job is planned within a memory "
                   "budget; add --memory-budget BYTES, or leave them out")


def check_search_hosts(args, job, devices: int) -> None:
    """Refuse ``--hosts`` (or a ``--config`` file's ``hosts``) and the two-network flags where
    ``plan --search`` would not price them."""
    hosts = dict(job.parallel.hosts)
    where = ("--hosts " + args.hosts) if args.hosts else f"--config {args.config!r} (hosts {hosts})"
    if args.memory_budget is not None:
        if hosts:
            refuse(f"{where}: under --memory-budget the job search chooses which axes span hosts itself, from "
                   "--devices-per-host and --inter-host-bandwidth; give those (e.g. --devices-per-host "
                   f"{devices // math.prod(hosts.values())} --inter-host-bandwidth 2.5e10), or leave the hosts out")
        if args.inter_host_bandwidth is not None and args.devices_per_host is None:
            refuse(f"--inter-host-bandwidth {args.inter_host_bandwidth:g} prices the network between hosts, but "
                   "the job search under --memory-budget needs --devices-per-host N to know how many hosts the "
                   f"{devices} devices are on; add it (a divisor of {devices} below it), or leave "
                   "--inter-host-bandwidth out")
        per = args.devices_per_host
        if per is not None and (per >= devices or devices % per):
            why = "fit on one host, so no collective crosses hosts" if per >= devices else f"do not fill hosts of {per}"
            refuse(f"--devices-per-host {per}: the {devices} devices the job search plans {why}; give a divisor of "
                   f"{devices} below {devices} (e.g. --devices-per-host {devices // 2}), or leave --devices-per-host "
                   "and --inter-host-bandwidth out for one network")
        return
    if args.inter_host_bandwidth is not None and not hosts:
        refuse(f"--inter-host-bandwidth {args.inter_host_bandwidth:g} prices the collectives that cross hosts, but "
               "no mesh axis spans hosts; give the layout with --hosts AXIS=N (e.g. --hosts data=2), or add "
               "--memory-budget BYTES and --devices-per-host N to let the job search choose it")
    if hosts and args.inter_host_bandwidth is None:
        refuse(f"{where}: the strategy search prices the collectives that cross hosts only with the network "
               "between them; add --inter-host-bandwidth BYTES_PER_S (and --inter-host-latency SECONDS), or "
               "leave the hosts out for one network")


def cmd_plan(args) -> int:
    from jaxpar.nn.specs import format_specs
    from jaxpar.report import param_table

    check_plan_flags(args)
    if args.search:
        from jaxpar.job import search

        job, devices = resolve_job(args, plan_hosts=True)
        if args.config and job.parallel.rules:
            refuse(f"--config {args.config!r} sets rules {dict(job.parallel.rules)}, which --search replaces (it "
                   "plans every parameter); drop them from the file, or pin parameters with --annotate")
        if args.memory_budget is not None and job.parallel.remat != "none":
            refuse(f"--config {args.config!r} sets remat {job.parallel.remat!r}, which the job search under "
                   f"--memory-budget chooses itself (it prices each policy on the model's blocks); drop it from the "
                   f"file and offer it with --remat-options {job.parallel.remat} (or none,{job.parallel.remat})")
        check_search_hosts(args, job, len(devices))
        note = hosts_note(job.parallel, devices)
        if note:
            print(note)
        if args.plan_out:
            check_writable("--plan-out", args.plan_out)
        return search.run_plan_search(search_settings(args, job), job, devices)

    from jaxpar.job import run

    job, devices = resolve_job(args, plan_hosts=True)
    if args.save:
        check_writable("--save", args.save)
    note = hosts_note(job.parallel, devices)
    if note:
        print(note)
    built = run.build(dataclasses.replace(job, parallel=on_this_machine(job.parallel)), devices=devices)
    mesh, trainer = built.mesh, built.trainer
    if job.parallel.rules and not job.parallel.allow_unused_rules:
        trainer.lower(built.example_batch())   # tracing the step refuses rules nothing consults
    hosts = f"  hosts {dict(job.parallel.hosts)}" if job.parallel.hosts else ""
    print(f"mesh {dict(mesh.shape)}{hosts}  mode {job.parallel.mode}")
    print(format_specs(param_table(trainer)))
    if args.save:
        rows = [{"path": r.path, "shape": r.shape, "spec": [list(e) if isinstance(e, tuple) else e for e in r.spec]}
                for r in param_table(trainer)]
        with open(args.save, "w") as f:
            json.dump({"config": job.parallel.to_dict(), "mesh": dict(mesh.shape), "params": rows}, f, indent=2)
    return 0




def plan_file(args: argparse.Namespace, overrides: list[str]) -> int:
    """``jaxpar plan --config JOB``: the job's TrainPlan and (Llama) memory per device, from shapes
    alone: no parameter is allocated and the mesh may be larger than this machine."""
    import jax

    from jaxpar.job.config import JobConfig
    from jaxpar.job.shapes import plan_of_job, plan_sizes

    set_simulated_devices(DEFAULT_DEVICES)     # a mesh axis of -1 takes the devices `train` would use here
    job = JobConfig.load(args.config, overrides)
    plan, memory = plan_of_job(job, plan_sizes(job, jax.device_count()))
    print(plan)
    if memory is not None:
        print(memory)
    return 0
