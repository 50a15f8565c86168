"""The first persistent save of a fresh process: orbax's default writer against jaxpar's.

A process that starts (or restarts) pays for compiling whatever its first save runs. orbax
splits each replicated array among its replicas by default on CPU and TPU ("replica-parallel"
writing), cutting each replica's slice with a program compiled per array and per device.
jaxpar's ``state`` handler (`jaxpar.checkpoint.manager`) writes each shard whole from its first
replica instead (not on TPU). This script saves the same state twice in a fresh process, with
each writer, in turns (``--rounds`` rounds, the order reversed every other round), and reports
the seconds the save held the caller (the device-to-host copy and anything compiled for it)
for the first and the second save, the programs compiled during the first, and the seconds
until the first was committed.

The state is a `jaxpar.Trainer`'s: a GPT of 4 layers (embed 128, adamw) under ``{"data": 8}``
with ZeRO-1 on 8 simulated CPU devices, as `benchmarks/failures.py` trains; parameters are
replicated, the optimizer state sharded. Only orbax's save is timed (jaxpar's checksums, which
every save computes with either writer, are not part of it).

    python benchmarks/first_save.py                    # ~2 min on 2 CPU cores: table, JSON, plot
    python benchmarks/first_save.py --rounds 1 --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITERS = ("orbax default", "jaxpar")


def worker(writer: str, directory: str) -> dict:
    """One fresh process: build the state, save it twice with ``writer``, time each."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.monitoring
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    import jaxpar
    from jaxpar.checkpoint import manager as mgr
    from jaxpar.checkpoint import state as st
    from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(duration) if event.endswith("backend_compile_duration") else None)
    cfg = GPTConfig(vocab_size=16, seq_len=32, embed=128, heads=4, mlp=512, layers=4, dropout=0.0, scan_layers=True)
    config = jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"}, optimizer={"level": 1, "threshold_kb": 0})
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    tree = st.nest(st.savable(st.flat_state(trainer.state)))
    jax.block_until_ready(tree)
    handler, save = ((ocp.StandardCheckpointHandler(), ocp.args.StandardSave) if writer == WRITERS[0]
                     else (mgr.StateHandler(), mgr.StateSave))
    out = {"writer": writer}
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True),
                               item_handlers={"state": handler}) as manager:
        for step in (1, 2):
            before = len(compiles)
            t = time.perf_counter()
            manager.save(step, args=ocp.args.Composite(state=save(tree)))
            held = time.perf_counter() - t
            manager.wait_until_finished()
            out[f"save_{step}"] = {"held_s": held, "committed_s": time.perf_counter() - t,
                                   "compiled": len(compiles) - before,
                                   "compile_s": sum(compiles[before:])}
    return out


def run(writer: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", writer, "--dir", d],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
        if proc.returncode:
            raise RuntimeError(f"{writer}: the worker failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "first_save_cpu.json"))
    p.add_argument("--worker", choices=WRITERS, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, os.path.join(args.dir, "ckpt"))), flush=True)
        return
    runs = []
    for r in range(args.rounds):
        for writer in (WRITERS if r % 2 == 0 else WRITERS[::-1]):
            runs.append(run(writer))
            print(f"round {r}: {writer}: first save held {runs[-1]['save_1']['held_s']:.2f} s", flush=True)
    rows = []
    print(f"\n{'writer':14} {'first held s':>12} {'compiled':>9} {'compile s':>10} {'first committed s':>18} "
          f"{'second held s':>14}")
    for writer in WRITERS:
        mine = [x for x in runs if x["writer"] == writer]
        row = {"writer": writer, "runs": len(mine)}
        for key, pick in (("first_held_s", lambda x: x["save_1"]["held_s"]),
                          ("first_compiled", lambda x: x["save_1"]["compiled"]),
                          ("first_compile_s", lambda x: x["save_1"]["compile_s"]),
                          ("first_committed_s", lambda x: x["save_1"]["committed_s"]),
                          ("second_held_s", lambda x: x["save_2"]["held_s"])):
            values = [pick(x) for x in mine]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        rows.append(row)
        print(f"{writer:14} {row['first_held_s']['median']:12.2f} {row['first_compiled']['median']:9.0f} "
              f"{row['first_compile_s']['median']:10.2f} {row['first_committed_s']['median']:18.2f} "
              f"{row['second_held_s']['median']:14.3f}")
    import jax
    import orbax.checkpoint as ocp

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python benchmarks/first_save.py"] + sys.argv[1:]),
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, 8 simulated CPU devices",
                   "jax": jax.__version__, "orbax": ocp.__version__, "rows": rows, "runs": runs}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, row in enumerate(rows):
        ax.bar([i - 0.2], [row["first_held_s"]["median"]], 0.4, color="C0", label="first save" if i == 0 else None)
        ax.bar([i + 0.2], [row["second_held_s"]["median"]], 0.4, color="C1", label="second save" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [r["writer"] for r in rows])
    ax.set_ylabel("seconds the save held the caller")
    ax.set_title("A fresh process's persistent saves (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)


if __name__ == "__main__":
    main()
