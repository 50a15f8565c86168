"""Train the DLRM-style click model with its embedding table in host memory (or in a file).

    python examples/train_clicks.py                                   # 300k rows, pinned_host
    python examples/train_clicks.py --rows 40000000 --dim 32 --storage file \\
        --table-path /tmp/clicks.rows --rlimit-as-gib 3               # a 5 GB table under 3 GiB

The dense towers train on the device in the `jaxpar.Trainer`'s compiled step; the table is
its row source (`jaxpar.ps.HostRows`): only the rows a batch uses travel to the step, and
their row optimizer (Adagrad) updates them on the host after it. With
``--rlimit-as-gib`` the process limits its own address space (``RLIMIT_AS``) before JAX
starts, and the summary shows its peak address space and resident memory next to the table's
size.
"""

import argparse
import json
import resource
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, default=300_000, help="rows of the table, over 3 fields")
parser.add_argument("--dim", type=int, default=16, help="width of an embedding row")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=512)
parser.add_argument("--storage", default="auto", choices=("auto", "pinned_host", "callback", "file"))
parser.add_argument("--table-path", default=None, help="the table's file (--storage file)")
parser.add_argument("--rlimit-as-gib", type=float, default=None,
                    help="limit this process's address space to this many GiB")
parser.add_argument("--json", default=None, help="also write the summary to this file")
args = parser.parse_args()
if args.rlimit_as_gib:  # before JAX starts: its own reservations count too
    limit = int(args.rlimit_as_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.data.clicks import ClickData  # noqa: E402
from jaxpar.models.dlrm import DLRM, DLRMConfig, loss_fn  # noqa: E402
from jaxpar.ps import HostEmbedding, HostRows, RowOptimizer  # noqa: E402


def status_kib(name: str) -> int:
    """A ``Vm*`` line of /proc/self/status (``VmRSS``, ``VmHWM``, ``VmPeak``) in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


fields = (args.rows // 2, args.rows // 4, args.rows - args.rows // 2 - args.rows // 4)
data = ClickData(field_rows=fields)
config = DLRMConfig(field_rows=fields, embed=args.dim, bottom=(64,), top=(64,))
table = HostEmbedding("clicks", config.rows, args.dim,
                      RowOptimizer(kind="adagrad", learning_rate=0.05),
                      storage=args.storage, path=args.table_path)
parallel = jaxpar.ParallelConfig(mesh={"data": 1})
trainer = jaxpar.Trainer(DLRM(config, rngs=nnx.Rngs(0), table=False), optax.adam(0.01),
                         lambda model, batch, rows: loss_fn(model, batch, rows, batch["ids"]),  # ids: rows' indices
                         parallel, jaxpar.make_mesh(parallel, devices=jax.devices()[:1]),
                         rows=HostRows(table, ids=config.table_ids))
held_out = data.eval_batch(2048)


def eval_loss() -> float:
    return trainer.evaluate([held_out])


start_loss = eval_loss()
print(f"table {config.rows:,} x {args.dim} ({config.rows * args.dim * 4 / 2**30:.2f} GiB), "
      f"storage {table.storage}; eval loss {start_loss:.4f}")
began = time.perf_counter()
for s in range(args.steps):
    batch = data.batch(s, args.batch)
    loss = trainer.step(batch)["loss"]
    if s % 50 == 0 or s == args.steps - 1:
        print(f"step {s:4d}  loss {float(loss):.4f}  resident {status_kib('VmRSS') / 2**20:.2f} GiB")
took = time.perf_counter() - began
summary = {
    "table_gib": config.rows * args.dim * 4 / 2**30, "storage": table.storage,
    "rlimit_as_gib": args.rlimit_as_gib, "peak_address_space_gib": status_kib("VmPeak") / 2**20,
    "peak_resident_gib": status_kib("VmHWM") / 2**20, "eval_loss_start": start_loss,
    "eval_loss_end": eval_loss(), "steps_per_s": args.steps / took,
}
print(json.dumps(summary))
if args.json:
    with open(args.json, "w") as f:
        json.dump(summary, f)
