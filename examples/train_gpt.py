"""Train the example GPT with jaxpar on 8 simulated CPU devices, nanoGPT style.

    python examples/train_gpt.py                  # data x model=4 (Megatron rules) on all devices
    python examples/train_gpt.py --mesh data=8    # pure data parallel
    jaxpar launch --worker-num 2 --local-worker-num 2 --simulated-devices 4 examples/train_gpt.py

The model (jaxpar/models/gpt.py) knows nothing about devices: its parameters name their
dimensions ("embed", "mlp", "heads", "vocab"), and the rules below say where each name goes.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts; ignored on GPU/TPU

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
import jaxpar.distributed  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn  # noqa: E402


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def axis_sizes(text: str) -> dict[str, int]:
    try:
        return {name: int(size) for name, size in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=SIZE,...; e.g. data=2,model=4") from None


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", type=axis_sizes, default=None,
                    help="mesh axes, e.g. data=2,model=4 (-1: the rest); default data x model, model the largest "
                         "of 4, 2, 1 dividing the device count (data=2,model=4 on 8 devices, data=1 on 1 GPU)")
parser.add_argument("--steps", type=positive, default=300)
parser.add_argument("--batch", type=positive, default=32, help="global batch (sequences per step)")
args = parser.parse_args()
# Under `jaxpar launch`, join the other processes before JAX starts (one process: nothing to do).
jaxpar.distributed.initialize()

# -- parallelism: a mesh and one rules table (logical axis -> mesh axis) ---------------------
mesh_axes = args.mesh
if mesh_axes is None:
    model_size = next(m for m in (4, 2, 1) if jax.device_count() % m == 0)
    mesh_axes = {"data": jax.device_count() // model_size, "model": model_size}
rules = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
rules = {name: axis for name, axis in rules.items() if axis in mesh_axes}
try:
    config = jaxpar.ParallelConfig(mesh=mesh_axes, rules=rules)
    mesh = jaxpar.make_mesh(config)
    rows = jaxpar.distributed.process_rows(args.batch)  # this process's rows of each global batch
except ValueError as err:  # e.g. a mesh that does not match the device count
    parser.error(str(err))
print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {jax.devices()[0].platform} devices, rules {rules}")

# -- model, built directly sharded, and optimizer --------------------------------------------
gpt = GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=8, mlp=256, layers=2)
constrain = jaxpar.nn.model_constraint(mesh, config)  # activations follow the same rules
model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
warmup = min(20, args.steps // 5)  # short runs warm up for a fifth of their steps
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=warmup,
                                              decay_steps=max(args.steps, warmup + 1))
trainer = jaxpar.Trainer(model, optax.adamw(schedule), loss_fn, config, mesh)

# -- training loop: each process feeds its own rows of the global batch -----------------------
# One process holds all rows; under `jaxpar launch` process i holds the i-th contiguous block,
# and jaxpar assembles the global batch from the blocks (feeding every process the whole batch
# would train on copies of the same rows).
data = ArithmeticData(seq_len=gpt.seq_len, seed=0)


def mine(batch):
    return {name: value[rows] for name, value in batch.items()}


for step in range(args.steps):
    metrics = trainer.step(mine(data.batch(args.batch, step)))
    if step % 50 == 0 or step == args.steps - 1:
        print(f"step {step:4d}  loss {float(metrics['loss']):.4f}  grad norm {float(metrics['grad_norm']):.3f}")

held_out = (mine(b) for b in data.batches(args.batch, start=10**6))  # steps never used for training
print(f"eval loss {trainer.evaluate(held_out, steps=4):.4f}")

# trainer.model is the trained model, still sharded (the model passed in was donated to the step)
up = trainer.model.blocks[0].mlp.up.get_value()
print(f"blocks/0/mlp/up {up.shape} is split {up.sharding.spec}: {up.addressable_shards[0].data.shape} per device")
