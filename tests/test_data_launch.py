"""A 2-process x 4-device job through `jaxpar launch` reads the same global batches as 1 process
x 8 devices, from the start and resumed from a position saved by the 1-process run. (Training
on a `TokenLoader` per process, equal to one process, runs in the launched slice of the
combination matrix, on 2 x 4 and 4 x 2: tests/test_matrix.py, tests/workers/launched_extras.py.)"""

import json
import os

import pytest

from jaxpar.data import TokenLoader, prepare
from jaxpar.launch.ports import free_port
from jaxpar.models.data import arithmetic_text
from workers.loader_worker import digest
from workers.procs import WORKERS, Launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
BATCHES, SAVED_AT = 6, 3


def test_two_processes_read_the_global_batches_of_one(tmp_path, tag):
    (tmp_path / "corpus.txt").write_text(arithmetic_text(800, seed=2))
    store = prepare([str(tmp_path / "corpus.txt")], str(tmp_path / "store"), docs="line", progress=False)
    one = TokenLoader(store, seq_len=16, global_batch=16, seed=5)         # this process: 1 x 8 devices
    expected = [one.batch(i) for i in range(BATCHES)]
    for _ in range(SAVED_AT):
        next(one)
    (tmp_path / "state.json").write_text(json.dumps(one.state()))
    args = ["--worker-num", 2, "--local-worker-num", 2, "--simulated-devices", 4, "--master-port", free_port(),
            "--cluster-time-out", 60]
    run = Launch(tmp_path, tag, args, ["--store", tmp_path / "store", "--state", tmp_path / "state.json",
                                       "--batches", BATCHES],
                 script=os.path.join(WORKERS, "loader_worker.py"), entry=("-m", "jaxpar.cli", "launch"))
    try:
        assert run.wait(timeout=180) == 0, run.stderr + run.log(0) + run.log(1)
    finally:
        run.close()
    results = run.results()
    assert [(r["rank"], r["processes"], r["local_devices"]) for r in results] == [(0, 2, 4), (1, 2, 4)]
    for r in results:
        start, stop = r["rows"]
        assert (start, stop) == (8 * r["rank"], 8 * r["rank"] + 8)         # each process read only its rows
        assert r["local"] == [digest(one.batch(i, slice(start, stop))) for i in range(BATCHES)]
        assert r["global"] == [digest(b) for b in expected]                # assembled: the 1-process batches
        assert r["resumed"] == [digest(b) for b in expected[SAVED_AT:]]    # resumed on 2 x 4 from 1 x 8
        assert r["state"]["next_batch"] == BATCHES
