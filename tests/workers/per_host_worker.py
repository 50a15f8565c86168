"""Test worker: each process feeds the Trainer only its own rows of every global batch.

Run under ``jaxpar launch`` (4 processes x 2 devices). Every cell is a fresh run from the same
initial model: ``STEPS`` sgd steps on process ``p``'s block of rows of each global batch of
``GLOBAL`` rows (``jaxpar.distributed.process_rows``), then ``Trainer.evaluate`` on two more
blocks. The cells (`CELLS`) cover mode data on ``{"data": 8}`` (through ``fit``, then ``place``
+ ``step`` + ``lower``), ZeRO-3, ZeRO-3 x grad_accum=2, and ``{"model": 2, "data": 4}`` with
each process's devices along ``model`` (one data shard a process) or along ``data`` (as
``jaxpar.make_mesh`` orders them: two shards a process, each shared by two processes). A batch
of rows that do not split is refused on every process alike; its message is recorded.
Process 0 writes everything to ``--out/results.json``. The model and data are importable, so the
test trains the same on one device.
"""

import argparse
import json
import os
import time

GLOBAL, STEPS = 16, 3
MODEL_DATA = {"model": 2, "data": 4}
CELLS = {
    "data": dict(mesh={"data": 8}, mode="data"),
    "zero3": dict(mesh={"data": 8}, mode="data", optimizer={"level": 3, "threshold_kb": 0}),
    "zero3_accum2": dict(mesh={"data": 8}, mode="data", optimizer={"level": 3, "threshold_kb": 0}, grad_accum=2),
    "model_data_devices_on_model": dict(mesh=MODEL_DATA, rules={"mlp": "model"}),
    "model_data_devices_on_data": dict(mesh=MODEL_DATA, rules={"mlp": "model"}),
}


def model_fn():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(6, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(16, 1, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    return Mlp(nnx.Rngs(0))


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def global_batches(n, start=0):
    """Global batches ``start .. start + n - 1`` of ``GLOBAL`` rows (the same on every process)."""
    import numpy as np

    out = []
    for i in range(start, start + n):
        rng = np.random.default_rng(i)
        x = rng.normal(size=(GLOBAL, 6)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)})
    return out


def run(trainer, mine, use_fit):
    """``(train losses, eval loss)`` of ``trainer`` fed ``mine(batch)`` rows of each global batch."""
    train = [mine(b) for b in global_batches(STEPS)]
    if use_fit:
        losses = [h["loss"] for h in trainer.fit(iter(train), STEPS, progress=False)]
    else:
        losses = []
        for b in train:
            placed = trainer.place(b)      # global arrays; the step takes them as they are
            assert placed["x"].shape == (GLOBAL, 6) and not placed["x"].is_fully_addressable
            losses.append(float(trainer.step(placed)["loss"]))
        trainer.lower(train[0])            # lowers for the per-process rows, as step compiled them
    held_out = [mine(b) for b in global_batches(2, start=100)]
    return losses, trainer.evaluate(held_out)


def refusals(trainer, mine):
    """The messages of a step and an evaluation fed 3 rows a process, of both fed 8 rows (step)
    or 6 (evaluate) on process 0 and 4 on the others, each a count that splits on its own, and
    of a step fed no rows on process 1: refused before anything runs, by every process alike (no
    collective is left waiting), after process 0 alone has lowered an evaluation."""
    import jax
    import numpy as np

    first = mine(global_batches(1)[0])
    three = {k: v[:3] for k, v in first.items()}
    uneven = {k: np.concatenate([v, v]) if jax.process_index() == 0 else v for k, v in first.items()}
    none = {k: v[:0] if jax.process_index() == 1 else v for k, v in first.items()}
    if jax.process_index() == 0:     # one process lowers alone (a report): no collective, so no wait
        trainer.lower_eval({k: v[:2] for k, v in first.items()})
    said = {}
    for what, call, batch in (("step", trainer.step, three), ("evaluate", lambda b: trainer.evaluate([b]), three),
                              ("uneven_step", trainer.step, uneven), ("no_rows_on_one", trainer.step, none),
                              ("uneven_evaluate", lambda b: trainer.evaluate([{k: v[:6] for k, v in b.items()}]),
                               uneven)):
        try:
            call(batch)
            said[what] = None
        except ValueError as e:
            said[what] = str(e)
    return said


def global_refusal(config, mesh, mine):
    """The message of a step that says each process passes the whole global batch
    (``Placement(global_batch=True)``) and is given each process's own rows instead."""
    import optax

    import jaxpar

    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.sgd(0.1), loss_fn, config, mesh,
                             placement=jaxpar.Placement(global_batch=True))
    try:
        trainer.step(mine(global_batches(1)[0]))
    except ValueError as e:
        return str(e)
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    started = time.monotonic()
    import jaxpar.distributed as dist

    spec = dist.initialize()
    print(f"joined ({time.monotonic() - started:.1f} s)", flush=True)
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxpar

    rows = dist.process_rows(GLOBAL)
    assert rows.stop - rows.start == 4        # the natural per-host batch: 4 rows of 16
    mine = lambda b: {k: v[rows] for k, v in b.items()}  # noqa: E731
    results = {"processes": jax.process_count(), "local_devices": jax.local_device_count(), "cells": {}}
    for name, fields in CELLS.items():
        config = jaxpar.ParallelConfig(**fields)
        mesh = jaxpar.make_mesh(config)
        if name == "model_data_devices_on_model":      # process p's two devices: model 0 and 1 of data shard p
            ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
            mesh = Mesh(np.array(ordered).reshape(4, 2).T, ("model", "data"), axis_types=mesh.axis_types)
        trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.sgd(0.1), loss_fn, config, mesh)
        if name == "zero3_accum2":
            results["refusals"] = refusals(trainer, mine)
            results["refusals"]["global_batch_own_rows"] = global_refusal(config, mesh, mine)
        losses, evaluated = run(trainer, mine, use_fit=name != "data")
        results["cells"][name] = {"losses": losses, "eval": evaluated,
                                  "spec": str(trainer.place(mine(global_batches(1)[0]))["x"].sharding.spec)}
        print(f"{name}: losses {losses} eval {evaluated} ({time.monotonic() - started:.1f} s)", flush=True)
    if spec.process_id == 0:
        path = os.path.join(args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
