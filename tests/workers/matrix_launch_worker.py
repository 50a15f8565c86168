"""Combination-matrix cells under ``jaxpar launch``: ``matrix_launch_worker.py --cells CELLS.json
--references REF.npz --out DIR``.

Every process builds each cell's trainer on the 8 devices of the job and feeds it only its own
rows of each global batch (``jaxpar.distributed.process_rows``: the natural per-host batch);
the losses and the gathered parameters are compared with the one-device references, as the
matrix's single-process cells are (`matrix_worker.py`). Process 0 appends one JSON line per
finished cell to ``DIR/out.jsonl``: ``{"name", "loss_err", "param_err", "tolerance"}``,
``{"name", "refused"}`` or ``{"name", "error"}``; every process prints its own line. Then, in the
same job, the entries of `launched_extras` (a TokenLoader per process with ``--store``,
ServerRows with ``--servers``, HostRows refused, and with ``--preempt`` a SIGTERM to one
process last), one line each.
"""

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True)
    p.add_argument("--references", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--store", help="a token store: a TokenLoader per process trains on it")
    p.add_argument("--servers", help="parameter servers' addresses: ServerRows, one worker per process")
    p.add_argument("--preempt", help="a checkpoint directory: SIGTERM to the last process, every one saves")
    args = p.parse_args()

    started = time.monotonic()
    import jaxpar.distributed as dist

    spec = dist.initialize()
    import jax

    import matrix

    with open(args.cells) as f:
        cells = json.load(f)
    references = matrix.References(args.references)
    rows = dist.process_rows(matrix.BATCH)
    lines = (matrix.cell_line(cell, references, os.path.join(args.out, f"ckpt{i}"), rows=rows)
             for i, cell in enumerate(cells))
    for line in itertools.chain(lines, extras(args)):
        line["processes"] = jax.process_count()
        print(f"process {spec.process_id}: {json.dumps(line)} ({time.monotonic() - started:.1f} s)", flush=True)
        if spec.process_id == 0:
            with open(os.path.join(args.out, "out.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


def extras(args):
    """The `launched_extras` lines the flags ask for, one at a time (the preemption last)."""
    from workers import launched_extras as ex

    yield ex.run("host_rows", ex.host_rows)
    if args.store:
        yield ex.run("loader", ex.loader, args.store)
    if args.servers:
        yield ex.run("server_rows", ex.server_rows, args.servers)
    if args.preempt:
        yield ex.run("preempt", ex.preempt, args.preempt)


if __name__ == "__main__":
    main()
