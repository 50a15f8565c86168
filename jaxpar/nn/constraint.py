"""The activation constraint a model built for a ``ParallelConfig`` holds."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpar.config import ParallelConfig
from jaxpar.data import batch_axes
from jaxpar.data.sequence import context_axes
from jaxpar.ops import ContextParallel
from jaxpar.shard import LogicalConstraint


def model_constraint(mesh: jax.sharding.Mesh, config: ParallelConfig) -> Callable:
    """The activation constraint a model built for ``config`` should hold: a
    ``LogicalConstraint`` of the rules, wrapped in `ContextParallel` when ``config.context`` is set.

    >>> config = jaxpar.ParallelConfig(mesh={"data": 4, "context": 2}, rules={"batch": "data"}, context={})
    >>> type(model_constraint(jaxpar.make_mesh(config), config)).__name__
    'ContextParallel'
    """
    constrain = LogicalConstraint(mesh, activation_rules(mesh, config))
    return constrain if config.context is None else ContextParallel(constrain, mesh, config)


def activation_rules(mesh: jax.sharding.Mesh, config: ParallelConfig) -> dict:
    """The rules a model's activations follow: ``config.rules``, and where they do not say,
    where the step puts the batch: ``"batch"`` over the batch axes (`jaxpar.data.batch_axes`;
    ``mode="data"`` takes no rules at all) when no ``dataset_strategy`` (and no ``mode="auto"``
    search) places the batch otherwise, and, with context parallel, ``"length"`` over the
    context axes. Layers that route tokens (``jaxpar.nn.MoE``) read them: without them every
    device would route the whole batch.

    >>> activation_rules(jaxpar.make_mesh({"data": 8}), jaxpar.ParallelConfig(mesh={"data": 8}))
    {'batch': ('data',)}
    """
    rules = dict(config.rules)
    # the default batch split only: a dataset_strategy (a searched one under mode="auto" too)
    # places the batch itself, and its activations follow it
    if "batch" not in rules and config.dataset_strategy is None and config.mode != "auto" and batch_axes(config, mesh):
        rules["batch"] = batch_axes(config, mesh)
    if config.context is not None and not {"length", "seq"} & set(rules):
        rules["length"] = context_axes(config, mesh)
    return rules
