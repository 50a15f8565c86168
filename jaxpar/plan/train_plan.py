"""``TrainPlan``: every layout decision of a training job, as one value.

A plan is a pure function of (config, mesh sizes, abstract state, optimizer): the same inputs
always give the same plan. It holds, by parameter path, where each parameter is used
(compute specs), where it is stored (ZeRO-3), how its gradient is kept (ZeRO-2), where every
optimizer-state leaf and every non-parameter variable lives, and the techniques the step
applies (pipeline, recompute, accumulation, multi-copy, communication fusion). It
prints as a table, saves to JSON, loads back and diffs against another plan::

    >>> plan = make_train_plan(config, mesh, model, optax.adamw(1e-3))      # doctest: +SKIP
    >>> print(plan)                                  # path -> compute / stored spec, bytes
    >>> plan.to_json("plan.json"); TrainPlan.from_json("plan.json") == plan
    True
    >>> plan.diff(other_plan)                        # ["params/head: compute P(...) -> P(...)", ...]

Spec trees for ``jax.jit`` come from `TrainPlan.specs` (a section's specs laid out like a
given state tree, matched by path), so a loaded plan applies to any state with the same
paths.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig, to_plain, from_plain
from jaxpar.deprecation import OFFLOAD, RemovedAttribute, offload_removed, removed_keywords
from jaxpar.pipeline.schedules import build as _build_schedule
from jaxpar.data.layout import BatchLayout
from jaxpar.nn.specs import check_strategy_covers, is_variable, itemsize, path_str, state_specs
from jaxpar.optim.zero import ZeroSpecs, opt_state_specs, stacked_dim, zero_specs
from jaxpar.plan.checks import check_combination, check_plan_args
from jaxpar.precision import cast_floats
from jaxpar.strategy import mesh_sizes, spec_axes

SECTIONS = ("params", "stored", "grads", "update", "opt_state", "rest")
FORMAT = "jaxpar.train_plan/1"
_is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


def flat_paths(tree) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` of a state tree (NNX Variables count as leaves; ``value`` dropped)."""
    return [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]]


def _flat_specs(specs) -> dict[str, PartitionSpec]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: _is_spec(x) or is_variable(x))[0]
    out = {}
    for p, s in flat:
        out[path_str(p)] = s.get_value() if is_variable(s) else s
    return out


@removed_keywords("TrainPlan", {"offload": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Where every array of a training job lives and how the step is built (see module doc).

    Attributes:
      config: the ``ParallelConfig`` the plan realises (for a searched plan: the search's
        result as a ``mode="semi_auto"`` config).
      mesh: mesh axis name -> size.
      source: ``"given"`` (the config's strategies) or ``"searched:<algorithm>"``.
      params: path -> ``PartitionSpec`` where each parameter is used (compute layout).
      stored: path -> where each parameter is stored between steps (differs at ZeRO-3).
      grads: path -> where each gradient is kept before the update (differs from ZeRO-2).
      update: path -> where the optimizer update of each parameter runs (differs from
        ZeRO-1: gradients are reduced to these shards and parameter-shaped optimizer state
        lives there).
      opt_state: optimizer-state leaf path -> ``PartitionSpec``.
      rest: path -> ``PartitionSpec`` of every non-parameter variable (RNG state, statistics).
      zero_axes: the mesh axes ZeRO shards over (``()`` at level 0).
      unsharded: parameters above the ZeRO threshold that no dimension could take.
      shapes: path -> (shape, dtype) of every parameter, for the table and byte counts.
    """

    config: ParallelConfig
    mesh: Mapping[str, int]
    source: str
    params: Mapping[str, PartitionSpec]
    stored: Mapping[str, PartitionSpec]
    grads: Mapping[str, PartitionSpec]
    update: Mapping[str, PartitionSpec]
    opt_state: Mapping[str, PartitionSpec]
    rest: Mapping[str, PartitionSpec]
    zero_axes: tuple[str, ...] = ()
    unsharded: tuple[str, ...] = ()
    shapes: Mapping[str, tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=dict)
    offload = RemovedAttribute(OFFLOAD)     # a field of 0.1.0: host offload was removed

    # ----------------------------------------------------------------- techniques
    @property
    def loss_runs(self) -> str:
        """``"spmd"`` (one program under the compiler's propagation) or ``"per_device"``
        (the user's loss inside ``shard_map``: mode ``"hybrid"``)."""
        return "per_device" if self.config.mode == "hybrid" else "spmd"

    @property
    def pipeline(self):
        return self.config.pipeline

    @property
    def schedule(self):
        """The built pipeline schedule (`jaxpar.pipeline.Schedule`: the ticks, each stage's
        actions and where each chunk of layers lives), or None without a pipeline. Built once
        per pipeline setting; the step runs it and lays the stages out by it."""
        pipe = self.config.pipeline
        return None if pipe.stages == 1 else _schedule(pipe.schedule, pipe.stages, pipe.microbatches,
                                                       pipe.virtual_stages)

    @property
    def remat(self) -> str:
        return self.config.remat

    @property
    def grad_accum(self) -> int:
        return self.config.grad_accum

    @property
    def interleave(self) -> int:
        return self.config.interleave

    @property
    def precision(self):
        """The ``jaxpar.Precision`` the step applies, or ``None`` (dtypes as the model made them)."""
        return self.config.precision

    @property
    def zero_level(self) -> int:
        return self.config.optimizer.level

    @functools.cached_property
    def batch_layout(self) -> BatchLayout:
        """How batches lie on the mesh (`jaxpar.data.BatchLayout`: the batch axes, each leaf's
        spec, the parts a step and the pipeline cut a batch into, each process's rows), read
        once from the plan's config and mesh; the step and the pipeline run by it."""
        return BatchLayout.of(self.config, self.mesh)

    def batch_axes(self) -> tuple[str, ...]:
        return self.batch_layout.axes

    def batch_specs(self, batch, *, training: bool | None = None) -> Any:
        """``PartitionSpec`` per leaf of ``batch`` (arrays or shapes of the global batch);
        ``training``: what the batch is for (`jaxpar.data.BatchLayout.leaf_spec`: the rows it
        must have)."""
        return self.batch_layout.specs(batch, training=training)

    # ----------------------------------------------------------------- spec trees
    def specs(self, section: str | dict, like) -> Any:
        """The ``PartitionSpec`` tree of ``section`` laid out like the state tree ``like``.

        ``like``'s leaves (or NNX Variables) are matched to the plan by path; a path the
        plan does not know is an error naming it (the plan was made for another model).
        ``section`` may be a table of the plan's form (``{path: spec}``) made from its own.
        """
        table = section if isinstance(section, dict) else getattr(self, section)
        section = "specs" if isinstance(section, dict) else section

        def one(path, x):
            if is_variable(x) and not jax.tree.leaves(x):
                return x        # holds no array (optax.masked's MaskedNode for a masked-out parameter)
            key = path_str(path)
            if key not in table:
                known = list(table)[:4]
                raise ValueError(f"TrainPlan.{section} has no entry for {key!r} (it plans paths like {known}); "
                                 "make the plan from the same model and optimizer")
            spec = table[key]
            return x.replace(spec) if is_variable(x) else spec

        return jax.tree_util.tree_map_with_path(one, like, is_leaf=is_variable)

    def zero(self, params_like):
        """The ``jaxpar.optim.ZeroSpecs`` (spec trees like ``params_like``) of this plan."""
        tree = lambda section: self.specs(section, params_like)  # noqa: E731
        return ZeroSpecs(tree("params"), tree("stored"), tree("grads"), tree("update"), self.zero_axes, self.unsharded)

    def shardings(self, section: str, like, mesh) -> Any:
        """``NamedSharding`` tree of ``section``."""
        def one(s):
            return NamedSharding(mesh, s)

        return jax.tree.map(one, self.specs(section, like), is_leaf=_is_spec)

    # ----------------------------------------------------------------- show
    def rows(self) -> list[tuple[str, tuple[int, ...], str, PartitionSpec, PartitionSpec, int, int]]:
        """``(path, shape, dtype, compute spec, stored spec, bytes, stored bytes/device)`` per parameter."""
        out = []
        for path, spec in self.params.items():
            shape, dtype = self.shapes.get(path, ((), "float32"))
            nbytes = math.prod(shape) * itemsize(dtype)
            stored = self.stored[path]
            out.append((path, tuple(shape), dtype, spec, stored, nbytes, nbytes // _shards(stored, self.mesh)))
        return out

    def table(self, width: int = 140) -> str:
        """The plan as text: one row per parameter, then the techniques."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"train plan ({self.source}) on mesh {dict(self.mesh)}")
        for col in ("parameter", "shape", "compute spec", "stored spec", "bytes", "stored/device"):
            t.add_column(col, justify="right" if "bytes" in col or "device" in col else "left")
        total = per_dev = 0
        for path, shape, _, spec, stored, nbytes, dev in self.rows():
            t.add_row(path, str(shape), str(tuple(spec)), str(tuple(stored)) if stored != spec else "=",
                      f"{nbytes:,}", f"{dev:,}")
            total, per_dev = total + nbytes, per_dev + dev
        t.add_row("total", "", "", "", f"{total:,}", f"{per_dev:,}", style="bold")
        console = Console(record=True, width=width, file=io.StringIO())
        console.print(t)
        console.print(self.summary(), soft_wrap=True)     # one line, as summary() and diff() give it
        return console.export_text()

    def summary(self) -> str:
        c = self.config
        parts = [f"loss runs {self.loss_runs}", self.batch_layout.describe(),
                 f"ZeRO-{c.optimizer.level}" + (f" over {self.zero_axes}" if self.zero_axes else ""),
                 f"remat {c.remat}", f"grad_accum {c.grad_accum}", f"interleave {c.interleave}"]
        if c.pipeline.stages > 1:
            parts.append(f"pipeline {c.pipeline.schedule} stages={c.pipeline.stages} "
                         f"microbatches={c.pipeline.microbatches} virtual={c.pipeline.virtual_stages}")
        if c.comm_fusion is not None:
            parts.append(f"comm_fusion {c.comm_fusion.mode}")
        if c.precision is not None:
            parts.append(f"precision {c.precision.label}")
        if idle := self.idle_axes():
            parts.append(f"idle mesh axes {idle} (no rule, batch split or parameter uses them: unless the "
                         "model's own jaxpar.shard / jaxpar.ops strategies split over them, which a plan cannot see, "
                         "the devices along them repeat the same compute and memory)")
        return "; ".join(parts)

    def idle_axes(self) -> dict[str, int]:
        """Mesh axes (of size > 1) that nothing in the plan splits over: no rule names them, the
        batch is not split over them, no parameter, gradient, optimizer-state (ZeRO) or other
        variable spec uses them, and they are not the pipeline's stage axis or a context axis.
        The devices along such an axis repeat one another's compute and memory. Empty for a
        searched plan (the search assigns the axes) and in mode ``"hybrid"``, whose per-device
        loss may use any axis with its own collectives."""
        if self.config.mode == "hybrid" or self.source.startswith("searched"):
            return {}
        used = set(self.zero_axes) | self.batch_layout.split_axes()
        for section in SECTIONS:
            used.update(a for spec in getattr(self, section).values() for e in spec for a in spec_axes(e))
        for target in self.config.rules.values():
            used.update((target,) if isinstance(target, str) else target or ())
        c = self.config
        if c.pipeline.stages > 1:
            used.add(c.pipeline.axis)
        if c.context is not None:
            used.update(c.context.axes)
        return {a: n for a, n in self.mesh.items() if n > 1 and a not in used}

    def idle_axes_note(self, used: Iterable[str] = ()) -> str | None:
        """What the Trainer warns of when the plan has `idle_axes` besides the mesh axes ``used``
        (those its traced step split over: the model's own strategies, a row source), else None."""
        used = set(used)
        idle = {a: n for a, n in self.idle_axes().items() if a not in used}
        if not idle:
            return None
        names = ", ".join(f"{a!r} (size {n})" for a, n in idle.items())
        axis, size = next(iter(idle.items()))
        rest = {a: n for a, n in self.mesh.items() if a not in idle} or {"data": 1}
        smaller = f"a smaller mesh ({rest} on {math.prod(rest.values())} devices)"
        if self.config.mode == "data":     # every axis but the pipeline's (and context's) splits the batch
            fixes = (f"run pipeline stages over it (pipeline={{'stages': {size}, 'axis': {axis!r}}}), or use "
                     f"{smaller}")
        else:
            batch = self.batch_axes()
            if axis in batch:      # a batch axis, which dataset_strategy keeps the batch off
                how = f"dataset_strategy={self.config.dataset_strategy!r} keeps the batch off it: drop it"
            else:
                how = f"rules={{'batch': {(*batch, axis) if batch else axis!r}}} or a dataset_strategy"
            fixes = (f"map a logical axis to it (e.g. rules={{'mlp': {axis!r}}}), split the batch over it "
                     f"({how}), or use {smaller}")
        axes, is_are, it = ("mesh axis", "is", "it") if len(idle) == 1 else ("mesh axes", "are", "them")
        return (f"{axes} {names} of mesh {dict(self.mesh)} {is_are} idle: no rule, batch split, parameter, "
                f"optimizer-state (ZeRO) shard, pipeline stage or context axis uses {it}, nor does a jaxpar "
                f"strategy in the traced step (jaxpar.shard, jaxpar.ops, Layout, LogicalConstraint) or the row "
                f"source, so the {size} devices along {axis!r} repeat the same compute and hold the same memory. "
                f"To use it, {fixes}")

    def __str__(self) -> str:
        return self.table()

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        spec = lambda s: to_plain(s)["PartitionSpec"]  # noqa: E731
        return {
            "format": FORMAT, "config": self.config.to_dict(), "mesh": dict(self.mesh), "source": self.source,
            **{section: {p: spec(s) for p, s in getattr(self, section).items()} for section in SECTIONS},
            "zero_axes": list(self.zero_axes), "unsharded": list(self.unsharded),
            "shapes": {p: [list(shape), dtype] for p, (shape, dtype) in self.shapes.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainPlan":
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise ValueError(f"not a jaxpar train plan (format {getattr(d, 'get', lambda k: None)('format')!r}; "
                             f"expected {FORMAT!r})")
        if d.get("offload"):     # a plan file saved before host offload was removed ([] there: read on)
            raise offload_removed(f"train plan with offload={list(d['offload'])}")
        spec = lambda entries: from_plain({"PartitionSpec": entries})  # noqa: E731
        return cls(
            config=ParallelConfig.from_saved(d["config"]), mesh=dict(d["mesh"]), source=d["source"],
            **{section: {p: spec(e) for p, e in d[section].items()} for section in SECTIONS},
            zero_axes=tuple(d.get("zero_axes", ())), unsharded=tuple(d.get("unsharded", ())),
            shapes={p: (tuple(shape), dtype) for p, (shape, dtype) in d.get("shapes", {}).items()},
        )

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "TrainPlan":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def diff(self, other: "TrainPlan") -> list[str]:
        """One line per difference: mesh, techniques, then every spec that changed, by path."""
        out = []
        if dict(self.mesh) != dict(other.mesh):
            out.append(f"mesh: {dict(self.mesh)} -> {dict(other.mesh)}")
        if self.summary() != other.summary():
            out.append(f"techniques: {self.summary()} -> {other.summary()}")
        for section in SECTIONS:
            a, b = getattr(self, section), getattr(other, section)
            for path in sorted(set(a) | set(b)):
                if a.get(path) != b.get(path):
                    out.append(f"{section}/{path}: {_show(a.get(path))} -> {_show(b.get(path))}")
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainPlan) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))


class IdleAxisWarning(UserWarning):
    """A mesh axis of the Trainer's plan that nothing splits over (`TrainPlan.idle_axes`)."""


def _show(spec) -> str:
    return "absent" if spec is None else str(tuple(spec))


def _shards(spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for e in spec for a in spec_axes(e))


def _abstract(x):
    value = x.get_value() if is_variable(x) else x
    return jax.ShapeDtypeStruct(np.shape(value), value.dtype)


@removed_keywords("make_train_plan", {"offload": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
def make_train_plan(config: ParallelConfig, mesh, model_or_state, tx: optax.GradientTransformation, *,
                    source: str = "given", loss_fn: Any = None, rows: Any = None,
                    example_batch: Any = None) -> TrainPlan:
    """The `TrainPlan` of ``config`` on ``mesh`` for a model and optimizer.

    Args:
      config: the ``ParallelConfig`` (``mode="auto"`` needs a search first: see
        ``jaxpar.auto.plan_training``).
      mesh: a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``: only sizes are read.
      model_or_state: an NNX module (abstract ones from ``nnx.eval_shape`` work) or its
        ``(params, rest)`` states.
      tx: the optax optimizer (its state's layout follows the parameters').
      source: recorded as the plan's origin.
      loss_fn: the loss to train with, when known: a combination the Trainer would refuse
        for it (e.g. a pipeline without a ``PipelineLoss``) is refused here too
        (`check_combination`, which also runs on the model and, for a ``Mesh``, its backend).
      rows: the row source the Trainer will pull embedding rows through (``Trainer(rows=...)``),
        when there is one: what it cannot train with is refused here too.
      example_batch: one global batch (arrays or ``jax.ShapeDtypeStruct`` leaves), when known:
        with ``loss_fn``, rules nothing consults are refused here as the first step would
        refuse them (an abstract trace of the loss; only shapes are read).

    >>> plan = make_train_plan(config, {"data": 8}, nnx.eval_shape(make_model), optax.adamw(1e-3))  # doctest: +SKIP
    """
    check_plan_args(config, mesh, model_or_state, tx)
    if config.mode == "auto":
        raise ValueError("make_train_plan: mode='auto' has no strategies to plan yet; search first with "
                         "jaxpar.auto.plan_training(model, loss_fn, batch, config, mesh, tx)")
    platform = mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else None
    check_combination(config, model_or_state if isinstance(model_or_state, nnx.Module) else None, loss_fn,
                      mesh=mesh, platform=platform, rows=rows, batch=example_batch)
    sizes = mesh_sizes(mesh)
    if isinstance(model_or_state, nnx.Module):
        _, params, rest = nnx.split(model_or_state, nnx.Param, ...)
    else:
        params, rest = model_or_state
    param_specs = state_specs(config, sizes, params, check_unused=False)
    rest_specs = state_specs(config, sizes, rest, check_unused=False)
    check_strategy_covers(config, params, rest)
    abstract = jax.tree.map(_abstract, params, is_leaf=is_variable)
    if config.precision is not None:     # the plan's shapes and bytes are those of the stored dtype
        abstract = cast_floats(abstract, config.precision.params)
    pure_specs = jax.tree.map(lambda v: v.get_value(), param_specs, is_leaf=is_variable)
    zero = zero_specs(config.optimizer, sizes, pure_specs, abstract,
                      stacked=jax.tree.map(stacked_dim, params, is_leaf=is_variable))
    opt = opt_state_specs(tx, zero.state, abstract)
    shapes = {p: (tuple(a.shape), str(a.dtype)) for p, a in flat_paths(abstract)}
    return TrainPlan(
        config=config, mesh=sizes, source=source,
        params=_flat_specs(pure_specs), stored=_flat_specs(zero.params), grads=_flat_specs(zero.grads),
        update=_flat_specs(zero.state),
        opt_state=_flat_specs(opt), rest=_flat_specs(rest_specs),
        zero_axes=tuple(zero.axes), unsharded=tuple(zero.unsharded), shapes=shapes,
    )


@functools.cache
def _schedule(name: str, stages: int, microbatches: int, virtual: int):
    return _build_schedule(name, stages, microbatches, virtual)
