"""The jaxpar command: train, plan, report, launch, k8s, ckpt, data.

jaxpar train is the main job: the example GPT on every available device (8 simulated CPU
devices on a machine without accelerators), default mesh data x model with Megatron-style
rules. Parallel settings come from --config FILE.yaml and/or overrides such as
--mesh data=2,model=4 --rules mlp=model,heads=model.

Every flag is checked before any work starts: a value out of range, a missing or malformed
config file, an output path that cannot be written, or a flag that the chosen command would
ignore ends the command with one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

from jaxpar.cli_job import (DEFAULT_BATCH, DEFAULT_DEVICES, JOB_ERRORS, UserError, build_job, config_of, devices_of,
                            refuse, resolve_job, set_simulated_devices)
from jaxpar.plan_cli import number


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one paragraph (no usage block) and exit code 2."""

    def error(self, message: str):
        head, _, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith("--"):
            message = rest     # our type= functions name the flag and the value themselves
        elif rest == "expected one argument":
            message += f"; a value that starts with '-' is written {head.split()[-1].split('/')[0]}=VALUE"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def config_file(text: str) -> str:
    """``--config``: an existing file holding a YAML mapping (its fields are checked later)."""
    import yaml

    example = "a YAML file of ParallelConfig fields such as 'mesh: {data: 2, model: 4}'"
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


def check_writable(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written, by creating its folder and a probe file."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        refuse(f"{flag} {path!r} is a directory; give a file path such as {os.path.join(path, 'out.json')!r}")
    folder = os.path.dirname(full)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxpar-probe-"):
            pass
        if os.path.exists(full) and not os.access(full, os.W_OK):
            raise PermissionError(13, "Permission denied", full)
    except OSError as e:
        refuse(f"{flag} {path!r} cannot be written ({e.strerror or e}); choose a path in a folder you can write, "
               f"e.g. {flag} runs/{os.path.basename(full) or 'out.json'}")


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether a flag whose default is None / False / [] was given."""
    return getattr(args, dest, None) not in (None, False, [])


def jaxpar_raised(error: BaseException) -> bool:
    """Whether a ``raise`` statement in jaxpar's own code raised ``error`` (a message jaxpar wrote)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return os.path.abspath(last.filename).startswith(root) and (last.line or "").lstrip().startswith("raise")


def add_job_args(p: argparse.ArgumentParser, *, train: bool) -> None:
    """The flags of the job that ``train``, ``plan`` and ``report`` build (``--steps``, ``--lr`` and
    ``--seed`` only for ``train``: nothing else depends on them)."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--config", type=config_file, help="YAML file with ParallelConfig fields")
    g.add_argument("--mesh", help="mesh axes, e.g. data=2,model=4 (one may be -1)")
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


_DESCRIPTION = """\
jaxpar: SPMD parallel training with JAX.

'jaxpar COMMAND --help' lists a command's flags. A mistaken flag or value ends the command
with exit code 2 and one paragraph naming it; 'jaxpar --debug COMMAND ...' shows the Python
traceback instead.
"""


def _print(text: str, file=None) -> None:
    # Tables arrive rendered; print them as they are (rich would re-wrap them in a narrow log).
    print(text, flush=True, file=file)


def cmd_train(args) -> int:
    import jax

    from jaxpar.metrics.cli import mistake
    from jaxpar.report import mfu as jaxpar_mfu
    from jaxpar.report import step_report

    job = resolve_job(args)
    if args.metrics:
        check_writable("--metrics", args.metrics)     # before training, not after it
    problem = mistake(args, job.steps)       # --log-dir, --tensorboard, --profile-steps together
    if problem:
        refuse(problem)
    mesh, trainer, data = build_job(job, watch=args)
    config = job.config
    _print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
           f"mode {config.mode}, rules {config.rules}")
    report = step_report(trainer, data.batch(job.batch, 0))
    _print(report.format(detail=False))
    if config.pipeline.stages > 1:
        from jaxpar.report import format_schedule

        _print(format_schedule(config))
    t0 = time.perf_counter()
    with trainer:      # closes the metric writers and a profile trace still running
        history = trainer.fit(data.batches(job.batch), job.steps, log_every=args.log_every, progress=not args.quiet)
        wall = time.perf_counter() - t0
        eval_loss = trainer.evaluate(data.batches(job.batch, start=10**6), steps=4)
    steady = history[1:] or history
    step_time = sum(h["time_s"] for h in steady) / len(steady)
    tokens_per_s = job.batch * job.model.seq_len / step_time
    n = mesh.devices.size
    from jaxpar.metrics.cli import device_peak

    peak = args.peak_flops or device_peak(config.precision.compute if config.precision else "float32")
    # model FLOPs (the GPT's closed form), not XLA's count: it counts a scan body once
    model_flops = trainer.model.flops_per_token(job.model.seq_len) * job.batch * job.model.seq_len
    mfu = jaxpar_mfu(model_flops, step_time, peak, n) if peak else None
    _print(f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} (eval {eval_loss:.4f}); "
           f"step {step_time * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s, "
           f"MFU {'n/a (no peak for this device: --peak-flops)' if mfu is None else f'{mfu:.1%}'}, total {wall:.1f}s")
    if args.log_dir:
        _print(f"run log in {args.log_dir}" + (f" (tensorboard --logdir {args.log_dir})" if args.tensorboard else ""))
    out = {"config": config.to_dict(), "mesh": dict(mesh.shape), "steps": job.steps, "batch": job.batch,
           "seq_len": job.model.seq_len, "history": history, "eval_loss": eval_loss, "step_time_s": step_time,
           "tokens_per_s": tokens_per_s, "mfu": mfu, "mfu_source": "model", "report": report.summary()}
    if args.metrics and jax.process_index() == 0:   # one writer under `jaxpar launch`
        with open(args.metrics, "w") as f:
            json.dump(out, f, indent=2, default=str)
        _print(f"metrics written to {args.metrics}")
    return 0


def check_plan_flags(args) -> None:
    """Refuse the ``plan`` flags that the chosen form of the command would ignore."""
    if args.search is None:
        search_only = [f for f in ("annotate", "memory_budget", "zero_levels", "accum_options", "remat_options",
                                   "pipeline_options", "microbatch_options", "schedule", "flops", "bandwidth",
                                   "latency", "plan_out", "batch") if given(args, f)]
        if search_only:
            refuse(f"{_flags(search_only)} {_verb(search_only)} to --search only (without it, jaxpar plan prints "
                   "the configured plan, which does not depend on it); add --search dynamic_programming, or leave "
                   "it out")
        return
    if given(args, "save"):
        refuse(f"--save {args.save!r} writes the configured plan, which --search replaces; write the searched "
               f"plan with --plan-out {args.save!r}")
    if given(args, "mode"):
        refuse(f"--mode {args.mode} is replaced by mode 'auto' under --search; leave --mode out")
    if given(args, "rules"):
        refuse(f"--rules {args.rules} is replaced by the search under --search (it plans every parameter); pin "
               "parameters with --annotate PATH=STRATEGY instead, or leave --rules out")
    if args.memory_budget is None:
        budget_only = [f for f in ("zero_levels", "accum_options", "remat_options", "pipeline_options",
                                   "microbatch_options", "schedule") if given(args, f)]
        if budget_only:
            refuse(f"{_flags(budget_only)} {_verb(budget_only)} only when the whole job is planned within a memory "
                   "budget; add --memory-budget BYTES, or leave them out")


def _flags(dests: Sequence[str]) -> str:
    return ", ".join("--" + d.replace("_", "-") for d in dests)


def _verb(dests: Sequence[str]) -> str:
    return "applies" if len(dests) == 1 else "apply"


def cmd_plan(args) -> int:
    from jaxpar.nn.plan import format_plan
    from jaxpar.report import param_table

    check_plan_flags(args)
    if args.search:
        from jaxpar.plan_cli import run_plan_search, search_settings

        job = resolve_job(args)
        if args.config and job.config.rules:
            refuse(f"--config {args.config!r} sets rules {dict(job.config.rules)}, which --search replaces (it "
                   "plans every parameter); drop them from the file, or pin parameters with --annotate")
        if args.plan_out:
            check_writable("--plan-out", args.plan_out)
        return run_plan_search(search_settings(args, job), job, build_job)

    job = resolve_job(args)
    if args.save:
        check_writable("--save", args.save)
    mesh, trainer, data = build_job(job)
    if job.config.rules and not job.config.allow_unused_rules:
        trainer.lower(data.batch(job.batch, 0))   # tracing the step refuses rules nothing consults
    print(f"mesh {dict(mesh.shape)}  mode {job.config.mode}")
    print(format_plan(param_table(trainer)))
    if args.save:
        rows = [{"path": r.path, "shape": r.shape, "spec": [list(e) if isinstance(e, tuple) else e for e in r.spec]}
                for r in param_table(trainer)]
        with open(args.save, "w") as f:
            json.dump({"config": job.config.to_dict(), "mesh": dict(mesh.shape), "params": rows}, f, indent=2)
    return 0


def cmd_report(args) -> int:
    from jaxpar.report import step_report
    from jaxpar.report_cli import check_model_report_flags, run_llama_report

    check_model_report_flags(args, refuse)
    if args.model == "llama":   # planned from mesh sizes: the mesh may be larger than this machine
        try:
            devices = devices_of(args)
            config = config_of(args, devices)
        except JOB_ERRORS as e:
            raise UserError(str(e)) from e
        return run_llama_report(args, devices, config, args.batch or DEFAULT_BATCH, _print)
    job = resolve_job(args)
    mesh, trainer, data = build_job(job)
    report = step_report(trainer, data.batch(job.batch, 0))
    # With --json, stdout holds the JSON document alone (so it can be piped); tables go to stderr.
    tables = sys.stderr if args.json else sys.stdout
    _print(report.format(), file=tables)
    if job.config.pipeline.stages > 1:
        from jaxpar.report import format_schedule

        _print(format_schedule(job.config), file=tables)
    if job.config.context is not None:   # the causal work per device of each sequence order
        from jaxpar.ops import describe_balance

        cp = math.prod(job.config.mesh[a] for a in job.config.context.axes)
        _print(describe_balance(job.model.seq_len, cp), file=tables)
    if args.json:
        _print(json.dumps(report.summary(), indent=2, default=str))
    return 0


def make_parser() -> argparse.ArgumentParser:
    """The ``jaxpar`` argument parser with every subcommand."""
    parser = Parser(prog="jaxpar", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train the example GPT on all devices")
    add_job_args(p, train=True)
    p.add_argument("--metrics", default="runs/train_metrics.json", help="JSON file for metrics ('' = none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from jaxpar.metrics.cli import add_arguments as add_watch_arguments

    add_watch_arguments(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("plan", help="print the parameter plan, or search one (--search)")
    add_job_args(p, train=False)
    p.add_argument("--save", help="write the configured plan as JSON (without --search)")
    from jaxpar.plan_cli import add_plan_search_arguments

    add_plan_search_arguments(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("report", help="compile the GPT step and report memory, collectives, FLOPs; or a Llama "
                       "model's FLOPs, memory per device and MFU (--model llama)")
    add_job_args(p, train=False)
    from jaxpar.report_cli import add_model_report_arguments

    add_model_report_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (tables on stderr)")
    p.set_defaults(func=cmd_report)
    from jaxpar.launch.cli import add_k8s_parser, add_launch_parser

    add_launch_parser(sub)
    add_k8s_parser(sub)
    from jaxpar.ckpt_cli import add_ckpt_parser

    add_ckpt_parser(sub)
    from jaxpar.data.cli import add_data_parser

    add_data_parser(sub)
    return parser


def _unknown_flags(command: str, unknown: Sequence[str]) -> str:
    text = f"unrecognized arguments {' '.join(unknown)}"
    train_only = sorted({u.split("=")[0] for u in unknown} & {"--steps", "--lr", "--seed"})
    if train_only and command != "train":
        verb = "is" if len(train_only) == 1 else "are"
        text += (f"; {', '.join(train_only)} {verb} for 'jaxpar train' only: nothing 'jaxpar {command}' prints "
                 "depends on them")
    return f"{text}; 'jaxpar {command} --help' lists its flags"


def _fail(args, message: str) -> int:
    print(f"jaxpar {args.command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``jaxpar`` command; returns the exit code (2 for a mistake in the input).

    Example:
        >>> main(["train", "--batch", "0"])  # doctest: +SKIP
        jaxpar train: error: argument --batch: 0 is not valid: expected an integer >= 1 ...
        2
    """
    from jaxpar.job.cli import job_file, main as run_job_file

    argv = list(sys.argv[1:] if argv is None else argv)
    if job_file(argv):       # train --config JOB.yaml: the job's own flags and --section.field overrides
        return run_job_file(argv, set_simulated_devices, DEFAULT_DEVICES, jaxpar_raised)
    try:
        args, unknown = make_parser().parse_known_args(argv)
    except SystemExit as e:   # --help (0) or a flag argparse refused (2, the paragraph is printed)
        return e.code if isinstance(e.code, int) else 2
    if unknown:
        return _fail(args, _unknown_flags(args.command, unknown))
    if hasattr(args, "devices"):
        set_simulated_devices(args.devices or DEFAULT_DEVICES)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        if args.debug:
            raise
        return _fail(args, str(e))
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
        # jaxpar's own checks of a value the user chose (e.g. a batch the mesh cannot split)
        # get the one paragraph; anything raised elsewhere is a bug and keeps its traceback.
        if args.debug or not jaxpar_raised(e):
            raise
        return _fail(args, str(e))


if __name__ == "__main__":  # python -m jaxpar.cli
    sys.exit(main())
