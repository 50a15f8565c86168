"""Flax NNX integration: the parameter specs, sharded init, the model's activation constraint, the
mixture-of-experts layer (embedding tables in host memory live in ``jaxpar.ps``)."""

from jaxpar.deprecation import module_getattr
from jaxpar.nn.constraint import model_constraint
from jaxpar.nn.init import abstract_model, init, init_program, place
from jaxpar.nn.moe import MoE, MoEAuxLoss, MoEConfig, MoEMetric, moe_aux_loss, moe_metrics, route
from jaxpar.nn.specs import format_specs, spec_rows, state_specs, to_shardings

__all__ = ["MoE", "MoEAuxLoss", "MoEConfig", "MoEMetric", "abstract_model", "format_specs", "init", "init_program",
           "model_constraint", "moe_aux_loss", "moe_metrics", "place", "route", "spec_rows", "state_specs",
           "to_shardings"]

__getattr__ = module_getattr(__name__)   # former names (CHANGELOG.md): warn and forward, or say what replaced them
