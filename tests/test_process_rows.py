"""The rule for a process's own rows (several processes, each feeding its block of the global
batch), on fake device -> process maps; and the batches the Trainer refuses by name."""

import itertools
import math
import re

import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.data import ProcessShards, check_process_rows, process_shards

# 4 processes x 2 devices, device d driven by process d // 2
FOUR_BY_TWO = np.repeat(np.arange(4), 2)


@pytest.mark.parametrize("grid, names, axes, process, expected", [
    # {"data": 8}: a process holds its two devices' shards, nobody else's
    (FOUR_BY_TWO, ("data",), ("data",), 1, dict(local=2, sharing=1, devices=(2, 3), shards=8)),
    # {"model": 2, "data": 4} as jaxpar.make_mesh orders it: a process's devices along data,
    # each of its two data shards held by a process of the other model row too
    (FOUR_BY_TWO.reshape(2, 4), ("model", "data"), ("data",), 2, dict(local=2, sharing=2, devices=(4, 5), shards=4)),
    # the same mesh with each process's two devices along model: one data shard a process
    (FOUR_BY_TWO.reshape(4, 2).T, ("model", "data"), ("data",), 2, dict(local=1, sharing=1, devices=(2, 6), shards=4)),
    # {"data": 2, "model": 4}: two processes fill each data shard
    (FOUR_BY_TWO.reshape(2, 4), ("data", "model"), ("data",), 3, dict(local=1, sharing=2, devices=(6, 7), shards=2)),
    # processes interleaved along the axis: process 0 holds shards 0 and 4
    (np.tile(np.arange(4), 2), ("data",), ("data",), 0, dict(local=2, sharing=1, devices=(0, 4), shards=8)),
    # no batch axis: every device needs every row
    (FOUR_BY_TWO, ("model",), (), 0, dict(local=1, sharing=4, devices=(0, 1), shards=1)),
])
def test_the_shards_a_process_holds_come_from_the_device_map(grid, names, axes, process, expected):
    got = process_shards(grid, names, axes, process)
    assert {k: getattr(got, k) for k in expected} == expected
    assert got.processes == 4


def exact(rows, shards: ProcessShards, parts):
    """The global batch (rows x processes) cut into parts, each split over every shard."""
    return rows * shards.processes % (shards.shards * parts) == 0


@pytest.mark.parametrize("seed", range(4))
def test_the_local_rule_is_the_global_batch_rule_on_any_layout(seed):
    """On random device -> process maps, even or not, over one or two batch axes: this process's
    rows pass exactly when the global batch splits, and every process decides alike."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        shape = tuple(int(s) for s in rng.choice([1, 2, 4], size=3))
        size = math.prod(shape)
        processes = int(rng.choice([p for p in (1, 2, 4, 8) if p <= size]))
        grid = rng.permutation(np.arange(size) % processes).reshape(shape)
        names = ("a", "b", "c")
        axes = tuple(a for a in names if rng.random() < 0.6)
        for parts in (1, 2, 3, 4):
            decided = set()
            for p in range(processes):
                shards = process_shards(grid, names, axes, p)
                need = shards.rows_multiple(parts)
                assert [r % need == 0 for r in range(1, 33)] == [exact(r, shards, parts) for r in range(1, 33)], (
                    grid, axes, p, parts)
                decided.add(need)
            assert len(decided) == 1


def test_a_natural_per_host_batch_passes_where_the_whole_mesh_would_refuse_it():
    mine = process_shards(FOUR_BY_TWO, ("data",), ("data",), 0)
    check_process_rows("batch['x']", 4, mine, {})                        # 4 rows of a global 16 on 8 devices
    check_process_rows("batch['x']", 4, mine, {"grad_accum": 2})         # 2 parts x 2 local shards
    on_model = process_shards(FOUR_BY_TWO.reshape(4, 2).T, ("model", "data"), ("data",), 0)
    check_process_rows("batch['x']", 2, on_model, {"grad_accum": 2})     # one data shard a process
    with pytest.raises(ValueError, match=re.escape(
            "batch['x']: this process's 4 rows do not split: the global batch is 4 rows x 4 processes = 16 rows, and "
            "this process's 2 devices on the batch axes ('data',) (ids 0, 1) hold 2 of their 8 shards; grad_accum=4 "
            "cuts each step's batch into 4 parts, each split over those shards, so every process must feed a "
            "multiple of 8 rows; feed 8 rows per process (a global batch of 32), or a smaller grad_accum")):
        check_process_rows("batch['x']", 4, mine, {"grad_accum": 4})


def test_shards_filled_by_several_processes_are_named():
    shared = process_shards(FOUR_BY_TWO.reshape(2, 4), ("data", "model"), ("data",), 0)     # {"data": 2, "model": 4}
    check_process_rows("batch['x']", 1, shared, {"grad_accum": 2})     # 2 processes x 1 row = a shard's 2 rows
    with pytest.raises(ValueError, match=re.escape(
            "hold 1 of their 2 shards, each filled by the rows of 2 processes; grad_accum=2 x interleave=2 cuts "
            "each step's batch into 4 parts, each split over those shards, so every process must feed a multiple "
            "of 2 rows; feed 2 or 4 rows per process (a global batch of 8 or 16)")):
        check_process_rows("batch['x']", 3, shared, {"grad_accum": 2, "interleave": 2})


def test_a_process_without_devices_on_the_mesh_is_named():
    outside = process_shards(FOUR_BY_TWO, ("data",), ("data",), 5)
    with pytest.raises(ValueError, match=r"this process \(process 5\) drives none of the mesh's devices"):
        check_process_rows("batch['x']", 4, outside, {})


def test_a_device_map_that_does_not_fit_the_axes_is_refused():
    with pytest.raises(ValueError, match="processes has 1 dimensions but axis_names=.* names 2"):
        process_shards(FOUR_BY_TWO, ("model", "data"), ("data",), 0)
    with pytest.raises(ValueError, match=r"batch axes \['pipe'\] are not axes of the mesh"):
        process_shards(FOUR_BY_TWO, ("data",), ("pipe",), 0)


# --------------------------------------------------------------------------- the Trainer


@pytest.fixture(scope="module")
def trainer():
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: nnx.Linear(3, 1, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), config, mesh)


def batch(rows):
    return {"x": np.ones((rows, 3), np.float32), "y": np.zeros((rows, 1), np.float32)}


def test_evaluate_says_when_the_batches_run_out(trainer):
    with pytest.raises(ValueError, match=re.escape("Trainer.evaluate: steps=5 but the batches ran out after 2; "
                                                   "pass steps=2")):
        trainer.evaluate([batch(8), batch(8)], steps=5)
    assert np.isfinite(trainer.evaluate([batch(8), batch(8)], steps=2))
    assert np.isfinite(trainer.evaluate(itertools.repeat(batch(8)), steps=3))   # an endless iterable


@pytest.mark.parametrize("call", ["step", "evaluate", "place", "lower"])
def test_a_batch_of_no_rows_is_refused_by_name(trainer, call):
    run = {"step": trainer.step, "evaluate": lambda b: trainer.evaluate([b]), "place": trainer.place,
           "lower": trainer.lower}[call]
    with pytest.raises(ValueError, match=re.escape("batch['x'] has 0 rows (shape (0, 3)); a batch needs at least one "
                                                   "row")):
        run(batch(0))
    assert trainer.step_count == 0
