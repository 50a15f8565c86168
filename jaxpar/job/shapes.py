"""A job's `TrainPlan` from shapes alone: ``jaxpar plan --config job.yaml``.

No parameter is allocated and the mesh may be larger than this machine (``llama3_8b`` on 64
devices): the model is built abstractly and planned for mesh *sizes*.
"""

from __future__ import annotations

import os

from jaxpar.data.store import INDEX, read_index
from jaxpar.job.config import JobConfig


def plan_sizes(job: JobConfig, device_count: int) -> dict[str, int]:
    """The job's mesh sizes, an axis of -1 taking the rest of ``device_count`` devices."""
    from jaxpar.mesh import resolve_axes

    sizes = dict(job.parallel.mesh)
    return resolve_axes(sizes, device_count) if -1 in sizes.values() else sizes


def plan_of_job(job: JobConfig, sizes: dict[str, int]):
    """``(TrainPlan, Llama memory report text or None)`` of a named-model job on a mesh of ``sizes``;
    the plan refuses what the Trainer would, as it is made from the model and loss `run_job` builds."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AbstractMesh

    from jaxpar.job.batch import check_batch
    from jaxpar.job.optim import make_optimizer
    from jaxpar.job.run import model_config
    from jaxpar.nn import abstract_model, model_constraint
    from jaxpar.plan import make_train_plan
    from jaxpar.plan.checks import check_rules_consulted

    if job.model.factory is not None:
        raise ValueError("jaxpar plan --config: a model.factory job is planned when it runs (jaxpar train); "
                         "plan covers the named models")
    if job.parallel.mode == "auto":
        raise ValueError("jaxpar plan --config: parallel.mode 'auto' is planned by the strategy search on a batch, "
                         "which jaxpar train runs before the first step; plan from shapes covers the other modes: "
                         "give --parallel.mode semi_auto with --parallel.rules, or train the job")
    check_batch(job, sizes, process_count=1)    # as the job's run checks it (the processes are not known here)
    vocab = None
    if job.data.source == "arithmetic":
        from jaxpar.job.example import ARITHMETIC_VOCAB

        vocab = ARITHMETIC_VOCAB
    elif job.data.path is not None and os.path.isfile(os.path.join(job.data.path, INDEX)):
        # the vocabulary grows to the store's as in `run_job` (its index alone is read)
        vocab = int(read_index(job.data.path)["tokenizer"]["vocab_size"])
    cfg = model_config(job, vocab)
    tx, _ = make_optimizer(job.optimizer, job.train.steps)
    if job.model.name == "llama":
        from jaxpar.models import llama as module
        from jaxpar.models import llama_parallel as parallel
        make = module.Llama
    else:
        from jaxpar.models import gpt as module
        from jaxpar.models import gpt_parallel as parallel
        make = module.GPT
    constrain = model_constraint(AbstractMesh(tuple(sizes.values()), tuple(sizes)), job.parallel)
    model = abstract_model(lambda: make(cfg, rngs=nnx.Rngs(0), constrain=constrain))
    loss = parallel.training_loss(job.parallel)
    plan = make_train_plan(job.parallel, sizes, model, tx, loss_fn=loss)
    tokens = jax.ShapeDtypeStruct((job.data.batch, job.data.seq_len), jnp.int32)
    check_rules_consulted(job.parallel, model, module.loss_fn, {"inputs": tokens, "targets": tokens})   # as train
    memory = None
    if job.model.name == "llama":
        from jaxpar.models.llama_report import ReportRequest, format_model_report, llama_report

        memory = format_model_report(llama_report(cfg, job.parallel, ReportRequest(
            batch=job.data.batch, seq_len=job.data.seq_len, mesh=sizes, tx=tx)))
    return plan, memory
