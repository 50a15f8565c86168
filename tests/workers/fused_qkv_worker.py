"""A small language model with a fused QKV projection split over "model", pipelined:
``fused_qkv_worker.py SCHEDULE WHAT [RULE=VALUE ...]`` prints one JSON line: ``{"refused": message}``
when jaxpar refuses the program, or ``{"losses": [...]}``.

WHAT: ``train`` (two steps) or ``evaluate`` (one batch). The model is written as users write one:
the fused kernel is one ``nnx.Linear(D, 3 * D)`` with logical axes ("embed", "heads"), split into
q, k, v with ``jnp.split``; with "heads" over a mesh axis of 2 its q, k, v thirds (16 columns) do
not fall on the 24-column shards. Run in a child process: a program that a stage's collective
would hang aborts the process (XLA:CPU's rendezvous), and the test fails by name, not the suite.
"""
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar as jp  # noqa: E402

V, D, H, F, T = 32, 16, 2, 32, 8
part = nnx.with_partitioning


class Block(nnx.Module):
    def __init__(self, rngs):
        k = nnx.initializers.lecun_normal()
        self.qkv = nnx.Linear(D, 3 * D, kernel_init=part(k, ("embed", "heads")), use_bias=False, rngs=rngs)
        self.out = nnx.Linear(D, D, kernel_init=part(k, ("heads", "embed")), use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, F, kernel_init=part(k, ("embed", "mlp")), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(F, D, kernel_init=part(k, ("mlp", "embed")), use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        sh = lambda a: a.reshape(b, t, H, D // H)  # noqa: E731
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", sh(q), sh(k)) / np.sqrt(D // H), axis=-1)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", att, sh(v)).reshape(b, t, D))
        return x + self.down(jax.nn.gelu(self.up(x)))


class LM(nnx.Module):
    def __init__(self, layers, rngs):
        self.embed = nnx.Embed(V, D, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(rngs)

        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(D, V, kernel_init=part(nnx.initializers.lecun_normal(), ("embed", "vocab")),
                               use_bias=False, rngs=rngs)


def head_loss(head, h, batch):
    return optax.softmax_cross_entropy_with_integer_labels(head(h), batch["tokens"][:, 1:]).mean()


LOSS = jp.pipeline.PipelineLoss(embed=lambda m, b: m.embed(b["tokens"][:, :-1]), blocks=lambda m: m.blocks,
                                head=lambda m: m.head, head_loss=head_loss)


def main(schedule: str, what: str, *overrides: str):
    rules = {"layers": "pipe", "batch": "data", "vocab": None, "embed": None, "heads": "model", "mlp": "model"}
    rules |= {k: (None if v == "None" else v) for k, v in (o.split("=") for o in overrides)}
    virtual = 2 if schedule == "interleaved" else 1
    config = jp.ParallelConfig(mesh={"pipe": 2, "data": 2, "model": 2}, rules=rules,
                               pipeline={"stages": 2, "microbatches": 2, "schedule": schedule,
                                         "virtual_stages": virtual})
    mesh = jp.make_mesh(config)
    layers = 4 if schedule in ("interleaved", "zb-v", "dualpipe-v") else 2
    trainer = jp.Trainer(jp.init(lambda: LM(layers, nnx.Rngs(0)), config, mesh), optax.adamw(1e-2), LOSS,
                         config, mesh)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, size=(8, T + 1), dtype=np.int32)} for _ in range(2)]
    try:
        if what == "train":
            out = {"losses": [float(trainer.step(b)["loss"]) for b in batches]}
        else:
            out = {"losses": [trainer.evaluate(batches[:1])]}
    except ValueError as e:
        out = {"refused": str(e)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
