"""`MetricsLogger`: turns what ``Trainer.fit`` reads at a logging step into logged scalars.

Every value it logs is either already on the host (times, shapes, the step number), read
once (memory and FLOPs of the compiled step), or read together with the loss at a logging
step (the learning rate of an ``inject_hyperparams`` state). Nothing here runs on the steps
in between, so the host keeps dispatching steps ahead of the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.metrics.config import MetricsConfig
from jaxpar.metrics.writers import JsonlWriter, TensorBoardWriter
from jaxpar.report.flops import flops
from jaxpar.report.memory import memory

# The routing a model with MoE layers adds to each step's metrics (`jaxpar.nn.moe_metrics`),
# logged like the loss: the mean over the steps since the previous log.
ROUTING = ("moe_load_balance", "moe_z_loss", "moe_dropped")


def read(tree: Any) -> Any:
    """``jax.device_get(tree)``, marked as a read the caller means: it is allowed even inside
    ``jax.transfer_guard_device_to_host("disallow_explicit")``, which then catches any other read.

    Example:
      >>> float(read(jax.numpy.float32(2.5)))
      2.5
    """
    with jax.transfer_guard_device_to_host("allow"):
        return jax.device_get(tree)


def tokens_per_example(batch: Any) -> int:
    """Tokens in one example of ``batch``: the second dimension of its first integer array with
    two or more dimensions (token ids shaped ``(batch, seq)``), else 1. Reads shapes only.

    Example:
      >>> tokens_per_example({"inputs": np.zeros((8, 32), np.int32)})
      32
    """
    for leaf in jax.tree.leaves(batch):
        if np.ndim(leaf) >= 2 and np.issubdtype(leaf.dtype, np.integer):
            return int(np.shape(leaf)[1])
    return 1


def examples_per_step(batch: Any) -> int:
    """The global batch size: the leading dimension of the batch's first array."""
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 1


def progress_text(loss: float, tokens_per_s: float | None, mfu: float | None = None) -> str:
    """What the progress bar shows beside the bar (the ETA is its own column); ``mfu`` from
    model FLOPs, when a peak is known.

    Example:
      >>> progress_text(2.3456, 12345.6)
      'loss 2.3456 | 12,346 tok/s'
      >>> progress_text(2.3456, 12345.6, 0.4123)
      'loss 2.3456 | 12,346 tok/s | MFU 41.2%'
    """
    speed = f" | {tokens_per_s:,.0f} tok/s" if tokens_per_s else ""
    util = f" | MFU {mfu:.1%}" if mfu is not None else ""
    return f"loss {loss:.4f}{speed}{util}"


class MetricsLogger:
    """The writers of one run (process 0 writes; every process computes the same values).

    Example:
      >>> logger = MetricsLogger(MetricsConfig(dir=tmp))                       # doctest: +SKIP
      >>> logger.start(compiled, batch, num_devices=8)                         # doctest: +SKIP
      >>> logger.log(10, [{"loss": 2.5, "grad_norm": 1.0}], window_s=0.5)      # doctest: +SKIP
    """

    def __init__(self, config: MetricsConfig, *, process_index: int | None = None):
        self.config = config
        self._writing = (jax.process_index() if process_index is None else process_index) == 0
        self.writers: list[Any] | None = None       # opened at the first start() or write()
        self.tokens_per_step: int | None = None
        self.flops_per_step: float | None = None     # model FLOPs (or XLA's, see mfu_source), all devices
        self.xla_flops_per_step: float | None = None # what XLA counts for the compiled step, all devices
        self.mfu_source: str | None = None           # "given", "model" or "xla"
        self._num_devices = 1
        self._once: dict[str, float] = {}            # logged with the first record only
        self._key: Any = None                        # what the last start() read was of

    def start(self, compiled: jax.stages.Compiled, batch: Any, *, num_devices: int, resumed: bool = False,
              model_flops_per_token: Callable[[int], float] | None = None, key: Any = None) -> None:
        """Read the compiled step's memory and FLOPs, and the tokens of a batch: once per run, and
        again only for another compiled step (``key`` names the one read: `started`), whose values
        the next record carries. Opens the writers: ``metrics.jsonl`` anew, or appended to when
        the run was ``resumed``.

        MFU is computed from model FLOPs: ``MetricsConfig.flops_per_token`` when given, else
        ``model_flops_per_token(seq_len)`` (the model's own closed form, e.g.
        ``Llama.flops_per_token``), else — labelled ``mfu_source: "xla"`` — the FLOPs XLA counts
        for the compiled step. XLA's count misses library calls (cuBLAS, cuDNN) and counts a
        ``scan`` body once, so beside model FLOPs it is logged only as ``hfu`` (hardware FLOPs
        utilisation)."""
        self._open(append=resumed)
        self._key = key
        per_example = self.config.tokens_per_example or tokens_per_example(batch)
        self.tokens_per_step = examples_per_step(batch) * per_example
        self._num_devices = num_devices
        try:
            self.xla_flops_per_step = flops(compiled) * num_devices
        except ValueError:          # a backend without a cost analysis: no HFU, not a failure
            self.xla_flops_per_step = None
        per_token, self.mfu_source = self.config.flops_per_token, "given"
        if per_token is None and model_flops_per_token is not None:
            per_token, self.mfu_source = float(model_flops_per_token(per_example)), "model"
        if per_token is not None:
            self.flops_per_step = per_token * self.tokens_per_step
        else:
            self.flops_per_step, self.mfu_source = self.xla_flops_per_step, "xla"
        self._once = {"mfu_source": self.mfu_source, "flops_per_step": self.flops_per_step}
        try:
            m = memory(compiled)
        except ValueError:
            return
        self._once |= {"memory_argument_bytes": m.argument_bytes, "memory_output_bytes": m.output_bytes,
                       "memory_temp_bytes": m.temp_bytes, "memory_total_bytes": m.total}

    def started(self, key: Any) -> bool:
        """Whether the last `start` read the compiled step ``key`` (its values stand)."""
        return key is not None and key is self._key

    def scalars(self, step: int, records: Sequence[Mapping[str, float]], window_s: float,
                opt_state: Any = None, checkpoint_s: float = 0.0) -> dict[str, float | None]:
        """The logged values for ``step``: loss and grad norm averaged over ``records`` (the steps
        since the last log, which took ``window_s`` seconds together), lr, speed, MFU, memory;
        an MoE model's routing (``ROUTING``): its losses averaged like the loss, its dropped
        assignments (``moe_dropped``, an int) summed over the steps; ``checkpoint_s``, the seconds
        checkpoint saves held the host in that window (not part of ``window_s``), when there were any."""
        n = len(records)
        out: dict[str, float | None] = {
            "loss": float(np.mean([r["loss"] for r in records])),
            "grad_norm": float(np.mean([r["grad_norm"] for r in records])),
            "lr": self.learning_rate(step, opt_state),
            "step_time_s": window_s / n,
        }
        for key in ROUTING:
            if key in records[-1]:
                values = [r[key] for r in records]
                out[key] = sum(int(v) for v in values) if key == "moe_dropped" else float(np.mean(values))
        out["tokens_per_s"] = self.tokens_per_step * n / window_s if self.tokens_per_step and window_s > 0 else None
        out["mfu"] = self.mfu(window_s / n)
        if self.mfu_source != "xla":
            out["hfu"] = self.mfu(window_s / n, self.xla_flops_per_step)
        if checkpoint_s > 0:
            out["checkpoint_s"] = checkpoint_s
        out.update(self._once)
        self._once = {}
        stats = jax.local_devices()[0].memory_stats() or {}     # None on CPU
        if "peak_bytes_in_use" in stats:
            out["memory_peak_bytes_in_use"] = float(stats["peak_bytes_in_use"])
        return out

    def log(self, step: int, records: Sequence[Mapping[str, float]], window_s: float,
            opt_state: Any = None, checkpoint_s: float = 0.0) -> dict[str, float | None]:
        """Write the scalars of ``step`` to every writer; returns them."""
        values = self.scalars(step, records, window_s, opt_state, checkpoint_s)
        self.write(step, values)
        return values

    def log_eval(self, step: int, loss: float) -> None:
        """Write an evaluation: ``eval_loss`` and ``eval_perplexity`` (``exp(loss)``: a perplexity
        when the loss is a mean cross-entropy in nats)."""
        self.write(step, {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))})

    def write(self, step: int, values: Mapping[str, float | None]) -> None:
        self._open(append=True)
        for w in self.writers:
            w.write(step, values)

    def _open(self, *, append: bool) -> None:
        if self.writers is not None:
            return
        self.writers = []
        if self._writing:
            self.writers.append(JsonlWriter(self.config.jsonl_path, append=append))
            if self.config.tensorboard:
                self.writers.append(TensorBoardWriter(self.config.dir))

    def learning_rate(self, step: int, opt_state: Any = None) -> float | None:
        """The learning rate the update of ``step`` used: from the configured value or schedule
        (optax counts updates from 0), else from an ``inject_hyperparams`` state, else None."""
        lr = self.config.learning_rate
        if lr is not None:
            return float(read(lr(step - 1))) if callable(lr) else float(lr)
        for node in jax.tree.leaves(opt_state, is_leaf=_has_hyperparams):
            if _has_hyperparams(node) and "learning_rate" in node.hyperparams:
                return float(read(node.hyperparams["learning_rate"]))
        return None

    def mfu(self, step_time_s: float, flops_per_step: float | None = None) -> float | None:
        """Model FLOPs utilisation of a step that took ``step_time_s`` (``flops_per_step``: another
        count, e.g. XLA's for HFU); None without a peak."""
        peak = self.config.peak_flops
        flops_per_step = self.flops_per_step if flops_per_step is None else flops_per_step
        if peak is None or not flops_per_step or step_time_s <= 0:
            return None
        return flops_per_step / (step_time_s * peak * self._num_devices)

    def close(self) -> None:
        for w in self.writers or ():
            w.close()
        self.writers = None


def _has_hyperparams(node: Any) -> bool:
    return isinstance(getattr(node, "hyperparams", None), dict)
