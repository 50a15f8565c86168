"""Step benchmark: the example GPT under a list of strategies, and a hand-written jax.jit baseline.

For each strategy it compiles the jaxpar training step, reads what the compiled program costs
(``jaxpar.report``: per-device memory, collectives, FLOPs), then times steps (median of
``--steps`` after ``--warmup``, each ended with ``jax.block_until_ready``). The baseline is
the same data-parallel step written directly with ``jax.jit``, ``nnx.split/merge``,
``jax.value_and_grad``, optax and ``NamedSharding``, without jaxpar; the data-parallel row
reports jaxpar's step time over the baseline's.

    python benchmarks/step.py                          # CPU: 8 simulated devices, size "tiny"
    python benchmarks/step.py --size small --layers both --out /tmp/step.json

The strategies size their meshes to the devices there are (``-1`` = the rest); one whose mesh
cannot be made of them (Megatron's model=4 on 1 or 2 GPUs) is skipped with a message. On a CPU
the timings only compare strategies with each other on this machine (8 simulated devices share
its cores; ``JAXPAR_BENCH_DEVICES`` changes how many are simulated); on a GPU the script also
reports MFU from the model FLOPs (`gpt_flops_per_token`) and the device's float32 (TF32) peak
(`jaxpar.report.peak_flops`, or ``--peak-flops``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax

if __name__ == "__main__":  # before JAX starts its backend; harmless on GPU/TPU
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_BENCH_DEVICES", "8")))

import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from jaxpar.models.data import ArithmeticData
from jaxpar.mesh import resolve_axes
from jaxpar.models.gpt import GPT, GPTConfig, gpt_flops_per_token, loss_fn
from jaxpar.report import collective_summary, collectives, flops, memory, throughput

SIZES = {  # embed, heads, layers, seq_len, global batch
    "tiny": dict(embed=64, heads=8, layers=2, seq_len=32, batch=32),
    "small": dict(embed=128, heads=8, layers=4, seq_len=64, batch=32),
    "medium": dict(embed=512, heads=8, layers=8, seq_len=256, batch=64),
    "large": dict(embed=1024, heads=16, layers=16, seq_len=1024, batch=64),
}
MEGATRON = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
# name -> (ParallelConfig fields, label); -1 = the rest of the devices, so each runs on any count
# its fixed axes divide (on 8 devices: data=8, data=2 x model=4, model=8, x=2 x y=4, data=8).
STRATEGIES = {
    "data": (dict(mesh={"data": -1}, mode="data"), ""),
    "megatron": (dict(mesh={"data": -1, "model": 4}, rules=MEGATRON), " (Megatron)"),
    "model": (dict(mesh={"model": -1}, rules={"heads": "model", "mlp": "model", "vocab": "model"}), ""),
    "2d": (dict(mesh={"x": 2, "y": -1}, rules={"batch": "x", "embed": "y", "heads": "x", "mlp": "x", "vocab": "x"}),
           " (2D)"),
    "hybrid": (dict(mesh={"data": -1}, mode="hybrid"), " (hybrid)"),
}
LR = 1e-3


def gpt_config(size: str, scan: bool) -> GPTConfig:
    s = SIZES[size]
    return GPTConfig(vocab_size=16, seq_len=s["seq_len"], embed=s["embed"], heads=s["heads"],
                     mlp=4 * s["embed"], layers=s["layers"], scan_layers=scan)


def strategy(name: str, n: int) -> tuple[dict, str] | str:
    """``(ParallelConfig fields with the mesh sized for n devices, label)``, or why it does not fit."""
    fields, suffix = STRATEGIES[name]
    try:
        mesh = resolve_axes(fields["mesh"], n)
    except ValueError as e:
        return str(e)
    return fields | {"mesh": mesh}, " x ".join(f"{k}={v}" for k, v in mesh.items()) + suffix


def time_interleaved(runs: list, warmup: int, steps: int) -> list[list[float]]:
    """Seconds per step of each run, timed in turns (one step of each per round).

    Taking turns spreads any change in the machine's load (other processes, CPU frequency)
    over all runs alike, so their ratios stay meaningful on a shared machine; the order is
    reversed every other round so that no run always follows the same neighbour.
    """
    for run in runs:
        for _ in range(warmup):
            jax.block_until_ready(run())
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps):
        turns = list(zip(runs, times))
        for run, ts in (turns if i % 2 == 0 else turns[::-1]):  # alternate who goes first
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            ts.append(time.perf_counter() - t0)
    return times


def paired_ab(run_a, run_b, rounds: int, warmup: int = 5) -> dict:
    """Paired A/B: ``rounds`` rounds of one step of each, the order alternating every round.

    Each round's ratio ``t_a / t_b`` compares two steps taken back to back, so slow drifts of
    the machine cancel; the result is the median ratio with a 95% bootstrap interval.
    """
    for _ in range(warmup):
        jax.block_until_ready(run_a())
        jax.block_until_ready(run_b())
    ratios, a_times, b_times = [], [], []
    for i in range(rounds):
        pair = {}
        for name, run in ((("a", run_a), ("b", run_b)) if i % 2 == 0 else (("b", run_b), ("a", run_a))):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            pair[name] = time.perf_counter() - t0
        a_times.append(pair["a"])
        b_times.append(pair["b"])
        ratios.append(pair["a"] / pair["b"])
    rng = np.random.default_rng(0)
    boot = [float(np.median(rng.choice(ratios, len(ratios)))) for _ in range(1000)]
    return {"rounds": rounds, "median_ratio": float(np.median(ratios)),
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
            "median_a_s": statistics.median(a_times), "median_b_s": statistics.median(b_times)}


def compiled_costs(compiled, mesh) -> dict:
    mem = memory(compiled)
    cols = collective_summary(collectives(compiled, mesh))
    return {
        "memory": {"argument": mem.argument_bytes, "output": mem.output_bytes, "temp": mem.temp_bytes,
                   "alias": mem.alias_bytes, "total": mem.total},
        "collectives": {"count": cols["count"], "bytes": cols["bytes"],
                        "executed_bytes": cols["executed_bytes"],
                        "by_kind": {k: v["count"] for k, v in cols["by_kind"].items()}},
        "flops_per_device": flops(compiled),
    }


def bench_jaxpar(name: str, fields: dict, gpt: GPTConfig, batch: dict):
    """Compile jaxpar's step for one strategy: (row of compiled costs, a function running one step)."""
    config = jaxpar.ParallelConfig(**fields)
    mesh = jaxpar.make_mesh(config)
    constrain = jaxpar.nn.model_constraint(mesh, config)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(LR), loss_fn, config, mesh)
    placed = trainer.place(batch)
    t0 = time.perf_counter()
    compiled = trainer.lower(placed).compile()
    compile_s = time.perf_counter() - t0
    row = {"strategy": name, "config": config.to_dict(), "compile_s": compile_s, **compiled_costs(compiled, mesh)}
    return row, lambda: (trainer.step(placed), trainer.params)


def bench_baseline(gpt: GPTConfig, batch: dict):
    """The data-parallel step over every device, written by hand: jax.jit, nnx.split/merge,
    value_and_grad, optax."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    graphdef, params = nnx.split(GPT(gpt, rngs=nnx.Rngs(0)))
    tx = optax.adamw(LR)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}  # what Trainer.step returns
        return optax.apply_updates(params, updates), opt_state, metrics

    step = jax.jit(train_step, in_shardings=(replicated, replicated, by_rows),
                   out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1))
    placed = jax.device_put(batch, by_rows)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, placed).compile()
    compile_s = time.perf_counter() - t0
    state = {"params": params, "opt": opt_state}

    def run():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], placed)
        return state["params"], metrics

    row = {"strategy": f"baseline jax.jit data={n}", "config": None, "compile_s": compile_s,
           **compiled_costs(compiled, mesh)}
    return row, run


def finish(row: dict, times: list[float], gpt: GPTConfig, tokens: int, peak: float | None) -> dict:
    """The row with its median step time, tokens/s and MFU from the model FLOPs (float32 peak:
    the GPT computes in float32, TF32 on NVIDIA GPUs; ``None`` on a CPU, which has no peak)."""
    step_s = statistics.median(times)
    t = throughput(flops_per_token=gpt_flops_per_token(gpt), tokens_per_step=tokens, step_time_s=step_s,
                   num_devices=len(jax.devices()), dtype="float32", peak_flops=peak)
    row.update(step_s=step_s, step_times_s=times, tokens_per_s=tokens / step_s,
               model_flops_per_step=t.flops_per_token * tokens, mfu=t.mfu, mfu_text=t.mfu_text)
    return row


def per_step_bytes(c: dict) -> int:
    """Collective bytes one step moves per device: loop bodies (scanned layers) count per iteration."""
    return c["bytes"] if c["executed_bytes"] is None else c["executed_bytes"]


def print_table(rows: list[dict], ratio: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPT train step on {len(jax.devices())} {jax.devices()[0].platform} devices")
    cols = ["strategy", "layers", "compile s", "step ms", "tokens/s", "arg KiB", "out KiB", "temp KiB",
            "collectives", "coll. KiB/step", "GFLOP/dev"]
    if any(r["mfu"] is not None for r in rows):
        cols.append("MFU")
    for c in cols:
        table.add_column(c, justify="left" if c in ("strategy", "layers") else "right")
    for r in rows:
        m, c = r["memory"], r["collectives"]
        cells = [r["strategy"], r["layers"], f"{r['compile_s']:.2f}", f"{r['step_s'] * 1e3:.1f}",
                 f"{r['tokens_per_s']:,.0f}", f"{m['argument'] / 1024:,.0f}", f"{m['output'] / 1024:,.0f}",
                 f"{m['temp'] / 1024:,.0f}", str(c["count"]), f"{per_step_bytes(c) / 1024:,.0f}",
                 f"{r['flops_per_device'] / 1e9:.3f}"]
        if "MFU" in cols:
            cells.append(r["mfu_text"])
        table.add_row(*cells)
    console = Console(width=170)
    console.print(table)
    if ratio is not None:
        console.print(f"jaxpar data-parallel / hand-written jax.jit baseline step time: {ratio:.3f}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\n({r['layers']})" for r in rows]
    x = np.arange(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 5))
    ax_t.bar(x, [r["step_s"] * 1e3 for r in rows], color="tab:blue")
    ax_t.set_ylabel("step time, ms (median)")
    ax_t.set_title("step time")
    bottom = np.zeros(len(rows))
    parts = {"arguments": lambda m: m["argument"], "outputs (not donated)": lambda m: m["output"] - m["alias"],
             "temporaries": lambda m: m["temp"]}
    for (part, bytes_of), color in zip(parts.items(), ("tab:green", "tab:orange", "tab:red")):
        values = np.array([bytes_of(r["memory"]) / 2**20 for r in rows])
        ax_m.bar(x, values, bottom=bottom, label=part, color=color)
        bottom += values
    ax_m.set_ylabel("MiB per device")
    ax_m.set_title("per-device memory of the compiled step (total = stack)")
    ax_m.legend()
    for ax in (ax_t, ax_m):
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    fig.suptitle(f"GPT train step, {len(jax.devices())} {jax.devices()[0].platform} devices")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="model size (default tiny)")
    p.add_argument("--layers", choices=("unrolled", "scanned", "both"), default="unrolled",
                   help="blocks as a Python loop, stacked under lax.scan, or both")
    p.add_argument("--strategies", nargs="*", default=list(STRATEGIES), metavar="NAME",
                   help=f"subset of {list(STRATEGIES)}")
    p.add_argument("--steps", type=int, default=40, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--no-baseline", action="store_true", help="skip the hand-written jax.jit baseline")
    p.add_argument("--ab-rounds", type=int, default=200,
                   help="paired A/B rounds of jaxpar's data strategy against the baseline (0: skip)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="peak FLOP/s per device for MFU (default: jaxpar.report.peak_flops of the device, "
                        "float32; none on a CPU)")
    p.add_argument("--out", default=os.path.join(here, "results", "step_cpu.json"), help="JSON results")
    p.add_argument("--plot", default=None, help="PNG plot (default: --out with .png)")
    args = p.parse_args(argv)
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        p.error(f"unknown strategies {sorted(unknown)}; choose from {list(STRATEGIES)}")
    return args


def data_over_baseline(rows: list[dict]) -> float | None:
    """jaxpar's data-parallel step time over the baseline's (first layers kind with both rows);
    each baseline row gets its ratio as ``jaxpar_over_baseline``. None when either did not run."""
    ratio = None
    for base in (r for r in rows if r["name"] == "baseline"):
        mine = next((r for r in rows if r["name"] == "data" and r["layers"] == base["layers"]), None)
        if mine is not None:
            base["jaxpar_over_baseline"] = mine["step_s"] / base["step_s"]
            ratio = base["jaxpar_over_baseline"] if ratio is None else ratio
    return ratio


def ab_pair(compiled_rows: list[dict], runs: list):
    """``(layers, jaxpar data step, baseline step)`` for the paired A/B, or None if one did not run."""
    for row, run in zip(compiled_rows, runs):
        if row["name"] != "data":
            continue
        base = next((b for r, b in zip(compiled_rows, runs)
                     if r["name"] == "baseline" and r["layers"] == row["layers"]), None)
        if base is not None:
            return row["layers"], run, base
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    n = len(jax.devices())
    s = SIZES[args.size]
    batch = ArithmeticData(s["seq_len"]).batch(s["batch"], 0)
    tokens = s["batch"] * s["seq_len"]
    peak = args.peak_flops
    t_start = time.perf_counter()
    compiled_rows, runs, gpts, skipped = [], [], [], {}
    for layers in (("unrolled", "scanned") if args.layers == "both" else (args.layers,)):
        gpt = gpt_config(args.size, layers == "scanned")
        for name in args.strategies:
            fitted = strategy(name, n)
            if isinstance(fitted, str):
                skipped[name] = f"its mesh does not fit {n} {jax.devices()[0].platform} devices: {fitted}"
                print(f"  skipping {name}: {skipped[name]}", file=sys.stderr)
                continue
            fields, label = fitted
            row, run = bench_jaxpar(label, fields, gpt, batch)
            compiled_rows.append(row | {"layers": layers, "name": name})
            runs.append(run)
            gpts.append(gpt)
            print(f"  compiled {name} ({layers}) in {row['compile_s']:.1f}s", file=sys.stderr)
        if not args.no_baseline:
            row, run = bench_baseline(gpt, batch)
            compiled_rows.append(row | {"layers": layers, "name": "baseline"})
            runs.append(run)
            gpts.append(gpt)
    times = time_interleaved(runs, args.warmup, args.steps)
    rows = [finish(r, t, g, tokens, peak) for r, t, g in zip(compiled_rows, times, gpts)]
    ratio = data_over_baseline(rows)
    print_table(rows, ratio)
    ab = None
    pair = ab_pair(compiled_rows, runs)
    if args.ab_rounds and pair is None:
        print("no paired A/B: it needs the data strategy and the baseline (both ran? see above)", file=sys.stderr)
    elif args.ab_rounds:
        layers, mine, base = pair
        ab = paired_ab(mine, base, args.ab_rounds) | {"layers": layers}
        print(f"paired A/B over {ab['rounds']} alternating rounds: jaxpar data={n} / hand-written jax.jit = "
              f"{ab['median_ratio']:.3f} (95% interval {ab['ci95'][0]:.3f}-{ab['ci95'][1]:.3f}; "
              f"medians {ab['median_a_s'] * 1e3:.2f} ms vs {ab['median_b_s'] * 1e3:.2f} ms)")
    device = jax.devices()[0]
    out = {
        "meta": {"jax": jax.__version__, "jaxpar": jaxpar.__version__, "platform": device.platform,
                 "device_kind": device.device_kind, "devices": len(jax.devices()), "host_cpus": os.cpu_count(),
                 "python": platform.python_version(), "size": args.size, "model": dataclasses.asdict(gpt_config(args.size, False)),
                 "global_batch": s["batch"], "tokens_per_step": tokens, "steps": args.steps, "warmup": args.warmup,
                 "peak_flops": peak if peak is not None else jaxpar.report.peak_flops(device.device_kind, "float32"),
                 "timing": "interleaved rounds (order reversed every other round), median", "total_s": time.perf_counter() - t_start,
                 "date": time.strftime("%Y-%m-%d")},
        "results": rows,
        "skipped": skipped,
        "jaxpar_over_baseline_data": ratio,
        "paired_ab_data": ab,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    plot(rows, png)
    print(f"results written to {args.out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
