"""Test worker for the local checkpoint tier under ``jaxpar launch --worker-restarts 1`` (4
processes x 2 devices, two simulated hosts of two processes: ``JAXPAR_HOST_ID`` = process // 2).

``local_tier_worker.py --out DIR --tier DIR --ckpt DIR``: every process trains the GPT of
`model` on its own rows of each global batch, saving to the local tier every ``LOCAL_EVERY``
steps (the persistent tier only every 100). In the group's first run, after step ``KILL_AT``
every process waits for its local writes (so step ``KILL_AT - 1`` is complete everywhere) and
process 1 kills itself with SIGKILL; the launcher restarts the group. In the second run the
processes of host 1 first wipe their local directories (a replaced host), so they resume
through their peers' copies; the group trains on to ``STEPS``. Process p writes
``DIR/resumed-<p>.json`` ({step, source}) and process 0 ``DIR/params.npz`` (every parameter,
gathered) at the end.
"""

import argparse
import json
import os
import shutil
import signal
import sys

STEPS, LOCAL_EVERY, KILL_AT, GLOBAL = 10, 2, 7, 16


def model_config():
    from jaxpar.models.gpt import GPTConfig

    return GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=2, dropout=0.0)


def parallel_config():
    import jaxpar

    return jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, rules={"batch": "data", "heads": "model", "mlp": "model"},
                                 optimizer={"level": 1, "threshold_kb": 0})


def batches():
    from jaxpar.models.data import ArithmeticData

    data = ArithmeticData(16)
    return [data.batch(GLOBAL, i) for i in range(STEPS)]


def trainer(services=None, placement=None, devices=None):
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.gpt import GPT, loss_fn

    config = parallel_config()
    mesh = jaxpar.make_mesh(config, devices=devices)
    model = jaxpar.init(lambda: GPT(model_config(), rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, services=services, placement=placement)


def watch_compiles() -> tuple[list, list]:
    """``(names of the functions this process compiled (or loaded from JAX's cache), programs it
    read back from jaxpar.executables' folder)``, filled as the process runs."""
    import logging
    import re

    import jax

    from jaxpar.executables import READ_EVENT

    compiled, read = [], []

    class Names(logging.Handler):
        def emit(self, record):
            if m := re.search(r"Finished XLA compilation of (?:jit\()?(\w+)", record.getMessage()):
                compiled.append(m.group(1))

    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(Names())
    jax.monitoring.register_event_listener(lambda event, **_: read.append(event) if event == READ_EVENT else None)
    return compiled, read


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tier", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    import jaxpar.distributed as dist

    dist.initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxpar

    me, restart = jax.process_index(), int(os.environ.get("JAXPAR_WORKER_RESTART", "0"))
    compiled, read = watch_compiles()
    os.environ["JAXPAR_HOST_ID"] = f"host{me // 2}"
    if restart == 1 and me // 2 == 1:      # host 1 was replaced: its local storage is empty
        shutil.rmtree(os.path.join(args.tier, f"process-{me}"), ignore_errors=True)
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(
        dir=args.ckpt, save_every=100, local_dir=args.tier, local_every=LOCAL_EVERY))
    t = trainer(services, jaxpar.Placement(global_batch=False))
    local = t.service("checkpoint").local
    recovery = local.recovery
    with open(os.path.join(args.out, f"resumed-{me}.{restart}.json"), "w") as f:
        json.dump({"step": t.step_count, "source": None if recovery is None else recovery.source}, f)
    rows = dist.process_rows(GLOBAL)
    for i, batch in enumerate(batches()[t.step_count:]):
        t.step({k: v[rows] for k, v in batch.items()})
        if i == 0:       # what this life's first step compiled or read
            with open(os.path.join(args.out, f"compiled-{me}.{restart}.first.json"), "w") as f:
                json.dump({"compiled": sorted(set(compiled)), "read": len(read)}, f)
        if restart == 0 and t.step_count == KILL_AT:
            local.wait()                   # step KILL_AT - 1 is written (and copied) on every process
            multihost_utils.sync_global_devices("written")
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            signal.pause()                  # the launcher ends the others
    from flax import nnx

    state = nnx.to_pure_dict(nnx.state(t.model, nnx.Param))
    whole = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(
        t.mesh, jax.sharding.PartitionSpec()))(state)
    flat = {jax.tree_util.keystr(k): np.asarray(v.addressable_data(0))
            for k, v in jax.tree_util.tree_flatten_with_path(whole)[0]}
    t.close()
    with open(os.path.join(args.out, f"compiled-{me}.{restart}.json"), "w") as f:
        json.dump({"compiled": sorted(set(compiled)), "read": len(read)}, f)
    if me == 0:
        np.savez(os.path.join(args.out, "params.npz"), **flat)
    sys.exit(0)


if __name__ == "__main__":
    main()
