"""Parameter-server benchmark: lookups/s and rows pushed/s with 2 servers x 2 workers, and the
share of a worker's step time spent waiting for pulls, with prefetch on and off.

Each configuration starts 2 servers (``python -m jaxpar.ps.server``) and 2 worker processes
(this script with ``--role worker``) on loopback. A worker trains a small click model (3
categorical fields over two tables: 100k x 32 rows with Adagrad and 20k x 32 with SGD, read by
a 2-layer dense tower) on its own half of the global batch: dedup, pull, jitted dense step,
push. After ``--warmup`` steps (compiles), it times ``--steps`` steps and reports:

* **lookups/s**: ids looked up (batch x fields, duplicates included) per second, both workers;
* **rows pulled/s**, **rows pushed/s**: unique rows moved per second, both workers;
* **pull wait**: the share of step time a worker blocks waiting for its rows (the pull itself
  without prefetch; what is left of it once prefetch overlaps it with the previous step). In
  sync mode it includes waiting for the other worker's push of the previous step.

The two worker processes are separate one-process jobs here (each with its own dense tower;
only the tables are shared), so that async mode can let them drift apart: the benchmark
measures the table traffic. In a ``jax.distributed`` job the dense step is one SPMD program
over both workers (see docs/parameter_server.md).

Each configuration runs ``--repeats`` times (taking turns); the run of median step time is shown.

    python benchmarks/ps.py                     # ~2.5 minutes on 2 CPU cores (3 runs of each)
    python benchmarks/ps.py --steps 100 --out /tmp/ps.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = [("sync", 0, False), ("sync", 0, True), ("async", 2, False), ("async", 2, True)]
BATCH = 1024  # global: 512 per worker
FIELDS = {"user": "users", "item": "items", "prev": "items"}


def tables():
    from jaxpar import ps

    return [ps.TableSpec("users", 20_000, 32, ps.SGD(0.1), seed=1),
            ps.TableSpec("items", 100_000, 32, ps.Adagrad(0.05), seed=2)]


def batches(worker: int, n: int, size: int):
    import numpy as np

    rng = np.random.default_rng(100 + worker)
    for _ in range(n):
        user = rng.zipf(1.2, size) % 20_000
        item, prev = rng.zipf(1.2, size) % 100_000, rng.zipf(1.2, size) % 100_000
        yield {"user": user, "item": item, "prev": prev, "label": ((user + item) % 2).astype(np.float32)}


def run_worker(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxpar import ps

    class Tower(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(96, 64, rngs=rngs), nnx.Linear(64, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))[..., 0]

    def loss_fn(model, emb, batch):
        x = jnp.concatenate([emb[f] for f in FIELDS], -1)
        return optax.sigmoid_binary_cross_entropy(model(x), batch["label"]).mean()

    client = ps.connect(tables(), mode=args.mode, staleness=args.staleness,
                        addresses=args.addresses.split(","), worker=args.worker, workers=2, timeout=120)
    trainer = ps.SparseTrainer(client, Tower(nnx.Rngs(0)), optax.sgd(0.05), loss_fn, FIELDS,
                               prefetch=bool(args.prefetch))
    data = list(batches(args.worker, args.warmup + args.steps, BATCH // 2))
    trainer.fit(data[:args.warmup])
    before = client.stats()["worker"]
    trainer.timings = {"pull_wait_s": 0.0, "step_s": 0.0}
    start = time.perf_counter()
    history = trainer.fit(data[args.warmup:])
    wall = time.perf_counter() - start
    after = client.stats()
    out = {"worker": args.worker, "wall_s": wall, "steps": len(history), **trainer.timings,
           "lookups": len(history) * (BATCH // 2) * len(FIELDS),
           "rows_pulled": after["worker"]["rows_pulled"] - before["rows_pulled"],
           "rows_pushed": after["worker"]["rows_pushed"] - before["rows_pushed"],
           "staleness": after["worker"]["staleness"], "rejected": after["worker"]["rejected"],
           "loss_last": history[-1]["loss"]}
    pathlib.Path(args.out).write_text(json.dumps(out))
    client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(mode: str, staleness: int, prefetch: bool, args, tmp: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "JAXPAR_PS_TOKEN": secrets.token_hex(16)}
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    ckpt = tempfile.mkdtemp(dir=tmp)
    servers = [subprocess.Popen([sys.executable, "-m", "jaxpar.ps.server", "--index", str(i), "--count", "2",
                                 "--bind", a, "--checkpoint-dir", ckpt, "--checkpoint-every", "1000"],
                                env=env, stdout=subprocess.DEVNULL) for i, a in enumerate(addresses)]
    outs = [os.path.join(ckpt, f"worker{w}.json") for w in range(2)]
    workers = [subprocess.Popen([sys.executable, __file__, "--role", "worker", "--worker", str(w),
                                 "--addresses", ",".join(addresses), "--mode", mode, "--staleness", str(staleness),
                                 "--prefetch", str(int(prefetch)), "--steps", str(args.steps),
                                 "--warmup", str(args.warmup), "--out", outs[w]], env=env) for w in range(2)]
    try:
        for w in workers:
            if w.wait(timeout=600) != 0:
                raise RuntimeError(f"a worker failed ({mode}, prefetch={prefetch})")
    finally:
        for p in servers + workers:
            p.terminate()
            p.wait(timeout=30)
    results = [json.loads(pathlib.Path(o).read_text()) for o in outs]
    wall = max(r["wall_s"] for r in results)
    return {"mode": mode, "staleness": staleness, "prefetch": prefetch, "wall_s": wall,
            "step_ms": 1000 * wall / args.steps,
            "lookups_per_s": sum(r["lookups"] for r in results) / wall,
            "rows_pulled_per_s": sum(r["rows_pulled"] for r in results) / wall,
            "rows_pushed_per_s": sum(r["rows_pushed"] for r in results) / wall,
            "pull_wait_share": sum(r["pull_wait_s"] for r in results) / sum(r["step_s"] for r in results),
            "staleness_seen": results[0]["staleness"], "rejected": sum(r["rejected"] for r in results),
            "workers": results}


def median_run(runs: list[dict]) -> dict:
    """The run of median step time, with every run's step time and pull-wait share beside it."""
    chosen = sorted(runs, key=lambda r: r["step_ms"])[len(runs) // 2]
    return {**chosen, "step_ms_runs": [r["step_ms"] for r in runs],
            "pull_wait_share_runs": [r["pull_wait_share"] for r in runs]}


def plot(result: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    rows = result["rows"]
    labels = [f"{r['mode']}{'' if r['mode'] == 'sync' else ' τ=' + str(r['staleness'])}\n"
              f"prefetch {'on' if r['prefetch'] else 'off'}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(labels, [r["lookups_per_s"] for r in rows])
    a.set(ylabel="lookups / s (2 workers)", title="lookups per second")
    b.bar(labels, [100 * r["pull_wait_share"] for r in rows], color="tab:orange")
    b.set(ylabel="% of step time", title="waiting for pulls")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", default="driver", choices=["driver", "worker"])
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--addresses", default="")
    p.add_argument("--mode", default="sync")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration; the median is shown")
    p.add_argument("--out", default=str(HERE / "results" / "ps_cpu.json"))
    args = p.parse_args()
    if args.role == "worker":
        return run_worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {c: [] for c in CONFIGS}
        for r in range(args.repeats):  # configurations take turns, so a load change hits all alike
            for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                runs[c].append(run_config(*c, args, tmp))
    rows = [median_run(runs[c]) for c in CONFIGS]
    print(f"{'mode':<10}{'prefetch':>9}{'step ms':>9}{'lookups/s':>11}{'pulled/s':>10}{'pushed/s':>10}"
          f"{'pull wait':>10}  staleness seen (worker 0)")
    for r in rows:
        mode = r["mode"] if r["mode"] == "sync" else f"async τ={r['staleness']}"
        print(f"{mode:<10}{'on' if r['prefetch'] else 'off':>9}{r['step_ms']:>9.1f}{r['lookups_per_s']:>11.0f}"
              f"{r['rows_pulled_per_s']:>10.0f}{r['rows_pushed_per_s']:>10.0f}{100 * r['pull_wait_share']:>9.1f}%"
              f"  {r['staleness_seen']}")
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "servers": 2, "workers": 2, "global_batch": BATCH, "fields": len(FIELDS),
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
