"""Test worker: reads global batches of a TokenLoader with per-process rows, under ``jaxpar launch``.

Each process reads only its rows, assembles the global ``jax.Array`` from them
(``make_array_from_process_local_data``), gathers it and writes hashes of the local rows and of
the global batches, from the start and resumed from a saved loader position, to ``rank_<i>.json``.
`train` is what each process of the launched matrix slice runs with a ``TokenLoader`` of its rows
(tests/workers/launched_extras.py).
"""

import argparse
import hashlib
import json
import os


def digest(batch) -> str:
    import numpy as np

    h = hashlib.sha256()
    for key in sorted(batch):
        h.update(key.encode() + np.ascontiguousarray(np.asarray(batch[key], np.int32)).tobytes())
    return h.hexdigest()


TRAIN_BATCH = 8      # global rows of a training batch: 4 a process on 2 processes, 2 on 4


def train(store, steps, process=None):
    """``(losses, eval loss)``: ``steps`` adamw steps of the tiny Llama, mode data on
    ``{"data": 8}``, through ``Trainer.fit`` on a ``TokenLoader`` (``process``: whose rows it
    reads, a ``LoaderProcess``; by default this process's), then ``evaluate`` on a loader of
    other batches."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.data import TokenLoader
    from jaxpar.models.llama import Llama, LlamaConfig, loss_fn

    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    cfg = LlamaConfig.named("tiny", vocab_size=264)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(3e-3),
                             loss_fn, config, mesh)
    loader = TokenLoader(store, seq_len=16, global_batch=TRAIN_BATCH, seed=7, model_config=cfg, process=process)
    losses = [h["loss"] for h in trainer.fit(loader, steps, progress=False)]
    held_out = TokenLoader(store, seq_len=16, global_batch=TRAIN_BATCH, seed=8, model_config=cfg, process=process)
    return losses, trainer.evaluate(held_out, steps=2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--store", required=True)
    p.add_argument("--state", required=True, help="JSON file of a saved TokenLoader.state()")
    p.add_argument("--batches", type=int, default=6)
    args = p.parse_args()
    import jaxpar.distributed as dist

    rank = dist.initialize().process_id
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxpar
    from jaxpar.data import TokenLoader

    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    gather = jax.jit(lambda b: b, out_shardings=whole)

    def read(loader, n):
        local, full = [], []
        for _ in range(n):
            rows = next(loader)
            local.append(digest(rows))
            placed = dist.make_global_batch(rows, split)
            assert placed["inputs"].shape == (16, 16) and not placed["inputs"].is_fully_addressable
            full.append(digest({k: np.asarray(v.addressable_data(0)) for k, v in gather(placed).items()}))
        return local, full

    make = lambda: TokenLoader(args.store, seq_len=16, global_batch=16, seed=5)
    loader = make()
    local, full = read(loader, args.batches)
    resumed = make()
    with open(args.state) as f:
        resumed.restore(json.load(f))
    _, again = read(resumed, args.batches - resumed.position)
    result = {"rank": rank, "processes": jax.process_count(), "local_devices": jax.local_device_count(),
              "rows": [loader.rows.start, loader.rows.stop], "local": local, "global": full, "resumed": again,
              "state": loader.state()}
    # written whole, then renamed: a test polling for reports never reads a half-written one
    path = os.path.join(args.out, f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
