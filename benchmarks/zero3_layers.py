"""ZeRO 3 on scanned layers: what the compiled step holds, and where it gathers.

A scanned Llama (16 layers, embed 256, mlp 1024, grouped-query attention, fp32) on data=8,
16 rows x 128 tokens, under ZeRO 0 and ZeRO 3, each with ``remat="none"`` and ``"full"``: the
compiled step's temp and argument bytes per device (``memory_analysis``), its all-gathers in
the entry computation and inside loop bodies (the scans' steps), and three adamw losses.
With the layers' parameters gathered one layer at a time (`jaxpar.train.step.gather_by_layer`)
ZeRO 3's temp stays near ZeRO 0's instead of holding every layer's parameters.

    python benchmarks/zero3_layers.py    # writes benchmarks/results/zero3_layers_cpu.{json,png}

Only public APIs: it runs against any commit (``PYTHONPATH=<checkout>``), which is how the
figures before the change were measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from jaxpar.report import memory  # noqa: E402

HERE = pathlib.Path(__file__).parent
CFG = LlamaConfig(vocab_size=512, embed=256, heads=8, kv_heads=2, mlp=1024, layers=16, max_seq_len=128,
                  scan_layers=True, dtype="float32", attention="reference")
GATHER = re.compile(r"= \S+ all-gather(?:-start)?\(")


def gathers(hlo: str) -> tuple[int, int]:
    """(all-gathers in the entry computation, all-gathers in other computations)."""
    entry = other = 0
    in_entry = False
    for line in hlo.splitlines():
        if re.match(r"^(?:ENTRY )?%?[\w.\-]+ .*\{$", line):
            in_entry = line.startswith("ENTRY")
        if GATHER.search(line):
            entry, other = (entry + 1, other) if in_entry else (entry, other + 1)
    return entry, other


def row(level: int, remat: str) -> dict:
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", optimizer={"level": level}, remat=remat)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: Llama(CFG, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (16, CFG.max_seq_len)), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    compiled = trainer.lower(batch).compile()
    mem = memory(compiled)
    entry, inside = gathers(compiled.as_text())
    losses = [float(trainer.step(batch)["loss"]) for _ in range(3)]
    return {"zero": level, "remat": remat, "temp_bytes": mem.temp_bytes, "argument_bytes": mem.argument_bytes,
            "gathers_in_entry": entry, "gathers_in_loops": inside, "losses": losses}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "zero3_layers_cpu.json"))
    ap.add_argument("--plot", action="store_true", help="also write the plot beside the JSON")
    args = ap.parse_args(argv)
    rows = [row(level, remat) for remat in ("none", "full") for level in (0, 3)]
    print(f"{'zero':>4} {'remat':<6} {'temp MB':>9} {'args MB':>9} {'gathers entry/loops':>20}  losses")
    for r in rows:
        print(f"{r['zero']:>4} {r['remat']:<6} {r['temp_bytes'] / 1e6:>9.1f} {r['argument_bytes'] / 1e6:>9.1f} "
              f"{r['gathers_in_entry']:>9}/{r['gathers_in_loops']:<10}  {', '.join(f'{x:.6f}' for x in r['losses'])}")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=os.path.dirname(jaxpar.__file__)).stdout.strip()
    result = {"meta": {"command": "python benchmarks/zero3_layers.py", "jax": jax.__version__,
                       "jaxpar_commit": commit, "devices": "8 simulated CPU devices"}, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        labels = [f"ZeRO {r['zero']}\nremat {r['remat']}" for r in rows]
        ax.bar(labels, [r["temp_bytes"] / 1e6 for r in rows], color=["grey", "tab:blue"] * 2)
        ax.set(ylabel="compiled temp MB per device", title="Scanned Llama, data=8: step temp")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    return result


if __name__ == "__main__":
    main()
