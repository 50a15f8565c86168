"""The compiled training step (built in `jaxpar.train.step`) and the Trainer that runs it."""

from jaxpar.train.compile import compile_step
from jaxpar.train.guards import Preempted
from jaxpar.train.trainer import Trainer

__all__ = ["Preempted", "Trainer", "compile_step"]
