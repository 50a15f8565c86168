"""Operator-level parallel operators with MindSpore-style strategies.

Each is a plain function, usable eagerly and inside ``jax.jit``, that takes its mesh as
``mesh=`` (or the one set with ``jax.set_mesh``) and says which collectives it implies:

* `matmul` / `dense`: ``x @ w`` with ``in_strategy=(x, w)`` / ``out_strategy=(y,)``; K split
  → all-reduce, or reduce-scatter when the output is split over K's axes.
* `matmul_2d`: 2D tensor parallel (all-gather of w, reduce-scatter of y).
* `embedding`: vocab-parallel lookup (psum), with MindSpore's ``manual_split``
  (`pad_for_manual_split` / `unpad`).
* `attention`: heads (and batch) split, no communication.
* `conv2d`: image split over H/W, halo exchange with collective-permutes.
* `context_attention`: the sequence split over a context axis (all-gather, ring, Ulysses,
  ring × Ulysses); `ContextParallel` hands it to a model; `context_order` balances causal
  work (zigzag / striped).
* `moe_dispatch`: tokens to their experts over an expert axis (two all-to-alls), dropless; an
  `ExpertDispatch` says over which axes, with what capacity and which kernel.
* `grouped_matmul`: ``jax.lax.ragged_dot`` semantics for the experts' matmuls, with JAX's
  Mosaic GPU kernels on Hopper GPUs (a plain function, per device).
* `chunked_cross_entropy`: LM head + cross-entropy in token chunks, never holding the full
  ``[tokens, vocab]`` logits (a plain function: no mesh, it keeps whatever split it is given).
* `swiglu`: the models' MLP activation, recomputed in the backward from its inputs instead of
  keeping its intermediates (a plain function).

See docs/operators.md.
"""

from jaxpar.ops import context_order
from jaxpar.ops.activations import swiglu
from jaxpar.ops.context import AttentionMask, context_attention
from jaxpar.ops.context_model import ContextParallel
from jaxpar.ops.context_order import describe_balance
from jaxpar.ops.conv import conv2d
from jaxpar.ops.cross_entropy import chunked_cross_entropy
from jaxpar.ops.grouped_matmul import grouped_matmul
from jaxpar.ops.head_parallel import attention
from jaxpar.ops.linear import dense, matmul
from jaxpar.ops.linear_2d import matmul_2d
from jaxpar.ops.moe_dispatch import ExpertDispatch, moe_dispatch, ragged_all_to_all_supported
from jaxpar.ops.vocab_parallel import embedding, pad_for_manual_split, unpad

__all__ = [
    "AttentionMask",
    "ContextParallel",
    "ExpertDispatch",
    "attention",
    "chunked_cross_entropy",
    "context_attention",
    "context_order",
    "conv2d",
    "describe_balance",
    "dense",
    "embedding",
    "grouped_matmul",
    "matmul",
    "matmul_2d",
    "moe_dispatch",
    "pad_for_manual_split",
    "ragged_all_to_all_supported",
    "swiglu",
    "unpad",
]
