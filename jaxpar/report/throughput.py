"""Tokens per second per device and MFU from a measured step time and a model FLOPs count."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from jaxpar.report.flops import check_number, mfu
from jaxpar.report.peaks import dtype_name, check_peak, no_peak_reason
from jaxpar.report.peaks import peak_flops as table_peak


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What one measured step achieves.

    Attributes:
      step_time_s: measured seconds per optimizer step.
      tokens_per_step: tokens of the global batch (batch × sequence length × accumulation).
      num_devices: devices the step ran on.
      flops_per_token: model FLOPs per token (forward + backward).
      device_kind: the device the peak is for.
      dtype: the compute dtype the peak is for.
      peak_flops: peak FLOP/s of one device, ``None`` when unknown.
      mfu: model FLOPs utilisation, ``None`` when there is no peak (see ``mfu_text``).
      peak_source: ``"table"`` or ``"given"``.
    """

    step_time_s: float
    tokens_per_step: int
    num_devices: int
    flops_per_token: float
    device_kind: str
    dtype: str
    peak_flops: float | None
    mfu: float | None
    peak_source: str

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.num_devices

    @property
    def mfu_text(self) -> str:
        """``"41.2 %"``, or why there is none, e.g. ``"n/a (no peak for CPU)"``."""
        if self.mfu is None:
            return no_peak_reason(self.device_kind, self.dtype)
        return f"{100 * self.mfu:.1f} %"

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"tokens_per_s_per_device": self.tokens_per_s_per_device,
                                           "mfu_text": self.mfu_text}


def throughput(*, flops_per_token: float, tokens_per_step: int, step_time_s: float, num_devices: int,
               device_kind: str | None = None, dtype="bfloat16", peak_flops: float | None = None) -> Throughput:
    """Tokens/s/device and MFU of a step that took ``step_time_s`` seconds.

    ``mfu = flops_per_token × tokens_per_step / (step_time_s × num_devices × peak_flops)``,
    with the peak from `jaxpar.report.peaks` for ``device_kind`` and ``dtype`` unless
    ``peak_flops`` is given. On a device without a peak (a CPU) ``mfu`` is ``None``.

    >>> t = throughput(flops_per_token=6e9, tokens_per_step=8192, step_time_s=0.5, num_devices=8,
    ...                device_kind="cpu", dtype="float32")
    >>> t.tokens_per_s_per_device, t.mfu_text
    (2048.0, 'n/a (no peak for CPU)')
    >>> throughput(flops_per_token=6e9, tokens_per_step=8192, step_time_s=0.5, num_devices=8,
    ...            peak_flops=1e14).mfu
    0.12288
    """
    check_number("flops_per_token", flops_per_token)
    check_number("step_time_s", step_time_s)
    for name, value in (("tokens_per_step", tokens_per_step), ("num_devices", num_devices)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"throughput(): {name}={value!r} must be a positive int")
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    source = "given" if peak_flops is not None else "table"
    peak = check_peak(peak_flops) if peak_flops is not None else table_peak(device_kind, dtype)
    value = None if peak is None else mfu(flops_per_token * tokens_per_step, step_time_s, peak, int(num_devices))
    return Throughput(step_time_s=float(step_time_s), tokens_per_step=int(tokens_per_step),
                      num_devices=int(num_devices), flops_per_token=float(flops_per_token), device_kind=device_kind,
                      dtype=dtype_name(dtype), peak_flops=peak, mfu=value, peak_source=source)
