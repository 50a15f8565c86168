"""Test worker: one process of a 2-process jax.distributed job training the ps_model click
model through parameter servers on its half of each batch (``jaxpar.Trainer`` with
``jaxpar.ps.ServerRows``); writes its losses to ``--out``."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--process", type=int, required=True)
p.add_argument("--coordinator", required=True)
p.add_argument("--addresses", required=True)
p.add_argument("--out", required=True)
p.add_argument("--tag", default="")
args = p.parse_args()

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.process,
                           initialization_timeout=60)

import jaxpar  # noqa: E402
from jaxpar import ps  # noqa: E402
from workers.ps_model import ITEMS, TOKEN, USERS, make_batches, mesh_trainer  # noqa: E402

client = ps.connect([USERS, ITEMS], addresses=args.addresses.split(","), token=TOKEN, timeout=60)
assert (client.worker, client.workers) == (args.process, 2)
source, trainer = mesh_trainer(client, jaxpar.ParallelConfig(mesh={"data": 4}))
half = slice(16 * args.process, 16 * args.process + 16)  # this process's rows of each batch of 32
local = [{k: v[half] for k, v in b.items()} for b in make_batches(20)]
losses = [h["loss"] for h in trainer.fit(source.prefetching(local, 20), 20, progress=False)]
with open(args.out, "w") as f:
    json.dump({"losses": losses}, f)
client.close()
jax.distributed.shutdown()
