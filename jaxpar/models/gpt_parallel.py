"""What runs the example GPT in parallel, beside the model (as torchtitan's ``parallelize.py``
sits beside ``model.py``): the model file knows nothing of pipelines.

`pipeline_loss` is ``loss_fn`` in the parts a pipeline needs: the token and position
embeddings for the first stage, the stacked blocks split over the ``pipe`` axis, the final
norm, head and loss for the last stage.

    >>> import jaxpar
    >>> isinstance(pipeline_loss(), jaxpar.pipeline.PipelineLoss)
    True
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.models.gpt import GPT, check_tokens, head_loss, loss_fn
from jaxpar.nn.moe import moe_aux_loss
from jaxpar.pipeline.model import PipelineLoss

__all__ = ["pipeline_loss", "training_loss"]


class _Head(nnx.Module):
    """What the pipeline's last stage needs: the final norm, the head and how to chunk the loss."""

    def __init__(self, model: GPT):
        self.ln_f, self.head, self.chunks = model.ln_f, model.head, model.cfg.loss_chunks


def _head_loss(head: _Head, h, batch):
    return head_loss(head.ln_f, head.head, h, batch, head.chunks)


def _pipeline_embed(model: GPT, batch) -> jax.Array:
    return model.embed(batch["inputs"], batch.get("positions"))


class _Embedding(nnx.Module):
    """What the pipeline's first stage needs: the token and position tables and the config
    that says which token ids they can embed."""

    def __init__(self, model: GPT):
        self.wte, self.wpe, self.cfg = model.wte, model.wpe, model.cfg


def _pipeline_embedding(model: GPT) -> _Embedding:
    return _Embedding(model)


def _embed_inputs(part: _Embedding, batch) -> jax.Array:
    tokens, positions = batch["inputs"], batch.get("positions")
    check_tokens(part.cfg, tokens)     # as GPT.embed: refused here, not by JAX's indexing or broadcasting
    return part.wte[...][tokens] + (part.wpe[...][: tokens.shape[1]] if positions is None
                                    else part.wpe[...][positions])


def _block_call(model: GPT):
    """A block with the model's ``constrain`` (context attention) and the batch's positions."""
    constrain = model.constrain
    return lambda block, h, batch: block(h, constrain, batch.get("positions"))


def pipeline_loss() -> PipelineLoss:
    """``loss_fn`` in the three parts a pipeline needs (embedding, stacked blocks, head).

    Equal to ``loss_fn`` for a model built with ``scan_layers=True``; pass it to the
    ``Trainer`` when ``ParallelConfig.pipeline.stages > 1``. Each stage's blocks get the
    micro-batch's positions (a context-parallel reorder) and the model's ``constrain``; MoE
    blocks' auxiliary losses join the loss per micro-batch.
    """
    return PipelineLoss(
        embed=_pipeline_embed,
        blocks=lambda model: model.blocks,
        head=_Head,
        head_loss=_head_loss,
        embedding=_pipeline_embedding,
        embed_inputs=_embed_inputs,
        block_call=_block_call,
        aux_loss=moe_aux_loss,
    )


def training_loss(config):
    """The loss a ``GPT`` trains with under ``config`` (a ``ParallelConfig``): `pipeline_loss`
    with pipeline stages, else ``loss_fn`` (what ``jaxpar train`` and its reports use)."""
    return pipeline_loss() if config.pipeline.stages > 1 else loss_fn
