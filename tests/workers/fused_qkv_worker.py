"""Small language models whose attention cuts a tensor-parallel dimension off its shard boundaries,
pipelined: ``fused_qkv_worker.py SCHEDULE WHAT [RULE=VALUE ...] [--qkv=KIND] [--heads=N] [--head-dim=N]``
prints one JSON line: ``{"refused": message}`` when jaxpar refuses the program, or ``{"losses": [...]}``.

WHAT: ``train`` (two steps) or ``evaluate`` (one batch). The models are written as users write them
(`Shape`): ``--qkv=fused`` (the default) is one ``nnx.Linear(D, 3 * D)`` with logical axes ("embed",
"heads"), split into q, k, v with ``jnp.split``: with "heads" over a mesh axis of 2 its q, k, v thirds
(16 columns) do not fall on the 24-column shards. ``--qkv=separate`` has three ``nnx.Linear(D, D)``
reshaped to ``[heads, head_dim]``: with 3 heads over 2 devices a head straddles two shards.
``--qkv=headed`` keeps a ``[D, heads, head_dim]`` kernel with ("embed", "heads", "kv"): 3 heads do
not divide over 2 devices. Run in a child process: a program that a stage's collective would hang
aborts the process (XLA:CPU's rendezvous), and the test fails by name, not the suite. The models
are importable (``tests/matrix.py`` trains them as cells of the combination matrix).
"""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

V, F, T = 16, 32, 8
part = nnx.with_partitioning


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the attention is written: ``qkv`` ("fused", "separate" or "headed"), ``heads`` and
    ``head_dim`` (the width D is their product), ``layers`` stacked blocks."""
    qkv: str = "fused"
    heads: int = 2
    head_dim: int = 8
    layers: int = 2

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


class Block(nnx.Module):
    def __init__(self, shape: Shape, rngs):
        self.shape, d, k = shape, shape.width, nnx.initializers.lecun_normal()
        linear = lambda i, o, names: nnx.Linear(i, o, kernel_init=part(k, names), use_bias=False, rngs=rngs)  # noqa: E731
        if shape.qkv == "fused":
            self.qkv = linear(d, 3 * d, ("embed", "heads"))
        elif shape.qkv == "separate":
            self.q, self.k, self.v = (linear(d, d, ("embed", "heads")) for _ in range(3))
        else:
            init = part(nnx.initializers.normal(0.1), ("embed", "heads", "kv"))
            self.wq, self.wk, self.wv = (nnx.Param(init(rngs.params(), (d, shape.heads, shape.head_dim)))
                                         for _ in range(3))
        self.out = linear(d, d, ("heads", "embed"))
        self.up = linear(d, F, ("embed", "mlp"))
        self.down = linear(F, d, ("mlp", "embed"))

    def _qkv(self, x):
        b, t, _ = x.shape
        heads = lambda a: a.reshape(b, t, self.shape.heads, self.shape.head_dim)  # noqa: E731
        if self.shape.qkv == "fused":
            return tuple(map(heads, jnp.split(self.qkv(x), 3, axis=-1)))
        if self.shape.qkv == "separate":
            return heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        return tuple(jnp.einsum("btd,dhe->bthe", x, w[...]) for w in (self.wq, self.wk, self.wv))

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = self._qkv(x)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.shape.head_dim), axis=-1)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(x)))


class LM(nnx.Module):
    def __init__(self, shape: Shape, rngs):
        d = shape.width
        self.embed = nnx.Embed(V, d, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)

        @nnx.split_rngs(splits=shape.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(shape, rngs)

        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(d, V, kernel_init=part(nnx.initializers.lecun_normal(), ("embed", "vocab")),
                               use_bias=False, rngs=rngs)


def head_loss(head, h, batch):
    return optax.softmax_cross_entropy_with_integer_labels(head(h), batch["targets"]).mean()


def pipeline_loss():
    """The models' loss as a `jaxpar.pipeline.PipelineLoss` (batches ``{"inputs", "targets"}``)."""
    import jaxpar as jp

    return jp.pipeline.PipelineLoss(embed=lambda m, b: m.embed(b["inputs"]), blocks=lambda m: m.blocks,
                                    head=lambda m: m.head, head_loss=head_loss)


def main(schedule: str, what: str, *options: str):
    import jaxpar as jp

    model = {o[2:].split("=")[0].replace("-", "_"): o.split("=")[1] for o in options if o.startswith("--")}
    model = {k: (v if k == "qkv" else int(v)) for k, v in model.items()}
    rules = {"layers": "pipe", "batch": "data", "vocab": None, "embed": None, "heads": "model", "mlp": "model"}
    rules |= {"kv": None} if model.get("qkv") == "headed" else {}
    rules |= {k: (None if v == "None" else v) for k, v in (o.split("=") for o in options if not o.startswith("--"))}
    virtual = 2 if schedule == "interleaved" else 1
    config = jp.ParallelConfig(mesh={"pipe": 2, "data": 2, "model": 2}, rules=rules,
                               pipeline={"stages": 2, "microbatches": 2, "schedule": schedule,
                                         "virtual_stages": virtual})
    mesh = jp.make_mesh(config)
    shape = Shape(layers=4 if schedule in ("interleaved", "zb-v", "dualpipe-v") else 2, **model)
    rng = np.random.default_rng(0)
    batches = [{"inputs": x[:, :-1], "targets": x[:, 1:]}
               for x in (rng.integers(0, V, size=(8, T + 1), dtype=np.int32) for _ in range(2))]
    try:
        trainer = jp.Trainer(jp.init(lambda: LM(shape, nnx.Rngs(0)), config, mesh), optax.adamw(1e-2),
                             pipeline_loss(), config, mesh)
        if what == "train":
            out = {"losses": [float(trainer.step(b)["loss"]) for b in batches]}
        else:
            out = {"losses": [trainer.evaluate(batches[:1])]}
    except ValueError as e:
        out = {"refused": str(e)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    main(*sys.argv[1:])
