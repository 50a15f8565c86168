"""Train the DLRM-style click model with its embedding table on parameter servers.

    jaxpar launch --servers 2 --worker-num 2 --local-worker-num 2 --simulated-devices 2 \\
        examples/train_clicks_ps.py                                  # 300k rows, 200 steps

    ulimit -s 1024; export MALLOC_ARENA_MAX=2   # JAX's threads and arenas reserve less
    jaxpar launch --servers 2 --worker-num 2 --local-worker-num 2 --simulated-devices 2 \\
        --server-checkpoint-every 1000 examples/train_clicks_ps.py \\
        --rows 10000000 --dim 32 --steps 600 --rlimit-as-gib 1.1     # a 1.19 GiB table

The launcher starts 2 servers (each owns half of the table's rows and applies Adagrad to them)
and 2 workers, one jax.distributed job running one ``jaxpar.Trainer`` whose row source is the
servers' table (``jaxpar.ps.ServerRows``): the dense towers train data parallel over every
worker's devices, and each worker pulls and pushes the rows of its half of each batch. A
worker never holds the table: ``--rlimit-as-gib`` caps its address space below the table's
size, and the summary prints its peak resident memory next to the table's.

``--mode async --staleness 4`` trains with bounded staleness and prints the staleness the
servers saw. With ``--checkpoint-dir`` the Trainer saves a checkpoint every ``--save-every``
steps (the servers snapshot their shards at the same step, just before) and a restarted worker
group (``jaxpar launch --worker-restarts K``) resumes from the latest one, the servers with it.
"""

import argparse
import json
import resource

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, default=300_000, help="rows of the table, over 3 fields")
parser.add_argument("--dim", type=int, default=16, help="width of an embedding row")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=512, help="global batch (all workers)")
parser.add_argument("--mode", default="sync", choices=("sync", "async"))
parser.add_argument("--staleness", type=int, default=0, help="async's bound on staleness")
parser.add_argument("--eval-size", type=int, default=4096, help="held-out examples")
parser.add_argument("--checkpoint-dir", default=None, help="the Trainer's checkpoints (resume)")
parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
parser.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
parser.add_argument("--rlimit-as-gib", type=float, default=None,
                    help="limit each worker's address space to this many GiB")
parser.add_argument("--json", default=None, help="worker 0 writes the summary to this file")
args = parser.parse_args()
if args.rlimit_as_gib:  # before JAX starts: its own reservations count too
    limit = int(args.rlimit_as_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
import jaxpar.distributed  # noqa: E402
from jaxpar import ps  # noqa: E402
from jaxpar.data.clicks import ClickData  # noqa: E402
from jaxpar.models.dlrm import DLRM, DLRMConfig  # noqa: E402

cluster = jaxpar.distributed.initialize()
rank, workers = jax.process_index(), jax.process_count()


def status_kib(name: str) -> int:
    """A ``Vm*`` line of /proc/self/status (``VmRSS``, ``VmHWM``, ``VmPeak``) in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


field_rows = (args.rows // 2, args.rows // 4, args.rows - args.rows // 2 - args.rows // 4)
data = ClickData(field_rows=field_rows)
config = DLRMConfig(field_rows=field_rows, embed=args.dim, bottom=(64,), top=(64,))
spec = ps.TableSpec("clicks", config.rows, args.dim, ps.Adagrad(0.05), partition="hash")
FIELDS = {f"f{k}": "clicks" for k in range(len(field_rows))}  # every field reads the shared table


def split_fields(batch: dict) -> dict:
    """ClickData's ``ids [B, F]`` → one key per field holding rows of the shared table."""
    ids = config.table_ids(batch["ids"])
    return {"dense": batch["dense"], "label": batch["label"],
            **{f: ids[:, k] for k, f in enumerate(FIELDS)}}


def loss_fn(model: DLRM, embedded: dict, batch: dict) -> jax.Array:
    emb = jnp.stack([embedded[f] for f in FIELDS], axis=1)          # [B, F, E]
    b, f, e = emb.shape
    logits = model(batch["dense"], rows=emb.reshape(b * f, e), inverse=jnp.arange(b * f).reshape(b, f))
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()


def batches(start: int, stop: int):
    for s in range(start, stop):
        yield split_fields(data.batch(s, args.batch, process_index=rank, process_count=workers))


def eval_loss(trainer: jaxpar.Trainer, source: ps.ServerRows, held_out: dict) -> float:
    """The held-out loss with the rows as the servers hold them after every update so far."""
    lk = ps.lookup(held_out, FIELDS)
    # Async: ask for the rows no older than the last step (its pull bound is step - τ).
    rows = source.client.pull_many(lk.unique, source.step + args.staleness)
    model = trainer.model
    state = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), nnx.state(model))
    embedded = {f: rows[t][lk.index[f]] for f, t in FIELDS.items()}
    return float(loss_fn(nnx.merge(nnx.graphdef(model), state), embedded, held_out))


def main() -> dict:
    client = ps.connect([spec], mode=args.mode, staleness=args.staleness, timeout=120)
    parallel = jaxpar.ParallelConfig(mesh={"data": -1})
    mesh = jaxpar.make_mesh(parallel)
    source = ps.ServerRows(client, FIELDS, mesh=mesh)
    checkpoint = None if not args.checkpoint_dir else jaxpar.CheckpointConfig(
        dir=args.checkpoint_dir, save_every=args.save_every, preemption=False)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: DLRM(config, rngs=nnx.Rngs(0), table=False), parallel, mesh),
                             optax.adam(0.01), lambda model, batch, rows: loss_fn(model, source.embedded(batch, rows),
                                                                                 batch),
                             parallel, mesh, rows=source, services=jaxpar.Services(checkpoint=checkpoint))
    if trainer.step_count:     # resumed (the servers went back to the same step)
        print(f"resumed from the checkpoint of step {trainer.step_count}", flush=True)
    elif args.checkpoint_dir:  # a group killed before its first save restarts at 0
        trainer.save()
        trainer.checkpointer.wait()
    held_out = split_fields(data.eval_batch(args.eval_size))
    print(f"worker {rank} of {workers}: table {config.rows:,} x {args.dim} "
          f"({config.rows * args.dim * 4 / 2**30:.2f} GiB) on {len(client.addresses)} servers, "
          f"{args.mode} (staleness {args.staleness}), from step {trainer.step_count}", flush=True)
    losses = {}

    def logged(i: int, record: dict) -> None:
        step = record["step"] - 1     # the record counts steps done; the lines name the step run
        losses[step] = record["loss"]
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {record['loss']:.6f}  "
                  f"resident {status_kib('VmRSS') / 2**20:.2f} GiB", flush=True)

    start, began = trainer.step_count, time.perf_counter()
    if start < args.steps:
        trainer.fit(source.prefetching(batches(start, args.steps), args.steps - start), args.steps - start,
                    log_every=args.log_every, progress=False, callback=logged)
    took = time.perf_counter() - began
    stats = client.stats()
    table = stats["tables"]["clicks"]
    summary = {
        "mode": args.mode, "staleness": args.staleness, "workers": workers,
        "servers": len(client.addresses), "table_gib": config.rows * args.dim * 4 / 2**30,
        "rlimit_as_gib": args.rlimit_as_gib, "peak_resident_gib": status_kib("VmHWM") / 2**20,
        "peak_address_space_gib": status_kib("VmPeak") / 2**20, "eval_loss": eval_loss(trainer, source, held_out),
        "losses": losses, "staleness_histogram": table["staleness_histogram"],
        "rejected_pushes": table["rejected"], "server_restarts": stats["server_restarts"],
        "pull_wait_s": source.timings["pull_wait_s"], "step_s": took,
    }
    trainer.close()
    client.close()
    return summary


summary = main()
print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)
if args.json and rank == 0:
    with open(args.json, "w") as f:
        json.dump(summary, f)
