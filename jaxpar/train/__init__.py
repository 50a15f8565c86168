"""The compiled training step (built in `jaxpar.train.step`), its programs per batch shape
(`jaxpar.train.programs`), the services around the loop as hooks (`Services`, `jaxpar.train.hooks`)
and the Trainer that runs a plan made before it."""

from jaxpar.deprecation import module_getattr
from jaxpar.train.checkpointing import CheckpointHook
from jaxpar.train.compile import compile_step
from jaxpar.train.hooks import EveryHook, Hook, NonfiniteHook, Preempted, PreemptionHook
from jaxpar.train.services import BUILT_IN, CheckpointConfig, Placement, Services
from jaxpar.train.trainer import Trainer
from jaxpar.train.watch import MetricsHook, ProfileHook

__all__ = ["BUILT_IN", "CheckpointConfig", "CheckpointHook", "EveryHook", "Hook", "MetricsHook", "NonfiniteHook",
           "Placement", "Preempted", "PreemptionHook", "ProfileHook", "Services", "Trainer", "compile_step"]

__getattr__ = module_getattr(__name__)   # former names (CHANGELOG.md): warn and forward, or say what replaced them
