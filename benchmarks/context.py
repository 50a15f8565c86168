"""Context parallel attention: temporaries per device and collective bytes, against theory.

Compiles (never runs) ``jax.value_and_grad`` of `jaxpar.ops.context_attention` — forward and
backward of one causal attention — on simulated CPU devices and reads the compiled programs:

1. Memory: ``temp_size_in_bytes`` per device for each strategy at cp = 1, 2, 4, 8 (fixed
   sequence), next to one device's / cp; and, for each cp, the longest sequence whose
   temporaries fit the budget one device needs at ``--budget-seq`` tokens (ring: grows
   linearly with cp).
2. Communication: bytes of the collectives per device (``jaxpar.report.collectives``, loop
   bodies counted once per iteration) against the formulas of docs/context_parallel.md.
3. Time (runs): ring forward + backward at cp = 8, full mask against causal with contiguous
   and zigzag shards: the tiles a causal mask hides are skipped. Simulated CPU devices share
   the host's cores, so this shows the total work saved, not the balance between devices.

    python benchmarks/context.py          # writes benchmarks/results/context_cpu.{json,png}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.ops import AttentionMask, context_attention  # noqa: E402
from jaxpar.report import collectives, memory  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STRATEGIES = ("all_gather", "ring", "ulysses", "hybrid")
F32 = 4


def compiled(strategy: str, cp: int, seq: int, heads: int, kv_heads: int, dim: int):
    """The compiled forward + backward of causal attention over ``cp`` devices, and its mesh."""
    if strategy == "hybrid":
        if cp < 4:
            return None, None
        axes = {"context": 2, "ulysses": cp // 2}
    else:
        axes = {"context": cp}
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:cp])
    axis = tuple(axes) if strategy == "hybrid" else "context"
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, axis if cp > 1 else None, None, None))

    def loss(q, k, v):
        return context_attention(q, k, v, axis=axis, strategy=strategy, mesh=mesh).sum()

    shapes = [jax.ShapeDtypeStruct((1, seq, h, dim), jnp.float32, sharding=sharding) for h in (heads, kv_heads, kv_heads)]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile(), mesh


def _ring_bytes(n: int, kv: int, ids: int) -> int:
    """Ring over ``n`` devices, ``kv`` bytes of a K and a V block, ``ids`` bytes of its positions.

    Forward: n-1 shifts of K, V and positions. Backward: the same again, and n shifts of dK,
    dV. At n = 2 the scans have one step and are inlined, and XLA reuses the forward's shift in
    the backward (the same ppermute of the same saved K, V), so one shift fewer.
    """
    shifts = 2 * (n - 1) - (1 if n == 2 else 0)
    return shifts * (kv + ids) + n * kv


def formula_bytes(strategy: str, cp: int, seq: int, heads: int, kv_heads: int, dim: int) -> float:
    """Collective bytes per device (jaxpar.report's convention) of forward + backward."""
    t = seq // cp                                   # tokens per device
    if strategy == "ring":
        return _ring_bytes(cp, 2 * t * kv_heads * dim * F32, t * 4)
    if strategy == "all_gather":
        # K, V and their positions gathered (the gathered size); dK, dV reduce-scattered (operand size)
        return 2 * (2 * seq * kv_heads * dim * F32) + seq * 4
    uly = cp if strategy == "ulysses" else cp // 2
    kvh = math.lcm(kv_heads, uly)                   # K/V heads repeated up to a multiple of the Ulysses size
    moved = (2 * t * heads + 2 * t * kvh) * dim * F32      # q, out, k, v through all_to_all
    block = t * uly                                 # tokens after the all_to_all: the ring block
    a2a = 2 * moved + block * 4                     # and the transposes; the positions gathered once
    if strategy == "ulysses":
        return a2a
    return a2a + _ring_bytes(cp // uly, 2 * block * (kvh // uly) * dim * F32, block * 4)


def measured_bytes(program, mesh) -> int:
    return sum(c.bytes * (c.executions or 1) for c in collectives(program, mesh))


def temp(program) -> int:
    return memory(program).temp_bytes


def longest(strategy: str, cp: int, budget: int, heads: int, kv_heads: int, dim: int, step: int) -> int:
    """The longest sequence (a multiple of ``step · cp``) whose temporaries fit ``budget``."""
    fits = lambda s: temp(compiled(strategy, cp, s, heads, kv_heads, dim)[0]) <= budget  # noqa: E731
    unit, n = step * cp, 1
    while fits(unit * n * 2):
        n *= 2
    lo, hi = n, 2 * n                               # fits(lo), not fits(hi)
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(unit * mid) else (lo, mid)
    return unit * lo


def ring_times(seq: int, heads: int, dim: int, repeats: int = 3) -> dict[str, float]:
    """Best of ``repeats`` wall times (s) of ring forward + backward at cp = 8."""
    import time

    import numpy as np
    from jaxpar.ops import context_order

    mesh = jaxpar.make_mesh({"context": 8}, devices=jax.devices()[:8])
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "context"))
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, seq, heads, dim)), jnp.float32)
    out = {}
    for name, causal, order in (("full", False, "contiguous"), ("causal contiguous", True, "contiguous"),
                                ("causal zigzag", True, "zigzag")):
        perm = context_order.permutation(order, seq, 8)
        pos = jax.device_put(jnp.broadcast_to(jnp.asarray(perm), (1, seq)), sharding)
        x = jax.device_put(q[:, perm], sharding)
        grad = jax.jit(jax.grad(lambda x: context_attention(  # noqa: B023 (used at once)
            x, x, x, AttentionMask(causal=causal, q_positions=pos), axis="context", strategy="ring",
            mesh=mesh).sum()))
        jax.block_until_ready(grad(x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(grad(x))
            times.append(time.perf_counter() - start)
        out[name] = min(times)
        print(f"ring cp=8 S={seq} forward + backward, {name}: {out[name]:.3f} s", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--budget-seq", type=int, default=1024, help="the budget: one device's temp at this length")
    p.add_argument("--time-seq", type=int, default=4096, help="sequence of the ring timing")
    p.add_argument("--out", default=str(RESULTS / "context_cpu.json"))
    args = p.parse_args(argv)
    shape = (args.heads, args.kv_heads, args.dim)
    rows = []
    one_device = temp(compiled("all_gather", 1, args.seq, *shape)[0])
    for strategy in STRATEGIES:
        for cp in (1, 2, 4, 8):
            program, mesh = compiled(strategy, cp, args.seq, *shape)
            if program is None:
                continue
            row = dict(strategy=strategy, cp=cp, temp=temp(program), temp_ratio=temp(program) / one_device,
                       bound=1 / cp + 0.10, bytes=measured_bytes(program, mesh),
                       formula=formula_bytes(strategy, cp, args.seq, *shape) if cp > 1 else 0)
            row["bytes_error"] = abs(row["bytes"] - row["formula"]) / row["formula"] if row["formula"] else 0.0
            rows.append(row)
            print(f"{strategy:>10} cp={cp}  temp {row['temp'] / 2**20:8.2f} MiB ({row['temp_ratio']:.3f} of one "
                  f"device, bound {row['bound']:.3f})  collectives {row['bytes'] / 2**20:7.3f} MiB, formula "
                  f"{row['formula'] / 2**20:7.3f} MiB ({100 * row['bytes_error']:.2f} %)", flush=True)
    budget = temp(compiled("all_gather", 1, args.budget_seq, *shape)[0])
    reach = {cp: longest("ring", cp, budget, *shape, step=64) for cp in (1, 2, 4, 8)}
    for cp, s in reach.items():
        print(f"ring cp={cp}: longest sequence within {budget / 2**20:.1f} MiB of temporaries: {s} "
              f"({s / reach[1]:.2f}x cp=1)")
    times = ring_times(args.time_seq, args.heads, args.dim)
    result = dict(config=vars(args), one_device_temp=one_device, rows=rows, budget=budget,
                  longest_ring={str(k): v for k, v in reach.items()}, ring_times_s=times)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in STRATEGIES:
        rows = [r for r in result["rows"] if r["strategy"] == strategy]
        a.plot([r["cp"] for r in rows], [r["temp_ratio"] for r in rows], "o-", label=strategy)
    cps = [1, 2, 4, 8]
    a.plot(cps, [1 / c + 0.1 for c in cps], "k--", label="1/cp + 10 %")
    a.set(xscale="log", yscale="log", xlabel="cp", ylabel="temp per device / one device's",
          title="attention temporaries (fwd + bwd)")
    a.set_xticks(cps, [str(c) for c in cps])
    a.legend()
    reach = result["longest_ring"]
    b.plot(cps, [reach[str(c)] for c in cps], "o-", label="ring: longest sequence")
    b.plot(cps, [reach["1"] * c for c in cps], "k--", label="linear in cp")
    b.set(xlabel="cp", ylabel="tokens", title=f"within {result['budget'] / 2**20:.1f} MiB of temporaries")
    b.set_xticks(cps, [str(c) for c in cps])
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
