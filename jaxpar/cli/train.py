"""``jaxpar train``: train the built-in example GPT from flags, or a job file (``--config
job.yaml``). Both forms make a `jaxpar.job.JobConfig` (the flags through
`jaxpar.job.example.example_job`) and run it with `jaxpar.job.run.run_job`.

The flags that watch a run (``--log-dir``, ``--tensorboard``, ``--log-every``,
``--profile-steps``, ``--peak-flops``) become the job's ``logging`` section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable

from jaxpar.cli.common import (DEFAULT_DEVICES, check_mesh, check_writable, print_text, refuse,
                               set_simulated_devices)
from jaxpar.cli.jobflags import EXAMPLE_FLAGS, add_job_args, resolve_job

DEFAULT_LOG_DIR = "runs/train"


def _profile_steps(text: str) -> tuple[int, int]:
    from jaxpar.metrics import check_profile_steps

    try:
        return check_profile_steps(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--profile-steps {text!r} is not START:STOP with 1 <= START < STOP; e.g. --profile-steps 10:13 "
            "traces steps 10, 11 and 12") from None


def _every(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--log-every {text!r} is not an integer >= 1; e.g. --log-every 10")
    return int(text)


def _peak(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--peak-flops {text!r} is not a number > 0; give one device's peak "
                                         "FLOP/s, e.g. --peak-flops 989e12 for an H100 SXM in bf16")
    return value


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("watching the run")
    g.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="run directory: metrics.jsonl, TensorBoard event "
                   "files, profile traces (default %(default)s; '' = none)")
    g.add_argument("--log-every", type=_every, default=10, help="log every N steps (default %(default)s); "
                   "the device is read only then")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to --log-dir "
                   "(pip install 'jaxpar[tb]')")
    g.add_argument("--profile-steps", type=_profile_steps, metavar="START:STOP",
                   help="jax.profiler trace of steps START..STOP-1 under LOG_DIR/profile")
    g.add_argument("--peak-flops", type=_peak, help="peak FLOP/s of one device, for MFU (default: the datasheet "
                   "table for this device and the compute dtype; none for CPU: MFU n/a)")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the example GPT on all devices (or a job file: --config job.yaml)")
    add_job_args(p, train=True)
    p.add_argument("--metrics", default="runs/train_metrics.json", help="JSON file for metrics ('' = none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_watch_arguments(p)
    p.set_defaults(func=cmd_train)


def watch_mistake(args: argparse.Namespace, steps: int) -> str | None:
    """The paragraph for a combination of the watch flags that cannot work, or None."""
    from jaxpar.metrics import profile_window_outside, require_tensorboard

    if not args.log_dir:
        named = [f for f, on in (("--tensorboard", args.tensorboard), ("--profile-steps", args.profile_steps)) if on]
        if named:
            verb = "writes" if len(named) == 1 else "write"
            return f"{' and '.join(named)} {verb} into the run directory, but --log-dir is ''; give --log-dir DIR"
    inside = profile_window_outside(args.profile_steps, 1, steps) if args.profile_steps else None
    if inside:
        start, stop = args.profile_steps
        return (f"--profile-steps {start}:{stop} traces steps {start} to {stop - 1}, but the run has --steps {steps}; "
                f"choose a window inside it, e.g. --profile-steps {inside[0]}:{inside[1]}")
    if args.tensorboard:
        try:
            require_tensorboard("--tensorboard")
        except ValueError as e:
            return str(e)
    return _unwritable(args.log_dir) if args.log_dir else None


def _unwritable(folder: str) -> str | None:
    """Why ``--log-dir folder`` cannot hold the run's files (probed by creating one), or None."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxpar-probe-"):
            pass
    except OSError as e:
        return (f"--log-dir {folder!r} cannot be written ({e.strerror or e}); choose a folder you can write, "
                "e.g. --log-dir runs/exp1")
    return None


def logging_section(args: argparse.Namespace):
    """The job's ``logging`` section of the watch flags."""
    from jaxpar.job.config import LoggingSection

    window = f"{args.profile_steps[0]}:{args.profile_steps[1]}" if args.profile_steps else None
    return LoggingSection(dir=os.fspath(args.log_dir) if args.log_dir else None, every=args.log_every,
                          tensorboard=args.tensorboard, profile_steps=window, peak_flops=args.peak_flops)


def job_of_flags(args: argparse.Namespace):
    """``(JobConfig, devices)`` of ``jaxpar train``'s flags (checked; a mistake raises `UserError`)."""
    from jaxpar.job.batch import check_batch
    from jaxpar.job.reports import mesh_sizes

    job, devices = resolve_job(args)
    try:        # the batch the example's flags give: named by those flags
        check_batch(job, mesh_sizes(job.parallel, devices), names=EXAMPLE_FLAGS)
    except ValueError as e:
        refuse(str(e))
    if args.metrics:
        check_writable("--metrics", args.metrics)     # before training, not after it
    problem = watch_mistake(args, job.train.steps)
    if problem:
        refuse(problem)
    return dataclasses.replace(job, logging=logging_section(args)), devices


def train(job, devices, *, quiet: bool, samples: int = 0, before_fit: Callable | None = None):
    """Run ``job`` on ``devices`` (None: all) as both forms of ``jaxpar train`` do; returns
    `run_job`'s result. Only process 0 prints."""
    import jax

    from jaxpar.job import run

    lead = jax.process_index() == 0
    say = print_text if lead else (lambda *a, **k: None)
    return run.run_job(job, devices=devices, progress=not quiet and lead, samples=samples, print_fn=say,
                       before_fit=before_fit)


def cmd_train(args) -> int:
    """``jaxpar train`` with flags: the example job, its step report, then the summary and MFU."""
    import jax

    from jaxpar.report import mfu as jaxpar_mfu
    from jaxpar.report import peak_flops, step_report

    job, devices = job_of_flags(args)
    config, shown = job.parallel, {}

    def report(built):
        mesh = built.mesh
        print_text(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
                   f"mode {config.mode}, rules {config.rules}")
        shown["report"] = step_report(built.trainer, built.example_batch())
        shown["trainer"], shown["mesh"] = built.trainer, mesh
        print_text(shown["report"].format(detail=False))
        if config.pipeline.stages > 1:
            from jaxpar.report import format_schedule

            print_text(format_schedule(config))

    result = train(job, devices, quiet=args.quiet, before_fit=report)
    history, batch, seq_len = result["history"], job.data.batch, job.data.seq_len
    eval_loss = result["eval"][-1]["eval_loss"]
    steady = history[1:] or history
    step_time = sum(h["time_s"] for h in steady) / len(steady)
    tokens_per_s = batch * seq_len / step_time
    mesh = shown["mesh"]
    peak = job.logging.peak_flops or peak_flops(dtype=config.precision.compute if config.precision else "float32")
    # model FLOPs (the GPT's closed form), not XLA's count: it counts a scan body once
    model_flops = shown["trainer"].model.flops_per_token(seq_len) * batch * seq_len
    mfu = jaxpar_mfu(model_flops, step_time, peak, mesh.devices.size) if peak else None
    print_text(f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} (eval {eval_loss:.4f}); "
               f"step {step_time * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s, "
               f"MFU {'n/a (no peak for this device: --peak-flops)' if mfu is None else f'{mfu:.1%}'}, "
               f"total {result['fit_s']:.1f}s")
    if args.log_dir:
        print_text(f"run log in {args.log_dir}" + (f" (tensorboard --logdir {args.log_dir})" if args.tensorboard
                                                    else ""))
    out = {"config": config.to_dict(), "mesh": dict(mesh.shape), "steps": job.train.steps, "batch": batch,
           "seq_len": seq_len, "history": history, "eval_loss": eval_loss, "step_time_s": step_time,
           "tokens_per_s": tokens_per_s, "mfu": mfu, "mfu_source": "model", "report": shown["report"].summary()}
    if args.metrics and jax.process_index() == 0:   # one writer under `jaxpar launch`
        with open(args.metrics, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print_text(f"metrics written to {args.metrics}")
    return 0


def train_file(args: argparse.Namespace, overrides: list[str]) -> int:
    """``jaxpar train --config JOB [--section.field value ...]``: the resolved job, then training."""
    import jax

    from jaxpar.distributed import initialize
    from jaxpar.job.config import JobConfig
    from jaxpar.job.run import summary_json

    set_simulated_devices(args.devices or DEFAULT_DEVICES)
    job = JobConfig.load(args.config, overrides)
    initialize()   # under `jaxpar launch`, join the job before JAX lists the devices (else a no-op)
    if args.devices and jax.process_count() > 1:
        raise ValueError(f"--devices {args.devices}: a multi-process job uses every process's devices; leave "
                         "--devices out and choose the mesh with --parallel.mesh")
    devices = jax.devices()[: args.devices] if args.devices else None
    check_mesh(job.parallel, devices or jax.devices(), flag="parallel.mesh")
    lead = jax.process_index() == 0
    if lead:
        print(job.to_yaml(), flush=True)            # the resolved job, as saved beside the checkpoints
    result = train(job, devices, quiet=args.quiet, samples=args.samples)
    if not lead:
        return 0
    for text in result["samples"]:
        print("--- sample ---\n" + text, flush=True)
    if not result["trained"]:       # already at train.steps: the finished run's summary stays
        return 0
    last = result["history"][-1]["loss"] if result["history"] else float("nan")
    first = result["history"][0]["loss"] if result["history"] else float("nan")
    evals = " ".join(f"{e['eval_loss']:.3f}@{e['step']}" for e in result["eval"])
    print(f"trained to step {result['step']}: train loss {first:.3f} -> {last:.3f}; eval {evals or 'none'}")
    if job.logging.dir:
        with open(os.path.join(job.logging.dir, "summary.json"), "w") as f:
            f.write(summary_json(result))
    return 0
