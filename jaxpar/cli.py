"""The ``jaxpar`` command: ``train``, ``plan``, ``report``, ``launch``, ``k8s``.

``jaxpar train`` is the main job: the example GPT on every available device (8 simulated CPU
devices on a machine without accelerators), default mesh data × model with Megatron-style
rules. Parallel settings come from ``--config FILE.yaml`` and/or overrides such as
``--mesh data=2,model=4 --rules mlp=model,heads=model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

MEGATRON_RULES = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}


def _set_simulated_devices(n: int) -> None:
    """Ask for ``n`` CPU devices; must run before JAX starts a backend. Harmless on GPU/TPU."""
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def default_config(num_devices: int):
    """data × model: model = the largest of 4, 2, 1 dividing the device count."""
    from jaxpar.config import ParallelConfig

    model = next(m for m in (4, 2, 1) if num_devices % m == 0)
    return ParallelConfig(mesh={"data": num_devices // model, "model": model}, rules=MEGATRON_RULES)


def _job_config(args):
    import jax

    from jaxpar.config import ParallelConfig

    base = ParallelConfig.from_yaml(args.config) if args.config else default_config(len(jax.devices()))
    if args.mode == "data" and args.rules is None:
        base = dataclasses.replace(base, rules={})   # mode "data" replicates every parameter
    overrides = []
    for flag in ("mesh", "rules", "mode", "remat", "optimizer", "pipeline", "grad_accum"):
        value = getattr(args, flag)
        if value is not None:
            overrides += [f"--{flag}", str(value)]
    return ParallelConfig.from_overrides(overrides, base=base) if overrides else base


def model_config(args, config):
    from jaxpar.models.gpt import GPTConfig

    # A pipeline cuts the stacked blocks into stages, so it needs scanned layers.
    return GPTConfig(vocab_size=16, seq_len=args.seq_len, embed=args.embed, heads=args.heads,
                     mlp=4 * args.embed, layers=args.layers, scan_layers=args.scan or config.pipeline.stages > 1)


def build_job(args):
    """(config, mesh, trainer, data) for the example GPT."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.data import ArithmeticData
    from jaxpar.models.gpt import GPT, loss_fn, pipeline_loss

    config = _job_config(args)
    mesh = jaxpar.make_mesh(config)
    gpt = model_config(args, config)
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(args.seed), constrain=constrain), config, mesh)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, max(args.steps, 21)))
    loss = pipeline_loss() if config.pipeline.stages > 1 else loss_fn
    trainer = jaxpar.Trainer(model, tx, loss, config, mesh)
    return config, mesh, trainer, ArithmeticData(gpt.seq_len, seed=args.seed)


def _print(console, text: str) -> None:
    # Tables arrive rendered; print them as they are (rich would re-wrap them in a narrow log).
    print(text, flush=True)


def cmd_train(args) -> int:
    from rich.console import Console

    from jaxpar.report import step_report

    console = Console()
    config, mesh, trainer, data = build_job(args)
    _print(console, f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
                    f"mode {config.mode}, rules {config.rules}")
    batches = data.batches(args.batch)
    report = step_report(trainer, data.batch(args.batch, 0))
    _print(console, report.format(detail=False))
    if config.pipeline.stages > 1:
        from jaxpar.report import format_schedule

        _print(console, format_schedule(config))
    t0 = time.perf_counter()
    history = trainer.fit(batches, args.steps, progress=not args.quiet)
    wall = time.perf_counter() - t0
    steady = history[1:] or history
    step_time = sum(h["time_s"] for h in steady) / len(steady)
    tokens_per_s = args.batch * args.seq_len / step_time
    eval_loss = trainer.evaluate(data.batches(args.batch, start=10**6), steps=4)
    _print(console, f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} (eval {eval_loss:.4f}); "
                    f"step {step_time * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s, total {wall:.1f}s")
    out = {"config": config.to_dict(), "mesh": dict(mesh.shape), "steps": args.steps, "batch": args.batch,
           "seq_len": args.seq_len, "history": history, "eval_loss": eval_loss, "step_time_s": step_time,
           "tokens_per_s": tokens_per_s, "report": report.summary()}
    if args.metrics:
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics)), exist_ok=True)
        with open(args.metrics, "w") as f:
            json.dump(out, f, indent=2, default=str)
        _print(console, f"metrics written to {args.metrics}")
    return 0


def cmd_plan(args) -> int:
    from jaxpar.nn.plan import format_plan
    from jaxpar.report import param_table

    if args.search:
        from jaxpar.plan_cli import run_plan_search

        return run_plan_search(args, build_job, model_config)

    config, mesh, trainer, _ = build_job(args)
    print(f"mesh {dict(mesh.shape)}  mode {config.mode}")
    print(format_plan(param_table(trainer)))
    if args.save:
        rows = [{"path": r.path, "shape": r.shape, "spec": [list(e) if isinstance(e, tuple) else e for e in r.spec]}
                for r in param_table(trainer)]
        with open(args.save, "w") as f:
            json.dump({"config": config.to_dict(), "mesh": dict(mesh.shape), "params": rows}, f, indent=2)
    return 0


def cmd_report(args) -> int:
    from jaxpar.report import step_report

    config, mesh, trainer, data = build_job(args)
    report = step_report(trainer, data.batch(args.batch, 0))
    print(report.format())
    if config.pipeline.stages > 1:
        from jaxpar.report import format_schedule

        print(format_schedule(config))
    if args.json:
        print(json.dumps(report.summary(), indent=2, default=str))
    return 0


def _add_job_args(p: argparse.ArgumentParser, steps: int = 300) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--config", help="YAML file with ParallelConfig fields")
    g.add_argument("--mesh", help="mesh axes, e.g. data=2,model=4 (one may be -1)")
    g.add_argument("--rules", help="logical axis rules, e.g. mlp=model,heads=model,batch=data")
    g.add_argument("--mode", help="data | semi_auto | hybrid")
    g.add_argument("--remat", help="recompute policy name")
    g.add_argument("--optimizer", help="optimizer parallel, e.g. level=1,threshold_kb=64")
    g.add_argument("--pipeline", help="pipeline, e.g. stages=2,microbatches=4,schedule=1f1b (needs a pipe axis)")
    g.add_argument("--grad-accum", type=int, help="micro-steps per optimizer update")
    g.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator (default 8)")
    m = p.add_argument_group("model and data")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--embed", type=int, default=64)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--seq-len", type=int, default=32)
    m.add_argument("--scan", action="store_true", help="stack the blocks and run them with lax.scan")
    m.add_argument("--batch", type=int, default=32, help="global batch size")
    m.add_argument("--steps", type=int, default=steps)
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--seed", type=int, default=0)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train the example GPT on all devices")
    _add_job_args(p)
    p.add_argument("--metrics", default="runs/train_metrics.json", help="JSON file for metrics ('' = none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("plan", help="print the parameter plan (parameter -> PartitionSpec -> bytes)")
    _add_job_args(p)
    p.add_argument("--save", help="write the plan as JSON")
    from jaxpar.plan_cli import add_plan_search_arguments

    add_plan_search_arguments(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("report", help="compile the GPT step and report memory, collectives, FLOPs")
    _add_job_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)
    from jaxpar.launch.cli import add_k8s_parser, add_launch_parser

    add_launch_parser(sub)
    add_k8s_parser(sub)
    from jaxpar.checkpoint.cli import add_ckpt_parser

    add_ckpt_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if hasattr(args, "devices"):
        _set_simulated_devices(args.devices)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, NotImplementedError) as e:
        print(f"jaxpar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m jaxpar.cli
    sys.exit(main())
