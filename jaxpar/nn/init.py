"""``init``: build a Flax NNX model directly sharded on the mesh.

One trace of the constructor (``jax.make_jaxpr``: shapes, no memory), then the plan, then the
init: one small jitted program per kind of variable (``sliced_init``), or one program for the
whole model where that compiles sooner (a small model with variables of many kinds), whose
``out_shardings`` are the plan's. Each device computes only its own shards, so no device ever
holds a full replica of a sharded parameter, and a large model never compiles as one program.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import jax
import numpy as np
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
    graphdef, traced, shardings = _planned(model_fn, config, mesh)
    return graphdef, SlicedInit(traced, shardings, split)


def _planned(model_fn, config: ParallelConfig, mesh):
    """``model_fn`` traced once, and the plan's shardings of its ``(params, rest)``."""
    graphdef, traced, (abs_params, abs_rest) = _trace(model_fn)
    param_specs = state_specs(config, mesh, abs_params, check_unused=False)
    check_strategy_covers(config, abs_params, abs_rest)
    if config.optimizer.level == 3:
        # FSDP: parameters are stored sharded over the data axis from the start.
        from jaxpar.optim.zero import zero_specs

        param_specs = zero_specs(config.optimizer, mesh, param_specs, abs_params).params
    shardings = (to_shardings(param_specs, mesh),
                 to_shardings(state_specs(config, mesh, abs_rest, check_unused=False), mesh))
    return graphdef, traced, shardings


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


VALUES = ("computed", "restored")
_PLACEHOLDERS: dict[int, weakref.ref] = {}
"""The arrays of ``init(..., values="restored")`` models (by id; each entry dies with its array)."""


def init(model_fn: Callable[[], nnx.Module], config: ParallelConfig, mesh, *, values: str = "computed") -> nnx.Module:
    """Build ``model_fn()`` with every variable placed by the plan for ``config`` on ``mesh``.

    ``values="restored"``: for a run that resumes a checkpoint, which overwrites every variable,
    compute none of them: each is zeros of its shape, dtype and sharding, placed from the host
    (no program is compiled, where the computed initialisation compiles one or more: on a
    restart that is seconds on every process whose compilation cache misses). The Trainer given
    such a model must restore a step as it is built (``Services(checkpoint=...)`` with a step in
    its directory); it refuses to start otherwise, so placeholders never train.

    >>> cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"mlp": "model"})
    >>> mesh = jaxpar.make_mesh(cfg)
    >>> model = jaxpar.init(lambda: GPT(GPTConfig(), rngs=nnx.Rngs(0)), cfg, mesh)
    """
    if values not in VALUES:
        raise ValueError(f"init: values={values!r} is not one of {VALUES}; 'restored' places zeros for a "
                         "checkpoint to overwrite (a resumed run), 'computed' (the default) initialises")
    if values == "computed":
        graphdef, make = init_program(model_fn, config, mesh)
        return nnx.merge(graphdef, *make())
    graphdef, (_, out_shape), shardings = _planned(model_fn, config, mesh)
    leaves = [_zeros(shape, sharding) for shape, sharding in
              zip(jax.tree.leaves(out_shape), jax.tree.structure(out_shape).flatten_up_to(shardings))]
    for leaf in leaves:
        _PLACEHOLDERS[id(leaf)] = weakref.ref(leaf, lambda _, key=id(leaf): _PLACEHOLDERS.pop(key, None))
    return nnx.merge(graphdef, *jax.tree.unflatten(jax.tree.structure(out_shape), leaves))


def _zeros(shape: jax.ShapeDtypeStruct, sharding) -> jax.Array:
    """Zeros of ``shape`` placed by ``sharding``, each device's shard made on the host."""
    dtype = shape.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):     # a key: zeros of its data (a trailing axis), wrapped
        data = jax.eval_shape(jax.random.key_data, shape)
        extra = len(data.shape) - len(shape.shape)
        spec = jax.sharding.PartitionSpec(*sharding.spec, *([None] * (len(shape.shape) - len(sharding.spec) + extra)))
        try:
            key = jax.random.wrap_key_data(_zeros(data, jax.sharding.NamedSharding(sharding.mesh, spec,
                                                                                   memory_kind=sharding.memory_kind)))
        except TypeError:     # key data of another implementation's shape
            key = None
        if key is None or key.dtype != dtype:
            raise ValueError(f"init(values='restored'): a key of type {dtype} is not of the default key "
                             "implementation; build this model with values='computed'")
        return key if key.sharding.is_equivalent_to(sharding, key.ndim) else jax.device_put(key, sharding)
    return jax.make_array_from_callback(
        shape.shape, sharding, lambda index: np.zeros(_shard_shape(shape.shape, index), dtype))


def _shard_shape(shape: tuple, index: tuple) -> tuple:
    return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape)) + tuple(shape[len(index):])


def holds_placeholders(model: nnx.Module) -> bool:
    """Whether any variable of ``model`` is still a placeholder of ``init(..., values="restored")``."""
    return any((ref := _PLACEHOLDERS.get(id(x))) is not None and ref() is x
               for x in jax.tree.leaves(nnx.state(model)))


def place(model: nnx.Module, config: ParallelConfig, mesh) -> nnx.Module:
    """Move an already-built model's variables to the plan's shardings (returns a new model)."""
    graphdef, state = nnx.split(model)
    shardings = to_shardings(state_specs(config, mesh, state), mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
