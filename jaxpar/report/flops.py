"""FLOPs of a compiled program and model FLOPs utilisation (MFU)."""
from __future__ import annotations

import math
import numbers

import jax


def flops(compiled: jax.stages.Compiled) -> float:
    """FLOPs XLA counts for one call of a compiled program, on one device.

    The count comes from ``compiled.cost_analysis()`` (a dict, or a list of dicts from some
    JAX versions; their ``"flops"`` are summed). For a sharded program it is the FLOPs of
    one device's part: multiply by the number of devices for the whole step. XLA counts the
    body of a ``while`` loop (``lax.scan``) once, not once per iteration, so a scanned model
    is under-counted; prefer an analytic count (e.g. 6 × params × tokens) for MFU there.

    Raises:
      TypeError: ``compiled`` is not a ``jax.stages.Compiled``.
      ValueError: the backend reports no cost analysis or no ``"flops"`` entry.

    Example:
      >>> x = jax.ShapeDtypeStruct((64, 64), "float32")
      >>> flops(jax.jit(lambda a, b: a @ b).lower(x, x).compile())   # 2 * 64**3
      524288.0
    """
    if not isinstance(compiled, jax.stages.Compiled):
        hint = " (call .compile() on it first)" if isinstance(compiled, jax.stages.Lowered) else ""
        raise TypeError(f"flops() expects a jax.stages.Compiled, got "
                        f"{type(compiled).__name__}{hint}.")
    costs = compiled.cost_analysis()
    if isinstance(costs, dict):
        costs = [costs]
    if not costs or any(not isinstance(c, dict) or "flops" not in c for c in costs):
        raise ValueError(f"flops(): compiled.cost_analysis() gave no 'flops' entry "
                         f"(got {costs!r}); this backend does not count FLOPs, so count "
                         "them analytically.")
    return float(sum(c["flops"] for c in costs))


def mfu(flops_per_step: float, step_time_s: float, peak_flops_per_device: float,
        num_devices: int) -> float:
    """Model FLOPs utilisation: the share of the devices' peak FLOP/s a step achieves.

    ``mfu = flops_per_step / (step_time_s * peak_flops_per_device * num_devices)``

    Args:
      flops_per_step: FLOPs of one step on all devices together (for `flops`, which counts
        one device, pass ``flops(compiled) * num_devices``).
      step_time_s: measured seconds per step (wall clock, after warm-up).
      peak_flops_per_device: peak FLOP/s of one device for the dtype used
        (e.g. 989e12 for an H100 SXM in bf16 dense).
      num_devices: devices the step ran on.

    Returns:
      A fraction, normally in (0, 1]; above 1 means one of the inputs is wrong.

    Raises:
      TypeError / ValueError: an argument is not a number, not finite, or out of range.

    Example:
      >>> mfu(flops_per_step=4e15, step_time_s=1.0, peak_flops_per_device=1e15, num_devices=8)
      0.5
    """
    check_number("flops_per_step", flops_per_step, allow_zero=True)
    check_number("step_time_s", step_time_s)
    check_number("peak_flops_per_device", peak_flops_per_device)
    if isinstance(num_devices, bool) or not isinstance(num_devices, numbers.Integral):
        raise TypeError(f"mfu(): num_devices must be an int, got "
                        f"{type(num_devices).__name__} {num_devices!r}.")
    if num_devices < 1:
        raise ValueError(f"mfu(): num_devices must be >= 1, got {num_devices}; pass the "
                         "number of devices the step ran on (e.g. jax.device_count()).")
    return float(flops_per_step) / (float(step_time_s) * float(peak_flops_per_device)
                                    * int(num_devices))


def check_number(name: str, value, *, allow_zero: bool = False) -> None:
    """``TypeError`` / ``ValueError`` naming ``name`` unless ``value`` is a finite number > 0
    (>= 0 with ``allow_zero``); the check the throughput and MFU functions share."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"mfu(): {name} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"mfu(): {name} must be finite and {bound}, got {value!r}.")
