"""fp8 matmuls for the ``"fp8"`` precision preset: e4m3 forward, e5m2 gradients, per-tensor scales.

`einsum` is what a model's projections call (the Llama's q/k/v/o and SwiGLU matmuls). Outside
`matmuls` it is ``jnp.einsum``. Inside ``with matmuls("fp8"):`` (the training step enters it when
``Precision.matmuls == "fp8"``) it is `fp8_einsum`, with current scaling per tensor, as Transformer
Engine's and MaxText's current-scaling recipes do:

- forward: ``x`` and ``w`` are scaled so that their largest magnitude is e4m3's largest finite
  value (448), cast to ``float8_e4m3fn``, multiplied with fp32 accumulation, and the product is
  scaled back by ``s_x · s_w`` and returned in ``x``'s dtype;
- backward: the incoming gradient is scaled to e5m2's range (57344) and cast to ``float8_e5m2``;
  ``dx = g · w`` and ``dw = x · g`` reuse the forward's e4m3 operands (e5m2 × e4m3: the pairs
  fp8 GEMMs take).

XLA turns each such product into one fp8 GEMM (``__cublas$lt$matmul$f8`` on Hopper: an 8192³
product ran at 1016 TFLOP/s against 806 in bf16 on an H200, ``benchmarks/gpu_probe.py``). On a
backend without fp8 matmuls the same arithmetic runs (it is how the CPU tests check it against a
fake-quantised reference), but the ``"fp8"`` preset is refused there by the plan's checks, since
it would only lose precision. The LM head, attention scores and norms stay in the compute dtype.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp

from jaxpar.strategy import match_varying

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
KINDS = ("compute", "fp8")

_active: list[str] = []   # the kinds entered, innermost last (trace-time state, like a named scope)


@contextlib.contextmanager
def matmuls(kind: str = "fp8"):
    """Inside it, `einsum` runs the matmuls in ``kind`` (``"fp8"`` or ``"compute"``)."""
    if kind not in KINDS:
        raise ValueError(f"matmuls: kind={kind!r} is not one of {KINDS}")
    _active.append(kind)
    try:
        yield
    finally:
        _active.pop()


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)``, or `fp8_einsum` inside ``matmuls("fp8")``."""
    if _active and _active[-1] == "fp8":
        return fp8_einsum(spec, x, w)
    return jnp.einsum(spec, x, w)


def fp8_unavailable(platform: str | None = None) -> str | None:
    """Why the devices of ``platform`` (default: JAX's default backend) have no fp8 matmuls, or None."""
    device = jax.devices(platform)[0]
    if device.platform != "gpu":
        return f"the {device.platform} backend has no fp8 matmuls"
    cc = str(getattr(device, "compute_capability", "0"))
    major, _, minor = cc.partition(".")
    if (int(major or 0), int(minor or 0)) < (8, 9):
        return f"this {device.device_kind} (compute capability {cc}) has no fp8 matmuls; they need 8.9 or newer"
    return None


def quantize(x: jax.Array, dtype, largest: float) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``x / scale`` in the fp8 ``dtype``, ``scale = max|x| / largest`` (fp32)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


def _parse(spec: str) -> tuple[str, str, str]:
    m = re.fullmatch(r"\s*([a-zA-Z]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z]+)\s*", spec)
    if not m:
        raise ValueError(f"fp8_einsum: spec={spec!r} must name every axis of two operands and the output, "
                         f"like 'bse,ef->bsf' (no '...')")
    a, b, out = m.groups()
    for name, letters in (("x", a), ("w", b)):
        lone = set(letters) - set(out) - set(b if name == "x" else a)
        if lone:
            raise ValueError(f"fp8_einsum: spec={spec!r} sums axes {sorted(lone)} of {name} alone; sum them "
                             f"before the matmul")
    return a, b, out


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` with fp8 operands (see the module); the result in ``x``'s dtype.

    >>> x = jnp.linspace(-1, 1, 32).reshape(2, 16); w = jnp.eye(16)
    >>> float(jnp.abs(fp8_einsum("be,ef->bf", x, w) - x).max()) < 0.04
    True
    """
    _parse(spec)
    # inside a shard_map (hybrid's per-device loss, pipeline stages) both operands vary over the
    # manual axes either does: the custom_vjp's cotangents then have their inputs' types, and a
    # weight that did not vary gets its gradient summed over them by pcast's transpose (as an einsum's)
    return _fp8(spec, *match_varying(x, w))


def _product(spec, a, sa, b, sb, dtype):
    up = jnp.bfloat16   # fp8 operands widened in the product: XLA folds the casts into one fp8 GEMM
    out = jnp.einsum(spec, a.astype(up), b.astype(up), preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8(spec, x, w):
    return _fp8_fwd(spec, x, w)[0]


def _fp8_fwd(spec, x, w):
    qx, sx = quantize(x, E4M3, E4M3_MAX)
    qw, sw = quantize(w, E4M3, E4M3_MAX)
    # the dtypes ride along as empty arrays (residuals must be arrays)
    return _product(spec, qx, sx, qw, sw, x.dtype), (qx, sx, qw, sw, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _fp8_bwd(spec, res, g):
    qx, sx, qw, sw, x_like, w_like = res
    a, b, out = _parse(spec)
    qg, sg = quantize(g, E5M2, E5M2_MAX)
    dx = _product(f"{out},{b}->{a}", qg, sg, qw, sw, x_like.dtype)
    dw = _product(f"{a},{out}->{b}", qx, sx, qg, sg, w_like.dtype)
    return dx, dw


_fp8.defvjp(_fp8_fwd, _fp8_bwd)
