"""Grouped matmul of rows sorted by group: the experts' matmuls, at dense speed on Hopper GPUs.

``grouped_matmul(x [M, K], w [G, K, N], group_sizes [G])`` is ``jax.lax.ragged_dot``: rows
``[start_g, start_g + size_g)`` of ``x`` are multiplied by ``w[g]``; rows past the groups come
out zero. Two implementations, one semantics:

- ``"xla"``: ``jax.lax.ragged_dot`` and its XLA gradient. Every backend. On an H200 XLA runs it
  at 101 TFLOP/s forward (32768 x 768 x 2048, 8 groups) against 726 for one dense matmul of the
  same FLOPs, and its gradient at 61 (``benchmarks/results/gpu_probe_h200.json``).
- ``"mosaic"``: JAX's own Pallas Mosaic GPU kernels for Hopper (``jax.experimental.pallas.ops.gpu``:
  ``ragged_dot_mgpu.ragged_dot`` forward and for the rows' gradient, ``transposed_ragged_dot``
  for the weights' gradient) under one ``jax.custom_vjp``: 511, 427 and 559 TFLOP/s on the same
  shape. Hopper (compute capability 9.x), 16-bit operands, ``K`` and ``N`` multiples of 128.
  They ship with jaxlib and are maintained with it, which is why they are used instead of a
  kernel of our own.

``"auto"`` (the default everywhere) picks ``"mosaic"`` where it applies and ``"xla"`` elsewhere;
this is a choice of kernel for the same values (checked equal on the GPU by
``tests/test_grouped_matmul.py`` and ``benchmarks/gpu.py``), like cuDNN attention. Asking for
``"mosaic"`` where it cannot run is a ``ValueError`` that says why.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.strategy import match_varying

KERNELS = ("auto", "xla", "mosaic")

# Tile shapes measured on an H200 (benchmarks/gpu_probe.py): the fastest of those tried per matmul.
_FWD = dict(block_m=192, block_n=128, block_k=64, max_concurrent_steps=4)
_DX = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
_DW = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
_ALIGN = 128


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, kernel: str = "auto") -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` with the kernel ``kernel`` (see the module).

    >>> x = jnp.ones((6, 4)); w = jnp.stack([jnp.eye(4), 2 * jnp.eye(4)])
    >>> grouped_matmul(x, w, jnp.array([2, 3]), kernel="xla")[:, 0].tolist()
    [1.0, 1.0, 2.0, 2.0, 2.0, 0.0]
    """
    if kernel not in KERNELS:
        raise ValueError(f"grouped_matmul: kernel={kernel!r} is not one of {KERNELS}")
    why = mosaic_unavailable(x, w)
    if kernel == "mosaic" and why:
        raise ValueError(f"grouped_matmul: kernel='mosaic' cannot run here: {why}; use kernel='auto' or 'xla'")
    if kernel == "xla" or why:
        return jax.lax.ragged_dot(x, w, group_sizes)
    x, w = match_varying(x, w)   # in moe_dispatch's shard_map: w's gradient summed over the token axes
    return _mosaic(x, w, group_sizes)


def mosaic_unavailable(x, w, device=None) -> str | None:
    """Why the Mosaic GPU kernels cannot take ``x [M, K] @ w [G, K, N]`` here, or None if they can."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"they need a GPU, the backend is {device.platform}"
    cc = str(getattr(device, "compute_capability", ""))
    if not cc.startswith("9."):
        return f"they are written for Hopper (compute capability 9.x), this {device.device_kind} has {cc or 'none'}"
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"they take bfloat16 or float16 operands of one dtype, got {x.dtype} and {w.dtype}"
    k, n = w.shape[1], w.shape[2]
    if k % _ALIGN or n % _ALIGN:
        return f"K={k} and N={n} must be multiples of {_ALIGN}"
    if _kernels() is None:
        return "this jax has no jax.experimental.pallas.ops.gpu ragged_dot_mgpu"
    return None


@functools.cache
def _kernels():
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError:   # an older jax: "auto" uses XLA's kernel, "mosaic" says so
        return None
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _grid_block_n(n: int) -> int:
    return 2 if n % (2 * _FWD["block_n"]) == 0 else 1


def _pad_rows(a, multiple):
    extra = -a.shape[0] % multiple
    return a if not extra else jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)])


def _rows_in_groups(m, group_sizes):
    return (jnp.arange(m) < group_sizes.sum())[:, None]


# Each kernel call goes through a jitted function: a model calls one shape from every layer and
# again in the backward, and JAX lowers a jitted callee once per program (the Mosaic compile is
# part of lowering: a 12-layer MoE step otherwise compiled each kernel at every call site).
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiles"))
def _ragged_call(lhs, rhs, group_sizes, *, transpose_rhs, tiles):
    return _kernels()[0](lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **dict(tiles))


@functools.partial(jax.jit, static_argnames=("tiles",))
def _transposed_call(lhs, rhs, group_sizes, *, tiles):
    return _kernels()[1](lhs, rhs, group_sizes=group_sizes, **dict(tiles))


def _forward(x, w, group_sizes):
    m = x.shape[0]
    tiles = tuple({**_FWD, "grid_block_n": _grid_block_n(w.shape[2])}.items())
    out = _ragged_call(_pad_rows(x, _FWD["block_m"]), w, group_sizes.astype(jnp.int32), transpose_rhs=False,
                       tiles=tiles)[:m]
    return jnp.where(_rows_in_groups(m, group_sizes), out, 0)


@jax.custom_vjp
def _mosaic(x, w, group_sizes):
    return _forward(x, w, group_sizes)


def _mosaic_fwd(x, w, group_sizes):
    return _forward(x, w, group_sizes), (x, w, group_sizes)


def _mosaic_bwd(res, g):
    x, w, group_sizes = res
    m, gs = x.shape[0], group_sizes.astype(jnp.int32)
    g = jnp.where(_rows_in_groups(m, group_sizes), g.astype(x.dtype), 0)
    dx = _ragged_call(_pad_rows(g, _DX["block_m"]), w, gs, transpose_rhs=True, tiles=tuple(_DX.items()))[:m]
    dx = jnp.where(_rows_in_groups(m, group_sizes), dx, 0)
    dw = _transposed_call(_pad_rows(x, _DW["block_k"]), _pad_rows(g, _DW["block_k"]), gs, tiles=tuple(_DW.items()))
    # the kernels' outputs need not vary over the manual axes their operands vary over (inside
    # moe_dispatch's shard_map): each cotangent takes its primal's type, as custom_vjp requires
    dx, _ = match_varying(dx.astype(x.dtype), x)
    dw, _ = match_varying(dw.astype(w.dtype), w)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)
