"""Init benchmark: ``jaxpar.init`` against eager Flax init and one jitted program for the whole model.

Builds a Llama (``LlamaConfig.named(size, vocab_size=vocab)``, unrolled and scanned layers)
three ways, each timed from a fresh compilation state (``jax.clear_caches()`` before each;
the persistent compilation cache is off) until every variable is ready:

- **eager Flax**: ``Llama(cfg, rngs=nnx.Rngs(0))`` on one device, then ``jax.block_until_ready``;
- **jaxpar.init**: ``jaxpar.init(model_fn, ParallelConfig(mesh={"data": n}), mesh)`` — one small
  jitted program per kind of variable, placed by the plan;
- **one jitted program**: what ``jaxpar.init`` did before — ``jax.jit(make,
  out_shardings=plan)`` over the whole constructor (written out in ``whole_program_init``).

The methods take turns (order reversed every other round), so a change in the machine's load
hits them alike; each reports the median over ``--rounds`` of the wall time and of the
process's CPU time (all its threads: compiling and running; less sensitive than wall time to
other work on a shared machine), and both ratios to eager Flax.

    python benchmarks/init.py                     # CPU, 1 device, Llama 125m with vocab 8192
    python benchmarks/init.py --quick --out /tmp/init.json    # seconds: the tiny Llama, 1 layer
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax

if __name__ == "__main__":  # before JAX starts its backend; harmless on GPU/TPU
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_BENCH_DEVICES", "1")))
    jax.config.update("jax_enable_compilation_cache", False)   # every round compiles from scratch

import flax
import numpy as np
from flax import nnx

import jaxpar
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.nn import abstract_model, init_program, state_specs, to_shardings

METHODS = ("eager Flax", "jaxpar.init", "one jitted program")


def model_fn(size: str, vocab: int, scanned: bool, layers: int | None = None):
    cfg = LlamaConfig.named(size, vocab_size=vocab, scan_layers=scanned, **({"layers": layers} if layers else {}))
    return lambda: Llama(cfg, rngs=nnx.Rngs(0))


def whole_program_init(fn, config, mesh):
    """The previous ``jaxpar.init``: one ``jax.jit`` of the whole constructor, ``out_shardings`` = plan."""
    graphdef, abs_params, abs_rest = nnx.split(abstract_model(fn), nnx.Param, ...)
    shardings = tuple(to_shardings(state_specs(config, mesh, s, check_unused=False), mesh)
                      for s in (abs_params, abs_rest))

    def make():
        with nnx.use_eager_sharding(False):
            return nnx.split(fn(), nnx.Param, ...)[1:]

    return nnx.merge(graphdef, *jax.jit(make, out_shardings=shardings)())


def run_method(method: str, fn, config, mesh) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this process (all its threads) until the model is ready."""
    jax.clear_caches()
    start, cpu = time.perf_counter(), time.process_time()
    if method == "eager Flax":
        model = fn()
    elif method == "jaxpar.init":
        model = jaxpar.init(fn, config, mesh)
    else:
        model = whole_program_init(fn, config, mesh)
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - start, time.process_time() - cpu


def bench(args) -> list[dict]:
    devices = jax.devices()[:args.devices]
    config = jaxpar.ParallelConfig(mesh={"data": len(devices)}, mode="data")
    mesh = jaxpar.make_mesh(config, devices=devices)
    layouts = {"unrolled": False, "scanned": True}
    cases = [(layout, method) for layout in layouts for method in args.methods]
    times = {case: [] for case in cases}
    cpu_times = {case: [] for case in cases}
    for r in range(args.rounds):
        for layout, method in (cases if r % 2 == 0 else cases[::-1]):
            seconds, cpu = run_method(method, model_fn(args.size, args.vocab, layouts[layout], args.layers), config, mesh)
            times[(layout, method)].append(seconds)
            cpu_times[(layout, method)].append(cpu)
            print(f"  round {r + 1}: {layout} {method} {seconds:.2f}s (CPU {cpu:.2f}s)", file=sys.stderr)
    rows = []
    for layout, scanned in layouts.items():
        _, program = init_program(model_fn(args.size, args.vocab, scanned, args.layers), config, mesh)
        has_eager = "eager Flax" in args.methods
        eager = statistics.median(times[(layout, "eager Flax")]) if has_eager else None
        eager_cpu = statistics.median(cpu_times[(layout, "eager Flax")]) if has_eager else None
        for method in args.methods:
            seconds, cpu = statistics.median(times[(layout, method)]), statistics.median(cpu_times[(layout, method)])
            rows.append({"layers": layout, "method": method, "seconds": seconds, "all_seconds": times[(layout, method)],
                         "cpu_seconds": cpu, "all_cpu_seconds": cpu_times[(layout, method)],
                         "over_eager": seconds / eager if eager else None,
                         "cpu_over_eager": cpu / eager_cpu if eager_cpu else None,
                         "programs": program.program_count if method == "jaxpar.init" else None})
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name in ("layers", "method", "wall s (median)", "/ eager Flax", "CPU s (median)", "/ eager Flax ",
                 "compiled programs"):
        table.add_column(name, justify="left" if name in ("layers", "method") else "right")
    ratio = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        table.add_row(r["layers"], r["method"], f"{r['seconds']:.2f}", ratio(r["over_eager"]),
                      f"{r['cpu_seconds']:.2f}", ratio(r["cpu_over_eager"]),
                      "" if r["programs"] is None else str(r["programs"]))
    Console(width=120).print(table)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layers"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, method in enumerate(methods):
        values = [next(r["seconds"] for r in rows if r["layers"] == lay and r["method"] == method) for lay in layouts]
        ax.bar(np.arange(len(layouts)) + (i - (len(methods) - 1) / 2) * width, values, width, label=method)
    ax.set_xticks(np.arange(len(layouts)), layouts)
    ax.set_ylabel("seconds until every variable is ready (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="125m", help="LlamaConfig.named size (default 125m)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the named size's)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per method (median reported)")
    p.add_argument("--devices", type=int, default=1, help="devices of the data mesh (default 1)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), metavar="NAME", help=f"subset of {list(METHODS)}")
    p.add_argument("--quick", action="store_true",
                   help="the tiny Llama with 1 layer, one round: checks that the benchmark runs (seconds)")
    p.add_argument("--out", default=os.path.join(here, "results", "init_cpu.json"), help="JSON results")
    p.add_argument("--plot", default=None, help="PNG plot (default: --out with .png)")
    args = p.parse_args(argv)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    if args.devices < 1 or args.devices > len(jax.devices()):
        p.error(f"--devices {args.devices}: this process has {len(jax.devices())} devices "
                "(JAXPAR_BENCH_DEVICES=N simulates N CPU devices)")
    if args.quick:
        args.size, args.vocab, args.layers, args.rounds = "tiny", 64, 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    rows = bench(args)
    device = jax.devices()[0]
    title = (f"Llama {args.size}{f' ({args.layers} layers)' if args.layers else ''} (vocab {args.vocab}) init on {args.devices} {device.platform} "
             f"device{'s' if args.devices > 1 else ''}")
    print_table(rows, title)
    out = {"meta": {"jax": jax.__version__, "flax": flax.__version__,
                    "jaxpar": jaxpar.__version__, "platform": device.platform, "device_kind": device.device_kind,
                    "devices": args.devices, "host_cpus": os.cpu_count(), "python": platform.python_version(),
                    "size": args.size, "layers": args.layers, "vocab": args.vocab, "rounds": args.rounds,
                    "timing": "jax.clear_caches() before each, persistent cache off, methods alternating, median; "
                              "wall seconds and CPU seconds of the process (all threads)",
                    "load_average_1m_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "total_s": time.perf_counter() - start, "date": time.strftime("%Y-%m-%d")},
           "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    plot(rows, png, title)
    print(f"results written to {args.out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
