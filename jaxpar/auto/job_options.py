"""The job search's unpipelined options: ``[context ×] data × model`` meshes, micro-batches,
ZeRO levels, recompute policies and, for MoE models, the experts' placement.

`plain_options` enumerates and prices them (`jaxpar.auto.pricing.price` on the graph of one
micro-batch of the loss with each recompute policy on the model's blocks, corrected by
`jaxpar.auto.context` for a context axis and by `jaxpar.auto.experts` for MoE layers);
`option_config` turns the chosen one into the ``ParallelConfig`` (its ``remat`` included)
the dry run compiles and the user trains. Without a context axis and
without MoE layers both do exactly what the job search always did.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxpar.auto.context import attention_terms, check_sequence, context_cost, fold
from jaxpar.auto.cost import evaluate, flags_for
from jaxpar.auto.experts import experts_cost, moe_layers, pins, tokens_per_device
from jaxpar.auto.graph import build_graph, compute_dtype
from jaxpar.auto.pricing import micro_batch, price
from jaxpar.auto.search_space import JobSearchSpace


def plain_options(job, abstract, loss_of: Mapping[str, Callable], batch, base, shapes, space: JobSearchSpace, *,
                  params, strategies_of: Callable) -> list:
    """Every priced unpipelined `JobOption` (``job``: the JobOption class) of ``space``, for the
    abstract model ``abstract``; ``loss_of[policy]``: the loss with ``ParallelConfig.remat=policy``
    applied as the step applies it (`jaxpar.nn.blocks.remat_loss`);
    ``strategies_of(graph, loss_fn, batch, config, sizes, search_name, params, memory_budget, runs=k)``
    gives the searched strategies of one mesh (``runs``: the ``k`` micro-batches one step runs
    the graph for)."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    devices, strategies, out = space.devices, space.context_strategy, []
    moe = moe_layers(abstract)
    for policy in space.remat:
        loss_fn = loss_of[policy]
        for cp in space.context:
            seq = max(check_sequence(batch, cp, s) for s in strategies) if cp > 1 else 0
            for k in space.grad_accum:
                if rows % k:
                    continue
                part = micro_batch(batch, k) if k > 1 else batch
                graph = build_graph(abstract, loss_fn, fold(part, cp) if cp > 1 else part,
                                    compute_dtype=compute_dtype(base))
                flags = flags_for(graph, params)
                meshes = shapes if cp == 1 else [{"data": devices // cp // m, "model": m}
                                                 for m in range(1, devices // cp + 1) if (devices // cp) % m == 0]
                for shape in meshes:
                    d = shape.get("data", 1)
                    if (rows // k) % d:
                        continue
                    mesh = dict(shape) if cp == 1 else {"context": cp, **shape}
                    for ep in _expert_sizes(moe, d, cp):
                        option = Candidate(shape=shape, micro_batches=k, part=part, context=cp, seq=seq, experts=ep)
                        sizes = option.sizes
                        cfg = base if ep is None else _pinned(base, moe, ep)
                        # a step runs the graph of one micro-batch k times, its gradient collectives once
                        for strategy in strategies_of(graph, loss_fn, batch, cfg, sizes, space.search_name, params,
                                                      space.memory_budget, runs=k):
                            axes = [a for _, _, a in strategy.classes]
                            cost = evaluate(graph, axes, sizes, params, flags=flags)
                            for cost2, extra in _variants(cost, graph, axes, flags, option, strategies, moe, params,
                                                          space.moe_imbalance):
                                for z in space.zero_levels:
                                    if z and sizes.get("data", 1) == 1:
                                        continue
                                    t, a, tmp = price(graph, axes, sizes, params, zero=z, grad_accum=k,
                                                      threshold_kb=base.optimizer.threshold_kb, cost=cost2)
                                    if math.isfinite(t):
                                        out.append(job(mesh, k, z, strategy, t, a, tmp, remat=policy, **extra))
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One unpipelined job option before its strategy, context strategy and ZeRO level are
    chosen: the ``data x model`` mesh ``shape`` (the context axis apart), ``micro_batches`` a
    step (``part``: the abstract shapes of one), the ``context`` size with the ``seq``uence it
    splits (0 without a context axis), and the ``experts``' size (1: replicated, ``data``'s
    size: on ``data``; None without MoE layers).

    >>> Candidate(shape={"data": 2, "model": 2}, micro_batches=1, part=None, context=2, seq=64).sizes
    {'data': 4, 'model': 2}
    """

    shape: Mapping[str, int]
    micro_batches: int
    part: Any
    context: int = 1
    seq: int = 0
    experts: int | None = None

    @property
    def data(self) -> int:
        """The ``data`` axis's size (the context axis apart)."""
        return self.shape.get("data", 1)

    @property
    def sizes(self) -> dict[str, int]:
        """The axis sizes the search sees: the context axis folded into ``data``."""
        return dict(self.shape) if self.context == 1 else {**self.shape, "data": self.data * self.context}


def _expert_sizes(moe, d: int, cp: int = 1) -> list:
    """``[None]`` without MoE layers; else 1 (experts replicated) and ``d`` (on data) where it divides them.

    Beside a context axis only 1: the search sees data × context folded into one axis, so its
    ``"data"`` pins (widened to ``("data", "context")`` by `option_config`) would split the
    experts ``d · cp`` ways while the ``"expert": "data"`` rule dispatches over ``d``, an
    exchange priced for ``d`` plus weight gathers priced nowhere."""
    if not moe:
        return [None]
    if cp > 1:
        return [1]
    return [1] + ([d] if d > 1 and all(layer.experts % d == 0 for layer in moe) else [])


def _pinned(base, moe, ep: int):
    """``base`` whose parameter strategy places the expert weights (on ``data`` when ``ep > 1``)."""
    return dataclasses.replace(base, parameter_strategy={**base.parameter_strategy,
                                                         **pins(moe, "data" if ep > 1 else None)})


def _variants(cost, graph, axes, flags, option: Candidate, strategies, moe, params, imbalance):
    """``(cost, JobOption fields)`` of ``option`` for each context strategy (one without a context axis)."""
    cp, seq, ep, part, d = option.context, option.seq, option.experts, option.part, option.data
    sizes, tp = option.sizes, option.shape.get("model", 1)
    extra: dict[str, Any] = {}
    if moe:
        tokens = tokens_per_device(part, d, context=cp)
        cost, nbytes = experts_cost(cost, moe, tokens, ep, params, imbalance=imbalance)
        extra["experts"] = {"axis": "data", "size": ep, "bytes": int(nbytes)}
    if cp == 1:
        return [(cost, extra)]
    att = attention_terms(graph, axes, sizes, flags, seq // cp, params)
    if att is None:
        raise ValueError(f"search_job: context={cp}, but the model's loss has no attention over a sequence of "
                         f"{seq // cp} folded tokens (no value with two sequence dimensions); leave context=(1,)")
    rows = jax.tree.leaves(part)[0].shape[0] / d
    found = []
    for s in strategies:
        c, nbytes = context_cost(cost, att, s, cp, seq, rows, params, tp=tp)
        found.append((c, {**extra, "context": {"size": cp, "strategy": s, "bytes": int(nbytes)}}))
    return found


def _widen(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with ``data`` (the folded data × context axis of the search) as ``("data", "context")``."""
    def one(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if "data" not in names:
            return entry
        return tuple(a for n in names for a in (("data", "context") if n == "data" else (n,)))
    return PartitionSpec(*(one(e) for e in spec))


def option_config(option, base, search_name: str, zero, model_names: set[str] | None = None):
    """The semi-auto ``ParallelConfig`` of an unpipelined option, its recompute policy in ``remat``
    (which the Trainer applies to each block, as it was priced) (``zero``: its OptimizerConfig;
    ``model_names``: the logical names the model's parameters use, so that the head rules a
    context option adds are only those the model reads)."""
    from jaxpar.config import ContextConfig

    sizes = dict(option.strategy.mesh)
    cfg = option.strategy.to_config(dataclasses.replace(base, mesh=sizes, mode="auto", search=search_name, rules={},
                                                        grad_accum=option.grad_accum, optimizer=zero,
                                                        remat=option.remat))
    rules: dict[str, Any] = {}
    if option.experts and option.experts["size"] > 1:
        rules.update({"batch": "data", "expert": "data"})
    if not option.context:
        return dataclasses.replace(cfg, rules=rules) if rules else cfg
    rules.update({"batch": "data", "length": "context"})
    if option.mesh.get("model", 1) > 1:
        rules.update({n: "model" for n in ("heads", "kv_heads") if model_names is None or n in model_names})
    opt = dataclasses.replace(zero, axis=("data", "context")) if zero.level else zero
    return dataclasses.replace(cfg, mesh=dict(option.mesh), rules=rules, dataset_strategy=None, optimizer=opt,
                               parameter_strategy={p: _widen(s) for p, s in cfg.parameter_strategy.items()},
                               context=ContextConfig(strategy=option.context["strategy"]))


def needs_constraint(option) -> bool:
    """Whether the option's model must be built with the mesh's constraint (context or MoE)."""
    return bool(option.context or (option.experts and option.experts["size"] > 1))


def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` (by name or through ``**kwargs``)."""
    try:
        return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def with_constraint(builder: Callable, config) -> Callable:
    """``builder`` passed ``constrain=jaxpar.nn.model_constraint(mesh, config)`` for the dry
    run's mesh (the first devices of ``jax.devices()``, as `jaxpar.train.compile_step` builds it)."""
    from jaxpar.mesh import make_mesh
    from jaxpar.nn import model_constraint

    if not takes_keyword(builder, "constrain"):
        raise TypeError("search_job: the chosen option has a context axis or places MoE experts, so model_fn must take "
                        "a constrain= keyword (the activation constraint, e.g. lambda constrain=None: "
                        "Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain or no_constraint)); or leave context=(1,)")
    n = math.prod(config.mesh.values())
    if len(jax.devices()) < n:
        return builder
    mesh = make_mesh(config, devices=jax.devices()[:n])
    return functools.partial(builder, constrain=model_constraint(mesh, config))

