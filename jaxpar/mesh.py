"""``make_mesh``: a ``jax.sharding.Mesh`` whose axis names and sizes come from a config.

Axes are ``Auto`` on purpose (semi-auto parallel: the user pins some shardings and XLA
propagates the rest). The device order comes from JAX's own mesh utilities, which put
devices with fast links (same host, same slice) in the inner (last) axes; on several
processes the outer axes span processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import ParallelConfig, normalize_mesh
from jaxpar.strategy import mesh_sizes  # noqa: F401  (re-exported: jaxpar.mesh.mesh_sizes)


def resolve_axes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Replace a ``-1`` size by the rest of the devices and check the product.

    >>> resolve_axes({"data": 2, "model": -1}, 8)
    {'data': 2, 'model': 4}
    """
    axes = normalize_mesh(axes)
    known = math.prod(s for s in axes.values() if s != -1)
    if -1 in axes.values():
        if num_devices % known:
            raise ValueError(
                f"mesh {axes}: the fixed axes multiply to {known}, which does not divide "
                f"the {num_devices} devices; choose sizes whose product divides {num_devices}"
            )
        axes = {k: (num_devices // known if v == -1 else v) for k, v in axes.items()}
    total = math.prod(axes.values())
    if total != num_devices:
        raise ValueError(
            f"mesh {axes} has {total} devices but {num_devices} are available; make the sizes "
            f"multiply to {num_devices}, or set one axis to -1 to take the rest"
        )
    return axes


def make_mesh(config_or_axes: ParallelConfig | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """Build the device mesh for a config (or a plain ``{axis: size}`` mapping).

    >>> mesh = make_mesh({"data": 2, "model": -1})   # on 8 devices
    >>> dict(mesh.shape)
    {'data': 2, 'model': 4}
    """
    if isinstance(config_or_axes, ParallelConfig):
        axes = config_or_axes.mesh
    elif isinstance(config_or_axes, Mapping):
        axes = config_or_axes
    else:
        raise TypeError(
            f"make_mesh expects a ParallelConfig or a mapping axis -> size, got "
            f"{type(config_or_axes).__name__}"
        )
    if devices is None:
        # Join the cluster first (idempotent; a no-op for one process): the device list of a
        # multi-process job is only complete after jax.distributed has connected.
        from jaxpar.distributed import initialize

        initialize()
    chosen = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: the device list is empty")
    fixed = normalize_mesh(axes)
    fewer = math.prod(fixed.values()) if -1 not in fixed.values() else None
    try:
        sizes = resolve_axes(fixed, len(devices))
    except ValueError as e:
        if chosen or fewer is None or fewer > len(devices) or jax.process_count() > 1:
            raise
        # one process: the first devices are a mesh of that size (a one-device baseline, say)
        raise ValueError(f"{e}; or, to run on {fewer} of them, pass devices=jax.devices()[:{fewer}]") from None
    names, shape = tuple(sizes), tuple(sizes.values())
    types = (AxisType.Auto,) * len(names)
    if jax.process_count() > 1 and len(devices) == jax.device_count():
        # Outer axes across processes, inner axes inside one process (fast links).
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return Mesh(np.array(ordered).reshape(shape), names, axis_types=types)
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)
