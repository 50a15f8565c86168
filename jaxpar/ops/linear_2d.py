"""2D (high-dimension) tensor-parallel matmul: x and w each split over two mesh axes.

With ``r`` devices on ``row_axis`` and ``c`` on ``col_axis``, device ``(i, j)`` holds

    x[M/r · i, K/c · j]    (M over row_axis, K over col_axis)
    w[K/c · j, N/r · i]    (K over col_axis, N over row_axis)

and produces ``y[M/r · i, N/c · j]`` (M over row_axis, N over col_axis) in three steps:

    1. all-gather w over row_axis      w[K/c, N/r] → w[K/c, N]
    2. local matmul                    x[M/r, K/c] @ w[K/c, N] → partial y[M/r, N]
    3. reduce-scatter over col_axis    sum over the c K-blocks, keep N/c columns

Per-device communication in elements (times the item size for bytes), with ``p = r · c``:

    2D (this):            (r - 1) · K·N / p   +   (c - 1) · M·N / p
    1D row-parallel:      2 · (p - 1) / p · M·N       (K over all p devices, all-reduce of y)
    1D column-parallel:   (p - 1) / p · M·K           (N over all p devices, all-gather of x)

For ``r = c = √p`` and square matrices (M = K = N) that is about ``2·N²/√p`` for 2D against
``2·N²`` (row) or ``N²`` (column) for 1D: the 2D scheme sends ``√p`` times less as p grows,
and no device ever holds a full copy of x, w or y.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.ops._common import AnyMesh, axes_of, check_divides, resolve_mesh
from jaxpar.strategy import mesh_sizes


def matmul_2d(
    x: jax.Array,
    w: jax.Array,
    *,
    row_axis: str,
    col_axis: str,
    mesh: AnyMesh | None = None,
    precision: Any = None,
) -> jax.Array:
    """``x[M, K] @ w[K, N]`` with 2D tensor parallelism (all-gather w, reduce-scatter y).

    Args:
      x: ``[M, K]``, split M over ``row_axis`` and K over ``col_axis``.
      w: ``[K, N]``, split K over ``col_axis`` and N over ``row_axis``.
      row_axis, col_axis: two different mesh axes.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      precision: passed to the local ``jnp.matmul``.

    Returns ``y[M, N]`` split M over ``row_axis`` and N over ``col_axis`` (so the next 2D
    matmul can take ``y`` as its x after swapping the roles of the axes, or as is with a
    weight laid out the same way). For leading batch dimensions, reshape x to 2-D first.

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
      >>> y = matmul_2d(x, w, row_axis="x", col_axis="y", mesh=mesh)
      >>> y.sharding.spec
      P('x', 'y')
    """
    mesh = resolve_mesh(mesh, "matmul_2d")
    _check(x, w, row_axis, col_axis, mesh)

    def local(xb, wb):
        w_full_n = jax.lax.all_gather(wb, row_axis, axis=1, tiled=True)
        partial = jnp.matmul(xb, w_full_n, precision=precision)
        return jax.lax.psum_scatter(partial, col_axis, scatter_dimension=1, tiled=True)

    in_specs = (PartitionSpec(row_axis, col_axis), PartitionSpec(col_axis, row_axis))
    out_specs = PartitionSpec(row_axis, col_axis)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(x, w)


def _check(x, w, row_axis, col_axis, mesh) -> None:
    xshape, wshape = jnp.shape(x), jnp.shape(w)
    if len(xshape) != 2 or len(wshape) != 2 or xshape[1] != wshape[0]:
        raise ValueError(
            f"matmul_2d: needs x[M, K] and w[K, N], got shapes {xshape} and {wshape}; reshape "
            "leading batch dimensions of x into M"
        )
    for arg, value in (("row_axis", row_axis), ("col_axis", col_axis)):
        if not isinstance(value, str):
            raise TypeError(f"matmul_2d: {arg} must be one mesh axis name, got {value!r}")
        axes_of("matmul_2d", arg, value, mesh)
    if row_axis == col_axis:
        raise ValueError(f"matmul_2d: row_axis and col_axis are both {row_axis!r}; use two axes of {mesh_sizes(mesh)}")
    fix = "pick sizes divisible by the axis sizes, or swap row_axis and col_axis"
    check_divides("matmul_2d", "x", xshape, 0, mesh, (row_axis,), fix)
    check_divides("matmul_2d", "x", xshape, 1, mesh, (col_axis,), fix)
    check_divides("matmul_2d", "w", wshape, 1, mesh, (row_axis,), fix)
    check_divides("matmul_2d", "w (N is reduce-scattered over col_axis)", wshape, 1, mesh, (col_axis,), fix)
