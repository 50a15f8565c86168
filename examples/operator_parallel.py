"""Operator-level parallelism with jaxpar.ops on 8 simulated CPU devices.

Runs every operator on a 2 x 4 mesh, compares it with the same computation on one device,
and lists the collectives XLA put in the compiled program. On a machine with 8 or more GPUs
(TPUs) it uses them; with fewer it says so and uses the 8 simulated CPU devices:

    python examples/operator_parallel.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import ops  # noqa: E402
from jaxpar.report import collectives  # noqa: E402


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def show(name, fn, reference, args, mesh):
    """Print the max error of ``fn`` against ``reference`` and its collectives."""
    compiled = jax.jit(fn).lower(*args).compile()
    error = float(jnp.max(jnp.abs(compiled(*args) - reference(*args))))
    found = [f"{c.kind} over {','.join(c.mesh_axes or ('?',))} ({c.bytes} B)"
             for c in collectives(compiled, mesh)]
    print(f"{name:<34} max error {error:.1e}   {'; '.join(found) or 'no collectives'}")


def mesh_devices() -> list:
    """8 devices for the 2 x 4 mesh: the accelerators if there are 8, else the simulated CPUs."""
    devices = jax.devices()
    if len(devices) < 8:
        print(f"{len(devices)} {devices[0].platform} devices are fewer than the 2 x 4 mesh's 8: "
              "running on 8 simulated CPU devices")
        devices = jax.devices("cpu")
    return devices[:8]


def main():
    devices = mesh_devices()
    with jax.default_device(devices[0]):     # the one-device references run there too
        run(jaxpar.make_mesh({"x": 2, "y": 4}, devices=devices))


def run(mesh):
    x, w = rand(16, 32, seed=1), rand(32, 8, seed=2)

    # x: M over x, K over y; w: K over y. Partial sums over y: all-reduce ...
    show("matmul, K split", lambda x, w: ops.matmul(
        x, w, in_strategy=((2, 4), (4, 1)), mesh=mesh), jnp.matmul, (x, w), mesh)
    # ... or, with the output's rows split over y too, a reduce-scatter.
    show("matmul, K split, out (8, 1)", lambda x, w: ops.matmul(
        x, w, in_strategy=((2, 4), (4, 1)), out_strategy=((8, 1),), mesh=mesh), jnp.matmul, (x, w), mesh)
    show("matmul_2d (rows x, cols y)", lambda x, w: ops.matmul_2d(
        x, w, row_axis="x", col_axis="y", mesh=mesh), jnp.matmul, (x, w), mesh)

    table, ids = rand(10, 4, seed=3), jnp.array([[0, 9, 3, 5], [4, 1, 2, 8]])
    split = (4, 2, 3, 1)  # rows per device along y; stored padded: 4 blocks of 4 rows
    padded = jaxpar.shard(ops.pad_for_manual_split(table, split), (4, 1), mesh=mesh)
    show("embedding, manual_split", lambda i, t: ops.embedding(
        i, t, vocab_axis="y", manual_split=split, mesh=mesh),
        lambda i, t: table[i], (ids, padded), mesh)

    q, k, v = rand(2, 8, 8, 4, seed=4), rand(2, 8, 8, 4, seed=5), rand(2, 8, 8, 4, seed=6)
    show("attention, heads y, batch x", lambda q, k, v: ops.attention(
        q, k, v, heads_axis="y", batch_axis="x", mesh=mesh),
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), (q, k, v), mesh)

    img, kernel = rand(2, 16, 16, 3, seed=7), rand(3, 3, 3, 8, seed=8)
    show("conv2d, H over x, W over y", lambda x, w: ops.conv2d(
        x, w, spatial_axes=("x", "y"), mesh=mesh),
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), (img, kernel), mesh)


if __name__ == "__main__":
    main()
