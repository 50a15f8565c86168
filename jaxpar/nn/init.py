"""``init``: build a Flax NNX model directly sharded on the mesh.

One trace of the constructor (``jax.make_jaxpr``: shapes, no memory), then the plan, then the
init: one small jitted program per kind of variable (``sliced_init``), or one program for the
whole model where that compiles sooner (a small model with variables of many kinds), whose
``out_shardings`` are the plan's. Each device computes only its own shards, so no device ever
holds a full replica of a sharded parameter, and a large model never compiles as one program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.nn.specs import check_strategy_covers, state_specs, to_shardings
from jaxpar.nn.sliced_init import SlicedInit


def _no_eager_sharding():
    # Flax can shard variables at creation from their annotations; jaxpar places them itself.
    if hasattr(nnx, "use_eager_sharding"):
        return nnx.use_eager_sharding(False)
    return contextlib.nullcontext()


def abstract_model(model_fn: Callable[[], nnx.Module]) -> nnx.Module:
    """The model with ``ShapeDtypeStruct`` values: nothing is allocated."""
    with _no_eager_sharding():
        return nnx.eval_shape(model_fn)


def init_program(model_fn: Callable[[], nnx.Module], config: ParallelConfig, mesh, *, split: str = "auto"):
    """``(graphdef, program)``: ``program()`` returns ``(params, rest)``, already sharded.

    ``program`` is a ``jaxpar.nn.sliced_init.SlicedInit``: ``program.programs()`` lists the
    jitted programs that run with their arguments, to inspect (``jitted.lower(*args).compile()``).
    ``split``: ``"auto"`` (what ``init`` does), ``"variables"`` (a program per kind of variable)
    or ``"whole"`` (one program), to compare the two.
    """
    if isinstance(model_fn, nnx.Module) or not callable(model_fn):
        raise TypeError(f"init expects a function that builds the model, got {type(model_fn).__name__}; "
                        "write e.g. jaxpar.init(lambda: MyModel(rngs=nnx.Rngs(0)), config, mesh)")
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"init expects a ParallelConfig, got {type(config).__name__}")
    graphdef, traced, (abs_params, abs_rest) = _trace(model_fn)
    param_specs = state_specs(config, mesh, abs_params, check_unused=False)
    check_strategy_covers(config, abs_params, abs_rest)
    if config.optimizer.level == 3:
        # FSDP: parameters are stored sharded over the data axis from the start.
        from jaxpar.optim.zero import zero_specs

        param_specs = zero_specs(config.optimizer, mesh, param_specs, abs_params).params
    shardings = (to_shardings(param_specs, mesh),
                 to_shardings(state_specs(config, mesh, abs_rest, check_unused=False), mesh))
    return graphdef, SlicedInit(traced, shardings, split)


def _trace(model_fn):
    """``model_fn`` traced once: its graphdef, its jaxpr, and its abstract ``(params, rest)``."""
    graphdefs = []

    def make():
        with _no_eager_sharding():
            model = model_fn()
            if not isinstance(model, nnx.Module):
                raise TypeError(f"init: the model function returned a value of type {type(model).__name__}, "
                                "not an nnx.Module; it must build the model and return it, e.g. jaxpar.init(lambda: "
                                "MyModel(rngs=nnx.Rngs(0)), config, mesh)")
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        graphdefs.append(graphdef)
        return params, rest

    closed, abstract = jax.make_jaxpr(make, return_shape=True)()
    return graphdefs[0], (closed, abstract), abstract


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
    shardings = to_shardings(state_specs(config, mesh, state), mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
