"""Memory and traffic of optimizer parallel, recompute and accumulation, against theory.

Reads compiled steps of the example GPT (``jaxpar.report``) on simulated CPU devices:

1. ZeRO memory: per-device bytes of parameters + optimizer state (step arguments less the
   batch and non-parameter state) + gradients (outputs of ``Trainer.lower_grads``: the
   gradients as the update receives them) for level 0–3 and 2/4/8 devices, next to the
   formulas for fp32 Adam (DP 16Ψ, L1 8Ψ+8Ψ/N, L2 4Ψ+12Ψ/N, L3 16Ψ/N; parameters under the
   threshold counted as replicated, 16 bytes each). Plot: bytes per device vs level and N.
2. Traffic: ring bytes sent per device (all-reduce 2(g-1)/g × size, all-gather and
   reduce-scatter (g-1)/g × size) relative to plain data parallel, in mode "hybrid"
   (jaxpar reduces gradients itself) and mode "data" (XLA's partitioner chooses).
3. Recompute: temp bytes and FLOPs of the scanned GPT per policy.
4. Accumulation: temp bytes of grad_accum=4 vs one step on the same (4x) batch, and the
   gradient reductions each runs (per ZeRO level 0-2).

    python benchmarks/memory.py            # writes benchmarks/results/memory_cpu.{json,png}
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from jaxpar.report import collectives, flops, memory  # noqa: E402

BIG = GPTConfig(vocab_size=256, seq_len=8, embed=256, heads=4, mlp=512, layers=1)
RESULTS = pathlib.Path(__file__).parent / "results"


def trainer_for(cfg, gpt, n):
    mesh = jaxpar.make_mesh(cfg, devices=jax.devices()[:n])
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), cfg, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, cfg, mesh)


def shard_bytes(tree):
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def wire(cols):
    return sum((2 if c.kind == "all-reduce" else 1) * c.bytes * (c.group_size - 1) / c.group_size for c in cols)


def psi(trainer):
    plan = jaxpar.optim.zero_specs(jaxpar.OptimizerConfig(level=1), trainer.mesh, trainer.compute_specs, trainer.params)
    big = small = 0
    for spec, x in zip(jax.tree.leaves(plan.state, is_leaf=lambda s: isinstance(s, P)), jax.tree.leaves(trainer.params)):
        big, small = (big + x.size, small) if "data" in str(spec) else (big, small + x.size)
    return big, small


def formula(level, big, small, n):
    return {0: 16 * big, 1: 8 * big + 8 * big / n, 2: 4 * big + 12 * big / n, 3: 16 * big / n}[level] + 16 * small


def zero_rows():
    rows = []
    for n in (2, 4, 8):
        batch = ArithmeticData(BIG.seq_len).batch(n, 0)
        for level in (0, 1, 2, 3):
            cfg = jaxpar.ParallelConfig(mesh={"data": n}, mode="hybrid", optimizer={"level": level})
            tr = trainer_for(cfg, BIG, n)
            compiled = tr.lower(batch).compile()
            m = memory(compiled)
            args = m.argument_bytes - shard_bytes(tr.place(batch)) - shard_bytes(tr.rest)
            grads = memory(tr.lower_grads(batch).compile()).output_bytes
            big, small = psi(tr)
            want = formula(level, big, small, n)
            rows.append({"devices": n, "level": level, "params+opt_state": args, "grads": grads,
                         "measured": args + grads, "formula": want, "ratio": (args + grads) / want,
                         "temp": m.temp_bytes, "wire": wire(collectives(compiled, tr.mesh)), "psi": big,
                         "psi_small": small})
            print(f"N={n} level {level}: measured {args + grads:>10,} formula {want:>12,.0f} "
                  f"ratio {(args + grads) / want:.3f} (temp {m.temp_bytes:,})", flush=True)
    return rows


def traffic_rows():
    rows = []
    batch = ArithmeticData(BIG.seq_len).batch(8, 0)
    for mode in ("hybrid", "data"):
        base = None
        for level in (0, 1, 2, 3):
            cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode=mode, optimizer={"level": level})
            tr = trainer_for(cfg, BIG, 8)
            cols = collectives(tr.lower(batch).compile(), tr.mesh)
            w = wire(cols)
            base = base or w
            kinds = {k: sum(1 for c in cols if c.kind == k) for k in sorted({c.kind for c in cols})}
            rows.append({"mode": mode, "level": level, "wire_bytes": w, "ratio": w / base, "collectives": kinds})
            print(f"mode {mode:6} level {level}: ratio to DP {w / base:.2f}  {kinds}", flush=True)
    return rows


def remat_rows():
    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=32, heads=4, mlp=128, layers=4, scan_layers=True)
    batch = ArithmeticData(32).batch(128, 0)
    rows = []
    # ParallelConfig.remat: on each block (the scan body)
    for policy in ("none", "dots_saveable", "dots_except_mlp_in", "dots_except_mlp", "full"):
        cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", remat=policy)
        c = trainer_for(cfg, gpt, 8).lower(batch).compile()
        rows.append({"policy": policy, "temp": memory(c).temp_bytes, "flops": flops(c)})
    for r in rows:
        r["temp_vs_none"] = rows[0]["temp"] / r["temp"]
        r["flops_vs_none"] = r["flops"] / rows[0]["flops"]
        print(f"remat {r['policy']:14} temp {r['temp']:>12,} ({r['temp_vs_none']:.1f}x less)  "
              f"flops x{r['flops_vs_none']:.2f}", flush=True)
    return rows


def accum_rows():
    """grad_accum=4 against one step on the same batch, per ZeRO level: temp bytes, and the
    gradient reductions (all-reduce / reduce-scatter) each step runs, counted with their loop
    trip counts: the partitioner reduces each micro-batch's gradient inside the scan."""
    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=32, heads=4, mlp=128, layers=2)
    batch = ArithmeticData(32).batch(256, 0)
    rows = []
    for level in (0, 1, 2):
        for k in (1, 4):
            cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", grad_accum=k,
                                        optimizer={"level": level, "threshold_kb": 0})
            trainer = trainer_for(cfg, gpt, 8)
            compiled = trainer.lower(batch).compile()
            reductions = [c for c in collectives(compiled, trainer.mesh) if c.kind in ("all-reduce", "reduce-scatter")]
            rows.append({"level": level, "grad_accum": k, "temp": memory(compiled).temp_bytes,
                         "reductions_run": sum(c.executions for c in reductions),
                         "reductions_in_loop": sum(c.executions for c in reductions if c.in_loop),
                         "reduced_bytes": sum(c.bytes * c.executions for c in reductions)})
            r = rows[-1]
            print(f"level {level} grad_accum={k}: temp {r['temp']:,}  reductions run {r['reductions_run']} "
                  f"({r['reductions_in_loop']} in the loop), {r['reduced_bytes']:,} B", flush=True)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for level in (0, 1, 2, 3):
        pts = [r for r in rows if r["level"] == level]
        ax.plot([r["devices"] for r in pts], [r["measured"] / 2**20 for r in pts], "o-", label=f"level {level}")
        ax.plot([r["devices"] for r in pts], [r["formula"] / 2**20 for r in pts], "k:", lw=0.8)
    ax.set_xlabel("devices (data axis)")
    ax.set_ylabel("params + grads + Adam state per device (MiB)")
    ax.set_xticks([2, 4, 8])
    ax.set_title("ZeRO memory: measured (dots) vs formula (dotted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    RESULTS.mkdir(exist_ok=True)
    out = {"backend": jax.default_backend(), "zero": zero_rows(), "traffic": traffic_rows(),
           "remat": remat_rows(), "accum": accum_rows()}
    tag = jax.default_backend()
    (RESULTS / f"memory_{tag}.json").write_text(json.dumps(out, indent=1))
    plot(out["zero"], RESULTS / f"memory_{tag}.png")
    print(f"wrote {RESULTS / f'memory_{tag}.json'} and .png")


if __name__ == "__main__":
    sys.exit(main())
