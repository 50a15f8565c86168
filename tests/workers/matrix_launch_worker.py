"""Combination-matrix cells under ``jaxpar launch``: ``matrix_launch_worker.py --cells CELLS.json
--references REF.npz --out DIR``.

Every process builds each cell's trainer on the 8 devices of the job and feeds it only its own
rows of each global batch (``jaxpar.distributed.process_rows``: the natural per-host batch);
the losses and the gathered parameters are compared with the one-device references, as the
matrix's single-process cells are (`matrix_worker.py`). Process 0 appends one JSON line per
finished cell to ``DIR/out.jsonl``: ``{"name", "loss_err", "param_err", "tolerance"}``,
``{"name", "refused"}`` or ``{"name", "error"}``; every process prints its own line.
"""

import argparse
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
    for i, cell in enumerate(cells):
        line = {**matrix.cell_line(cell, references, os.path.join(args.out, f"ckpt{i}"), rows=rows),
                "processes": jax.process_count()}
        print(f"process {spec.process_id}: {json.dumps(line)} ({time.monotonic() - started:.1f} s)", flush=True)
        if spec.process_id == 0:
            with open(os.path.join(args.out, "out.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
