"""Loader benchmark: tokens/s the TokenLoader delivers vs tokens/s the tiny Llama consumes per step.

Builds a byte-level token store from the generated arithmetic corpus (``jaxpar data prepare``'s
``prepare``), then measures

* **loader**: batches taken from a `jaxpar.data.TokenLoader` (packed, shuffled, background
  prefetch) for ``--seconds``, at the model's shape (global batch x seq_len) and at a long
  shape (8 x 2048): tokens / wall second;
* **model**: the tiny Llama (vocabulary 264 for the byte tokenizer) trained with adamw under
  data parallel over every device (8 simulated CPU devices without an accelerator): global
  batch x seq_len / median step time
  (``jax.block_until_ready`` after each step, after a warm-up);
* **fit with the loader**: ``Trainer.fit(loader)`` against ``Trainer.fit`` over batches already
  in memory, per step: what reading from the store costs the training loop.

    python benchmarks/loader.py                              # ~1 minute on 2 CPU cores
    python benchmarks/loader.py --out /tmp/loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import jax

if __name__ == "__main__":  # before JAX starts its backend
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_BENCH_DEVICES", "8")))

import optax
from flax import nnx

import jaxpar
from jaxpar.data import TokenLoader, prepare
from jaxpar.models.data import arithmetic_text
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn

HERE = os.path.dirname(os.path.abspath(__file__))


def loader_rate(store, seq_len: int, batch: int, seconds: float) -> dict:
    """Tokens per second taken from a prefetching loader (the consumer does nothing else)."""
    loader = TokenLoader(store, seq_len=seq_len, global_batch=batch, seed=0, prefetch=4)
    next(loader)                                    # start the thread, draw the epoch's order
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(loader)
        n += 1
    took = time.perf_counter() - start
    loader.close()
    return {"seq_len": seq_len, "global_batch": batch, "batches": n, "seconds": took,
            "tokens_per_s": n * batch * seq_len / took}


def trainer(cfg: LlamaConfig) -> jaxpar.Trainer:
    config = jaxpar.ParallelConfig(mesh={"data": -1}, mode="data")     # every device there is
    return jaxpar.Trainer(Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config,
                          jaxpar.make_mesh(config))


def model_rate(store, cfg: LlamaConfig, batch: int, steps: int) -> dict:
    """Tokens per second the tiny Llama trains on (median step, each waited for)."""
    t = trainer(cfg)
    loader = TokenLoader(store, seq_len=cfg.max_seq_len, global_batch=batch, seed=1, prefetch=0)
    data = [next(loader) for _ in range(steps)]
    for b in data[:3]:
        jax.block_until_ready(t.step(b))            # compile and warm up
    times = []
    for b in data:
        start = time.perf_counter()
        jax.block_until_ready(t.step(b))
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"seq_len": cfg.max_seq_len, "global_batch": batch, "steps": steps, "median_step_s": step,
            "tokens_per_s": batch * cfg.max_seq_len / step}


def fit_overhead(store, cfg: LlamaConfig, batch: int, steps: int) -> dict:
    """Seconds per step of fit(loader) and of fit(batches in memory), alternating, best of 5."""
    t = trainer(cfg)
    make = lambda: TokenLoader(store, seq_len=cfg.max_seq_len, global_batch=batch, seed=2)
    source = make()
    held = [next(source) for _ in range(steps)]
    t.fit(held, 3, progress=False)                  # compile
    best = {"loader": float("inf"), "in_memory": float("inf")}
    for _ in range(5):
        for kind in best:
            t.data_state = {}                       # each loader run starts at batch 0
            start = time.perf_counter()
            t.fit(make() if kind == "loader" else held, steps, log_every=steps, progress=False)
            best[kind] = min(best[kind], (time.perf_counter() - start) / steps)
    return {"steps": steps, "s_per_step_loader": best["loader"], "s_per_step_in_memory": best["in_memory"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=200_000, help="lines of the generated corpus")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds each loader measurement runs")
    p.add_argument("--batch", type=int, default=32, help="global batch of the model step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=os.path.join(HERE, "results", "loader_cpu.json"))
    args = p.parse_args()
    cfg = LlamaConfig.named("tiny", vocab_size=264)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "corpus.txt"), "w") as f:
            f.write(arithmetic_text(args.lines, seed=0))
        start = time.perf_counter()
        store = prepare([os.path.join(tmp, "corpus.txt")], os.path.join(tmp, "store"), docs="line", progress=False)
        prepared = {"tokens": store.num_tokens, "seconds": time.perf_counter() - start}
        prepared["tokens_per_s"] = prepared["tokens"] / prepared["seconds"]
        at_model = loader_rate(store, cfg.max_seq_len, args.batch, args.seconds)
        long = loader_rate(store, 2048, 8, args.seconds)
        model = model_rate(store, cfg, args.batch, args.steps)
        fit = fit_overhead(store, cfg, args.batch, args.steps)
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "devices": f"{jax.device_count()} x {jax.devices()[0].platform}"},
              "prepare": prepared, "loader_at_model_shape": at_model, "loader_long_rows": long,
              "tiny_llama_step": model, "fit": fit,
              "loader_over_model": at_model["tokens_per_s"] / model["tokens_per_s"]}
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
