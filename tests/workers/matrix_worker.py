"""Runs combination-matrix cells in a child process: ``matrix_worker.py CELLS.json REF.npz OUT.jsonl TMP``.

One JSON line per finished cell: ``{"name", "loss_err", "param_err"}``, ``{"name", "refused"}`` (a
``ValueError``: jaxpar refused the cell) or ``{"name", "error"}``.
A cell that aborts the process or hangs leaves no line: the parent names it.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import matrix  # noqa: E402


def main(cells_path, ref_path, out_path, tmp):
    with open(cells_path) as f:
        cells = json.load(f)
    refs = None     # read once the first cell has trained: another worker may still be writing them
    for i, cell in enumerate(cells):
        line = {"name": matrix.name(cell)}
        try:
            # the cells beside the cover (matrix.EXTRA) also report what their stages' branches communicate
            inspect = None
            if cell.get("model") == "llama":
                def inspect(trainer, batch, line=line):
                    line["stray"] = matrix.stray_collectives(trainer, batch)
            losses, params = matrix.run_cell(cell, os.path.join(tmp, f"ckpt{i}"), inspect)
            flat = [np.asarray(p, np.float32) for _, p in sorted(matrix.flat_params(params).items())]
            refs = refs or matrix.load_references(ref_path)
            name = matrix.reference_name(matrix.reference_key(cell))
            line["loss_err"], line["param_err"] = matrix.errors((losses, flat), refs[name])
            line["tolerance"] = matrix.TOLERANCE[cell["precision"]]
        except ValueError as e:     # a refusal: the parent checks that the cell expects it, and its words
            line["refused"] = str(e)
        except Exception as e:  # reported by the parent with the cell's name
            line["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        with open(out_path, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
