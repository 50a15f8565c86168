"""The rows a pipeline runs: how many each micro-batch gets, checked against the batch axes.

Both pipelines (`jaxpar.pipeline.model` for a ``PipelineLoss``, `jaxpar.pipeline.stages` for a
``StagedLoss``) cut the batch they get into ``pipeline.microbatches`` micro-batches.
"""
from __future__ import annotations

import math

from jaxpar.config import ParallelConfig
from jaxpar.data import batch_axes
from jaxpar.strategy import mesh_sizes


def check_microbatch_rows(config: ParallelConfig, mesh, rows: int) -> None:
    """The ``rows`` of the batch the pipeline runs (in a training step: the global batch /
    (``grad_accum`` × ``interleave``)) cut into ``pipeline.microbatches`` equal micro-batches,
    each split over the batch axes as the unpipelined step splits its batch: a micro-batch of
    fewer rows than those axes have devices (or not a multiple of them) would be replicated
    or resharded, dropping data parallelism silently. Checked when the pipeline loss is traced
    (the first step), where the batch size is first known, as ``grad_accum``'s parts are."""
    pipe = config.pipeline
    m, k, n = pipe.microbatches, config.grad_accum, config.interleave
    parts = {name: v for name, v in (("grad_accum", k), ("interleave", n)) if v > 1}
    split = " × ".join(f"{name}={v}" for name, v in parts.items())
    step = f" (in a training step: the global batch / ({split}), a global batch of {rows * k * n})" if parts else ""
    if rows % m:
        raise ValueError(
            f"the batch of {rows} rows the pipeline runs{step} is not divisible by pipeline.microbatches={m}; "
            f"use a global batch that is a multiple of {m * k * n} (pipeline.microbatches × grad_accum × "
            "interleave)")
    sizes = mesh_sizes(mesh)
    axes = tuple(a for a in batch_axes(config, mesh) if a != pipe.axis)
    d = math.prod(sizes[a] for a in axes)
    if (rows // m) % d == 0:
        return
    fixes = [f"a global batch that is a multiple of {m * k * n * d} (pipeline.microbatches × grad_accum × "
             f"interleave × {d})"]
    if rows % d == 0:
        fixes.append(f"at most {rows // d} micro-batches (pipeline.microbatches a divisor of {rows // d})")
    if parts:
        fixes.append(f"a smaller {' / '.join(parts)}")
    per = rows // m
    raise ValueError(
        f"pipeline.microbatches={m} cuts the batch of {rows} rows the pipeline runs{step} into micro-batches "
        f"of {per} row{'s' if per != 1 else ''}, but each micro-batch is split over the batch axes "
        f"{dict((a, sizes[a]) for a in axes)}, {d} devices: its rows must be a multiple of {d}, or the devices "
        "of the batch axes would share rows and data parallelism would be lost without an error (as grad_accum "
        f"refuses parts smaller than the batch axes). Use {', or '.join(fixes)}")
