"""What a model report is asked for: the step's shape, where it is planned, and what was measured.

    >>> r = ReportRequest(batch=8, seq_len=4096, mesh={"data": 8}, step_time_s=0.5, device_kind="H100")
    >>> r.batch * r.seq_len
    32768
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["ReportRequest"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportRequest:
    """The arguments of `jaxpar.models.llama_report.llama_report` beside the model and the config."""

    batch: int
    """Global batch (sequences per step)."""
    seq_len: int | None = None
    """Tokens per sequence (default the model's ``max_seq_len``)."""
    mesh: Mapping[str, int] | None = None
    """Axis sizes to plan for (default ``config.mesh``); need not match the local devices."""
    tx: Any = None
    """The optax optimizer (default ``optax.adamw``): its real state structure is counted."""
    step_time_s: float | None = None
    """A measured step time, for tokens/s/device and MFU."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, instead of the table for ``device_kind``."""
    device_kind: str | None = None
    """The device for the peak table (default ``jax.devices()[0].device_kind``)."""
    backend: str | None = None
    """``"gpu"`` / ``"tpu"`` / ``"cpu"`` for the attention choice (default JAX's)."""
    param_dtype: Any = None
    """Parameter storage dtype (default ``config.precision.params``, else the parameters' own)."""
    grad_dtype: Any = None
    """Gradient dtype (default ``config.precision.params``, else the parameters' own)."""
    opt_state_dtype: Any = None
    """Optimizer-state dtype (default ``config.precision.opt_state``, else the parameters' own)."""
    compute_dtype: Any = None
    """Activation dtype (default the model's ``dtype``, else ``config.precision.compute``, else the
    model's ``param_dtype``)."""
    compiled: Any = None
    """A compiled step's memory (`jaxpar.report.MemoryReport`), or None."""
    compiled_note: str = "not compiled"
    """Why there is no compiled step's memory."""

    def __post_init__(self):
        if not isinstance(self.batch, int) or isinstance(self.batch, bool) or self.batch < 1:
            raise ValueError(f"ReportRequest: batch={self.batch!r} must be a positive int (sequences per step)")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"ReportRequest: seq_len={self.seq_len!r} must be a positive int or None (the model's "
                             f"max_seq_len)")
