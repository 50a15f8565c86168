"""``jaxpar train --config job.yaml [--section.field value ...]``: run a job file (``jaxpar plan
--config job.yaml``: its plan and memory per device from shapes alone).

A ``--config`` file with a job section (``model``, ``data``, ``parallel``, ``train``,
``checkpoint``, ``logging`` or ``eval``) is a job file; one holding ``ParallelConfig`` fields
alone keeps configuring the built-in example as before. Every field of the job is set with a
dotted flag; the example's own flags (``--steps``, ``--mesh``...) are refused with the dotted
flag to use instead, so that no flag is silently ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

JOB_ONLY = ("model", "data", "parallel", "train", "checkpoint", "logging", "eval")

# the example's flags -> the job field that does the same
INSTEAD = {
    "--steps": "--train.steps", "--lr": "--optimizer.lr", "--seed": "--train.seed", "--batch": "--data.batch",
    "--seq-len": "--data.seq_len", "--mesh": "--parallel.mesh", "--rules": "--parallel.rules",
    "--mode": "--parallel.mode", "--remat": "--parallel.remat", "--optimizer": "--parallel.optimizer",
    "--pipeline": "--parallel.pipeline", "--grad-accum": "--parallel.grad_accum", "--layers": "--model.fields",
    "--embed": "--model.fields", "--heads": "--model.fields", "--scan": "--model.fields",
    "--metrics": "--logging.dir", "--log-dir": "--logging.dir", "--log-every": "--logging.every",
    "--tensorboard": "--logging.tensorboard", "--profile-steps": "--logging.profile_steps",
    "--peak-flops": "(MFU needs an accelerator's peak; not in job files yet)",
}


def job_file(argv: Sequence[str]) -> str | None:
    """The job file of a ``train --config FILE`` command line, or None (not a job file)."""
    args = [a for a in argv if a != "--debug"]
    if not args or args[0] not in ("train", "plan"):
        return None
    path = None
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    if path is None or not os.path.isfile(path):
        return None
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None          # the example's --config check reports it (a binary file included)
    return path if isinstance(data, dict) and any(k in data for k in JOB_ONLY) else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar train", description=__doc__.splitlines()[0], exit_on_error=False)
    p.add_argument("--config", required=True, help="the job file")
    p.add_argument("--samples", type=int, default=0, help="greedy samples decoded at the end (default 0)")
    p.add_argument("--devices", type=int, help="use the first N devices (simulated CPU devices without one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(flags, overrides)``: ``--section.field value`` pairs apart from the other flags."""
    flags, overrides, it = [], [], iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name.startswith("--") and "." in name:
            overrides.append(a)
            if "=" not in a:
                overrides.append(next(it, ""))
        else:
            flags.append(a)
    return flags, overrides


def main(argv: Sequence[str], set_devices: Callable[[int], None] = lambda n: None, default_devices: int = 8,
         users_mistake: Callable[[BaseException], bool] = lambda e: True) -> int:
    """Run ``jaxpar train --config JOB ...``; returns the exit code (2 for a mistake in the input).

    ``set_devices(n)``: asks for ``n`` simulated CPU devices before JAX starts (``--devices``,
    else ``default_devices``). ``users_mistake(error)``: whether an error is jaxpar's answer to
    the input (one paragraph, exit 2) rather than a bug (its traceback is kept)."""
    command = next(a for a in argv if a in ("train", "plan"))
    argv = [a for a in argv if a != command]
    flags, overrides = split_overrides(argv)
    debug = "--debug" in flags
    try:
        for a in flags:
            name = a.split("=", 1)[0]
            if name in INSTEAD:
                raise ValueError(f"{name} configures the built-in example; in a job file run set "
                                 f"{INSTEAD[name]} (or the field in the file)")
        args, unknown = _parser().parse_known_args(flags)
        if command == "plan":
            unknown += [f for f in ("--samples", "--devices", "--quiet") if given(args, f)]
        if unknown:
            takes = "--config" if command == "plan" else "--config, --samples, --devices, --quiet"
            raise ValueError(f"unrecognized arguments {' '.join(unknown)}; 'jaxpar {command}' of a job file takes "
                             f"{takes} and --section.field value overrides")
        if command == "plan":
            set_devices(default_devices)     # a mesh axis of -1 takes the devices `train` would use here
            return _plan(args, overrides)
        if args.samples < 0 or (args.devices is not None and args.devices < 1):
            raise ValueError(f"--samples {args.samples} / --devices {args.devices}: use --samples >= 0 and "
                             "--devices >= 1")
        set_devices(args.devices or default_devices)
        return _run(args, overrides)
    except (ValueError, TypeError, FileNotFoundError, argparse.ArgumentError) as e:
        if debug or not (isinstance(e, argparse.ArgumentError) or users_mistake(e)):
            raise
        print(f"jaxpar {command}: error: {e}", file=sys.stderr)
        return 2


def given(args, flag: str) -> bool:
    value = getattr(args, flag[2:])
    return value not in (None, False, 0)


def _plan(args, overrides: list[str]) -> int:
    """The job's TrainPlan and (Llama) memory per device, from shapes alone: no parameter is
    allocated and the mesh may be larger than this machine (``llama3_8b`` on 64 devices)."""
    from flax import nnx

    from jaxpar.job.config import JobConfig
    from jaxpar.job.optim import make_optimizer
    from jaxpar.job.run import model_config
    from jaxpar.nn import abstract_model
    from jaxpar.plan import make_train_plan

    job = JobConfig.load(args.config, overrides)
    if job.model.factory is not None:
        raise ValueError("jaxpar plan --config: a model.factory job is planned when it runs (jaxpar train); "
                         "plan covers the named models")
    sizes = dict(job.parallel.mesh)
    if -1 in sizes.values():      # the rest of the devices `jaxpar train` would use on this machine
        import jax

        from jaxpar.mesh import resolve_axes

        sizes = resolve_axes(sizes, jax.device_count())
    cfg = model_config(job)
    tx, _ = make_optimizer(job.optimizer, job.train.steps)
    if job.model.name == "llama":
        from jaxpar.models import llama as module
        make = module.Llama
    else:
        from jaxpar.models import gpt as module
        make = module.GPT
    from jax.sharding import AbstractMesh

    from jaxpar.nn import model_constraint

    # the model and loss `jaxpar train` would build, so the plan refuses what the Trainer would
    constrain = model_constraint(AbstractMesh(tuple(sizes.values()), tuple(sizes)), job.parallel)
    model = abstract_model(lambda: make(cfg, rngs=nnx.Rngs(0), constrain=constrain))
    loss = module.pipeline_loss() if job.parallel.pipeline.stages > 1 else module.loss_fn
    plan = make_train_plan(job.parallel, sizes, model, tx, loss_fn=loss)
    print(plan)
    if job.model.name == "llama":
        from jaxpar.models.llama_report import format_model_report, llama_report

        print(format_model_report(llama_report(cfg, job.parallel, batch=job.data.batch, seq_len=job.data.seq_len,
                                               mesh=sizes, tx=tx)))
    return 0


def _run(args, overrides: list[str]) -> int:
    from jaxpar.job.config import JobConfig

    job = JobConfig.load(args.config, overrides)
    import jax

    from jaxpar.distributed import initialize
    from jaxpar.job.run import run_job, summary_json

    initialize()   # under `jaxpar launch`, join the job before JAX lists the devices (else a no-op)
    if args.devices and jax.process_count() > 1:
        raise ValueError(f"--devices {args.devices}: a multi-process job uses every process's devices; leave "
                         "--devices out and choose the mesh with --parallel.mesh")
    devices = jax.devices()[: args.devices] if args.devices else None
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    say(job.to_yaml(), flush=True)            # the resolved job, as saved beside the checkpoints
    result = run_job(job, devices=devices, progress=not args.quiet and lead, samples=args.samples, print_fn=say)
    for text in result["samples"]:
        say("--- sample ---\n" + text, flush=True)
    last = result["history"][-1]["loss"] if result["history"] else float("nan")
    first = result["history"][0]["loss"] if result["history"] else float("nan")
    evals = " ".join(f"{e['eval_loss']:.3f}@{e['step']}" for e in result["eval"])
    say(f"trained to step {result['step']}: train loss {first:.3f} -> {last:.3f}; eval {evals or 'none'}")
    if job.logging.dir and lead:
        with open(os.path.join(job.logging.dir, "summary.json"), "w") as f:
            f.write(summary_json(result))
    return 0
