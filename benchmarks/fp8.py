"""The fp8 preset against bf16: tokens/s and the loss after the same steps on the same data.

    python benchmarks/fp8.py                                  # Llama-1B shape, 300 steps, 8 x 2048
    python benchmarks/fp8.py --size tiny --steps 40 --batch 4 --seq 64 --precisions bf16 fp32   # a CPU check

Two ``jaxpar.Trainer`` runs of one Llama shape from one initialisation, ``precision="bf16"`` and
``precision="fp8"`` (the projections as scaled fp8 matmuls, `jaxpar.nn.fp8`), train on the same
batches of the project's arithmetic corpus (``jaxpar.models.data.ArithmeticData``: learnable, so
the loss falls within a few hundred steps). They take turns by rounds of ``--round`` steps, the
order reversed every other round; tokens/s is the median over rounds after the first (which
compiles), and the final loss the mean of the last 20 steps. The fp8 preset is refused where the
devices have no fp8 matmuls (CPU, GPUs before compute capability 8.9): the script says so.
Results: a table, JSON and a loss plot in ``$OUT`` if set, else ``benchmarks/results/``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig, flops_per_token, loss_fn  # noqa: E402
from jaxpar.report import memory, peak_flops  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def build(cfg: LlamaConfig, precision: str):
    config = jaxpar.ParallelConfig(mesh={"data": -1}, precision=precision)
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(3e-4, weight_decay=0.1), loss_fn, config, mesh)


def report(a, cfg: LlamaConfig, device, runs: dict, losses: dict, times: dict, compiled: dict, path: str):
    """The rows and the summary from the rounds so far, written to ``path``."""
    tokens = a.batch * a.seq
    fpt = flops_per_token(cfg, a.seq)
    peak = peak_flops(device.device_kind, "bfloat16")
    rows = {}
    for name in runs:
        s = float(np.median(times[name][1:]))
        rows[name] = {"ms_per_step": 1e3 * s, "tokens_per_s": tokens / s,
                      "mfu_bf16_peak": fpt * tokens / s / (peak * jax.device_count()) if peak else None,
                      "final_loss": float(np.mean(losses[name][-20:])), "first_loss": losses[name][0],
                      "compiled_gib": compiled[name], "steps": len(losses[name])}
    base, other = a.precisions
    summary = {"tokens_per_s_ratio": rows[other]["tokens_per_s"] / rows[base]["tokens_per_s"],
               "final_loss_rel_diff": rows[other]["final_loss"] / rows[base]["final_loss"] - 1}
    meta = {"device_kind": device.device_kind, "devices": jax.device_count(), "jax": jax.__version__,
            "jaxpar": jaxpar.__version__, "date": time.strftime("%Y-%m-%d"), "size": a.size, "steps": a.steps,
            "steps_done": len(losses[base]), "batch": a.batch, "seq": a.seq, "loss_chunks": a.loss_chunks,
            "round": a.round, "data": "jaxpar.models.data.ArithmeticData(seed=0)",
            "optimizer": "adamw(3e-4, weight_decay=0.1)",
            "command": " ".join(["python", "benchmarks/fp8.py", *(a.argv or [])])}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary, "losses": losses,
                   "round_ms": {n: [1e3 * t for t in ts] for n, ts in times.items()}}, f, indent=1)
    return rows, summary


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``: default ``sys.argv[1:]``), checked; ``.argv`` keeps it for the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1b", help="a LlamaConfig.named size (default 1b)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--round", type=int, default=10, help="steps per timed round")
    p.add_argument("--loss-chunks", type=int, default=8, help="the model's loss_chunks (0 = materialised logits)")
    p.add_argument("--precisions", nargs=2, default=["bf16", "fp8"], metavar=("BASE", "OTHER"))
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.steps < 2 * a.round or a.steps % a.round:
        p.error(f"--steps {a.steps} must be a multiple of --round {a.round} and at least two rounds")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = LlamaConfig.named(a.size, max_seq_len=max(a.seq, 128), loss_chunks=a.loss_chunks)
    try:
        runs = {name: build(cfg, name) for name in a.precisions}
    except ValueError as e:      # the fp8 preset where the devices have no fp8 matmuls
        print(f"fp8.py: {e}", file=sys.stderr)
        return 2
    data = ArithmeticData(seq_len=a.seq, seed=0)
    batches = [data.batch(a.batch, step=i) for i in range(a.steps)]
    losses = {n: [] for n in runs}
    times = {n: [] for n in runs}
    device = jax.devices()[0]
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    path = a.out or os.path.join(out_dir, f"fp8_{device.device_kind.lower().replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    compiled = {}
    rounds = a.steps // a.round
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            t0 = time.perf_counter()
            metrics = [runs[name].step(batches[r * a.round + i]) for i in range(a.round)]
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - t0) / a.round)
            losses[name].extend(float(m["loss"]) for m in metrics)
        if r == 0:   # the programs are compiled by now: their memory, once
            compiled = {n: memory(run.lower(batches[0]).compile()).total / 2**30 for n, run in runs.items()}
        if r >= 1 and (r % 5 == 0 or r == rounds - 1):   # written as it goes: a run cut short keeps its rounds
            rows, summary = report(a, cfg, device, runs, losses, times, compiled, path)
    for name, row in rows.items():
        mfu = "" if row["mfu_bf16_peak"] is None else f"  MFU {100 * row['mfu_bf16_peak']:.1f}% (bf16 peak)"
        print(f"{name:10s} {row['ms_per_step']:8.1f} ms/step  {row['tokens_per_s']:10,.0f} tokens/s{mfu}  loss "
              f"{row['first_loss']:.3f} -> {row['final_loss']:.4f}  compiled {row['compiled_gib']:.1f} GiB")
    base, other = a.precisions
    print(f"{other} / {base}: tokens/s x{summary['tokens_per_s_ratio']:.3f}, final loss "
          f"{100 * summary['final_loss_rel_diff']:+.2f} %")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, ls in losses.items():
            ax.plot(ls, label=f"{name} ({rows[name]['tokens_per_s']:,.0f} tokens/s)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{a.size} on {device.device_kind}: {other} vs {base}", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    except ImportError:
        pass
    print(f"results in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
