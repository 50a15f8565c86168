"""Failures: a job under ``jaxpar launch --worker-restarts`` that loses a random rank every
``--kill-every`` seconds, with the local checkpoint tier and with the persistent tier alone,
against the same job without failures.

Each variant is one ``--minutes`` run of 4 processes x 2 simulated CPU devices (two simulated
hosts of two processes: ``JAXPAR_HOST_ID``), mesh ``{"data": 8}``, every process feeding its own
rows of each global batch (the batch of step ``s`` is the same in every run), a small GPT:

- **no failures**: persistent checkpoints every ``--save-every`` steps;
- **kills, local tier**: the same, plus ``local_every=--local-every`` (and the peer copy);
- **kills, persistent only**: the persistent tier alone.

The driver SIGKILLs a random rank every ``--kill-every`` s; the launcher restarts the group,
which resumes from the newest checkpoint it can. Every run stops at the first multiple of
``--save-every`` steps past its deadline and saves it. Reported per variant: goodput (the run's
ledger, `jaxpar goodput`), steps reached, restarts, for each kill the seconds from the kill to
the group's first new step and how many steps it went back, and whether the final parameters
of each killed run equal the no-failure run's at the same step (bit for bit: one layout).

    python benchmarks/failures.py                           # 3 x 15 min, kills every 120 s
    python benchmarks/failures.py --minutes 3 --kill-every 45 --out /tmp/f.json   # a shorter look
    python benchmarks/failures.py --reanalyze benchmarks/results/failures_cpu.json  # its runs read again
    python benchmarks/failures.py --restart-breakdown --save-every 10   # where one restart's seconds go

``--restart-breakdown`` starts the job twice, the second resuming the first's step, and prints
for every process the seconds from its start to each point of its start (imports, joining the
job, the model, the Trainer with its resume, the first step) and what it compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL = 16
VARIANTS = ("no failures", "kills, local tier", "kills, persistent only")


# ------------------------------------------------------------------ the worker (one rank)
class Phases:
    """Where a rank's start went: seconds from the process's start to each mark, and its
    compiles (JAX's monitoring events: backend compile seconds, persistent-cache hits), written
    to ``RUN_DIR/phases/<pid>.json`` once its first step is done."""

    def __init__(self):
        import jax.monitoring

        from jaxpar.metrics.goodput import process_start_time

        self.born, self.marks, self.compile_s, self.hits = process_start_time(), {}, 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            self.compile_s += duration

    def _event(self, event: str, **_) -> None:
        if event.endswith("cache_hits"):
            self.hits += 1

    def mark(self, what: str) -> None:
        self.marks[what] = round(time.time() - self.born, 3)

    def write(self, run_dir: str, process: int, resumed: int) -> None:
        os.makedirs(os.path.join(run_dir, "phases"), exist_ok=True)
        with open(os.path.join(run_dir, "phases", f"{os.getpid()}.json"), "w") as f:
            json.dump({"process": process, "resumed": resumed, "born": self.born, "marks": self.marks,
                       "compile_s": round(self.compile_s, 3), "cache_hits": self.hits}, f)


def worker(args) -> None:
    phases = Phases()
    import jaxpar.distributed as dist

    phases.mark("imported")
    dist.initialize()
    phases.mark("joined")
    import jax
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import jaxpar
    from jaxpar.metrics import MetricsConfig
    from jaxpar.models.data import ArithmeticData
    from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

    me = jax.process_index()
    os.environ["JAXPAR_HOST_ID"] = f"host{me // 2}"
    cfg = GPTConfig(vocab_size=16, seq_len=32, embed=128, heads=4, mlp=512, layers=4, dropout=0.0, scan_layers=True)
    config = jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"}, optimizer={"level": 1, "threshold_kb": 0})
    mesh = jaxpar.make_mesh(config)
    # a restart resumes a step, which overwrites every variable: compute none (no init program)
    values = "restored" if (not args.computed_init and jaxpar.checkpoint.latest_step(
        os.path.join(args.run_dir, "ckpt")) is not None) else "computed"
    model = jaxpar.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config, mesh, values=values)
    phases.mark("model")
    local = {"local_dir": os.path.join(args.run_dir, "local"), "local_every": args.local_every} if args.local else {}
    services = jaxpar.Services(
        checkpoint=jaxpar.CheckpointConfig(dir=os.path.join(args.run_dir, "ckpt"), save_every=args.save_every,
                                           keep=None, **local),
        metrics=MetricsConfig(dir=os.path.join(args.run_dir, "metrics"), every=10))
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, services=services,
                             placement=jaxpar.Placement(global_batch=False))
    print(f"RESUMED {trainer.step_count} {time.time():.3f}", flush=True)
    phases.mark("trainer")
    resumed = trainer.step_count
    data, rows = ArithmeticData(16), dist.process_rows(GLOBAL)
    while True:
        batch = data.batch(GLOBAL, trainer.step_count)
        trainer.step({k: v[rows] for k, v in batch.items()})
        if trainer.step_count == resumed + 1:
            float(trainer.state.step)          # the first step is done on this process
            phases.mark("first step")
            phases.write(args.run_dir, me, resumed)
        if me == 0:
            print(f"STEP {trainer.step_count} {time.time():.3f}", flush=True)
        if trainer.step_count % args.save_every == 0:      # the processes agree to stop here
            stop = bool(multihost_utils.broadcast_one_to_all(time.time() >= args.deadline))
            if stop:
                trainer.close()
                print(f"DONE {trainer.step_count} {time.time():.3f}", flush=True)
                return


# ------------------------------------------------------------------ the driver
def started_pids(stderr_path: str) -> dict[int, int]:
    """The newest pid of each rank, from the launcher's messages."""
    pids = {}
    with open(stderr_path) as f:
        for m in re.finditer(r"started rank (\d+) \(pid (\d+)\)", f.read()):
            pids[int(m.group(1))] = int(m.group(2))
    return pids


def run_variant(name: str, args, out_dir: str, rng: random.Random) -> dict:
    run_dir = os.path.join(out_dir, re.sub(r"\W+", "_", name).strip("_"))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    deadline = time.time() + 60 * args.minutes
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "--worker-num", "4", "--local-worker-num", "4",
               "--simulated-devices", "2", "--worker-restarts", "1000", "--cluster-time-out", "120",
               "--log-dir", os.path.join(run_dir, "logs"), os.path.abspath(__file__), "--worker",
               "--run-dir", run_dir, "--deadline", str(deadline), "--save-every", str(args.save_every),
               "--local-every", str(args.local_every)] + (["--local"] if name == VARIANTS[1] else []) \
        + (["--computed-init"] if args.computed_init else [])
    stderr_path = os.path.join(run_dir, "launcher.stderr")
    # a warm restart: the group's programs come back from the persistent compilation cache
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(run_dir, "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    kills = []
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        try:
            next_kill = time.time() + args.kill_every
            while proc.poll() is None:
                time.sleep(0.5)
                if name != VARIANTS[0] and time.time() >= next_kill and time.time() < deadline:
                    rank = rng.randrange(4)
                    pid = started_pids(stderr_path).get(rank)
                    if pid is not None:
                        try:
                            os.kill(pid, signal.SIGKILL)
                            kills.append({"time": time.time(), "rank": rank})
                        except ProcessLookupError:
                            pass
                    next_kill += args.kill_every
                if time.time() > deadline + 600:
                    raise TimeoutError(f"{name}: the job did not stop within 10 minutes of its deadline")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(os.path.join(run_dir, "kills.json"), "w") as f:
        json.dump(kills, f)
    return analyze(name, run_dir, kills, proc.returncode)


def analyze(name: str, run_dir: str, kills: list[dict], code: int | None) -> dict:
    """A variant's figures from its run directory (rank 0's log, the ledger, ``kills``): for
    each kill the last step rank 0 had dispatched before it, the step the restarted group
    resumed, and the seconds from the kill to the first step after that resume."""
    log = open(os.path.join(run_dir, "logs", "worker_0.log")).read()
    events = [(word, int(s), float(t)) for word, s, t in re.findall(r"^(STEP|RESUMED) (\d+) ([\d.]+)$", log, re.M)]
    for kill in kills:
        before = [s for word, s, t in events if word == "STEP" and t <= kill["time"]]
        kill["last_step"] = max(before) if before else 0
        kill["resumed"] = kill["went_back"] = kill["to_first_new_step_s"] = None
        later = [i for i, (word, _, t) in enumerate(events) if word == "RESUMED" and t > kill["time"]]
        if later:
            _, resumed, _ = events[later[0]]
            kill["resumed"], kill["went_back"] = resumed, kill["last_step"] - resumed
            first = [t for word, _, t in events[later[0]:] if word == "STEP"]
            kill["to_first_new_step_s"] = (first[0] - kill["time"]) if first else None
    from jaxpar.metrics.goodput import summarize

    summary = summarize(os.path.join(run_dir, "metrics"))
    done = re.findall(r"^DONE (\d+)", log, re.M)
    return {"variant": name, "code": code, "final_step": int(done[-1]) if done else None,
            "goodput": summary["goodput"], "seconds": summary["seconds"], "restarts": summary["restarts"],
            "wall_s": summary["wall_s"], "kills": kills, "run_dir": run_dir}


def final_params(run_dir: str, step: int) -> dict:
    """The parameters of persistent step ``step`` of a run (``{path: array}``), on one device."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from jaxpar.checkpoint import state as st
    from jaxpar.checkpoint.manager import StateRestore, open_manager, saved_leaves

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with open_manager(os.path.join(run_dir, "ckpt"), read_only=True) as manager:
        target = {path: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=one)
                  for path, leaf in saved_leaves(manager, step).items()}
        tree = manager.restore(step, args=ocp.args.Composite(state=StateRestore(st.nest(target))))
    return {path: np.asarray(x) for path, x in st.unnest(tree["state"]).items() if path.startswith("params/")}


def restart_breakdown(args) -> None:
    """One job started twice (the second resumes the first's step from the local tier), each
    life stopping at step ``--save-every`` past its start: for every process of each life, the
    seconds from its start to each mark, and what it compiled (backend seconds, persistent-cache
    hits), from the workers' ``phases/*.json``."""
    run_dir = os.path.join(args.dir, "restart_breakdown")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(run_dir, "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    for life in range(2):
        command = [sys.executable, "-m", "jaxpar.cli", "launch", "--worker-num", "4", "--local-worker-num", "4",
                   "--simulated-devices", "2", "--cluster-time-out", "120",
                   "--log-dir", os.path.join(run_dir, f"logs{life}"), os.path.abspath(__file__), "--worker",
                   "--run-dir", run_dir, "--deadline", "0", "--save-every", str(args.save_every),
                   "--local-every", str(args.local_every), "--local"] + (["--computed-init"] if args.computed_init else [])
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    lives: dict[int, list[dict]] = {}
    for name in os.listdir(os.path.join(run_dir, "phases")):
        with open(os.path.join(run_dir, "phases", name)) as f:
            record = json.load(f)
        lives.setdefault(record["resumed"], []).append(record)
    marks = ("imported", "joined", "model", "trainer", "first step")
    print(f"seconds from each process's start (4 processes x 2 CPU devices; local_every={args.local_every})")
    print(f"{'life':>12} {'process':>7} " + " ".join(f"{m:>10}" for m in marks) + f" {'compile s':>10} {'cache hits':>10}")
    for resumed in sorted(lives):
        for r in sorted(lives[resumed], key=lambda r: r["process"]):
            print(f"{'resumed ' + str(resumed) if resumed else 'first':>12} {r['process']:7d} "
                  + " ".join(f"{r['marks'][m]:10.2f}" for m in marks) + f" {r['compile_s']:10.2f} {r['cache_hits']:10d}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python benchmarks/failures.py"] + sys.argv[1:]), "save_every": args.save_every,
                   "local_every": args.local_every, "marks": marks,
                   "lives": {str(k): sorted(v, key=lambda r: r["process"]) for k, v in sorted(lives.items())}},
                  f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--kill-every", type=float, default=120.0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--local-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--dir", default=os.path.join("/tmp", "jaxpar-failures"))
    p.add_argument("--out", help="the JSON file (default: benchmarks/results/failures_cpu.json, or "
                   "restart_breakdown_cpu.json with --restart-breakdown); a plot beside it")
    p.add_argument("--restart-breakdown", action="store_true", help="instead: start one job twice (the second "
                   "resumes) and print where each process's start went: imports, joining, the model, the Trainer "
                   "with its resume, the first step, and its compiles")
    p.add_argument("--reanalyze", metavar="JSON", help="read the runs of an earlier result file again (their "
                   "run directories must still exist) instead of running")
    # the worker's flags (the launcher runs this file once per rank)
    p.add_argument("--computed-init", action="store_true", help="a restart computes the initial values anyway "
                   "(jaxpar.init's default), as before values='restored' existed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results_dir = os.path.join(ROOT, "benchmarks", "results")
    if args.restart_breakdown:
        args.out = args.out or os.path.join(results_dir, "restart_breakdown_cpu.json")
        return restart_breakdown(args)
    args.out = args.out or os.path.join(results_dir, "failures_cpu.json")
    earlier = None
    if args.reanalyze:
        with open(args.reanalyze) as f:
            earlier = json.load(f)
        for k in ("minutes", "save_every", "local_every"):
            setattr(args, k, earlier[k])
        args.kill_every = earlier["kill_every_s"]
        results = [analyze(r["variant"], r["run_dir"], [{"time": k["time"], "rank": k["rank"]} for k in r["kills"]],
                           r["code"]) for r in earlier["results"]]
    else:
        rng = random.Random(args.seed)
        results = [run_variant(name, args, args.dir, rng) for name in args.variants]
    base = next((r for r in results if r["variant"] == VARIANTS[0]), None)
    for r in results:
        r["goodput_vs_no_failures"] = None if base is None else r["goodput"] / base["goodput"]
        r["params_equal_no_failures"] = None
        if base is not None and r is not base and r["final_step"] is not None and base["final_step"] is not None:
            step = min(r["final_step"], base["final_step"])
            if step % args.save_every == 0:
                a, b = final_params(r["run_dir"], step), final_params(base["run_dir"], step)
                r["params_equal_no_failures"] = {"step": step, "equal": all(
                    a[k].tobytes() == b[k].tobytes() for k in a) and a.keys() == b.keys()}
    print(f"{args.minutes:g} min each, a random rank SIGKILLed every {args.kill_every:g} s; persistent every "
          f"{args.save_every} steps, local every {args.local_every}")
    print(f"{'variant':24} {'goodput':>8} {'x none':>7} {'steps':>6} {'restarts':>8} {'kill->step s':>13} "
          f"{'went back':>10} {'params':>7}")
    for r in results:
        waits = [k["to_first_new_step_s"] for k in r["kills"] if k["to_first_new_step_s"] is not None]
        back = [k["went_back"] for k in r["kills"] if k["went_back"] is not None]
        same = r["params_equal_no_failures"]
        print(f"{r['variant']:24} {r['goodput']:8.3f} {r['goodput_vs_no_failures'] or 0:7.2f} "
              f"{r['final_step'] or 0:6d} {r['restarts']:8d} "
              f"{(sum(waits) / len(waits)) if waits else 0:13.1f} {max(back) if back else 0:10d} "
              f"{'-' if same is None else ('equal' if same['equal'] else 'DIFFER'):>7}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"minutes": args.minutes, "kill_every_s": args.kill_every, "save_every": args.save_every,
                   "local_every": args.local_every, "command": (f"{earlier['command']}; figures read again with --reanalyze" if args.reanalyze
                               else " ".join(["python benchmarks/failures.py"] + sys.argv[1:])),
                   "results": results}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        causes = list(results[0]["seconds"])
        left = [0.0] * len(results)
        for cause in causes:
            widths = [r["seconds"][cause] / r["wall_s"] for r in results]
            ax.barh([r["variant"] for r in results], widths, left=left, label=cause)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel("share of wall time")
        ax.set_title(f"{args.minutes:g} min, a rank killed every {args.kill_every:g} s (4 processes, CPU)")
        ax.invert_yaxis()
        ax.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, -0.55))
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
