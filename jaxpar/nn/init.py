"""``init``: build a Flax NNX model directly sharded on the mesh.

Abstract shapes first (``nnx.eval_shape``), then the plan, then one jitted init whose
``out_shardings`` are the plan: each device computes only its own shards, so no device ever
holds a full replica of a sharded parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.nn.plan import check_plan_covers, plan_state, to_shardings


def _no_eager_sharding():
    # Flax can shard variables at creation from their annotations; jaxpar places them itself.
    if hasattr(nnx, "use_eager_sharding"):
        return nnx.use_eager_sharding(False)
    return contextlib.nullcontext()


def abstract_model(model_fn: Callable[[], nnx.Module]) -> nnx.Module:
    """The model with ``ShapeDtypeStruct`` values: nothing is allocated."""
    with _no_eager_sharding():
        return nnx.eval_shape(model_fn)


def init_program(model_fn: Callable[[], nnx.Module], config: ParallelConfig, mesh):
    """``(graphdef, jitted_init)``: ``jitted_init()`` returns ``(params, rest)``, already sharded.

    Exposed so the init program can be inspected (``jitted_init.lower().compile()``).
    """
    if isinstance(model_fn, nnx.Module) or not callable(model_fn):
        raise TypeError(f"init expects a function that builds the model, got {type(model_fn).__name__}; "
                        "write e.g. jaxpar.init(lambda: MyModel(rngs=nnx.Rngs(0)), config, mesh)")
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"init expects a ParallelConfig, got {type(config).__name__}")
    graphdef, abs_params, abs_rest = nnx.split(abstract_model(model_fn), nnx.Param, ...)
    param_specs = plan_state(config, mesh, abs_params, check_unused=False)
    check_plan_covers(config, abs_params, abs_rest)
    if config.optimizer.level == 3:
        # FSDP: parameters are stored sharded over the data axis from the start.
        from jaxpar.optim.zero import zero_plan

        param_specs = zero_plan(config.optimizer, mesh, param_specs, abs_params).params
    shardings = (to_shardings(param_specs, mesh),
                 to_shardings(plan_state(config, mesh, abs_rest, check_unused=False), mesh))

    def make():
        with _no_eager_sharding():
            return nnx.split(model_fn(), nnx.Param, ...)[1:]

    return graphdef, jax.jit(make, out_shardings=shardings)


def init(model_fn: Callable[[], nnx.Module], config: ParallelConfig, mesh) -> nnx.Module:
    """Build ``model_fn()`` with every variable placed by the plan for ``config`` on ``mesh``.

    >>> cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"mlp": "model"})
    >>> mesh = jaxpar.make_mesh(cfg)
    >>> model = jaxpar.init(lambda: GPT(GPTConfig(), rngs=nnx.Rngs(0)), cfg, mesh)
    """
    graphdef, make = init_program(model_fn, config, mesh)
    return nnx.merge(graphdef, *make())


def place(model: nnx.Module, config: ParallelConfig, mesh) -> nnx.Module:
    """Move an already-built model's variables to the plan's shardings (returns a new model)."""
    graphdef, state = nnx.split(model)
    shardings = to_shardings(plan_state(config, mesh, state), mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
