"""The activation constraint a model built for a ``ParallelConfig`` holds."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpar.config import ParallelConfig
from jaxpar.ops import ContextParallel
from jaxpar.shard import LogicalConstraint


def model_constraint(mesh: jax.sharding.Mesh, config: ParallelConfig) -> Callable:
    """The activation constraint a model built for ``config`` should hold: a
    ``LogicalConstraint`` of the rules, wrapped in `ContextParallel` when ``config.context`` is set.

    >>> config = jaxpar.ParallelConfig(mesh={"data": 4, "context": 2}, rules={"batch": "data"}, context={})
    >>> type(model_constraint(jaxpar.make_mesh(config), config)).__name__
    'ContextParallel'
    """
    constrain = LogicalConstraint(mesh, config.rules)
    return constrain if config.context is None else ContextParallel(constrain, mesh, config)
