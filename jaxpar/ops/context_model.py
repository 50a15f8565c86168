"""`ContextParallel`: how a model that speaks logical axis names gets context-parallel attention.

A model stores one ``constrain(x, names)`` callable and calls it on its activations (the
Llama model does). Wrapping that callable in a `ContextParallel` adds an ``attention``
method the model's attention layer uses when it is there, so the model code names no mesh
axis: the data-parallel axes come from the ``"batch"`` rule, the tensor-parallel axes from
the ``"heads"`` rule, and the context axes, strategy and order from ``ParallelConfig.context``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.config import ParallelConfig
from jaxpar.ops.context import AttentionMask, context_attention
from jaxpar.strategy import logical_axes, mesh_sizes

RESIDUAL = ("batch", "length", "embed")   # the residual stream between the blocks' TP regions


def _is_residual(names) -> bool:
    """The residual stream's names: ``("batch", "length" or "seq", "embed")``."""
    names = tuple(names)
    return len(names) == 3 and names[0] == RESIDUAL[0] and names[2] == RESIDUAL[2] and names[1] in ("length", "seq")


class ContextParallel:
    """``constrain(x, names)`` plus ``attention(q, k, v, segment_ids, positions)`` over the context axes.

    Args:
      constrain: the model's activation constraint, a ``jaxpar.LogicalConstraint`` of the rules
        (``jaxpar.nn.model_constraint(mesh, config)`` builds this wrapper around it).
      mesh: the training mesh.
      config: a ``ParallelConfig`` with ``context`` set.
      residual: optional constraint for the residual stream ``("batch", "length", "embed")``
        only, e.g. one whose rules send ``"length"`` to ``("context", "model")``: Megatron-style
        sequence parallel, where norms and residuals run on ``S / (cp · tp)`` tokens and the
        tensor-parallel all-reduces become an all-gather before and a reduce-scatter after
        each TP block.

    Example:
      >>> config = jaxpar.ParallelConfig(mesh={"data": 2, "context": 4}, rules={"batch": "data",
      ...     "length": "context"}, context={"strategy": "ring", "order": "zigzag"})
      >>> mesh = jaxpar.make_mesh(config)
      >>> constrain = jaxpar.nn.model_constraint(mesh, config)    # a ContextParallel
      >>> model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0), constrain=constrain)
    """

    def __init__(self, constrain: Callable, mesh: jax.sharding.Mesh, config: ParallelConfig, *,
                 residual: Callable | None = None):
        if config.context is None:
            raise ValueError("ContextParallel needs ParallelConfig(context=...), e.g. context={'strategy': 'ring'}; "
                             "without it use the constraint alone")
        self.constrain, self.mesh, self.config, self.residual = constrain, mesh, config, residual

    def __hash__(self):
        return hash((self.constrain, self.residual, self.mesh, self.config.context,
                     tuple(sorted(self.config.rules.items()))))

    def __eq__(self, other):
        return isinstance(other, ContextParallel) and (self.constrain, self.residual, self.mesh, self.config) == (
            other.constrain, other.residual, other.mesh, other.config)

    @property
    def rules(self):
        """The wrapped constraint's rules (layers that read their mesh axes from them, e.g. MoE)."""
        return getattr(self.constrain, "rules", ())

    def __call__(self, x, names):
        if self.residual is not None and _is_residual(names):
            return self.residual(x, names)
        return self.constrain(x, names)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                  positions: jax.Array) -> jax.Array:
        """Causal attention on ``[B, S, H, D]`` q and ``[B, S, Hkv, D]`` k, v, masked by ``positions``."""
        ctx = self.config.context
        batch = self._axes("batch", q.shape[0])
        # an axis the batch already uses (a 2D layout maps heads to the data axis) leaves the heads whole
        heads = tuple(a for a in self._axes("heads", q.shape[2]) if a not in batch)
        n = math.prod(mesh_sizes(self.mesh)[a] for a in heads)
        if k.shape[2] % n:
            # fewer K/V heads than the tensor-parallel devices (GQA / MQA): each K/V head repeated
            # up to lcm(kv_heads, n), so every device keeps its share of the query heads
            r = math.lcm(k.shape[2], n) // k.shape[2]
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        mask = AttentionMask(segment_ids=segment_ids, q_positions=positions)
        return context_attention(q, k, v, mask, axis=ctx.axis, strategy=ctx.strategy, mesh=self.mesh,
                                 batch_axis=batch or None, heads_axis=heads or None)

    def _axes(self, name: str, *dims: int) -> tuple[str, ...]:
        """Mesh axes of logical ``name`` (not the context ones); none unless they divide ``dims``."""
        sizes, cfg = mesh_sizes(self.mesh), self.config
        skip = set(cfg.context.axes) | {cfg.pipeline.axis}
        if name == "batch" and "batch" not in cfg.rules:
            axes = tuple(a for a in sizes if a not in skip) if cfg.mode == "data" else (
                ("data",) if "data" in sizes else ())
        else:
            axes = tuple(a for a in logical_axes(name, sizes, cfg.rules) if a not in skip)
        n = 1
        for a in axes:
            n *= sizes[a]
        return axes if all(d % n == 0 for d in dims) else ()

