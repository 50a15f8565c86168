"""``LlamaConfig``: the shape of a Llama-3 model, its named sizes and its parameter count.

A frozen keyword-only dataclass, checked when it is built; the model in
``jaxpar.models.llama`` reads nothing else.

    >>> cfg = LlamaConfig.named("tiny")
    >>> cfg.heads, cfg.kv_heads, cfg.head_dim
    (4, 2, 8)
    >>> f"{param_count(LlamaConfig.named('llama3_8b')) / 1e9:.2f}B"
    '8.03B'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.deprecation import Removed, RemovedAttribute, removed_keywords

ATTENTION = ("auto", "xla", "cudnn", "reference")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1's rotary frequency scaling (``rope_type="llama3"`` in other libraries).

    Wavelengths shorter than ``original_max_positions / high_freq_factor`` keep their
    frequency, those longer than ``original_max_positions / low_freq_factor`` are divided by
    ``factor``, and the band between is interpolated smoothly.

    >>> RopeScaling(factor=8.0).original_max_positions
    8192
    """

    factor: float = 8.0                   # how much longer the context becomes
    low_freq_factor: float = 1.0          # wavelengths above original/low are scaled fully
    high_freq_factor: float = 4.0         # wavelengths below original/high are left alone
    original_max_positions: int = 8192    # the context length the model was pre-trained on

    def __post_init__(self):
        if self.factor < 1:
            raise ValueError(f"RopeScaling.factor={self.factor} must be >= 1 (1 = no scaling); e.g. 8.0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling needs 0 < low_freq_factor < high_freq_factor, got low_freq_factor="
                f"{self.low_freq_factor}, high_freq_factor={self.high_freq_factor}; Llama-3.1 uses 1.0 and 4.0")
        if self.original_max_positions < 1:
            raise ValueError(f"RopeScaling.original_max_positions={self.original_max_positions} must be "
                             f"positive; Llama-3 was pre-trained with 8192")


def _check_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"LlamaConfig.{name}={value!r} must be a positive int")


def check_loss_chunks(owner: str, chunks: Any, seq_len: int, seq_field: str) -> None:
    """``loss_chunks`` is 0 (off) or a number of token groups no larger than the sequence."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise ValueError(f"{owner}.loss_chunks={chunks!r} must be an int >= 0: 0 computes the loss from the full "
                         f"[tokens, vocab] logits, N runs the head and the loss in N token groups (e.g. 8)")
    if chunks > seq_len:
        raise ValueError(f"{owner}.loss_chunks={chunks} exceeds {seq_field}={seq_len}: each group takes every "
                         f"loss_chunks-th position of a sequence; use loss_chunks <= {seq_len} (e.g. 8), or 0")


def refuse_remat(cls: type) -> type:
    """``cls`` (a model config) whose constructor refuses ``remat=`` with the setting to use:
    recompute is a parallel-training technique, set once in ``ParallelConfig.remat``, which
    the step applies to each of the model's blocks from outside (a model carries no policy).

    >>> LlamaConfig(remat="full")      # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: LlamaConfig(remat='full'): a model config has no recompute policy; set ParallelConfig(remat='full') ...
    """
    def instead(policy: Any) -> Removed:
        return Removed(f"a model config has no recompute policy; set ParallelConfig(remat={policy!r}) (in a job "
                       f"file: parallel.remat: {policy}), which the Trainer applies to each of the model's blocks",
                       "docs/recompute.md")

    cls = removed_keywords(cls.__name__, {"remat": instead})(cls)
    field = RemovedAttribute(Removed("recompute is ParallelConfig.remat (a model config has no recompute policy)",
                                     "docs/recompute.md"))
    field.__set_name__(cls, "remat")
    cls.remat = field       # reading the former field says where the policy went
    return cls


@refuse_remat
@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The shape and options of a Llama-3 model. ``LlamaConfig.named(name)`` gives the sizes.

    >>> LlamaConfig(vocab_size=64, embed=32, heads=4, kv_heads=2, mlp=64, layers=2).head_dim
    8
    """

    vocab_size: int = 64          # tokens in the vocabulary
    embed: int = 32               # width of the residual stream
    heads: int = 4                # query heads
    kv_heads: int = 2             # key/value heads shared by heads // kv_heads query heads (1 = MQA)
    head_dim: int | None = None   # width of one head; None = embed // heads
    mlp: int = 64                 # hidden width of the SwiGLU feed-forward
    layers: int = 2               # transformer blocks
    max_seq_len: int = 16         # longest sequence the model is meant for (data / planning only)
    rope_theta: float = 500000.0  # RoPE base: frequency i is theta ** (-2i / head_dim)
    rope_scaling: RopeScaling | None = None   # Llama-3.1 long-context scaling; None = plain RoPE
    norm_eps: float = 1e-5        # RMSNorm epsilon
    tie_embeddings: bool = False  # the output head reuses the token embedding table
    scan_layers: bool = False     # stack blocks on a "layers" axis and run them with scan
    attention: str = "auto"       # "auto" | "xla" | "cudnn" | "reference" (plain einsum softmax)
    dtype: str | None = None      # compute dtype of activations; None = the parameters' dtype as used
                                  # (param_dtype, or the compute dtype of a jaxpar.Precision)
    param_dtype: str = "float32"  # storage dtype of parameters
    moe: Any = None               # a jaxpar.nn.MoEConfig (or a dict of its fields): mixture-of-experts MLPs
    moe_every: int = 1            # with moe: layer i is MoE when (i + 1) % moe_every == 0 (1 = Mixtral, 2 = Switch)
    loss_chunks: int = 0          # 0 = the loss from the full [tokens, vocab] logits; N = head + loss in N token
                                  # groups, never holding all logits (jaxpar.ops.chunked_cross_entropy)

    def __post_init__(self):
        _check_positive(self, "vocab_size", "embed", "heads", "kv_heads", "mlp", "layers", "max_seq_len")
        if self.head_dim is None:
            if self.embed % self.heads:
                raise ValueError(
                    f"LlamaConfig: embed={self.embed} is not divisible by heads={self.heads}, so head_dim "
                    f"cannot default to embed // heads; give head_dim explicitly or pick heads dividing {self.embed}")
            object.__setattr__(self, "head_dim", self.embed // self.heads)  # resolved once, then frozen
        _check_positive(self, "head_dim")
        if self.heads % self.kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ValueError(
                f"LlamaConfig: kv_heads={self.kv_heads} does not divide heads={self.heads}; grouped-query "
                f"attention shares each key/value head among heads // kv_heads query heads. "
                f"Use kv_heads in {divisors}")
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim={self.head_dim} is odd, but rotary embeddings rotate pairs of "
                f"dimensions; use an even head_dim (e.g. {self.head_dim + 1}) or embed/heads that give one")
        self._check_options()

    def _check_options(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"LlamaConfig.attention={self.attention!r} is not one of {ATTENTION}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES and not (name == "dtype" and self.dtype is None):
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)!r} is not one of {DTYPES}")
        if isinstance(self.rope_scaling, dict):   # from YAML / JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LlamaConfig.rope_scaling must be a RopeScaling, a dict of its fields or None, "
                            f"got {type(self.rope_scaling).__name__}")
        self._check_moe()
        check_loss_chunks("LlamaConfig", self.loss_chunks, self.max_seq_len, "max_seq_len")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig: rope_theta={self.rope_theta} and norm_eps={self.norm_eps} "
                             f"must be positive; Llama-3 uses 500000.0 and 1e-5")

    def _check_moe(self) -> None:
        from jaxpar.nn.moe import MoEConfig   # the layer's own config, validated there

        if isinstance(self.moe, dict):       # from YAML / JSON
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"LlamaConfig.moe must be a jaxpar.nn.MoEConfig, a dict of its fields or None, "
                            f"got {type(self.moe).__name__}")
        _check_positive(self, "moe_every")
        if self.moe is not None and self.scan_layers and self.moe_every != 1:
            raise ValueError(f"LlamaConfig: moe_every={self.moe_every} with scan_layers=True; scanned blocks are "
                             f"one stacked block, so every layer is MoE or none is. Use moe_every=1 or "
                             f"scan_layers=False")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) has a mixture-of-experts MLP.

        >>> [LlamaConfig.named("tiny", layers=4, moe={"experts": 4}, moe_every=2).is_moe(i) for i in range(4)]
        [False, True, False, True]
        """
        return self.moe is not None and (layer + 1) % self.moe_every == 0

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @classmethod
    def named(cls, name: str, **overrides: Any) -> LlamaConfig:
        """One of ``SIZES`` (``"tiny"``, ``"125m"``, ``"1b"``, ``"llama3_8b"``, ``"llama3_70b"``),
        with fields replaced by ``overrides``.

        >>> LlamaConfig.named("tiny", scan_layers=True).scan_layers
        True
        """
        if name not in SIZES:
            raise ValueError(f"no Llama size named {name!r}; the sizes are {sorted(SIZES)}")
        return cls(**{**SIZES[name], **overrides})


# Real shapes for the large ones (Meta's published configurations); they are for planning and
# abstract shapes (jaxpar.nn.abstract_model), never trained in the tests.
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=64, embed=32, heads=4, kv_heads=2, mlp=64, layers=2, max_seq_len=16),
    "125m": dict(vocab_size=32000, embed=768, heads=12, kv_heads=4, mlp=2048, layers=12, max_seq_len=2048),
    "1b": dict(_LLAMA3, embed=2048, heads=32, kv_heads=8, mlp=8192, layers=16, tie_embeddings=True,
               rope_scaling=RopeScaling(factor=32.0)),   # the Llama-3.2-1B shape
    "llama3_8b": dict(_LLAMA3, embed=4096, heads=32, kv_heads=8, mlp=14336, layers=32),
    "llama3_70b": dict(_LLAMA3, embed=8192, heads=64, kv_heads=8, mlp=28672, layers=80),
}


def for_data(size: str, fields: dict[str, Any], *, seq_len: int, vocab: int | None = None) -> LlamaConfig:
    """``LlamaConfig.named(size, **fields)`` as a job builds it for its data: ``max_seq_len``
    grown to the data's ``seq_len`` and ``vocab_size`` to its ``vocab`` where the size's are
    smaller, unless ``fields`` sets them (a job's ``model.fields``; a ``job.yaml`` records both).

    >>> cfg = for_data("tiny", {"layers": 4}, seq_len=64, vocab=257)
    >>> cfg.max_seq_len, cfg.vocab_size, cfg.layers
    (64, 257, 4)
    """
    named = LlamaConfig.named(size)
    grow = {"max_seq_len": max(named.max_seq_len, seq_len)}
    if vocab is not None and "vocab_size" not in fields:
        grow["vocab_size"] = max(named.vocab_size, vocab)
    return LlamaConfig.named(size, **{**grow, **fields})


def param_count(cfg: LlamaConfig) -> int:
    """Parameters of the model ``cfg`` describes, from its shape alone (no model is built).

    >>> param_count(LlamaConfig.named("tiny"))
    22688
    """
    e, d = cfg.embed, cfg.head_dim
    attention = e * cfg.heads * d * 2 + e * cfg.kv_heads * d * 2       # wq, wo; wk, wv
    mlps = sum(_mlp_params(cfg, i) for i in range(cfg.layers))
    tables = cfg.vocab_size * e * (1 if cfg.tie_embeddings else 2)
    return cfg.layers * (attention + 2 * e) + mlps + tables + e          # two norms a block; + final norm


def _mlp_params(cfg: LlamaConfig, layer: int) -> int:
    if not cfg.is_moe(layer):
        return 3 * cfg.embed * cfg.mlp                                   # gate, up, down
    moe, f = cfg.moe, cfg.moe.expert_mlp or cfg.mlp
    return cfg.embed * moe.experts + 3 * cfg.embed * f * (moe.experts + moe.shared_experts)   # router, experts


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights one token's forward multiplies by: the attention and MLP matrices of every layer
    plus the output head (the tied table when tied). Not the input table (a lookup) nor the
    RMSNorm scales. An MoE layer counts its router, its shared experts and ``top_k`` routed
    experts: the active parameters, not every expert.

    >>> matmul_params(LlamaConfig.named("tiny"))     # 2 * (32*32*2 + 32*16*2 + 3*32*64) + 32*64
    20480
    """
    e, d = cfg.embed, cfg.head_dim
    attention = 2 * e * cfg.heads * d + 2 * e * cfg.kv_heads * d        # wq, wo; wk, wv
    mlps = 0
    for layer in range(cfg.layers):
        if cfg.is_moe(layer):
            moe, f = cfg.moe, cfg.moe.expert_mlp or cfg.mlp
            mlps += e * moe.experts + 3 * e * f * (moe.top_k + moe.shared_experts)
        else:
            mlps += 3 * e * cfg.mlp
    return cfg.layers * attention + mlps + cfg.vocab_size * e


def flops_per_token(cfg: LlamaConfig, seq_len: int | None = None) -> float:
    """Model FLOPs per token of one training step (forward + backward = 3 × forward, 2 FLOPs per
    multiply-add): ``6 · matmul_params`` plus causal attention's ``Q·Kᵀ`` and ``P·V``,
    ``6 · layers · seq · heads · head_dim`` (PaLM's 12, halved by the causal mask, as MaxText
    counts it). MoE layers count their active experts only (`matmul_params`).

    >>> flops_per_token(LlamaConfig.named("tiny"), 16)    # 6 * 20480 + 6 * 2 * 16 * 4 * 8
    129024.0
    """
    seq = cfg.max_seq_len if seq_len is None else seq_len
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.layers * seq * cfg.heads * cfg.head_dim


_DIGITS = {"B": 2, "M": 1, "K": 1, "": 0}


def describe(cfg: LlamaConfig) -> str:
    """One line: the shape and the parameter count.

    >>> describe(LlamaConfig.named("tiny"))
    'layers=2 embed=32 heads=4/kv 2 head_dim=8 mlp=64 vocab=64: 22.7K parameters'
    """
    n = param_count(cfg)
    unit, scale = next((u, s) for u, s in (("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1)) if n >= s)
    return (f"layers={cfg.layers} embed={cfg.embed} heads={cfg.heads}/kv {cfg.kv_heads} head_dim={cfg.head_dim} "
            f"mlp={cfg.mlp} vocab={cfg.vocab_size}: {n / scale:.{_DIGITS[unit]}f}{unit} parameters")
