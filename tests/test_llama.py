"""The Llama-3 family: an independent numpy forward, attention paths, parallel training = one device."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import assert_close, assert_losses_close, batches
from jaxpar.models.llama import Llama, LlamaConfig, RopeScaling, attention, flops_per_token, loss_fn, param_count
from jaxpar.models.llama_parallel import pipeline_loss

# ----------------------------------------------------------------------------- numpy reference
# Written from the Llama-3 description alone: it shares no code with jaxpar.models.llama and
# reads the weights out of the model's state.


def np_rope_freqs(cfg) -> np.ndarray:
    freqs = [cfg.rope_theta ** (-2.0 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
    s = cfg.rope_scaling
    if s is None:
        return np.array(freqs)
    out = []
    for f in freqs:   # Meta's apply_scaling, one frequency at a time
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_positions / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_positions / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def np_rope(x, freqs):
    """x [S, H, D]; pair j of a head is (x[j], x[j + D/2]) rotated by position * freqs[j]."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for pos in range(x.shape[0]):
        c, s = np.cos(pos * freqs), np.sin(pos * freqs)
        a, b = x[pos, :, :half], x[pos, :, half:]
        out[pos, :, :half] = a * c - b * s
        out[pos, :, half:] = a * s + b * c
    return out


def np_rmsnorm(x, scale, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def np_attention(x, w, cfg):
    """One sequence x [S, E]: causal grouped-query attention, K/V repeated per group."""
    n, s = cfg.heads, x.shape[0]
    q, k, v = (np.einsum("se,ehd->shd", x, w[name]) for name in ("wq", "wk", "wv"))
    q, k = np_rope(q, np_rope_freqs(cfg)), np_rope(k, np_rope_freqs(cfg))
    k, v = np.repeat(k, n // cfg.kv_heads, axis=1), np.repeat(v, n // cfg.kv_heads, axis=1)
    out = np.zeros_like(q)
    for h in range(n):
        scores = q[:, h] @ k[:, h].T / np.sqrt(cfg.head_dim)
        scores[np.triu_indices(s, 1)] = -np.inf
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h]
    return np.einsum("shd,hde->se", out, w["wo"])


def np_forward(params, cfg, tokens):
    """Logits [S, vocab] of one unpacked sequence."""
    layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree) if cfg.scan_layers else tree[i]  # noqa: E731
    x = params["embedding"][tokens]
    for i in range(cfg.layers):
        b = layer(params["blocks"], i)
        x = x + np_attention(np_rmsnorm(x, b["attn_norm"]["scale"], cfg.norm_eps), b["attn"], cfg)
        h = np_rmsnorm(x, b["mlp_norm"]["scale"], cfg.norm_eps)
        gate = h @ b["mlp"]["gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ b["mlp"]["up"])) @ b["mlp"]["down"]
    head = params["embedding"].T if cfg.tie_embeddings else params["head"]
    return np_rmsnorm(x, params["norm"]["scale"], cfg.norm_eps) @ head


def random_model(cfg, seed=0):
    """A model whose every parameter (norm scales included) is random, so logits are O(1)."""
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)

    def draw(path, x):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.asarray(1 + 0.2 * rng.normal(size=x.shape), jnp.float32)
        stacked = cfg.scan_layers and "blocks" in jax.tree_util.keystr(path)
        fan_in = x.shape[1 if stacked else 0]
        return jnp.asarray(rng.normal(size=x.shape) / np.sqrt(fan_in), jnp.float32)

    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return model, params


@nnx.jit
def forward(model, tokens, segment_ids=None):
    return model(tokens, segment_ids)


TINY = LlamaConfig.named("tiny")
SCALED = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=128)
FORWARD_CASES = {
    "gqa": TINY,
    "gqa scanned, rope scaling": LlamaConfig.named("tiny", scan_layers=True, rope_theta=10000.0, rope_scaling=SCALED),
    "mqa tied": LlamaConfig.named("tiny", kv_heads=1, tie_embeddings=True, attention="reference"),
}


def test_rope_scaling_case_hits_every_band():
    """The scaled case keeps one frequency, blends one and divides two: all branches are checked."""
    cfg = FORWARD_CASES["gqa scanned, rope scaling"]
    ratio = np_rope_freqs(cfg) / np_rope_freqs(LlamaConfig.named("tiny", rope_theta=10000.0))
    assert ratio[0] == 1 and 1 / SCALED.factor < ratio[1] < 1 and np.allclose(ratio[2:], 1 / SCALED.factor)


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_logits_equal_numpy_reference(name):
    cfg = FORWARD_CASES[name]
    model, params = random_model(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, cfg.max_seq_len))
    logits = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(logits).max() > 1.0                      # random weights: logits far from zero
    for row in range(2):
        np.testing.assert_allclose(logits[row], np_forward(params, cfg, tokens[row]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["xla", "reference"])
def test_packed_sequences_equal_separate_sequences(kind):
    """With segment ids each segment's logits are those of the segment run alone (positions from 0)."""
    cfg = LlamaConfig.named("tiny", attention=kind, rope_theta=10000.0, rope_scaling=SCALED,
                            scan_layers=kind == "reference")     # segment ids reach scanned blocks too
    model, params = random_model(cfg, seed=3)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 16))
    segments = np.array([[1] * 6 + [2] * 7 + [0] * 3, [5] * 3 + [6] * 13])
    logits = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(segments, jnp.int32)))
    for row in range(2):
        for seg in np.unique(segments[row]):
            where = segments[row] == seg
            np.testing.assert_allclose(logits[row][where], np_forward(params, cfg, tokens[row][where]),
                                       rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- attention paths

def test_attention_paths_agree_with_gradients():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 8, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 3]], 2, 0).repeat(4, 1), jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(kind, seg):
        f = lambda q, k, v: attention(q, k, v, seg, kind=kind)   # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(jnp.cos(out))

    for seg_ids in (None, seg):
        expected = run("reference", seg_ids)
        for kind in ("xla", "auto"):
            assert_close(run(kind, seg_ids), expected, rtol=1e-6, what=f"{kind} segments={seg_ids is not None}")


def test_model_logits_agree_across_attention_kinds():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, 16)), jnp.int32)
    outs = {kind: np.asarray(forward(random_model(LlamaConfig.named("tiny", attention=kind))[0], tokens))
            for kind in ("auto", "xla", "reference")}
    np.testing.assert_allclose(outs["xla"], outs["reference"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs["auto"], outs["xla"], rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_stays_near_float32():
    """bf16 activations (fp32 norms, RoPE angles, softmax and logits) track the fp32 model."""
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, size=(2, 16)), jnp.int32)
    fp32 = np.asarray(forward(random_model(TINY)[0], tokens))
    bf16 = forward(random_model(LlamaConfig.named("tiny", dtype="bfloat16"))[0], tokens)
    assert bf16.dtype == jnp.float32
    err = np.abs(np.asarray(bf16) - fp32).max() / np.abs(fp32).max()
    assert 1e-4 < err < 3e-2            # visibly bf16, and still the same function


# ----------------------------------------------------------------------------- parallel = one device

# 8 query heads over 4 key/value heads: both split 4 ways over "model", 2 ways over "x".
TRAIN = LlamaConfig.named("tiny", heads=8, kv_heads=4, scan_layers=True)
MEGATRON = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
PARALLEL = {
    "data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"),
    # the loss per device in a shard_map: the head's custom_vjp sees per-device hidden states
    "hybrid data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid"),
    "megatron data=2,model=4": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON),
    "2D x=2,y=4 remat": jaxpar.ParallelConfig(
        mesh={"x": 2, "y": 4}, remat="full",
        rules={"batch": "x", "embed": "y", "heads": "x", "kv_heads": "x", "mlp": "x", "vocab": "x"}),
    "zero3 data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data",
                                          optimizer={"level": 3, "threshold_kb": 0}),
    "pipeline 1f1b pipe=2,data=4": jaxpar.ParallelConfig(
        mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
        pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"}),
}


def train(config, cfg=TRAIN, steps=5, sharded_init=False):
    """Losses and final parameters of ``steps`` adamw steps. The model is built on one device and
    placed by the Trainer (its eager init is compiled once for all runs), or, with ``sharded_init``,
    built directly sharded by ``jaxpar.init``: both must give the one-device run."""
    n = math.prod(config.mesh.values())
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    build = lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain)   # noqa: E731
    model = jaxpar.init(build, config, mesh) if sharded_init else build()
    loss = pipeline_loss() if config.pipeline.stages > 1 else loss_fn
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss, config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(steps, seq=cfg.max_seq_len)]
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    return losses, params, trainer


@functools.lru_cache(maxsize=1)
def reference():
    losses, params, _ = train(jaxpar.ParallelConfig(mesh={"data": 1}))
    return losses, params


@pytest.mark.parametrize("name", PARALLEL)
def test_training_matches_one_device(name):
    # the 2D case also recomputes every block (ParallelConfig.remat: the same reference)
    losses, params, trainer = train(PARALLEL[name], sharded_init=name.startswith("megatron"))
    ref_losses, ref_params = reference()
    assert ref_losses[-1] < ref_losses[0]
    assert_losses_close(losses, ref_losses, rtol=1e-5)
    assert_close(params, ref_params, rtol=5e-5, what=name)
    wk = trainer.model.blocks.attn.wk.get_value().sharding.spec
    expected = {"megatron data=2,model=4": P(None, None, "model", None), "2D x=2,y=4 remat": P(None, "y", "x", None),
                "pipeline 1f1b pipe=2,data=4": P("pipe", None, None, None)}
    if name in expected:                    # the layout the rules ask for, so the test splits heads
        assert wk == expected[name]
    if name.startswith("zero3"):            # parameters stored split over data between steps
        assert "data" in str(trainer.params["blocks"]["mlp"]["up"].get_value().sharding.spec)


def test_unrolled_tied_model_under_megatron_equals_numpy_reference():
    """Unrolled blocks and a tied table split over vocab (for the lookup and the head), on 8 devices."""
    cfg = LlamaConfig.named("tiny", heads=8, kv_heads=4, tie_embeddings=True)
    config = PARALLEL["megatron data=2,model=4"]
    mesh = jaxpar.make_mesh(config)
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    assert model.embedding.get_value().sharding.spec == P("model", None)
    assert model.blocks[1].attn.wk.get_value().sharding.spec == P(None, "model", None)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 16))
    logits = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32)))
    for row in range(2):
        np.testing.assert_allclose(logits[row], np_forward(params, cfg, tokens[row]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sizes

def _count(cfg) -> int:
    abstract = jaxpar.nn.abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name, known", [("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9), ("1b", 1.24e9)])
def test_named_sizes_have_the_published_parameter_counts(name, known):
    cfg = LlamaConfig.named(name, scan_layers=True)
    assert abs(param_count(cfg) - known) / known < 0.01
    if name != "llama3_70b":                # the abstract model counts the same (no memory used)
        assert _count(cfg) == param_count(cfg)


@pytest.mark.parametrize("cfg", [TINY, FORWARD_CASES["mqa tied"], TRAIN, LlamaConfig.named("125m", layers=1)])
def test_param_count_matches_the_model(cfg):
    assert _count(cfg) == param_count(cfg)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(heads=4, kv_heads=3), ValueError, r"kv_heads=3 does not divide heads=4.*\[1, 2, 4\]"),
    (dict(embed=36, heads=4), ValueError, r"head_dim=9 is odd.*even head_dim"),
    (dict(embed=30, heads=4), ValueError, r"embed=30 is not divisible by heads=4"),
    (dict(attention="flash"), ValueError, r"attention='flash' is not one of"),
    (dict(layers=0), ValueError, r"layers=0 must be a positive int"),
    (dict(dtype="float64"), ValueError, r"dtype='float64'"),
    (dict(remat="full"), TypeError, r"no recompute policy; set ParallelConfig\(remat='full'\)"),
    (dict(rope_scaling={"low_freq_factor": 4.0, "high_freq_factor": 1.0}), ValueError, r"low_freq_factor < high"),
    (dict(rope_scaling=8.0), TypeError, r"rope_scaling must be a RopeScaling"),
])
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        LlamaConfig.named("tiny", **kwargs)


def test_bad_model_input():
    with pytest.raises(ValueError, match=r"no Llama size named 'llama4'.*llama3_8b"):
        LlamaConfig.named("llama4")
    assert LlamaConfig.named("tiny", rope_scaling={"factor": 2.0}).rope_scaling == RopeScaling(factor=2.0)
    model = Llama(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"integer token ids.*float32 \(2, 16\)"):
        model(jnp.zeros((2, 16)))
    with pytest.raises(TypeError, match=r"integer token ids.*float32 \(2, 16\)"):
        model.embed(jnp.zeros((2, 16)))       # how a pipeline's first stage embeds
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 8\) but tokens \(2, 16\)"):
        model(jnp.zeros((2, 16), jnp.int32), segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"needs batch\['targets'\].*\['inputs'\]"):
        loss_fn(model, {"inputs": jnp.zeros((2, 16), jnp.int32)})
    with pytest.raises(TypeError, match="takes a LlamaConfig"):
        Llama({"embed": 32}, rngs=nnx.Rngs(0))


def packed_batches(steps: int, seq: int):
    """The training batches packed: each row is two segments of random lengths and a padding
    tail (segment 0), so the micro-batches keep different numbers of tokens."""
    rng = np.random.default_rng(0)
    out = []
    for batch in batches(steps, seq=seq):
        rows = []
        for _ in range(batch["inputs"].shape[0]):
            a, b = sorted(rng.choice(np.arange(2, seq - 1), 2, replace=False))
            rows.append([1] * a + [2] * (b - a) + [0] * (seq - b))
        out.append(dict(batch, segment_ids=np.asarray(rows, np.int32)))
    return out


def test_packed_batches_through_pipeline_stages_equal_one_device_accumulating():
    # every stage's blocks get the micro-batch's segment ids (attention inside a segment,
    # positions restarting); the loss is each micro-batch's mean over its kept tokens, averaged
    # over the micro-batches, as gradient accumulation over the same 4 micro-batches computes it
    def run(config):
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:math.prod(config.mesh.values())])
        model = Llama(TRAIN, rngs=nnx.Rngs(0), constrain=jaxpar.LogicalConstraint(mesh, config.rules))
        loss = pipeline_loss() if config.pipeline.stages > 1 else loss_fn
        trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss, config, mesh)
        losses = [float(trainer.step(b)["loss"]) for b in packed_batches(3, TRAIN.max_seq_len)]
        return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))

    losses, params = run(PARALLEL["pipeline 1f1b pipe=2,data=4"])
    ref_losses, ref_params = run(jaxpar.ParallelConfig(mesh={"data": 1}, grad_accum=4))
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params)


def test_pipeline_loss_equals_the_loss_for_a_tied_table():
    # a tied table is read by the first stage and the last (tests/test_pipeline_stages.py trains it)
    tokens = jnp.zeros((2, 16), jnp.int32)
    tied = Llama(LlamaConfig.named("tiny", scan_layers=True, tie_embeddings=True), rngs=nnx.Rngs(0))
    batch = {"inputs": tokens + 3, "targets": tokens + 5}
    np.testing.assert_allclose(pipeline_loss()(tied, batch), loss_fn(tied, batch), rtol=1e-6)
    # and a packed batch: the same segment ids reach the stacked blocks
    packed = packed_batches(1, TRAIN.max_seq_len)[0]
    model = Llama(TRAIN, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(pipeline_loss()(model, packed), loss_fn(model, packed), rtol=1e-5)


def test_padding_segment_is_left_out_of_the_loss():
    model, _ = random_model(TINY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 16)), jnp.int32)
    seg = jnp.asarray([[1] * 10 + [0] * 6, [1] * 16], jnp.int32)
    full = optax.softmax_cross_entropy_with_integer_labels(forward(model, tokens, seg), tokens)
    expected = (full[0, :10].sum() + full[1].sum()) / 26
    got = nnx.jit(loss_fn)(model, {"inputs": tokens, "targets": tokens, "segment_ids": seg})
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)


def test_flops_per_token_is_close_to_what_xla_counts():
    """The analytic count against XLA's for one gradient of an unrolled model (XLA also counts
    the elementwise work and the masked half of the scores, so it is a little higher)."""
    cfg = LlamaConfig.named("tiny", embed=128, mlp=512, vocab_size=256, max_seq_len=64)
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    batch = {"inputs": jnp.zeros((4, 64), jnp.int32), "targets": jnp.zeros((4, 64), jnp.int32)}
    step = jax.jit(jax.grad(lambda s, b: loss_fn(nnx.merge(graphdef, s), b)))
    counted = step.lower(state, batch).cost_analysis()["flops"] / (4 * 64)   # from the HLO, no compile
    assert 1.0 <= counted / flops_per_token(cfg) < 1.1
