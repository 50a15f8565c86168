"""The rows a pipeline runs: which mesh axes split them, and how many each micro-batch gets.

Both pipelines (`jaxpar.pipeline.model` for a ``PipelineLoss``, `jaxpar.pipeline.stages` for a
``StagedLoss``) cut the batch they get into ``pipeline.microbatches`` micro-batches
(`jaxpar.data.BatchLayout.micro`). Each micro-batch keeps the batch's split over the mesh: the
axes that dimension 0 of the batch's ``PartitionSpec`` names (``dataset_strategy``, else the
batch axes), less the pipe axis. Both read it from the plan's `jaxpar.data.BatchLayout`
(``plan.batch_layout``), which the step hands them.
"""
from __future__ import annotations

import math
from typing import Any

import jax

from jaxpar.data.layout import BatchLayout
from jaxpar.strategy import spec_axes


def row_axes(layout: BatchLayout, batch: Any) -> tuple[str, ...]:
    """The mesh axes that split the rows of ``batch`` as it is placed (dimension 0 of its first
    leaf's spec, `jaxpar.data.BatchLayout.leaf_spec`), less the pipe axis: ``()`` when the batch
    is whole on every device (``dataset_strategy="full_batch"``)."""
    path, leaf = jax.tree_util.tree_flatten_with_path(batch)[0][0]
    key = getattr(path[0], "key", getattr(path[0], "name", None)) if path else None
    spec = layout.leaf_spec(tuple(leaf.shape), key)
    first = spec_axes(spec[0]) if len(spec) else ()
    return tuple(a for a in first if a != layout.pipe_axis)


def check_microbatch_rows(layout: BatchLayout, rows: int, axes: tuple[str, ...]) -> None:
    """The ``rows`` of the batch the pipeline runs cut into ``pipeline.microbatches`` equal
    micro-batches, each split over the mesh ``axes`` that split the batch's rows (`row_axes`)
    as the unpipelined step splits its batch: a micro-batch of fewer rows than those axes have
    devices (or not a multiple of them) would be replicated or resharded, dropping data
    parallelism silently. A training step runs its global batch / (``grad_accum`` ×
    ``interleave``) at a time, an evaluation its whole batch. Checked when the pipeline loss is
    traced (the first step), where the batch size is first known, as ``grad_accum``'s parts are."""
    m, parts = layout.microbatches, dict(layout.parts)
    k, n = parts.get("grad_accum", 1), parts.get("interleave", 1)
    split = " × ".join(f"{name}={v}" for name, v in parts.items())
    step = (f" (in a training step, its global batch of {rows * k * n} / ({split}); in an evaluation, "
            "its whole batch)") if parts else ""
    if rows % m:
        raise ValueError(
            f"the batch of {rows} rows the pipeline runs{step} is not divisible by pipeline.microbatches={m}; "
            f"use {_batches(m, k, n)}")
    sizes = layout.mesh
    d = math.prod(sizes[a] for a in axes)
    if (rows // m) % d == 0:
        return
    fixes = [_batches(m, k, n, d)]
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


def _batches(m: int, k: int, n: int, d: int = 1) -> str:
    """The batch sizes that fit ``m`` micro-batches of a multiple of ``d`` rows each."""
    rows = f" × {d}" if d > 1 else ""
    if k * n == 1:
        return f"a batch that is a multiple of {m * d} (pipeline.microbatches{rows})"
    return (f"a training batch that is a multiple of {m * k * n * d} (pipeline.microbatches × grad_accum × "
            f"interleave{rows}) and an evaluation batch that is a multiple of {m * d}")
