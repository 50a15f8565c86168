"""The built-in example as a job: the small GPT on generated arithmetic text.

``jaxpar train`` / ``plan`` / ``report`` without a job file describe this job with flags
(``--layers``, ``--mesh``, ``--steps``...); `example_job` turns their values into the
`JobConfig` that a job file with ``data: {source: arithmetic}`` and ``model: {name: gpt}``
also describes, so both forms run through `jaxpar.job.run.run_job`.

>>> from jaxpar.config import ParallelConfig
>>> job = example_job(ParallelConfig(mesh={"data": 8}), ExampleModel(layers=4), steps=10)
>>> job.model.name, job.model.fields["layers"], job.data.source, job.optimizer.warmup_steps
('gpt', 4, 'arithmetic', 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.config import ParallelConfig
from jaxpar.job.config import (DataSection, EvalSection, JobConfig, LoggingSection, ModelSection, OptimizerSection,
                               TrainSection)

# Megatron-style tensor parallel rules of the example on a data x model mesh
MEGATRON_RULES = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
ARITHMETIC_VOCAB = 16      # jaxpar.models.data.VOCAB: divides evenly over 2, 4, 8 or 16 devices
EVAL_START = 10**6         # the held-out batches of the arithmetic data: far after any training step


def default_parallel(num_devices: int) -> ParallelConfig:
    """data x model with the Megatron rules: model = the largest of 4, 2, 1 dividing the device count.

    >>> default_parallel(8).mesh
    {'data': 2, 'model': 4}
    """
    model = next(m for m in (4, 2, 1) if num_devices % m == 0)
    return ParallelConfig(mesh={"data": num_devices // model, "model": model}, rules=MEGATRON_RULES)


@dataclasses.dataclass(frozen=True)
class ExampleModel:
    """The shape of the example GPT: ``layers`` blocks of width ``embed``, ``heads`` heads, MLP
    4 x ``embed``, on sequences of ``seq_len`` tokens; ``scan``: its blocks a ``lax.scan`` over
    stacked layers (a pipeline stacks them without it).

    >>> ExampleModel(embed=64, heads=6)
    Traceback (most recent call last):
    ...
    ValueError: the example GPT's embed=64 is not divisible by heads=6; use an embed that is a multiple of the heads, e.g. 60
    """

    layers: int = 2
    embed: int = 64
    heads: int = 8
    seq_len: int = 32
    scan: bool = False

    def __post_init__(self):
        embed, heads = self.embed, self.heads
        if embed % heads:
            raise ValueError(f"the example GPT's embed={embed} is not divisible by heads={heads}; use an embed that "
                             f"is a multiple of the heads, e.g. {heads * max(1, embed // heads)}")

    def fields(self) -> dict[str, Any]:
        """The ``model.fields`` of the job (``GPTConfig`` fields)."""
        fields: dict[str, Any] = {"vocab_size": ARITHMETIC_VOCAB, "seq_len": self.seq_len, "embed": self.embed,
                                  "heads": self.heads, "mlp": 4 * self.embed, "layers": self.layers}
        if self.scan:
            fields["scan_layers"] = True      # a pipeline stacks the blocks without it (model_config)
        return fields


def example_job(parallel: ParallelConfig, model: ExampleModel = ExampleModel(), *, batch: int = 32, steps: int = 300,
                lr: float = 3e-3, seed: int = 0, logging: LoggingSection | None = None) -> JobConfig:
    """The example GPT (``model``: its shape, `ExampleModel`) trained ``steps`` steps on ``batch``
    arithmetic sequences of ``model.seq_len`` tokens by AdamW (optax's defaults: weight decay
    1e-4 on every parameter, no clipping) with a linear warmup over ``min(20, steps // 5)`` steps
    and a cosine decay to 0, placed by ``parallel``."""
    if not isinstance(model, ExampleModel):
        raise TypeError(f"example_job: model={model!r} must be a jaxpar.job.example.ExampleModel(layers=..., "
                        "embed=..., heads=..., seq_len=..., scan=...)")
    return JobConfig(
        model=ModelSection(name="gpt", fields=model.fields()),
        data=DataSection(source="arithmetic", seq_len=model.seq_len, batch=batch, seed=seed),
        optimizer=OptimizerSection(lr=lr, warmup_steps=min(20, steps // 5), schedule="cosine", min_lr_ratio=0.0,
                                   weight_decay=1e-4, decay_1d=True, clip_norm=None, b2=0.999),
        parallel=parallel, train=TrainSection(steps=steps, seed=seed),
        logging=logging or LoggingSection(), eval=EvalSection(steps=4))


class ArithmeticLoader:
    """Global batches of `jaxpar.models.data.ArithmeticData` from batch ``start`` on, keeping its
    position as `jaxpar.data.TokenLoader` does (``state()`` / ``restore(state)``), so a job on
    this data resumes from a checkpoint at the batch it stopped at. Every process reads the same
    global batch (``jaxpar.Placement(global_batch=True)``).

    >>> loader = ArithmeticLoader(seq_len=8, batch=2, seed=0)
    >>> first = next(iter(loader)); loader.state()
    {'next_batch': 1}
    """

    def __init__(self, *, seq_len: int, batch: int, seed: int, start: int = 0):
        from jaxpar.models.data import ArithmeticData

        self.data = ArithmeticData(seq_len, seed=seed)
        self.batch_size, self.start, self.position = batch, start, 0

    def batch(self, position: int) -> dict:
        """The batch at ``position`` (0: the first this loader yields)."""
        return self.data.batch(self.batch_size, self.start + position)

    def __iter__(self):
        while True:
            batch = self.batch(self.position)
            self.position += 1
            yield batch

    def state(self) -> dict[str, int]:
        return {"next_batch": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state["next_batch"])

    def close(self) -> None:
        pass

