"""Parameter-server benchmark: lookups/s and rows pushed/s with 2 servers x 2 workers, and the
share of a worker's step time spent waiting for pulls, with prefetch on and off.

Each configuration has its 2 servers (``python -m jaxpar.ps.server``); 2 worker processes
(this script with ``--role worker``) run every configuration in turn, on loopback. A worker trains a small click model (3
categorical fields over two tables: 100k x 32 rows with Adagrad and 20k x 32 with SGD, read by
a 2-layer dense tower) on its own half of the global batch with ``jaxpar.Trainer`` and
``jaxpar.ps.ServerRows``: dedup, pull, the Trainer's compiled step, push. After ``--warmup`` steps (compiles), it times ``--steps`` steps and reports:

* **lookups/s**: ids looked up (batch x fields, duplicates included) per second, both workers;
* **rows pulled/s**, **rows pushed/s**: unique rows moved per second, both workers;
* **pull wait**: the share of step time a worker blocks waiting for its rows (the pull itself
  without prefetch; what is left of it once prefetch overlaps it with the previous step). In
  sync mode it includes waiting for the other worker's push of the previous step.

The two worker processes are separate one-process jobs here (each with its own dense tower;
only the tables are shared), so that async mode can let them drift apart: the benchmark
measures the table traffic. In a ``jax.distributed`` job the dense step is one SPMD program
over both workers (see docs/parameter_server.md).

Each configuration runs ``--repeats`` times (configurations taking turns, so a change of load
hits them alike); every figure is printed as the median over the runs with its min–max, and the
JSON keeps every run. The conditions go with the figures: the 1-minute load average before and
after (``loaded`` when it is at least a quarter of the cores before the run: other work shares
the CPUs, and the spread says how much that moved the figures).

    python benchmarks/ps.py                     # 3 runs of each configuration, 40 timed steps
    python benchmarks/ps.py --repeats 3 --steps 10 --warmup 3   # 2 minutes on 2 cores at load 15
    python benchmarks/ps.py --repeats 5 --steps 100 --out /tmp/ps.json
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
    """Runs every (repeat, configuration) of the plan in turn, in step with the other worker."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar import ps

    class Tower(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(96, 64, rngs=rngs), nnx.Linear(64, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))[..., 0]

    def loss_fn(model, emb, batch):
        x = jnp.concatenate([emb[f] for f in FIELDS], -1)
        return optax.sigmoid_binary_cross_entropy(model(x), batch["label"]).mean()

    plan = json.loads(pathlib.Path(args.plan).read_text())
    data = list(batches(args.worker, args.warmup + args.steps, BATCH // 2))
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    for k, run in enumerate(plan):
        barrier(pathlib.Path(args.plan).parent, k, args.worker)  # both workers start a run together
        client = ps.connect(tables(), mode=run["mode"], staleness=run["staleness"],
                            addresses=run["addresses"], worker=args.worker, workers=2, timeout=120)
        source = ps.ServerRows(client, FIELDS)
        trainer = jaxpar.Trainer(Tower(nnx.Rngs(0)), optax.sgd(0.05),
                                 lambda model, batch, rows: loss_fn(model, source.embedded(batch, rows), batch),
                                 config, mesh, rows=source)

        def fit(part):   # the Trainer's loop, the rows prefetched or not
            return trainer.fit(source.prefetching(part, len(part)) if run["prefetch"] else part, len(part),
                               progress=False)

        fit(data[:args.warmup])
        before = client.stats()["worker"]
        source.timings = {"pull_wait_s": 0.0, "prefetched": 0}
        start = time.perf_counter()
        history = fit(data[args.warmup:])
        wall = time.perf_counter() - start
        after = client.stats()
        out = {"worker": args.worker, "wall_s": wall, "steps": len(history),
               "pull_wait_s": source.timings["pull_wait_s"], "step_s": wall,
               "lookups": len(history) * (BATCH // 2) * len(FIELDS),
               "rows_pulled": after["worker"]["rows_pulled"] - before["rows_pulled"],
               "rows_pushed": after["worker"]["rows_pushed"] - before["rows_pushed"],
               "staleness": after["worker"]["staleness"], "rejected": after["worker"]["rejected"],
               "loss_last": history[-1]["loss"]}
        pathlib.Path(run["out"][args.worker]).write_text(json.dumps(out))
        client.close()


def barrier(folder: pathlib.Path, k: int, worker: int, timeout: float = 600) -> None:
    (folder / f"start-{k}-{worker}").touch()
    deadline = time.monotonic() + timeout
    while not (folder / f"start-{k}-{1 - worker}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {1 - worker} did not reach run {k} within {timeout} s")
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(args, tmp: str) -> dict[tuple, list[dict]]:
    """Every configuration ``args.repeats`` times, taking turns (a change of load hits them
    alike): one pair of servers per configuration and one pair of worker processes for all the
    runs, so that starting processes (each imports JAX) does not take most of the time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "JAXPAR_PS_TOKEN": secrets.token_hex(16)}
    addresses = {c: [f"127.0.0.1:{free_port()}" for _ in range(2)] for c in CONFIGS}
    servers = []
    for c in CONFIGS:
        ckpt = tempfile.mkdtemp(dir=tmp)
        servers += [subprocess.Popen([sys.executable, "-m", "jaxpar.ps.server", "--index", str(i), "--count", "2",
                                      "--bind", a, "--checkpoint-dir", ckpt, "--checkpoint-every", "1000"],
                                     env=env, stdout=subprocess.DEVNULL) for i, a in enumerate(addresses[c])]
    order = [c for r in range(args.repeats) for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1])]
    plan = [{"mode": c[0], "staleness": c[1], "prefetch": c[2], "addresses": addresses[c],
             "out": [os.path.join(tmp, f"run{k}-worker{w}.json") for w in range(2)]} for k, c in enumerate(order)]
    plan_file = pathlib.Path(tmp, "plan.json")
    plan_file.write_text(json.dumps(plan))
    workers = [subprocess.Popen([sys.executable, __file__, "--role", "worker", "--worker", str(w),
                                 "--plan", str(plan_file), "--steps", str(args.steps),
                                 "--warmup", str(args.warmup)], env=env) for w in range(2)]
    try:
        for w in workers:
            if w.wait(timeout=1800) != 0:
                raise RuntimeError("a worker failed (its error is printed above)")
    finally:
        for p in servers + workers:
            p.terminate()
            p.wait(timeout=30)
    runs: dict[tuple, list[dict]] = {c: [] for c in CONFIGS}
    for c, run in zip(order, plan):
        runs[c].append(measure(c, [json.loads(pathlib.Path(o).read_text()) for o in run["out"]], args.steps))
    return runs


def measure(config: tuple, results: list[dict], steps: int) -> dict:
    mode, staleness, prefetch = config
    wall = max(r["wall_s"] for r in results)
    return {"mode": mode, "staleness": staleness, "prefetch": prefetch, "wall_s": wall,
            "step_ms": 1000 * wall / steps,
            "lookups_per_s": sum(r["lookups"] for r in results) / wall,
            "rows_pulled_per_s": sum(r["rows_pulled"] for r in results) / wall,
            "rows_pushed_per_s": sum(r["rows_pushed"] for r in results) / wall,
            "pull_wait_share": sum(r["pull_wait_s"] for r in results) / sum(r["step_s"] for r in results),
            "staleness_seen": results[0]["staleness"], "rejected": sum(r["rejected"] for r in results),
            "workers": results}


METRICS = ("step_ms", "lookups_per_s", "rows_pulled_per_s", "rows_pushed_per_s", "pull_wait_share")


def summarize(runs: list[dict]) -> dict:
    """One configuration's row: each metric's median over the runs (the headline figure), its
    ``{"median", "min", "max"}`` under ``spread``, and every run."""
    import statistics

    spread = {m: {"median": statistics.median(r[m] for r in runs), "min": min(r[m] for r in runs),
                  "max": max(r[m] for r in runs)} for m in METRICS}
    first = runs[0]
    return {"mode": first["mode"], "staleness": first["staleness"], "prefetch": first["prefetch"],
            **{m: spread[m]["median"] for m in METRICS}, "spread": spread, "repeats": len(runs),
            "staleness_seen": [r["staleness_seen"] for r in runs],
            "rejected": sum(r["rejected"] for r in runs),
            "runs": [{k: v for k, v in r.items() if k != "workers"} for r in runs]}


def load_state(load: float, cpus: int) -> str:
    """``"idle"`` or ``"loaded"``: whether other work ran on the machine before the benchmark."""
    return "loaded" if load >= 0.25 * cpus else "idle"


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

    def bars(ax, metric, scale, **kw):  # the median, and the min–max of the runs as error bars
        med = [scale * r["spread"][metric]["median"] for r in rows]
        low = [m - scale * r["spread"][metric]["min"] for m, r in zip(med, rows)]
        high = [scale * r["spread"][metric]["max"] - m for m, r in zip(med, rows)]
        ax.bar(labels, med, yerr=[low, high], capsize=4, **kw)

    runs = f"median and min–max of {result['repeats']} runs, {result['conditions']['state']}"
    bars(a, "lookups_per_s", 1)
    a.set(ylabel="lookups / s (2 workers)", title=f"lookups per second\n({runs})")
    bars(b, "pull_wait_share", 100, color="tab:orange")
    b.set(ylabel="% of step time", title=f"waiting for pulls\n({runs})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", default="driver", choices=["driver", "worker"])
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--plan", default="", help="(worker) the runs to do, written by the driver")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each configuration; the median and the min–max are shown")
    p.add_argument("--out", default=str(HERE / "results" / "ps_cpu.json"))
    args = p.parse_args()
    if args.role == "worker":
        return run_worker(args)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--repeats {args.repeats}, --steps {args.steps}, --warmup {args.warmup}: "
                "give at least 1 run of at least 1 step, and warm-up steps >= 0")
    cpus = os.cpu_count() or 1
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_all(args, tmp)
    conditions = {"state": load_state(load_before, cpus), "load_1min_before": load_before,
                  "load_1min_after": os.getloadavg()[0], "cpus": cpus,
                  "wall_s": time.perf_counter() - start}
    rows = [summarize(runs[c]) for c in CONFIGS]
    print(f"{conditions['state']}: 1-minute load average {load_before:.1f} before the run, "
          f"{conditions['load_1min_after']:.1f} after, on {cpus} cores; {args.repeats} runs per "
          f"configuration ({args.steps} steps after {args.warmup} warm-up), in "
          f"{conditions['wall_s']:.0f} s; median [min–max] over the runs")
    print(f"{'mode':<10}{'prefetch':>9}{'step ms':>20}{'lookups/s':>24}{'pushed rows/s':>24}"
          f"{'pull wait %':>20}")

    def cell(r, metric, fmt, scale=1.0):
        s = r["spread"][metric]
        return f"{scale * s['median']:{fmt}} [{scale * s['min']:{fmt}}–{scale * s['max']:{fmt}}]"

    for r in rows:
        mode = r["mode"] if r["mode"] == "sync" else f"async τ={r['staleness']}"
        print(f"{mode:<10}{'on' if r['prefetch'] else 'off':>9}{cell(r, 'step_ms', '.1f'):>20}"
              f"{cell(r, 'lookups_per_s', '.0f'):>24}{cell(r, 'rows_pushed_per_s', '.0f'):>24}"
              f"{cell(r, 'pull_wait_share', '.1f', 100):>20}")
    for r in rows:
        if r["mode"] == "async":
            print(f"async τ={r['staleness']} prefetch {'on' if r['prefetch'] else 'off'}: pushes per "
                  f"staleness seen by worker 0 in each run {r['staleness_seen']}, {r['rejected']} rejected")
    result = {"machine": {"cpus": cpus, "platform": platform.platform()}, "conditions": conditions,
              "servers": 2, "workers": 2, "global_batch": BATCH, "fields": len(FIELDS),
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
