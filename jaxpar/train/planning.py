"""The `TrainPlan` a Trainer runs, made before the Trainer exists.

Every mode plans here, up front: ``"data"``, ``"semi_auto"`` and ``"hybrid"`` from the config
(`jaxpar.plan.make_train_plan`); ``"auto"`` by the strategy search on an example batch
(`jaxpar.auto.plan_training`) or from a search saved earlier (``jaxpar.auto.Strategy.from_json``).
The Trainer takes the result and only runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.plan import TrainPlan, make_train_plan


def plan_for(model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable, config: ParallelConfig, mesh, *,
             example_batch: Any = None, searched: Any = None, offload: tuple[str, ...] = ()) -> tuple[TrainPlan, Any]:
    """``(TrainPlan, search record)``: the plan to train ``model`` with ``tx`` and ``loss_fn``
    under ``config`` on ``mesh``, and the strategy search's `jaxpar.auto.Strategy` (``None`` when
    nothing was searched).

    In mode ``"auto"`` the search runs on ``example_batch`` (a global batch: arrays or
    ``jax.ShapeDtypeStruct``s; only its shapes and dtypes are read), or ``searched`` — a search
    saved with ``.to_json`` and read with ``jaxpar.auto.Strategy.from_json`` — is trained as it is.
    Other modes need neither (both are ignored).

    >>> plan, found = plan_for(model, tx, loss_fn, auto_config, mesh, example_batch=batch)  # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, auto_config, mesh, plan=plan)          # doctest: +SKIP
    """
    if config.mode != "auto":
        return make_train_plan(config, mesh, model, tx, offload=offload, loss_fn=loss_fn), None
    from jaxpar.auto import Strategy, plan_training

    if searched is not None:
        if not isinstance(searched, Strategy):
            raise TypeError(f"plan_for: searched must be a jaxpar.auto.Strategy (e.g. jaxpar.auto.Strategy.from_json(path)), "
                            f"got {type(searched).__name__}")
        return make_train_plan(searched.to_config(config), mesh, model, tx, offload=offload, loss_fn=loss_fn,
                               source=f"searched:{searched.search}"), searched
    if example_batch is None:
        raise ValueError("mode='auto' searches the strategies on a batch before training, and no batch was given: "
                         "pass example_batch=<one global batch> to the Trainer (only its shapes are read), or plan "
                         "first with jaxpar.train.plan_for(model, tx, loss_fn, config, mesh, example_batch=batch) "
                         "(or searched=jaxpar.auto.Strategy.from_json(path)) and give the Trainer plan=; the Trainer no "
                         "longer searches at its first batch (see docs/parallel_modes.md and CHANGELOG.md)")
    return plan_training(model, loss_fn, example_batch, config, mesh, tx, offload=offload)
