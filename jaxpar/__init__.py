"""jaxpar: SPMD parallel training for JAX.

Describe the parallelism once (``ParallelConfig``), get a mesh (``make_mesh``), build the
model sharded (``init``) and train it (``Trainer``). Strategies come in MindSpore forms
(integer tuples, ``Layout``) or JAX forms (logical names with rules, ``PartitionSpec``).
"""

import importlib
import importlib.util
import sys
import types

from jaxpar.deprecation import install_module_finder
from jaxpar.remat import remat  # the function (light: JAX loads when it runs); the policies live in the jaxpar.remat module
from jaxpar.version import __version__

# The package face is read on first use (PEP 562): `import jaxpar.launch` (the launcher, the
# CLI's light commands, every worker of a job before it needs JAX) does not import JAX, Flax,
# optax and orbax. Each name, and the module that defines it:
_FACE = {
    "CheckpointConfig": "jaxpar.train", "Placement": "jaxpar.train", "Services": "jaxpar.train",
    "Trainer": "jaxpar.train",
    "CommFusionConfig": "jaxpar.config", "OptimizerConfig": "jaxpar.config", "ParallelConfig": "jaxpar.config",
    "PipelineConfig": "jaxpar.config",
    "Layout": "jaxpar.strategy", "to_partition_spec": "jaxpar.strategy",
    "LogicalConstraint": "jaxpar.shard", "shard": "jaxpar.shard",   # the function, as remat below
    "PipelineLoss": "jaxpar.pipeline",
    "Precision": "jaxpar.precision",
    "TrainPlan": "jaxpar.plan", "TrainState": "jaxpar.plan", "make_train_plan": "jaxpar.plan",
    "init": "jaxpar.nn",
    "make_mesh": "jaxpar.mesh",
}
_SUBPACKAGES = ("ops", "optim", "report")


def __getattr__(name: str):
    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
    elif name in _SUBPACKAGES or (not name.startswith("_") and importlib.util.find_spec(f"jaxpar.{name}")):
        value = importlib.import_module(f"jaxpar.{name}")   # jaxpar.nn, jaxpar.checkpoint, ...: as when all were loaded
    else:
        from jaxpar.deprecation import former_attribute

        return former_attribute("jaxpar", name, stacklevel=2)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_FACE) | set(_SUBPACKAGES))


class _Face(types.ModuleType):
    """The package: ``jaxpar.shard`` and ``jaxpar.remat`` stay the functions of those names
    when their modules are imported (the import system binds a submodule to its package's
    attribute of the same name; the modules stay importable by their paths)."""

    def __setattr__(self, name, value):
        if name in ("shard", "remat") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face


install_module_finder()   # module paths of 0.1.0 that moved: a warning naming the new one, or an error saying what to use

__all__ = [
    "CheckpointConfig",
    "CommFusionConfig",
    "Layout",
    "LogicalConstraint",
    "OptimizerConfig",
    "ParallelConfig",
    "PipelineConfig",
    "PipelineLoss",
    "Placement",
    "Precision",
    "Services",
    "TrainPlan",
    "TrainState",
    "Trainer",
    "init",
    "make_mesh",
    "make_train_plan",
    "optim",
    "remat",
    "ops",
    "report",
    "shard",
    "to_partition_spec",
]
