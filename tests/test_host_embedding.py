"""Host-side embedding tables: training the table row by row on the host equals training it as
an ordinary device parameter, for either storage, and bad ids are refused by name."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.data.clicks import ClickData
from jaxpar.models.dlrm import DLRM, DLRMConfig, loss_fn
from jaxpar.nn.host_embedding import HostEmbedding, RowOptimizer
from jaxpar.nn.host_step import HostEmbeddingStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = DLRMConfig(field_rows=(60, 30, 10), embed=8, bottom=(16,), top=(16,))
DATA = ClickData(field_rows=CONFIG.field_rows)
STEPS, BATCH, LR = 6, 32, 0.05
ROWS = {"sgd": (RowOptimizer(kind="sgd", learning_rate=LR), optax.sgd(LR)),
        "adagrad": (RowOptimizer(kind="adagrad", learning_rate=LR), optax.adagrad(LR))}


def reference(row_kind: str, initial: np.ndarray):
    """The table as an ordinary parameter: losses, final table and dense parameters."""
    model = DLRM(CONFIG, rngs=nnx.Rngs(0))
    model.table[...] = initial
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "table" if "table" in jax.tree_util.keystr(path) else "dense", params)
    tx = optax.multi_transform({"table": ROWS[row_kind][1], "dense": optax.adam(LR)}, labels)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, DATA.batch(s, BATCH))) for s in range(STEPS)]
    table = np.asarray(model.table[...])
    model.table = None
    return losses, table, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("storage, row_kind", [("callback", "sgd"), ("pinned_host", "adagrad"),
                                               ("file", "adagrad")])
def test_host_table_equals_device_parameter(storage, row_kind, tmp_path):
    if storage == "file":  # rows drawn when first read: the reference starts from those
        table = HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, ROWS[row_kind][0],
                              storage="file", path=str(tmp_path / "clicks.rows"))
        initial = table.numpy()
    else:
        initial = np.asarray(DLRM(CONFIG, rngs=nnx.Rngs(0)).table[...])
        table = HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, ROWS[row_kind][0],
                              init=initial, storage=storage)
    assert table.storage == storage
    step = HostEmbeddingStep(DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), optax.adam(LR),
                             loss_fn, table)
    losses = []
    for s in range(STEPS):
        batch = DATA.batch(s, BATCH)
        losses.append(float(step(batch, CONFIG.table_ids(batch["ids"]))))
    ref_losses, ref_table, ref_dense = reference(row_kind, initial)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert not np.allclose(table.numpy(), initial), "the table trained"
    np.testing.assert_allclose(table.numpy(), ref_table, rtol=1e-6, atol=1e-7)
    dense = nnx.to_pure_dict(nnx.state(step.model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), dense, ref_dense)


@pytest.mark.parametrize("ids, error, words", [
    (np.array([[0, 100]]), ValueError, "table 'clicks' has rows 0..99, but the ids (shape (1, 2)) hold 100"),
    (np.array([-1, 3]), ValueError, "hold -1"),
    (np.array([1.0, 2.0]), TypeError, "table 'clicks': ids must be integers, got dtype float64"),
])
def test_bad_ids_are_refused_naming_the_table(ids, error, words):
    table = HostEmbedding("clicks", 100, 4, RowOptimizer(), storage="callback")
    with pytest.raises(error) as err:
        table.prepare(ids)
    assert words in str(err.value)


def test_cpu_backend_has_pinned_host():
    """What `storage="auto"` finds here: the CPU backend lists a pinned_host memory."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert "pinned_host" in kinds
    assert HostEmbedding("t", 4, 2, RowOptimizer()).storage == "pinned_host"


EXAMPLE = os.path.join(ROOT, "examples", "train_clicks.py")


@pytest.mark.timeout(180)
def test_table_larger_than_the_address_space_limit(tmp_path):
    """A 4.8 GiB table (plus as much Adagrad state) trains in a process limited to 3 GiB of
    address space with storage="file"; the same table in process memory cannot even start."""
    common = [sys.executable, EXAMPLE, "--rows", "40000000", "--dim", "32", "--batch", "256",
              "--rlimit-as-gib", "3"]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    summary = tmp_path / "summary.json"
    run = subprocess.run([*common, "--steps", "40", "--storage", "file", "--table-path",
                          str(tmp_path / "clicks.rows"), "--json", str(summary)],
                         env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["table_gib"] > 4.5 > 3 > s["peak_address_space_gib"] > s["peak_resident_gib"]
    assert s["peak_resident_gib"] < 1.0
    assert s["eval_loss_end"] < s["eval_loss_start"] - 0.1
    in_memory = subprocess.run([*common, "--steps", "1", "--storage", "callback"], env=env,
                               capture_output=True, text=True, timeout=150)
    assert in_memory.returncode != 0 and "MemoryError" in in_memory.stderr, in_memory.stderr[-2000:]


@pytest.mark.parametrize("kwargs, words", [
    ({"num_rows": 0}, "table 'clicks': num_rows=0 must be a positive whole number"),
    ({"dim": 2.5}, "dim=2.5 must be a positive whole number"),
    ({"storage": "disk"}, "storage='disk' must be one of"),
    ({"storage": "file"}, "storage='file' takes a file path"),
    ({"num_rows": 2 ** 31}, "num_rows=2,147,483,648 is over the 2**31 - 1 rows"),
])
def test_bad_tables_are_refused(kwargs, words):
    args = {"name": "clicks", "num_rows": 10, "dim": 4, "optimizer": RowOptimizer(), **kwargs}
    with pytest.raises(ValueError) as err:
        HostEmbedding(**args)
    assert words in str(err.value)


def test_a_row_file_is_one_tables_and_closes(tmp_path):
    """A second table on the same file would empty the first's rows: refused while it is open."""
    path = str(tmp_path / "t.rows")
    first = HostEmbedding("a", 10, 2, RowOptimizer(), storage="file", path=path)
    with pytest.raises(ValueError, match="already open as another table's rows"):
        HostEmbedding("b", 10, 2, RowOptimizer(), storage="file", path=path)
    first.close()
    HostEmbedding("b", 10, 2, RowOptimizer(), storage="file", path=path).close()


def test_step_over_a_mesh_equals_one_device():
    """The dense towers split over a 2 x 4 mesh (batch over "data", hidden widths over
    "model"), the pulled rows replicated: the same losses and table as on one device."""
    initial = np.asarray(DLRM(CONFIG, rngs=nnx.Rngs(0)).table[...])

    def train(config=None):
        table = HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, ROWS["adagrad"][0],
                              init=initial, storage="pinned_host")
        mesh = None if config is None else jaxpar.make_mesh(config)
        make = lambda: DLRM(CONFIG, rngs=nnx.Rngs(0), table=False)  # noqa: E731
        model = make() if config is None else jaxpar.init(make, config, mesh)
        step = HostEmbeddingStep(model, optax.adam(LR), loss_fn, table, config=config, mesh=mesh)
        losses = []
        for s in range(4):
            batch = DATA.batch(s, BATCH)
            losses.append(float(step(batch, CONFIG.table_ids(batch["ids"]))))
        return losses, table.numpy(), step

    one, one_table, _ = train()
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                   rules={"batch": "data", "mlp": "model"})
    split, split_table, step = train(config)
    hidden = step.params["bottom"]["weights"][0][...]
    assert hidden.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_allclose(split, one, rtol=1e-5)
    np.testing.assert_allclose(split_table, one_table, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("module", ["jaxpar.nn.host_embedding", "jaxpar.nn.host_step",
                                    "jaxpar.nn.row_file", "jaxpar.models.dlrm",
                                    "jaxpar.data.clicks"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module)).failed == 0
