"""Greedy decoding for the example language models (demos and smoke checks, not serving).

The model runs on a fixed window of ``window`` tokens, so it compiles once: a causal model's
logits at position ``t`` depend only on tokens ``0..t``, so the padding after ``t`` changes
nothing. No key/value cache: each new token is one forward pass over the window, which is
what a demo of a tiny model needs and no more.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def greedy(model: nnx.Module, prompt: Sequence[int], new_tokens: int, *, window: int) -> list[int]:
    """``prompt`` followed by ``new_tokens`` tokens, each the model's most likely next one.

    ``model(tokens [1, window])`` must return logits ``[1, window, vocab]`` (the Llama and GPT
    examples do). The prompt is cut to its last tokens when the window is full.

    >>> from jaxpar.models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
    >>> out = greedy(model, [1, 2, 3], 4, window=16)
    >>> len(out), out[:3]
    (7, [1, 2, 3])
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("greedy: prompt is empty; give at least one token id")
    if window < 2 or new_tokens < 0:
        raise ValueError(f"greedy: window={window}, new_tokens={new_tokens}; use window >= 2 and new_tokens >= 0")
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, tokens, last):
        logits = nnx.merge(graphdef, state)(tokens)
        return jnp.argmax(logits[0, last])

    out = list(prompt)
    for _ in range(new_tokens):
        context = out[-window:]
        tokens = np.zeros((1, window), np.int32)
        tokens[0, : len(context)] = context
        out.append(int(next_token(state, tokens, len(context) - 1)))
    return out
