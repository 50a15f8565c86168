"""`Strategy`: what a search found, as a frozen value that prints, saves and becomes a config.

Its file (``to_json``) is tagged ``"format": "jaxpar.strategy/1"``; files saved before the class was
named `Strategy` carry ``"jaxpar.plan/1"`` and hold the same fields, so both load.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping
from typing import Any

from jax.sharding import PartitionSpec


FORMAT = "jaxpar.strategy/1"
OLD_FORMAT = "jaxpar.plan/1"   # files saved by `jaxpar.auto.Plan`: the same fields


def _spec_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_load(entries) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def glob_escape(path: str) -> str:
    """``path`` as a glob pattern that matches exactly that path."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in path)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy found by `jaxpar.auto.search`.

    Attributes:
      search: the algorithm (``"dynamic_programming"``, ...; ``"hand"`` for a config's own).
      mesh: mesh axis name -> size the strategy is for.
      params: ``(path, shape, PartitionSpec, bytes per device)`` per parameter.
      batch: ``(leaf path, PartitionSpec)`` per batch leaf.
      classes: ``(name, size, mesh axes)`` per dimension class of the graph.
      cost: the predicted `jaxpar.auto.cost.Cost`, as a dict.
      operators: ``(operator, input specs, GFLOP, comm bytes)`` of the matmuls and gathers (a
        gather's GFLOP: three times its largest operand's elements, the cost model's measure of it).
      notes: annotations, conflicts and how they were resolved, runners-up.
      cost_params: the `CostParams` used, as a dict.
      search_time_s: wall time of the search.

    >>> strategy = jaxpar.auto.search(model, loss_fn, batch, config, mesh)    # doctest: +SKIP
    >>> print(strategy.table()); strategy.to_json("strategy.json")            # doctest: +SKIP
    >>> trainer = jaxpar.Trainer(model, tx, loss_fn, strategy.to_config(config), mesh)  # doctest: +SKIP
    """

    search: str
    mesh: Mapping[str, int]
    params: tuple[tuple[str, tuple[int, ...], PartitionSpec, int], ...]
    batch: tuple[tuple[str, PartitionSpec], ...]
    classes: tuple[tuple[str, int, tuple[str, ...]], ...]
    cost: Mapping[str, Any]
    operators: tuple[tuple[str, str, float, int], ...] = ()
    notes: tuple[str, ...] = ()
    cost_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    search_time_s: float = 0.0

    # ----------------------------------------------------------------- use
    @property
    def param_specs(self) -> dict[str, PartitionSpec]:
        return {p: s for p, _, s, _ in self.params}

    def dataset_strategy(self) -> PartitionSpec | str:
        specs = {s for _, s in self.batch}
        if len(specs) != 1:
            # leaves split differently: keep the batch dimension's split (shared by every leaf)
            firsts = {tuple(s)[0] if len(tuple(s)) else None for _, s in self.batch}
            if len(firsts) != 1:
                raise ValueError(f"the strategy splits batch leaves differently ({self.batch}); "
                                 "ParallelConfig.dataset_strategy holds one strategy for every leaf")
            first = firsts.pop()
            return PartitionSpec(first) if first is not None else "full_batch"
        spec = specs.pop()
        return spec if len(tuple(spec)) else "full_batch"

    def to_config(self, config):
        """A ``mode="semi_auto"`` config whose ``parameter_strategy`` (exact paths) and
        ``dataset_strategy`` reproduce this strategy; every other field is kept."""
        specs = {glob_escape(p): s for p, _, s, _ in self.params}
        return dataclasses.replace(config, mode="semi_auto", mesh=dict(self.mesh),
                                   parameter_strategy=specs, dataset_strategy=self.dataset_strategy())

    # ----------------------------------------------------------------- show
    def table(self, *, operators: bool = True, width: int = 150) -> str:
        """The strategy as text: parameters → PartitionSpec → bytes, operators, predicted cost."""
        from rich.console import Console
        from rich.table import Table

        console = Console(record=True, width=width, file=io.StringIO())
        t = Table(title=f"strategy ({self.search}) on mesh {dict(self.mesh)}")
        for col in ("parameter", "shape", "PartitionSpec", "bytes/device"):
            t.add_column(col, justify="right" if "bytes" in col else "left")
        for path, shape, spec, nbytes in self.params:
            t.add_row(path, str(tuple(shape)), str(tuple(spec)), f"{nbytes:,}")
        for path, spec in self.batch:
            t.add_row(f"batch{path}", "", str(tuple(spec)), "")
        console.print(t)
        if operators and self.operators:
            o = Table(title="operators (matmuls and gathers)")
            for col in ("operator", "input specs", "GFLOP/device", "comm bytes"):
                o.add_column(col)
            for name, specs, gflop, comm in self.operators:
                o.add_row(name, specs, f"{gflop:.4g}", f"{comm:,}")
            console.print(o)
        c = self.cost
        by_axes = ", ".join(f"{k or '-'} {v:,}" for k, v in c["comm_by_axes"].items())
        console.print(f"predicted per device: compute {c['compute_s'] * 1e3:.4g} ms, communication "
                      f"{c['comm_s'] * 1e3:.4g} ms ({c['comm_bytes']:,} B{': ' + by_axes if by_axes else ''})"
                      f", step {c['time_s'] * 1e3:.4g} ms; memory: arguments {c['argument_bytes']:,} B "
                      f"(exact), temp ~{c['temp_bytes']:,} B; search {self.search_time_s:.3g} s")
        for note in self.notes:
            console.print(f"note: {note}")
        return console.export_text()

    def __str__(self) -> str:
        return self.table()

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "search": self.search, "mesh": dict(self.mesh),
            "params": [{"path": p, "shape": list(sh), "spec": _spec_json(s), "bytes_per_device": b}
                       for p, sh, s, b in self.params],
            "batch": [{"path": p, "spec": _spec_json(s)} for p, s in self.batch],
            "classes": [{"name": n, "size": z, "axes": list(a)} for n, z, a in self.classes],
            "cost": dict(self.cost), "operators": [list(o) for o in self.operators],
            "notes": list(self.notes), "cost_params": dict(self.cost_params),
            "search_time_s": self.search_time_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Strategy":
        if d.get("format") not in (FORMAT, OLD_FORMAT):
            raise ValueError(f"not a jaxpar strategy file (format {d.get('format')!r}; expected {FORMAT!r}, "
                             f"or {OLD_FORMAT!r} from before the class was named Strategy)")
        return cls(
            search=d["search"], mesh=dict(d["mesh"]),
            params=tuple((p["path"], tuple(p["shape"]), _spec_load(p["spec"]), p["bytes_per_device"])
                         for p in d["params"]),
            batch=tuple((b["path"], _spec_load(b["spec"])) for b in d["batch"]),
            classes=tuple((c["name"], c["size"], tuple(c["axes"])) for c in d["classes"]),
            cost=dict(d["cost"]), operators=tuple(tuple(o) for o in d.get("operators", ())),
            notes=tuple(d.get("notes", ())), cost_params=dict(d.get("cost_params", {})),
            search_time_s=float(d.get("search_time_s", 0.0)),
        )

    def to_json(self, path: str) -> None:
        """Save as a strategy file (JSON; keep it next to the checkpoints)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "Strategy":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def __eq__(self, other) -> bool:
        return isinstance(other, Strategy) and json.dumps(self.to_dict(), sort_keys=True, default=str) == \
            json.dumps(other.to_dict(), sort_keys=True, default=str)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))
