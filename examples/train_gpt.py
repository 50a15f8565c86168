"""Train the example GPT with jaxpar on 8 simulated CPU devices, nanoGPT style.

    python examples/train_gpt.py                  # data=2 x model=4, Megatron rules
    python examples/train_gpt.py --mesh data=8    # pure data parallel

The model (jaxpar/models/gpt.py) knows nothing about devices: its parameters name their
dimensions ("embed", "mlp", "heads", "vocab"), and the rules below say where each name goes.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts; ignored on GPU/TPU

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", default="data=2,model=4", help="mesh axes, e.g. data=2,model=4")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
args = parser.parse_args()

# -- parallelism: a mesh and one rules table (logical axis -> mesh axis) ---------------------
mesh_axes = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
rules = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
rules = {name: axis for name, axis in rules.items() if axis in mesh_axes}
config = jaxpar.ParallelConfig(mesh=mesh_axes, rules=rules)
mesh = jaxpar.make_mesh(config)
print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {jax.devices()[0].platform} devices, rules {rules}")

# -- model, built directly sharded, and optimizer --------------------------------------------
gpt = GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=8, mlp=256, layers=2)
constrain = jaxpar.LogicalConstraint(mesh, rules)  # activations follow the same rules
model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=20, decay_steps=args.steps)
trainer = jaxpar.Trainer(model, optax.adamw(schedule), loss_fn, config, mesh)

# -- training loop: batches hold the *global* batch; jaxpar splits it over the devices --------
data = ArithmeticData(seq_len=gpt.seq_len, seed=0)
for step in range(args.steps):
    metrics = trainer.step(data.batch(args.batch, step))
    if step % 50 == 0 or step == args.steps - 1:
        print(f"step {step:4d}  loss {float(metrics['loss']):.4f}  grad norm {float(metrics['grad_norm']):.3f}")

held_out = data.batches(args.batch, start=10**6)  # steps never used for training
print(f"eval loss {trainer.evaluate(held_out, steps=4):.4f}")

# trainer.model is the trained model, still sharded (the model passed in was donated to the step)
up = trainer.model.blocks[0].mlp.up.get_value()
print(f"blocks/0/mlp/up {up.shape} is split {up.sharding.spec}: {up.addressable_shards[0].data.shape} per device")
