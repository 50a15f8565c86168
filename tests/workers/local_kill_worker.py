"""Test worker: trains with the local checkpoint tier saving every step, and is SIGKILLed by the
test at random moments, often in the middle of a write.

``local_kill_worker.py DIR``: one process, 8 simulated CPU devices, a model whose state is
about 13 MB (so a write takes long enough to be cut). Prints ``RESUMED <step>`` once the Trainer
is built (0: nothing to resume; any warning of the tier is printed before it), then after each
step ``STARTED <step>`` (its local save started: the step is on the host) and, once a save has
been waited for, ``WRITTEN <step>`` (that step is on disk).
"""

import os
import sys
import warnings


def main():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar

    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1024, 1024)))

        def __call__(self, x):
            return x @ self.w

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).mean()

    directory = sys.argv[1]
    config = jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"})
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: Wide(nnx.Rngs(0)), config, mesh)
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(
        dir=os.path.join(directory, "ckpt"), save_every=10_000, local_dir=os.path.join(directory, "local"),
        local_every=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = jaxpar.Trainer(model, optax.adam(1e-3), loss_fn, config, mesh, services=services)
    for w in caught:
        print(f"WARNING {w.message}", flush=True)
    print(f"RESUMED {trainer.step_count}", flush=True)
    local = trainer.service("checkpoint").local
    batch = {"x": np.ones((8, 1024), np.float32)}
    while True:
        trainer.step(batch)
        if local.written is not None:
            print(f"WRITTEN {local.written}", flush=True)
        print(f"STARTED {trainer.step_count}", flush=True)


if __name__ == "__main__":
    main()
