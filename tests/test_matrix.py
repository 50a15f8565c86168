"""The combination matrix: every pair of features trains equal to one device, or is refused.

Cells run in child processes (a few cells each) under a timeout, so a cell that aborts the
process or hangs fails its test by name instead of taking the suite down.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxpar
import matrix

GROUP = 4
GROUPS = [matrix.CELLS[i:i + GROUP] for i in range(0, len(matrix.CELLS), GROUP)]
WORKER = os.path.join(os.path.dirname(__file__), "workers", "matrix_worker.py")
# Cells compile fresh: XLA:CPU executables loaded from the persistent compilation cache can
# deadlock in a collective rendezvous (seen with pipeline x ring attention x expert dispatch:
# the same program runs when compiled, and times out when loaded; docs/composition.md).
WORKER_ENV = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    arrays = {}
    for key in sorted({matrix.reference_key(cell) for cell in matrix.CELLS}):
        name = matrix.reference_name(key)
        losses, params = matrix.reference(key)
        arrays[f"{name}/losses"] = np.asarray(losses)
        for i, (_, x) in enumerate(sorted(matrix.flat_params(params).items())):
            arrays[f"{name}/p/{i:04d}"] = np.asarray(x, np.float32)
    path = tmp_path_factory.mktemp("matrix") / "reference.npz"
    np.savez(path, **arrays)
    return str(path)


def test_cells_cover_every_pair():
    covered = {p for cell in matrix.CELLS for p in matrix._pairs(cell)}
    missing = matrix.all_pairs() - covered
    assert not missing, f"pairs no cell covers: {sorted(missing)[:5]}"
    # the full product of the three most used features is there too
    for schedule in matrix.FEATURES["pipeline"]:
        for zero in (0, 1):
            assert any(c["layout"] == "megatron" and c["pipeline"] == schedule and c["zero"] == zero
                       for c in matrix.CELLS)


@pytest.mark.slow
@pytest.mark.parametrize("cells", GROUPS, ids=[f"cells{i * GROUP}-{i * GROUP + len(g) - 1}" for i, g in enumerate(GROUPS)])
def test_cells_match_one_device(cells, references, tmp_path):
    spec, out = tmp_path / "cells.json", tmp_path / "out.jsonl"
    spec.write_text(json.dumps(cells))
    proc = subprocess.run([sys.executable, WORKER, str(spec), references, str(out), str(tmp_path)],
                          capture_output=True, text=True, timeout=560, env=WORKER_ENV)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if len(lines) < len(cells):
        stuck = matrix.name(cells[len(lines)])
        pytest.fail(f"cell {stuck} ended the process (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    failures = []
    for line in lines:
        if "error" in line:
            failures.append(f"{line['name']}: {line['error']}")
        elif line["loss_err"] > line["tolerance"][0] or line["param_err"] > line["tolerance"][1]:
            failures.append(f"{line['name']}: losses {line['loss_err']:.2e}, parameters {line['param_err']:.2e}")
    assert not failures, "\n".join(failures)


# How each feature is named in the Trainer's refusal.
NAMED = {"mode": "mode='{}'", "pipeline": r"pipeline\.stages( > 1|=2)", "context": "context=", "moe": "mixture-of-experts",
         "precision": "precision"}
ON = {"pipeline": "1f1b", "context": "ring", "moe": "ep"}   # the other feature of a refused pair, switched on


@pytest.mark.parametrize("pair", [p for p in matrix.REFUSED if p[0] != "precision"], ids="-".join)
def test_refused_pairs_name_both_features(pair):
    feature, value, other = pair
    cell = dict(matrix.BASE, **{feature: value, other: ON[other]})
    first, second = NAMED[feature].format(value), NAMED[other].format(ON[other])
    with pytest.raises(ValueError, match=rf"{first}.*{second}|{second}.*{first}"):
        matrix._trainer(matrix.config_for(cell), matrix.gpt_config(cell), 8)
    assert matrix.REFUSED[pair]


def test_bf16_with_pipeline_refused_on_cpu_naming_both():
    cell = dict(matrix.BASE, precision="bf16", pipeline="1f1b")
    with pytest.raises(ValueError, match=r"pipeline\.stages=2 with precision compute='bfloat16'.*CPU"):
        matrix._trainer(matrix.config_for(cell), matrix.gpt_config(cell), 8)
