"""Test worker: trains the example GPT for a few steps under data x model parallel.

Run under ``jaxpar launch``. ``--feed`` lists the ways to hand batches to ``Trainer.step``, each
a fresh 5-step run from the same initial model:

* ``local``: each process passes only its rows of every global batch (the default of a
  multi-process run; process ``i`` holds the ``i``-th block);
* ``full``: every process passes the identical full global batch
  (``placement=jaxpar.Placement(global_batch=True)``);
* ``assembled``: the process builds the global ``jax.Array`` itself with
  ``jaxpar.distributed.make_global_batch`` from its rows.

Process 0 writes the losses of each to ``--out/losses.json``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(feed, steps, dist):
    import optax
    from flax import nnx

    import jaxpar
    from helpers import BATCH, LR, MEGATRON, TINY, batches
    from jaxpar.data import batch_shardings
    from jaxpar.models.gpt import GPT, loss_fn

    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(config)
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
    options = {} if feed == "local" else {"placement": jaxpar.Placement(global_batch=True)}
    trainer = jaxpar.Trainer(model, optax.adamw(LR), loss_fn, config, mesh, **options)
    rows = dist.process_rows(BATCH)
    losses = []
    for batch in batches(steps):
        mine = {k: v[rows] for k, v in batch.items()}  # this process loads only these rows
        if feed == "full":
            mine = batch
        elif feed == "assembled":
            mine = dist.make_global_batch(mine, batch_shardings(config, mesh, batch))
        losses.append(float(trainer.step(mine)["loss"]))
        print(f"{feed}: step {len(losses)} loss {losses[-1]:.6f}", flush=True)
    return losses


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--feed", default="local", help="comma-separated: local, full, assembled")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    import jaxpar.distributed as dist

    spec = dist.initialize()  # before anything touches JAX devices
    losses = {feed: train(feed, args.steps, dist) for feed in args.feed.split(",")}
    if spec.process_id == 0:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "processes": spec.num_processes}, f)


if __name__ == "__main__":
    main()
