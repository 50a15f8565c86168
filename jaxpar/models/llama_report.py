"""A Llama model's report: FLOPs per token, memory per device, attention choice and MFU, from shapes.

Everything comes from abstract shapes (``nnx.eval_shape``) and a `TrainPlan` made from mesh
*sizes*, so a report for ``llama3_8b`` on 64 devices runs on a laptop without allocating a
parameter (`llama_report`). The generic pieces (peak table, throughput, memory estimate from
a plan) are in ``jaxpar.report``.

FLOPs per token of a training step (forward + backward = 3 × forward, 2 FLOPs per multiply-add):

    6 · N  +  6 · L · T · H · d_head

``N`` counts the weights that take part in matmuls (``count="matmul"``, the default): the
attention projections, the SwiGLU matrices and the output head (the tied table when tied) —
not the input embedding (a lookup) nor the RMSNorm scales. This is MaxText's count (its
"embedding FLOPs" are the head's matmul). ``count="all"`` uses every parameter
(``param_count``), PaLM's looser 6N. The second term is attention's ``Q·Kᵀ`` and ``P·V``:
PaLM's ``12 · L · H · d_head · T`` halved for the causal mask, as MaxText does.

    >>> f = llama_flops_per_token(LlamaConfig.named("tiny"), 16)
    >>> f.params, f.dense, f.attention
    (20480, 122880.0, 6144.0)
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax
from rich import box
from rich.console import Console
from rich.table import Table

from jaxpar.deprecation import FormerForm, accepts_former_form, former_signature
from jaxpar.config import ParallelConfig
from jaxpar.models.llama_config import LlamaConfig, describe, matmul_params, param_count
from jaxpar.models.report_request import ReportRequest
from jaxpar.pipeline.program import lower
from jaxpar.plan.train_plan import TrainPlan
from jaxpar.report import MemoryEstimate, MemoryReport, Throughput, estimate_memory, format_bytes, format_memory
from jaxpar.report import schedule_of
from jaxpar.report import throughput as measure_throughput

COUNTS = ("matmul", "all")
# Policies whose saved set the estimate models; any other is reported as the no-recompute bound.
_SAVE_INPUTS = ("full", "nothing_saveable")
# Bytes per query, key and head that an attention implementation keeps for its backward besides
# the probabilities in the compute dtype: XLA's softmax (and the reference einsum softmax) keeps
# the causal mask (bool) and the masked scores and their exponentials in fp32; cuDNN's kernel
# keeps no [seq, seq] value (one fp32 log-sum-exp per head and query, counted apart).
_SCORES_KEPT = {"xla": 1 + 4 + 4, "reference": 1 + 4 + 4, "cudnn": 0}


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token: ``dense`` (6N) + ``attention``; ``params`` is N, ``count`` its kind."""

    params: int
    count: str
    seq_len: int
    dense: float
    attention: float

    @property
    def total(self) -> float:
        return self.dense + self.attention

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"total": self.total}


def llama_flops_per_token(cfg: LlamaConfig, seq_len: int | None = None, *, count: str = "matmul") -> FlopsPerToken:
    """Model FLOPs per token of one training step (module docstring for the formula).

    Args:
      cfg: the model's ``LlamaConfig``.
      seq_len: tokens per sequence (default ``cfg.max_seq_len``).
      count: ``"matmul"`` (N = matmul weights, default) or ``"all"`` (N = every parameter).

    >>> llama_flops_per_token(LlamaConfig.named("llama3_8b"), 8192).total / 1e9   # doctest: +ELLIPSIS
    51.4...
    """
    if count not in COUNTS:
        raise ValueError(f"count={count!r} is not one of {COUNTS}: 'matmul' counts the weights used in matmuls "
                         "(MaxText), 'all' every parameter (PaLM's 6N)")
    seq = _positive("seq_len", cfg.max_seq_len if seq_len is None else seq_len)
    n = matmul_params(cfg) if count == "matmul" else param_count(cfg)
    return FlopsPerToken(params=n, count=count, seq_len=seq, dense=6.0 * n,
                         attention=6.0 * cfg.layers * seq * cfg.heads * cfg.head_dim)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def _degree(plan: TrainPlan, logical: str) -> int:
    """How many ways the plan's rules split the logical axis ``logical`` (1 if they do not)."""
    target = plan.config.rules.get(logical)
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    return math.prod(plan.mesh.get(a, 1) for a in axes)


def _ring_attention(plan: TrainPlan) -> bool:
    """The model attends with ring attention's kernel (`jaxpar.ops.context_kernels.ring_attention`):
    a context section whose strategy is ``"ring"``, or ``"hybrid"`` with a ring axis of more than
    one device (of size 1 the hybrid runs the plain per-device softmax)."""
    context = plan.config.context
    if context is None or context.strategy not in ("ring", "hybrid"):
        return False
    return plan.mesh.get(context.axes[0], 1) > 1


def llama_activation_bytes(cfg: LlamaConfig, plan: TrainPlan, *, batch: int, seq_len: int | None = None,
                           compute_dtype=None, attention: str = "xla") -> int:
    """Estimated bytes of forward values saved for the backward pass, on one device.

    Per token and layer, without recompute, a block saves its input and the two norms' inputs
    and outputs (4 × embed), the queries and attention output (2 × heads × d_head), keys and
    values (2 × kv_heads × d_head) and the SwiGLU gate, up and product (3 × mlp), in the
    compute dtype, and what its attention keeps for the backward (``attention``, the
    implementation that runs: `jaxpar.models.llama.attention_implementation`): XLA's softmax
    (``"xla"``, and ``"reference"``, the same einsum softmax) keeps ``heads × seq`` scores of
    four tensors — the causal mask (bool, 1 byte), the masked scores and their exponentials
    (fp32) and the probabilities (the compute dtype), ``9 + itemsize`` bytes per query and key
    (``jax.ad_checkpoint.print_saved_residuals`` of `jaxpar.models.llama.attention`); cuDNN's
    fused kernel (``"cudnn"``) keeps none of them, one fp32 log-sum-exp per head. Under a
    context section with ring attention (``context.strategy="ring"``, or ``"hybrid"`` with a ring
    axis of more than one device) the model attends through the ring's ``custom_vjp``, which keeps
    q, k, v, the output (counted above) and one fp32 log-sum-exp per head and query, whatever
    ``attention`` says; ``"all_gather"`` and ``"ulysses"`` are counted as ``attention``. Not counted:
    the backward's own buffers for the layer it is differentiating (the scores' gradients,
    ``heads × seq`` per token in fp32 again) and XLA's scratch, which the compiled step's temp
    holds. Head-, kv- and mlp-sized values are divided by the ways the plan's rules split
    ``heads`` / ``kv_heads`` / ``mlp``; tokens by the batch axes, the context axes and
    ``grad_accum`` (one micro-batch is alive at a time). The fp32 logits
    (vocab per token, split as ``vocab``) are added once; with ``loss_chunks`` instead the
    gradients the chunked loss keeps (embed per token, and the head's in fp32). With recompute ``"full"`` /
    ``"nothing_saveable"`` (``ParallelConfig.remat``) a layer keeps only its input, plus one
    layer's full set while it is recomputed; other policies are reported at the
    no-recompute bound.

    Under ``pipeline.stages = S`` a device runs ``L / (S·v)`` layers per chunk (``v`` chunks
    per stage: interleaved and V schedules) on micro-batches of ``1 / M`` of its batch shard,
    and the executor keeps only each micro-batch's chunk input (``embed`` per token) until its
    backward: its buffers (`jaxpar.pipeline.lower`) hold ``x_slots`` chunk inputs, the
    micro-batches in flight at the schedule's peak (GPipe all ``M``, 1F1B ``S``), and
    ``g_slots`` output gradients. A backward recomputes the chunk's forward for one
    micro-batch, so one micro-batch's chunk activations (as above, for the chunk's layers)
    and logits are alive at a time. With ``pipeline.embedding="outside"`` the embedding output, its micro-batch
    view and its gradient (``3·M`` micro-batches of ``embed`` per token) are alive too.

    >>> llama_activation_bytes(cfg, plan, batch=8, seq_len=2048)      # doctest: +SKIP
    """
    if attention not in _SCORES_KEPT:
        raise ValueError(f"llama_activation_bytes: attention={attention!r} is not an implementation the estimate "
                         f"knows; use one of {sorted(_SCORES_KEPT)} (jaxpar.models.llama.attention_implementation "
                         f"resolves LlamaConfig.attention={cfg.attention!r} to one)")
    seq = _positive("seq_len", cfg.max_seq_len if seq_len is None else seq_len)
    pipe = plan.config.pipeline
    pipelined = pipe.stages > 1
    # the executor splits each micro-batch over the batch axes but the stages' axis
    replicas = math.prod(plan.mesh[a] for a in plan.batch_axes() if not (pipelined and a == pipe.axis))
    # one micro-batch's tokens (grad_accum and the pipeline's micro-batches run one after
    # another), the sequence split over the context axes
    context = plan.config.context
    cp = math.prod(plan.mesh[a] for a in context.axes) if context is not None else 1
    micro = plan.grad_accum * (pipe.microbatches if pipelined else 1)
    tokens = -(-_positive("batch", batch) // (replicas * micro)) * -(-seq // cp)
    heads, kv, mlp = (_degree(plan, name) for name in ("heads", "kv_heads", "mlp"))
    itemsize = np.dtype(compute_dtype or cfg.dtype or cfg.param_dtype).itemsize
    # what the attention keeps per token and head: a log-sum-exp (cuDNN's kernel, ring attention's
    # custom_vjp), or per key the mask, the masked scores, their exponentials and the
    # probabilities (module constant _SCORES_KEPT)
    ring = _ring_attention(plan)
    scores = 4 if attention == "cudnn" or ring else seq * (_SCORES_KEPT[attention] + itemsize)
    layer = (4 * cfg.embed + 2 * cfg.heads * cfg.head_dim / heads                  # bytes per token
             + 2 * cfg.kv_heads * cfg.head_dim / kv + 3 * cfg.mlp / mlp) * itemsize + cfg.heads * scores / heads
    layers, inputs = cfg.layers, 0
    if pipelined:
        schedule = schedule_of(plan.config)      # the V schedules run two chunks per stage
        program = lower(schedule)
        layers = cfg.layers // (pipe.stages * schedule.virtual_stages)
        outside = 3 * pipe.microbatches if pipe.embedding == "outside" else 0
        inputs = (program.x_slots + program.g_slots + outside) * cfg.embed
    recompute = plan.remat in _SAVE_INPUTS
    kept = layers * cfg.embed * itemsize + layer if recompute else layers * layer
    vocab = cfg.vocab_size / _degree(plan, "vocab")
    # chunked loss: the gradients its forward computed (dh per token, the head's in fp32), not logits
    logits = tokens * cfg.embed * itemsize + cfg.embed * vocab * 4 if cfg.loss_chunks else tokens * vocab * 4
    return int(tokens * (kept + inputs * itemsize) + logits)


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """FLOPs, memory per device and (given a step time) throughput of one model under one plan.

    ``compiled`` is the compiled step's ``memory_analysis()`` when it was compiled (small
    models whose mesh fits the devices); otherwise ``compiled_note`` says why not.
    """

    name: str
    description: str
    mesh: Mapping[str, int]
    zero_level: int
    batch: int
    seq_len: int
    attention: str
    attention_setting: str
    backend: str
    remat: str
    flops: FlopsPerToken
    memory: MemoryEstimate
    compiled: MemoryReport | None = None
    compiled_note: str = "not compiled"
    throughput: Throughput | None = None

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of one step on all devices together."""
        return self.flops.total * self.batch * self.seq_len

    def summary(self) -> dict[str, Any]:
        """JSON-friendly: every field, with the memory and compiled totals."""
        compiled = None
        if self.compiled is not None:
            compiled = dataclasses.asdict(self.compiled) | {"total": self.compiled.total}
        return {"model": self.name, "description": self.description, "mesh": dict(self.mesh),
                "num_devices": self.num_devices, "zero_level": self.zero_level, "batch": self.batch,
                "seq_len": self.seq_len, "remat": self.remat,
                "attention": {"implementation": self.attention, "setting": self.attention_setting,
                              "backend": self.backend},
                "flops_per_token": self.flops.summary(), "flops_per_step": self.flops_per_step,
                "memory_per_device": self.memory.summary(),
                "compiled_memory_per_device": compiled, "compiled_note": self.compiled_note,
                "throughput": None if self.throughput is None else self.throughput.summary()}

    def format(self) -> str:
        """The report as plain-text tables."""
        return format_model_report(self)


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
    from jax.sharding import AbstractMesh

    from jaxpar.models.llama import Llama
    from jaxpar.models.llama_parallel import training_loss
    from jaxpar.nn import abstract_model, model_constraint
    from jaxpar.plan.train_plan import make_train_plan

    # the constraint training gives the model (with a context section: ContextParallel), on mesh sizes
    constrain = model_constraint(AbstractMesh(tuple(sizes.values()), tuple(sizes)), config)
    abstract = abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain))
    return make_train_plan(config, sizes, abstract, tx, loss_fn=training_loss(config))


_FIELDS = tuple(f.name for f in dataclasses.fields(ReportRequest))
_FORMER = FormerForm(
    "jaxpar.models.llama_report.llama_report",
    former_signature("model config", {"*": None, "batch": dataclasses.MISSING, **{
        f.name: f.default for f in dataclasses.fields(ReportRequest) if f.name != "batch"}}),
    lambda args, kwargs: any(name in kwargs for name in _FIELDS),
    lambda a: ((a["model"], a["config"], ReportRequest(**{n: a[n] for n in _FIELDS})), {}),
    "llama_report(model, config, jaxpar.models.report_request.ReportRequest(batch=..., seq_len=..., ...))")


@accepts_former_form(_FORMER)
def llama_report(model: LlamaConfig | str, config: ParallelConfig, request: ReportRequest) -> ModelReport:
    """The `ModelReport` of a Llama model trained under ``config``, from shapes alone.

    Args:
      model: a ``LlamaConfig`` or a size name (``"tiny"``, ``"125m"``, ``"1b"``, ``"llama3_8b"``,
        ``"llama3_70b"``; named sizes use scanned layers).
      config: the ``ParallelConfig`` (mesh axes, rules, ZeRO level, recompute).
      request: a ``ReportRequest``: the batch and sequence length, the mesh sizes to plan for,
        the optimizer, a measured step time and the device's peak, the backend, the dtypes, and a
        compiled step's memory (see its fields).

    Raises:
      ValueError: an unknown size, a non-positive batch / seq_len / peak, a mesh with ``-1``.

    Example:
      >>> import jaxpar
      >>> config = jaxpar.ParallelConfig(mesh={"data": 2}, optimizer={"level": 1})
      >>> r = llama_report("tiny", config, ReportRequest(batch=4, step_time_s=0.01, device_kind="cpu"))
      >>> r.attention, r.throughput.mfu_text
      ('xla', 'n/a (no peak for CPU)')
    """
    import jax

    from jaxpar.models.llama import attention_implementation

    cfg = llama_config(model)
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"llama_report: config must be a jaxpar.ParallelConfig, got {type(config).__name__}")
    if not isinstance(request, ReportRequest):
        raise TypeError(f"llama_report: request must be a jaxpar.models.report_request.ReportRequest, got "
                        f"{type(request).__name__}; e.g. ReportRequest(batch=8, seq_len=4096)")
    r = request
    seq = cfg.max_seq_len if r.seq_len is None else r.seq_len
    flops = llama_flops_per_token(cfg, seq)
    sizes = _sizes(config, r.mesh)
    tx = DEFAULT_TX if r.tx is None else r.tx
    plan = _plan(cfg, config, sizes, tx)
    backend = r.backend or jax.default_backend()
    p = config.precision          # the job's mixed precision sets the dtypes not given here
    param_dtype, grad_dtype, opt_state_dtype = r.param_dtype, r.grad_dtype, r.opt_state_dtype
    if p is not None:
        param_dtype, grad_dtype = param_dtype or p.params, grad_dtype or p.params
        opt_state_dtype = opt_state_dtype or p.opt_state
    dtype = r.compute_dtype or cfg.dtype or (p.compute if p is not None else None) or cfg.param_dtype
    attention = attention_implementation(cfg.attention, dtype, backend)
    activations = llama_activation_bytes(cfg, plan, batch=r.batch, seq_len=seq, compute_dtype=dtype,
                                         attention=attention)
    est = estimate_memory(plan, tx, param_dtype=param_dtype, grad_dtype=grad_dtype,
                          opt_state_dtype=opt_state_dtype, activations=activations)
    speed = None
    if r.step_time_s is not None:
        speed = measure_throughput(flops_per_token=flops.total, tokens_per_step=r.batch * seq,
                                   step_time_s=r.step_time_s, num_devices=math.prod(sizes.values()),
                                   device_kind=r.device_kind, dtype=dtype, peak_flops=r.peak_flops)
    elif r.peak_flops is not None:
        from jaxpar.report.peaks import check_peak

        check_peak(r.peak_flops)
    name = model if isinstance(model, str) else "custom"
    return ModelReport(name=name, description=describe(cfg), mesh=sizes, zero_level=plan.zero_level, batch=r.batch,
                       seq_len=seq, attention=attention, attention_setting=cfg.attention, backend=backend,
                       remat=plan.remat, flops=flops, memory=est, compiled=r.compiled,
                       compiled_note="compiled" if r.compiled is not None else r.compiled_note, throughput=speed)


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
        t.add_row(part, format_bytes(value), f"{value:,}")
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


