"""Build and run a `JobConfig`: model, data, optimizer, Trainer, evaluation, samples.

``run_job(job)`` is what ``jaxpar train --config job.yaml`` calls; it is also the way to run a
job file from Python::

    job = JobConfig.load("examples/configs/tiny.yaml", ["--train.steps", "20"])
    summary = run_job(job)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

from jaxpar.job.batch import check_batch
from jaxpar.job.config import JobConfig
from jaxpar.job.optim import make_optimizer


def _import(spec: str, where: str) -> Callable:
    module, _, name = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"job config {where}={spec!r}: cannot import it ({e}); check the module is on PYTHONPATH "
                         "and the name is spelled as defined") from None
    if not callable(obj):
        raise TypeError(f"job config {where}={spec!r} is a {type(obj).__name__}, not a function")
    return obj


def _built(model, spec: str):
    """The model a ``model.factory`` returned, refused unless it is an ``nnx.Module``."""
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(f"job config model.factory={spec!r} returned a value of type {type(model).__name__}, "
                        "not an nnx.Module; the factory is called as factory(rngs) and must build the model and "
                        "return it, e.g. 'def factory(rngs): return MyModel(rngs=rngs)'")
    return model


def model_config(job: JobConfig, vocab: int | None = None):
    """The named model's config (``LlamaConfig`` / ``GPTConfig``) with the job's fields; its
    vocabulary grows to the data's and its ``max_seq_len`` to ``data.seq_len`` when smaller.
    With pipeline stages the blocks are stacked (``scan_layers=True``), which the stages split."""
    m = job.model
    if m.name == "llama":
        from jaxpar.models.llama_config import LlamaConfig, for_data

        try:
            cfg = LlamaConfig.named(m.size)
        except ValueError as e:
            raise ValueError(f"job config model.size={m.size!r}: {e}") from None
        grow = {}       # for_data grows max_seq_len and vocab_size, as export_hf does from a job.yaml
    else:
        from jaxpar.models.gpt import GPTConfig

        cfg = GPTConfig()
        grow = {"seq_len": max(cfg.seq_len, job.data.seq_len)}
        if vocab is not None and "vocab_size" not in m.fields:
            grow["vocab_size"] = max(cfg.vocab_size, vocab)
    if "remat" in m.fields:     # recompute is a parallel setting, applied to the model's blocks from outside
        raise ValueError(f"job config model.fields.remat={m.fields['remat']!r}: a model has no recompute policy; "
                         f"set it under parallel (parallel.remat: {m.fields['remat']}, i.e. ParallelConfig.remat), "
                         f"which the Trainer applies to each of the model's blocks")
    known = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(m.fields) - known)
    if unknown:
        raise ValueError(f"job config model.fields: {unknown} are not fields of {type(cfg).__name__}; known: "
                         f"{sorted(known)}")
    stages = job.parallel.pipeline.stages
    if stages > 1:
        if m.fields.get("scan_layers", True) is not True:
            raise ValueError(f"job config model.fields.scan_layers={m.fields['scan_layers']!r} with "
                             f"parallel.pipeline.stages={stages}: the stages split the stacked blocks; drop "
                             "scan_layers from model.fields (pipelined jobs stack them) or the pipeline")
        grow["scan_layers"] = True
    fields = {**grow, **m.fields}
    try:
        if m.name == "llama":   # as LlamaConfig.named(size, **fields): head_dim follows the job's embed / heads
            return for_data(m.size, fields, seq_len=job.data.seq_len, vocab=vocab)
        return dataclasses.replace(cfg, **fields)
    except (TypeError, ValueError) as e:
        kind = ValueError if isinstance(e, ValueError) else TypeError
        model = f"llama size {m.size!r}" if m.name == "llama" else "gpt"
        raise kind(f"job config model.fields={dict(m.fields)!r} ({model}): {e}") from None


def build_model(job: JobConfig, mesh, vocab: int | None = None, values: str = "computed"):
    """``(model, loss_fn, model_config)`` placed on ``mesh`` by ``job.parallel``; ``values`` as
    `jaxpar.init`'s (``"restored"``: zeros for the resumed checkpoint to overwrite)."""
    from flax import nnx

    import jaxpar
    from jaxpar.nn import model_constraint

    config, m = job.parallel, job.model
    constrain = model_constraint(mesh, config)   # with a context axis: ContextParallel
    rngs = lambda: nnx.Rngs(job.train.seed)  # noqa: E731
    if m.factory is not None:
        factory, loss = _import(m.factory, "model.factory"), _import(m.loss, "model.loss")
        if config.pipeline.stages > 1:
            from jaxpar.pipeline import PipelineLoss, StagedLoss

            if not isinstance(loss, (PipelineLoss, StagedLoss)):
                raise TypeError(f"job config model.loss={m.loss!r} is a {type(loss).__name__}; with "
                                f"parallel.pipeline.stages={config.pipeline.stages} it must name a "
                                "jaxpar.pipeline.PipelineLoss (or StagedLoss) defined in that module, e.g. "
                                "'loss = PipelineLoss(embed=..., blocks=..., head=..., head_loss=...)'")
        return jaxpar.init(lambda: _built(factory(rngs()), m.factory), config, mesh, values=values), loss, None
    cfg = model_config(job, vocab)
    if m.name == "llama":
        from jaxpar.models import llama as module
        from jaxpar.models import llama_parallel as parallel

        make = lambda: module.Llama(cfg, rngs=rngs(), constrain=constrain)  # noqa: E731
    else:
        from jaxpar.models import gpt as module
        from jaxpar.models import gpt_parallel as parallel

        make = lambda: module.GPT(cfg, rngs=rngs(), constrain=constrain)  # noqa: E731
    # pipelined: the loss in the parts the stages run (segment ids reach every stage's blocks)
    loss = parallel.training_loss(config)
    return jaxpar.init(make, config, mesh, values=values), loss, cfg


def _eval_store(job: JobConfig):
    """The held-out store of ``data.eval_path`` (None without one); a missing or damaged one is
    refused naming ``data.eval_path``, not as if it were ``data.path``."""
    from jaxpar.data import TokenStore

    path = job.data.eval_path
    if path is None:
        return None
    try:
        return TokenStore(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"job config data.eval_path={path!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"job config data.eval_path={path!r}: {e}") from None


def _loaders(job: JobConfig, store, eval_store, model_cfg):
    from jaxpar.data import TokenLoader, load_tokenizer

    d = job.data
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer is not None else None
    common = dict(seq_len=d.seq_len, global_batch=d.batch, packing=d.packing, model_config=model_cfg,
                  tokenizer=tokenizer)
    train = TokenLoader(store, seed=d.seed, prefetch=d.prefetch, **common)
    held_out = None
    if eval_store is not None:       # built now: a store too small for a batch fails before training
        held_out = TokenLoader(eval_store, seed=0, shuffle=False, prefetch=0, **common)
    return train, held_out


def check_directory(field: str, directory: str) -> None:
    """Refuse an output folder of the job that cannot be written, before any work: the folder is
    made if missing and a probe file written in it; ``ValueError`` names the field, the path and
    the fix."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".jaxpar-probe-"):
            pass
    except OSError as e:
        blocking = os.path.abspath(directory)
        while not os.path.exists(blocking) and os.path.dirname(blocking) != blocking:
            blocking = os.path.dirname(blocking)
        why = (f"{blocking!r} is a file, not a folder" if os.path.isfile(blocking)
               else f"{e.strerror or e}: {blocking!r}")
        raise ValueError(f"job config {field}={directory!r} cannot be written ({why}); give a folder you can "
                         f"write (made if missing), e.g. --{field} runs/{os.path.basename(os.path.normpath(directory))}"
                         ) from None


def save_resolved(job: JobConfig, *directories: str | None) -> None:
    """Write the resolved job (defaults and overrides applied) as ``job.yaml`` in each directory."""
    for directory in directories:
        if directory:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "job.yaml"), "w") as f:
                f.write(job.to_yaml())


@dataclasses.dataclass
class Built:
    """What `build` makes of a job: its mesh, Trainer, training batches and held-out batches
    (None without evaluation data), and the token store (None for generated data)."""

    mesh: Any
    trainer: Any
    train: Any
    held_out: Any
    store: Any = None

    def example_batch(self):
        """The first batch the Trainer will train on (reports and plans compile the step with it)."""
        return self.train.batch(self.train.position)


def check_outputs(job: JobConfig) -> None:
    """Refuse, before any work, a job without data and output folders that cannot be written."""
    if job.data.source == "store" and job.data.path is None:
        raise ValueError("job config data.path is not set: make a token store with 'jaxpar data prepare FILES "
                         "--out DIR' and give data.path: DIR (or --data.path DIR)")
    for field, directory in (("checkpoint.dir", job.checkpoint.dir), ("logging.dir", job.logging.dir)):
        if directory is not None:
            check_directory(field, directory)


def _resumes(job: JobConfig) -> bool:
    """Whether the Trainer will resume a step of ``checkpoint.dir`` (its persistent tier holds a
    complete one, and mode "auto" searches on a computed model first)."""
    from jaxpar.checkpoint import latest_step

    ck = job.checkpoint
    return ck.dir is not None and job.parallel.mode != "auto" and latest_step(ck.dir) is not None


def build(job: JobConfig, *, devices=None) -> Built:
    """The mesh, model, data, optimizer and Trainer of ``job`` (`run_job` checks its outputs
    first); the Trainer resumes from ``checkpoint.dir`` when it holds steps."""
    import jaxpar
    from jaxpar.metrics import MetricsConfig
    from jaxpar.report import peak_flops

    log, ck = job.logging, job.checkpoint
    mesh = jaxpar.make_mesh(job.parallel, devices)
    check_batch(job, mesh)      # the processes, the step's parts and the batch axes all split data.batch
    store = eval_store = None
    if job.data.source == "store":
        from jaxpar.data import TokenStore

        store = TokenStore(job.data.path)      # a damaged store is named first
        eval_store = _eval_store(job)
    tx, schedule = make_optimizer(job.optimizer, job.train.steps)     # the schedule is checked before the model
    values = "restored" if _resumes(job) else "computed"    # a resumed run computes no initial values
    if job.data.source == "arithmetic":
        from jaxpar.job.example import ARITHMETIC_VOCAB, EVAL_START, ArithmeticLoader

        model, loss, _ = build_model(job, mesh, vocab=ARITHMETIC_VOCAB, values=values)
        d = job.data
        train = ArithmeticLoader(seq_len=d.seq_len, batch=d.batch, seed=d.seed)
        held_out = ArithmeticLoader(seq_len=d.seq_len, batch=d.batch, seed=d.seed, start=EVAL_START)
    else:
        model, loss, model_cfg = build_model(job, mesh, vocab=store.vocab_size, values=values)
        train, held_out = _loaders(job, store, eval_store, model_cfg)
    metrics = None
    if log.dir is not None:
        compute = job.parallel.precision.compute if job.parallel.precision is not None else "float32"
        metrics = MetricsConfig(dir=log.dir, every=log.every, tensorboard=log.tensorboard, learning_rate=schedule,
                                peak_flops=log.peak_flops or peak_flops(dtype=compute))
    # mode "auto": the plan is searched on the first batch the job trains on, before the Trainer
    # places anything (jaxpar.auto.plan_for); then the Trainer resumes from checkpoint.dir
    plan = None
    if job.parallel.mode == "auto":
        from jaxpar.auto import plan_for

        plan = plan_for(model, tx, loss, job.parallel, mesh, example_batch=train.batch(train.position))
    # generated data: every process makes the same global batch and jaxpar keeps each device's rows
    global_batch = True if job.data.source == "arithmetic" else None
    checkpoint = None if ck.dir is None else jaxpar.CheckpointConfig(dir=ck.dir, save_every=ck.every, keep=ck.keep,
                                                                     resume=ck.resume, local_dir=ck.local_dir,
                                                                     local_every=ck.local_every, peer=ck.peer)
    services = jaxpar.Services(checkpoint=checkpoint, metrics=metrics, profile=log.profile_steps)
    trainer = jaxpar.Trainer(model, tx, loss, job.parallel, mesh, plan=plan, services=services,
                             placement=jaxpar.Placement(global_batch=global_batch))
    return Built(mesh=mesh, trainer=trainer, train=train, held_out=held_out, store=store)


def run_job(job: JobConfig, *, devices=None, progress: bool = True, samples: int = 0,
            print_fn: Callable[[str], None] = print,
            before_fit: Callable[[Built], None] | None = None) -> dict[str, Any]:
    """Train ``job``; returns ``{"history", "eval", "samples", "step", "fit_s", "trained"}``
    (``fit_s``: the seconds spent in the training steps; ``trained``: False when the checkpoint
    was already at ``train.steps``, which leaves ``job.yaml`` alone; one past it is refused).

    Evaluation runs every ``eval.every`` steps and at the end when there is held-out data
    (``data.eval_path``, or the arithmetic source's own); ``samples`` greedy continuations of
    a few prompts are decoded at the end (named models on a token store). ``before_fit(built)``
    is called once the Trainer is ready, before the first step (``jaxpar train`` prints its
    report there).
    """
    import jax

    if samples and job.data.source != "store":
        raise ValueError(f"samples={samples}: the samples continue prompts in a token store's tokenizer, and "
                         f"data.source {job.data.source!r} has none; drop --samples")
    check_outputs(job)
    built = build(job, devices=devices)
    trainer, train, held_out = built.trainer, built.train, built.held_out
    log, ck = job.logging, job.checkpoint
    with trainer, contextlib.closing(train):
        if trainer.data_state:           # resumed: the saved data position must be this store and batch
            train.restore(trainer.data_state)
        start = trainer.step_count
        finished = _check_resume_step(start, job)
        if finished:     # nothing runs: the job.yaml and the summary of the run that got there stay
            print_fn(f"already at step {start} = train.steps in {ck.dir}; nothing to train (give a larger "
                     "--train.steps to train on)")
            texts = _samples(trainer, built.store, samples, job.data.seq_len) if samples else []
            return {"history": [], "eval": [], "samples": texts, "step": start, "fit_s": 0.0, "trained": False}
        # job.yaml is written once a step has run: a resume or a step that is refused (at build or
        # at the first step's trace) keeps the job.yaml of the job that made the checkpoints
        saved = []

        def record(*_):     # a Trainer hook: (step, metrics)
            if not saved and trainer.step_count > start:
                saved.append(trainer.step_count)
                if jax.process_index() == 0:
                    save_resolved(job, log.dir, ck.dir)

        trainer.add_hook(record)
        if start:
            print_fn(f"resumed at step {start} from {ck.dir}")
        if before_fit is not None:
            before_fit(built)
        try:
            history, evals, fit_s = _train_steps(job, trainer, train, held_out, progress, print_fn)
        finally:
            record()       # a run stopped after its first step (preempted, say) has its job.yaml too
        if ck.dir is not None and trainer.step_count not in trainer.checkpointer.manager.all_steps():
            trainer.save()
        texts = _samples(trainer, built.store, samples, job.data.seq_len) if samples else []
    return {"history": history, "eval": evals, "samples": texts, "step": trainer.step_count, "fit_s": fit_s,
            "trained": True}


def _train_steps(job: JobConfig, trainer, train, held_out, progress: bool, print_fn) -> tuple[list, list, float]:
    """Train to ``train.steps``, evaluating every ``eval.every`` steps: ``(history, evals, fit_s)``."""
    import time

    log = job.logging
    history, evals, fit_s = [], [], 0.0
    every = job.eval.every or job.train.steps
    while trainer.step_count < job.train.steps:
        chunk = min(every - trainer.step_count % every, job.train.steps - trainer.step_count)
        t0 = time.perf_counter()
        history += trainer.fit(train, chunk, log_every=log.every, progress=progress, until=job.train.steps)
        fit_s += time.perf_counter() - t0
        if held_out is not None:
            held_out.restore({**held_out.state(), "next_batch": 0})     # the same batches each time
            loss_value = trainer.evaluate(held_out, job.eval.steps)
            evals.append({"step": trainer.step_count, "eval_loss": loss_value,
                          "perplexity": math.exp(min(loss_value, 50.0))})
            print_fn(f"step {trainer.step_count}: train loss {history[-1]['loss']:.4f}  eval loss "
                     f"{loss_value:.4f}  perplexity {evals[-1]['perplexity']:.2f}")
    return history, evals, fit_s


def _check_resume_step(start: int, job: JobConfig) -> bool:
    """Whether the checkpoint is already at ``train.steps`` (nothing to train); a checkpoint past
    it is refused: training cannot go back, and rewriting the run's records would lose them."""
    steps = job.train.steps
    if start > steps:
        raise ValueError(f"job config checkpoint.dir={job.checkpoint.dir!r} holds step {start}, past train.steps="
                         f"{steps}: a run cannot train back to step {steps}; give --train.steps {start + 1} or more to "
                         f"train on from step {start}, or another --checkpoint.dir to start a new run")
    return start == steps


PROMPTS = ("def ", "import ", "class ", "    return ")


def _samples(trainer, store, count: int, window: int) -> list[str]:
    from jaxpar.models.generate import greedy

    tokenizer = store.tokenizer()
    model = trainer.model
    out = []
    for prompt in PROMPTS[:count]:
        ids = greedy(model, tokenizer.encode(prompt), 48, window=window)
        out.append(tokenizer.decode(ids))
    return out


def summary_json(result: dict[str, Any]) -> str:
    """The run's last train loss, eval records and samples, as JSON."""
    last = result["history"][-1] if result["history"] else {}
    return json.dumps({"step": result["step"], "loss": last.get("loss"), "eval": result["eval"],
                       "samples": result["samples"]}, indent=1)
