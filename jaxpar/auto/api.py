"""``search``: (model, loss, batch shapes, config, mesh sizes, costs) → `Strategy`. Nothing compiles."""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import PartitionSpec

from jaxpar.auto.assign import batch_specs, from_specs, hand_axes, param_specs
from jaxpar.auto.cost import CostParams, evaluate, op_terms
from jaxpar.auto.graph import Graph, build_graph, compute_dtype
from jaxpar.auto.strategy import Strategy
from jaxpar.auto.search import SEARCHES, Problem
from jaxpar.data import leaf_spec
from jaxpar.deprecation import OFFLOAD, removed_keywords
from jaxpar.plan import make_train_plan
from jaxpar.strategy import mesh_sizes, to_partition_spec




def annotations(graph: Graph, config, sizes: Mapping[str, int], extra: Mapping[str, Any] | None = None):
    """``{path: PartitionSpec}`` the user fixed: ``config.parameter_strategy`` patterns,
    ``config.dataset_strategy`` (every batch leaf) and ``extra`` (path glob -> strategy)."""
    specs: dict[str, PartitionSpec] = {}
    by: dict[str, str] = {}
    for patterns in (config.parameter_strategy, extra or {}):
        for pattern, strategy in patterns.items():
            hits = [(p, t) for p, t in (*graph.params, *graph.batch) if fnmatch.fnmatchcase(p, pattern)]
            if not hits:
                raise ValueError(f"annotation {pattern!r} matches no parameter or batch leaf; paths look like "
                                 f"{[p for p, _ in graph.params[:3]]}")
            for p, t in hits:
                if p in by:     # as in jaxpar.nn.specs.resolve_spec: two patterns on one path are an error
                    raise ValueError(f"parameter {p!r} matches the annotations {by[p]!r} and {pattern!r}; make "
                                     "the patterns disjoint")
                by[p] = pattern
                specs[p] = to_partition_spec(strategy, sizes, graph.tensors[t].shape, rules=config.rules)
    if config.dataset_strategy is not None:
        for p, t in graph.batch:
            specs.setdefault(p, leaf_spec(config, sizes, graph.tensors[t].shape))
    return specs


def search(model, loss_fn: Callable, batch: Any, config, mesh, *, cost_params: CostParams | None = None,
           annotate: Mapping[str, Any] | None = None, memory_budget: float | None = None,
           graph: Graph | None = None, runs: float = 1) -> Strategy:
    """Search a strategy for training ``model`` with ``loss_fn`` on ``batch``-shaped batches.

    Args:
      model: a Flax NNX module (its values are not read; abstract models work).
      loss_fn: ``loss_fn(model, batch)`` → scalar loss or ``(loss, aux)``.
      batch: the global batch (arrays or ``jax.ShapeDtypeStruct``s).
      config: ``ParallelConfig``; ``config.search`` picks the algorithm (default
        ``"dynamic_programming"``); its ``parameter_strategy`` and ``dataset_strategy`` are
        annotations the search keeps.
      mesh: a ``Mesh`` or a mapping axis name -> size (simulated meshes of any size work).
      cost_params: machine numbers (`CostParams`); defaults when ``None``.
      annotate: more annotations, path glob → strategy (parameters or batch leaves).
      memory_budget: per-device bytes the predicted memory must fit.
      runs: how many times one step runs the graph of ``batch`` (its micro-batches, when
        ``batch`` is one micro-batch of the step: gradient accumulation, pipeline stages): the
        search weighs ``runs`` times its operators' FLOPs and activation collectives against
        the parameter-gradient collectives, which run once per step. The strategy's recorded
        cost stays that of one run of the graph.

    >>> plan = search(model, loss_fn, batch, ParallelConfig(mesh={"data": 2, "model": 4},
    ...               mode="auto", search="dynamic_programming"), mesh)     # doctest: +SKIP
    """
    t0 = time.perf_counter()
    sizes = mesh_sizes(mesh)
    params = cost_params or CostParams()
    params.check_axes(sizes, "search")
    algorithm = config.search or "dynamic_programming"
    graph = graph if graph is not None else build_graph(model, loss_fn, batch, compute_dtype=compute_dtype(config))
    if isinstance(runs, bool) or not isinstance(runs, (int, float)) or not (math.isfinite(runs) and runs >= 1):
        raise ValueError(f"search: runs={runs!r} must be a number >= 1, the times one step runs the graph of the "
                         f"batch given (1 for a whole step's batch; m for one of m micro-batches)")
    problem = Problem.make(graph, sizes, params, runs)
    fixed, sources, conflicts = from_specs(graph, annotations(graph, config, sizes, annotate), sizes)
    notes = list(getattr(graph, "notes", ())) + [f"annotation: class {graph.class_names[c]} -> {fixed[c] or 'whole'} (from {sources[c]})"
             for c in range(graph.num_classes) if fixed[c] is not None]
    run = SEARCHES[algorithm]
    kw = {"memory_budget": memory_budget}
    if algorithm == "sharding_propagation" or any(f is not None for f in fixed):
        axes = run(problem, list(fixed), **kw)
    else:
        axes = run(problem, None, **kw)
    for c, options in conflicts:
        tried = []
        for path, value in options:
            trial = list(fixed)
            trial[c] = value
            cand = run(problem, trial, **kw)
            tried.append((problem.total(cand), path, value, cand))
        tried.sort(key=lambda x: x[0])
        axes = tried[0][3]
        notes.append(f"conflict on class {graph.class_names[c]}: " + ", ".join(
            f"{p} wants {v or 'whole'} (step {t * 1e3:.4g} ms)" for t, p, v, _ in tried)
            + f" -> kept {tried[0][2] or 'whole'} (cheapest)")
    return make_strategy(graph, axes, sizes, params, algorithm, notes, time.perf_counter() - t0)


def make_strategy(graph: Graph, axes, sizes, params: CostParams, algorithm: str, notes=(), seconds: float = 0.0) -> Strategy:
    """The `Strategy` of one assignment (with its predicted cost and per-operator rows)."""
    cost = evaluate(graph, axes, sizes, params)
    pspecs = param_specs(graph, axes)
    rows = []
    for path, t in graph.params:
        tensor = graph.tensors[t]
        shards = math.prod(sizes[a] for c in tensor.classes if c >= 0 for a in axes[c])
        rows.append((path, tensor.shape, pspecs[path], tensor.nbytes // shards))
    return Strategy(algorithm, dict(sizes), tuple(rows), tuple(batch_specs(graph, axes).items()),
                tuple((n, z, tuple(axes[c])) for c, (n, z) in enumerate(zip(graph.class_names, graph.class_sizes))),
                cost.to_dict(), _operator_rows(graph, axes, sizes), tuple(notes), params.to_dict(), seconds)


def _operator_rows(graph: Graph, axes, sizes):
    from jaxpar.auto.assign import spec_of
    from jaxpar.auto.cost import analyse

    flags = analyse(graph)
    names = {t: p for p, t in graph.params}
    rows = []
    for i, op in enumerate(graph.ops):
        if op.prim not in ("dot_general", "ragged_dot_general", "gather", "conv_general_dilated"):
            continue
        flops, comms, _, _ = op_terms(graph, op, axes, sizes, flags)
        label = next((names[t] for t in op.ins if t in names), "")
        specs = ", ".join(str(tuple(spec_of(graph, t, axes))) for t in op.ins if t >= 0)
        rows.append((f"{op.prim}#{i} {label}".strip(), specs, flops / 1e9, int(round(sum(c[2] for c in comms)))))
    return tuple(rows)


def hand_strategy(model, loss_fn, batch, config, mesh, *, cost_params: CostParams | None = None,
              graph: Graph | None = None) -> Strategy:
    """The `Strategy` (and predicted cost) of a hand-written config, for comparison."""
    sizes = mesh_sizes(mesh)
    graph = graph if graph is not None else build_graph(model, loss_fn, batch, compute_dtype=compute_dtype(config))
    return make_strategy(graph, hand_axes(graph, config, sizes), sizes, cost_params or CostParams(), "hand")


@removed_keywords("plan_training", {"offload": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
def plan_training(model, loss_fn: Callable, batch: Any, config, mesh, tx, **search_options):
    """Search a strategy and return ``(TrainPlan, Strategy)``: the plan to train under, and the search's
    own record (its predicted cost, operators and notes).

    ``search_options`` go to `search` (``cost_params``, ``annotate``, ``memory_budget``).

    >>> train_plan, found = plan_training(model, loss_fn, batch, config, mesh, optax.adamw(1e-3))  # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, train_plan.config, mesh, plan=train_plan)      # doctest: +SKIP
    """
    found = search(model, loss_fn, batch, config, mesh, **search_options)
    train_plan = make_train_plan(found.to_config(config), mesh, model, tx, source=f"searched:{found.search}")
    return train_plan, found


# What a mode "auto" run without a plan is told (here and by the Trainer)
NO_BATCH = ("mode='auto' searches the strategies on a batch before training, and no batch was given: pass "
            "example_batch=<one global batch> (only its shapes are read) to jaxpar.auto.plan_for(model, tx, "
            "loss_fn, config, mesh, example_batch=batch), or searched=jaxpar.auto.Strategy.from_json(path), and give "
            "the Trainer plan= its result; the Trainer no longer searches at its first batch (see "
            "docs/parallel_modes.md and CHANGELOG.md)")


@removed_keywords("plan_for", {"offload": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
def plan_for(model, tx, loss_fn: Callable, config, mesh, *, example_batch: Any = None, searched: Any = None):
    """``(TrainPlan, search record)``: the plan to train ``model`` with ``tx`` and ``loss_fn`` under
    ``config`` on ``mesh``, made before the Trainer is built, and the strategy search's `Strategy`
    (``None`` when nothing was searched). Give both to the Trainer as ``plan=``.

    In mode ``"auto"`` the search runs on ``example_batch`` (a global batch: arrays or
    ``jax.ShapeDtypeStruct``s; only its shapes and dtypes are read), or ``searched`` — a search
    saved with ``.to_json`` and read with ``Strategy.from_json`` — is trained as it is. Other
    modes need neither (both are ignored): their plan is `jaxpar.make_train_plan`'s, which the
    Trainer makes itself when given none.

    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, auto_config, mesh,
    ...                          plan=jaxpar.auto.plan_for(model, tx, loss_fn, auto_config, mesh,
    ...                                                    example_batch=batch))        # doctest: +SKIP
    >>> trainer.searched.table()                                                        # doctest: +SKIP
    """
    if config.mode != "auto":
        return make_train_plan(config, mesh, model, tx, loss_fn=loss_fn), None
    if searched is not None:
        if not isinstance(searched, Strategy):
            raise TypeError(f"plan_for: searched must be a jaxpar.auto.Strategy (e.g. jaxpar.auto.Strategy.from_json(path)), "
                            f"got {type(searched).__name__}")
        return make_train_plan(searched.to_config(config), mesh, model, tx, loss_fn=loss_fn,
                               source=f"searched:{searched.search}"), searched
    if example_batch is None:
        raise ValueError(NO_BATCH)
    return plan_training(model, loss_fn, example_batch, config, mesh, tx)
