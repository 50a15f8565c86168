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
import traceback

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
    import numpy as np

    import matrix

    with open(args.cells) as f:
        cells = json.load(f)
    refs = None     # read once the first cell has trained: a pytest worker may still be writing them
    rows = dist.process_rows(matrix.BATCH)
    for i, cell in enumerate(cells):
        line = {"name": matrix.name(cell), "processes": jax.process_count()}
        try:
            losses, params = matrix.run_cell(cell, os.path.join(args.out, f"ckpt{i}"), rows=rows)
            flat = [np.asarray(x, np.float32) for _, x in sorted(matrix.flat_params(params).items())]
            refs = refs or matrix.load_references(args.references)
            name = matrix.reference_name(matrix.reference_key(cell))
            line["loss_err"], line["param_err"] = matrix.errors((losses, flat), refs[name])
            line["tolerance"] = matrix.TOLERANCE[cell["precision"]]
        except ValueError as e:     # none expected: the test reports it with where it was raised
            line["refused"] = f"{e}\n{traceback.format_exc(limit=-12)}"
        except Exception as e:  # reported by the test with the cell's name
            line["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        print(f"process {spec.process_id}: {json.dumps(line)} ({time.monotonic() - started:.1f} s)", flush=True)
        if spec.process_id == 0:
            with open(os.path.join(args.out, "out.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
