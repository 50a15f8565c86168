"""What a pipelined call runs: the stage, loss and embedding functions, the schedule and the mesh.

A ``PipelineCall`` is the part of ``pipeline_value_and_grad`` / ``pipeline_forward`` that stays
the same from step to step; the arrays (parameters, inputs, targets) stay arguments:

    >>> import jax, jaxpar
    >>> from jaxpar.pipeline import build
    >>> mesh = jaxpar.make_mesh({"pipe": 4}, devices=jax.devices()[:4])
    >>> call = PipelineCall(stage_fn=lambda w, x: x * w, loss_fn=lambda head, y, t: (y - t).mean(),
    ...                     schedule=build("1f1b", 4, 8), mesh=mesh)
    >>> call.axis, call.schedule.stages
    ('pipe', 4)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax.sharding import Mesh

from jaxpar.pipeline.schedules import Schedule

__all__ = ["PipelineCall"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineCall:
    """The functions and the schedule one pipelined loss runs (see ``pipeline_value_and_grad``)."""

    stage_fn: Callable[..., Any]
    """``stage_fn(chunk_params, x[, const][, micro_batch]) -> y``, one model chunk: ``y`` has the
    shape and dtype of ``x``; with ``stage_aux`` it returns ``(y, aux_loss, stats)``. Runs inside
    ``shard_map`` manual over ``axis`` only."""
    loss_fn: Callable[..., Any]
    """``loss_fn(head_params, y, target) -> scalar`` on the last chunk's output."""
    schedule: Schedule
    """The table the stages run; its ``stages`` is the size of mesh axis ``axis``."""
    mesh: Mesh
    """The mesh; axes other than ``axis`` stay automatic (data / tensor sharding carries through)."""
    axis: str = "pipe"
    """The pipe mesh axis."""
    specs: tuple[Any, ...] | None = None
    """``(stage_specs, head_specs, activation_spec[, embed_specs])``: ``PartitionSpec`` trees over
    the *other* mesh axes for one chunk of the stage parameters (without its two leading axes),
    for the head's, for one micro-batch's activations (and the embedding's). Each op's operands
    and results are pinned to them, so no layout chosen outside (e.g. a ZeRO shard of the update)
    propagates into the per-stage branches, where a resharding collective would run on the
    devices of some stages only (a deadlock)."""
    embed_fn: Callable[..., Any] | None = None
    """``embed_fn(embed_params, micro_batch_inputs) -> x``, run by the first virtual stage only:
    the inputs are then a pytree of ``[m, ...]`` raw inputs (token ids), and only one
    micro-batch's activation crosses a stage boundary per step."""
    stage_batch: bool = False
    """``stage_fn`` also takes the micro-batch's targets as its last argument (what a stage needs
    beside the activation: positions, segment ids)."""
    stage_aux: bool = False
    """``stage_fn`` returns ``(y, aux_loss, stats)``: the scalar ``aux_loss`` (e.g. the MoE layers'
    load-balancing loss) is added to the loss, averaged over the micro-batches like it, and
    differentiated; ``stats`` (a pytree of arrays, e.g. routing metrics) is averaged over the
    micro-batches per chunk (integers: summed) and returned in stage layout."""

    def __post_init__(self):
        for name in ("stage_fn", "loss_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"PipelineCall({name}=...) must be callable, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.embed_fn is not None and not callable(self.embed_fn):
            raise TypeError(f"PipelineCall(embed_fn=...) must be callable or None, got {type(self.embed_fn).__name__}")
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"PipelineCall(schedule=...) must be a jaxpar.pipeline.Schedule, got "
                            f"{type(self.schedule).__name__}; e.g. jaxpar.pipeline.build('1f1b', stages, micro_batches)")
        if self.axis not in self.mesh.shape:
            raise ValueError(f"pipeline axis {self.axis!r} is not in the mesh axes {list(self.mesh.shape)}; "
                             f"add it to the mesh or pass axis=<one of them>")
        if self.mesh.shape[self.axis] != self.schedule.stages:
            raise ValueError(f"schedule has stages={self.schedule.stages} but mesh axis {self.axis!r} has size "
                             f"{self.mesh.shape[self.axis]}; build the schedule with {self.mesh.shape[self.axis]} "
                             f"stages")
