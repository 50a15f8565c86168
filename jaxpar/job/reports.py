"""``jaxpar report --model llama``: a Llama model's FLOPs, memory per device and MFU, planned
from mesh *sizes* (``data=8,model=8`` works on a machine with 8 or 1 devices: nothing is
allocated), with the compiled step's ``memory_analysis()`` beside the estimate when the mesh
fits the devices at hand and the model is small enough to build.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optax

    from jaxpar.config import ParallelConfig
    from jaxpar.models.llama_config import LlamaConfig
    from jaxpar.report import MemoryReport

COMPILE_MAX_PARAMS = 20_000_000     # above this, building the model for a compile costs too much memory


def mesh_sizes(config: ParallelConfig, devices) -> dict[str, int]:
    """The config's mesh sizes, an axis of -1 taking the rest of ``devices``."""
    from jaxpar.mesh import resolve_axes

    if -1 in config.mesh.values():
        return resolve_axes(config.mesh, len(devices))
    return dict(config.mesh)


def compiled_llama_memory(model: LlamaConfig | str, config: ParallelConfig, *, batch: int,
                          seq_len: int | None = None, tx: optax.GradientTransformation | None = None) -> MemoryReport:
    """``memory_analysis()`` of the Llama training step compiled on the first devices.

    Builds the model (sharded), so keep it for models that fit: the report's estimate needs no
    devices at all. The model gets the activation constraint ``jaxpar train`` gives it
    (``jaxpar.nn.model_constraint``: with a ``context`` section a ``ContextParallel``), so the
    step compiled here is the one training runs.

    >>> compiled_llama_memory("tiny", jaxpar.ParallelConfig(mesh={"data": 2}), batch=4).argument_bytes  # doctest: +SKIP
    """
    import jax
    import numpy as np
    from flax import nnx

    from jaxpar.mesh import make_mesh
    from jaxpar.models.llama import Llama
    from jaxpar.models.llama_parallel import training_loss
    from jaxpar.models.llama_report import DEFAULT_TX, llama_config
    from jaxpar.nn import model_constraint
    from jaxpar.report import memory
    from jaxpar.train import compile_step

    cfg = llama_config(model)
    seq = cfg.max_seq_len if seq_len is None else seq_len
    tokens = np.zeros((batch, seq), np.int32)
    # the mesh compile_step makes (the first devices): a mesh of the same devices and axes is equal
    constrain = model_constraint(make_mesh(config, devices=jax.devices()[:math.prod(config.mesh.values())]), config)
    compiled = compile_step(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain), training_loss(config),
                            {"inputs": tokens, "targets": tokens}, config, tx or DEFAULT_TX)
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


def llama_size_report(size: str, config: ParallelConfig, devices, batch: int, *, dtype: str | None = None,
                      seq_len: int | None = None, step_time: float | None = None, peak_flops: float | None = None,
                      backend: str | None = None):
    """The `jaxpar.models.llama_report.llama_report` of the named Llama ``size`` under ``config``
    on ``devices`` (``seq_len`` default: the model's ``max_seq_len``)."""
    from jaxpar.models.llama_report import ReportRequest, llama_config, llama_report

    cfg = llama_config(size)
    if dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    seq = seq_len or cfg.max_seq_len
    sizes = mesh_sizes(config, devices)
    compiled, note = _compile(cfg, config, sizes, devices, batch, seq)
    report = llama_report(cfg, config, ReportRequest(
        mesh=sizes, batch=batch, seq_len=seq, step_time_s=step_time, peak_flops=peak_flops,
        device_kind=devices[0].device_kind, backend=backend, compiled=compiled, compiled_note=note))
    return dataclasses.replace(report, name=size)
