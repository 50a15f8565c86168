"""Host-side embedding: time of one `jaxpar.Trainer` step of the click model (its table a
`jaxpar.ps.HostRows` row source) for each table storage,
and where that time goes (host dedup, moving rows, the device step, the row update).

    .venv/bin/python benchmarks/host_embedding.py                   # about 30 s on 2 CPU cores
    .venv/bin/python benchmarks/host_embedding.py --rows 10000000 --batch 4096 --out r.json

Each storage trains the same model on the same batches; the storages take turns step by step,
so a change in the machine's load hits all of them alike. Reported per storage: median step
ms, ids looked up per second (batch × fields / step time), unique rows moved and updated per
second, and the median ms of each phase (measured in a second pass that blocks after each).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.data.clicks import ClickData
from jaxpar.models.dlrm import DLRM, DLRMConfig, loss_fn
from jaxpar.ps import HostEmbedding, HostRows, RowOptimizer


class PhaseRows(HostRows):
    """`HostRows` that, with ``timing`` set, blocks after each phase and records its ms."""

    timing, times, _t = False, {}, 0.0

    def pull(self, batch):
        if not self.timing:
            return super().pull(batch)
        t0 = time.perf_counter()
        prepared = self.table.prepare(self.ids(batch[self.key]))
        t1 = time.perf_counter()
        rows = jax.block_until_ready(self.table.pull(prepared))
        self._t = time.perf_counter()
        self.times = {"dedup": (t1 - t0) * 1e3, "pull": (self._t - t1) * 1e3}
        return {**batch, self.key: prepared.inverse}, rows, prepared

    def push(self, handle, row_grads, step):
        if not self.timing:
            return super().push(handle, row_grads, step)
        jax.block_until_ready(row_grads)
        t3 = time.perf_counter()
        super().push(handle, row_grads, step)
        self.table.block_until_ready()
        self.times.update(device_step=(t3 - self._t) * 1e3, apply=(time.perf_counter() - t3) * 1e3)


def build(storage: str, config: DLRMConfig, folder: str) -> tuple[jaxpar.Trainer, PhaseRows]:
    path = os.path.join(folder, "table.rows") if storage == "file" else None
    table = HostEmbedding("clicks", config.rows, config.embed,
                          RowOptimizer(kind="adagrad", learning_rate=0.05), storage=storage, path=path)
    parallel, source = jaxpar.ParallelConfig(mesh={"data": 1}), PhaseRows(table, ids=config.table_ids)
    return jaxpar.Trainer(DLRM(config, rngs=nnx.Rngs(0), table=False), optax.adam(0.01),
                          lambda model, batch, rows: loss_fn(model, batch, rows, batch["ids"]), parallel,
                          jaxpar.make_mesh(parallel, devices=jax.devices()[:1]), rows=source), source


def phases(trainer: jaxpar.Trainer, source: PhaseRows, batch) -> dict[str, float]:
    """One step, cut into its phases, blocking after each (slower than a real step)."""
    source.timing = True
    try:
        trainer.step(batch)
    finally:
        source.timing = False
    return source.times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--storages", nargs="+", default=["pinned_host", "callback", "file"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    fields = (args.rows // 2, args.rows // 4, args.rows - args.rows // 2 - args.rows // 4)
    data, config = ClickData(field_rows=fields), DLRMConfig(field_rows=fields, embed=args.dim)
    folder = tempfile.mkdtemp()
    steps = {s: build(s, config, folder) for s in args.storages}
    batches = [data.batch(i, args.batch) for i in range(args.steps + 2)]
    unique = statistics.median(np.unique(config.table_ids(b["ids"])).size for b in batches)
    times = {s: [] for s in steps}
    for i, b in enumerate(batches):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for s in order:
            t = time.perf_counter()
            trainer, source = steps[s]
            jax.block_until_ready(trainer.step(b)["loss"])
            source.table.block_until_ready()  # the row update too, before the next storage
            if i >= 2:  # the first two compile
                times[s].append(time.perf_counter() - t)
    results = {}
    for s, (trainer, source) in steps.items():
        ms = statistics.median(times[s]) * 1e3
        cut = [phases(trainer, source, b) for b in batches[:10]]
        results[s] = {"step_ms": ms, "ids_per_s": args.batch * len(fields) / ms * 1e3,
                      "rows_per_s": unique / ms * 1e3,
                      **{f"{k}_ms": statistics.median(c[k] for c in cut) for k in cut[0]}}
    print(f"table {config.rows:,} x {args.dim}, batch {args.batch} x {len(fields)} ids "
          f"(median {unique:.0f} unique rows), {jax.devices()[0].platform}")
    print(f"{'storage':12} {'step ms':>8} {'ids/s':>10} {'rows/s':>10}  dedup / pull / device / apply ms")
    for s, r in results.items():
        print(f"{s:12} {r['step_ms']:8.2f} {r['ids_per_s']:10.0f} {r['rows_per_s']:10.0f}  "
              f"{r['dedup_ms']:.2f} / {r['pull_ms']:.2f} / {r['device_step_ms']:.2f} / {r['apply_ms']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "unique_rows": unique, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
