"""Pipelining a model shaped *embedding → N repeated blocks → head*.

A ``PipelineLoss`` names the three parts; it is an ordinary ``loss_fn(model, batch)``:

    >>> loss = PipelineLoss(
    ...     embed=lambda model, batch: model.embed(batch["inputs"]),
    ...     blocks=lambda model: model.blocks,            # the marker: the stacked repeated part
    ...     head=lambda model: (model.ln_f, model.head),  # what the head needs
    ...     head_loss=lambda head, h, batch: xent(head, h, batch["targets"]),
    ... )
    >>> trainer = jaxpar.Trainer(model, tx, loss, config, mesh)   # config.pipeline.stages > 1

With ``pipeline.stages == 1`` it runs the blocks with ``lax.scan``, so the same loss trains
the model unpipelined (the one-device reference). With ``stages = p > 1`` the ``Trainer``
swaps in ``pipelined(loss, config, mesh)``: the embedding runs on every stage (outside the
pipeline, sharded by the other mesh axes), the stacked blocks (leading ``layers`` axis,
which the rules should map to the pipe axis) are cut into ``p·v`` chunks, and the schedule
runs them with the ``shard_map`` executor; the head runs on the last stage. The embedding
and the head do not share parameters with the blocks (tied embeddings are not supported).
Micro-batch ``i`` holds rows ``i, i+m, i+2m, ...`` of the global batch, so each data shard
contributes equally to every micro-batch and nothing moves across the data axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.pipeline.executor import pipeline_loss, to_stage_layout
from jaxpar.pipeline.schedules import build


@dataclasses.dataclass(frozen=True)
class PipelineLoss:
    """A loss in three parts: ``embed(model, batch) -> h``, ``blocks(model) -> stacked module``,
    ``head(model) -> head object`` and ``head_loss(head_object, h, batch) -> scalar``."""

    embed: Callable[[nnx.Module, Any], jax.Array]
    blocks: Callable[[nnx.Module], nnx.Module]
    head: Callable[[nnx.Module], Any]
    head_loss: Callable[[Any, jax.Array, Any], jax.Array]

    def __call__(self, model: nnx.Module, batch: Any) -> jax.Array:
        h = self.embed(model, batch)
        blocks_def, blocks_state = nnx.split(self.blocks(model))
        h = _run_layers(blocks_def, blocks_state, h)
        return self.head_loss(self.head(model), h, batch)


def _run_layers(blocks_def, stacked_state, h):
    def one(h, layer_state):
        return nnx.merge(blocks_def, layer_state)(h), None

    return jax.lax.scan(one, h, stacked_state)[0]


def _micro(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [m, B/m, ...] with micro-batch i = rows i, i+m, ... (no cross-shard moves)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _check(config: ParallelConfig, mesh, n_layers: int, batch_rows: int) -> None:
    pipe = config.pipeline
    if mesh.shape.get(pipe.axis) != pipe.stages:
        raise ValueError(
            f"pipeline.stages={pipe.stages} but mesh axis {pipe.axis!r} has size "
            f"{mesh.shape.get(pipe.axis)} (mesh {dict(mesh.shape)}); make them equal"
        )
    chunks = pipe.stages * pipe.virtual_stages
    if n_layers % chunks:
        raise ValueError(
            f"the stacked blocks have {n_layers} layers, not divisible by stages × virtual_stages = "
            f"{pipe.stages} × {pipe.virtual_stages}; use a layer count that is a multiple of {chunks}"
        )
    if batch_rows % pipe.microbatches:
        raise ValueError(
            f"global batch {batch_rows} is not divisible by pipeline.microbatches={pipe.microbatches}; "
            f"use a batch that is a multiple of {pipe.microbatches}"
        )


def pipelined(loss: PipelineLoss, config: ParallelConfig, mesh) -> Callable[[nnx.Module, Any], jax.Array]:
    """The pipelined ``loss_fn(model, batch)`` for ``config.pipeline`` on ``mesh``."""
    if not isinstance(loss, PipelineLoss):
        raise TypeError(
            f"pipeline.stages={config.pipeline.stages} needs the loss as a jaxpar.pipeline.PipelineLoss "
            f"(embed / blocks / head / head_loss), got {type(loss).__name__}; see docs/pipeline.md"
        )
    pipe = config.pipeline
    schedule = build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages)

    def pipelined_loss(model: nnx.Module, batch: Any) -> jax.Array:
        blocks_def, blocks_state = nnx.split(loss.blocks(model))
        layers = jax.tree.leaves(blocks_state)[0].shape[0]
        rows = jax.tree.leaves(batch)[0].shape[0]
        _check(config, mesh, layers, rows)
        head_def, head_state = nnx.split(loss.head(model))

        def stage_fn(chunk, h):
            return _run_layers(blocks_def, chunk, h)

        def head_fn(head_state, h, micro_batch):
            return loss.head_loss(nnx.merge(head_def, head_state), h, micro_batch)

        run = pipeline_loss(stage_fn, head_fn, schedule, mesh, axis=pipe.axis)
        h = loss.embed(model, batch)
        m = pipe.microbatches
        stage_params = to_stage_layout(blocks_state, pipe.stages, pipe.virtual_stages)
        return run(stage_params, head_state, _micro(h, m), jax.tree.map(lambda x: _micro(x, m), batch))

    return pipelined_loss
