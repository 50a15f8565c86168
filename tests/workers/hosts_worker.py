"""Test worker: two processes as two hosts (``jaxpar launch``, 2 processes x 4 devices).

Cells train the per-host worker's model (`per_host_worker.model_fn`, each process feeding its
own rows) on a mesh built with ``ParallelConfig.hosts``: ``{"data": 2, "model": 4}`` with data
across the hosts, and ``{"data": 4, "model": 2}`` with data 2 hosts x 2 inside. For each the
compiled step's collectives are read with `jaxpar.report.collectives` and checked against the
truth from the mesh itself (the processes of the devices in each replica group). A matmul with
``model`` across the hosts shows the other side; ``hosts={"data": 4}`` is refused by name;
`jaxpar.auto.calibrate` fits both networks. Process 0 writes ``--out/results.json``.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: the workers package

CELLS = {
    "data_across": dict(mesh={"data": 2, "model": 4}, hosts={"data": 2}, rules={"mlp": "model"}),
    "data_2x2": dict(mesh={"data": 4, "model": 2}, hosts={"data": 2}, rules={"mlp": "model"}),
}


def truth(c, mesh) -> int:
    """Hosts a collective's groups span, from the mesh's devices (not from the report)."""
    procs = [d.process_index for d in mesh.devices.flat]
    groups = c.replica_groups
    return max(len({procs[i] for i in g}) for g in groups)


def rows_of(cols, mesh):
    return [{"kind": c.kind, "axes": list(c.mesh_axes or ()), "hosts": c.hosts_spanned, "truth": truth(c, mesh),
             "bytes": c.bytes, "intra": c.intra_host_bytes, "inter": c.inter_host_bytes} for c in cols]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    started = time.monotonic()
    import jaxpar.distributed as dist

    spec = dist.initialize()
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxpar
    from jaxpar.auto import calibrate
    from jaxpar.mesh import host_map
    from jaxpar.report import collectives, format_collectives
    from workers.per_host_worker import GLOBAL, STEPS, global_batches, loss_fn, model_fn

    rows = dist.process_rows(GLOBAL)
    mine = lambda b: {k: v[rows] for k, v in b.items()}  # noqa: E731
    results = {"processes": jax.process_count(), "cells": {}}
    for name, fields in CELLS.items():
        config = jaxpar.ParallelConfig(**fields)
        mesh = jaxpar.make_mesh(config)
        trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.sgd(0.1), loss_fn, config, mesh)
        losses = [float(trainer.step(mine(b))["loss"]) for b in global_batches(STEPS)]
        cols = collectives(trainer.lower(mine(global_batches(1)[0])).compile(), mesh)
        results["cells"][name] = {"losses": losses, "host_map": host_map(mesh), "collectives": rows_of(cols, mesh),
                                  "table": format_collectives(cols, width=160)}
        print(f"{name}: {losses} ({time.monotonic() - started:.1f} s)", flush=True)
    # model across the hosts: the tensor-parallel matmul's all-reduce crosses
    mesh = jaxpar.make_mesh(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, hosts={"model": 2}))
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    f = jax.jit(lambda x, w: x @ w, in_shardings=(s("data", "model"), s("model", None)), out_shardings=s("data"))
    compiled = f.lower(jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((32, 8), jnp.float32)).compile()
    results["model_across"] = {"host_map": host_map(mesh), "collectives": rows_of(collectives(compiled, mesh), mesh)}
    try:
        jaxpar.make_mesh(jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, hosts={"data": 4}))
        results["refusal"] = None
    except ValueError as e:
        results["refusal"] = str(e)
    machine = calibrate(jaxpar.make_mesh(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, hosts={"data": 2})),
                        repeats=2)
    results["calibrated"] = {"hosts": dict(machine.hosts), "devices_per_host": machine.devices_per_host,
                             "inter_host_bandwidth": machine.inter_host_bandwidth,
                             "inter_host_latency": machine.inter_host_latency, "bandwidth": dict(machine.bandwidth)}
    print(f"done ({time.monotonic() - started:.1f} s)", flush=True)
    if spec.process_id == 0:
        path = os.path.join(args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
