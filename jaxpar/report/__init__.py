"""Reading a compiled step: what it communicates, how much memory and how many FLOPs.

Everything here takes a ``jax.stages.Compiled`` (``jax.jit(f, ...).lower(...).compile()``),
i.e. the program after XLA has chosen its collectives and buffers:

- `collectives` / `collective_summary`: every collective with its kind, bytes, device groups
  and mesh axes, parsed from the optimized HLO;
- `memory`: per-device argument, output, temp and aliased bytes;
- `flops` / `mfu`: XLA's FLOP count and model FLOPs utilisation;
- `peak_flops` / `throughput`: peak FLOP/s per device kind and dtype, tokens/s/device and MFU;
- `estimate_memory`: params / grads / optimizer state bytes per device from a `TrainPlan`;
(`jaxpar.models.llama_report.llama_report` builds a Llama model's whole report from these.)
- `format_collectives` / `format_memory`: the same as plain-text tables.

Example:
  >>> compiled = jax.jit(step, in_shardings=..., out_shardings=...).lower(*args).compile()  # doctest: +SKIP
  >>> print(format_collectives(collectives(compiled, mesh)))                               # doctest: +SKIP
  >>> print(format_memory(memory(compiled)))                                               # doctest: +SKIP
"""
from jaxpar.report.collectives import KINDS, Collective, collective_summary, collectives
from jaxpar.report.estimate import MemoryEstimate, estimate_memory
from jaxpar.report.flops import flops, mfu
from jaxpar.report.memory import MemoryReport, memory
from jaxpar.report.peaks import peak_flops, peak_table
from jaxpar.report.pipeline import format_schedule, schedule_of
from jaxpar.report.step import StepReport, param_table, step_report
from jaxpar.report.table import format_bytes, format_collectives, format_memory
from jaxpar.report.throughput import Throughput, throughput

__all__ = [
    # collectives
    "KINDS",
    "Collective",
    "collectives",
    "collective_summary",
    # memory
    "MemoryReport",
    "memory",
    # compute
    "flops",
    "mfu",
    "peak_flops",
    "peak_table",
    "Throughput",
    "throughput",
    # analytic, from shapes and a plan
    "MemoryEstimate",
    "estimate_memory",
    # pipeline
    "format_schedule",
    "schedule_of",
    # whole step
    "StepReport",
    "param_table",
    "step_report",
    # text
    "format_bytes",
    "format_collectives",
    "format_memory",
]
