"""``jaxpar goodput RUN_DIR``: where a run's wall time went, across its restarts
(`jaxpar.metrics.goodput`): a table of the causes, goodput, the effective MFU, and a plot."""

from __future__ import annotations

import argparse
import json
import os

from jaxpar.cli.common import UserError, check_writable


def add_parser(sub) -> None:
    p = sub.add_parser("goodput", help="where a run's wall time went: goodput, badput by cause, effective MFU",
                       description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's metrics directory (holds goodput.jsonl)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="also draw the time by cause into this file (the 'plot' extra)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxpar.metrics.goodput import CAUSES, plot, summarize

    if not os.path.isdir(args.run_dir):
        raise UserError(f"RUN_DIR {args.run_dir!r} is not a directory; give the run's metrics directory "
                        "(MetricsConfig(dir=...) or the job's logging.dir), which holds goodput.jsonl")
    if args.plot:
        check_writable("--plot", args.plot)       # before any work, not after it
    summary = summarize(args.run_dir)
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    wall = summary["wall_s"]
    table = Table(title=f"{args.run_dir}: {wall:.1f} s from the first start to the last record, "
                        f"{summary['restarts']} restart(s)")
    for column in ("cause", "seconds", "share"):
        table.add_column(column, justify="left" if column == "cause" else "right")
    for cause in CAUSES:
        seconds = summary["seconds"][cause]
        table.add_row(cause, f"{seconds:.2f}", f"{seconds / wall:.1%}" if wall > 0 else "n/a")
    console = Console()
    console.print(table)
    mfu = summary["mfu"]
    console.print(f"goodput {summary['goodput']:.1%}; "
                  + (f"MFU of the steady steps {mfu:.1%}, effective MFU {summary['effective_mfu']:.1%}"
                     if mfu is not None else "MFU n/a (metrics.jsonl has none: no peak FLOPs for this device)"))
    if summary["unreadable_lines"]:
        console.print(f"{summary['unreadable_lines']} unreadable ledger line(s) skipped (a line cut by a kill)")
    if args.plot:
        console.print(f"plot: {args.plot}")
    return 0
