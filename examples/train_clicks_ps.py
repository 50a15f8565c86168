"""Train the DLRM-style click model with its embedding table on parameter servers.

    jaxpar launch --servers 2 --worker-num 2 --local-worker-num 2 --simulated-devices 2 \\
        examples/train_clicks_ps.py                                  # 300k rows, 200 steps

    ulimit -s 1024; export MALLOC_ARENA_MAX=2   # JAX's threads and arenas reserve less
    jaxpar launch --servers 2 --worker-num 2 --local-worker-num 2 --simulated-devices 2 \\
        --server-checkpoint-every 1000 examples/train_clicks_ps.py \\
        --rows 10000000 --dim 32 --steps 600 --rlimit-as-gib 1.1     # a 1.19 GiB table

The launcher starts 2 servers (each owns half of the table's rows and applies Adagrad to them)
and 2 workers, one jax.distributed job: the dense towers train data parallel over every
worker's devices, and each worker pulls and pushes the rows of its half of each batch. A
worker never holds the table: ``--rlimit-as-gib`` caps its address space below the table's
size, and the summary prints its peak resident memory next to the table's.

``--mode async --staleness 4`` trains with bounded staleness and prints the staleness the
servers saw. With ``--checkpoint-dir`` the workers save an orbax checkpoint every
``--save-every`` steps (the servers snapshot their shards at the same step) and a restarted
worker group (``jaxpar launch --worker-restarts K``) resumes from the latest one.
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
parser.add_argument("--checkpoint-dir", default=None, help="workers' orbax checkpoints (resume)")
parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
parser.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
parser.add_argument("--rlimit-as-gib", type=float, default=None,
                    help="limit each worker's address space to this many GiB")
parser.add_argument("--json", default=None, help="worker 0 writes the summary to this file")
args = parser.parse_args()
if args.rlimit_as_gib:  # before JAX starts: its own reservations count too
    limit = int(args.rlimit_as_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

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


def eval_loss(trainer: ps.SparseTrainer, held_out: dict) -> float:
    """The held-out loss with the rows as the servers hold them after every update so far."""
    lk = ps.lookup(held_out, FIELDS)
    # Async: ask for the rows no older than the last step (its pull bound is step - τ).
    rows = trainer.client.pull_many(lk.unique, trainer.step_count + args.staleness)
    params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), trainer.params)
    model = nnx.merge(trainer.graphdef, params, jax.tree.map(np.asarray, trainer.rest))
    embedded = {f: rows[t][lk.index[f]] for f, t in FIELDS.items()}
    return float(loss_fn(model, embedded, held_out))


def restore_latest(trainer: ps.SparseTrainer, manager: ocp.CheckpointManager) -> None:
    """Resumes from the latest orbax checkpoint; the servers go back to the same step."""
    latest = manager.latest_step()
    if latest is None:
        return
    target = {"params": trainer.params, "opt_state": trainer.opt_state, "step": 0}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    trainer.restore(manager.restore(latest, args=ocp.args.StandardRestore(abstract)))
    print(f"resumed from the checkpoint of step {trainer.step_count}", flush=True)


def save(trainer: ps.SparseTrainer, manager: ocp.CheckpointManager) -> None:
    """The workers' orbax checkpoint of this step; the servers snapshot their shards with it."""
    manager.save(trainer.step_count, args=ocp.args.StandardSave(trainer.save()))
    manager.wait_until_finished()


def main() -> dict:
    client = ps.connect([spec], mode=args.mode, staleness=args.staleness, timeout=120)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    trainer = ps.SparseTrainer(client, DLRM(config, rngs=nnx.Rngs(0), table=False), optax.adam(0.01),
                               loss_fn, FIELDS, mesh=mesh)
    manager = ocp.CheckpointManager(args.checkpoint_dir) if args.checkpoint_dir else None
    if manager is not None:
        restore_latest(trainer, manager)
        if manager.latest_step() is None:  # a group killed before its first save restarts at 0
            save(trainer, manager)
    held_out = split_fields(data.eval_batch(args.eval_size))
    print(f"worker {rank} of {workers}: table {config.rows:,} x {args.dim} "
          f"({config.rows * args.dim * 4 / 2**30:.2f} GiB) on {len(client.addresses)} servers, "
          f"{args.mode} (staleness {args.staleness}), from step {trainer.step_count}", flush=True)
    losses = {}
    while trainer.step_count < args.steps:
        start = trainer.step_count
        stop = min(args.steps, start + args.save_every) if manager else args.steps
        for k, h in enumerate(trainer.fit(batches(start, stop))):
            losses[start + k] = h["loss"]
            if (start + k) % args.log_every == 0 or start + k == args.steps - 1:
                print(f"step {start + k:5d}  loss {h['loss']:.6f}  "
                      f"resident {status_kib('VmRSS') / 2**20:.2f} GiB", flush=True)
        if manager is not None:
            save(trainer, manager)
    stats = client.stats()
    table = stats["tables"]["clicks"]
    summary = {
        "mode": args.mode, "staleness": args.staleness, "workers": workers,
        "servers": len(client.addresses), "table_gib": config.rows * args.dim * 4 / 2**30,
        "rlimit_as_gib": args.rlimit_as_gib, "peak_resident_gib": status_kib("VmHWM") / 2**20,
        "peak_address_space_gib": status_kib("VmPeak") / 2**20, "eval_loss": eval_loss(trainer, held_out),
        "losses": losses, "staleness_histogram": table["staleness_histogram"],
        "rejected_pushes": table["rejected"], "server_restarts": stats["server_restarts"],
        "pull_wait_s": trainer.timings["pull_wait_s"], "step_s": trainer.timings["step_s"],
    }
    client.close()
    return summary


summary = main()
print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)
if args.json and rank == 0:
    with open(args.json, "w") as f:
        json.dump(summary, f)
