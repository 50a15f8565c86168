"""Pipeline parallelism: schedules as plain data, one shard_map executor for all of them.

``schedules`` builds and draws tables (tick × stage → F / B / W / idle) without JAX;
``executor`` runs any table as one compiled program over a ``"pipe"`` mesh axis.

Example:
    >>> from jaxpar.pipeline import build, bubble_fraction
    >>> bubble_fraction(build("zb-h1", 4, 8))
    Fraction(1, 9)
"""
from jaxpar.pipeline.executor import (
    PipelineCall,
    Program,
    forward_only,
    from_stage_layout,
    lower,
    pipeline_forward,
    pipeline_loss,
    pipeline_value_and_grad,
    to_stage_layout,
)
from jaxpar.pipeline.model import PipelineLoss, pipelined
from jaxpar.pipeline.schedules import (
    SCHEDULES,
    Kind,
    Op,
    Schedule,
    bubble_fraction,
    build,
    gpipe,
    interleaved,
    location,
    one_f_one_b,
    peak_activations,
    plot_timeline,
    timeline,
    validate,
    virtual_stage,
    zb_h1,
)
from jaxpar.pipeline.stages import StagedLoss, best_split, module_paths
from jaxpar.pipeline.vshape import dualpipe_v, zb_v

__all__ = [
    "SCHEDULES", "Kind", "Op", "PipelineCall", "PipelineLoss", "Program", "Schedule", "StagedLoss", "best_split",
    "bubble_fraction", "build", "module_paths",
    "dualpipe_v", "forward_only", "from_stage_layout", "gpipe", "interleaved", "location", "lower",
    "one_f_one_b", "peak_activations", "pipeline_forward", "pipeline_loss", "pipeline_value_and_grad",
    "pipelined", "plot_timeline", "timeline", "to_stage_layout", "validate", "virtual_stage", "zb_h1", "zb_v",
]
