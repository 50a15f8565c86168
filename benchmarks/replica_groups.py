"""Replica groups: three groups on localhost, one SIGKILLed and restarted, against the same three
groups without failures.

Each group is one process of 2 simulated CPU devices (``tests/workers/replica_worker.py``: the
small GPT, ZeRO-2 over its 2 devices, 4 rows of its own per step, ``--pace`` seconds of sleep per
step standing in for a longer step), averaging through ``python -m jaxpar.ps.replica_server
--timeout``. Two runs of ``--seconds`` each:

- **no failures**: the three groups throughout;
- **one group killed**: group 1 is SIGKILLed at ``--kill-at`` s and started again ``--restart-after``
  s later (a scheduler's restart); it heals from a live group and trains on. The groups share a persistent
  compilation cache, so the restarted group's programs come back from it.

Reported: each group's steps; the survivors' longest step (the coordinator's drop timeout) and
their steps per second before the kill, between the kill and the heal, and after; the seconds
from the restart to the healed state and to its first step; the steps group 1 missed; whether
every group's parameters are bit-identical at every step after the heal; and the survivors'
steps against the no-failure run's in the same time.

    python benchmarks/replica_groups.py                      # 2 x 60 s
    python benchmarks/replica_groups.py --seconds 30 --kill-at 10 --out /tmp/r.json
    python benchmarks/replica_groups.py --replot benchmarks/results/replica_groups_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "replica_worker.py")
TOKEN = "replica-benchmark"


def _records(out: str, group: int) -> list[dict]:
    path = os.path.join(out, f"group-{group}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(out: str, args, kill: bool) -> dict:
    """One run of the three groups; returns what it measured."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    # a warm restart: the restarted group's programs come back from the persistent compilation cache
    env = {**os.environ, "JAXPAR_REPLICAS_TOKEN": TOKEN, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(out, "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)
    coordinator = subprocess.Popen([sys.executable, "-m", "jaxpar.ps.replica_server", "--groups", "3",
                                    "--timeout", str(args.timeout)], stdout=subprocess.PIPE,
                                   stderr=open(os.path.join(out, "coordinator.err"), "w"), text=True, env=env, cwd=ROOT)
    address = coordinator.stdout.readline().split()[-1]

    def spawn(g: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, WORKER, "--group", str(g), "--groups", "3", "--address", address,
                                 "--out", out, "--steps", "1000000", "--pace", str(args.pace)], env=env, cwd=ROOT,
                                stdout=open(os.path.join(out, f"worker-{g}.log"), "a"), stderr=subprocess.STDOUT)

    workers = {g: spawn(g) for g in range(3)}
    events: dict[str, float] = {}
    try:
        while not all(any("time" in r for r in _records(out, g)) for g in range(3)):   # every group stepping
            time.sleep(0.05)
        t0 = events["first_step"] = time.time()
        if kill:
            time.sleep(args.kill_at)
            workers[1].kill()
            workers[1].wait()
            events["kill"] = time.time()
            time.sleep(args.restart_after)
            events["restart"] = time.time()
            workers[1] = spawn(1)
        time.sleep(max(0.0, t0 + args.seconds - time.time()))
        last = max(r["step"] for r in _records(out, 0) if "time" in r)
        with open(os.path.join(out, "stop"), "w") as f:
            f.write(str(last + 2))
        codes = {g: w.wait(timeout=300) for g, w in workers.items()}
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
        coordinator.terminate()
        coordinator.wait(timeout=30)
    return measure(out, events, codes, args)


def measure(out: str, events: dict, codes: dict, args) -> dict:
    records = {g: _records(out, g) for g in range(3)}
    steps = {g: [r for r in rs if "time" in r] for g, rs in records.items()}
    t0 = events["first_step"]
    survivors = (0, 2)
    result: dict = {"exit_codes": codes, "steps": {g: len(s) for g, s in steps.items()},
                    "survivor_steps_in_window": {g: sum(t0 <= r["time"] <= t0 + args.seconds for r in steps[g])
                                                 for g in survivors}}
    gaps = {g: [b["time"] - a["time"] for a, b in zip(steps[g], steps[g][1:]) if a["time"] >= t0] for g in survivors}
    result["survivor_median_step_s"] = {g: round(sorted(v)[len(v) // 2], 4) for g, v in gaps.items()}
    result["survivor_longest_step_s"] = {g: round(max(v), 3) for g, v in gaps.items()}
    if "kill" not in events:
        return result
    starts = [r for r in records[1] if "start" in r]
    healed = next(r for r in starts if r["healed"])
    healed_step = healed["step"]
    killed_step = max(r["step"] for r in steps[1] if r["time"] <= events["kill"])
    heal_time = next(r["time"] for r in steps[0] if r["step"] == healed_step)    # the donor's step it took
    first_after = next(r["time"] for r in steps[1] if r["step"] == healed_step + 1)
    events["healed"] = heal_time

    def rate(g, lo, hi):
        n = sum(lo <= r["time"] < hi for r in steps[g])
        return round(n / (hi - lo), 2) if hi > lo else None

    digests = {g: {r["step"]: r["digest"] for r in steps[g]} for g in range(3)}
    after = [s for s in digests[1] if s > healed_step]
    result.update({
        "killed_after_step": killed_step, "healed_at_step": healed_step,
        "steps_group_1_missed": healed_step - killed_step,
        "restart_to_healed_s": round(healed["start"] - events["restart"], 2),
        "restart_to_first_step_s": round(first_after - events["restart"], 2),
        "kill_to_first_step_without_it_s": round(min(r["time"] for r in steps[0] if r["groups"] == [0, 2])
                                                 - events["kill"], 2),
        "survivor_steps_per_s": {g: {"before kill": rate(g, t0, events["kill"]),
                                     "kill to heal": rate(g, events["kill"], heal_time),
                                     "after heal": rate(g, heal_time, t0 + args.seconds)} for g in survivors},
        "identical_after_heal": bool(after) and all(digests[0][s] == digests[1][s] == digests[2][s] for s in after),
        "steps_compared_after_heal": len(after),
        "events_s": {k: round(v - t0, 2) for k, v in events.items()},
    })
    result["_timeline"] = {g: [(round(r["time"] - t0, 3), r["step"]) for r in steps[g]] for g in range(3)}
    return result


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    killed = results["one group killed"]
    for g, points in killed["_timeline"].items():
        t = [p[0] for p in points]
        top.plot(t[1:], [b - a for a, b in zip(t, t[1:])], ".", ms=3 if g != 1 else 5, label=f"group {g}",
                 alpha=0.8)
        bottom.plot(t, [g] * len(t), "|", ms=8)
    for ax in (top, bottom):
        for name, t in killed["events_s"].items():
            if name != "first_step":
                ax.axvline(t, color="grey", ls="--", lw=0.8)
    marks = [(name, t) for name, t in killed["events_s"].items() if name != "first_step"]
    for k, (name, t) in enumerate(marks):
        top.text(t, 5.5 - 1.2 * k, f" {name}", fontsize=8)
    top.set_ylabel("seconds per step")
    top.set_title("Replica groups: group 1 killed and restarted; groups 0 and 2 step on")
    top.legend(loc="upper left")
    bottom.set_yticks([0, 1, 2], [f"group {g}" for g in range(3)])
    bottom.set_ylim(-0.5, 2.5)
    bottom.set_ylabel("steps taken")
    bottom.set_xlabel("seconds since every group stepped")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run, from every group's first step")
    parser.add_argument("--kill-at", type=float, default=20.0, help="seconds into the run to SIGKILL group 1")
    parser.add_argument("--restart-after", type=float, default=5.0, help="seconds from the kill to group 1's restart")
    parser.add_argument("--timeout", type=float, default=2.0, help="the coordinator's --timeout (s)")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of sleep per step (a longer step)")
    parser.add_argument("--dir", default="/tmp/jaxpar-replica-groups")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "replica_groups_cpu.json"))
    parser.add_argument("--replot", metavar="JSON", help="draw the plot of a written result again, and nothing else")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            record = json.load(f)
        killed = {**record["runs"]["one group killed"], "_timeline": {int(g): v for g, v in record["timeline"].items()}}
        plot({"one group killed": killed}, args.replot.replace(".json", ".png"))
        return 0
    if not 0 < args.kill_at < args.kill_at + args.restart_after < args.seconds:
        parser.error("need 0 < --kill-at < --kill-at + --restart-after < --seconds")
    results = {"no failures": run(os.path.join(args.dir, "none"), args, kill=False),
               "one group killed": run(os.path.join(args.dir, "killed"), args, kill=True)}
    base, killed = results["no failures"], results["one group killed"]
    ratio = {g: round(killed["survivor_steps_in_window"][g] / base["survivor_steps_in_window"][g], 3) for g in (0, 2)}
    print(f"{'':34s}{'no failures':>14s}{'one killed':>14s}")
    for g in (0, 2):
        print(f"group {g} steps in {args.seconds:.0f} s{'':14s}{base['survivor_steps_in_window'][g]:>14d}"
              f"{killed['survivor_steps_in_window'][g]:>14d}   ratio {ratio[g]}")
        print(f"group {g} longest step (s){'':9s}{base['survivor_longest_step_s'][g]:>14.3f}"
              f"{killed['survivor_longest_step_s'][g]:>14.3f}")
    for key in ("killed_after_step", "healed_at_step", "steps_group_1_missed", "kill_to_first_step_without_it_s",
                "restart_to_healed_s", "restart_to_first_step_s", "identical_after_heal", "steps_compared_after_heal"):
        print(f"{key:34s}{'':14s}{str(killed[key]):>14s}")
    print("survivors' steps/s:", json.dumps(killed["survivor_steps_per_s"]))
    record = {"device": "CPU (2 cores), 3 groups x 2 simulated devices", "command": " ".join(["python", *sys.argv]),
              "args": vars(args), "survivor_steps_ratio": ratio,
              "runs": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in results.items()},
              "timeline": killed["_timeline"]}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    try:
        plot(results, args.out.replace(".json", ".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'jaxpar[plot]')")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
