"""`JobSearchSpace`: what `jaxpar.auto.search_job` may choose from, as one frozen value.

The device count and the memory budget bound the search; every other field lists the choices
it tries (meshes, ZeRO levels, micro-batch counts, recompute policies, pipeline stages and
schedules, context sizes and strategies). Every field is checked when the value is built, so a
wrong choice is refused before any model is traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxpar.auto.context import STRATEGIES as CONTEXT_STRATEGIES
from jaxpar.auto.search import SEARCHES
from jaxpar.config import REMAT_POLICIES, SCHEDULES
from jaxpar.deprecation import check_policy


def _is_count(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer)) and x >= 1


def _names(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _choices(name: str, value, example: str) -> tuple:
    """``value`` (a sequence of choices) as a tuple; one bare value is refused with the fix."""
    if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"JobSearchSpace: {name}={value!r} must be a sequence of choices, {example}")
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSearchSpace:
    """The choices `jaxpar.auto.search_job` searches over, for ``devices`` devices within
    ``memory_budget`` bytes per device.

    Attributes:
      devices: device count to search for (a dry run needs that many local devices).
      memory_budget: bytes per device.
      search_name: the strategy search run on each mesh (``"dynamic_programming"``, ...).
      meshes: ``data × model`` shapes to try without a pipeline (``None``: every shape of
        ``devices``; beside a pipe axis of ``p``, every shape of ``devices / p``).
      zero_levels: ZeRO levels to try.
      grad_accum: micro-batch counts to try without a pipeline (those that do not divide the
        batch are skipped).
      remat: recompute policies to try (`jaxpar.remat` names, one or several), each priced on
        the model's blocks as ``ParallelConfig.remat`` applies it (the chosen one is the
        config's ``remat``); pipelined options are priced without one, the pipeline's
        executor already recomputes each stage's forward (so with no 1 in
        ``pipeline_stages`` a policy other than ``"none"`` is refused: nothing would use it).
      pipeline_stages: stage counts to try (1: no pipeline).
      microbatches: the pipeline's micro-batch counts (``None``: ``p, 2p, 4p``).
      schedule: the pipeline schedule, or several to choose from (``"gpipe"``, ``"1f1b"``,
        ``"zb-h1"``, ``"interleaved"`` with two chunks per stage, ``"zb-v"``, ``"dualpipe-v"``);
        kept as a tuple.
      context: context-parallel sizes to try (1: none); a size ``cp > 1`` adds meshes
        ``context=cp × data × model`` priced by `jaxpar.auto.context`.
      context_strategy: the context attention(s) to price (``"ring"``, ``"ulysses"``,
        ``"all_gather"``; zigzag order); kept as a tuple.
      moe_imbalance: for models with `jaxpar.nn.MoE` layers, the routing imbalance the
        all-to-all buffers are priced for (1: balanced; `jaxpar.auto.experts`).

    >>> space = JobSearchSpace(devices=8, memory_budget=16e9, remat=("none", "full"),
    ...                        pipeline_stages=(1, 2), schedule=("1f1b", "zb-h1"))
    >>> space.schedule
    ('1f1b', 'zb-h1')
    """

    devices: int
    memory_budget: float
    search_name: str = "dynamic_programming"
    meshes: Sequence[Mapping[str, int]] | None = None
    zero_levels: Sequence[int] = (0, 1, 2, 3)
    grad_accum: Sequence[int] = (1, 2, 4)
    remat: Sequence[str] = ("none",)
    pipeline_stages: Sequence[int] = (1,)
    microbatches: Sequence[int] | None = None
    schedule: str | Sequence[str] = ("1f1b",)
    context: Sequence[int] = (1,)
    context_strategy: str | Sequence[str] = ("ring",)
    moe_imbalance: float = 1.0

    def __post_init__(self):
        # tuples, so the value reads and compares the same however it was given
        for name in ("zero_levels", "grad_accum", "pipeline_stages", "context", "microbatches"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _choices(name, getattr(self, name), "e.g. (1, 2)"))
        for name in ("remat", "schedule", "context_strategy"):      # one name, or several
            object.__setattr__(self, name, _names(getattr(self, name)))
        if self.meshes is not None:
            if isinstance(self.meshes, Mapping):
                raise TypeError(f"JobSearchSpace: meshes={self.meshes!r} is one mesh; give a list of them, "
                                f"e.g. meshes=[{dict(self.meshes)!r}]")
            meshes = _choices("meshes", self.meshes, "e.g. [{'data': 8}]")
            for m in meshes:
                if not isinstance(m, Mapping):
                    raise TypeError(f"JobSearchSpace: meshes has {m!r}; each mesh is a mapping of axis sizes, "
                                    "e.g. {'data': 4, 'model': 2}")
            object.__setattr__(self, "meshes", tuple(dict(m) for m in meshes))
        self._check()

    def _check(self) -> None:
        if not _is_count(self.devices):
            raise ValueError(f"JobSearchSpace: devices={self.devices!r} must be a positive device count")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, (int, float, np.number)) \
                or not self.memory_budget > 0:
            raise ValueError(f"JobSearchSpace: memory_budget={self.memory_budget!r} must be a positive number of "
                             "bytes per device")
        if self.search_name not in SEARCHES:
            raise ValueError(f"JobSearchSpace: search_name={self.search_name!r}; choose one of {tuple(SEARCHES)}")
        for name in ("zero_levels", "grad_accum", "remat", "pipeline_stages", "schedule", "context",
                     "context_strategy"):
            if not getattr(self, name):
                raise ValueError(f"JobSearchSpace: {name}=() is empty; give at least one choice")
        for z in self.zero_levels:
            if z not in (0, 1, 2, 3) or isinstance(z, bool):
                raise ValueError(f"JobSearchSpace: zero_levels has {z!r}; ZeRO levels are 0, 1, 2, 3")
        for name in ("grad_accum", "microbatches"):
            for k in getattr(self, name) or ():
                if not _is_count(k):
                    raise ValueError(f"JobSearchSpace: {name} has {k!r}; use positive micro-batch counts")
        for r in self.remat:
            check_policy(r, f"JobSearchSpace: remat has {r!r}")      # offload_dots: removed with host offload
            if r not in REMAT_POLICIES:
                raise ValueError(f"JobSearchSpace: remat has {r!r}; choose policies from {REMAT_POLICIES}")
        if 1 not in self.pipeline_stages and set(self.remat) != {"none"}:
            raise ValueError(f"JobSearchSpace: remat={tuple(self.remat)} with pipeline_stages="
                             f"{tuple(self.pipeline_stages)}: recompute policies are priced for options without a "
                             "pipeline only (a pipeline's executor recomputes each stage's forward itself), and "
                             "these stage counts leave none; add 1 to pipeline_stages or leave remat at ('none',)")
        for s in self.schedule:
            if s not in SCHEDULES:
                raise ValueError(f"JobSearchSpace: schedule has {s!r}; choose one or several of {SCHEDULES}")
        for name in ("pipeline_stages", "context"):
            for p in getattr(self, name):
                if not _is_count(p) or self.devices % p:
                    raise ValueError(f"JobSearchSpace: {name} has {p!r}; use positive divisors of "
                                     f"devices={self.devices}")
        for s in self.context_strategy:
            if s not in CONTEXT_STRATEGIES:
                raise ValueError(f"JobSearchSpace: context_strategy has {s!r}; choose from {CONTEXT_STRATEGIES}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float, np.number)) \
                or not self.moe_imbalance >= 1:
            raise ValueError(f"JobSearchSpace: moe_imbalance={self.moe_imbalance!r} must be >= 1 (the fullest "
                             "peer's rows over the balanced load)")
        for m in self.meshes or ():
            if math.prod(m.values()) != self.devices:
                raise ValueError(f"JobSearchSpace: meshes has {m}, {math.prod(m.values())} devices, not "
                                 f"devices={self.devices}; give data x model shapes whose product is {self.devices}")
