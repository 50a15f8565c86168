"""Worker: a new process restores a checkpoint and trains on; prints the losses as JSON.

    python resume_worker.py DIR STEPS CONFIG_JSON [gpt|mlp]
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import jaxpar.checkpoint as ckpt  # noqa: E402


def main(directory, steps, config, model="gpt"):
    trainer = (common.gpt_trainer if model == "gpt" else common.mlp_trainer)(json.loads(config))
    meta = ckpt.restore(trainer, directory)
    losses = common.run(trainer, int(steps))
    print("RESULT " + json.dumps({"step": meta["step"], "data_state": meta["data_state"], "losses": losses}))


if __name__ == "__main__":
    main(*sys.argv[1:])
