"""``check_batch``: the job's global batch (``data.batch``) against the ways a run cuts it,
before anything is built.

Three things cut the global batch: the processes (each reads its own block of rows from a
token store, `jaxpar.distributed.process_rows`), the step (``parallel.grad_accum`` ×
``parallel.interleave``, and ``parallel.pipeline.microbatches`` with pipeline stages, cut it
into equal parts) and the mesh (each part is split over the devices of the batch axes). The
batch must be a multiple of every cut at once; a job that is not would be refused only at the
first step, naming a leaf's shape instead of ``data.batch``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jaxpar.job.config import JobConfig


def batch_devices(job: JobConfig, mesh) -> tuple[tuple[str, ...], int] | None:
    """``(batch axes, their device count)`` each part of the batch is split over, or None where
    the step decides it later (``mode: auto``, or a ``dataset_strategy`` that names its split)."""
    from jaxpar.data import batch_axes
    from jaxpar.strategy.resolve import mesh_sizes

    config = job.parallel
    if config.mode == "auto" or config.dataset_strategy not in (None, "full_batch"):
        return None
    if config.dataset_strategy == "full_batch":
        return (), 1
    axes = batch_axes(config, mesh)
    sizes = mesh_sizes(mesh)
    return axes, math.prod(sizes[a] for a in axes)


def check_batch(job: JobConfig, mesh, *, process_count: int | None = None,
                names: Mapping[str, str] | None = None) -> None:
    """Refuse a ``data.batch`` that the processes, the step's parts and the batch axes of
    ``mesh`` (a ``Mesh`` or ``{axis: size}``) cannot all split evenly; the ``ValueError`` names the job fields (or ``names``:
    field -> the flag that sets it), each cut, and the nearest batches that fit.

    >>> job = JobConfig.from_dict({"data": {"batch": 12}, "parallel": {"mesh": {"data": 8}}})
    >>> check_batch(job, {"data": 8}, process_count=1)
    Traceback (most recent call last):
    ...
    ValueError: job config data.batch=12 does not split: each step splits it over the batch axes ('data',) \
(8 devices), so the global batch must be a multiple of 8; give --data.batch 16 (or 8)
    """
    import jax

    config = job.parallel
    flag = (lambda field: names.get(field, field)) if names else (lambda field: f"--{field}")

    def given(field: str, value: int) -> str:
        return f"{names[field]} {value}" if names and field in names else f"{field}={value}"

    batch = job.data.batch
    # generated data: every process makes the whole batch and keeps its devices' rows
    processes = (jax.process_count() if process_count is None else process_count) if job.data.source == "store" else 1
    parts = {field: value for field, value in (("parallel.grad_accum", config.grad_accum),
                                               ("parallel.interleave", config.interleave)) if value > 1}
    if config.pipeline.stages > 1 and config.pipeline.microbatches > 1:
        parts["parallel.pipeline.microbatches"] = config.pipeline.microbatches
    split = batch_devices(job, mesh)
    devices = split[1] if split else 1
    per_step = devices * math.prod(parts.values())
    need = math.lcm(processes, per_step)
    if batch % need == 0:
        return
    cuts = []
    if processes > 1:
        cuts.append(f"each of the {processes} processes reads its own block of rows")
    cut_parts = " x ".join(given(field, value) for field, value in parts.items())
    over = f"the batch axes {split[0]} ({devices} devices)" if split and devices > 1 else None
    if parts:
        cuts.append(f"each step cuts it into {math.prod(parts.values())} parts ({cut_parts})"
                    + (f" and splits each part over {over}" if over else ""))
    elif over:
        cuts.append(f"each step splits it over {over}")
    factors = [str(n) for n in ([devices] if devices > 1 else []) + list(parts.values())]
    why = f" = {' x '.join(factors)}" if len(factors) > 1 else ""
    if processes > 1 and need not in (processes, per_step):
        why = f" = lcm({processes} processes, {per_step}{why})"
    up, down = (batch // need + 1) * need, batch // need * need
    fix = f"give {flag('data.batch')} {up}" + (f" (or {down})" if down else "")
    if parts:
        fix += f", or a smaller {' or '.join(flag(field) for field in parts)}"
    head = given("data.batch", batch) if names else f"job config data.batch={batch}"
    raise ValueError(f"{head} does not split: {', and '.join(cuts)}, so the global batch must be a multiple of "
                     f"{need}{why}; {fix}")
