"""What the test suite's XLA:CPU flags (tests/suite_xla.py) cost and save, on three of the
combination matrix's steps.

    .venv/bin/python benchmarks/suite_flags.py                 # about 2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/suite_flags.py --rounds 3 --out /tmp/flags.json
    .venv/bin/python benchmarks/suite_flags.py --busy --out benchmarks/results/suite_flags_busy.json

Each flag set runs in a fresh process (XLA reads ``XLA_FLAGS`` once), the sets taking turns
round by round, the order reversed every other round. A process builds three matrix cells'
trainers (Megatron; Megatron under a 1F1B pipeline; ZeRO-3 with ring context attention) on 8
simulated CPU devices with the persistent compilation cache off, and measures for each:
lowering (tracing included), the backend compile, 3 steps, and the compiled step's temp bytes
(buffer assignment runs after the flag's passes: a flag that changed it would show here).
Prints a table of medians and writes JSON (and a plot with ``--plot``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import suite_xla  # noqa: E402  the suite's own flags (tests/suite_xla.py)
SETS = {
    "-O0 (LLVM only)": "--xla_backend_optimization_level=0",
    "-O0, classic loop emitters": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
    "-O0, classic loop emitters, one LLVM module (the suite's)": suite_xla.xla_flags(),
    "default": "",
}


def measure() -> dict:
    """In the child process: the three cells' lowering, compile, 3 steps and temp bytes."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import matrix

    import jaxpar

    cells = [dict(matrix.BASE, layout="megatron"), dict(matrix.BASE, layout="megatron", pipeline="1f1b"),
             dict(matrix.BASE, zero=3, context="ring")]
    out = {"lower_s": 0.0, "compile_s": 0.0, "steps_s": 0.0, "temp_bytes": []}
    for cell in cells:
        trainer = matrix._trainer(matrix.config_for(cell), matrix.model_config(cell), 8)
        batch = matrix._batches()[0]
        start = time.perf_counter()
        lowered = trainer.lower(batch)
        mid = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
        out["lower_s"] += mid - start
        out["compile_s"] += end - mid
        out["temp_bytes"].append(jaxpar.report.memory(compiled).temp_bytes)
        jax.block_until_ready(trainer.step(batch))      # compiles the step once more, then runs
        start = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(trainer.step(batch))
        out["steps_s"] += time.perf_counter() - start
    return out


def run(flags: str, busy: bool = False) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    # the suite's other xdist worker, as a process that keeps one core busy
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              timeout=900, cwd=ROOT)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"flags {flags!r}: the measuring process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "suite_flags.json"))
    parser.add_argument("--plot", action="store_true", help="also write a PNG beside --out")
    parser.add_argument("--busy", action="store_true",
                        help="keep one core busy with another process meanwhile (the suite's second worker)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure()))
        return 0
    names = list(SETS)
    runs = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(run(SETS[name], args.busy))
            print(f"  round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr)
    rows = []
    for name in names:
        med = {k: statistics.median(x[k] for x in runs[name]) for k in ("lower_s", "compile_s", "steps_s")}
        rows.append({"flags": name, "xla_flags": SETS[name], **med, "temp_bytes": runs[name][0]["temp_bytes"],
                     "runs": runs[name]})
    from rich.console import Console
    from rich.table import Table

    busy = ", one core kept busy" if args.busy else ""
    table = Table(title=f"three matrix steps, 8 simulated CPU devices, {os.cpu_count()} cores{busy}, median of {args.rounds}")
    for col in ("flags", "lower s", "compile s", "3 steps x 3 s", "temp bytes per step"):
        table.add_column(col, justify="left" if col == "flags" else "right")
    for r in rows:
        table.add_row(r["flags"], f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}", f"{r['steps_s']:.2f}",
                      ", ".join(map(str, r["temp_bytes"])))
    Console(width=140).print(table)
    import jax

    result = {"command": "python benchmarks/suite_flags.py " + " ".join(argv or sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "jax": jax.__version__,
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([r["flags"] for r in rows], [r["compile_s"] for r in rows], label="backend compile")
        ax.barh([r["flags"] for r in rows], [r["lower_s"] for r in rows], left=[r["compile_s"] for r in rows],
                label="lowering")
        ax.set_xlabel("seconds, three matrix steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
