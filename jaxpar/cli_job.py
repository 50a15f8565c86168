"""The job that `jaxpar train`, `plan` and `report` run, resolved from their flags.

`resolve_job` turns the parsed flags into a `Job` (config, model, devices), raising
`UserError` for a mistake in them; `build_job` makes the mesh, the Trainer and the data.
"""

from __future__ import annotations

import dataclasses
from typing import Any


DEFAULT_DEVICES = 8       # simulated CPU devices when the machine has no accelerator
DEFAULT_BATCH = 32
# What jaxpar's validation of a config, a mesh or a flag raises: while the flags are being
# resolved into a job, these are the user's mistakes, never a bug.
JOB_ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError)


class UserError(Exception):
    """A mistake in the command line or its files; ``main`` prints it as one paragraph, exit 2."""


def refuse(message: str) -> None:
    raise UserError(message)


MEGATRON_RULES = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}


def set_simulated_devices(n: int) -> None:
    """Ask for ``n`` CPU devices; only possible before JAX starts a backend. Harmless on GPU/TPU."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX already runs (an in-process call): `resolve_job` checks --devices against it


def default_config(num_devices: int):
    """data × model: model = the largest of 4, 2, 1 dividing the device count."""
    from jaxpar.config import ParallelConfig

    model = next(m for m in (4, 2, 1) if num_devices % m == 0)
    return ParallelConfig(mesh={"data": num_devices // model, "model": model}, rules=MEGATRON_RULES)


@dataclasses.dataclass(frozen=True)
class Job:
    """What ``train`` / ``plan`` / ``report`` run, resolved from the flags before any work.

    Example:
        >>> job = resolve_job(make_parser().parse_args(["plan", "--mesh", "data=8"]))  # doctest: +SKIP
        >>> job.config.mesh  # doctest: +SKIP
        {'data': 8}
    """

    config: Any            # ParallelConfig
    model: Any             # GPTConfig
    devices: tuple         # the devices the mesh is built on
    batch: int
    steps: int
    lr: float
    seed: int


def devices_of(args) -> tuple:
    """All devices, or the first ``--devices`` of them."""
    import jax

    from jaxpar.distributed import initialize

    initialize()   # under `jaxpar launch`, join the job before JAX lists the devices (else a no-op)
    devices = tuple(jax.devices())
    if args.devices is None:
        return devices
    if jax.process_count() > 1:
        refuse(f"--devices {args.devices}: a multi-process job uses every process's devices; leave "
               "--devices out and choose the mesh with --mesh")
    if args.devices > len(devices):
        refuse(f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices are available "
               "(JAX was already started in this process, or this machine has no more); use --devices "
               f"{len(devices)} or fewer")
    return devices[:args.devices]


def config_of(args, devices):
    from jaxpar.config import ParallelConfig

    if args.config:
        try:
            base = ParallelConfig.from_yaml(args.config)
        except JOB_ERRORS as e:
            raise UserError(f"--config {args.config!r}: {e}") from e
    else:
        base = default_config(len(devices))
    default_rules = not args.config and args.rules is None and args.mode != "data"
    if args.rules is None and (args.mode == "data" or default_rules):
        base = dataclasses.replace(base, rules={})   # mode "data" replicates every parameter
    overrides = []
    for flag in ("mesh", "rules", "mode", "remat", "optimizer", "pipeline", "grad_accum"):
        value = getattr(args, flag)
        if value is not None:
            overrides += [f"--{flag}", str(value)]
    config = ParallelConfig.from_overrides(overrides, base=base) if overrides else base
    if default_rules:   # the Megatron rules, for the mesh axes there are (--mesh data=8: batch only)
        config = dataclasses.replace(config, rules={k: v for k, v in MEGATRON_RULES.items() if v in config.mesh})
    return config


def model_config(args, config):
    """The example GPT's ``GPTConfig`` from the model flags."""
    from jaxpar.models.gpt import GPTConfig

    if args.embed % args.heads:
        refuse(f"--embed {args.embed} is not divisible by --heads {args.heads}; use an embed that is a multiple "
               f"of the heads, e.g. --embed {args.heads * max(1, args.embed // args.heads)}")
    # A pipeline cuts the stacked blocks into stages, so it needs scanned layers.
    return GPTConfig(vocab_size=16, seq_len=args.seq_len or 32, embed=args.embed, heads=args.heads,
                     mlp=4 * args.embed, layers=args.layers, scan_layers=args.scan or config.pipeline.stages > 1)


def resolve_job(args) -> Job:
    """The `Job` the flags describe; a mistake in them raises `UserError` (exit 2)."""
    import jaxpar

    try:
        devices = devices_of(args)
        config = config_of(args, devices)
        jaxpar.make_mesh(config, devices)      # the mesh must fit the devices
        model = model_config(args, config)
    except JOB_ERRORS as e:
        raise UserError(str(e)) from e
    return Job(config=config, model=model, devices=devices, batch=args.batch or DEFAULT_BATCH,
               steps=getattr(args, "steps", 1), lr=getattr(args, "lr", 3e-3), seed=getattr(args, "seed", 0))


def build_job(job: Job, watch=None):
    """(mesh, trainer, data) for the example GPT; ``watch``: the `jaxpar.metrics.cli` flags."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.data import ArithmeticData
    from jaxpar.models.gpt import GPT, loss_fn, pipeline_loss
    from jaxpar.nn import model_constraint

    config = job.config
    mesh = jaxpar.make_mesh(config, job.devices)
    constrain = model_constraint(mesh, config)   # with a context axis: ContextParallel
    model = jaxpar.init(lambda: GPT(job.model, rngs=nnx.Rngs(job.seed), constrain=constrain), config, mesh)
    warmup = min(20, job.steps // 5)
    tx_schedule = optax.warmup_cosine_decay_schedule(0.0, job.lr, warmup, max(job.steps, warmup + 1))
    tx = optax.adamw(tx_schedule)
    loss = pipeline_loss() if config.pipeline.stages > 1 else loss_fn
    # Every process generates the same global batches (ArithmeticData is seeded by step), so under
    # `jaxpar launch` each one hands jaxpar the whole batch and jaxpar keeps each device's rows.
    watching = {}
    if watch is not None:
        from jaxpar.metrics.cli import metrics_config

        compute = config.precision.compute if config.precision else "float32"
        watching = {"metrics": metrics_config(watch, tx_schedule, compute), "profile_steps": watch.profile_steps}
    trainer = jaxpar.Trainer(model, tx, loss, config, mesh, global_batch=True, **watching)
    return mesh, trainer, ArithmeticData(job.model.seq_len, seed=job.seed)
