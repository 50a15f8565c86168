"""Optimizer parallel (ZeRO), gradient accumulation, communication fusion.

The ``Trainer`` applies these from ``ParallelConfig``; the functions here are the same
pieces for a hand-written loop:

>>> zero = jaxpar.optim.zero_specs(jaxpar.OptimizerConfig(level=2), mesh, specs, params)   # doctest: +SKIP
>>> tx = jaxpar.optim.shard_optimizer(optax.adamw(1e-3), mesh, zero, params)             # doctest: +SKIP
"""

from jaxpar.deprecation import module_getattr
from jaxpar.optim.accumulate import accumulate_grads, interleave_loss, split_batch
from jaxpar.optim.fusion import bucketed_psum, compiler_options
from jaxpar.optim.zero import ZeroSpecs, opt_state_specs, shard_optimizer, zero_axes, zero_specs, zero_spec

__all__ = [
    "ZeroSpecs",
    "accumulate_grads",
    "bucketed_psum",
    "compiler_options",
    "interleave_loss",
    "opt_state_specs",
    "shard_optimizer",
    "split_batch",
    "zero_axes",
    "zero_specs",
    "zero_spec",
]

__getattr__ = module_getattr(__name__)   # former names (CHANGELOG.md): warn and forward, or say what replaced them
