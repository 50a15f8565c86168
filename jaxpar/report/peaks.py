"""Peak dense FLOP/s per device kind and compute dtype, for model FLOPs utilisation (MFU).

The numbers are the vendors' datasheet figures for *dense* matrix math (NVIDIA's headline
numbers are "with sparsity": twice these). The device is found by its
``jax.devices()[0].device_kind`` string; a kind with no entry (a CPU, an unknown GPU) has no
peak, and MFU is reported as ``"n/a"`` rather than a made-up figure. ``peak_flops=`` overrides
the table everywhere.

    >>> peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") / 1e12
    989.0
    >>> peak_flops("cpu", "float32") is None
    True
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# (lower-case substrings that must all occur in device_kind, name shown, {dtype: FLOP/s}).
# Checked in order, so a specific entry (H100 PCIe, v5 lite) comes before a general one.
# float32 on NVIDIA GPUs is the TF32 tensor-core rate: XLA runs float32 matmuls in TF32 at
# JAX's default matmul precision. TPUs publish no float32 matmul peak, so they have none.
_TABLE: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): H100 PCIe BF16/FP16 756 TFLOPS,
    # TF32 378 TFLOPS, FP8 1,513 TFLOPS (dense = half the "with sparsity" column).
    (("h100", "pcie"), "NVIDIA H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12,
                                             "float8": 1513e12}),
    # H100 SXM: BF16/FP16 989 TFLOPS, TF32 494 TFLOPS, FP8 1,979 TFLOPS dense.
    (("h100",), "NVIDIA H100 SXM", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12,
                                     "float8": 1979e12}),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100 SXM's tensor cores,
    # BF16/FP16 989 TFLOPS, TF32 494 TFLOPS, FP8 1,979 TFLOPS dense.
    (("h200",), "NVIDIA H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12,
                                "float8": 1979e12}),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16/FP16 312 TFLOPS,
    # TF32 156 TFLOPS dense, SXM and PCIe alike.
    (("a100",), "NVIDIA A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    # Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
    # peak BF16 per chip: v4 275 TFLOPS, v5e 197 TFLOPS, v5p 459 TFLOPS, v6e (Trillium) 918 TFLOPS.
    (("tpu", "v5", "lite"), "TPU v5e", {"bfloat16": 197e12}),
    (("tpu", "v5e"), "TPU v5e", {"bfloat16": 197e12}),
    (("tpu", "v5"), "TPU v5p", {"bfloat16": 459e12}),
    (("tpu", "v6"), "TPU v6e", {"bfloat16": 918e12}),
    (("tpu", "v4"), "TPU v4", {"bfloat16": 275e12}),
)

_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz")


def peak_table() -> list[dict[str, object]]:
    """The table as rows ``{"device", "match", "dtype", "peak_flops"}`` (for docs and JSON).

    >>> peak_table()[0]["device"]
    'NVIDIA H100 PCIe'
    """
    return [{"device": name, "match": " ".join(keys), "dtype": dtype, "peak_flops": value}
            for keys, name, peaks in _TABLE for dtype, value in peaks.items()]


def dtype_name(dtype) -> str:
    """The table's name of a dtype (every float8 type is ``"float8"``).

    >>> dtype_name("float8_e4m3fn"), dtype_name("bfloat16")
    ('float8', 'bfloat16')
    """
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"compute dtype {dtype!r} is not a dtype; pass e.g. 'bfloat16' or 'float32'") from None
    return "float8" if name in _FP8 else name


def device_name(device_kind: str) -> str | None:
    """The table's name for ``device_kind`` (``None`` when it has no entry).

    >>> device_name("TPU v5 lite")
    'TPU v5e'
    """
    kind = device_kind.lower()
    return next((name for keys, name, _ in _TABLE if all(k in kind for k in keys)), None)


def peak_flops(device_kind: str | None = None, dtype="bfloat16") -> float | None:
    """Peak dense FLOP/s of one device of ``device_kind`` computing in ``dtype``; ``None`` if unknown.

    Args:
      device_kind: ``jax.Device.device_kind`` (default: that of ``jax.devices()[0]``).
      dtype: the compute dtype of the matmuls (``"bfloat16"``, ``"float16"``, ``"float32"``,
        a float8 type).

    >>> peak_flops("NVIDIA A100-SXM4-80GB", "float32") / 1e12     # TF32
    156.0
    """
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    if not isinstance(device_kind, str):
        raise TypeError(f"device_kind must be a string such as 'NVIDIA H100 80GB HBM3', got "
                        f"{type(device_kind).__name__} {device_kind!r}")
    name = dtype_name(dtype)
    kind = device_kind.lower()
    for keys, _, peaks in _TABLE:
        if all(k in kind for k in keys):
            return peaks.get(name)
    return None


def no_peak_reason(device_kind: str, dtype) -> str:
    """Why there is no MFU: ``"n/a (no peak for CPU)"`` and the like.

    >>> no_peak_reason("cpu", "float32")
    'n/a (no peak for CPU)'
    """
    name = device_name(device_kind)
    if name is None:
        shown = "CPU" if device_kind.lower() == "cpu" else repr(device_kind)
        return f"n/a (no peak for {shown})"
    return f"n/a (no {dtype_name(dtype)} peak for {name})"


def check_peak(value, name: str = "peak_flops") -> float:
    """``value`` as a float if it is a finite positive FLOP/s figure, else a ``ValueError``/``TypeError``.

    >>> check_peak(989e12)
    989000000000000.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of FLOP/s per device, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite positive number of FLOP/s per device, "
                         f"e.g. {name}=989e12 for an H100 SXM in bfloat16")
    return float(value)
