"""Search time of jaxpar.auto: DP on the example GPT (8 devices) and recursive programming on
deep GPTs over up to 1024 simulated devices (cost model only, nothing compiles).

    python benchmarks/search.py            # prints the table, writes results/search_*.json|png
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flax import nnx

import jaxpar
from jaxpar.auto import build_graph, search
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

HERE = os.path.dirname(os.path.abspath(__file__))


def _batch(b, s):
    return {"inputs": np.zeros((b, s), np.int32), "targets": np.zeros((b, s), np.int32)}


def timed(model, batch, mesh, algorithm):
    t0 = time.perf_counter()
    graph = build_graph(model, loss_fn, batch)
    t1 = time.perf_counter()
    cfg = jaxpar.ParallelConfig(mesh=mesh, mode="auto", search=algorithm)
    plan = search(model, loss_fn, batch, cfg, mesh, graph=graph)
    t2 = time.perf_counter()
    return {"trace_s": t1 - t0, "search_s": t2 - t1, "total_s": t2 - t0, "ops": len(graph.ops),
            "classes": graph.num_classes, "predicted_step_s": plan.cost["time_s"]}


def main():
    rows = []
    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=8, mlp=256, layers=2)
    r = timed(GPT(gpt, rngs=nnx.Rngs(0)), _batch(32, 32), {"data": 2, "model": 4}, "dynamic_programming")
    rows.append({"case": "example GPT, 8 devices (2x4)", "algorithm": "dynamic_programming", "layers": 2,
                 "devices": 8, **r})
    for layers in (12, 48):
        deep = GPTConfig(vocab_size=512, seq_len=128, embed=1024, heads=16, mlp=4096, layers=layers)
        model = nnx.eval_shape(lambda: GPT(deep, rngs=nnx.Rngs(0)))
        for k in (3, 6, 8, 10):
            mesh = {f"l{i}": 2 for i in range(k)}     # 2^k devices as k halvings
            r = timed(model, _batch(1024, 128), mesh, "recursive_programming")
            rows.append({"case": f"GPT {layers} layers, {2 ** k} devices", "algorithm": "recursive_programming",
                         "layers": layers, "devices": 2 ** k, **r})
    for row in rows:
        print(f"{row['case']:<36} {row['algorithm']:<22} ops {row['ops']:>5} classes {row['classes']:>4} "
              f"trace {row['trace_s']:6.2f} s  search {row['search_s']:6.2f} s  total {row['total_s']:6.2f} s")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "search_times.json"), "w") as f:
        json.dump(rows, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for layers in (12, 48):
        pts = [(r["devices"], r["total_s"]) for r in rows if r["layers"] == layers and r["algorithm"] == "recursive_programming"]
        ax.plot(*zip(*pts), marker="o", label=f"recursive, {layers} layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices (simulated)")
    ax.set_ylabel("trace + search time (s)")
    ax.set_title("jaxpar.auto search time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results", "search_scaling.png"), dpi=120)


if __name__ == "__main__":
    main()
