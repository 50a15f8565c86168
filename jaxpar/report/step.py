"""One report for a compiled training step: memory, collectives, FLOPs and the parameter specs."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.nn.specs import SpecRow, format_specs, spec_rows
from jaxpar.report.collectives import Collective, collective_summary, collectives
from jaxpar.report.flops import flops
from jaxpar.report.memory import MemoryReport, memory
from jaxpar.report.table import format_collectives, format_memory


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one compiled step costs per device."""

    memory: MemoryReport
    collectives: list[Collective]
    flops: float
    params: list[SpecRow]

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        s = collective_summary(self.collectives)
        return {
            "memory": dataclasses.asdict(self.memory) | {"total": self.memory.total},
            "collectives": {"count": s["count"], "bytes": s["bytes"], "by_kind": s["by_kind"]},
            "flops_per_device": self.flops,
            "param_bytes": sum(r.bytes_total for r in self.params),
            "param_bytes_per_device": sum(r.bytes_per_device for r in self.params),
        }

    def format(self, *, detail: bool = True) -> str:
        """The plan, memory and collectives as text (``detail=False``: collectives summed by kind and axes)."""
        return "\n".join([format_specs(self.params), format_memory(self.memory),
                          format_collectives(self.collectives) if detail else self.collective_lines(),
                          f"FLOPs per device: {self.flops:,.0f}"])

    def collective_lines(self) -> str:
        groups: dict[tuple, list[int]] = {}
        for c in self.collectives:
            g = groups.setdefault((c.kind, c.mesh_axes), [0, 0])
            g[0] += 1
            g[1] += c.bytes
        lines = ["collectives per step (per device): kind, mesh axes, count, bytes"]
        for (kind, axes), (n, b) in sorted(groups.items(), key=lambda kv: str(kv[0])):
            lines.append(f"  {kind:<18} {str(axes):<22} {n:>4}  {b:>12,}")
        return "\n".join(lines)


def param_table(trainer) -> list[SpecRow]:
    """Rows parameter → strategy → bytes per device for a ``Trainer``'s parameters."""
    return spec_rows(trainer.params, trainer.param_specs, trainer.mesh)


def step_report(trainer, batch) -> StepReport:
    """Compile ``trainer``'s step for ``batch`` and read what it costs."""
    compiled = trainer.lower(batch).compile()
    return StepReport(memory(compiled), collectives(compiled, trainer.mesh), flops(compiled), param_table(trainer))
