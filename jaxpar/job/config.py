"""``JobConfig``: one training job in one YAML file.

Sections (every one optional; the defaults train the Llama ``tiny`` model)::

    model:      {name: llama, size: tiny, fields: {layers: 4}}      # or factory/loss: "pkg.mod:fn"
    data:       {path: runs/data/stdlib, seq_len: 128, batch: 16}
    optimizer:  {lr: 3.0e-3, warmup_steps: 20, schedule: cosine, clip_norm: 1.0, weight_decay: 0.1}
    parallel:   {mesh: {data: 8}}                                     # ParallelConfig fields
    train:      {steps: 300, seed: 0}
    checkpoint: {dir: runs/ckpt, every: 100, keep: 3}
    logging:    {dir: runs/log, every: 10, tensorboard: true, profile_steps: "10:13"}
    eval:       {every: 100, steps: 4}

Every field can be overridden on the command line as ``--section.field value`` (the value is
read as YAML: ``--optimizer.lr 3e-4``, ``--parallel.mesh "{data: 2, model: 4}"``). A key that
does not exist is refused with the closest known one; a value of the wrong type names the
field, the value and the type wanted.

>>> job = JobConfig.from_dict({"optimizer": {"lr": 1e-3}}, overrides=["--train.steps", "5"])
>>> job.optimizer.lr, job.train.steps
(0.001, 5)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpar.config import ParallelConfig, current_names
from jaxpar.deprecation import OFFLOAD, refusal

SCHEDULES = ("cosine", "linear", "constant")
# keys of former jobs, refused in any section naming what to use: train.offload (host offload) was removed
REMOVED_KEYS = {"offload": OFFLOAD}


def _loader():
    """PyYAML's safe loader refusing a key given twice (`jaxpar.yaml_files.UniqueKeyLoader`),
    without YAML 1.1's base-60 integers (``10:13`` stays the text a profile window is written in,
    not 613) and with ``3e-4`` read as a float."""
    import re

    import yaml

    from jaxpar.yaml_files import UniqueKeyLoader

    class Loader(UniqueKeyLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        key: [(tag, regexp) for tag, regexp in resolvers if tag not in (
            "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
        for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
        r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0o?[0-7_]+)$"), list("-+0123456789"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    return Loader


PACKING = ("packed", "padded")
SOURCES = ("store", "arithmetic")


def _fail(where: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"job config {where}={value!r}: {fix}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model: a named jaxpar model, or any NNX model through ``factory`` + ``loss``.

    ``name``: ``"llama"`` or ``"gpt"``; ``size``: a named size (``LlamaConfig.named``);
    ``fields``: config fields to change (``{layers: 4, attention: reference}``);
    ``factory``: ``"package.module:function"`` called as ``function(rngs)`` returning an
    ``nnx.Module``, with ``loss``: ``"package.module:function"`` called as ``loss(model, batch)``
    on batches of ``inputs``, ``targets`` and ``segment_ids`` (token ids, ``[batch, seq]``).
    """

    name: str = "llama"
    size: str = "tiny"
    fields: dict = dataclasses.field(default_factory=dict)
    factory: str | None = None
    loss: str | None = None

    def __post_init__(self):
        if (self.factory is None) != (self.loss is None):
            raise _fail("model.factory/loss", (self.factory, self.loss),
                        "give both 'package.module:factory' and 'package.module:loss', or neither")
        for key in ("factory", "loss"):
            value = getattr(self, key)
            if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
                raise _fail(f"model.{key}", value, "write it as 'package.module:function'")
        if self.factory is None and self.name not in ("llama", "gpt"):
            raise _fail("model.name", self.name, "choose 'llama' or 'gpt', or give model.factory and model.loss")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Token data: a store made by ``jaxpar data prepare`` (``path``; ``eval_path``: a held-out
    store for evaluation; ``tokenizer``: the one the job expects, checked against the store's), cut into ``seq_len`` sequences, ``batch`` of them per step (the global
    batch), ``packed`` with segment ids or ``padded`` (see `jaxpar.data.TokenLoader`).
    ``source: arithmetic`` trains on generated arithmetic text instead (the built-in example's
    data, vocabulary 16, no store; evaluation reads its held-out batches)."""

    source: str = "store"
    path: str | None = None
    eval_path: str | None = None
    tokenizer: str | None = None     # "byte" or a tokenizer.json: refused unless it made the store
    seq_len: int = 128
    batch: int = 16
    seed: int = 0
    packing: str = "packed"
    prefetch: int = 2

    def __post_init__(self):
        if self.source not in SOURCES:
            raise _fail("data.source", self.source, f"choose one of {SOURCES}")
        if self.source == "arithmetic":
            given = [k for k in ("path", "eval_path", "tokenizer") if getattr(self, k) is not None]
            if given:
                raise _fail(f"data.{given[0]}", getattr(self, given[0]), "data.source 'arithmetic' generates its "
                            "text and reads no store; drop it, or use data.source 'store'")
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch", self.batch)
        if self.packing not in PACKING:
            raise _fail("data.packing", self.packing, f"choose one of {PACKING}")
        if self.prefetch < 0:
            raise _fail("data.prefetch", self.prefetch, "use 0 (no background thread) or more batches")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """AdamW with a warmup then a ``cosine`` / ``linear`` decay (to ``lr * min_lr_ratio``) or a
    ``constant`` rate, global-norm clipping, and weight decay on matrices only (norm scales and
    biases, the 1-D parameters, are masked out)."""

    lr: float = 3e-3
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    decay_1d: bool = False
    clip_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self):
        for key, (what, interval, ok, example) in OPTIMIZER_RANGES.items():
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and ok(value)):
                raise _fail(f"optimizer.{key}", value, f"{what} must be a number in {interval}, e.g. {example}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise _fail("optimizer.warmup_steps", self.warmup_steps, "the warmup's length in steps must be an "
                        "integer >= 0 (0: no warmup), e.g. 20")
        if self.schedule not in SCHEDULES:
            raise _fail("optimizer.schedule", self.schedule, f"choose one of {SCHEDULES}")
        if not isinstance(self.decay_1d, bool):
            raise _fail("optimizer.decay_1d", self.decay_1d, "use true or false")
        if self.clip_norm is not None and not (isinstance(self.clip_norm, (int, float)) and not isinstance(
                self.clip_norm, bool) and math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise _fail("optimizer.clip_norm", self.clip_norm, "the global-norm clipping threshold must be a "
                        "number in (0, inf), e.g. 1.0, or null for no clipping")


# optimizer field -> (what it is, its range, the check of that range, a usual value)
OPTIMIZER_RANGES = {
    "lr": ("the peak learning rate", "(0, inf)", lambda v: v > 0, 3e-3),
    "min_lr_ratio": ("the fraction of lr the decay ends at", "[0, 1]", lambda v: 0 <= v <= 1, 0.1),
    "weight_decay": ("AdamW's weight decay", "[0, inf)", lambda v: v >= 0, 0.1),
    "b1": ("Adam's first-moment decay", "[0, 1)", lambda v: 0 <= v < 1, 0.9),   # at 1 a moment never moves
    "b2": ("Adam's second-moment decay", "[0, 1)", lambda v: 0 <= v < 1, 0.95),
    "eps": ("Adam's denominator epsilon", "(0, inf)", lambda v: v > 0, 1e-8),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
    """``steps``: optimizer steps; ``seed``: the model's init seed."""

    steps: int = 300
    seed: int = 0

    def __post_init__(self):
        _positive("train.steps", self.steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    dir: str | None = None
    every: int = 0
    keep: int | None = 3
    resume: str = "newest"
    local_dir: str | None = None     # the fast tier on node-local storage (jaxpar.CheckpointConfig.local_dir)
    local_every: int = 0
    peer: bool = True

    def __post_init__(self):
        if self.local_every < 0:
            raise _fail("checkpoint.local_every", self.local_every, "use 0 (no local tier) or a step count")
        if (self.local_dir is None) != (self.local_every == 0):
            what = ("checkpoint.local_every", self.local_every) if self.local_dir is None else ("checkpoint.local_dir",
                                                                                               self.local_dir)
            raise _fail(*what, "the local tier needs both checkpoint.local_dir (node-local storage, e.g. "
                        "/dev/shm/run1) and checkpoint.local_every (a step count); set both, or neither")
        if self.local_dir is not None and self.dir is None:
            raise _fail("checkpoint.local_dir", self.local_dir, "the local tier sits beside the persistent one; "
                        "set checkpoint.dir too")
        if self.every < 0:
            raise _fail("checkpoint.every", self.every, "use 0 (only at the end) or a step count")
        if self.keep is not None and self.keep < 1:
            raise _fail("checkpoint.keep", self.keep, "the number of newest steps to keep must be 1 or more, or "
                        "null to keep every step")
        if self.resume not in ("newest", "newest_intact"):
            raise _fail("checkpoint.resume", self.resume, "choose 'newest' or 'newest_intact'")
        if self.dir is None and self.every:
            raise _fail("checkpoint.every", self.every, "saving needs checkpoint.dir; set it, or drop every")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingSection:
    dir: str | None = None
    every: int = 10
    tensorboard: bool = False
    profile_steps: str | None = None
    peak_flops: float | None = None     # one device's peak FLOP/s for MFU (None: jaxpar.report.peak_flops)

    def __post_init__(self):
        _positive("logging.every", self.every)
        if self.peak_flops is not None and not (math.isfinite(self.peak_flops) and self.peak_flops > 0):
            raise _fail("logging.peak_flops", self.peak_flops, "one device's peak FLOP/s must be a number > 0, "
                        "e.g. 989e12 for an H100 SXM in bf16, or null for the datasheet table")
        if self.profile_steps is not None:
            from jaxpar.metrics.config import check_profile_steps

            try:
                check_profile_steps(self.profile_steps)
            except (TypeError, ValueError) as e:
                raise _fail("logging.profile_steps", self.profile_steps, str(e)) from None
        if self.dir is None and (self.tensorboard or self.profile_steps is not None):
            raise _fail("logging.dir", None, "tensorboard and profile_steps write under the run directory; set "
                        "logging.dir (or turn them off)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    every: int = 0
    steps: int = 4

    def __post_init__(self):
        if self.every < 0:
            raise _fail("eval.every", self.every, "use 0 (only at the end) or a step count")
        _positive("eval.steps", self.steps)


SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "optimizer": OptimizerSection, "parallel": ParallelConfig,
    "train": TrainSection, "checkpoint": CheckpointSection, "logging": LoggingSection, "eval": EvalSection,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The whole job (see the module docstring for the file layout)."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)

    def __post_init__(self):
        if self.eval.every and self.data.eval_path is None and self.data.source == "store":
            raise _fail("eval.every", self.eval.every, "evaluation reads data.eval_path; set it (a store made by "
                        "jaxpar data prepare from held-out text), or drop eval.every")
        if self.model.name == "gpt" and self.model.size != "tiny":
            raise _fail("model.size", self.model.size, "sizes name Llama models; the GPT takes model.fields")
        self._check_profile_window()

    def _check_profile_window(self) -> None:
        """The trace window must end inside the run (steps 1 to train.steps), as ``jaxpar train
        --profile-steps`` is checked against ``--steps``: refused before anything is built."""
        from jaxpar.metrics.config import check_profile_steps, profile_window_outside

        if self.logging.profile_steps is None:
            return
        start, stop = check_profile_steps(self.logging.profile_steps)
        inside = profile_window_outside((start, stop), 1, self.train.steps)
        if inside:
            raise _fail("logging.profile_steps", self.logging.profile_steps,
                        f"the window traces steps {start} to {stop - 1}, but the run ends at train.steps="
                        f"{self.train.steps}; choose a window inside it, e.g. --logging.profile_steps "
                        f"{inside[0]}:{inside[1]}, or give --train.steps {stop - 1} or more")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> "JobConfig":
        """Build from a parsed YAML mapping, then apply ``--section.field value`` overrides."""
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise TypeError(f"job config: the file holds a {type(d).__name__}, not a mapping of sections "
                            f"{sorted(SECTIONS)}")
        merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in d.items()}
        _unknown("", merged, SECTIONS)
        if isinstance(merged.get("parallel"), dict):    # a file saved before a field's rename
            merged["parallel"] = current_names(merged["parallel"])
        for key, raw in _pairs(overrides):
            section, _, field = key.partition(".")
            if not field:
                raise ValueError(f"override --{key}: write --section.field value, e.g. --optimizer.lr 3e-4")
            _unknown("", {section: None}, SECTIONS)
            field, _, sub = field.partition(".")      # --parallel.optimizer.level 3
            _unknown(f"{section}.", {field: None}, _fields(SECTIONS[section]))
            target = merged.setdefault(section, {})
            if not isinstance(target, dict):
                raise _fail(section, target, "a section is a mapping of fields")
            if sub:
                target = target.setdefault(field, {})
                if not isinstance(target, dict):
                    raise _fail(f"{section}.{field}", target, f"--{key} sets a field inside it: make it a mapping")
                field = sub
            target[field] = _yaml_scalar(raw)
        return cls(**{name: _section(name, SECTIONS[name], merged.get(name)) for name in SECTIONS})

    @classmethod
    def load(cls, path: str, overrides: Sequence[str] = ()) -> "JobConfig":
        """Read a YAML job file (see `from_dict`); an empty one (or one of comments only) is a
        ``ValueError``: it would train every default rather than what the file was meant to say."""
        from jaxpar.yaml_files import read_yaml

        d = read_yaml(path, _loader())
        if d is None:
            raise ValueError(f"job file {path!r} is empty (or holds only comments): it gives no section to run; "
                             f"write the job's sections in it (model:, data:, parallel:, train:, ...: see "
                             "docs/jobs.md), or leave --config out to run the built-in example")
        return cls.from_dict(d, overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `from_dict` reads back (what is printed and saved with checkpoints)."""
        out = {}
        for name in SECTIONS:
            value = getattr(self, name)
            out[name] = value.to_dict() if isinstance(value, ParallelConfig) else {
                k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()}
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _positive(where: str, value: int) -> None:
    if value < 1:
        raise _fail(where, value, "use a positive integer")


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(prefix: str, given: Mapping[str, Any], known: Mapping[str, Any]) -> None:
    for key in given:
        if key not in known and key in REMOVED_KEYS:
            raise ValueError(refusal(f"job config key '{prefix}{key}' (delete it)", REMOVED_KEYS[key]))
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ValueError(f"job config: unknown key '{prefix}{key}'; {hint}known keys: "
                             f"{', '.join(prefix + k for k in known)}")


def _section(name: str, cls, value: Any):
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise _fail(name, value, f"a section is a mapping of fields: {sorted(_fields(cls))}")
    fields = _fields(cls)
    _unknown(f"{name}.", value, fields)
    if cls is ParallelConfig:
        return ParallelConfig.from_dict(value)
    return cls(**{k: _typed(f"{name}.{k}", v, fields[k]) for k, v in value.items()})


def _typed(where: str, value: Any, hint: Any) -> Any:
    """``value`` checked against a field's annotation (ints accepted where floats are wanted)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option in (int, str, bool, dict) and isinstance(value, option) and not (
                option is int and isinstance(value, bool)):
            return value
    wanted = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise TypeError(f"job config {where}={value!r} is a {type(value).__name__}; it must be {wanted}")


def _yaml_scalar(raw: str) -> Any:
    import yaml

    from jaxpar.yaml_files import DuplicateKeyError

    try:
        return yaml.load(raw, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKeyError as e:
        raise ValueError(f"override value {raw!r} gives key {e.key!r} twice; keep one of them") from None
    except yaml.YAMLError:
        return raw


def _pairs(overrides: Sequence[str]):
    it = iter(overrides)
    for flag in it:
        if not flag.startswith("--"):
            raise ValueError(f"override {flag!r}: write --section.field value, e.g. --optimizer.lr 3e-4")
        key = flag[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            raw = next(it, None)
            if raw is None:
                raise ValueError(f"override {flag!r} needs a value")
        yield key.replace("-", "_"), raw
