"""A training job described in one YAML file (`JobConfig`), built (`build`) and run (`run_job`)."""

from jaxpar.job.config import JobConfig
from jaxpar.job.optim import make_optimizer

__all__ = ["JobConfig", "make_optimizer"]
