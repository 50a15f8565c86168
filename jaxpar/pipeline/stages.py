"""Pipelining any model by module: layers assigned to stages by path pattern.

``PipelineLoss`` needs the repeated part as one stack of identical blocks. ``StagedLoss`` takes
a model that is not: its ``order`` names the modules applied one after another (``h =
module(h)``), and ``stages`` assigns each of them to a virtual stage by a regular expression on
its path, as MindSpore's ``Cell.pipeline_stage`` does, so stages may hold different numbers and
kinds of layers (3 + 5, say). The embedding runs on the first virtual stage, the head and the
loss on the last (as ``PipelineLoss`` with ``pipeline.embedding="first"``):

    >>> loss = StagedLoss(                                    # doctest: +SKIP
    ...     order=("layers",),                                # an nnx.List: "layers/0", "layers/1", ...
    ...     stages={r"layers/[0-2]": 0, r"layers/[3-7]": 1},  # 3 + 5 layers
    ...     embedding=lambda model: model.embed, embed_inputs=lambda e, batch: e(batch["inputs"]),
    ...     head=lambda model: model.head, head_loss=xent)

How a stage holds its layers: the parameters of each virtual stage's layers are raveled into
one flat vector, padded to the longest stage's, and the ``p·v`` vectors are stacked in stage
layout, so the executor's leading pipe axis carries stages of any shape; a stage's branch
cuts its vector back into its layers (static offsets) and runs them. The flat vectors are
built from the model's parameters inside the step (the gradient flows back to them through
the packing), so the parameters themselves stay stored where the plan puts them.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import ParallelConfig
from jaxpar.data.layout import BatchLayout
from jaxpar.pipeline.executor import pipeline_loss, to_stage_layout
from jaxpar.pipeline.rows import check_microbatch_rows, row_axes
from jaxpar.pipeline.schedules import build

__all__ = ["StagedLoss", "assign", "best_split", "module_paths", "named_modules", "stage_costs", "staged"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagedLoss:
    """A loss over ``embedding → modules in order → head``, the modules assigned to stages.

    Attributes:
      order: module paths applied one after another; a path naming a sequence (an
        ``nnx.List``) stands for its items ``path/0``, ``path/1``, ...
      stages: regular expression on a module path → virtual stage (``0 .. stages·v-1``); each
        module matches exactly one, and the stages follow ``order`` (non-decreasing).
      embedding, embed_inputs: ``embed_inputs(embedding(model), batch) -> h``.
      head, head_loss: ``head_loss(head(model), h, batch) -> scalar``.

    Called as ``loss(model, batch)`` it runs the model unpipelined: the one-device reference.

    Example:
        >>> loss = StagedLoss(order=("layers",), stages={r".*": 0}, embedding=lambda m: m.wte,
        ...                   embed_inputs=lambda w, b: w[...][b], head=lambda m: m.wte,
        ...                   head_loss=lambda w, h, b: (h @ w[...].T).mean())
        >>> loss.stages
        {'.*': 0}
    """

    order: Sequence[str]
    stages: Mapping[str, int]
    embedding: Callable[[nnx.Module], Any]
    embed_inputs: Callable[[Any, Any], jax.Array]
    head: Callable[[nnx.Module], Any]
    head_loss: Callable[[Any, jax.Array, Any], jax.Array]

    def __post_init__(self):
        if isinstance(self.order, str) or not self.order:
            raise TypeError(f"StagedLoss.order={self.order!r}: give a non-empty sequence of module paths, "
                            f"e.g. ('layers',)")
        for pattern, stage in self.stages.items():
            if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                raise ValueError(f"StagedLoss.stages[{pattern!r}]={stage!r}: use a virtual stage index >= 0")
            re.compile(pattern)
        object.__setattr__(self, "stages", dict(self.stages))

    def __call__(self, model: nnx.Module, batch: Any) -> jax.Array:
        h = self.embed_inputs(self.embedding(model), batch)
        for _, module in named_modules(model, self.order):
            h = module(h)
        return self.head_loss(self.head(model), h, batch)


def module_paths(model: nnx.Module, order: Sequence[str]) -> list[str]:
    """The paths ``order`` stands for, a sequence expanded to its items.

    Example:
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(3)])
        >>> module_paths(M(), ("layers",))
        ['layers/0', 'layers/1', 'layers/2']
    """
    return [path for path, _ in named_modules(model, order)]


def named_modules(model: nnx.Module, order: Sequence[str]) -> list[tuple[str, Any]]:
    """``(path, module)`` for each module ``order`` stands for (see ``module_paths``)."""
    out = []
    for path in order:
        node = _resolve(model, path)
        if isinstance(node, (nnx.List, list, tuple)):
            out += [(f"{path}/{i}", item) for i, item in enumerate(node)]
        else:
            out.append((path, node))
    return out


def _resolve(model, path: str):
    node = model
    for part in path.split("/"):
        try:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        except (AttributeError, IndexError, TypeError) as e:
            raise ValueError(f"StagedLoss.order: the model has no module at {path!r} ({part!r} not found in "
                             f"{type(node).__name__}); name modules by attribute path, e.g. 'layers' or "
                             f"'blocks/3'") from e
    return node


def assign(paths: Sequence[str], stages: Mapping[str, int], virtual: int) -> list[int]:
    """The virtual stage of each path; every stage ``0 .. virtual-1`` gets a run of modules in order.

    Example:
        >>> assign(["l/0", "l/1", "l/2"], {r"l/0": 0, r"l/[12]": 1}, 2)
        [0, 1, 1]
    """
    out = []
    for path in paths:
        hits = [(pattern, s) for pattern, s in stages.items() if re.fullmatch(pattern, path)]
        if len(hits) != 1:
            raise ValueError(f"StagedLoss.stages: module {path!r} matches {len(hits)} patterns "
                             f"{[h[0] for h in hits]} of {list(stages)}; make every module match exactly one")
        out.append(hits[0][1])
    if out != sorted(out) or sorted(set(out)) != list(range(virtual)):
        raise ValueError(
            f"StagedLoss.stages puts the modules {list(paths)} on virtual stages {out}: they must run "
            f"0, 1, ..., {virtual - 1} in order, each stage holding at least one module (the schedule has "
            f"{virtual} virtual stages: pipeline stages × chunks per stage)")
    return out


def _pack(parts: list[list[Any]], pv: int) -> tuple[jax.Array, list[list[tuple[int, tuple, int]]]]:
    """Parameter leaves per virtual stage → ``[pv, longest]`` flat vectors and their offsets."""
    dtypes = {leaf.dtype for leaves in parts for leaf in leaves}
    if len(dtypes) > 1:
        raise TypeError(f"StagedLoss: the staged modules' parameters have dtypes {sorted(map(str, dtypes))}; "
                        f"a stage packs them into one vector, so store them in one dtype")
    sizes = [sum(leaf.size for leaf in leaves) for leaves in parts]
    longest = max(sizes)
    flats, offsets = [], []
    for leaves in parts:
        flat = jnp.concatenate([leaf.reshape(-1) for leaf in leaves]) if leaves else jnp.zeros((0,))
        flats.append(jnp.pad(flat, (0, longest - flat.shape[0])))
        starts = [0, *itertools.accumulate(leaf.size for leaf in leaves)][:len(leaves)]
        offsets.append([(s, leaf.shape, leaf.size) for s, leaf in zip(starts, leaves)])
    return jnp.stack(flats), offsets


def _stage_program(graphs: list[list[tuple[Any, Any, Any]]], offsets) -> list[Callable]:
    """Per virtual stage: ``(flat vector, h) -> h`` running its modules."""
    def one(stage_graphs, stage_offsets):
        def run(flat, h):
            leaves = [flat[s:s + n].reshape(shape) for s, shape, n in stage_offsets]
            for graphdef, treedef, count, rest in stage_graphs:
                mine, leaves = leaves[:count], leaves[count:]
                h = nnx.merge(graphdef, jax.tree.unflatten(treedef, mine), rest)(h)
            return h
        return run

    return [one(g, o) for g, o in zip(graphs, offsets)]


def staged(loss: StagedLoss, config: ParallelConfig, mesh, *, specs: nnx.Module | None = None,
           layout: BatchLayout | None = None) -> Callable[[nnx.Module, Any], jax.Array]:
    """The pipelined ``loss_fn(model, batch)`` of a ``StagedLoss`` for ``config.pipeline`` on ``mesh``.

    ``specs`` and ``layout`` as for ``jaxpar.pipeline.pipelined``; the stages' vectors, the head and the
    embedding run whole over the other mesh axes inside the stage branches.
    """
    pipe = config.pipeline
    schedule = build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages)
    p, v = pipe.stages, schedule.virtual_stages
    layout = BatchLayout.of(config, mesh) if layout is None else layout

    def staged_loss(model: nnx.Module, batch: Any) -> jax.Array:
        row_split = row_axes(layout, batch)
        check_microbatch_rows(layout, jax.tree.leaves(batch)[0].shape[0], row_split)
        pins = None if specs is None else _pins(loss, specs, row_split)
        modules = named_modules(model, loss.order)
        where = assign([path for path, _ in modules], loss.stages, p * v)
        graphs, parts = [[] for _ in range(p * v)], [[] for _ in range(p * v)]
        for (path, module), k in zip(modules, where):
            graphdef, params, rest = nnx.split(module, nnx.Param, ...)
            if jax.tree.leaves(rest):
                raise ValueError(f"StagedLoss: module {path!r} has state other than parameters "
                                 f"({type(rest).__name__}); staged modules may hold nnx.Param only")
            leaves, treedef = jax.tree.flatten(params)
            graphs[k].append((graphdef, treedef, len(leaves), rest))
            parts[k] += leaves
        flat, offsets = _pack(parts, p * v)
        programs = _stage_program(graphs, offsets)
        ids = to_stage_layout(jnp.arange(p * v, dtype=jnp.int32), p, v, schedule.placement)

        def stage_fn(chunk, h, k):
            return jax.lax.switch(k[0], programs, chunk[0], h)

        head_def, head_state = nnx.split(loss.head(model))
        embed_def, embed_state = nnx.split(loss.embedding(model))
        embed_fn = lambda state, mb: loss.embed_inputs(nnx.merge(embed_def, state), mb)  # noqa: E731
        micro = layout.micro(batch)
        _check_shapes(programs, flat[0], embed_fn, embed_state, jax.tree.map(lambda a: a[0], micro), where)

        def head_fn(state, h, micro_batch):
            return loss.head_loss(nnx.merge(head_def, state), h, micro_batch)

        run = pipeline_loss(stage_fn, head_fn, schedule, mesh, axis=pipe.axis, specs=pins, with_consts=True,
                            embed_fn=embed_fn)
        return run(to_stage_layout(flat, p, v, schedule.placement), head_state, micro, micro, ids, embed_state)

    return staged_loss


def _check_shapes(programs, flat, embed_fn, embed_state, micro_batch, where) -> None:
    x = jax.eval_shape(embed_fn, embed_state, micro_batch)
    for k, program in enumerate(programs):
        y = jax.eval_shape(program, jax.ShapeDtypeStruct(flat.shape, flat.dtype), x)
        if (y.shape, y.dtype) != (x.shape, x.dtype):
            raise ValueError(
                f"StagedLoss: virtual stage {k} (modules {[i for i, s in enumerate(where) if s == k]} of the "
                f"order) maps the activation {x.shape} {x.dtype} to {y.shape} {y.dtype}; every stage boundary "
                f"carries one shape: move a shape change into the embedding or the head")


def _pins(loss: StagedLoss, specs: nnx.Module, axes: tuple[str, ...]):
    """``(chunk, head, activation, embedding)`` specs: whole over the other axes, the rows split
    over ``axes`` as the batch's are (`row_axes`)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    whole = lambda part: jax.tree.map(lambda s: P(), nnx.split(part)[1], is_leaf=is_spec)  # noqa: E731
    act = P(axes if len(axes) > 1 else axes[0] if axes else None)
    return P(), whole(loss.head(specs)), act, whole(loss.embedding(specs))


def stage_costs(costs: Sequence[float], where: Sequence[int], first: float = 0.0, last: float = 0.0) -> list[float]:
    """Cost per virtual stage: its modules' plus the embedding's (first) and the head's (last).

    Example:
        >>> stage_costs([1, 2, 3], [0, 1, 1], first=0.5, last=1)
        [1.5, 6.0]
    """
    out = [0.0] * (max(where) + 1)
    for c, k in zip(costs, where):
        out[k] += c
    out[0] += first
    out[-1] += last
    return out


def best_split(costs: Sequence[float], virtual: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """The contiguous assignment of modules to ``virtual`` stages with the least maximal stage cost.

    Dynamic programming over split points; ties go to the earliest split.

    Example:
        >>> best_split([1, 1, 1, 5], 2)
        [0, 0, 0, 1]
    """
    n = len(costs)
    if not 1 <= virtual <= n:
        raise ValueError(f"cannot split {n} modules into {virtual} stages: need 1 <= stages <= modules")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j, k):   # modules i..j-1 on stage k
        return prefix[j] - prefix[i] + (first if k == 0 else 0.0) + (last if k == virtual - 1 else 0.0)

    best = {(0, 0): (0.0, ())}   # (modules placed, stages used) -> (max cost, cut points)
    for k in range(virtual):
        for i in range(n):
            if (i, k) not in best:
                continue
            worst, cuts = best[(i, k)]
            for j in range(i + 1, n - (virtual - k - 1) + 1):
                cand = (max(worst, cost(i, j, k)), cuts + (j,))
                if (j, k + 1) not in best or cand[0] < best[(j, k + 1)][0]:
                    best[(j, k + 1)] = cand
    cuts = (0,) + best[(n, virtual)][1]
    return [k for k in range(virtual) for _ in range(cuts[k + 1] - cuts[k])]

