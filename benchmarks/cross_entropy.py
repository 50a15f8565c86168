"""LM head + cross-entropy: the materialised loss against `jaxpar.ops.chunked_cross_entropy`.

For each variant, ``jax.value_and_grad`` of the loss wrt the hidden states and the head
(what a training step runs) is compiled on one device; the table gives the compiled
program's temporary bytes (``jaxpar.report.memory``: XLA's buffer assignment, so on CPU
it is what the same program would allocate on a GPU up to fusion differences), its output
bytes, the median time of a call (variants timed in turns, see ``benchmarks/step.py``), and
the loss and gradients' relative difference from the materialised ones.

"materialised" is ``logits = einsum(h, table.astype(h.dtype), preferred_element_type=float32)``
for every token at once, then ``optax.softmax_cross_entropy_with_integer_labels`` and the mean
(whose gradient matmuls XLA runs in fp32 for bf16 inputs); "mat. head_logits" is the same through
`jaxpar.nn.logits.head_logits` (gradient matmuls in the inputs' dtype): the Llama's ``loss_fn``.

    python benchmarks/cross_entropy.py              # CPU: 4096 tokens × vocab 32768 × embed 512, fp32
                                                    # (~2 min on 2 cores); writes results/cross_entropy_cpu.{json,png}
    python benchmarks/cross_entropy.py --gpu-shape  # the issue's shape: 16,384 × 128,256 × 2048 bf16, tied
                                                    # (Llama-3.2-1B), writes results/cross_entropy_<device>.{json,png}
    python benchmarks/cross_entropy.py --tokens 8192 --chunks 4 8 --steps 10 --out /tmp/ce.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

if "--gpu-shape" not in sys.argv:       # the CPU unless asked for the GPU shape (or JAX_PLATFORMS says)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from step import time_interleaved  # noqa: E402

from jaxpar.ops import chunked_cross_entropy  # noqa: E402
from jaxpar.report import memory  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
GPU_SHAPE = dict(tokens=16384, vocab=128256, embed=2048, dtype="bfloat16", chunks=[4, 8, 16, 32], tied=True)


def materialised(x, table, targets, tied: bool):
    logits = jnp.einsum("bse,ve->bsv" if tied else "bse,ev->bsv", x, table.astype(x.dtype),
                        preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def materialised_head_logits(x, table, targets, tied: bool):
    """The same with `jaxpar.nn.logits.head_logits`: its gradient matmuls in the inputs' dtype."""
    from jaxpar.nn.logits import head_logits

    return optax.softmax_cross_entropy_with_integer_labels(head_logits(x, table, tied=tied), targets).mean()


def variants(chunks: list[int], tied: bool) -> dict:
    out = {"materialised": lambda x, w, t: materialised(x, w, t, tied),
           "mat. head_logits": lambda x, w, t: materialised_head_logits(x, w, t, tied)}
    for n in chunks:
        out[f"chunked {n}"] = lambda x, w, t, n=n: chunked_cross_entropy(x, w, t, chunks=n, tied=tied)
    return out


def inputs(a):
    """Hidden states [batch, seq, embed] (batch 8, as a training batch of sequences), the head and targets."""
    k = jax.random.split(jax.random.key(0), 3)
    dtype = jnp.dtype(a.dtype)
    x = (jax.random.normal(k[0], (8, a.tokens // 8, a.embed), jnp.float32)).astype(dtype)
    shape = (a.vocab, a.embed) if a.tied else (a.embed, a.vocab)
    table = (0.02 * jax.random.normal(k[1], shape, jnp.float32)).astype(dtype)
    targets = jax.random.randint(k[2], (8, a.tokens // 8), 0, a.vocab)
    return x, table, targets


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--tied", action="store_true", help="the head is the [vocab, embed] embedding table")
    p.add_argument("--gpu-shape", action="store_true", help="16,384 tokens × vocab 128,256 × embed 2048, bf16, tied")
    p.add_argument("--steps", type=int, default=None, help="timed calls per variant (default 3 on CPU, 20 else)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cross_entropy_<cpu|device>.json)")
    a = p.parse_args(argv)
    if a.gpu_shape:
        for k, v in GPU_SHAPE.items():
            setattr(a, k, v)
    if a.tokens % 8:
        p.error(f"--tokens={a.tokens} must be a multiple of 8 (a batch of 8 sequences)")
    platform = jax.devices()[0].platform
    steps = a.steps or (3 if platform == "cpu" else 20)
    x, table, targets = inputs(a)
    rows, runs, results = [], [], []
    for name, loss in variants(a.chunks, a.tied).items():
        fn = jax.jit(jax.value_and_grad(loss, (0, 1)))
        compiled = fn.lower(x, table, targets).compile()
        mem = memory(compiled)
        rows.append({"variant": name, "temp_bytes": mem.temp_bytes, "output_bytes": mem.output_bytes})
        runs.append(lambda compiled=compiled: compiled(x, table, targets))
        results.append(jax.block_until_ready(runs[-1]()))
        print(f"compiled {name}", flush=True)
    ref_loss, ref_grads = results[0]
    for row, (loss, grads) in zip(rows, results):
        row["loss_rel_diff"] = rel(loss, ref_loss)
        row["dx_rel_diff"], row["dtable_rel_diff"] = (rel(g, r) for g, r in zip(grads, ref_grads))
    for row, times in zip(rows, time_interleaved(runs, a.warmup, steps)):
        row["ms"] = round(1e3 * statistics.median(times), 2)
    base = rows[0]
    for row in rows:
        row["time_ratio"] = round(row["ms"] / base["ms"], 3)
        row["temp_ratio"] = round(row["temp_bytes"] / max(base["temp_bytes"], 1), 3)
    shape = f"{a.tokens} tokens × vocab {a.vocab} × embed {a.embed}, {a.dtype}, {'tied' if a.tied else 'untied'}"
    print(f"value_and_grad of LM head + cross-entropy, {shape}, on {jax.devices()[0].device_kind}")
    print(f"{'variant':>16} {'temp MiB':>9} {'× temp':>7} {'ms':>9} {'× time':>7} {'loss diff':>9} "
          f"{'dx diff':>8} {'dW diff':>8}")
    for r in rows:
        print(f"{r['variant']:>16} {r['temp_bytes'] / 2**20:>9.1f} {r['temp_ratio']:>7.3f} {r['ms']:>9.2f} "
              f"{r['time_ratio']:>7.3f} {r['loss_rel_diff']:>9.1e} {r['dx_rel_diff']:>8.1e} {r['dtable_rel_diff']:>8.1e}")
    kind = jax.devices()[0].device_kind.lower().removeprefix("nvidia ").replace(" ", "_")
    out = pathlib.Path(a.out) if a.out else RESULTS / f"cross_entropy_{'cpu' if platform == 'cpu' else kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": jax.devices()[0].device_kind, "platform": platform, "jax": jax.__version__,
              "tokens": a.tokens, "vocab": a.vocab, "embed": a.embed, "dtype": a.dtype, "tied": a.tied,
              "steps": steps, "command": "python benchmarks/cross_entropy.py " + " ".join(argv or sys.argv[1:]),
              "rows": rows}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    plot(record, out.with_suffix(".png"))


def plot(record, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    rows = record["rows"]
    names = [r["variant"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [r["temp_bytes"] / 2**20 for r in rows])
    a.set(ylabel="MiB", title="temporaries of the compiled value_and_grad")
    b.bar(names, [r["ms"] for r in rows])
    b.set(ylabel="ms (median)", title=f"time on {record['device']}")
    fig.suptitle(f"{record['tokens']} tokens × vocab {record['vocab']} × embed {record['embed']}, {record['dtype']}")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
