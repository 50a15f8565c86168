"""``jaxpar ckpt``: inspect, transform and merge checkpoints offline.

    jaxpar ckpt inspect DIR [--step N] [--json]
    jaxpar ckpt transform DIR --to CONFIG.yaml OUT [--step N] [--devices N]
    jaxpar ckpt merge DIR OUT [--step N]
    jaxpar ckpt import-hf HF_DIR --out DIR [--to CONFIG.yaml] [--devices N] [--dtype D] [--scan-layers] [--force]
    jaxpar ckpt export-hf DIR --out HF_DIR [--step N] [--dtype D] [--max-shard-size 5GB] [--hf-config FILE] [--force]

A mistake in the paths or files given is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator

from jaxpar.cli.common import UserError, set_simulated_devices

# A user's mistake in the paths or files given: one line and exit code 2, no traceback.
USER_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
               ValueError)


def _inspect(args) -> int:
    from jaxpar.checkpoint.offline import format_inspect, inspect

    report = inspect(args.dir, step=args.step)
    print(json.dumps(report, indent=1) if args.json else format_inspect(report))
    return 0


TO_ACCEPTS = ("a YAML/JSON ParallelConfig file such as 'mesh: {data: 2, model: 4}', a job file (its parallel "
              "section is used), a strategy JSON, or a checkpoint directory whose layout to copy")


def _job_parallel(spec: str, d: dict):
    """The ``ParallelConfig`` of a job file's ``parallel`` section (the job's default without one)."""
    from jaxpar.config import ParallelConfig

    section = d.get("parallel") or {}
    if not isinstance(section, dict):
        raise ValueError(f"--to {spec!r} is a job file whose parallel section holds a {type(section).__name__}, "
                         "not a mapping of ParallelConfig fields such as 'mesh: {data: 2, model: 4}'")
    try:
        return ParallelConfig.from_dict(section)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--to {spec!r} is a job file; its parallel section (the layout --to takes from it): "
                         f"{e}") from None


def _load_config(spec: str):
    """A YAML/JSON config file (a job file: its ``parallel`` section), or a strategy file /
    checkpoint directory to copy the layout of."""
    from jaxpar.checkpoint.strategy import strategy_config
    from jaxpar.cli.jobfile import JOB_ONLY
    from jaxpar.config import ParallelConfig

    if os.path.isdir(spec):
        from jaxpar.checkpoint.offline import load_strategy

        return strategy_config(load_strategy(spec))
    if not os.path.exists(spec):
        raise FileNotFoundError(f"--to {spec!r}: no such file or directory; give {TO_ACCEPTS}")
    import yaml

    from jaxpar.yaml_files import UniqueKeyLoader

    try:
        with open(spec) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--to {spec!r} cannot be read as text ({e}); give {TO_ACCEPTS}") from None
    try:
        # UniqueKeyLoader: a key given twice is refused, not the last one kept
        d = json.loads(text) if spec.endswith(".json") else yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as e:      # RecursionError: nested too deep
        problem = " ".join(str(getattr(e, "problem", None) or e or type(e).__name__).split())
        raise ValueError(f"--to {spec!r} is not valid {'JSON' if spec.endswith('.json') else 'YAML'} "
                         f"({problem}); give "
                         "a ParallelConfig file such as 'mesh: {data: 2, model: 4}'") from None
    if not isinstance(d, dict):
        raise ValueError(f"--to {spec!r} holds a {type(d).__name__}, not a mapping of ParallelConfig fields such as "
                         "'mesh: {data: 2, model: 4}'")
    if "leaves" in d:
        return strategy_config(d)
    if any(k in d for k in JOB_ONLY):
        return _job_parallel(spec, d)
    return ParallelConfig.from_dict(d)


def _target_devices(count: int | None):
    """The first ``--devices`` devices (None: let ``transform`` take the first that fit the mesh)."""
    if count is None:
        return None
    import jax

    devices = jax.devices()
    if count > len(devices):
        raise ValueError(f"--devices {count}: only {len(devices)} {devices[0].platform} devices are available (JAX "
                         f"was already started in this process, or this machine has no more); use --devices "
                         f"{len(devices)} or fewer")
    return devices[:count]


def _mesh_text(config, devices) -> str:
    """The mesh of ``config`` as laid out: a ``-1`` axis given its size on ``devices`` (default all)."""
    sizes = dict(config.mesh)
    if -1 in sizes.values():
        import jax

        count = len(devices if devices is not None else jax.devices())
        rest = math.prod(v for v in sizes.values() if v != -1)
        sizes = {k: (count // rest if v == -1 else v) for k, v in sizes.items()}
    return str(sizes)


def _transform(args) -> int:
    from jaxpar.checkpoint.offline import transform

    config = _load_config(args.to)
    devices = _target_devices(args.ckpt_devices)
    step = transform(args.dir, args.out, config, step=args.step, devices=devices)
    print(f"step {step} of {args.dir} -> {args.out} laid out on mesh {_mesh_text(config, devices)}")
    return 0


def _merge(args) -> int:
    from jaxpar.checkpoint.offline import merge

    step = merge(args.dir, args.out, step=args.step)
    print(f"step {step} of {args.dir} -> {args.out} (unsharded: load {args.out}/{step}/state with "
          "orbax.checkpoint.StandardCheckpointer().restore)")
    return 0


def _import_hf(args) -> int:
    from jaxpar.config import ParallelConfig
    from jaxpar.interop.hf import import_hf

    # no --to: every parameter replicated on the --devices devices (one without it)
    config = ParallelConfig(mesh={"data": args.ckpt_devices or 1}, mode="data") if args.to is None \
        else _load_config(args.to)
    devices = _target_devices(args.ckpt_devices)
    cfg, _ = import_hf(args.dir, args.out, config=config, devices=devices, dtype=args.dtype,
                       scan_layers=args.scan_layers, force=args.force)
    print(f"{args.dir} -> {args.out} step 0 ({cfg.layers} layers, {cfg.param_dtype}) laid out on mesh "
          f"{_mesh_text(config, devices)}")
    return 0


def _export_hf(args) -> int:
    from jaxpar.interop.hf import export_hf

    cfg = base = None
    if args.hf_config is not None:
        from jaxpar.interop.hf_files import read_config
        from jaxpar.interop.hf_layout import llama_config

        if not os.path.exists(args.hf_config):
            raise FileNotFoundError(f"--hf-config {args.hf_config}: no such file; give the model's HF config.json "
                                    "(or the folder holding it)")
        base = read_config(args.hf_config)
        cfg = llama_config(base, where=args.hf_config)
    written = export_hf(args.dir, cfg, args.out, max_shard_bytes=args.max_shard_size, dtype=args.dtype,
                        step=args.step, hf_base=base, force=args.force)
    print(f"{args.dir} -> {args.out}: {', '.join(written)}")
    return 0


def _devices_needed(args) -> int:
    if args.ckpt_devices:
        return args.ckpt_devices
    if args.to is None:
        return 1
    if os.path.isdir(args.to):
        return _saved_devices(args.to)
    try:
        sizes = _load_config(args.to).mesh.values()
    except Exception:  # reported properly when the handler loads it again
        return 8
    return math.prod(sizes) if -1 not in sizes else 8


def _saved_devices(directory: str) -> int:
    """The device count in the newest step's strategy file of ``directory``, read as plain JSON:
    opening it with orbax would start JAX before the simulated devices are asked for."""
    try:
        steps = [int(n) for n in os.listdir(directory)
                 if n.isdigit() and os.path.isfile(os.path.join(directory, n, "strategy", "metadata"))]
        with open(os.path.join(directory, str(max(steps)), "strategy", "metadata")) as f:
            return int(json.load(f)["mesh"]["devices"])
    except Exception:  # reported properly when the handler loads it again
        return 8


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``ckpt`` with ``inspect`` / ``transform`` / ``merge`` / ``import-hf`` / ``export-hf``."""
    p = subparsers.add_parser("ckpt", help="inspect, transform (reshard) or merge checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    q = sub.add_parser("inspect", help="tree, shapes, dtypes, strategies and sizes of a checkpoint")
    q.add_argument("dir")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = sub.add_parser("transform", help="rewrite a checkpoint in another layout (offline resharding)")
    q.add_argument("dir")
    q.add_argument("--to", required=True, metavar="CONFIG",
                   help="YAML/JSON ParallelConfig, a job file (its parallel section), a strategy JSON, or a "
                        "checkpoint directory whose layout to copy")
    q.add_argument("out")
    q.add_argument("--devices", dest="ckpt_devices", type=_count("--devices", 1), default=None,
                   help="lay the checkpoint out on the first N devices; without an accelerator, N simulated CPU "
                        "devices (default: the mesh size of CONFIG)")
    q = sub.add_parser("merge", help="one unsharded checkpoint that plain Flax/JAX code loads")
    q.add_argument("dir")
    q.add_argument("out")
    _add_hf_parsers(sub)
    for name in ("inspect", "transform", "merge", "export-hf"):
        sub.choices[name].add_argument("--step", type=_count("--step", 0), default=None,
                                       help="default: the newest complete step")
    for name, q in sub.choices.items():
        q.set_defaults(cli_name=f"ckpt {name}")     # errors begin 'jaxpar ckpt inspect: error:'
    p.set_defaults(func=run_ckpt)
    return p


def _add_hf_parsers(sub) -> None:
    q = sub.add_parser("import-hf", help="a Hugging Face Llama directory (safetensors) into a jaxpar checkpoint")
    q.add_argument("dir", help="holds config.json and model.safetensors or model.safetensors.index.json")
    q.add_argument("--out", required=True, help="the checkpoint directory to write (step 0, parameters only)")
    q.add_argument("--to", metavar="CONFIG", default=None,
                   help="YAML/JSON ParallelConfig, a job file (its parallel section), a strategy JSON, or a "
                        "checkpoint directory whose layout to use (default: every parameter replicated on the "
                        "--devices devices, one without it)")
    q.add_argument("--devices", dest="ckpt_devices", type=_count("--devices", 1), default=None,
                   help="lay the checkpoint out on the first N devices (default: the mesh size of CONFIG)")
    q.add_argument("--scan-layers", action="store_true", help="stack the blocks on a 'layers' axis")
    q = sub.add_parser("export-hf", help="a jaxpar checkpoint of a Llama into a Hugging Face directory")
    q.add_argument("dir")
    q.add_argument("--out", required=True, help="the directory to write config.json and safetensors into")
    q.add_argument("--max-shard-size", type=_size, default=5 * 2**30, metavar="SIZE",
                   help="largest safetensors file, e.g. 5GB, 500MB or bytes (default 5GB); larger models "
                        "are split with model.safetensors.index.json")
    q.add_argument("--hf-config", default=None, metavar="FILE",
                   help="the HF config.json of the model (default: written from the model config recorded "
                        "with the checkpoint: import-hf's, or the job.yaml a training job saved beside it; a "
                        "given FILE is checked against that record)")
    for name in ("import-hf", "export-hf"):
        sub.choices[name].add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                                       help="convert the weights (default: keep the stored dtype)")
    sub.choices["import-hf"].add_argument("--force", action="store_true",
                                          help="replace the step 0 that --out already holds (a folder holding "
                                               "later steps, a run's, is refused even so)")
    sub.choices["export-hf"].add_argument("--force", action="store_true",
                                          help="replace the HF model files (config.json, safetensors, index) "
                                               "that --out already holds; other files are kept")


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    """An argparse ``type=``: bytes as an integer or with a unit (5GB, 500MB, 64KiB; powers of 1024)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    value = int(float(match[1]) * _UNITS[match[2]]) if match else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, "
                                         "500MB or a number of bytes")
    return value


def _count(flag: str, low: int):
    """An argparse ``type=``: an integer ``>= low``, refused with the value and the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not an integer; expected an integer >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} {text}: out of range; expected an integer >= {low}")
        return value

    return parse


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Hide absl's INFO/WARNING lines (orbax logs its read-only options on every open) for one command."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_ckpt(args) -> int:
    """Run a parsed ``ckpt`` command; a user's mistake raises `UserError` (one line, exit 2)."""
    if args.ckpt_command in ("transform", "import-hf"):
        set_simulated_devices(_devices_needed(args))
    handler = {"inspect": _inspect, "transform": _transform, "merge": _merge, "import-hf": _import_hf,
               "export-hf": _export_hf}[args.ckpt_command]
    try:
        with _quiet_absl():
            return handler(args)
    except (*USER_ERRORS, ImportError) as e:    # ImportError: the [hf] extra is missing; it says so
        raise UserError(str(e)) from e
