"""``matmul`` / ``dense`` with MindSpore-style strategies (``ops.MatMul().shard(...)``).

``y[..., N] = x[..., K] @ w[K, N]``. ``in_strategy = (x_strategy, w_strategy)`` splits the
operands, ``out_strategy = (y_strategy,)`` the result; each strategy is any form that
``jaxpar.to_partition_spec`` takes (integer tuple, ``Layout`` spec, logical names,
``PartitionSpec``). The communication follows from where K is split:

* K not split: none (each device multiplies its own rows / columns);
* K split over mesh axes ``k`` and the output not split over ``k`` (the default): every device
  holds a partial sum, so the output is **all-reduced** over ``k``;
* K split over ``k`` and ``out_strategy`` splits an output dimension over (some of) ``k``:
  the partial sums are **reduce-scattered** over those axes (half the traffic of an
  all-reduce, and a smaller output). XLA's CPU pipeline turns "all-reduce then slice" into
  an all-reduce plus a dynamic-slice, so this case runs as an explicit ``jax.shard_map`` with
  ``jax.lax.psum_scatter``; the others are plain sharding constraints that XLA propagates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.ops._common import (
    AnyMesh,
    axes_size,
    constrain,
    padded,
    resolve_mesh,
    to_spec,
)
from jaxpar.strategy import is_integer_strategy, mesh_sizes, to_partition_spec

Axes = tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per-dimension mesh axes of x, w and y (None: left to XLA) and the axes that split K."""

    x: Axes | None
    w: Axes | None
    y: Axes | None
    k: tuple[str, ...]

    def natural_y(self) -> Axes:
        """The output split the local product gives, plus the K axes ``y`` scatters over."""
        base = self.x[:-1] + (self.w[1],)
        return tuple(b + tuple(a for a in want if a in self.k) for b, want in zip(base, self.y))

    def scatters(self) -> bool:
        return self.y is not None and any(a in self.k for axes in self.y for a in axes)


def matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    in_strategy: Sequence[Any] | None = None,
    out_strategy: Sequence[Any] | None = None,
    mesh: AnyMesh | None = None,
    rules: Mapping[str, Any] | None = None,
    precision: Any = None,
) -> jax.Array:
    """``x[..., K] @ w[K, N]`` split by MindSpore-style strategies.

    Args:
      x: the activation ``[..., K]``.
      w: the weight ``[K, N]``.
      in_strategy: ``(x_strategy, w_strategy)``; either may be None (derived from the other:
        K split the same way, the rest whole). An integer ``w_strategy`` is matched to mesh
        axes *jointly* with x's, as MindSpore does: its K factor must equal x's and reuses
        x's K axes; its N factor takes mesh axes that x does not use. None: no constraint.
      out_strategy: ``(y_strategy,)``. Default: x's split on the leading dimensions, w's on
        N, replicated over the K axes (an all-reduce). Splitting an output dimension over
        K's axes makes it a reduce-scatter.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      rules: logical axis name → mesh axes, for logical-name strategies.
      precision: passed to ``jnp.matmul``.

    Returns ``y[..., N]``, sharded as ``out_strategy`` says.

    Raises ``ValueError`` when a strategy does not fit (factor not dividing a dimension, x and
    w splitting K differently, N split over an axis x already uses, an unknown mesh axis).

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
      >>> y = matmul(x, w, in_strategy=((2, 4), (4, 1)), mesh=mesh)          # all-reduce over y
      >>> y = matmul(x, w, in_strategy=((2, 4), (4, 1)), out_strategy=((8, 1),), mesh=mesh)
      >>> y.sharding.spec                                                     # reduce-scatter
      P(('x', 'y'), None)
    """
    y, _, _ = _matmul("matmul", x, w, in_strategy, out_strategy, mesh, rules, precision)
    return y


def dense(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    in_strategy: Sequence[Any] | None = None,
    out_strategy: Sequence[Any] | None = None,
    mesh: AnyMesh | None = None,
    rules: Mapping[str, Any] | None = None,
    precision: Any = None,
) -> jax.Array:
    """``x @ w + b``: ``matmul`` followed by a bias split like the output's last dimension.

    ``in_strategy`` is ``(x_strategy, w_strategy)`` or ``(x_strategy, w_strategy,
    b_strategy)``; the bias is added after the reduction, so it is counted once.

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> x, w, b = jnp.ones((16, 32)), jnp.ones((32, 8)), jnp.ones((8,))
      >>> y = dense(x, w, b, in_strategy=((2, 1), (1, 4)), mesh=mesh)   # column parallel
      >>> y.sharding.spec
      P('x', 'y')
    """
    b_strategy = None
    if in_strategy is not None:
        _check_tuple("dense", "in_strategy", in_strategy, (2, 3))
        in_strategy, b_strategy = tuple(in_strategy[:2]), (in_strategy[2:] or (None,))[0]
    y, plan, mesh = _matmul("dense", x, w, in_strategy, out_strategy, mesh, rules, precision)
    if b is None:
        return y
    if jnp.shape(b) != (w.shape[1],):
        raise ValueError(f"dense: b has shape {jnp.shape(b)}; it must be ({w.shape[1]},), w's N")
    if b_strategy is not None:
        b = constrain(b, _resolve("dense", "b", b_strategy, mesh, jnp.shape(b), rules), mesh)
    elif plan.y is not None:
        b = constrain(b, to_spec(plan.y[-1:]), mesh)
    y = y + b
    return y if plan.y is None else constrain(y, to_spec(plan.y), mesh)


def _matmul(op, x, w, in_strategy, out_strategy, mesh, rules, precision):
    _check_operands(op, x, w)
    mesh = resolve_mesh(mesh, op)
    plan = _plan(op, jnp.shape(x), jnp.shape(w), in_strategy, out_strategy, mesh, rules)
    if plan.scatters() and _fits(plan.natural_y(), jnp.shape(x)[:-1] + (w.shape[1],), mesh):
        return _scatter_matmul(x, w, plan, mesh, precision), plan, mesh
    return _constrained_matmul(x, w, plan, mesh, precision), plan, mesh


def _constrained_matmul(x, w, plan: _Plan, mesh, precision):
    if plan.x is not None:
        x = constrain(x, to_spec(plan.x), mesh)
        w = constrain(w, to_spec(plan.w), mesh)
    y = jnp.matmul(x, w, precision=precision)
    return y if plan.y is None else constrain(y, to_spec(plan.y), mesh)


def _scatter_matmul(x, w, plan: _Plan, mesh, precision):
    natural = plan.natural_y()
    scatter = [(d, tuple(a for a in axes if a in plan.k)) for d, axes in enumerate(natural)]
    scatter = [(d, axes) for d, axes in scatter if axes]
    summed = tuple(a for a in plan.k if not any(a in axes for _, axes in scatter))

    def local(xb, wb):
        y = jnp.matmul(xb, wb, precision=precision)
        for dim, axes in scatter:  # scatter first: the psum then moves less data
            y = jax.lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(y, summed) if summed else y

    in_specs = (to_spec(plan.x), to_spec(plan.w))
    y = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=to_spec(natural))(x, w)
    # An output order shard_map cannot give directly (e.g. K's axis before M's) is left to XLA.
    return y if natural == plan.y else constrain(y, to_spec(plan.y), mesh)


def _fits(axes: Axes, shape, mesh) -> bool:
    return all(n % axes_size(mesh, a) == 0 for n, a in zip(shape, axes))


# ----------------------------------------------------------------------------- planning


def _plan(op, xshape, wshape, in_strategy, out_strategy, mesh, rules) -> _Plan:
    xs, ws = _unpack(op, "in_strategy", in_strategy, 2)
    (ys,) = _unpack(op, "out_strategy", out_strategy, 1)
    x_axes, w_axes = _input_axes(op, xshape, wshape, xs, ws, mesh, rules)
    yshape = tuple(xshape[:-1]) + (wshape[1],)
    if ys is not None:
        y_axes = padded(_resolve(op, "out_strategy[0] (y)", ys, mesh, yshape, rules), len(yshape))
    else:
        y_axes = None if x_axes is None else x_axes[:-1] + (w_axes[1],)
    return _Plan(x_axes, w_axes, y_axes, () if x_axes is None else x_axes[-1])


def _unpack(op, name, value, n) -> tuple:
    if value is None:
        return (None,) * n
    _check_tuple(op, name, value, (n,))
    return tuple(value)


def _check_tuple(op, name, value, lengths) -> None:
    if not isinstance(value, (tuple, list)) or is_integer_strategy(tuple(value)):
        raise TypeError(
            f"{op}: {name}={value!r} must be a tuple with one strategy per tensor, e.g. "
            f"{name}=((2, 4), (4, 1)) for (x, w) or out_strategy=((8, 1),)"
        )
    if len(value) not in lengths:
        raise ValueError(
            f"{op}: {name} has {len(value)} strategies; it takes {' or '.join(map(str, lengths))}"
        )


def _input_axes(op, xshape, wshape, xs, ws, mesh, rules):
    if xs is None and ws is None:
        return None, None
    if xs is None:
        w_axes = padded(_resolve(op, "w", ws, mesh, wshape, rules), 2)
        x_axes = ((),) * (len(xshape) - 1) + (w_axes[0],)
        _resolve(op, "x (derived from w's K split)", to_spec(x_axes), mesh, xshape, rules)
        return x_axes, w_axes
    x_axes = padded(_resolve(op, "x", xs, mesh, xshape, rules), len(xshape))
    if ws is None:
        w_axes = (x_axes[-1], ())
        _resolve(op, "w (derived from x's K split)", to_spec(w_axes), mesh, wshape, rules)
    elif is_integer_strategy(ws):
        w_axes = _integer_w_axes(op, ws, xs, x_axes, mesh, wshape)
    else:
        w_axes = padded(_resolve(op, "w", ws, mesh, wshape, rules), 2)
    _check_consistent(op, xs, ws, x_axes, w_axes, mesh)
    return x_axes, w_axes


def _integer_w_axes(op, ws, xs, x_axes, mesh, wshape) -> Axes:
    if len(ws) != 2:
        raise ValueError(f"{op}: w strategy {ws} must have 2 factors (K, N) for w of shape {tuple(wshape)}")
    kf, nf = ws
    kx = axes_size(mesh, x_axes[-1])
    if kf != kx:
        raise ValueError(
            f"{op}: x strategy {xs!r} splits K into {kx} (mesh axes {x_axes[-1]}) but w strategy "
            f"{ws} splits it into {kf}; K must be split the same way in both (MindSpore: "
            f"x_strategy[-1] == w_strategy[0]), e.g. w strategy ({kx}, {nf})"
        )
    used = {a for axes in x_axes for a in axes}
    free = {a: s for a, s in mesh_sizes(mesh).items() if a not in used}
    n_spec = _resolve(op, f"w strategy {ws}: N factor {nf} over the mesh axes x leaves free",
                      (nf,), free, (wshape[1],), None)
    return (x_axes[-1], padded(n_spec, 1)[0])


def _check_consistent(op, xs, ws, x_axes, w_axes, mesh) -> None:
    if w_axes[0] != x_axes[-1]:
        raise ValueError(
            f"{op}: x strategy {xs!r} splits K over mesh axes {x_axes[-1]} but w strategy {ws!r} "
            f"splits it over {w_axes[0]} (mesh {mesh_sizes(mesh)}); split K over the same axes in both"
        )
    clash = set(w_axes[1]) & {a for axes in x_axes for a in axes}
    if clash:
        raise ValueError(
            f"{op}: w strategy {ws!r} splits N over mesh axes {sorted(clash)}, which x strategy "
            f"{xs!r} already uses (mesh {mesh_sizes(mesh)}); split N over other axes"
        )


def _resolve(op, name, strategy, mesh, shape, rules):
    try:
        return to_partition_spec(strategy, mesh_sizes(mesh), tuple(shape), rules=rules)
    except ValueError as err:
        raise ValueError(f"{op}: {name}: {err}") from err


def _check_operands(op, x, w) -> None:
    xshape, wshape = jnp.shape(x), jnp.shape(w)
    if len(xshape) < 1 or len(wshape) != 2:
        raise ValueError(f"{op}: needs x[..., K] and w[K, N], got shapes {xshape} and {wshape}")
    if xshape[-1] != wshape[0]:
        raise ValueError(
            f"{op}: x's last dimension ({xshape[-1]}, shape {xshape}) must equal w's first "
            f"({wshape[0]}, shape {wshape})"
        )
