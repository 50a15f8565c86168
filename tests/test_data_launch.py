"""A 2-process x 4-device job through `jaxpar launch` reads the same global batches as 1 process
x 8 devices, from the start and resumed from a position saved by the 1-process run, and trains
on them as one process does with a `TokenLoader` per process feeding its 4 rows of 8."""

import json
import os

import pytest

from jaxpar.data import LoaderProcess, TokenLoader, prepare
from jaxpar.launch.ports import free_port
from jaxpar.models.data import arithmetic_text
from workers.loader_worker import digest, train
from workers.procs import WORKERS, Launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
BATCHES, SAVED_AT, STEPS = 6, 3, 3


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
                                       "--batches", BATCHES, "--train", STEPS],
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
    # each process fed the Trainer its 4 rows of every global batch of 8 on {"data": 8}: the
    # training and evaluation of one process reading the whole batches
    losses, evaluated = train(str(tmp_path / "store"), STEPS, process=LoaderProcess(index=0, count=1))
    for r in results:
        assert r["train"][0] == pytest.approx(losses, rel=1e-5)
        assert r["train"][1] == pytest.approx(evaluated, rel=1e-5)
