"""Worker: saves step after step of a large state until it is killed.

The weight of step ``k`` is ``BASE + k`` (``BASE`` from numpy seed 0), so a restored step can be
checked exactly. Prints ``SAVED k`` after each committed step.

    python kill_worker.py DIR ROWS COLS
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar.checkpoint as ckpt  # noqa: E402

CONFIG = {"mesh": {"model": 8}, "rules": {"mlp": "model"}}


def base(rows, cols):
    return np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)


def main(directory, rows, cols):
    rows, cols = int(rows), int(cols)
    trainer = common.big_trainer(rows, cols, CONFIG)
    b = base(rows, cols)
    with ckpt.Checkpointer(directory, keep=None, asynchronous=False) as saver:
        step = (saver.latest_step() or 0) + 1
        while True:
            trainer.step_count = step
            common.fill(trainer, b, step)
            saver.save(trainer.plan, trainer.state, trainer.mesh)
            print(f"SAVED {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
