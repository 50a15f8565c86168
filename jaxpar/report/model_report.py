"""``llama_report``: a Llama model's FLOPs, memory per device and MFU under a parallel config.

Everything comes from abstract shapes (``nnx.eval_shape``) and a `TrainPlan` made from mesh
*sizes*, so a report for ``llama3_8b`` on 64 devices runs on a laptop without allocating a
parameter. A compiled step's ``memory_analysis()`` is added when the caller compiled one
(`compiled_llama_memory`, for models small enough to build on the devices at hand).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import optax
from rich import box
from rich.console import Console
from rich.table import Table

from jaxpar.config import ParallelConfig
from jaxpar.models.llama_config import LlamaConfig, describe
from jaxpar.report.estimate import estimate_memory
from jaxpar.report.llama import ModelReport, llama_activation_bytes, llama_flops_per_token
from jaxpar.report.memory import MemoryReport, memory
from jaxpar.report.table import format_bytes, format_memory
from jaxpar.report.throughput import throughput

DEFAULT_TX = optax.adamw(1e-3)


def llama_config(model: LlamaConfig | str) -> LlamaConfig:
    """``model`` itself, or the named size with stacked (scanned) layers.

    >>> llama_config("tiny").scan_layers
    True
    """
    if isinstance(model, LlamaConfig):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a LlamaConfig or a size name such as 'llama3_8b', got "
                        f"{type(model).__name__} {model!r}")
    return LlamaConfig.named(model, scan_layers=True)


def _sizes(config: ParallelConfig, mesh: Mapping[str, int] | None) -> dict[str, int]:
    sizes = dict(config.mesh if mesh is None else mesh)
    if any(v == -1 for v in sizes.values()) or set(sizes) != set(config.mesh):
        raise ValueError(f"llama_report: mesh={sizes} must give a size to every axis of the config's mesh "
                         f"{dict(config.mesh)} (no -1: the report plans devices it may not have); "
                         f"e.g. mesh={{{', '.join(repr(a) + ': 8' for a in config.mesh)}}}")
    return sizes


def _plan(cfg: LlamaConfig, config: ParallelConfig, sizes: dict[str, int], tx):
    from flax import nnx

    from jaxpar.models.llama import Llama
    from jaxpar.nn import abstract_model
    from jaxpar.plan.train_plan import make_train_plan

    abstract = abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return make_train_plan(config, sizes, abstract, tx)


def llama_report(model: LlamaConfig | str, config: ParallelConfig, *, batch: int, seq_len: int | None = None,
                 mesh: Mapping[str, int] | None = None, tx: optax.GradientTransformation | None = None,
                 step_time_s: float | None = None, peak_flops: float | None = None,
                 device_kind: str | None = None, backend: str | None = None, param_dtype=None,
                 grad_dtype=None, opt_state_dtype=None, compute_dtype=None,
                 compiled: MemoryReport | None = None, compiled_note: str = "not compiled") -> ModelReport:
    """The `ModelReport` of a Llama model trained under ``config``, from shapes alone.

    Args:
      model: a ``LlamaConfig`` or a size name (``"tiny"``, ``"125m"``, ``"1b"``, ``"llama3_8b"``,
        ``"llama3_70b"``; named sizes use scanned layers).
      config: the ``ParallelConfig`` (mesh axes, rules, ZeRO level, recompute).
      batch: global batch (sequences per step).
      seq_len: tokens per sequence (default ``max_seq_len`` of the model).
      mesh: axis sizes to plan for (default ``config.mesh``); need not match the local devices.
      tx: the optax optimizer (default ``optax.adamw``): its real state structure is counted.
      step_time_s: a measured step time, for tokens/s/device and MFU.
      peak_flops: peak FLOP/s of one device, instead of the table for ``device_kind``.
      device_kind: the device for the peak table (default ``jax.devices()[0].device_kind``).
      backend: ``"gpu"`` / ``"tpu"`` / ``"cpu"`` for the attention choice (default JAX's).
      param_dtype, grad_dtype, opt_state_dtype: storage dtypes (default: the parameters' own).
      compute_dtype: activation dtype (default the model's ``dtype``).
      compiled, compiled_note: a compiled step's memory, or why there is none.

    Raises:
      ValueError: an unknown size, a non-positive batch / seq_len / peak, a mesh with ``-1``.

    Example:
      >>> import jaxpar
      >>> config = jaxpar.ParallelConfig(mesh={"data": 2}, optimizer={"level": 1})
      >>> r = llama_report("tiny", config, batch=4, step_time_s=0.01, device_kind="cpu")
      >>> r.attention, r.throughput.mfu_text
      ('xla', 'n/a (no peak for CPU)')
    """
    import jax

    from jaxpar.models.llama import attention_implementation

    cfg = llama_config(model)
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"llama_report: config must be a jaxpar.ParallelConfig, got {type(config).__name__}")
    seq = cfg.max_seq_len if seq_len is None else seq_len
    flops = llama_flops_per_token(cfg, seq)
    sizes = _sizes(config, mesh)
    tx = DEFAULT_TX if tx is None else tx
    plan = _plan(cfg, config, sizes, tx)
    backend = backend or jax.default_backend()
    dtype = compute_dtype or cfg.dtype
    attention = attention_implementation(cfg.attention, dtype, backend)
    activations = llama_activation_bytes(cfg, plan, batch=batch, seq_len=seq, compute_dtype=dtype,
                                         attention=attention)
    est = estimate_memory(plan, tx, param_dtype=param_dtype, grad_dtype=grad_dtype,
                          opt_state_dtype=opt_state_dtype, activations=activations)
    speed = None
    if step_time_s is not None:
        speed = throughput(flops_per_token=flops.total, tokens_per_step=batch * seq, step_time_s=step_time_s,
                           num_devices=math.prod(sizes.values()), device_kind=device_kind, dtype=dtype,
                           peak_flops=peak_flops)
    elif peak_flops is not None:
        from jaxpar.report.peaks import check_peak

        check_peak(peak_flops)
    name = model if isinstance(model, str) else "custom"
    return ModelReport(name=name, description=describe(cfg), mesh=sizes, zero_level=plan.zero_level, batch=batch,
                       seq_len=seq, attention=attention, attention_setting=cfg.attention, backend=backend,
                       remat=cfg.remat if cfg.remat != "none" else plan.remat, flops=flops, memory=est,
                       compiled=compiled, compiled_note="compiled" if compiled is not None else compiled_note,
                       throughput=speed)


def compiled_llama_memory(model: LlamaConfig | str, config: ParallelConfig, *, batch: int,
                          seq_len: int | None = None, tx: optax.GradientTransformation | None = None) -> MemoryReport:
    """``memory_analysis()`` of the Llama training step compiled on the first devices.

    Builds the model (sharded), so keep it for models that fit: the report's estimate needs no
    devices at all.

    >>> compiled_llama_memory("tiny", jaxpar.ParallelConfig(mesh={"data": 2}), batch=4)  # doctest: +SKIP
    """
    import numpy as np
    from flax import nnx

    from jaxpar.models.llama import Llama, loss_fn
    from jaxpar.train.trainer import compile_step

    cfg = llama_config(model)
    seq = cfg.max_seq_len if seq_len is None else seq_len
    tokens = np.zeros((batch, seq), np.int32)
    compiled = compile_step(lambda: Llama(cfg, rngs=nnx.Rngs(0)), loss_fn, {"inputs": tokens, "targets": tokens},
                            config, tx or DEFAULT_TX)
    return memory(compiled)


# ----------------------------------------------------------------------------- text

def _table(title: str, *columns: str) -> Table:
    t = Table(box=box.ASCII, title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def _render(*tables, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False)
    for t in tables:
        console.print(t)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def _flops_table(r: ModelReport) -> Table:
    f = r.flops
    t = _table("model FLOPs per token", "term", "FLOPs")
    t.add_row("6 N", f"{f.dense:,.0f}")
    t.add_row("attention 6 L T H d", f"{f.attention:,.0f}")
    t.add_section()
    t.add_row("per token", f"{f.total:,.0f}")
    t.add_row(f"per step ({r.batch} x {r.seq_len} tokens)", f"{r.flops_per_step:.4g}")
    return t


def _memory_table(r: ModelReport) -> Table:
    m = r.memory
    t = _table("memory per device (estimate)", "part", "bytes", "exact")
    for part in ("params", "grads", "opt_state", "activations"):
        value = getattr(m, part)
        t.add_row(part + (" (host)" if part in m.host else ""), format_bytes(value), f"{value:,}")
    t.add_section()
    t.add_row("total", format_bytes(m.total), f"{m.total:,}")
    return t


def _speed_table(r: ModelReport) -> Table:
    s = r.throughput
    t = _table(f"throughput on {s.device_kind}", "measure", "value")
    t.add_row("step time", f"{s.step_time_s * 1e3:.1f} ms")
    t.add_row("tokens/s/device", f"{s.tokens_per_s_per_device:,.1f}")
    peak = "n/a" if s.peak_flops is None else f"{s.peak_flops / 1e12:,.1f} TFLOP/s ({s.peak_source})"
    t.add_row("peak per device", peak)
    t.add_row("MFU", s.mfu_text)
    return t


def format_model_report(r: ModelReport) -> str:
    """A `ModelReport` as text: a header, FLOPs, memory (estimate, then compiled) and throughput."""
    head = (f"llama {r.name}: {r.description}\nmesh {dict(r.mesh)} ({r.num_devices} devices), ZeRO-{r.zero_level}, "
            f"remat {r.remat}, attention {r.attention} (setting {r.attention_setting!r} on {r.backend})\n"
            f"N = {r.flops.params:,} ({r.flops.count} weights), seq_len {r.seq_len}, batch {r.batch}; "
            f"dtypes {dict(r.memory.dtypes)} ('own' = the parameters')\n")
    tables = [_flops_table(r), _memory_table(r)]
    if r.throughput is not None:
        tables.append(_speed_table(r))
    text = head + _render(*tables)
    compiled = (f"compiled step, memory_analysis() (arguments = params + optimizer state + batch):\n"
                f"{format_memory(r.compiled)}" if r.compiled is not None else f"compiled step: {r.compiled_note}\n")
    return text + compiled


__all__ = ["compiled_llama_memory", "format_model_report", "llama_config", "llama_report"]
