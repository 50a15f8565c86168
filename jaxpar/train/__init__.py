"""The compiled training step (built in `jaxpar.train.step`), the plan a Trainer runs
(`plan_for`, made before it) and the Trainer that runs it."""

from jaxpar.train.compile import compile_step
from jaxpar.train.hooks import Preempted
from jaxpar.train.planning import plan_for
from jaxpar.train.trainer import Trainer

__all__ = ["Preempted", "Trainer", "compile_step", "plan_for"]
