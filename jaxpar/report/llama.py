"""Model FLOPs, activations and a whole-model report for the Llama family, from shapes alone.

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
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpar.models.llama_config import LlamaConfig, param_count
from jaxpar.plan.train_plan import TrainPlan
from jaxpar.report.estimate import MemoryEstimate
from jaxpar.report.memory import MemoryReport
from jaxpar.report.throughput import Throughput

COUNTS = ("matmul", "all")
# Policies whose saved set the estimate models; any other is reported as the no-recompute bound.
_SAVE_ALL = ("none", "everything_saveable")
_SAVE_INPUTS = ("full", "nothing_saveable")


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


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights used in matmuls: attention and MLP matrices of every layer plus the output head.

    >>> matmul_params(LlamaConfig.named("tiny"))     # 2 * (32*32*2 + 32*16*2 + 3*32*64) + 32*64
    20480
    """
    e, d = cfg.embed, cfg.head_dim
    per_layer = 2 * e * cfg.heads * d + 2 * e * cfg.kv_heads * d + 3 * e * cfg.mlp
    return cfg.layers * per_layer + cfg.vocab_size * e


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


def llama_activation_bytes(cfg: LlamaConfig, plan: TrainPlan, *, batch: int, seq_len: int | None = None,
                           compute_dtype=None, attention: str = "xla") -> int:
    """Estimated bytes of forward values saved for the backward pass, on one device.

    Per token and layer, without recompute, a block saves its input and the two norms' inputs
    and outputs (4 × embed), the queries and attention output (2 × heads × d_head), keys and
    values (2 × kv_heads × d_head), the SwiGLU gate, up and product (3 × mlp), and the
    attention probabilities (heads × seq) — or, for cuDNN's fused kernel, one log-sum-exp per
    head. Head-, kv- and mlp-sized values are divided by the ways the plan's rules split
    ``heads`` / ``kv_heads`` / ``mlp``; tokens by the batch axes. The fp32 logits
    (vocab per token, split as ``vocab``) are added once. With recompute ``"full"`` /
    ``"nothing_saveable"`` (the config's or the model's) a layer keeps only its input, plus one
    layer's full set while it is recomputed; other policies are reported at the
    no-recompute bound.

    >>> llama_activation_bytes(cfg, plan, batch=8, seq_len=2048)      # doctest: +SKIP
    """
    seq = _positive("seq_len", cfg.max_seq_len if seq_len is None else seq_len)
    replicas = math.prod(plan.mesh[a] for a in plan.batch_axes())
    tokens = -(-_positive("batch", batch) // replicas) * seq
    heads, kv, mlp = (_degree(plan, name) for name in ("heads", "kv_heads", "mlp"))
    probs = cfg.heads if attention == "cudnn" else cfg.heads * seq
    layer = (4 * cfg.embed + (2 * cfg.heads * cfg.head_dim + probs) / heads
             + 2 * cfg.kv_heads * cfg.head_dim / kv + 3 * cfg.mlp / mlp)
    itemsize = np.dtype(compute_dtype or cfg.dtype).itemsize
    recompute = {plan.remat, cfg.remat} & set(_SAVE_INPUTS)
    kept = cfg.layers * cfg.embed + layer if recompute else cfg.layers * layer
    logits = tokens * cfg.vocab_size / _degree(plan, "vocab") * 4
    return int(tokens * kept * itemsize + logits)


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
        from jaxpar.report.model_report import format_model_report

        return format_model_report(self)
