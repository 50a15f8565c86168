"""Times every cell of the combination matrix alone and fits `matrix.CELL_COST` to the times.

    python tests/workers/matrix_costs.py [--processes 2] [--out costs.jsonl]

Each cell runs as the matrix test runs it (no compilation cache, the suite's XLA flags), in one
of ``--processes`` child processes; its CPU seconds go to ``--out`` as a JSON line. The fit is a
least-squares line through the log of the times over one-hot feature values (ridge 0.3), printed
as the base and the factors to paste into tests/matrix.py.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(out: str, indices: list[int]) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, TESTS)
    import tempfile

    import matrix

    for i in indices:
        cell = matrix.CELLS[i]
        wall, cpu = time.perf_counter(), time.process_time()
        with tempfile.TemporaryDirectory() as tmp:
            matrix.run_cell(cell, tmp)
        with open(out, "a") as f:
            f.write(json.dumps({"cell": cell, "cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}) + "\n")


def fit(rows: list[dict]) -> tuple[float, dict]:
    import numpy as np

    sys.path.insert(0, TESTS)
    import matrix

    cols = [(f, v) for f, values in matrix.FEATURES.items() for v in values[1:]]
    x = np.array([[1.0] + [float(r["cell"][f] == v) for f, v in cols] for r in rows])
    y = np.log([r["cpu"] for r in rows])
    w = np.linalg.solve(x.T @ x + 0.3 * np.diag([0.0] + [1.0] * len(cols)), x.T @ y)
    factors = {c: math.exp(wi) if c[0] in ("layout", "mode") else max(math.exp(wi), 1.03) for c, wi in zip(cols, w[1:])}
    return math.exp(w[0]), factors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out", default="matrix_costs.jsonl")
    p.add_argument("--child", nargs="*", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        return child(args.out, args.child)
    sys.path.insert(0, TESTS)
    import matrix

    import suite_xla

    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false",   # the suite's flags (tests/suite_xla.py)
               XLA_FLAGS=suite_xla.xla_flags(os.environ.get("XLA_FLAGS", "")))
    open(args.out, "w").close()
    n = len(matrix.CELLS)
    procs = [subprocess.Popen([sys.executable, __file__, "--out", args.out, "--child",
                               *map(str, range(k, n, args.processes))], env=env) for k in range(args.processes)]
    if any(proc.wait() for proc in procs):
        sys.exit("a child process failed")
    rows = [json.loads(line) for line in open(args.out)]
    base, factors = fit(rows)
    print(f"{len(rows)} cells, {sum(r['cpu'] for r in rows):.0f} CPU seconds")
    print(f"CELL_COST_BASE = {base:.2f}")
    print("CELL_COST = {" + ", ".join(f"{k!r}: {v:.2f}" for k, v in factors.items()) + "}")


if __name__ == "__main__":
    main()
