"""The price of a ``context`` mesh axis: attention over a sequence split ``cp`` ways.

`jaxpar.auto.job_search.search_job` prices a ``context × data × model`` option on the graph of
the model run on a *folded* batch: ``[B, S]`` becomes ``[B · cp, S / cp]`` and the data axis
``d · cp``. Everything per token (norms, MLPs, residuals, embedding, loss: the
``"length" → "context"`` rule) then costs per device exactly what it costs under context
parallel, and the parameters are replicated over ``d · cp`` devices whose gradients are
summed together (ZeRO shards over ``("data", "context")``). Only attention differs: the folded
graph compares each query with ``S / cp`` keys, context parallel with all ``S``.
`attention_terms` finds the attention operators (values with two sequence dimensions: the
scores, their softmax, the product with V) and `context_cost` corrects the folded price:

* **FLOPs**: the folded attention's FLOPs times ``cp`` (``all_gather``, ``ulysses``: every
  score is computed and masked), or times ``(2·cp + 1) / 4`` for ``ring`` under a causal mask
  (zigzag order, two tiles per shard: of ``4·cp`` tile pairs a device meets, ``2·cp + 1`` are
  not fully masked; the same on every device).
* **Temp**: the folded graph keeps ``(S / cp)²`` scores per row and head for the backward;
  ``all_gather`` keeps ``S / cp × S`` and ``ulysses`` ``H / cp`` heads × ``S²`` (both ``cp``
  times the folded ones); ``ring``'s custom VJP keeps none (one tile of ``(S / 2cp)²`` is
  live at a time).
* **Collectives** per attention layer, forward + backward, in `jaxpar.report`'s count (the
  formulas of docs/context_parallel.md, checked there against the compiled HLO), for ``b``
  rows per device: ``all_gather`` ``b · (2 · 2·S·Hkv·D·w + 4·S)``; ``ring``
  ``b · ((2(cp-1) - [cp=2]) · (kv + ids) + cp · kv)`` with ``kv = 2·(S/cp)·Hkv·D·w`` and
  ``ids = 4·S/cp``; ``ulysses`` ``b · (2 · (2·q + 2·kv') + 4·S)`` with ``q = (S/cp)·H·D·w``
  and ``kv'`` the K/V heads repeated to ``lcm(Hkv, cp)``. Time: a latency per collective and
  the bytes on the wire (a ``ppermute`` moves all of its buffer, a gather or all-to-all
  ``(cp - 1) / cp``) over the ``context`` axis's bandwidth; no overlap with compute is
  assumed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxpar.auto.cost import Cost, CostParams, local_bytes, op_terms, param_of
from jaxpar.auto.graph import Graph

STRATEGIES = ("ring", "ulysses", "all_gather")


@dataclasses.dataclass(frozen=True)
class Attention:
    """The attention of a folded graph: layers (runs per step), heads, K/V heads, head width,
    bytes per element, and the folded operators' FLOPs and saved score bytes per device."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    flops: float
    saved_bytes: float


def fold(batch: Any, cp: int) -> Any:
    """Abstract shapes of ``batch`` with every ``[B, S, ...]`` leaf as ``[B · cp, S / cp, ...]``.

    >>> fold({"inputs": np.zeros((2, 16), np.int32)}, 4)["inputs"].shape
    (8, 4)
    """
    def one(x):
        shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", np.asarray(x).dtype)
        if len(shape) < 2:
            return jax.ShapeDtypeStruct((shape[0] * cp, *shape[1:]) if shape else shape, dtype)
        return jax.ShapeDtypeStruct((shape[0] * cp, shape[1] // cp, *shape[2:]), dtype)
    return jax.tree.map(one, batch)


def check_sequence(batch: Any, cp: int, strategy: str) -> int:
    """The sequence length of ``batch`` (dimension 1 of its first leaf), checked for ``cp``."""
    leaves = jax.tree.leaves(batch)
    shape = tuple(np.shape(leaves[0]))
    if len(shape) < 2:
        raise ValueError(f"search_job: context={cp} splits dimension 1 (the sequence) of the batch, but its first "
                         f"leaf has shape {shape}; give [batch, length] leaves or leave context=(1,)")
    if strategy not in STRATEGIES:
        raise ValueError(f"search_job: context_strategy has {strategy!r}; choose from {STRATEGIES}")
    if shape[1] % (2 * cp):
        raise ValueError(f"search_job: context={cp} with the zigzag order needs the sequence length {shape[1]} to be a "
                         f"multiple of 2 * {cp} = {2 * cp}; use context sizes whose double divides {shape[1]}")
    return shape[1]


def attention_terms(graph: Graph, axes, sizes: Mapping[str, int], flags, seq: int,
                    cost_params=None) -> Attention | None:
    """The attention operators of a graph whose sequence length is ``seq`` (``None``: none);
    their FLOPs as `jaxpar.auto.cost.evaluate` counts them with ``cost_params`` (a `CostParams`).

    An attention operator touches a value with two sequence dimensions (the scores);
    the score products are the ``dot_general`` s producing one, their K input gives the K/V
    heads and head width. A sequence dimension is one of the batch's sequence class (dimension
    1 of its first ``[B, seq]`` leaf), not any dimension of length ``seq``: a folded sequence
    as long as the heads or the head width would otherwise make every ``[B, S, H, D]``
    activation look like scores."""
    seq_class = _sequence_class(graph, seq)

    def two_seq(t):
        return t >= 0 and graph.tensors[t].classes.count(seq_class) >= 2

    params = param_of(graph)      # the parameters and their compute-dtype casts
    flops = saved = 0.0
    layers, shape = 0, None
    for op in graph.ops:
        if not any(two_seq(t) for t in (*op.ins, *op.outs)):
            continue
        flops += op_terms(graph, op, axes, sizes, flags, cost_params)[0]
        saved += sum(local_bytes(graph, t, axes, sizes) * op.repeat for t in op.outs if two_seq(t) and flags.saved[t])
        if op.prim == "dot_general" and two_seq(op.outs[0]) and not any(t in params for t in op.ins):
            layers += op.repeat
            q, k = sorted((graph.tensors[t] for t in op.ins), key=lambda x: -math.prod(x.shape))
            shape = (q, k)
    if not layers:
        return None
    q, k = shape
    d = k.shape[-1]
    rows_tokens = q.shape[0] * seq
    heads = max(1, math.prod(q.shape) // (rows_tokens * d))
    kv = max(1, math.prod(k.shape) // (rows_tokens * d))
    return Attention(layers, heads, kv, d, q.itemsize, flops, saved)


def _sequence_class(graph: Graph, seq: int) -> int | None:
    """The dimension class of the batch's sequence: dimension 1 of its first ``[B, seq, ...]`` leaf."""
    for _, t in graph.batch:
        tensor = graph.tensors[t]
        if len(tensor.shape) >= 2 and tensor.shape[1] == seq:
            return tensor.classes[1]
    return None


def collective_bytes(att: Attention, strategy: str, cp: int, seq: int, rows: float, tp: int = 1) -> float:
    """Per-device bytes (`jaxpar.report`'s count) of one step's context collectives (module docstring).

    >>> a = Attention(layers=1, heads=4, kv_heads=4, head_dim=8, itemsize=4, flops=0.0, saved_bytes=0.0)
    >>> collective_bytes(a, "all_gather", 4, 64, rows=1)    # 2 · 2·64·4·8·4 + 4·64
    33024.0
    """
    w, d = att.itemsize, att.head_dim
    heads = att.heads / tp
    kv_heads = math.lcm(att.kv_heads, tp) / tp
    kv = 2 * (seq / cp) * kv_heads * d * w
    ids = 4 * seq / cp
    if strategy == "all_gather":
        one = 2 * (2 * seq * kv_heads * d * w) + 4 * seq
    elif strategy == "ring":
        one = (2 * (cp - 1) - (cp == 2)) * (kv + ids) + cp * kv
    else:
        q = (seq / cp) * heads * d * w
        kv_rep = kv * math.lcm(int(kv_heads), cp) / kv_heads
        one = 2 * (2 * q + 2 * kv_rep) + 4 * seq
    return att.layers * rows * one


def collective_count(strategy: str, cp: int) -> int:
    """Collectives per attention layer and step (each pays a latency)."""
    return {"all_gather": 4, "ring": 3 * cp - 2, "ulysses": 8}[strategy]


def context_cost(cost: Cost, att: Attention, strategy: str, cp: int, seq: int, rows: float, params: CostParams,
                 tp: int = 1, axis: str = "context", causal: bool = True) -> tuple[Cost, float]:
    """The folded graph's ``cost`` corrected for context parallel attention (module docstring),
    and the step's context collective bytes per device."""
    factor = (2 * cp + 1) / 4 if strategy == "ring" and causal else cp
    extra_s = att.flops * (factor - 1) / params.flops_per_s
    temp = -att.saved_bytes if strategy == "ring" else att.saved_bytes * (cp - 1)
    nbytes = collective_bytes(att, strategy, cp, seq, rows, tp)
    wire = nbytes * (1.0 if strategy == "ring" else (cp - 1) / cp)
    bw = params.bandwidth.get(axis, params.default_bandwidth)
    comm_s = att.layers * collective_count(strategy, cp) * params.latency_of((axis,)) + wire / bw
    act, grads, reduced = cost.temp_parts
    parts = (max(0.0, act + temp), grads, reduced)
    return dataclasses.replace(cost, compute_s=cost.compute_s + extra_s, comm_s=cost.comm_s + comm_s, temp_parts=parts,
                               comm_bytes=cost.comm_bytes + int(nbytes)), nbytes
