"""Checkpoint tiers: what a save holds the loop for, and how long a resume takes, persistent
(orbax) against local (`jaxpar.checkpoint.local`), with the peer copy's transfer.

A GPT (``--embed``, ``--layers``; adamw, so the state is three times the parameters) trains on
``--devices`` simulated CPU devices (or every accelerator) under ``{"data": n}`` with ZeRO-1.
Each round, in turns (the order reversed every other round, so a change in the machine's load
hits both alike):

- **persistent**: ``Checkpointer.save`` (returns once the arrays are off the devices) — the
  seconds the loop is held — then ``wait`` (the files committed); resume = ``Checkpointer.resume``
  into the trainer's layout;
- **local**: ``LocalTier.save`` (the device-to-host copy; the files are written by its thread)
  then ``wait``; resume = ``LocalTier.resume``;
- **peer copy**: the local step sent to a `PeerServer` on this host over TCP, and fetched back.

The persistent directory is ``--persistent-dir`` (a disk), the local one ``--local-dir``
(node-local memory by default: ``/dev/shm``). Prints a table, writes JSON and a plot.

    python benchmarks/checkpoint_tiers.py                       # ~2 min on 2 CPU cores
    python benchmarks/checkpoint_tiers.py --quick --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_BENCH_DEVICES", "8")))

import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.checkpoint import Checkpointer, peer
from jaxpar.checkpoint.local import LocalTier
from jaxpar.models.data import ArithmeticData
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(embed: int, layers: int):
    cfg = GPTConfig(vocab_size=256, seq_len=64, embed=embed, heads=8, mlp=4 * embed, layers=layers, dropout=0.0,
                    scan_layers=True)
    config = jaxpar.ParallelConfig(mesh={"data": len(jax.devices())}, rules={"batch": "data"},
                                   optimizer={"level": 1, "threshold_kb": 0})
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-4), loss_fn, config, mesh)


def state_bytes(trainer) -> int:
    return sum(x.nbytes for x in jax.tree.leaves((trainer.state.params, trainer.state.opt_state)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--persistent-dir", default=None, help="default: a new directory under the system's temp dir")
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--quick", action="store_true", help="a small model, 2 rounds: checks that it runs")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint_tiers_cpu.json"))
    args = p.parse_args()
    if args.quick:
        args.embed, args.layers, args.rounds = 64, 2, 2
    persistent_root = tempfile.mkdtemp(prefix="jaxpar-bench-ckpt-", dir=args.persistent_dir)
    local_root = tempfile.mkdtemp(prefix="jaxpar-bench-local-", dir=args.local_dir)
    trainer = build(args.embed, args.layers)
    data = ArithmeticData(64)
    batch = data.batch(2 * len(jax.devices()), 0)
    for _ in range(3):
        trainer.step(batch)
    jax.block_until_ready(trainer.state.params)
    steps = []
    for _ in range(5):
        start = time.perf_counter()
        trainer.step(batch)
        jax.block_until_ready(trainer.state.params)
        steps.append(time.perf_counter() - start)
    size = state_bytes(trainer)
    key = os.urandom(32)
    server = peer.PeerServer(os.path.join(local_root, "holder"), key, host="127.0.0.1")
    rows = {k: [] for k in ("persistent save (held)", "persistent commit", "persistent resume", "local save (held)",
                            "local write", "local resume", "peer send", "peer fetch")}
    try:
        for r in range(args.rounds):
            order = ("persistent", "local") if r % 2 == 0 else ("local", "persistent")
            trainer.step(batch)
            jax.block_until_ready(trainer.state.params)
            step = trainer.step_count
            for tier in order:
                if tier == "persistent":
                    directory = os.path.join(persistent_root, f"r{r}")
                    with Checkpointer(directory, keep=1) as ckpt:
                        start = time.perf_counter()
                        ckpt.save(trainer.plan, trainer.state, trainer.mesh)
                        rows["persistent save (held)"].append(time.perf_counter() - start)
                        ckpt.wait()
                        rows["persistent commit"].append(time.perf_counter() - start)
                        start = time.perf_counter()
                        jax.block_until_ready(ckpt.resume(trainer.state, trainer.mesh)[0].params)
                        rows["persistent resume"].append(time.perf_counter() - start)
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    tier_dir = os.path.join(local_root, f"r{r}")
                    local = LocalTier(tier_dir, run=os.path.join(tier_dir, "run"))
                    local.start()
                    start = time.perf_counter()
                    local.save(step, trainer.state)
                    rows["local save (held)"].append(time.perf_counter() - start)
                    local.wait()
                    rows["local write"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    jax.block_until_ready(local.resume(trainer.state, trainer.mesh, newer_than=None)[0].params)
                    rows["local resume"].append(time.perf_counter() - start)
                    written = os.path.join(tier_dir, "process-0", "own", f"step-{step}")
                    start = time.perf_counter()
                    peer.put_step(("127.0.0.1", server.port), key, 0, step, written)
                    rows["peer send"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    peer.get_step(("127.0.0.1", server.port), key, 0, step, os.path.join(tier_dir, "back"))
                    rows["peer fetch"].append(time.perf_counter() - start)
                    local.close()
                    shutil.rmtree(tier_dir, ignore_errors=True)
    finally:
        server.close()
        shutil.rmtree(persistent_root, ignore_errors=True)
        shutil.rmtree(local_root, ignore_errors=True)
    step_s = statistics.median(steps)
    table = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "platform": platform.platform(),
        "jax": jax.__version__, "model": {"embed": args.embed, "layers": args.layers},
        "state_bytes": size, "step_s": step_s, "rounds": args.rounds,
        "persistent_dir": args.persistent_dir or tempfile.gettempdir(), "local_dir": args.local_dir,
        "median_s": table, "all_s": rows,
        "command": "python benchmarks/checkpoint_tiers.py" + (" --quick" if args.quick else ""),
    }
    print(f"state {size / 2**20:.0f} MiB on {len(jax.devices())} x {result['device']}; a step {step_s:.3f} s; "
          f"median of {args.rounds} rounds")
    print(f"{'what':28} {'seconds':>9} {'x step':>7} {'GiB/s':>7}")
    for k, v in table.items():
        print(f"{k:28} {v:9.3f} {v / step_s:7.2f} {size / 2**30 / v:7.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(table)
        ax.barh(names, [table[n] for n in names], color=["#888" if n.startswith("persistent") else "#2a7" for n in names])
        ax.axvline(step_s, color="k", ls=":", label=f"one step ({step_s:.3f} s)")
        ax.set_xlabel("seconds (median)")
        ax.set_title(f"checkpoint tiers: {size / 2**20:.0f} MiB of state, {len(jax.devices())} x {result['device']}")
        ax.invert_yaxis()
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
