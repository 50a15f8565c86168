"""The plan and the state: ``TrainPlan`` (where everything lives, a value) and ``TrainState``
(what the step takes and returns, a pytree). Both come before the compiled step in the data
flow: search, init, checkpoints and reports take them; none of them needs a Trainer."""

from jaxpar.plan.checks import check_combination
from jaxpar.plan.state import TrainState, check_data, init_state, state_shardings
from jaxpar.plan.train_plan import IdleAxisWarning, TrainPlan, flat_paths, make_train_plan

__all__ = ["IdleAxisWarning", "TrainPlan", "TrainState", "check_combination", "check_data", "flat_paths", "init_state",
           "make_train_plan", "state_shardings"]
