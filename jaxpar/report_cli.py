"""``jaxpar report --model llama --size NAME``: a Llama model's FLOPs, memory per device and MFU.

Wiring (in ``jaxpar/cli.py``, which imports this module, never the other way)::

    add_model_report_arguments(p)            # on the "report" sub-parser
    # in cmd_report: if args.model == "llama": return run_llama_report(args, ...)

The report is planned from mesh *sizes*, so ``--mesh data=8,model=8`` works on a machine with
8 (or 1) devices: nothing is allocated. The step is compiled too (its ``memory_analysis()``
printed beside the estimate) when the mesh fits the devices at hand and the model is small.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from jaxpar.plan_cli import number

if TYPE_CHECKING:
    import optax

    from jaxpar.config import ParallelConfig
    from jaxpar.models.llama_config import LlamaConfig
    from jaxpar.report import MemoryReport

MODELS = ("gpt", "llama")
COMPILE_MAX_PARAMS = 20_000_000     # above this, building the model for a compile costs too much memory
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


def check_model_report_flags(args, refuse) -> None:
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


def _mesh_sizes(config, devices) -> dict[str, int]:
    from jaxpar.mesh import resolve_axes

    if -1 in config.mesh.values():
        return resolve_axes(config.mesh, len(devices))
    return dict(config.mesh)


def compiled_llama_memory(model: LlamaConfig | str, config: ParallelConfig, *, batch: int,
                          seq_len: int | None = None, tx: optax.GradientTransformation | None = None) -> MemoryReport:
    """``memory_analysis()`` of the Llama training step compiled on the first devices.

    Builds the model (sharded), so keep it for models that fit: the report's estimate needs no
    devices at all.

    >>> compiled_llama_memory("tiny", jaxpar.ParallelConfig(mesh={"data": 2}), batch=4).argument_bytes  # doctest: +SKIP
    """
    import numpy as np
    from flax import nnx

    from jaxpar.models.llama import Llama, loss_fn
    from jaxpar.models.llama_report import DEFAULT_TX, llama_config
    from jaxpar.report import memory
    from jaxpar.train import compile_step

    cfg = llama_config(model)
    seq = cfg.max_seq_len if seq_len is None else seq_len
    tokens = np.zeros((batch, seq), np.int32)
    compiled = compile_step(lambda: Llama(cfg, rngs=nnx.Rngs(0)), loss_fn, {"inputs": tokens, "targets": tokens},
                            config, tx or DEFAULT_TX)
    return memory(compiled)


def _compile(cfg, config, sizes, devices, batch, seq_len) -> tuple:
    """(compiled memory or None, why not)."""
    from jaxpar.models.llama_config import param_count

    n = math.prod(sizes.values())
    if n > len(devices):
        return None, (f"not compiled: the mesh has {n} devices and this machine {len(devices)}; the estimate "
                      "needs none")
    if param_count(cfg) > COMPILE_MAX_PARAMS:
        return None, (f"not compiled: {param_count(cfg):,} parameters is more than {COMPILE_MAX_PARAMS:,} to "
                      "build here; the estimate needs no devices")
    return compiled_llama_memory(cfg, config, batch=batch, seq_len=seq_len), "compiled"


def run_llama_report(args, devices, config, batch: int, print_text) -> int:
    """Print the Llama report for the flags (``--json``: the JSON document alone on stdout)."""
    import dataclasses

    from jaxpar.models.llama_report import llama_config, llama_report

    cfg = llama_config(args.size or "tiny")
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    seq = args.seq_len or cfg.max_seq_len
    sizes = _mesh_sizes(config, devices)
    compiled, note = _compile(cfg, config, sizes, devices, batch, seq)
    report = llama_report(cfg, config, mesh=sizes, batch=batch, seq_len=seq, step_time_s=args.step_time,
                          peak_flops=args.peak_flops, device_kind=devices[0].device_kind, backend=args.backend,
                          compiled=compiled, compiled_note=note)
    report = dataclasses.replace(report, name=args.size or "tiny")
    print_text(report.format(), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print_text(json.dumps(report.summary(), indent=2))
    return 0
