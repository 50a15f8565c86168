"""Flax NNX integration: the parameter plan and sharded init."""

from jaxpar.nn.init import abstract_model, init, init_program, place
from jaxpar.nn.plan import format_plan, plan_rows, plan_state, to_shardings

__all__ = ["abstract_model", "format_plan", "init", "init_program", "place", "plan_rows", "plan_state", "to_shardings"]
