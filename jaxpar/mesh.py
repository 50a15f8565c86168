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


def hybrid_devices(sizes: Mapping[str, int], hosts: Mapping[str, int], devices: Sequence[Any]) -> np.ndarray:
    """The devices of a two-network mesh, shaped ``sizes``: axis ``a`` spans ``hosts[a]`` hosts
    (its outer factor) and ``sizes[a] / hosts[a]`` devices inside each (its inner factor), as
    `jax.experimental.mesh_utils.create_hybrid_device_mesh` orders them. A host is a slice
    where devices carry ``slice_index`` (multi-slice TPU), else a process.

    >>> hybrid_devices({"data": 4, "model": 2}, {"data": 2}, jax.devices())   # doctest: +SKIP
    """
    from jax.experimental import mesh_utils

    for axis, n in hosts.items():
        if sizes[axis] % n:
            raise ValueError(f"make_mesh: hosts={dict(hosts)} puts axis {axis!r} of size {sizes[axis]} on {n} "
                             f"hosts, and {n} does not divide {sizes[axis]}; use a divisor of {sizes[axis]}")
    # slices where devices carry several slice indices (multi-slice TPU); else processes
    by_slice = len({getattr(d, "slice_index", None) for d in devices} - {None}) > 1
    key = "slice_index" if by_slice else "process_index"
    granules: dict[int, int] = {}
    for d in devices:
        granules[getattr(d, key)] = granules.get(getattr(d, key), 0) + 1
    dcn = [hosts.get(a, 1) for a in sizes]
    ici = [s // h for s, h in zip(sizes.values(), dcn)]
    unit = ("slice" if by_slice else "process (host)") if len(granules) == 1 else \
        ("slices" if by_slice else "processes (hosts)")
    if math.prod(dcn) != len(granules) or set(granules.values()) != {math.prod(ici)}:
        counts = sorted(set(granules.values()))
        raise ValueError(
            f"make_mesh: hosts={dict(hosts)} on mesh {dict(sizes)} asks for {math.prod(dcn)} hosts of "
            f"{math.prod(ici)} devices each, but the {len(devices)} devices are on {len(granules)} {unit} "
            f"of {counts[0] if len(counts) == 1 else counts} devices; make the hosts factors multiply to "
            f"{len(granules)} (run one process per host with jaxpar launch), or drop hosts for one network")
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=not by_slice)


def host_map(mesh: Mesh) -> dict[str, int]:
    """How many hosts (processes) each axis of ``mesh`` spans: ``{axis: count}`` for the axes
    whose device groups hold devices of several processes (the `ParallelConfig.hosts` of a
    mesh `make_mesh` built with it; ``{}`` on one process).

    >>> host_map(make_mesh(ParallelConfig(mesh={"data": 4, "model": 2}, hosts={"data": 2})))  # doctest: +SKIP
    {'data': 2}
    """
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    out = {}
    for i, axis in enumerate(mesh.axis_names):
        rows = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        n = max(len(set(row.tolist())) for row in rows)
        if n > 1:
            out[axis] = n
    return out


def make_mesh(config_or_axes: ParallelConfig | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """Build the device mesh for a config (or a plain ``{axis: size}`` mapping).

    A config with ``hosts`` (two networks) gets `hybrid_devices`' order: each axis's host
    factor outermost, the rest of it inside a host; a ``ValueError`` when the factors do not
    match the processes (or slices) the devices are on.

    >>> mesh = make_mesh({"data": 2, "model": -1})   # on 8 devices
    >>> dict(mesh.shape)
    {'data': 2, 'model': 4}
    """
    hosts: Mapping[str, int] = {}
    if isinstance(config_or_axes, ParallelConfig):
        axes, hosts = config_or_axes.mesh, config_or_axes.hosts
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
    if hosts:
        return Mesh(hybrid_devices(sizes, hosts, devices), names, axis_types=types)
    if jax.process_count() > 1 and len(devices) == jax.device_count():
        # Outer axes across processes, inner axes inside one process (fast links).
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return Mesh(np.array(ordered).reshape(shape), names, axis_types=types)
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)
