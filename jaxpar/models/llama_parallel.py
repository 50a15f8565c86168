"""What runs the Llama in parallel, beside the model (as torchtitan's ``parallelize.py`` sits
beside ``model.py``): the model file knows nothing of pipelines.

`pipeline_loss` is ``loss_fn`` in the parts a pipeline needs: the token embedding for the
first stage, the stacked blocks split over the ``pipe`` axis, the final norm, head and loss
for the last stage.

    >>> import jaxpar
    >>> isinstance(pipeline_loss(), jaxpar.pipeline.PipelineLoss)
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.llama import Llama, head_loss, loss_fn, token_positions
from jaxpar.nn.moe import moe_aux_loss
from jaxpar.pipeline.model import PipelineLoss

__all__ = ["pipeline_loss", "training_loss"]


def _pipeline_embed(model: Llama, batch) -> jax.Array:
    return model.embed(batch["inputs"])


def _block_call(model: Llama):
    """A block with the model's ``constrain`` (context attention), the micro-batch's positions
    and its segment ids (packed sequences: attention stays inside a segment, positions restart)."""
    constrain = model.constrain

    def call(block, h, batch):
        segment_ids = batch.get("segment_ids")
        return block(h, token_positions(h, segment_ids, batch.get("positions")), segment_ids, constrain)

    return call


class _Table(nnx.Module):
    """The token table and what reading it needs, for the pipeline's first and last stages."""

    def __init__(self, model: Llama, norm=None):
        self.table = model.embedding if norm is None or model.head is None else model.head
        self.norm, self.tied, self.dtype = norm, norm is not None and model.head is None, model.cfg.dtype
        self.chunks = model.cfg.loss_chunks


def _pipeline_embedding(model: Llama) -> _Table:
    return _Table(model)


def _embed_inputs(part: _Table, batch) -> jax.Array:
    x = part.table[...][batch["inputs"]]
    return x if part.dtype is None else x.astype(jnp.dtype(part.dtype))


def _head_loss(head: _Table, h, batch):
    return head_loss(head.norm, head.table, h, batch, tied=head.tied, chunks=head.chunks)


def pipeline_loss() -> PipelineLoss:
    """``loss_fn`` in the three parts a pipeline needs (embedding, stacked blocks, head).

    Equal to ``loss_fn`` for a model built with ``scan_layers=True``; pass it to the
    ``Trainer`` when ``ParallelConfig.pipeline.stages > 1``. With tied embeddings the table
    is read by the first stage and by the last, and its gradient is the sum of both uses.
    Each stage's blocks get the micro-batch's positions (a context-parallel reorder), its
    segment ids (packed batches) and the model's ``constrain``; MoE blocks' auxiliary losses
    join the loss per micro-batch. The loss is the mean over micro-batches of each one's
    mean over its kept (non-padding) tokens, as with ``grad_accum=m``: equal to ``loss_fn``
    when every micro-batch keeps as many tokens (no padding).
    """
    return PipelineLoss(embed=_pipeline_embed, blocks=lambda model: model.blocks,
                        head=lambda model: _Table(model, model.norm), head_loss=_head_loss,
                        embedding=_pipeline_embedding, embed_inputs=_embed_inputs, block_call=_block_call,
                        aux_loss=moe_aux_loss)


def training_loss(config):
    """The loss a ``Llama`` trains with under ``config`` (a ``ParallelConfig``): `pipeline_loss`
    with pipeline stages, else ``loss_fn`` (what ``jaxpar train`` and its reports use)."""
    return pipeline_loss() if config.pipeline.stages > 1 else loss_fn
