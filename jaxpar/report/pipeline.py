"""The pipeline schedule of a config: its timeline, bubble fraction and activations held."""

from __future__ import annotations

from jaxpar.config import ParallelConfig, PipelineConfig
from jaxpar.pipeline.schedules import Schedule, bubble_fraction, build, peak_activations, timeline


def schedule_of(config: ParallelConfig | PipelineConfig) -> Schedule:
    """The schedule table a config runs."""
    pipe = config.pipeline if isinstance(config, ParallelConfig) else config
    return build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages)


def format_schedule(config_or_schedule: ParallelConfig | PipelineConfig | Schedule) -> str:
    """Timeline (tick × stage: F / B / W / idle), bubble fraction and peak micro-batch
    activations per stage.

    >>> print(format_schedule(PipelineConfig(stages=2, microbatches=2, schedule="gpipe")))  # doctest: +SKIP
    """
    s = config_or_schedule if isinstance(config_or_schedule, Schedule) else schedule_of(config_or_schedule)
    bubble = bubble_fraction(s)
    return "\n".join([
        f"pipeline schedule {s.name}: {s.stages} stages, {s.microbatches} micro-batches, "
        f"{s.virtual_stages} virtual stage(s)",
        timeline(s),
        f"bubble fraction {bubble} = {float(bubble):.3f}; peak activations held per stage "
        f"{peak_activations(s)}",
    ])
