"""jaxpar: SPMD parallel training for JAX.

Describe the parallelism once (``ParallelConfig``), get a mesh (``make_mesh``), build the
model sharded (``init``) and train it (``Trainer``). Strategies come in MindSpore forms
(integer tuples, ``Layout``) or JAX forms (logical names with rules, ``PartitionSpec``).
"""

from jaxpar import ops, report
from jaxpar.deprecation import install_module_finder
from jaxpar.config import OptimizerConfig, ParallelConfig, PipelineConfig
from jaxpar.mesh import make_mesh
from jaxpar.precision import Precision
from jaxpar.nn import init
from jaxpar.pipeline import PipelineLoss
from jaxpar.plan import TrainPlan, TrainState, make_train_plan
from jaxpar.shard import LogicalConstraint, shard
from jaxpar.strategy import Layout, to_partition_spec
from jaxpar.train import CheckpointConfig, Placement, Services, Trainer
from jaxpar import optim
from jaxpar.config import CommFusionConfig
from jaxpar.remat import remat  # the function; the policies live in the jaxpar.remat module

from jaxpar.version import __version__  # noqa: E402

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
