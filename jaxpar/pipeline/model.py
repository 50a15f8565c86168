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
pipeline, sharded by the other mesh axes), or, with ``pipeline.embedding="first"`` and the
loss's ``embedding`` / ``embed_inputs`` parts, inside the first virtual stage's ops only
(token ids enter the pipeline; the embedding's gradient comes out of it); the stacked blocks (leading ``layers`` axis,
which the rules should map to the pipe axis) are cut into ``p·v`` chunks placed as the
schedule says (a loop, or a V for ``"zb-v"`` / ``"dualpipe-v"``), and the schedule runs them
with the ``shard_map`` executor; the head runs on the stage of the last chunk. Called
without differentiating (``Trainer.evaluate``) it runs the schedule's forwards only. The embedding
and the head may share a table (tied embeddings: its gradient is the sum of both uses), not
parameters with the blocks.
With ``block_call`` each block also gets its micro-batch (positions of a context-parallel
reorder) and ``aux_loss`` adds what the blocks record (MoE auxiliary losses) to the loss per
micro-batch; see docs/pipeline.md.
Micro-batch ``i`` holds rows ``i, i+m, i+2m, ...`` of the global batch, so each data shard
contributes equally to every micro-batch and nothing moves across the data axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import ParallelConfig
from jaxpar.data.layout import BatchLayout
from jaxpar.pipeline.executor import from_stage_layout, pipeline_loss, to_stage_layout
from jaxpar.pipeline.rows import check_microbatch_rows, row_axes
from jaxpar.pipeline.schedules import build
from jaxpar.strategy import spec_entry


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineLoss:
    """A loss in three parts: ``embed(model, batch) -> h``, ``blocks(model) -> stacked module``,
    ``head(model) -> head object`` and ``head_loss(head_object, h, batch) -> scalar``.

    ``embedding(model) -> embedding object`` and ``embed_inputs(embedding_object, batch) -> h``
    (both or neither) give the embedding as a part of its own, so that the pipeline can run it
    on its first virtual stage only (``pipeline.embedding="first"``). ``embed``
    must equal ``embed_inputs(embedding(model), batch)``; it is what the job search prices and
    what ``pipeline.embedding="outside"`` runs. The head object and the embedding object may
    share a parameter (tied embeddings): its gradient is the sum over both uses.

    ``block_call(model) -> call`` says how one block runs: ``call(block, h, batch) -> h`` with
    the (micro-)batch at hand, for what a block needs beside ``h`` (token positions after a
    context-parallel reorder, the model's ``constrain`` with its context attention); default
    ``block(h)``. ``aux_loss(blocks) -> scalar`` reads what the blocks recorded during their
    forward that joins the loss (``jaxpar.nn.moe_aux_loss``); pipelined, it is added per
    micro-batch, as gradient accumulation would. What else the blocks record besides
    parameters and RNG streams (``jaxpar.nn.MoEMetric``) comes out of the pipeline averaged
    over the micro-batches (integers summed), one value per layer.
    """

    embed: Callable[[nnx.Module, Any], jax.Array]
    blocks: Callable[[nnx.Module], nnx.Module]
    head: Callable[[nnx.Module], Any]
    head_loss: Callable[[Any, jax.Array, Any], jax.Array]
    embedding: Callable[[nnx.Module], Any] | None = None
    embed_inputs: Callable[[Any, Any], jax.Array] | None = None
    block_call: Callable[[nnx.Module], Callable[[nnx.Module, jax.Array, Any], jax.Array]] | None = None
    aux_loss: Callable[[nnx.Module], jax.Array] | None = None

    def __post_init__(self):
        for name in ("head", "head_loss", "embedding", "embed_inputs", "block_call", "aux_loss"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"PipelineLoss({name}=...) must be callable, got {type(value).__name__}: {value!r}")
        if (self.embedding is None) != (self.embed_inputs is None):
            raise TypeError(
                f"PipelineLoss needs embedding and embed_inputs together (got embedding={self.embedding!r}, "
                f"embed_inputs={self.embed_inputs!r}); give both to run the embedding on the first stage, "
                f"or neither")

    def __call__(self, model: nnx.Module, batch: Any) -> jax.Array:
        h = self.embed(model, batch)
        blocks = self.blocks(model)
        graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
        call = None if self.block_call is None else self.block_call(model)
        h, rest = _run_layers(graphdef, params, rest, h, call, batch)
        nnx.update(blocks, rest)   # the blocks' RNG counts and statistics advance, as unrolled
        value = self.head_loss(self.head(model), h, batch)
        return value if self.aux_loss is None else value + self.aux_loss(blocks)


def _run_layers(graphdef, params, rest, h, call=None, batch=None, unrolled: bool = False):
    """The stacked layers one after another; returns ``(h, new rest)``.

    With ``call``, each block runs as ``call(block, h, batch)``. ``lax.scan`` runs them, or,
    ``unrolled``, a Python loop (a pipeline chunk's few layers): differentiating a scan hoists
    what depends on its constants alone out of the loop, and that cuts an operator's inner
    shard_map in two (context attention's masks come from the positions, a constant), with
    residuals XLA's verifier rejects inside the pipeline's shard_map.
    """
    def one(h, layer):
        block = nnx.merge(graphdef, *layer)
        h = block(h) if call is None else call(block, h, batch)
        return h, nnx.state(block, nnx.Not(nnx.Param))

    if not unrolled:
        return jax.lax.scan(one, h, (params, rest))
    states = []
    for i in range(jax.tree.leaves(params)[0].shape[0]):
        h, state = one(h, jax.tree.map(lambda a: a[i], (params, rest)))
        states.append(state)
    return h, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


# what the blocks record during a forward besides parameters and RNG streams (MoE routing metrics)
_RECORDED = nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))


def check_layers(config: ParallelConfig, n_layers: int, virtual_stages: int, who: str = "pipeline") -> None:
    """The stacked blocks' ``n_layers`` split evenly into stages × chunks per stage: what
    `jaxpar.plan.check_combination` refuses up front for a `PipelineLoss` and model."""
    pipe = config.pipeline
    chunks = pipe.stages * virtual_stages
    if n_layers % chunks:
        raise ValueError(
            f"{who}: the stacked blocks have {n_layers} layers, not divisible by stages × chunks per stage = "
            f"{pipe.stages} × {virtual_stages} (schedule {pipe.schedule!r}); use a layer count that is a "
            f"multiple of {chunks}"
        )


def stacked_layers(loss: "PipelineLoss", model: nnx.Module) -> int:
    """The layer count of ``loss.blocks(model)`` (a concrete or an abstract model)."""
    return jax.tree.leaves(nnx.state(loss.blocks(model), nnx.Param))[0].shape[0]


def _check(config: ParallelConfig, layout: BatchLayout, n_layers: int, batch_rows: int,
           row_split: tuple[str, ...], virtual_stages: int) -> None:
    # the pipe axis against pipeline.stages: `jaxpar.plan.check_combination` (and the executor)
    check_layers(config, n_layers, virtual_stages)
    check_microbatch_rows(layout, batch_rows, row_split)


def pipelined(loss: PipelineLoss, config: ParallelConfig, mesh, *, specs: nnx.Module | None = None,
              schedule=None, layout: BatchLayout | None = None) -> Callable[[nnx.Module, Any], jax.Array]:
    """The pipelined ``loss_fn(model, batch)`` for ``config.pipeline`` on ``mesh``.

    ``specs``: the model with a ``PartitionSpec`` in place of every value (the plan's compute
    specs, merged with the model's graph). The executor pins each op's operands to them,
    and keeps the head whole over the tensor axes inside the stage branches: XLA cannot
    partition a vocabulary-split loss inside a branch that only the last stage runs.

    The blocks' non-parameter state (dropout RNG streams) enters every chunk as a constant:
    the micro-batches of one step share its keys, and the streams advance once per step, as
    in the unpipelined model (the stages return the advanced counts). What the blocks record
    (MoE metrics) comes back from the stages too.

    ``schedule``: the built schedule (a `jaxpar.TrainPlan` carries it: ``plan.schedule``);
    default: built here from ``config.pipeline``. ``layout``: the batch layout (``plan.batch_layout``:
    the micro-batches, the axes their rows split over); default: read here from ``config``.
    """
    from jaxpar.pipeline.stages import StagedLoss, staged   # stages.py builds on this module

    if isinstance(loss, StagedLoss):
        return staged(loss, config, mesh, specs=specs, layout=layout)
    if not isinstance(loss, PipelineLoss):
        raise TypeError(
            f"pipeline.stages={config.pipeline.stages} needs the loss as a jaxpar.pipeline.PipelineLoss "
            f"(embed / blocks / head / head_loss) or a jaxpar.pipeline.StagedLoss (modules by path), got "
            f"{type(loss).__name__}; see docs/pipeline.md"
        )
    pipe = config.pipeline
    layout = BatchLayout.of(config, mesh) if layout is None else layout
    if schedule is None:
        schedule = build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages)
    embed_first = pipe.embedding == "first"
    if embed_first and loss.embedding is None:
        raise TypeError(
            "pipeline.embedding='first' runs the embedding on the first pipeline stage, which needs the "
            "PipelineLoss's embedding= and embed_inputs= parts; give them, or set pipeline.embedding='outside' "
            "(the embedding then runs before the pipeline, on every stage)")

    def pipelined_loss(model: nnx.Module, batch: Any) -> jax.Array:
        blocks = loss.blocks(model)
        blocks_def, params, rest = nnx.split(blocks, nnx.Param, ...)
        layers = jax.tree.leaves(params)[0].shape[0]
        rows, row_split = jax.tree.leaves(batch)[0].shape[0], row_axes(layout, batch)
        _check(config, layout, layers, rows, row_split, schedule.virtual_stages)
        pins = None if specs is None else _pins(loss, specs, config, layout, row_split)
        head_def, head_state = nnx.split(loss.head(model))
        call = None if loss.block_call is None else loss.block_call(model)
        if call is not None and not callable(call):
            raise TypeError(f"PipelineLoss(block_call=...) is a factory, model -> call(block, h, batch); called with "
                            f"the model it returned {type(call).__name__}, not a function (e.g. block_call=lambda "
                            "model: lambda block, h, batch: block(h, positions=batch['positions']))")
        # a chunk's few layers run unrolled where operators nest their own shard_map in the stage
        # (context attention; the expert dispatch, whose layers record metrics: see _run_layers),
        # scanned otherwise
        unrolled = config.context is not None or bool(jax.tree.leaves(nnx.state(blocks, _RECORDED)))

        def stage_fn(chunk, h, const, micro_batch):
            h, new = _run_layers(blocks_def, chunk, const, h, call, micro_batch, unrolled=unrolled)
            ran = nnx.merge(blocks_def, chunk, new)
            aux = jnp.zeros((), jnp.float32) if loss.aux_loss is None else loss.aux_loss(ran)
            return h, aux, (nnx.state(ran, _RECORDED), nnx.state(ran, nnx.RngCount))

        def head_fn(head_state, h, micro_batch):
            return loss.head_loss(nnx.merge(head_def, head_state), h, micro_batch)

        m = pipe.microbatches
        on_stages = lambda tree: to_stage_layout(tree, pipe.stages, schedule.virtual_stages,  # noqa: E731
                                                 schedule.placement)
        micro = layout.micro(batch)
        kw = dict(axis=pipe.axis, specs=pins, with_consts=True, stage_batch=True, stage_aux=True)
        if embed_first:
            embed_def, embed_state = nnx.split(loss.embedding(model))
            embed_fn = lambda state, mb: loss.embed_inputs(nnx.merge(embed_def, state), mb)  # noqa: E731
            run = pipeline_loss(stage_fn, head_fn, schedule, mesh, embed_fn=embed_fn, **kw)
            value, stats = run(on_stages(params), head_state, micro, micro, on_stages(rest), embed_state)
        else:
            run = pipeline_loss(stage_fn, head_fn, schedule, mesh, **kw)
            h = loss.embed(model, batch)
            value, stats = run(on_stages(params), head_state, layout.micro(h), micro, on_stages(rest))
        _record(blocks, from_stage_layout(stats, pipe.stages, schedule.virtual_stages, schedule.placement), m)
        return value

    return pipelined_loss


def _record(blocks: nnx.Module, stats: tuple[nnx.State, nnx.State], m: int) -> None:
    """The blocks' state after the step, from what the stages returned (summed over the ``m``
    micro-batches for integers, averaged for floats): recorded floats stay the mean, recorded
    counts the sum; the RNG counts, which every micro-batch advanced alike from the same
    state, advance once, as unpipelined."""
    recorded, counts = stats
    like = nnx.state(blocks, _RECORDED)
    nnx.update(blocks, jax.tree.map(lambda new, old: new.astype(jnp.asarray(old).dtype), recorded, like))
    nnx.update(blocks, jax.tree.map(lambda total: total // m, counts))


def _pins(loss: PipelineLoss, specs: nnx.Module, config: ParallelConfig, layout: BatchLayout,
          axes: tuple[str, ...]):
    """``(chunk specs, head specs, activation spec)`` for the executor, from the spec model; the
    activations' rows split over ``axes`` as the batch's are (`row_axes`)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    block_specs = nnx.split(loss.blocks(specs), nnx.Param, ...)[1]
    chunk = jax.tree.map(lambda s: P(*tuple(s)[1:]), block_specs, is_leaf=is_spec)
    head = jax.tree.map(lambda s: P(), nnx.split(loss.head(specs))[1], is_leaf=is_spec)
    seq = tuple(a for a in layout.context if a not in axes)
    # with a context axis the activations between stages keep their sequence split
    act = P(spec_entry(axes), *((spec_entry(seq),) if seq else ()))
    if loss.embedding is None or config.pipeline.embedding != "first":
        return chunk, head, act
    # whole over the tensor axes, as the head: only the first stage's branch looks rows up
    embed = jax.tree.map(lambda s: P(), nnx.split(loss.embedding(specs))[1], is_leaf=is_spec)
    return chunk, head, act, embed
