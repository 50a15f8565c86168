"""Plain-text tables of a report, readable in a terminal and in a log file."""
from __future__ import annotations

import io
from collections.abc import Iterable

from rich import box
from rich.console import Console
from rich.table import Table

from jaxpar.report.collectives import Collective, collective_summary
from jaxpar.report.memory import MemoryReport


def format_collectives(cols: Iterable[Collective], *, width: int = 120) -> str:
    """A table of collectives, one row each, with a total.

    Columns: instruction name, kind, per-device result shape(s), bytes (see
    ``Collective.bytes``), groups as ``num_groups x group_size``, mesh axes (``?`` when
    unknown) and ``loop xN`` for an instruction that runs N times per call inside a loop.
    On a program of several hosts (two networks: `Collective.hosts_spanned`) two more:
    ``hosts`` (how many hosts a group spans: ``1`` stays inside a host) and ``inter-host``
    (the bytes a device moves between hosts, `Collective.inter_host_bytes`).

    Example:
      >>> print(format_collectives(collectives(compiled, mesh)))   # doctest: +SKIP
      collectives: 1
      +------------------------------------------------------------------------+
      | name       | kind       | shape    | bytes | groups | mesh axes | loop |
      |------------+------------+----------+-------+--------+-----------+------|
      | all-reduce | all-reduce | f32[8,8] | 256 B |    2x4 | model     |      |
      |------------+------------+----------+-------+--------+-----------+------|
      | total      |            |          | 256 B |        |           |      |
      +------------------------------------------------------------------------+
    """
    cols = list(cols)
    summary = collective_summary(cols)
    two = bool(cols) and summary["inter_host_bytes"] is not None and any((c.num_hosts or 1) > 1 for c in cols)
    title = f"collectives: {summary['count']}"
    if two:
        crossing = summary["crossing_hosts"]["count"]
        title += (f" ({crossing} {'crosses' if crossing == 1 else 'cross'} hosts: "
                  f"{format_bytes(summary['inter_host_bytes'])} between hosts, "
                  f"{format_bytes(summary['intra_host_bytes'])} inside)")
    table = Table(box=box.ASCII, title=title, title_justify="left")
    headers = [("name", "left"), ("kind", "left"), ("shape", "left"), ("bytes", "right"), ("groups", "right"),
               ("mesh axes", "left")] + ([("hosts", "right"), ("inter-host", "right")] if two else []) + [
               ("loop", "left")]
    for header, justify in headers:
        table.add_column(header, justify=justify, overflow="fold")
    for c in cols:
        hosts = [str(c.hosts_spanned), format_bytes(c.inter_host_bytes)] if two else []
        table.add_row(c.name, c.kind + (" (async)" if c.is_async else ""), _shapes(c),
                      format_bytes(c.bytes), f"{c.num_groups}x{c.group_size}",
                      _axes(c.mesh_axes), *hosts, _loop(c))
    table.add_section()
    total = ["", format_bytes(summary["inter_host_bytes"])] if two else []
    table.add_row("total", "", "", format_bytes(summary["bytes"]), "", "", *total,
                  f"{summary['in_loop']['count']} in loops" if summary["in_loop"]["count"] else "")
    return _render(table, width)


def format_memory(m: MemoryReport, *, width: int = 80) -> str:
    """A table of a `MemoryReport`: one row per kind of buffer and the total.

    Example:
      >>> print(format_memory(memory(compiled)))                   # doctest: +SKIP
      per-device memory
      +-----------------------------------+
      | buffer         |    bytes | exact |
      |----------------+----------+-------|
      | arguments      |    512 B |   512 |
      | outputs        |    256 B |   256 |
      | temporaries    |    256 B |   256 |
      | aliased (-)    |      0 B |     0 |
      |----------------+----------+-------|
      | total          | 1.00 KiB | 1,024 |
      | generated code |      0 B |     0 |
      +-----------------------------------+
    """
    if not isinstance(m, MemoryReport):
        raise TypeError(f"format_memory() expects a MemoryReport (from memory(compiled)), "
                        f"got {type(m).__name__}.")
    table = Table(box=box.ASCII, title="per-device memory", title_justify="left")
    table.add_column("buffer")
    table.add_column("bytes", justify="right")
    table.add_column("exact", justify="right")
    for label, value in (("arguments", m.argument_bytes), ("outputs", m.output_bytes),
                         ("temporaries", m.temp_bytes), ("aliased (-)", m.alias_bytes)):
        table.add_row(label, format_bytes(value), f"{value:,}")
    table.add_section()
    table.add_row("total", format_bytes(m.total), f"{m.total:,}")
    table.add_row("generated code", format_bytes(m.generated_code_bytes),
                  f"{m.generated_code_bytes:,}")
    return _render(table, width)


def format_bytes(n: int) -> str:
    """``1536`` → ``"1.50 KiB"``; below 1 KiB the exact count, e.g. ``"256 B"``."""
    if abs(n) < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"


def _shapes(c: Collective) -> str:
    dims = [f"[{','.join(map(str, s))}]" for s in c.shapes]
    if "," in c.dtype:                      # a tuple of several element types
        return f"({c.dtype}) " + ", ".join(dims)
    parts = [c.dtype + d for d in dims]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _axes(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "?"
    return ",".join(axes) if axes else "-"


def _loop(c: Collective) -> str:
    if not c.in_loop:
        return ""
    return f"loop x{c.executions}" if c.executions is not None else "loop x?"


def _render(table: Table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None,
                      force_terminal=False, soft_wrap=False)
    console.print(table)
    # Rich pads lines to the console width; trailing blanks only clutter a log file.
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"
