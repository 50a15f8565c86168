"""Per-device memory of Llama-3 8B on 64 devices (data 8 x model 8) at ZeRO 0-3, from shapes alone.

Plans the job from mesh sizes (no device, no parameter is allocated) and writes the report's
parameter / gradient / optimizer-state / activation bytes per device, next to the closed
forms (fp32 parameters and gradients, Adam's two fp32 moments: 4P/s, 4P/s, 8P/s for the
shards s each has at that level), plus a stacked bar plot of the split.

Activations: global batch 8 (one 8192-token sequence per data replica), bfloat16 compute,
cuDNN attention (the choice on a GPU), without and with full recompute.

    python benchmarks/llama_memory.py     # writes benchmarks/results/llama3_8b_memory_64dev.{json,png}
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxpar  # noqa: E402
from jaxpar.models.llama_config import LlamaConfig, param_count  # noqa: E402
from jaxpar.models.llama_report import ReportRequest, llama_report  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MESH = {"data": 8, "model": 8}
RULES = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
PARTS = ("params", "grads", "opt_state", "activations")
GIB = 2 ** 30


def closed_form(level: int, p: int) -> dict[str, float]:
    tp, all_ = MESH["model"], MESH["data"] * MESH["model"]
    return {"params": 4 * p / (all_ if level == 3 else tp), "grads": 4 * p / (all_ if level >= 2 else tp),
            "opt_state": 8 * p / (all_ if level >= 1 else tp)}


def row(level: int, remat: str) -> dict:
    cfg = LlamaConfig.named("llama3_8b", scan_layers=True, dtype="bfloat16")
    config = jaxpar.ParallelConfig(mesh=MESH, rules=RULES, optimizer={"level": level}, remat=remat)
    r = llama_report(cfg, config, ReportRequest(batch=8, seq_len=8192, backend="gpu"))
    r = dataclasses.replace(r, name="llama3_8b")
    expected = closed_form(level, param_count(cfg))
    memory = r.memory.summary()
    return {"zero_level": level, "remat": remat, "attention": r.attention, "memory_per_device": memory,
            "closed_form": expected,
            "relative_error": {k: abs(memory[k] - v) / v for k, v in expected.items()},
            "flops_per_token": r.flops.total}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, remat in zip(axes, ("none", "full")):
        sub = [r for r in rows if r["remat"] == remat]
        bottom = [0.0] * len(sub)
        for part in PARTS:
            values = [r["memory_per_device"][part] / GIB for r in sub]
            ax.bar([f"ZeRO-{r['zero_level']}" for r in sub], values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"remat {remat}")
        ax.set_ylabel("GiB per device")
    axes[0].legend()
    fig.suptitle("Llama-3 8B, 64 devices (data 8 x model 8), batch 8 x 8192 tokens, bf16 compute, Adam fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    rows = [row(level, remat) for remat in ("none", "full") for level in range(4)]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "llama3_8b_memory_64dev.json"
    out.write_text(json.dumps({"model": "llama3_8b", "mesh": MESH, "rules": RULES, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    for r in rows:
        m = r["memory_per_device"]
        print(f"ZeRO-{r['zero_level']} remat {r['remat']:<5} " + "  ".join(
            f"{k} {m[k] / GIB:6.2f} GiB" for k in PARTS) + f"  worst error vs closed form "
            f"{max(r['relative_error'].values()):.2%}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
