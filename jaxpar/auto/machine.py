"""`calibrate`: measure the cost model's machine numbers (`CostParams`) on a mesh."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxpar.auto.cost import XLA_GPU_COMBINE_BYTES, CostParams
from jaxpar.mesh import host_map


def calibrate(mesh, sizes_bytes: Sequence[int] = (1 << 12, 1 << 22), repeats: int = 5) -> CostParams:
    """Measure ``CostParams`` on ``mesh``: a matmul for FLOP/s, and per mesh axis an
    all-reduce of two sizes, fitted to ``latency + 2 (n-1)/n · bytes / bandwidth``. The
    combiner's byte threshold follows the backend (CPU: no limit; others: XLA:GPU's 30 MiB).

    Two networks: on a mesh whose devices are on several processes (hosts), the axes inside
    a host are fitted as above (their slowest is ``default_bandwidth``, the links of a host),
    and an all-reduce over one device of each host gives ``inter_host_bandwidth`` and
    ``inter_host_latency``; ``devices_per_host`` and ``hosts`` (the axes spanning hosts, with
    their one-axis figures: `CostParams.placed`) describe the mesh measured.

    Example:
      >>> machine = calibrate(jaxpar.make_mesh({"data": 2, "model": 4}))   # doctest: +SKIP
      >>> plan = search(model, loss_fn, batch, config, mesh, cost_params=machine)   # doctest: +SKIP
    """
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def best(fn, *args):
        fn(*args).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    def fit(axis_mesh, axis, size):
        points = []
        for nbytes in sizes_bytes:
            # rows split over the axis, summed: an all-reduce of one row (nbytes) over it
            x = jax.device_put(jnp.ones((size, max(1, nbytes // 4))), NamedSharding(axis_mesh, PartitionSpec(axis)))
            f = jax.jit(lambda v: jnp.sum(v, axis=0), out_shardings=NamedSharding(axis_mesh, PartitionSpec()))
            points.append((nbytes * 2 * (size - 1) / size, best(f, x)))
        (b0, t0), (b1, t1) = points[0], points[-1]
        slope = max((t1 - t0) / max(b1 - b0, 1), 1e-15)
        return 1.0 / slope, max(t0 - slope * b0, 0.0)

    n = 512
    a = jnp.ones((n, n), jnp.float32)
    flops = 2 * n ** 3 / best(jax.jit(lambda x: x @ x), a)
    bandwidth, latency = {}, {}
    hosts = host_map(mesh)
    for axis, size in dict(mesh.shape).items():
        if size >= 2 and axis not in hosts:
            bandwidth[axis], latency[axis] = fit(mesh, axis, size)
    # XLA:CPU combines gradient all-reduces without a byte limit; other backends: GPU's default
    threshold = math.inf if mesh.devices.flat[0].platform == "cpu" else XLA_GPU_COMBINE_BYTES
    machine = CostParams(flops_per_s=flops, bandwidth=bandwidth, latency_per_axis=latency,
                         latency=max(latency.values(), default=1e-5), combine_threshold_bytes=threshold)
    if not hosts:
        return machine
    firsts: dict[int, object] = {}
    for d in mesh.devices.flat:         # one device of each host: a group that only crosses hosts
        firsts.setdefault(d.process_index, d)
    inter_bw, inter_lat = fit(Mesh(np.array(list(firsts.values())), ("hosts",)), "hosts", len(firsts))
    return dataclasses.replace(machine, default_bandwidth=min(bandwidth.values(), default=machine.default_bandwidth),
                               inter_host_bandwidth=inter_bw, inter_host_latency=inter_lat,
                               devices_per_host=mesh.devices.size // len(firsts)).placed(hosts, dict(mesh.shape))

