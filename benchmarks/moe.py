"""Mixture of experts: training throughput and per-device memory vs the number of experts.

A small scanned Llama whose every MLP is an MoE layer, trained with adamw under 8-way expert
parallel inside data parallel (``rules={"batch": "data", "expert": "data"}``, 8 simulated CPU
devices). Active parameters per token are fixed: top-2 routing over experts of hidden width
``mlp / 2``, so every token runs the FLOPs of one dense MLP of width ``mlp`` whatever the number of
experts; only the stored experts (and the exchange buffers) grow. A dense model (no MoE) with the
same active parameters is the first row.

For each: compile seconds, median step time and tokens/s (steps taken in turns, see
``benchmarks/step.py``), per-device memory of the compiled step (``jaxpar.report.memory``:
arguments, temp, total) and the all-to-all count of the compiled step.

    python benchmarks/moe.py              # writes benchmarks/results/moe_cpu.{json,png} (~3 min on 2 cores)
    python benchmarks/moe.py --replot     # redraws the PNG from the JSON
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import jaxpar  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn, param_count  # noqa: E402
from jaxpar.nn import MoEConfig  # noqa: E402
from jaxpar.report import memory  # noqa: E402
from step import time_interleaved  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
BASE = dict(vocab_size=256, embed=64, heads=4, kv_heads=2, mlp=128, layers=2, max_seq_len=32, scan_layers=True)
EXPERTS = (8, 16, 32, 64)
BATCH, SEQ, WARMUP, STEPS = 16, 32, 2, 10


def model_config(experts: int | None) -> LlamaConfig:
    if experts is None:
        return LlamaConfig(**BASE)
    return LlamaConfig(**BASE, moe=MoEConfig(experts=experts, top_k=2, expert_mlp=BASE["mlp"] // 2))


def build(experts: int | None, batch: dict):
    rules = {"batch": "data"} if experts is None else {"batch": "data", "expert": "data"}
    config = jaxpar.ParallelConfig(mesh={"data": 8}, rules=rules)
    mesh = jaxpar.make_mesh(config)
    constrain = jaxpar.nn.model_constraint(mesh, config)
    cfg = model_config(experts)
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    placed = trainer.place(batch)
    t0 = time.perf_counter()
    compiled = trainer.lower(placed).compile()
    compile_s = time.perf_counter() - t0
    mem = memory(compiled)
    row = {"experts": experts or 0, "params": param_count(cfg), "compile_s": round(compile_s, 2),
           "argument_bytes": mem.argument_bytes, "temp_bytes": mem.temp_bytes, "total_bytes": mem.total,
           "all_to_all_instructions": len(re.findall(r"= .*? all-to-all\(", compiled.as_text()))}
    return row, lambda: (trainer.step(placed), trainer.params)


def main() -> None:
    batch = ArithmeticData(SEQ).batch(BATCH, 0)
    rows, runs = [], []
    for experts in (None, *EXPERTS):
        row, run = build(experts, batch)
        rows.append(row)
        runs.append(run)
        print(f"built experts={row['experts']} (compile {row['compile_s']} s)", flush=True)
    for row, times in zip(rows, time_interleaved(runs, WARMUP, STEPS)):
        row["step_ms"] = round(1e3 * statistics.median(times), 2)
        row["tokens_per_s"] = round(BATCH * SEQ / statistics.median(times))
    print(f"{'experts':>8} {'params':>9} {'compile s':>9} {'step ms':>8} {'tokens/s':>9} "
          f"{'args MiB':>9} {'temp MiB':>9} {'total MiB':>9} {'a2a':>4}")
    for r in rows:
        print(f"{r['experts'] or 'dense':>8} {r['params']:>9} {r['compile_s']:>9} {r['step_ms']:>8} "
              f"{r['tokens_per_s']:>9} {r['argument_bytes'] / 2**20:>9.2f} {r['temp_bytes'] / 2**20:>9.2f} "
              f"{r['total_bytes'] / 2**20:>9.2f} {r['all_to_all_instructions']:>4}")
    RESULTS.mkdir(exist_ok=True)
    out = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "model": BASE,
           "top_k": 2, "expert_mlp": BASE["mlp"] // 2, "batch": BATCH, "seq": SEQ, "steps": STEPS, "rows": rows}
    platform = jax.devices()[0].platform
    (RESULTS / f"moe_{platform}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, RESULTS / f"moe_{platform}.png")


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    moe = [r for r in rows if r["experts"]]
    dense = next(r for r in rows if not r["experts"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["experts"] for r in moe], [r["tokens_per_s"] for r in moe], "o-", label="MoE, EP=8, top-2")
    a.axhline(dense["tokens_per_s"], color="gray", ls="--", label="dense, same active parameters")
    a.set(xscale="log", xlabel="experts", ylabel="tokens/s (8 CPU devices)", title="throughput")
    b.plot([r["experts"] for r in moe], [r["total_bytes"] / 2**20 for r in moe], "o-", label="total")
    b.plot([r["experts"] for r in moe], [r["argument_bytes"] / 2**20 for r in moe], "s-", label="arguments")
    b.set(xscale="log", xlabel="experts", ylabel="MiB per device", title="per-device memory")
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(EXPERTS, [str(e) for e in EXPERTS])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    if "--replot" in sys.argv:        # redraw the PNG from the saved JSON
        name = f"moe_{jax.devices()[0].platform}"
        plot(json.loads((RESULTS / f"{name}.json").read_text())["rows"], RESULTS / f"{name}.png")
    else:
        main()
