"""``ParallelConfig``: how to split the work, described once.

Small frozen keyword-only dataclasses, validated in ``__post_init__``. A bad value raises
``ValueError`` naming the field, the value and what would be valid. Configs load from a dict,
a YAML file, or command-line style overrides::

    >>> cfg = ParallelConfig(mesh={"data": 2, "model": 4}, rules={"mlp": "model"})
    >>> cfg.mesh
    {'data': 2, 'model': 4}
    >>> ParallelConfig.from_overrides(["--mesh", "data=2,model=-1", "--rules", "mlp=model"]).rules
    {'mlp': 'model'}
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from jaxpar.deprecation import RenamedAttribute, check_policy, renamed_keywords
from jaxpar.precision import Precision, as_precision
from jaxpar.strategy.layout import Layout, LayoutSpec

MODES = ("data", "semi_auto", "auto", "hybrid")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
SEARCHES = ("sharding_propagation", "dynamic_programming", "recursive_programming")
REMAT_POLICIES = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "dots_except_mlp",
    "dots_except_mlp_in",
    "nothing_saveable",
    "everything_saveable",
    "save_collectives",
    "everything_except_collectives",
)
FUSION_MODES = ("size", "auto")
CONTEXT_STRATEGIES = ("all_gather", "ring", "ulysses", "hybrid")
CONTEXT_ORDERS = ("contiguous", "zigzag", "striped")
OPTIMIZER_LEVELS = (0, 1, 2, 3)
# Former field name -> field: `ParallelConfig.from_dict` reads files saved before a rename.
RENAMED_FIELDS = {"parameter_plan": "parameter_strategy"}


def current_names(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` (a config as plain data) with the former names of renamed fields (`RENAMED_FIELDS`)
    replaced by the current ones; a ValueError when both names are given."""
    d = dict(d)
    for old, new in RENAMED_FIELDS.items():
        if old in d:
            if new in d:
                raise ValueError(f"ParallelConfig: both {old!r} and {new!r} are given ({old!r} is the former name "
                                 f"of {new!r}); keep only {new!r}")
            d[new] = d.pop(old)
    return d


def _fail(field: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"ParallelConfig.{field}={value!r} is invalid: {valid}")


def _check_axis_name(field: str, name: Any) -> None:
    if not isinstance(name, str) or not name or not name.isidentifier():
        raise _fail(field, name, "mesh axis names must be non-empty identifiers such as 'data'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer parallel (ZeRO) settings.

    Attributes:
      level: 0 = off; 1 = optimizer state sharded over ``axis``; 2 = gradients too;
        3 = parameters too (FSDP).
      threshold_kb: parameters smaller than this stay replicated.
      axis: the data-parallel mesh axis (or axes) the state is sharded over.
      shard_size: shard within groups of this many devices, replicate across groups.
    """

    level: int = 0
    threshold_kb: float = 64.0
    axis: str | tuple[str, ...] = "data"
    shard_size: int | None = None

    def __post_init__(self):
        if self.level not in OPTIMIZER_LEVELS:
            raise _fail("optimizer.level", self.level, f"choose one of {OPTIMIZER_LEVELS}")
        if not isinstance(self.threshold_kb, (int, float)) or self.threshold_kb < 0:
            raise _fail("optimizer.threshold_kb", self.threshold_kb, "use a number >= 0")
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if not isinstance(axes, tuple) or not axes:
            raise _fail("optimizer.axis", self.axis, "use a mesh axis name or a tuple of them")
        for a in axes:
            _check_axis_name("optimizer.axis", a)
        if self.shard_size is not None and (
            not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            raise _fail("optimizer.shard_size", self.shard_size, "use a positive int or None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommFusionConfig:
    """Fusion of gradient collectives into fewer, larger ones (MindSpore ``comm_fusion``).

    Attributes:
      mode: ``"size"``: buckets of ``bucket_mb``; ``"auto"``: the compiler's own choice
        (jit modes) / 64 MB buckets (``mode="hybrid"``).
      bucket_mb: bucket size in MB (2**20 bytes) for ``mode="size"``.

    Loads from ``None`` (off), ``"auto"``, or a dict ``{"mode": "size", "bucket_mb": 4}``.
    """

    mode: str = "size"
    bucket_mb: float = 64.0

    def __post_init__(self):
        if self.mode not in FUSION_MODES:
            raise _fail("comm_fusion.mode", self.mode, f"choose one of {FUSION_MODES}")
        if not isinstance(self.bucket_mb, (int, float)) or isinstance(self.bucket_mb, bool) or self.bucket_mb <= 0:
            raise _fail("comm_fusion.bucket_mb", self.bucket_mb, "use a number of MB > 0")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallel settings.

    Attributes:
      stages: number of pipeline stages (size of the ``axis`` mesh axis); 1 = off.
      microbatches: micro-batches per step.
      schedule: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"zb-v"``,
        ``"dualpipe-v"`` (the V schedules always run two chunks per stage).
      virtual_stages: model chunks per stage (interleaved schedule).
      axis: the mesh axis the stages live on.
      embedding: where a ``PipelineLoss``'s embedding runs: ``"outside"`` (before the
        pipeline, on every stage, all micro-batches at once: the default) or ``"first"`` (on
        the first virtual stage only, inside the schedule: only token ids enter the
        pipeline and one micro-batch's activation crosses a stage boundary per step).
    """

    stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str = "pipe"
    embedding: str = "outside"

    def __post_init__(self):
        for name in ("stages", "microbatches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _fail(f"pipeline.{name}", v, "use a positive int")
        if self.schedule not in SCHEDULES:
            raise _fail("pipeline.schedule", self.schedule, f"choose one of {SCHEDULES}")
        if self.embedding not in ("first", "outside"):
            raise _fail("pipeline.embedding", self.embedding, "choose 'first' or 'outside'")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise _fail(
                "pipeline.virtual_stages",
                self.virtual_stages,
                "virtual stages need schedule='interleaved'",
            )
        _check_axis_name("pipeline.axis", self.axis)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextConfig:
    """Context parallel: the sequence split over a mesh axis (see docs/context_parallel.md).

    Attributes:
      axis: the context mesh axis; for ``strategy="hybrid"`` a pair ``(ring_axis, ulysses_axis)``.
      strategy: attention across the axis: ``"all_gather"``, ``"ring"``, ``"ulysses"``, ``"hybrid"``.
      order: how batches are reordered when placed, for causal load balance:
        ``"zigzag"``, ``"striped"`` or ``"contiguous"`` (no reorder).
    """

    axis: str | tuple[str, ...] = "context"
    strategy: str = "ring"
    order: str = "zigzag"

    def __post_init__(self):
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if not isinstance(axes, tuple) or not axes:
            raise _fail("context.axis", self.axis, "use a mesh axis name, or (ring_axis, ulysses_axis) for 'hybrid'")
        for a in axes:
            _check_axis_name("context.axis", a)
        if self.strategy not in CONTEXT_STRATEGIES:
            raise _fail("context.strategy", self.strategy, f"choose one of {CONTEXT_STRATEGIES}")
        if (self.strategy == "hybrid") != (len(axes) == 2) or len(axes) > 2:
            raise _fail("context.axis", self.axis, "strategy 'hybrid' takes (ring_axis, ulysses_axis), the others "
                        "one axis name")
        if self.order not in CONTEXT_ORDERS:
            raise _fail("context.order", self.order, f"choose one of {CONTEXT_ORDERS}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The context mesh axes as a tuple."""
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)


def normalize_mesh(mesh: Any) -> dict[str, int]:
    if not isinstance(mesh, Mapping) or not mesh:
        raise _fail("mesh", mesh, "give a non-empty mapping of axis name -> size, e.g. {'data': -1}")
    out: dict[str, int] = {}
    for name, size in mesh.items():
        _check_axis_name("mesh", name)
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise _fail("mesh", dict(mesh), f"axis {name!r} has size {size!r}; use a positive int or -1")
        out[name] = size
    if sum(1 for s in out.values() if s == -1) > 1:
        raise _fail("mesh", out, "at most one axis may be -1 (the rest of the devices)")
    return out


def _normalize_hosts(hosts: Any, mesh: Mapping[str, int]) -> dict[str, int]:
    """``ParallelConfig.hosts`` checked against the mesh: known axes, positive int factors that
    divide the axis size (an axis of ``-1`` is checked when `jaxpar.make_mesh` resolves it);
    factors of 1 are dropped, so ``{"data": 1}`` is the one-network default."""
    if hosts is None:
        return {}
    if not isinstance(hosts, Mapping):
        raise _fail("hosts", hosts, "give a mapping mesh axis -> hosts it spans, e.g. {'data': 2}")
    out: dict[str, int] = {}
    for axis, n in hosts.items():
        if axis not in mesh:
            raise _fail("hosts", dict(hosts), f"axis {axis!r} is not in the mesh {dict(mesh)}; name mesh axes")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _fail("hosts", dict(hosts), f"axis {axis!r} spans {n!r} hosts; use a positive int")
        if mesh[axis] != -1 and mesh[axis] % n:
            raise _fail("hosts", dict(hosts), f"axis {axis!r} of size {mesh[axis]} cannot span {n} hosts ({n} "
                        f"does not divide {mesh[axis]}); use a divisor of {mesh[axis]}, or resize the axis")
        if n > 1:
            out[axis] = n
    return out


def _normalize_rules(rules: Any) -> dict[str, Any]:
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise _fail("rules", rules, "give a mapping logical name -> mesh axis, tuple of axes, or None")
    out: dict[str, Any] = {}
    for logical, target in rules.items():
        if not isinstance(logical, str):
            raise _fail("rules", dict(rules), f"logical axis name {logical!r} must be a str")
        if isinstance(target, list):
            target = tuple(target)
        if target is not None and not isinstance(target, (str, tuple)):
            raise _fail("rules", dict(rules), f"rule {logical!r} -> {target!r} must be str, tuple or None")
        if isinstance(target, tuple) and not all(isinstance(t, str) for t in target):
            raise _fail("rules", dict(rules), f"rule {logical!r} -> {target!r} must name mesh axes")
        out[logical] = target
    return out


def _sub(cls, value: Any, field: str):
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(value) - known
        if extra:
            raise _fail(field, dict(value), f"unknown keys {sorted(extra)}; known: {sorted(known)}")
        value = dict(value)
        if isinstance(value.get("axis"), list):
            value["axis"] = tuple(value["axis"])
        return cls(**value)
    raise _fail(field, value, f"give a dict or a {cls.__name__}")


@renamed_keywords("ParallelConfig", RENAMED_FIELDS)     # ParallelConfig(parameter_plan=...) warns, then reads as the field
@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How to parallelize one training job.

    Attributes:
      mesh: mesh axis name -> size; at most one ``-1`` (the rest of the devices).
      mode: ``"data"`` (replicate parameters, split the batch over every axis),
        ``"semi_auto"`` (user strategies + XLA propagation; the default), ``"auto"``
        (strategy search) or ``"hybrid"`` (the loss runs inside ``shard_map``).
      rules: logical axis name -> mesh axis, tuple of mesh axes, or None (replicated).
      parameter_strategy: parameter-path glob pattern -> strategy (any strategy form), for
        models whose code carries no annotations, e.g. ``{"*/mlp/up/kernel": (1, 4)}``
        (the parameters' counterpart of ``dataset_strategy``). ``from_dict`` also reads it
        under its former key ``"parameter_plan"``, as configs saved before the rename have it;
        the keyword and attribute ``parameter_plan`` still work, with a ``DeprecationWarning``.
      dataset_strategy: how batches are split. ``None``: dimension 0 over the batch axes
        (the ``"batch"`` rule, else the ``"data"`` axis, else every axis in mode
        ``"data"``); ``"full_batch"``: replicated; or one strategy (any form) for every
        leaf of the batch, e.g. ``(2, 1, 2, 2)`` to also split images over H/W.
      optimizer: optimizer parallel (ZeRO) settings, an ``OptimizerConfig`` or dict.
      grad_accum: micro-steps per optimizer update.
      pipeline: pipeline settings, a ``PipelineConfig`` or dict.
      remat: recompute policy name, applied to each of the model's blocks (see ``jaxpar.remat``).
      comm_fusion: fuse gradient collectives: ``None`` (off), ``"auto"`` or
        ``{"mode": "size", "bucket_mb": 4}`` (a ``CommFusionConfig``).
      interleave: multi-copy parallel (MindSpore ``MicroBatchInterleaved``): each step's
        batch runs as this many parts one after another, so one part's collectives can
        overlap the next part's compute. 1 = off.
      search: strategy search algorithm for ``mode="auto"``.
      precision: mixed precision: ``None`` (every array keeps the dtype the model gave
        it), a preset ``"fp32"`` / ``"bf16"`` / ``"bf16-pure"`` / ``"fp8"`` (bf16 with the
        model's projections as scaled fp8 matmuls; GPUs with fp8 matmuls only), a dict
        ``{"params", "compute", "reduce", "opt_state", "matmuls"}`` or a ``jaxpar.Precision``.
      context: context parallel (a ``ContextConfig`` or dict), or None (off).
      allow_unused_rules: keep rules that no parameter, activation constraint or batch
        consults (off: such a rule, e.g. a typo ``"mlpp"``, is an error when the step is
        traced). Turn on for a shared rule set applied to models that use part of it.
      hosts: two networks (MaxText's ``dcn_*`` parallelism): mesh axis name -> how many hosts
        that axis spans, e.g. ``{"data": 2}`` on 2 hosts of 4 devices with mesh
        ``{"data": 4, "model": 2}``: ``data`` is 2 hosts x 2 devices, ``model`` stays inside a
        host. The rest of each axis (``mesh[a] / hosts[a]``) stays inside a host, on its fast
        links; the factors multiply to the host count (``jax.process_count()``, or the
        slices of a multi-slice TPU job). Empty (the default): one network, the device order
        JAX's mesh utilities choose (`jaxpar.make_mesh`). See docs/startup.md, "Two networks".
    """

    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    mode: str = "semi_auto"
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parameter_strategy: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset_strategy: Any = None
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    grad_accum: int = 1
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    remat: str = "none"
    search: str | None = None
    comm_fusion: CommFusionConfig | None = None
    interleave: int = 1
    precision: Precision | None = None
    allow_unused_rules: bool = False
    context: ContextConfig | None = None
    hosts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    parameter_plan = RenamedAttribute("parameter_strategy")     # the former name, read with a DeprecationWarning

    def __post_init__(self):
        setf = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        setf("mesh", normalize_mesh(self.mesh))
        if self.mode not in MODES:
            raise _fail("mode", self.mode, f"choose one of {MODES}")
        setf("rules", _normalize_rules(self.rules))
        self._check_rule_axes()
        if not isinstance(self.parameter_strategy, Mapping):
            raise _fail("parameter_strategy", self.parameter_strategy, "give a mapping glob pattern -> strategy")
        setf("parameter_strategy", {str(k): from_plain(v) for k, v in self.parameter_strategy.items()})
        setf("dataset_strategy", from_plain(self.dataset_strategy))
        if isinstance(self.dataset_strategy, str) and self.dataset_strategy != "full_batch":
            raise _fail("dataset_strategy", self.dataset_strategy, "use None, 'full_batch' or a strategy")
        setf("optimizer", _sub(OptimizerConfig, self.optimizer, "optimizer"))
        setf("pipeline", _sub(PipelineConfig, self.pipeline, "pipeline"))
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise _fail("grad_accum", self.grad_accum, "use a positive int")
        check_policy(self.remat, f"ParallelConfig(remat={self.remat!r})")   # offload_dots: removed with offload
        if self.remat not in REMAT_POLICIES:
            raise _fail("remat", self.remat, f"choose one of {REMAT_POLICIES}")
        if self.comm_fusion is not None:
            fusion = CommFusionConfig(mode="auto") if self.comm_fusion == "auto" else self.comm_fusion
            if isinstance(fusion, str):
                raise _fail("comm_fusion", fusion, "use None, 'auto' or {'mode': 'size', 'bucket_mb': 4}")
            setf("comm_fusion", _sub(CommFusionConfig, fusion, "comm_fusion"))
        if not isinstance(self.interleave, int) or isinstance(self.interleave, bool) or self.interleave < 1:
            raise _fail("interleave", self.interleave, "use a positive int (1 = off)")
        try:
            setf("precision", as_precision(self.precision))
        except (ValueError, TypeError) as e:
            raise type(e)(f"ParallelConfig.precision: {e}") from None
        if not isinstance(self.allow_unused_rules, bool):
            raise _fail("allow_unused_rules", self.allow_unused_rules, "use True or False")
        if self.search is not None and self.search not in SEARCHES:
            raise _fail("search", self.search, f"choose one of {SEARCHES} or None")
        if self.mode == "data" and self.rules:
            raise _fail("rules", dict(self.rules), "mode='data' replicates every parameter; "
                        "drop the rules or use mode='semi_auto'")
        if self.context is not None:
            setf("context", _sub(ContextConfig, self.context, "context"))
            if missing := [a for a in self.context.axes if a not in self.mesh]:
                raise _fail("context.axis", self.context.axis,
                            f"mesh axes {missing} are not in the mesh {dict(self.mesh)}; add them to mesh")
        if self.pipeline.stages > 1 and self.pipeline.axis not in self.mesh:
            raise _fail("pipeline.stages", self.pipeline.stages,
                        f"pipeline needs a mesh axis {self.pipeline.axis!r}; mesh has {list(self.mesh)}")
        setf("hosts", _normalize_hosts(self.hosts, self.mesh))
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Pairs of features the config alone rules out, each refused naming both and what to use
        instead. (What depends on the model, the loss or the backend: `jaxpar.plan.check_combination`.)"""
        if self.pipeline.stages > 1 and self.mode == "hybrid":
            raise ValueError(
                "ParallelConfig: pipeline.stages > 1 with mode='hybrid' is not supported (the pipeline is "
                "itself a shard_map over the pipe axis); use mode='semi_auto' or 'data' with the pipeline")
        if self.pipeline.stages > 1 and self.mode == "auto":
            raise ValueError(
                "ParallelConfig: pipeline.stages > 1 with mode='auto' is not supported (the strategy search does "
                "not place pipeline stages); search the job with jaxpar.auto.search_job over a "
                "JobSearchSpace(pipeline_stages=...) and train its config, or use mode='semi_auto' with rules {'layers': 'pipe'}")
        if self.context is not None:
            self._check_batch_off_context()
        if self.context is not None and self.mode in ("hybrid", "auto"):
            why = ("per-device code sees one shard of the sequence and no context attention" if self.mode == "hybrid"
                   else "the strategy search does not place the sequence over a context axis")
            raise ValueError(f"ParallelConfig: context={self.context} with mode={self.mode!r} is not supported "
                             f"({why}); use mode='semi_auto' with the context axis (jaxpar.auto.search_job over a "
                             "JobSearchSpace(context=(1, 2, 4, 8)) finds one and returns such a config), or drop context")

    def _check_batch_off_context(self) -> None:
        """The batch and the sequence are two dimensions of every [B, S, ...] tensor: a mesh axis
        that splits the sequence (context parallel) cannot split the batch too."""
        context = self.context.axes
        if "batch" in self.rules:
            target = self.rules["batch"]
            shared = [a for a in ((target,) if isinstance(target, str) else target or ()) if a in context]
            setting = f"rules['batch']={target!r}"
        elif self.mode != "data" and self.dataset_strategy is None and "data" in context:
            shared, setting = ["data"], "the default batch axis 'data' (there is no 'batch' rule)"
        else:
            return
        if shared:
            others = [a for a in self.mesh if a not in context and a != self.pipeline.axis]
            fix = (f"put the batch on another axis (e.g. rules['batch']={others[0]!r})" if others
                   else "add a mesh axis for the batch and name it in rules['batch']")
            raise ValueError(
                f"ParallelConfig: {setting} splits the batch over mesh axis {shared[0]!r}, which "
                f"context.axis={self.context.axis!r} (strategy {self.context.strategy!r}) splits the sequence "
                f"over; one mesh axis cannot split both dimensions of a [batch, sequence] tensor: {fix}, "
                f"or context parallel on another axis")

    def _check_rule_axes(self) -> None:
        for logical, target in self.rules.items():
            targets = (target,) if isinstance(target, str) else (target or ())
            for axis in targets:
                if axis not in self.mesh:
                    raise _fail(
                        "rules",
                        dict(self.rules),
                        f"rule {logical!r} -> {target!r} names mesh axis {axis!r}, "
                        f"but the mesh axes are {list(self.mesh)}; add it to mesh or fix the rule",
                    )

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParallelConfig":
        """Build from a plain dict (e.g. parsed YAML or JSON). Keys a field had before it was
        renamed (`RENAMED_FIELDS`, e.g. ``"parameter_plan"``) are read as that field, so files
        saved earlier (checkpoint metadata, strategy files, job files) still load."""
        if not isinstance(d, Mapping):
            raise TypeError(f"ParallelConfig.from_dict expects a mapping, got {type(d).__name__}")
        d = current_names(d)
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown ParallelConfig fields {sorted(extra)}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_saved(cls, d: Mapping[str, Any]) -> "ParallelConfig":
        """`from_dict` for a config jaxpar saved (checkpoint metadata, strategy and plan files):
        a recompute policy removed since (``"offload_dots"``) is read as ``remat="full"`` with a
        warning, since it does not change where anything lives, so that the file still loads."""
        from jaxpar.deprecation import REMOVED_POLICIES

        if isinstance(d, Mapping) and isinstance(d.get("remat"), str) and d["remat"] in REMOVED_POLICIES:
            warnings.warn(f"the saved ParallelConfig has remat={d['remat']!r}, which was removed "
                          f"({REMOVED_POLICIES[d['remat']].instead}); read as remat='full' (recompute every block: "
                          "the least memory); give another remat= to train with it", UserWarning, stacklevel=2)
            d = {**d, "remat": "full"}
        return cls.from_dict(d)

    @classmethod
    def from_yaml(cls, path: str) -> "ParallelConfig":
        """Build from a YAML file whose top level holds the fields (a key given twice is a
        ``ValueError`` naming it and both lines: `jaxpar.yaml_files`)."""
        from jaxpar.yaml_files import read_yaml

        return cls.from_dict(read_yaml(path) or {})

    @classmethod
    def from_overrides(cls, args: Sequence[str], base: "ParallelConfig | None" = None) -> "ParallelConfig":
        """Apply ``--field value`` overrides (``--mesh data=2,model=4 --rules mlp=model``)."""
        d = (base or cls()).to_dict()
        it = iter(args)
        for flag in it:
            if not flag.startswith("--"):
                raise ValueError(f"override {flag!r} must look like '--field value'")
            key = flag[2:].replace("-", "_")
            if "=" in key and not key.startswith(("mesh", "rules", "hosts")):
                key, raw = key.split("=", 1)
            else:
                raw = next(it, None)
                if raw is None:
                    raise ValueError(f"override {flag!r} needs a value")
            top, dot, sub = key.partition(".")
            key = RENAMED_FIELDS.get(top, top) + dot + sub      # a field's former name, as from_dict reads it
            _apply_override(d, key, raw)
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-friendly dict that ``from_dict`` reads back."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else to_plain(v)
        return out


def from_plain(v: Any) -> Any:
    """YAML and JSON give lists; strategies are tuples. ``{"PartitionSpec": [...]}`` and
    ``{"Layout": {...}}`` (how `to_dict` writes those strategy forms) are read back."""
    if isinstance(v, list):
        return tuple(from_plain(x) for x in v)
    if isinstance(v, Mapping):
        if set(v) == {"PartitionSpec"}:
            return PartitionSpec(*(from_plain(e) for e in v["PartitionSpec"]))
        if set(v) == {"Layout"}:
            d = v["Layout"]
            layout = Layout(tuple(d["device_matrix"]), tuple(d["alias_name"]))
            return LayoutSpec(layout, tuple(tuple(e) for e in d["tensor_map"]))
        return {k: from_plain(x) for k, x in v.items()}
    return v


def to_plain(v: Any) -> Any:
    """JSON/YAML-friendly form of a config value (every strategy form included)."""
    if isinstance(v, PartitionSpec):
        return {"PartitionSpec": [to_plain(e) for e in v]}
    if isinstance(v, LayoutSpec):
        return {"Layout": {"device_matrix": list(v.layout.device_matrix),
                           "alias_name": list(v.layout.alias_name),
                           "tensor_map": [list(e) for e in v.tensor_map]}}
    if isinstance(v, Mapping):
        return {k: to_plain(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [to_plain(x) for x in v]
    return v


def _parse_scalar(raw: str) -> Any:
    import yaml

    return yaml.safe_load(raw)


def _parse_pairs(key: str, raw: str) -> dict[str, Any]:
    out = {}
    for item in filter(None, raw.split(",")):
        if "=" not in item:
            raise ValueError(f"--{key} {raw!r}: expected name=value pairs such as data=2,model=4")
        k, v = item.split("=", 1)
        if key == "rules" and "+" in v:
            out[k] = tuple(v.split("+"))
        else:
            out[k] = None if v in ("None", "none", "") else _parse_scalar(v)
    return out


def _apply_override(d: dict[str, Any], key: str, raw: str) -> None:
    if key in ("mesh", "rules", "hosts"):
        d[key] = _parse_pairs(key, raw)
    elif "." in key:
        top, sub = key.split(".", 1)
        if top == "context" and d.get(top) is None:
            d[top] = {}     # the optional section starts from its defaults
        if not isinstance(d.get(top), dict):
            raise ValueError(f"--{key}: {top!r} is not a config section")
        d[top][sub] = _parse_scalar(raw)
    elif key == "comm_fusion" and "=" in raw:
        d[key] = {**(d[key] or {}), **_parse_pairs(key, raw)}
    elif key == "precision" and "=" in raw:
        d[key] = {**(dataclasses.asdict(as_precision("fp32")) if d[key] is None else d[key]),
                  **_parse_pairs(key, raw)}
    elif key in ("optimizer", "pipeline"):
        d[key] = {**d[key], **_parse_pairs(key, raw)}
    else:
        d[key] = _parse_scalar(raw)
