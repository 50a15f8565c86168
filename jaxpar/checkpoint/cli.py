"""``jaxpar ckpt``: inspect, transform and merge checkpoints offline.

    jaxpar ckpt inspect DIR [--step N] [--json]
    jaxpar ckpt transform DIR --to CONFIG.yaml OUT [--step N] [--devices N]
    jaxpar ckpt merge DIR OUT [--step N]

Also runnable as ``python -m jaxpar.checkpoint ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence


def _set_cpu_devices(n: int) -> None:
    """Enough simulated CPU devices for the target mesh (harmless on GPU/TPU).

    Only possible before JAX starts its backend; when called from a running program, the
    devices it already has are used.
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass


def _inspect(args) -> int:
    from jaxpar.checkpoint.offline import format_inspect, inspect

    report = inspect(args.dir, step=args.step)
    print(json.dumps(report, indent=1) if args.json else format_inspect(report))
    return 0


def _load_config(spec: str):
    """A YAML/JSON config file, or a strategy file / checkpoint directory to copy the layout of."""
    import os

    from jaxpar.checkpoint.strategy import strategy_config
    from jaxpar.config import ParallelConfig

    if os.path.isdir(spec):
        from jaxpar.checkpoint.offline import load_strategy

        return strategy_config(load_strategy(spec))
    with open(spec) as f:
        text = f.read()
    if spec.endswith(".json"):
        d = json.loads(text)
        return strategy_config(d) if "leaves" in d else ParallelConfig.from_dict(d)
    return ParallelConfig.from_yaml(spec)


def _transform(args) -> int:
    from jaxpar.checkpoint.offline import transform

    config = _load_config(args.to)
    step = transform(args.dir, args.out, config, step=args.step)
    print(f"step {step} of {args.dir} -> {args.out} laid out on mesh {config.mesh}")
    return 0


def _merge(args) -> int:
    from jaxpar.checkpoint.offline import merge

    step = merge(args.dir, args.out, step=args.step)
    print(f"step {step} of {args.dir} -> {args.out} (unsharded: load {args.out}/{step}/state with "
          "orbax.checkpoint.StandardCheckpointer().restore)")
    return 0


def _devices_needed(args) -> int:
    if args.ckpt_devices:
        return args.ckpt_devices
    try:
        sizes = _load_config(args.to).mesh.values()
    except Exception:  # reported properly when the handler loads it again
        return 8
    return math.prod(sizes) if -1 not in sizes else 8


def add_ckpt_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``ckpt`` with ``inspect`` / ``transform`` / ``merge`` to a command's subparsers.

    Sets ``func=run_ckpt`` (returns the exit code), as the other ``jaxpar`` commands do.
    """
    p = subparsers.add_parser("ckpt", help="inspect, transform (reshard) or merge checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    q = sub.add_parser("inspect", help="tree, shapes, dtypes, strategies and sizes of a checkpoint")
    q.add_argument("dir")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = sub.add_parser("transform", help="rewrite a checkpoint in another layout (offline resharding)")
    q.add_argument("dir")
    q.add_argument("--to", required=True, metavar="CONFIG",
                   help="YAML/JSON ParallelConfig, a strategy JSON, or a checkpoint directory whose layout to copy")
    q.add_argument("out")
    q.add_argument("--devices", dest="ckpt_devices", type=int, default=None,
                   help="simulated CPU devices when no accelerator (default: the mesh size of CONFIG)")
    q = sub.add_parser("merge", help="one unsharded checkpoint that plain Flax/JAX code loads")
    q.add_argument("dir")
    q.add_argument("out")
    for name in ("inspect", "transform", "merge"):
        sub.choices[name].add_argument("--step", type=int, default=None, help="default: the newest complete step")
    p.set_defaults(func=run_ckpt)
    return p


def run_ckpt(args) -> int:
    """Run a parsed ``ckpt`` command; returns the exit code (1 with a message on a user error)."""
    if args.ckpt_command == "transform":
        _set_cpu_devices(_devices_needed(args))
    handler = {"inspect": _inspect, "transform": _transform, "merge": _merge}[args.ckpt_command]
    try:
        return handler(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"jaxpar ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpar")
    add_ckpt_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ckpt", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
