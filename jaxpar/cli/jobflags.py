"""The flags of the built-in example job that ``jaxpar train``, ``plan`` and ``report`` share,
and the `JobConfig` they describe (`jaxpar.job.example.example_job`): the same value a job
file with ``data: {source: arithmetic}`` and ``model: {name: gpt}`` loads.

Parallel settings come from ``--config FILE.yaml`` (``ParallelConfig`` fields) and/or
overrides such as ``--mesh data=2,model=4 --rules mlp=model,heads=model``; without them the
mesh is data x model over the devices with Megatron-style rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from jaxpar.cli.common import DEFAULT_BATCH, DEFAULT_DEVICES, JOB_ERRORS, UserError, check_mesh, number, refuse

# the job fields the example's flags set, as `jaxpar.job.batch.check_batch` names them
EXAMPLE_FLAGS = {"data.batch": "--batch", "parallel.grad_accum": "--grad-accum"}


def config_file(text: str) -> str:
    """``--config``: an existing file holding a YAML mapping (its fields are checked later)."""
    import yaml

    example = ("a job file (train, plan: e.g. examples/configs/tiny.yaml) or a YAML file of ParallelConfig fields "
               "such as 'mesh: {data: 2, model: 4}'")
    head = f"--config {text!r}:"
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{head} does not exist; give {example}")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{head} a directory, not a file; give {example}")
    try:
        with open(text) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{head} cannot be read ({e.strerror}); give {example}") from None
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{head} is not a text file (byte {e.object[e.start]:#04x} at offset "
                                         f"{e.start} is not UTF-8); give {example}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = " ".join(str(getattr(e, "problem", e)).split())      # one line (a ReaderError has two)
        raise argparse.ArgumentTypeError(f"{head} not valid YAML{at} ({problem}); "
                                         f"give {example}") from None
    if data is not None and not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{head} holds a YAML {type(data).__name__}, not a mapping; give "
                                         f"{example}")
    return text


def add_job_args(p: argparse.ArgumentParser, *, train: bool) -> None:
    """The flags of the job that ``train``, ``plan`` and ``report`` build (``--steps``, ``--lr`` and
    ``--seed`` only for ``train``: nothing else depends on them)."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--config", type=config_file, help="YAML file with ParallelConfig fields; for train and plan "
                   "also a job file (model, data, parallel, ... sections: see docs/jobs.md)")
    g.add_argument("--mesh", help="mesh axes, e.g. data=2,model=4 (one may be -1)")
    g.add_argument("--hosts", help="mesh axes that span hosts (two networks), e.g. data=2: data is 2 hosts x "
                   "the rest inside a host; plan and report lay it out on this machine's devices (docs/startup.md)")
    g.add_argument("--rules", help="logical axis rules, e.g. mlp=model,heads=model,batch=data")
    g.add_argument("--mode", help="data | semi_auto | hybrid")
    g.add_argument("--remat", help="recompute policy name")
    g.add_argument("--optimizer", help="optimizer parallel, e.g. level=1,threshold_kb=64")
    g.add_argument("--pipeline", help="pipeline, e.g. stages=2,microbatches=4,schedule=1f1b (needs a pipe axis)")
    g.add_argument("--grad-accum", type=number("--grad-accum", low=1), help="micro-steps per optimizer update")
    g.add_argument("--devices", type=number("--devices", low=1), help="use the first N devices; without an "
                   f"accelerator, N simulated CPU devices (default: all; {DEFAULT_DEVICES} simulated)")
    m = p.add_argument_group("model and data")
    m.add_argument("--layers", type=number("--layers", low=1), default=2, help="blocks (default %(default)s)")
    m.add_argument("--embed", type=number("--embed", low=1), default=64, help="width (default %(default)s)")
    m.add_argument("--heads", type=number("--heads", low=1), default=8, help="attention heads (default %(default)s)")
    m.add_argument("--seq-len", type=number("--seq-len", low=1),
                   help="tokens per sequence (default 32; a Llama report: the model's max_seq_len)")
    m.add_argument("--scan", action="store_true", help="stack the blocks and run them with lax.scan")
    m.add_argument("--batch", type=number("--batch", low=1), help=f"global batch size (default {DEFAULT_BATCH})")
    if train:
        m.add_argument("--steps", type=number("--steps", low=1), default=300,
                       help="optimizer steps (default %(default)s)")
        m.add_argument("--lr", type=number("--lr", float, above=0), default=3e-3, help="peak learning rate")
        m.add_argument("--seed", type=number("--seed", low=0), default=0,
                       help="init and data seed (default %(default)s)")


def devices_of(args) -> tuple:
    """All devices, or the first ``--devices`` of them."""
    import jax

    from jaxpar.distributed import initialize

    initialize()   # under `jaxpar launch`, join the job before JAX lists the devices (else a no-op)
    devices = tuple(jax.devices())
    if args.devices is None:
        return devices
    if jax.process_count() > 1:
        refuse(f"--devices {args.devices}: a multi-process job uses every process's devices; leave "
               "--devices out and choose the mesh with --mesh")
    if args.devices > len(devices):
        refuse(f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices are available "
               "(JAX was already started in this process, or this machine has no more); use --devices "
               f"{len(devices)} or fewer")
    return devices[:args.devices]


def config_of(args, devices):
    """The ``ParallelConfig`` of ``--config`` and the parallel flags on ``devices``."""
    from jaxpar.config import ParallelConfig
    from jaxpar.job.example import MEGATRON_RULES, default_parallel

    if args.config:
        try:
            base = ParallelConfig.from_yaml(args.config)
        except JOB_ERRORS as e:
            raise UserError(f"--config {args.config!r}: {e}") from e
    else:
        base = default_parallel(len(devices))
    default_rules = not args.config and args.rules is None and args.mode != "data"
    if args.rules is None and (args.mode == "data" or default_rules):
        base = dataclasses.replace(base, rules={})   # mode "data" replicates every parameter
    overrides = []
    for flag in ("mesh", "hosts", "rules", "mode", "remat", "optimizer", "pipeline", "grad_accum"):
        value = getattr(args, flag)
        if value is not None:
            overrides += [f"--{flag}", str(value)]
    config = ParallelConfig.from_overrides(overrides, base=base) if overrides else base
    if default_rules:   # the Megatron rules, for the mesh axes there are (--mesh data=8: batch only)
        config = dataclasses.replace(config, rules={k: v for k, v in MEGATRON_RULES.items() if v in config.mesh})
    return config


def on_this_machine(config):
    """``config`` as the devices of this process lay it out: with ``hosts`` that do not multiply to
    the processes there are (a two-host layout planned on the simulated devices of one), the same
    mesh on one host. A layout's specs and memory do not depend on which devices share a host."""
    import jax

    if not config.hosts or math.prod(config.hosts.values()) == jax.process_count():
        return config
    return dataclasses.replace(config, hosts={})


def hosts_note(config, devices) -> str | None:
    """The line ``plan`` and ``report`` print when ``config``'s hosts are laid out on this
    process's devices (`on_this_machine`); None when they are the processes there are."""
    if on_this_machine(config) is config:
        return None
    n = math.prod(config.hosts.values())
    per = math.prod(config.mesh.values()) // n if -1 not in config.mesh.values() else len(devices) // n
    return (f"note: hosts {dict(config.hosts)} ({n} hosts of {per} devices) planned on this one process as one "
            "host: a layout's specs and memory do not depend on which devices share a host")


def resolve_job(args, logging=None, *, plan_hosts: bool = False):
    """``(JobConfig, devices)`` of the flags; a mistake in them raises `UserError` (exit 2).
    ``logging``: the job's `jaxpar.job.config.LoggingSection` (``jaxpar train``'s watch flags).
    ``plan_hosts`` (``plan``, ``report``): a ``hosts`` layout for more processes than this one is
    checked on this machine's devices (`on_this_machine`); the job keeps its ``hosts``."""
    from jaxpar.job.batch import check_batch
    from jaxpar.job.example import ExampleModel, example_job
    from jaxpar.job.reports import mesh_sizes

    try:
        devices = devices_of(args)
        config = config_of(args, devices)
        where = "--mesh" if args.mesh or not args.config else f"--config {args.config!r}"
        if config.hosts and getattr(args, "hosts", None):     # make_mesh's hosts check names the layout
            where = f"--hosts {args.hosts}" + (f" with {where}" if args.mesh else "")
        check_mesh(on_this_machine(config) if plan_hosts else config, devices, flag=where)   # the mesh fits
        if args.embed % args.heads:
            refuse(f"--embed {args.embed} is not divisible by --heads {args.heads}; use an embed that is a "
                   f"multiple of the heads, e.g. --embed {args.heads * max(1, args.embed // args.heads)}")
        model = ExampleModel(layers=args.layers, embed=args.embed, heads=args.heads, seq_len=args.seq_len or 32,
                             scan=args.scan)
        job = example_job(config, model, batch=args.batch or DEFAULT_BATCH, steps=getattr(args, "steps", 1),
                          lr=getattr(args, "lr", 3e-3), seed=getattr(args, "seed", 0), logging=logging)
        check_batch(job, mesh_sizes(config, devices), names=EXAMPLE_FLAGS)     # named by the flags that set it
    except JOB_ERRORS as e:
        raise UserError(str(e)) from e
    return job, devices
