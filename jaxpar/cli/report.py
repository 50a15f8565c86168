"""``jaxpar report``: compile the example GPT's step and report memory, collectives and FLOPs;
or (``--model llama --size NAME``) a Llama model's FLOPs, memory per device and MFU
(`jaxpar.job.reports.llama_size_report`), planned from mesh sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from jaxpar.cli.common import DEFAULT_BATCH, JOB_ERRORS, UserError, number, print_text, refuse
from jaxpar.cli.jobflags import (EXAMPLE_FLAGS, add_job_args, config_of, devices_of, hosts_note, on_this_machine,
                                 resolve_job)

MODELS = ("gpt", "llama")
_LLAMA_ONLY = ("size", "step_time", "peak_flops", "dtype", "backend")


def add_model_report_arguments(p: argparse.ArgumentParser) -> None:
    """The ``report`` flags that choose the model and describe a measured run."""
    from jaxpar.models.llama_config import DTYPES, SIZES

    g = p.add_argument_group("model report (--model llama)")
    g.add_argument("--model", choices=MODELS, default="gpt",
                   help="gpt: compile the example GPT's step; llama: the Llama report (default %(default)s)")
    g.add_argument("--size", choices=sorted(SIZES), help="Llama size (with --model llama; default tiny)")
    g.add_argument("--step-time", type=number("--step-time", float, above=0),
                   help="measured seconds per step: adds tokens/s/device and MFU")
    g.add_argument("--peak-flops", type=number("--peak-flops", float, above=0),
                   help="peak FLOP/s of one device (default: the table for this device kind and dtype)")
    g.add_argument("--dtype", choices=DTYPES, help="compute dtype of the Llama model (default float32)")
    g.add_argument("--backend", choices=("cpu", "gpu", "tpu"),
                   help="backend the attention choice is made for (default: this machine's)")


# The example GPT's shape flags and their defaults: the Llama report takes its shape from --size.
GPT_SHAPE = {"layers": 2, "embed": 64, "heads": 8, "scan": False}


def check_model_report_flags(args) -> None:
    """Refuse flags that the chosen model's report would ignore."""
    if args.model == "llama":
        ignored = [f for f, default in GPT_SHAPE.items() if getattr(args, f) != default]
        if ignored:
            flags = ", ".join("--" + f for f in ignored)
            refuse(f"{flags} shape the example GPT; the Llama report takes its shape from --size "
                   f"(tiny, 125m, 1b, llama3_8b, llama3_70b); leave {flags} out")
        return
    ignored = [f for f in _LLAMA_ONLY if getattr(args, f, None) is not None]
    if ignored:
        flags = ", ".join("--" + f.replace("_", "-") for f in ignored)
        refuse(f"{flags} apply to the Llama report only; add --model llama, or leave them out")


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="compile the GPT step and report memory, collectives, FLOPs; or a Llama "
                       "model's FLOPs, memory per device and MFU (--model llama)")
    add_job_args(p, train=False)
    add_model_report_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (tables on stderr)")
    p.set_defaults(func=cmd_report)


def llama_report(args) -> int:
    """Print the Llama report for the flags (``--json``: the JSON document alone on stdout)."""
    from jaxpar.job.batch import check_batch
    from jaxpar.job.example import example_job
    from jaxpar.job.reports import llama_size_report, mesh_sizes

    batch = args.batch or DEFAULT_BATCH
    try:    # planned from mesh sizes: the mesh may be larger than this machine
        devices = devices_of(args)
        config = config_of(args, devices)
        # the batch the flags give, named by them (a job of the same batch and layout cuts it the same way)
        check_batch(example_job(config, batch=batch), mesh_sizes(config, devices), names=EXAMPLE_FLAGS)
    except JOB_ERRORS as e:
        raise UserError(str(e)) from e
    tables = sys.stderr if args.json else sys.stdout
    note = hosts_note(config, devices)
    if note:
        print_text(note, file=tables)
    # the estimate does not read hosts; the compiled step is laid out on this process's devices
    report = llama_size_report(args.size or "tiny", on_this_machine(config), devices, batch, dtype=args.dtype,
                               seq_len=args.seq_len, step_time=args.step_time, peak_flops=args.peak_flops,
                               backend=args.backend)
    print_text(report.format(), file=tables)
    if config.context is not None:
        _print_balance(config, report.seq_len, tables)
    if args.json:
        print_text(json.dumps(report.summary(), indent=2))
    return 0


def _print_balance(config, seq_len: int, file) -> None:
    """With a context axis: the causal work per device of each sequence order."""
    if config.context is None:
        return
    from jaxpar.ops import describe_balance

    cp = math.prod(config.mesh[a] for a in config.context.axes)
    print_text(describe_balance(seq_len, cp), file=file)


def host_of_positions(hosts, sizes) -> list[int]:
    """The host of each device position of a mesh of ``sizes`` whose axes span ``hosts``, as
    `jaxpar.make_mesh` lays them out (each axis: ``hosts[a]`` blocks of ``sizes[a] / hosts[a]``
    devices of one host), in the order of ``mesh.devices.flat``.

    >>> host_of_positions({"data": 2}, {"data": 4, "model": 2})
    [0, 0, 0, 0, 1, 1, 1, 1]
    """
    import numpy as np

    dcn = [hosts.get(a, 1) for a in sizes]
    ici = [n // h for n, h in zip(sizes.values(), dcn)]
    index = np.indices(list(sizes.values())).reshape(len(sizes), -1)
    return np.ravel_multi_index(tuple(i // c for i, c in zip(index, ici)), dcn).tolist()


def _simulated_hosts_report(built, hosts):
    """`jaxpar.report.step_report` of a step compiled on this process's devices, its collectives
    placed on the hosts the layout ``hosts`` gives each device position."""
    from jaxpar.report import StepReport, collectives, flops, memory, param_table

    compiled = built.trainer.lower(built.example_batch()).compile()
    mesh = built.trainer.mesh
    return StepReport(memory(compiled), collectives(compiled, mesh, hosts=host_of_positions(hosts, dict(mesh.shape))),
                      flops(compiled), param_table(built.trainer))


def refuse_job_file(args) -> None:
    """``--config`` of ``report`` holds ParallelConfig fields; a job file is refused with the command
    that reports on it (``jaxpar plan``) and the part of it ``report`` takes."""
    if not args.config:
        return
    import yaml

    from jaxpar.cli.jobfile import JOB_ONLY

    with open(args.config) as f:            # checked by the --config type: a YAML mapping
        data = yaml.safe_load(f)
    sections = [k for k in JOB_ONLY if isinstance(data, dict) and k in data]
    if sections:
        parallel = data.get("parallel")
        inline = f" (here: {yaml.safe_dump(parallel, default_flow_style=True, width=10**6).strip()})" \
            if isinstance(parallel, dict) and parallel else ""
        refuse(f"--config {args.config!r} is a job file (sections {', '.join(sections)}); jaxpar report takes a "
               f"file of ParallelConfig fields and reports on the example GPT or --model llama --size NAME. For "
               f"this job's plan and model report run: jaxpar plan --config {args.config}; to report on its "
               f"layout, give report a file holding its parallel section alone{inline}")


def cmd_report(args) -> int:
    from jaxpar.job import run
    from jaxpar.report import step_report

    refuse_job_file(args)
    check_model_report_flags(args)
    if args.model == "llama":
        return llama_report(args)
    job, devices = resolve_job(args, plan_hosts=True)
    # With --json, stdout holds the JSON document alone (so it can be piped); tables go to stderr.
    tables = sys.stderr if args.json else sys.stdout
    note = hosts_note(job.parallel, devices)
    if note:
        print_text(note + "; the collectives that cross hosts are read from the device positions", file=tables)
    built = run.build(dataclasses.replace(job, parallel=on_this_machine(job.parallel)), devices=devices)
    if note:
        report = _simulated_hosts_report(built, job.parallel.hosts)
    else:
        report = step_report(built.trainer, built.example_batch())
    print_text(report.format(), file=tables)
    config = job.parallel
    if config.pipeline.stages > 1:
        from jaxpar.report import format_schedule

        print_text(format_schedule(config), file=tables)
    _print_balance(config, job.data.seq_len, tables)
    if args.json:
        print_text(json.dumps(report.summary(), indent=2, default=str))
    return 0
