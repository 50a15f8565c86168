"""MFU is logged from model FLOPs: the model's closed form (Llama scanned and unrolled, MoE Llama
with its active experts), a ``flops_per_token`` the user gives, or — labelled — XLA's count.

XLA's count is not model FLOPs: it counts a ``scan`` body once (and on a GPU misses cuBLAS and
cuDNN calls), so a scanned model's XLA-based MFU is several times too low. These runs are on
one CPU device with a made-up peak; what they check is that the logged MFU is the closed form
at the logged tokens/s.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.metrics import MetricsConfig, read_jsonl
from jaxpar.models.llama import Llama, LlamaConfig, flops_per_token, loss_fn
from jaxpar.report import flops

PEAK = 1e12
BATCH, SEQ = 4, 32


def _batches(n: int, vocab: int):
    rng = np.random.default_rng(0)
    for _ in range(n):
        tokens = rng.integers(0, vocab, (BATCH, SEQ + 1), dtype=np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _run(tmp_path, cfg: LlamaConfig, **metrics):
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), config, mesh)
    with jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh,
                        metrics=MetricsConfig(dir=str(tmp_path), every=2, peak_flops=PEAK, **metrics)) as trainer:
        trainer.fit(_batches(4, cfg.vocab_size), steps=4, progress=False)
        compiled = trainer.lower(next(_batches(1, cfg.vocab_size))).compile()
    return [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "mfu" in r], compiled


CASES = {
    "unrolled": LlamaConfig.named("tiny", layers=4),
    "scanned": LlamaConfig.named("tiny", layers=4, scan_layers=True),
    "moe": LlamaConfig.named("tiny", layers=2, moe={"experts": 4, "top_k": 2}),
}


@pytest.mark.parametrize("name", CASES)
def test_logged_mfu_is_the_closed_form_at_the_logged_speed(tmp_path, name):
    cfg = CASES[name]
    records, compiled = _run(tmp_path, cfg)
    closed_form = flops_per_token(cfg, SEQ)
    for r in records:
        assert r["mfu"] == pytest.approx(closed_form * r["tokens_per_s"] / PEAK, rel=0.02)
        assert r["hfu"] == pytest.approx(flops(compiled) * r["tokens_per_s"] / (BATCH * SEQ) / PEAK, rel=0.02)
    assert records[0]["mfu_source"] == "model"
    assert records[0]["flops_per_step"] == pytest.approx(closed_form * BATCH * SEQ)
    if name == "scanned":     # XLA counts the scanned body once: its count is far below the model's
        assert flops(compiled) < 0.6 * closed_form * BATCH * SEQ


def test_given_flops_per_token_wins_and_xla_is_labelled(tmp_path):
    cfg = CASES["unrolled"]
    given, _ = _run(tmp_path / "given", cfg, flops_per_token=1e6)
    assert given[0]["mfu_source"] == "given"
    assert given[0]["mfu"] == pytest.approx(1e6 * given[0]["tokens_per_s"] / PEAK, rel=0.02)

    class Plain(Llama):     # a model without a closed form
        flops_per_token = None

    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    model = jaxpar.init(lambda: Plain(cfg, rngs=nnx.Rngs(0)), config, mesh)
    with jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh,
                        metrics=MetricsConfig(dir=str(tmp_path / "xla"), every=2, peak_flops=PEAK)) as trainer:
        trainer.fit(_batches(2, cfg.vocab_size), steps=2, progress=False)
    records = [r for r in read_jsonl(tmp_path / "xla" / "metrics.jsonl") if "mfu" in r]
    assert records[0]["mfu_source"] == "xla" and "hfu" not in records[0]


def test_metrics_config_refuses_a_bad_flops_per_token(tmp_path):
    with pytest.raises((ValueError, TypeError), match="flops_per_token"):
        MetricsConfig(dir=str(tmp_path), flops_per_token=-1.0)
