"""Test and benchmark worker: one replica group (one process, 2 simulated devices) of a job of
``--groups`` groups averaging through ``python -m jaxpar.ps.replica_server``.

``replica_worker.py --group G --groups N --address HOST:PORT --out DIR --steps S``: group G
trains the GPT of `model_config` under `parallel_config`, step s on its own rows
(`group_batch`), until step S, or until the step written in ``DIR/stop`` once that file exists.
After each step it appends ``{step, digest, groups, time, wait_s}`` to ``DIR/group-G.jsonl``
(``digest``: SHA-256 of every parameter's bytes) and, at its start, ``{start, healed, step}``;
at the end it writes ``DIR/params-G.npz`` (and with ``--save-at K``, ``DIR/params-G-at-K.npz``
after step K). ``--pace`` seconds of sleep per step stand in for a
longer step. The job token comes from ``JAXPAR_REPLICAS_TOKEN``.
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

    return jaxpar.ParallelConfig(mesh={"data": 2}, optimizer={"level": 1, "threshold_kb": 0})


def group_batch(step: int, group: int, groups: int):
    """Group ``group``'s rows of step ``step`` (1-based): rows ``group * ROWS`` onwards of the
    global batch of step ``step``, which has ``groups * ROWS`` rows."""
    from jaxpar.models.data import ArithmeticData

    full = ArithmeticData(16).batch(groups * ROWS, step)
    return {k: v[group * ROWS:(group + 1) * ROWS] for k, v in full.items()}


def digest(trainer) -> str:
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(trainer.state.params):
        h.update(np.asarray(x).tobytes())
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
    args = parser.parse_args()
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
    log = open(os.path.join(args.out, f"group-{args.group}.jsonl"), "a")
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
            metrics = trainer.step(group_batch(step, args.group, args.groups))
            float(metrics["loss"])
            log.write(json.dumps({"step": step, "digest": digest(trainer), "groups": group.groups,
                                  "time": time.time(), "wait_s": round(group.wait_s, 4)}) + "\n")
            log.flush()
            if step == args.save_at:
                np.savez(os.path.join(args.out, f"params-{args.group}-at-{step}.npz"),
                         *[np.asarray(x) for x in jax.tree.leaves(trainer.state.params)])
            if args.pace:
                time.sleep(args.pace)
        np.savez(os.path.join(args.out, f"params-{args.group}.npz"),
                 *[np.asarray(x) for x in jax.tree.leaves(trainer.state.params)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
