"""The compiled training step (built in `jaxpar.train.step`) and the Trainer that runs it."""

from jaxpar.train.guards import Preempted
from jaxpar.train.trainer import Trainer, compile_step

__all__ = ["Preempted", "Trainer", "compile_step"]
