"""Watching a run: metrics to JSON lines and TensorBoard, ``jax.profiler`` traces of a step window.

``Trainer(..., services=jaxpar.Services(metrics=MetricsConfig(dir=..., every=10, tensorboard=True),
profile=(10, 13)))`` logs loss, eval loss and perplexity, learning rate, gradient norm, tokens/s,
MFU and memory, reading the device only at logging steps. See docs/metrics.md.
"""

from jaxpar.metrics.config import MetricsConfig, check_profile_steps, profile_window_outside, require_tensorboard
from jaxpar.metrics.logger import MetricsLogger, progress_text, read, tokens_per_example
from jaxpar.metrics.profile import ProfileWindow
from jaxpar.metrics.writers import JsonlWriter, TensorBoardWriter, read_jsonl, tensorboard_tag

__all__ = [
    "MetricsConfig",
    "MetricsLogger",
    "JsonlWriter",
    "TensorBoardWriter",
    "ProfileWindow",
    "check_profile_steps",
    "profile_window_outside",
    "progress_text",
    "read",
    "read_jsonl",
    "require_tensorboard",
    "tensorboard_tag",
    "tokens_per_example",
]
