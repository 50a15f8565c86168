"""How honest is jaxpar.auto's cost model? Predicted against compiled, per strategy.

For hand strategies of the example GPT on 8 devices, and for ZeRO levels and micro-batch
counts on data parallel, compares the cost model's collective bytes, collective count (the
collectives priced with a latency, after XLA's combiner), argument bytes and temp bytes
with the compiled step (HLO collectives × executions, ``memory_analysis``); then the
strategy the search picks for a 4096-row batch on data=8. Needs 8 devices: it runs on 8
simulated CPU devices on any machine (``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here if unset); with
``JAX_PLATFORMS=cuda`` on 8 GPUs it reads their compiled programs instead.

    python benchmarks/cost_model.py        # prints the table, writes results/cost_model_cpu.json|png
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # compiled programs, not timings: any machine
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.auto import CostParams, build_graph, hand_strategy, search  # noqa: E402
from jaxpar.auto.assign import hand_axes  # noqa: E402
from jaxpar.auto.pricing import micro_batch, price  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from jaxpar.report import collectives, memory  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MEG = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
STRATEGIES = {
    "data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"),
    "data=2 x model=4 (Megatron)": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEG),
    "model=8": jaxpar.ParallelConfig(mesh={"model": 8}, rules={"heads": "model", "mlp": "model", "vocab": "model"}),
    "Megatron, vocab whole": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                                   rules={"batch": "data", "heads": "model", "mlp": "model"}),
    "batch=data, embed=model": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                                     rules={"batch": "data", "embed": "model"}),
    "data=2": jaxpar.ParallelConfig(mesh={"data": 2}, mode="data"),
    "model=2": jaxpar.ParallelConfig(mesh={"model": 2}, rules={"heads": "model", "mlp": "model", "vocab": "model"}),
}
MODELS = {
    "embed 32 (tiny)": GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=2),
    "embed 64": GPTConfig(vocab_size=16, seq_len=16, embed=64, heads=8, mlp=256, layers=2),
    "embed 128": GPTConfig(vocab_size=64, seq_len=32, embed=128, heads=8, mlp=512, layers=2),
    "embed 64, scanned layers": GPTConfig(vocab_size=16, seq_len=16, embed=64, heads=8, mlp=256, layers=2,
                                          scan_layers=True),
}


def compiled(gpt, config, batch):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[: math.prod(config.mesh.values())])
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    c = trainer.lower(batch).compile()
    cols = collectives(c, mesh)
    return memory(c), sum(x.bytes * x.executions for x in cols), sum(x.executions for x in cols)


def main():
    rows = []
    print(f"{'model':<26} {'strategy':<30} {'comm pred/HLO':>14} {'count pred/HLO':>15} {'args pred/HLO':>14} "
          f"{'temp pred/HLO':>14} {'total pred/HLO':>15}")
    for mname, gpt in MODELS.items():
        batch = ArithmeticData(gpt.seq_len).batch(16, 0)
        graph = build_graph(GPT(gpt, rngs=nnx.Rngs(0)), loss_fn, batch)
        for sname, config in STRATEGIES.items():
            plan = hand_strategy(None, loss_fn, batch, config, config.mesh, graph=graph)
            mem, hlo, count = compiled(gpt, config, batch)
            row = {"model": mname, "strategy": sname, "comm_pred": plan.cost["comm_bytes"], "comm_hlo": hlo,
                   "count_pred": plan.cost["comm_count"], "count_hlo": count,
                   "args_pred": plan.cost["argument_bytes"], "args_hlo": mem.argument_bytes,
                   "temp_pred": plan.cost["temp_bytes"], "temp_hlo": mem.temp_bytes,
                   "total_pred": plan.cost["memory_bytes"], "total_hlo": mem.total}
            rows.append(row)
            print(f"{mname:<26} {sname:<30} {row['comm_pred'] / max(hlo, 1):>14.3f} "
                  f"{row['count_pred']:>8g}/{count:<6} "
                  f"{row['args_pred'] / mem.argument_bytes:>14.3f} {row['temp_pred'] / mem.temp_bytes:>14.3f} "
                  f"{row['total_pred'] / mem.total:>15.3f}", flush=True)
    gpt = MODELS["embed 64"]
    batch = ArithmeticData(gpt.seq_len).batch(32, 0)
    print(f"\nZeRO and micro-batches, data=8, {gpt.embed=}, batch 32 (planner's `price`)")
    for zero, k in [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2), (2, 2), (3, 2), (0, 4), (2, 4), (3, 4)]:
        config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", grad_accum=k,
                                       optimizer=jaxpar.OptimizerConfig(level=zero, threshold_kb=0))
        graph = build_graph(GPT(gpt, rngs=nnx.Rngs(0)), loss_fn, micro_batch(batch, k) if k > 1 else batch)
        axes = hand_axes(graph, dataclasses.replace(config, grad_accum=1), {"data": 8})
        _, args, temp = price(graph, axes, {"data": 8}, CostParams(), zero=zero, grad_accum=k, threshold_kb=0)
        mem, _, _ = compiled(gpt, config, batch)
        rows.append({"model": "embed 64", "strategy": f"data=8 zero={zero} grad_accum={k}",
                     "args_pred": args, "args_hlo": mem.argument_bytes, "temp_pred": temp, "temp_hlo": mem.temp_bytes,
                     "total_pred": args + temp, "total_hlo": mem.total})
        print(f"  zero={zero} grad_accum={k}: arguments {args:,} / {mem.argument_bytes:,}, temp {temp:,} / "
              f"{mem.temp_bytes:,}, total {(args + temp) / mem.total:.3f}", flush=True)
    searches = _large_batch_search()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "cost_model_cpu.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows, "searches": searches}, f, indent=1)
    _plot(rows)


def _large_batch_search():
    """The dynamic-programming search on a 4096-row batch, data=8: does it split the batch?"""
    gpt = MODELS["embed 32 (tiny)"]
    batch = ArithmeticData(gpt.seq_len).batch(4096, 0)
    graph = build_graph(GPT(gpt, rngs=nnx.Rngs(0)), loss_fn, batch)
    machines = {"GPU-like defaults": CostParams(),
                "slow test machine": CostParams(flops_per_s=1e9, default_bandwidth=1e9, latency=1e-6)}
    out = []
    print("\nsearch, 4096-row batch, tiny GPT, mesh data=8")
    for mname, params in machines.items():
        config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="auto", search="dynamic_programming")
        plan = search(None, loss_fn, batch, config, {"data": 8}, cost_params=params, graph=graph)
        spec = str(dict(plan.batch)["['inputs']"])
        out.append({"machine": mname, "batch_spec": spec, "time_s": plan.cost["time_s"],
                    "comm_s": plan.cost["comm_s"], "comm_count": plan.cost["comm_count"]})
        print(f"  {mname}: batch {spec}, step {plan.cost['time_s'] * 1e6:.4g} us, "
              f"{plan.cost['comm_count']:g} collective(s)", flush=True)
    return out


def _plot(rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 6))
    for mname in {r["model"] for r in rows}:
        pts = [r for r in rows if r["model"] == mname]
        ax.scatter([r["total_hlo"] for r in pts], [r["total_pred"] for r in pts], label=mname, s=18)
    lo = min(r["total_hlo"] for r in rows) * 0.8
    hi = max(r["total_hlo"] for r in rows) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compiled per-device bytes (memory_analysis)")
    ax.set_ylabel("predicted per-device bytes (jaxpar.auto)")
    ax.legend(fontsize=7)
    ax.set_title("cost model memory: predicted vs compiled (8 CPU devices)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results", "cost_model_cpu.png"), dpi=120)


if __name__ == "__main__":
    if len(jax.devices()) < 8:
        raise SystemExit(f"{os.path.basename(__file__)} compiles 8-device strategies; there are "
                         f"{len(jax.devices())} {jax.devices()[0].platform} devices: run it on 8 simulated "
                         "CPU devices (JAX_PLATFORMS=cpu, the default)")
    main()
