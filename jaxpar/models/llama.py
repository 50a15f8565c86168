"""The Llama-3 family in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Like the example GPT it knows nothing about parallelism: every parameter names its dimensions
with logical axes (``"vocab"``, ``"embed"``, ``"heads"``, ``"kv_heads"``, ``"head_dim"``,
``"mlp"``, and ``"layers"`` when the blocks are stacked for ``scan``), and an optional
``constrain(x, names)`` pins the activations by ``"batch"``, ``"length"`` and the same names.
What runs it in parallel (the parts a pipeline's stages run) is `jaxpar.models.llama_parallel`.

    >>> cfg = LlamaConfig.named("tiny")
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 64)

Rotary embeddings use the "rotate half" layout (the first and second halves of a head form
the pairs), the layout of the Hugging Face Llama checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.deprecation import module_getattr
from jaxpar.models.llama_config import SIZES, LlamaConfig, RopeScaling, describe, flops_per_token, param_count
from jaxpar.nn import fp8
from jaxpar.ops.activations import swiglu
from jaxpar.nn.logits import head_logits
from jaxpar.nn.moe import MoE, moe_aux_loss
from jaxpar.ops.cross_entropy import chunked_cross_entropy

__all__ = ["SIZES", "Llama", "LlamaConfig", "RopeScaling", "attention", "attention_implementation", "describe",
           "flops_per_token", "head_loss", "loss_fn", "param_count", "rope_frequencies", "segment_positions",
           "token_positions"]

_INIT = nnx.initializers.normal(0.02)


def no_constraint(x, names):
    return x


def _param(rngs, cfg: LlamaConfig, init, shape, names):
    # eager_sharding=False: build anywhere; jaxpar (or any runner) decides the placement.
    init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


# ----------------------------------------------------------------------------- rotary embeddings

def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``head_dim // 2`` rotary frequencies (radians per position), Llama-3.1-scaled if asked.

    >>> rope_frequencies(4, 10000.0)
    array([1.  , 0.01])
    """
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return freqs
    wavelength = 2 * np.pi / freqs
    original = scaling.original_max_positions
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = np.where(wavelength > original / scaling.low_freq_factor, freqs / scaling.factor, blended)
    return np.where(wavelength < original / scaling.high_freq_factor, freqs, scaled)


def _rotate(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """x [B, S, H, D] rotated by ``positions`` [B, S] (angles in fp32 whatever x's dtype)."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(freqs, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def token_positions(x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array:
    """The tokens' positions: given (a reordered sequence), restarting at every segment
    (packed), or ``0..S-1`` per row."""
    if positions is not None:
        return positions
    if segment_ids is not None:
        return segment_positions(segment_ids)
    return jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its segment: packed sequences restart at 0.

    >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


# ----------------------------------------------------------------------------- attention

def _reference_attention(q, k, v, mask):
    """Plain einsum softmax; query heads grouped [K, G] so K/V are never repeated."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) / np.sqrt(d)
    allowed = jnp.tril(jnp.ones((t, k.shape[1]), bool))
    if mask is not None:
        allowed = allowed & mask[:, :, None]          # [B, 1, T, S] -> [B, 1, 1, T, S]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, n, d)


def attention_implementation(kind: str, dtype, backend: str | None = None) -> str:
    """The attention ``kind`` ("auto" | "xla" | "cudnn" | "reference") resolved for a compute
    ``dtype`` on ``backend`` (default: JAX's default backend): what the model runs.

    >>> attention_implementation("auto", "bfloat16", backend="gpu"), attention_implementation("auto", "float32")
    ('cudnn', 'xla')
    """
    if kind != "auto":
        return kind
    # cuDNN's fused kernel takes only half precision; everything else goes to XLA's
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and (backend or jax.default_backend()) == "gpu" else "xla"



def attention(q, k, v, segment_ids=None, *, kind: str = "auto") -> jax.Array:
    """Causal grouped-query attention: q [B, T, N, D], k and v [B, S, K, D] with K dividing N.

    ``segment_ids`` [B, T] keeps packed sequences apart (a token attends only inside its own
    segment). ``kind`` is ``LlamaConfig.attention``: ``"xla"`` / ``"cudnn"`` go through
    ``jax.nn.dot_product_attention`` (which groups the query heads itself, no repeated K/V),
    ``"auto"`` picks cuDNN for half precision on GPU, ``"reference"`` is the einsum softmax.

    >>> q = jnp.ones((1, 4, 4, 8)); kv = jnp.ones((1, 4, 2, 8))
    >>> attention(q, kv, kv, kind="reference").shape
    (1, 4, 4, 8)
    """
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    if kind == "reference":
        return _reference_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        implementation=attention_implementation(kind, q.dtype))


# ----------------------------------------------------------------------------- modules

class RMSNorm(nnx.Module):
    """x / rms(x) * scale over ``embed``, computed in fp32.

    >>> RMSNorm(LlamaConfig.named("tiny"), nnx.Rngs(0))(jnp.full((1, 2, 32), 3.0))[0, 0, :2].round(4).tolist()
    [1.0, 1.0]
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = _param(rngs, cfg, nnx.initializers.ones, (cfg.embed,), ("embed",))

    def __call__(self, x):
        # normalise in fp32 (a bf16 mean of squares loses the small components)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with rotary positions: ``heads`` queries share ``kv_heads`` keys/values.

    >>> attn = Attention(LlamaConfig.named("tiny"), nnx.Rngs(0))
    >>> attn(jnp.ones((1, 4, 32)), jnp.arange(4)[None]).shape
    (1, 4, 32)
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        e, n, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = _param(rngs, cfg, _INIT, (e, n, d), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, cfg, _INIT, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, cfg, _INIT, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, cfg, _INIT, (n, d, e), ("heads", "head_dim", "embed"))

    def __call__(self, x, positions, segment_ids=None, constrain=no_constraint):
        dtype, freqs = x.dtype, rope_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        # named for the recompute policies that keep some matmuls (`jaxpar.remat`, "dots_except_mlp")
        q = checkpoint_name(fp8.einsum("bse,ehd->bshd", x, self.wq[...].astype(dtype)), "query_proj")
        k = checkpoint_name(fp8.einsum("bse,ehd->bshd", x, self.wk[...].astype(dtype)), "key_proj")
        v = checkpoint_name(fp8.einsum("bse,ehd->bshd", x, self.wv[...].astype(dtype)), "value_proj")
        q = constrain(_rotate(q, positions, freqs), ("batch", "length", "heads", "head_dim"))
        k = constrain(_rotate(k, positions, freqs), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        # a constraint that knows how to attend across devices (jaxpar.ops.ContextParallel) does so;
        # its mask follows positions, so sequences reordered for load balance stay causal
        attend = getattr(constrain, "attention", None)
        out = (attention(q, k, v, segment_ids, kind=self.cfg.attention) if attend is None
               else attend(q, k, v, segment_ids, positions))
        out = checkpoint_name(constrain(out, ("batch", "length", "heads", "head_dim")), "context")
        return checkpoint_name(fp8.einsum("bshd,hde->bse", out, self.wo[...].astype(dtype)), "out_proj")


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)).

    >>> MLP(LlamaConfig.named("tiny"), nnx.Rngs(0))(jnp.ones((1, 4, 32))).shape
    (1, 4, 32)
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate = _param(rngs, cfg, _INIT, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.up = _param(rngs, cfg, _INIT, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.down = _param(rngs, cfg, _INIT, (cfg.mlp, cfg.embed), ("mlp", "embed"))

    def __call__(self, x, constrain=no_constraint):
        dtype = x.dtype
        # projections through jaxpar.nn.fp8.einsum: plain einsums, fp8 under precision="fp8"
        h = swiglu(checkpoint_name(fp8.einsum("bse,ef->bsf", x, self.gate[...].astype(dtype)), "mlp_in"),
                   checkpoint_name(fp8.einsum("bse,ef->bsf", x, self.up[...].astype(dtype)), "mlp_in"))
        return checkpoint_name(fp8.einsum("bsf,fe->bse", constrain(h, ("batch", "length", "mlp")),
                                          self.down[...].astype(dtype)), "mlp_out")


class Block(nnx.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + SwiGLU(norm(x)).

    >>> Block(LlamaConfig.named("tiny"), nnx.Rngs(0))(jnp.ones((1, 4, 32))).shape
    (1, 4, 32)
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp = (MoE(cfg.embed, cfg.mlp, cfg.moe, rngs=rngs, param_dtype=cfg.param_dtype, init=_INIT)
                    if cfg.is_moe(layer) else MLP(cfg, rngs))

    def __call__(self, x, positions=None, segment_ids=None, constrain=no_constraint):
        if positions is None:   # called as block(h): one unpacked sequence per row
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids, constrain),
                      ("batch", "length", "embed"))
        return constrain(x + self.mlp(self.mlp_norm(x), constrain), ("batch", "length", "embed"))


def _check_tokens(tokens, segment_ids, name: str = "segment_ids") -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"Llama takes integer token ids [batch, length], got {tokens.dtype} {tuple(tokens.shape)}; "
                        f"pass e.g. batch['inputs'] with dtype int32")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(tokens.shape):
        raise ValueError(f"{name} has shape {tuple(segment_ids.shape)} but tokens {tuple(tokens.shape)}; "
                         f"give one per token")


class Llama(nnx.Module):
    """Token embedding → ``layers`` blocks → final RMSNorm → vocabulary head (or the tied table).

    >>> model = Llama(LlamaConfig.named("tiny", kv_heads=1), rngs=nnx.Rngs(0))   # MQA
    >>> model(jnp.zeros((1, 8), jnp.int32), segment_ids=jnp.ones((1, 8), jnp.int32)).shape
    (1, 8, 64)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, constrain: Callable = no_constraint):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama(cfg) takes a LlamaConfig, got {type(cfg).__name__}; "
                            f"e.g. LlamaConfig.named('tiny')")
        self.cfg = cfg
        self.constrain = constrain
        self.embedding = _param(rngs, cfg, _INIT, (cfg.vocab_size, cfg.embed), ("vocab", "embed"))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return Block(cfg, rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs, i) for i in range(cfg.layers)])
        self.norm = RMSNorm(cfg, rngs)
        self.head = None if cfg.tie_embeddings else _param(rngs, cfg, _INIT, (cfg.embed, cfg.vocab_size),
                                                           ("embed", "vocab"))

    def embed(self, tokens):
        _check_tokens(tokens, None)     # also where a pipeline's first stage embeds without `hidden`
        x = self.embedding[...][tokens]
        if self.cfg.dtype is not None:
            x = x.astype(jnp.dtype(self.cfg.dtype))
        return self.constrain(x, ("batch", "length", "embed"))

    def run_blocks(self, x, segment_ids=None, positions=None):
        positions = token_positions(x, segment_ids, positions)
        block_fn = lambda block, h: block(h, positions, segment_ids, self.constrain)  # noqa: E731
        if self.cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def scan_fn(block, h):
                return block_fn(block, h)

            return scan_fn(self.blocks, x)
        for block in self.blocks:
            x = block_fn(block, x)
        return x

    def logits(self, x):
        return _logits(self.norm, self.embedding if self.head is None else self.head, x,
                       tied=self.head is None, constrain=self.constrain)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of a training step on sequences of ``seq_len`` (causal attention,
        active experts only): what ``jaxpar.Trainer`` logs MFU from (`flops_per_token`)."""
        return flops_per_token(self.cfg, seq_len)

    def hidden(self, tokens, segment_ids=None, positions=None):
        """The last block's output [B, S, embed] (before the final norm) for token ids [B, S]."""
        _check_tokens(tokens, segment_ids)
        _check_tokens(tokens, positions, "positions")
        return self.run_blocks(self.embed(tokens), segment_ids, positions)

    def __call__(self, tokens, segment_ids=None, positions=None):
        """Logits [B, S, vocab] in fp32 for token ids [B, S]; ``positions`` [B, S] (default: from
        the order of the tokens and the segments) when the sequence was reordered."""
        return self.logits(self.hidden(tokens, segment_ids, positions))


def _logits(norm, table, x, *, tied: bool, constrain=no_constraint):
    # fp32 logits; their gradient matmuls in the compute dtype (jaxpar.nn.logits)
    return constrain(head_logits(norm(x), table[...], tied=tied), ("batch", "length", "vocab"))


def head_loss(norm, table, x, batch, *, tied: bool, chunks: int, constrain=no_constraint) -> jax.Array:
    """The loss of the last hidden states ``x``: from the materialised logits (``chunks=0``) or
    by `jaxpar.ops.chunked_cross_entropy` in ``chunks`` token groups (equal, in less memory)."""
    if not chunks:
        return _xent(_logits(norm, table, x, tied=tied, constrain=constrain), batch)
    mask = batch["segment_ids"] != 0 if "segment_ids" in batch else None   # segment 0 = padding
    return chunked_cross_entropy(norm(x), table[...], batch["targets"], chunks=chunks, mask=mask, tied=tied,
                                 constrain=constrain)


def _xent(logits, batch) -> jax.Array:
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    if "segment_ids" not in batch:
        return losses.mean()
    keep = (batch["segment_ids"] != 0).astype(losses.dtype)   # segment 0 = padding
    return (losses * keep).sum() / jnp.maximum(keep.sum(), 1.0)


def loss_fn(model: Llama, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy over ``batch["inputs"]`` / ``batch["targets"]`` [B, S].

    With ``batch["segment_ids"]`` the sequences are packed: attention stays inside a segment,
    positions restart at each segment, and tokens of segment 0 (padding) are left out of the mean.
    ``batch["positions"]`` (added by context-parallel batch placement) gives the positions.
    With ``cfg.loss_chunks=N`` the head and the loss run in N token groups, never holding the
    full ``[tokens, vocab]`` logits (`jaxpar.ops.chunked_cross_entropy`).

    >>> model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> float(loss_fn(model, {"inputs": tokens, "targets": tokens})) > 0
    True
    """
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ValueError(f"Llama loss_fn needs batch[{key!r}] [batch, length]; the batch has {sorted(batch)}")
    h = model.hidden(batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
    loss = head_loss(model.norm, model.embedding if model.head is None else model.head, h, batch,
                      tied=model.head is None, chunks=model.cfg.loss_chunks, constrain=model.constrain)
    # MoE layers recorded their load-balancing and z-losses during the forward pass
    return loss + moe_aux_loss(model) if model.cfg.moe is not None else loss


# Former names (CHANGELOG.md), e.g. pipeline_loss (now in the *_parallel module beside this one):
# resolved by name when asked for, with a DeprecationWarning, so this file imports nothing parallel.
__getattr__ = module_getattr(__name__)
