"""Test and benchmark worker: one replica group (one process, 2 simulated devices) of a job of
``--groups`` groups averaging through ``python -m jaxpar.ps.replica_server``.

``replica_worker.py --group G --groups N --address HOST:PORT --out DIR --steps S``: group G
trains the GPT of `model_config` under `parallel_config`, step s on its own rows
(`group_batch`), until step S, or until the step written in ``DIR/stop`` once that file exists.
After each step it appends ``{step, digest, groups, time, wait_s}`` to ``DIR/group-G.jsonl``
(``digest``: SHA-256 of every parameter's bytes) and, at its start, ``{start, healed, step}``;
at the end it writes ``DIR/params-G.npz`` (and with ``--save-at K``, ``DIR/params-G-at-K.npz``
after step K). ``--pace`` seconds of sleep per step stand in for a
longer step. The job token comes from ``JAXPAR_REPLICAS_TOKEN``. With ``--launched`` the group
is a job of several processes started by ``jaxpar launch`` (one device each; each feeds its own
rows of the group's and writes ``group-G.P`` files).
"""

import argparse
import hashlib
import json
import os
import sys
import time

ROWS = 4       # each group's rows per step


def model_config():
    from jaxpar.models.gpt import GPTConfig

    return GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=2, dropout=0.0)


def parallel_config():
    import jaxpar

    return jaxpar.ParallelConfig(mesh={"data": 2}, optimizer={"level": 2, "threshold_kb": 0})


def group_batch(step: int, group: int, groups: int):
    """Group ``group``'s rows of step ``step`` (1-based): rows ``group * ROWS`` onwards of the
    global batch of step ``step``, which has ``groups * ROWS`` rows."""
    from jaxpar.models.data import ArithmeticData

    full = ArithmeticData(16).batch(groups * ROWS, step)
    return {k: v[group * ROWS:(group + 1) * ROWS] for k, v in full.items()}


def params(trainer) -> list:
    """Every parameter as a host array (replicated: this process's copy)."""
    import jax
    import numpy as np

    return [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(trainer.state.params)]


def digest(trainer) -> str:
    h = hashlib.sha256()
    for x in params(trainer):
        h.update(x.tobytes())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--save-at", type=int, default=0, help="also write params-G-at-K.npz after step K")
    parser.add_argument("--launched", action="store_true",
                        help="one process of a group started by jaxpar launch (one device each; own rows)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.launched:
        import jaxpar.distributed

        jaxpar.distributed.initialize()
    else:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.gpt import GPT, loss_fn
    from jaxpar.ps import replicas

    config = parallel_config()
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(model_config(), rngs=nnx.Rngs(0)), config, mesh)
    group = replicas.connect(args.address, args.group, timeout=120, beat_every=0.2)
    name = f"{args.group}" if jax.process_count() == 1 else f"{args.group}.{jax.process_index()}"
    log = open(os.path.join(args.out, f"group-{name}.jsonl"), "a")
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh,
                             placement=jaxpar.Placement(replicas=group))
    path = trainer.service("replicas")
    log.write(json.dumps({"start": time.time(), "healed": path.healed is not None, "step": trainer.step_count,
                          "digest": digest(trainer)}) + "\n")
    log.flush()
    stop_file = os.path.join(args.out, "stop")
    with trainer:
        while True:
            last = int(open(stop_file).read()) if os.path.exists(stop_file) else args.steps
            if trainer.step_count >= last:
                break
            step = trainer.step_count + 1
            rows = group_batch(step, args.group, args.groups)
            if jax.process_count() > 1:      # each process feeds its own rows of the group's
                n = ROWS // jax.process_count()
                rows = {k: v[jax.process_index() * n:(jax.process_index() + 1) * n] for k, v in rows.items()}
            metrics = trainer.step(rows)
            float(metrics["loss"])
            log.write(json.dumps({"step": step, "digest": digest(trainer), "groups": group.groups,
                                  "time": time.time(), "wait_s": round(group.wait_s, 4)}) + "\n")
            log.flush()
            if step == args.save_at:
                np.savez(os.path.join(args.out, f"params-{name}-at-{step}.npz"), *params(trainer))
            if args.pace:
                time.sleep(args.pace)
        np.savez(os.path.join(args.out, f"params-{name}.npz"), *params(trainer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
