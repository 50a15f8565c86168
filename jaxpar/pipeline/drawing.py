"""Pipeline schedules drawn: as text (``timeline``) and as Gantt charts (``plot_timeline``)."""
from __future__ import annotations

from typing import Iterable

from jaxpar.pipeline.table import Kind, Schedule, bubble_fraction, peak_activations

__all__ = ["timeline", "plot_timeline"]


def timeline(schedule: Schedule, *, wrap: int | None = None) -> str:
    """The schedule as text: one row per stage, one column per tick, ``.`` for idle.

    The header gives the bubble fraction and the peak activations per stage; ``wrap`` cuts
    the drawing into blocks of at most that many ticks.

    Example:
        >>> from jaxpar.pipeline import build
        >>> print(timeline(build("gpipe", 2, 2)))
        gpipe  p=2 m=2 v=1  ticks=9  bubble=1/3  peak activations per stage=[2, 2]
        tick    0  1  2  3  4  5  6  7  8
        stage0 F0 F1  .  .  . B0 B0 B1 B1
        stage1  . F0 F1 B0 B0 B1 B1  .  .
    """
    head = (f"{schedule.name}  p={schedule.stages} m={schedule.microbatches} "
            f"v={schedule.virtual_stages}  ticks={schedule.ticks}  "
            f"bubble={bubble_fraction(schedule)}  "
            f"peak activations per stage={peak_activations(schedule)}")
    return "\n".join([head] + grid(schedule, wrap))


def grid(schedule: Schedule, wrap: int | None = None) -> list[str]:
    v, n = schedule.virtual_stages, schedule.ticks
    labels = [[op.label(v) if op else "." for op in row] for row in schedule.table]
    width = max([len(str(n - 1))] + [len(x) for row in labels for x in row])
    name_w = len(f"stage{schedule.stages - 1}")
    step = wrap if wrap and wrap > 0 else max(n, 1)
    lines: list[str] = []
    for lo in range(0, n, step):
        ticks = range(lo, min(n, lo + step))
        lines.append("tick".ljust(name_w) + " " + " ".join(str(t).rjust(width) for t in ticks))
        for s in range(schedule.stages):
            cells = " ".join(labels[t][s].rjust(width) for t in ticks)
            lines.append(f"stage{s}".ljust(name_w) + " " + cells)
    return lines


_COLORS = {Kind.F: "#4c78a8", Kind.B: "#f58518", Kind.W: "#54a24b"}


def plot_timeline(schedule: Schedule | Iterable[Schedule], path: str) -> None:
    """Draw one or more schedules as Gantt charts (time × stages) into ``path`` (PNG, SVG...).

    Time is in units of one full stage's forward (a tick of an interleaved schedule is
    ``1/v``), so schedules drawn together compare fairly. Needs matplotlib
    (``pip install jaxpar[plot]``).

    Example:
        >>> from jaxpar.pipeline import build
        >>> plot_timeline([build("1f1b", 4, 8), build("zb-h1", 4, 8)], "/tmp/pipe.png")
    """
    from matplotlib.figure import Figure  # lazy: plotting is optional; no pyplot state

    schedules = [schedule] if isinstance(schedule, Schedule) else list(schedule)
    fig = Figure(figsize=(max(8, max(s.ticks for s in schedules) * 0.25),
                          1.2 + sum(0.45 * s.stages + 0.6 for s in schedules)))
    axes = fig.subplots(len(schedules), 1, squeeze=False)
    end = max(s.ticks / s.virtual_stages for s in schedules)
    for ax, s in zip(axes[:, 0], schedules):
        _draw(ax, s)
        ax.set_xlim(0, end)  # one time scale for all, so lengths compare
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _draw(ax, schedule: Schedule) -> None:
    # x in units of one full stage's forward, so interleaved ticks (1/v each) compare fairly.
    v = schedule.virtual_stages
    for s in range(schedule.stages):
        for t, op in schedule.ops(s):
            width = schedule.cost(op.kind) / v
            shade = 1.0 - 0.35 * op.chunk / max(1, v - 1)
            ax.broken_barh([(t / v, width)], (s - 0.4, 0.8),
                           facecolors=_COLORS[op.kind], alpha=shade, edgecolor="white")
            ax.text(t / v + width / 2, s, op.label(v), ha="center", va="center",
                    fontsize=6 if v == 1 else 4, color="white")
    ax.set_ylim(schedule.stages - 0.5, -0.5)
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel("time (one stage's forward = 1)")
    ax.set_title(f"{schedule.name}: p={schedule.stages} m={schedule.microbatches} v={v}, "
                 f"bubble {float(bubble_fraction(schedule)):.3f}, "
                 f"peak activations {peak_activations(schedule)}", fontsize=9)
