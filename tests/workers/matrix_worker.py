"""Runs combination-matrix cells in a child process: ``matrix_worker.py CELLS.json REF.npz OUT.jsonl TMP``.

One JSON line per finished cell (`matrix.cell_line`): ``{"name", "loss_err", "param_err"}``, ``{"name", "refused"}`` (a
``ValueError``: jaxpar refused the cell) or ``{"name", "error"}``.
A cell that aborts the process or hangs leaves no line: the parent names it.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matrix  # noqa: E402


def main(cells_path, ref_path, out_path, tmp):
    with open(cells_path) as f:
        cells = json.load(f)
    references = matrix.References(ref_path)
    for i, cell in enumerate(cells):
        line = matrix.cell_line(cell, references, os.path.join(tmp, f"ckpt{i}"))
        with open(out_path, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
