"""2-D convolution with the image split over H and/or W (spatial partitioning, halo exchange).

For images too large for one device, x ``[N, H, W, C]`` is split over H (``n_h`` devices)
and/or W (``n_w`` devices). An output row near a shard's edge needs input rows of the
neighbouring shard, so before convolving each shard receives from its neighbours a *halo*:
the ``lo`` last rows of the shard above and the ``hi`` first rows of the shard below (``lo``,
``hi`` = the padding, ``(k - 1) // 2`` and ``k - 1 - lo`` for "SAME" with stride 1), sent
with ``jax.lax.ppermute`` (collective-permute). The first and last shard receive zeros,
which is exactly the zero padding. Then a local VALID convolution gives this shard's rows
of the output. H is exchanged first and W second on the H-extended block, so the corners
come along.

Per device and split dimension that is two collective-permutes, receiving
``(lo + hi) · (rows of the other spatial dimension, halo included) · N_local · C`` elements:
for a 3x3 kernel over H, ``2 · W · N · C`` — independent of the image height, against
``H · W · N · C`` for gathering the image. The kernel ``w`` is replicated (no traffic).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.ops._common import (
    AnyMesh,
    axes_of,
    axes_size,
    check_divides,
    padded,
    resolve_mesh,
    to_spec,
)
from jaxpar.strategy import mesh_sizes, to_partition_spec

_DIMS = ("NHWC", "HWIO", "NHWC")


def conv2d(
    x: jax.Array,
    w: jax.Array,
    *,
    spatial_axes: tuple[Any, Any] | None = None,
    strategy: Any = None,
    mesh: AnyMesh | None = None,
    padding: str | tuple[tuple[int, int], tuple[int, int]] = "SAME",
    stride: int | tuple[int, int] = 1,
    rules: Mapping[str, Any] | None = None,
    precision: Any = None,
) -> jax.Array:
    """``jax.lax.conv_general_dilated`` (NHWC x, HWIO w) with x split over H and/or W.

    Args:
      x: the image batch ``[N, H, W, C]``.
      w: the kernel ``[kh, kw, C, C_out]`` (replicated).
      spatial_axes: ``(h_axis, w_axis)``: the mesh axis (or tuple of axes, or None) that
        splits H and the one that splits W.
      strategy: instead of ``spatial_axes``, x's NHWC strategy in any form, e.g. the
        MindSpore tuple ``(1, 2, 2, 1)`` or ``PartitionSpec("data", "x", "y", None)``; N may
        be split too, C may not.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      padding: "SAME", "VALID" or ``((lo_h, hi_h), (lo_w, hi_w))``. A split dimension needs
        an output that splits evenly: ``k - s <= lo + hi <= k - 1`` ("SAME" always is, "VALID"
        only for ``k <= s``), and ``lo, hi`` no larger than a shard.
      stride: an int or ``(s_h, s_w)``; a split dimension's rows per shard must be divisible
        by its stride.
      rules: logical axis name → mesh axes, for a logical-name ``strategy``.
      precision: passed to the local convolution.

    Returns ``[N, H_out, W_out, C_out]``, split like x.

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> x, w = jnp.ones((1, 16, 16, 3)), jnp.ones((3, 3, 3, 8))
      >>> y = conv2d(x, w, spatial_axes=("x", "y"), mesh=mesh)
      >>> y.shape, y.sharding.spec
      ((1, 16, 16, 8), P(None, 'x', 'y', None))
    """
    mesh = resolve_mesh(mesh, "conv2d")
    _check_shapes(x, w)
    x_axes = _x_axes(x, spatial_axes, strategy, mesh, rules)
    strides = _pair("stride", stride)
    pads = _pads(padding, jnp.shape(x)[1:3], jnp.shape(w)[:2], strides)
    for d in (0, 1):
        if x_axes[1 + d]:
            _check_split_dim(d, jnp.shape(x), jnp.shape(w), x_axes[1 + d], strides[d], pads[d], mesh)
    return _run(x, w, x_axes, strides, pads, mesh, precision)


def _run(x, w, x_axes, strides, pads, mesh, precision):
    def local(xb, wb):
        local_pads = []
        for d, (lo, hi) in enumerate(pads):
            axes = x_axes[1 + d]
            if axes:
                xb = _halo(xb, axes, axes_size(mesh, axes), 1 + d, lo, hi)
            local_pads.append((0, 0) if axes else (lo, hi))
        return jax.lax.conv_general_dilated(
            xb, wb, strides, local_pads, dimension_numbers=_DIMS, precision=precision
        )

    spec = to_spec(x_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec)(x, w)


def _halo(xb, axes, n, dim, lo, hi):
    """``xb`` with ``lo`` rows of the previous shard before it and ``hi`` of the next after."""
    name = axes if len(axes) > 1 else axes[0]
    size = xb.shape[dim]
    parts = []
    if lo:
        tail = jax.lax.slice_in_dim(xb, size - lo, size, axis=dim)
        parts.append(jax.lax.ppermute(tail, name, [(i, i + 1) for i in range(n - 1)]))
    parts.append(xb)
    if hi:
        head = jax.lax.slice_in_dim(xb, 0, hi, axis=dim)
        parts.append(jax.lax.ppermute(head, name, [(i + 1, i) for i in range(n - 1)]))
    return jnp.concatenate(parts, axis=dim)


def _x_axes(x, spatial_axes, strategy, mesh, rules):
    shape = jnp.shape(x)
    if spatial_axes is not None and strategy is not None:
        raise TypeError("conv2d: give spatial_axes=(h_axis, w_axis) or strategy=(n, h, w, c), not both")
    if strategy is not None:
        try:
            spec = to_partition_spec(strategy, mesh_sizes(mesh), shape, rules=rules)
        except ValueError as err:
            raise ValueError(f"conv2d: strategy for x (NHWC): {err}") from err
        axes = padded(spec, 4)
        if axes[3]:
            raise ValueError(
                f"conv2d: strategy {strategy!r} splits the channels (dimension 3) over {axes[3]}; "
                "conv2d splits N, H and W only: use a strategy ending in 1 / None"
            )
    elif spatial_axes is not None:
        if not isinstance(spatial_axes, (tuple, list)) or len(spatial_axes) != 2:
            raise TypeError(f"conv2d: spatial_axes must be (h_axis, w_axis), got {spatial_axes!r}")
        h = axes_of("conv2d", "spatial_axes[0]", spatial_axes[0], mesh)
        wa = axes_of("conv2d", "spatial_axes[1]", spatial_axes[1], mesh)
        if set(h) & set(wa):
            raise ValueError(f"conv2d: spatial_axes {spatial_axes!r} split H and W over the same mesh axis")
        axes = ((), h, wa, ())
    else:
        axes = ((), (), (), ())
    # An axis of size 1 splits nothing; dropping it avoids an empty halo exchange.
    return tuple(tuple(a for a in dim if mesh_sizes(mesh)[a] > 1) for dim in axes)


def _check_split_dim(d, xshape, wshape, axes, stride, pad, mesh) -> None:
    name, fix = "HW"[d], "use fewer devices on that axis or a size divisible by them"
    check_divides("conv2d", "x", xshape, 1 + d, mesh, axes, fix)
    rows, k, (lo, hi) = xshape[1 + d] // axes_size(mesh, axes), wshape[d], pad
    where = f"{name} of size {xshape[1 + d]} split over {axes} ({rows} per shard), kernel {k}, stride {stride}"
    if rows % stride:
        raise ValueError(
            f"conv2d: {where}: the {rows} rows per shard are not divisible by the stride {stride}; "
            "use a stride that divides them or fewer shards"
        )
    if not k - stride <= lo + hi <= k - 1:
        raise ValueError(
            f"conv2d: {where}: padding {pad} gives an output that does not split evenly over the "
            f"shards (needs {k - stride} <= lo + hi <= {k - 1}); use padding='SAME' or leave {name} unsplit"
        )
    if lo > rows or hi > rows:
        raise ValueError(
            f"conv2d: {where}: the halo ({lo}, {hi}) is larger than a shard; halos come only from "
            "direct neighbours, so split over fewer devices"
        )


def _pads(padding, spatial, window, strides) -> tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
            raise ValueError(f"conv2d: padding {padding!r} must be 'SAME', 'VALID' or ((lo, hi), (lo, hi))")
        return tuple(map(tuple, jax.lax.padtype_to_pads(spatial, window, strides, padding.upper())))
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        pads = ()
    if len(pads) != 2 or any(p < 0 for pair in pads for p in pair):
        raise ValueError(f"conv2d: padding {padding!r} must be 'SAME', 'VALID' or ((lo_h, hi_h), (lo_w, hi_w)) >= 0")
    return pads


def _pair(name, value) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
        raise ValueError(f"conv2d: {name} {value!r} must be a positive int or a pair of them")
    return pair


def _check_shapes(x, w) -> None:
    xs, ws = jnp.shape(x), jnp.shape(w)
    if len(xs) != 4 or len(ws) != 4 or ws[2] != xs[3]:
        raise ValueError(
            f"conv2d: needs x [N, H, W, C] and w [kh, kw, C, C_out] with the same C, got x {xs} "
            f"and w {ws}"
        )
