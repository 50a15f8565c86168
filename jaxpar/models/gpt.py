"""The example GPT: a small decoder-only transformer in Flax NNX, readable in one sitting.

It knows nothing about parallelism. Every parameter names its dimensions with logical axes
(``"vocab"``, ``"embed"``, ``"heads"``, ``"kv"``, ``"mlp"``, and ``"layers"`` when the blocks
are stacked for ``scan``); a rules table elsewhere maps them to mesh axes. An optional
``constrain(x, names)`` hook lets the runner pin activations by logical names too. What runs
it in parallel (the parts a pipeline's stages run) is `jaxpar.models.gpt_parallel`.

    >>> cfg = GPTConfig(vocab_size=16, seq_len=8, embed=32, heads=4, mlp=64, layers=2)
    >>> model = GPT(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 16)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.deprecation import module_getattr
from jaxpar.models.llama_config import check_loss_chunks, refuse_remat
from jaxpar.nn.moe import MoE, MoEConfig, moe_aux_loss
from jaxpar.ops.cross_entropy import chunked_cross_entropy


@refuse_remat    # recompute is ParallelConfig.remat, applied to the blocks from outside
@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 16
    seq_len: int = 32
    embed: int = 64
    heads: int = 8
    mlp: int = 256
    layers: int = 2
    scan_layers: bool = False   # stack blocks on a "layers" axis and run them with scan
    dtype: str = "float32"      # only "float32": the compute dtype is ParallelConfig.precision's
    dropout: float | None = None  # residual dropout rate; None = no Dropout modules (no RNG state)
    fused_qkv: bool = False     # one [embed, 3 * heads * head_dim] projection for q, k and v
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (jaxpar.nn.MoE) instead of the dense ones
    loss_chunks: int = 0        # 0 = the loss from the full [tokens, vocab] logits; N = head + loss in N token
                                # groups, never holding all logits (jaxpar.ops.chunked_cross_entropy)

    def __post_init__(self):
        check_loss_chunks("GPTConfig", self.loss_chunks, self.seq_len, "seq_len")
        if self.dtype != "float32":     # the model computes in its parameters' dtype
            raise ValueError(f"GPTConfig.dtype={self.dtype!r}: the example GPT computes in its parameters' dtype "
                             "(float32) and has no compute dtype of its own; train it in bf16 with "
                             "ParallelConfig(precision='bf16') (fp32 master weights, bf16 compute) and leave "
                             "GPTConfig.dtype at 'float32'")

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads


def _param(rngs, init, shape, names, dtype=jnp.float32):
    # eager_sharding=False: build anywhere; jaxpar (or any runner) decides the placement.
    init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, dtype))


def no_constraint(x, names):
    return x


def check_tokens(cfg: GPTConfig, tokens) -> None:
    """Refuse what the GPT cannot embed, naming the fix: token ids that are not integers
    ``[batch, length]``, and sequences longer than ``cfg.seq_len`` (its learned position table
    has one row per position). Reads shapes and dtypes only (runs while the step is traced).

    >>> check_tokens(GPTConfig(seq_len=8), jnp.zeros((2, 16), jnp.int32))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: GPT: the inputs hold sequences of 16 tokens (shape (2, 16)) but GPTConfig.seq_len=8, ...
    """
    shape, dtype = tuple(tokens.shape), tokens.dtype
    if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"GPT takes integer token ids [batch, length] (batch['inputs']), got {dtype} {shape}; "
                        "pass the ids as integers, e.g. np.asarray(inputs, np.int32)")
    if shape[1] > cfg.seq_len:
        raise ValueError(f"GPT: the inputs hold sequences of {shape[1]} tokens (shape {shape}) but "
                         f"GPTConfig.seq_len={cfg.seq_len}, the rows of its position table (wpe "
                         f"{cfg.seq_len} x {cfg.embed}); cut the sequences to at most {cfg.seq_len} tokens, or "
                         f"build the model with GPTConfig(seq_len={shape[1]}) or more")


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.scale = _param(rngs, nnx.initializers.ones, (dim,), ("embed",))
        self.bias = _param(rngs, nnx.initializers.zeros, (dim,), ("embed",))

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.fused = cfg.fused_qkv
        if cfg.fused_qkv:
            # q, k and v side by side in one matrix, as many checkpoints store them
            self.wqkv = _param(rngs, init, (cfg.embed, 3 * cfg.heads * cfg.head_dim), ("embed", "heads"))
        else:
            qkv_shape, qkv_names = (cfg.embed, cfg.heads, cfg.head_dim), ("embed", "heads", "kv")
            self.wq = _param(rngs, init, qkv_shape, qkv_names)
            self.wk = _param(rngs, init, qkv_shape, qkv_names)
            self.wv = _param(rngs, init, qkv_shape, qkv_names)
        self.wo = _param(rngs, init, (cfg.heads, cfg.head_dim, cfg.embed), ("heads", "kv", "embed"))

    def _qkv(self, x):
        # named for the recompute policies that keep some matmuls (`jaxpar.remat`, "dots_except_mlp")
        if self.fused:
            qkv = checkpoint_name(x @ self.wqkv[...], "qkv_proj")
            heads, dim = self.wo.shape[0], self.wo.shape[1]
            qkv = qkv.reshape(*x.shape[:2], 3, heads, dim)
            return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return tuple(checkpoint_name(jnp.einsum("bse,ehd->bshd", x, w[...]), name)
                     for w, name in ((self.wq, "query_proj"), (self.wk, "key_proj"), (self.wv, "value_proj")))

    def _out(self, out):
        return checkpoint_name(jnp.einsum("bshd,hde->bse", checkpoint_name(out, "context"), self.wo[...]), "out_proj")

    def __call__(self, x, positions, constrain=no_constraint):
        q, k, v = self._qkv(x)
        # a constraint that attends across devices (jaxpar.ops.ContextParallel: the sequence split
        # and reordered over a context axis) masks by the tokens' original positions
        if (attend := getattr(constrain, "attention", None)) is not None:
            return self._out(attend(q, k, v, None, positions))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        return self._out(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v))


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.up = _param(rngs, init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.up_bias = _param(rngs, nnx.initializers.zeros, (cfg.mlp,), ("mlp",))
        self.down = _param(rngs, init, (cfg.mlp, cfg.embed), ("mlp", "embed"))
        self.down_bias = _param(rngs, nnx.initializers.zeros, (cfg.embed,), ("embed",))

    def __call__(self, x):
        h = jax.nn.gelu(checkpoint_name(x @ self.up[...], "mlp_in") + self.up_bias[...])
        return checkpoint_name(h @ self.down[...], "mlp_out") + self.down_bias[...]


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.ln1 = LayerNorm(cfg.embed, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.embed, rngs)
        self.moe = cfg.moe is not None
        self.mlp = MoE(cfg.embed, cfg.mlp, cfg.moe, rngs=rngs) if self.moe else MLP(cfg, rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout is not None else None

    def __call__(self, x, constrain=no_constraint, positions=None):
        if positions is None:   # called as block(h): tokens in their own order
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        drop = self.drop if self.drop is not None else (lambda h: h)
        x = constrain(x + drop(self.attn(self.ln1(x), positions, constrain)), ("batch", "length", "embed"))
        mlp = self.mlp(self.ln2(x), constrain) if self.moe else self.mlp(self.ln2(x))   # MoE: axes from the rules
        return constrain(x + drop(mlp), ("batch", "length", "embed"))


class GPT(nnx.Module):
    """Token embedding → ``layers`` transformer blocks → final norm and vocabulary head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, constrain: Callable = no_constraint):
        self.cfg = cfg
        self.constrain = constrain
        init = nnx.initializers.normal(0.02)
        self.wte = _param(rngs, init, (cfg.vocab_size, cfg.embed), ("vocab", "embed"))
        self.wpe = _param(rngs, init, (cfg.seq_len, cfg.embed), (None, "embed"))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return Block(cfg, rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = LayerNorm(cfg.embed, rngs)
        self.head = _param(rngs, init, (cfg.embed, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens, positions=None):
        check_tokens(self.cfg, tokens)
        pos = self.wpe[...][: tokens.shape[1]] if positions is None else self.wpe[...][positions]
        return self.constrain(self.wte[...][tokens] + pos, ("batch", "length", "embed"))

    def run_blocks(self, x, positions=None):
        block_fn = lambda block, h: block(h, self.constrain, positions)  # noqa: E731
        if self.cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def scan_fn(block, h):
                return block_fn(block, h)

            return scan_fn(self.blocks, x)
        for block in self.blocks:
            x = block_fn(block, x)
        return x

    def logits(self, x):
        return self.ln_f(x) @ self.head[...]

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of a training step (`gpt_flops_per_token`): what
        ``jaxpar.Trainer`` logs MFU from."""
        return gpt_flops_per_token(self.cfg, seq_len)

    def __call__(self, tokens, positions=None):
        """Logits [B, S, vocab]; ``positions`` [B, S] when the tokens were reordered (context parallel)."""
        return self.logits(self.run_blocks(self.embed(tokens, positions), positions))


def gpt_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Model FLOPs per token of one training step (forward + backward = 3 × forward): 6 per weight
    a token multiplies by — q, k, v and output projections, the MLP (an MoE layer's router,
    shared experts and ``top_k`` routed experts: the active ones) and the head; not the
    embedding tables (lookups) nor norms and biases — plus causal attention's scores and
    values, ``6 · layers · seq · embed`` (PaLM's 12, halved by the causal mask).

    >>> gpt_flops_per_token(GPTConfig(vocab_size=16, seq_len=8, embed=32, heads=4, mlp=64, layers=2))
    104448.0
    """
    seq = cfg.seq_len if seq_len is None else seq_len
    e = cfg.embed
    if cfg.moe is None:
        mlp = 2 * e * cfg.mlp
    else:
        f = cfg.moe.expert_mlp or cfg.mlp
        mlp = e * cfg.moe.experts + 3 * e * f * (cfg.moe.top_k + cfg.moe.shared_experts)
    matmul = cfg.layers * (4 * e * cfg.heads * cfg.head_dim + mlp) + e * cfg.vocab_size
    return 6.0 * matmul + 6.0 * cfg.layers * seq * cfg.heads * cfg.head_dim


def loss_fn(model: GPT, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy; ``batch`` holds ``inputs`` and ``targets`` [B, S] (and
    ``positions`` when context-parallel placement reordered the sequence). With
    ``cfg.loss_chunks=N`` the head and the loss run in N token groups (fp32 logits per group)."""
    positions = batch.get("positions")
    h = model.run_blocks(model.embed(batch["inputs"], positions), positions)
    loss = head_loss(model.ln_f, model.head, h, batch, model.cfg.loss_chunks, model.constrain)
    # MoE layers recorded their load-balancing and z-losses during the forward pass
    return loss + moe_aux_loss(model) if model.cfg.moe is not None else loss


def head_loss(ln_f, w, h, batch, chunks: int, constrain=no_constraint) -> jax.Array:
    """The loss of the last hidden states ``h``: final norm, head ``w`` and cross-entropy, from the
    full logits (``chunks=0``) or by `jaxpar.ops.chunked_cross_entropy` in ``chunks`` token groups."""
    if chunks:
        return chunked_cross_entropy(ln_f(h), w[...], batch["targets"], chunks=chunks, constrain=constrain)
    return optax.softmax_cross_entropy_with_integer_labels(ln_f(h) @ w[...], batch["targets"]).mean()


# Former names (CHANGELOG.md), e.g. pipeline_loss (now in the *_parallel module beside this one):
# resolved by name when asked for, with a DeprecationWarning, so this file imports nothing parallel.
__getattr__ = module_getattr(__name__)
