"""The compiled training step (built in `jaxpar.train.step`) and the Trainer that runs it."""

from jaxpar.train.trainer import Trainer, compile_step

__all__ = ["Trainer", "compile_step"]
