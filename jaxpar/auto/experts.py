"""The price of expert parallel: the MoE layers' all-to-alls and expert memory.

`jaxpar.auto.job_search.search_job` reads a model's `jaxpar.nn.MoE` layers (`moe_layers`) and, for
each ``data × model`` mesh, prices two layouts of their stacked expert weights: replicated
(``ep = 1``: every device runs every expert on its own tokens) and split over the data axis
(``ep = d``: the rule ``"expert": "data"``, EP inside DP). The strategy search sees the
layer's one-device path (sort, gather, ``ragged_dot``, scatter) and keeps the expert weights
where `pins` put them, so their memory is exact per device (``1 / ep`` of them, and ZeRO
shards only what is not split already). The graph prices the experts' FLOPs itself: its
``ragged_dot`` products, ``2 · a · embed · mlp`` each over the strategy's splits, with
``a = t · top_k`` token-expert rows per device (``t`` tokens per device); balanced routing
gives every device ``a`` rows whatever ``ep`` is, so EP trades the all-to-alls for expert
memory. `experts_cost` adds what the graph does not show:

* **all-to-alls** (``ep > 1``): two per MoE layer forward (to the experts and back) and their
  two transposes in the backward, each of the dispatch's padded buffer
  ``ep · c · embed · itemsize`` bytes, ``c`` the rung of the dropless capacity ladder
  (`jaxpar.ops.moe_dispatch.capacity_ladder`, from ``ceil(a / ep)`` by ``bucket_growth``)
  that holds ``imbalance · a / ep`` rows (``imbalance = 1``: balanced routing, the first
  rung); with ``capacity_factor`` the fixed ``ceil(cf · t · k / E)`` slots per expert. On
  the wire an all-to-all moves ``(ep - 1) / ep`` of its buffer.

Beside a context axis the job search prices the experts replicated only (``ep = 1``), with the
tokens per device ``B · S / (d · cp)``: see `jaxpar.auto.job_options`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.auto.cost import Cost, CostParams
from jaxpar.auto.strategy import glob_escape
from jaxpar.ops.moe_dispatch import capacity_ladder

EXPERT_WEIGHTS = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One `jaxpar.nn.MoE` of a model: its parameter path, routing config, widths, how many
    layers it stands for and whether its weights carry a leading layer dimension (a scanned
    block stacks them, also when it holds a single layer)."""

    path: str
    experts: int
    top_k: int
    embed: int
    mlp: int
    layers: int
    itemsize: int
    bucket_growth: float
    capacity_factor: float | None
    stacked: bool = False


def moe_layers(model) -> list[MoELayer]:
    """The MoE layers of an (abstract) NNX model, in graph order.

    >>> from flax import nnx
    >>> moe_layers(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    []
    """
    from flax import nnx

    from jaxpar.nn.moe import MoE

    found = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, MoE):
            continue
        gate = node.gate.get_value()      # an array or, in an abstract model, its shape
        cfg = node.cfg
        stacked = len(gate.shape) == 4
        found.append(MoELayer("/".join(str(p) for p in path), cfg.experts, cfg.top_k, gate.shape[-2],
                              gate.shape[-1], gate.shape[0] if stacked else 1, np.dtype(gate.dtype).itemsize,
                              cfg.bucket_growth, cfg.capacity_factor, stacked))
    return found


def pins(layers: list[MoELayer], ep_axis: str | None) -> dict[str, PartitionSpec]:
    """``parameter_strategy`` entries placing every expert weight: its expert dimension on ``ep_axis``
    (``None``: replicated, so the search cannot split experts without pricing the exchange)."""
    out = {}
    for layer in layers:
        lead = (None,) if layer.stacked or layer.layers > 1 else ()
        spec = PartitionSpec(*lead, ep_axis, None, None) if ep_axis else PartitionSpec()
        for name in EXPERT_WEIGHTS:
            out[glob_escape(f"{layer.path}/{name}")] = spec
    return out


def buffer_rows(layer: MoELayer, tokens: int, ep: int, imbalance: float = 1.0) -> int:
    """Rows per peer of one exchange buffer on a device holding ``tokens`` tokens.

    >>> layer = MoELayer("mlp", 8, 2, 16, 32, 1, 4, 1.25, None)
    >>> buffer_rows(layer, 64, 4), buffer_rows(layer, 64, 4, imbalance=2.0)
    (32, 77)
    """
    a = tokens * layer.top_k
    if layer.capacity_factor is not None:
        return (layer.experts // ep) * math.ceil(layer.capacity_factor * tokens * layer.top_k / layer.experts)
    ladder = capacity_ladder(math.ceil(a / ep), a, layer.bucket_growth)
    need = math.ceil(imbalance * a / ep)
    return next((c for c in ladder if c >= need), ladder[-1])


def exchange_bytes(layers: list[MoELayer], tokens: int, ep: int, imbalance: float = 1.0) -> float:
    """Per-device all-to-all bytes of one step (`jaxpar.report`'s count: each exchange's buffer),
    forward and backward: four exchanges per MoE layer."""
    if ep <= 1:
        return 0.0
    return sum(4 * layer.layers * ep * buffer_rows(layer, tokens, ep, imbalance) * layer.embed * layer.itemsize
               for layer in layers)


def experts_cost(cost: Cost, layers: list[MoELayer], tokens: int, ep: int, params: CostParams, *,
                 axis: str = "data", imbalance: float = 1.0,
                 sizes: Mapping[str, int] | None = None) -> tuple[Cost, float]:
    """``cost`` plus, for ``ep > 1``, the all-to-alls over ``axis`` (module docstring); and the
    step's all-to-all bytes per device."""
    nbytes = exchange_bytes(layers, tokens, ep, imbalance)
    comm = 0.0
    if ep > 1:
        bw = params.bandwidth.get(axis, params.default_bandwidth)
        count = sum(4 * layer.layers for layer in layers)
        comm = count * params.latency_of((axis,)) + nbytes * (ep - 1) / ep / bw
    return dataclasses.replace(cost, comm_s=cost.comm_s + comm,
                               comm_bytes=cost.comm_bytes + int(nbytes)), nbytes


def tokens_per_device(batch: Any, data: int, grad_accum: int = 1, context: int = 1) -> int:
    """Tokens of one micro-batch on one device: the batch's ``[B, S]`` leaf over
    ``data × k × context`` (a context axis splits each row's tokens).

    >>> tokens_per_device({"inputs": np.zeros((8, 32))}, 4, context=2)
    32
    """
    import jax

    shape = tuple(np.shape(jax.tree.leaves(batch)[0]))
    return math.prod(shape[:2]) // (data * grad_accum * context)
