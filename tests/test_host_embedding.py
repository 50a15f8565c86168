"""Host-side embedding tables: training the table row by row on the host (a row source of the
one `jaxpar.Trainer` loop) equals training it as an ordinary device parameter, for every
storage and with precision, accumulation and ZeRO; bad ids are refused by name."""

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
from jaxpar.ps import HostEmbedding, HostRows, RowOptimizer

from helpers import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = DLRMConfig(field_rows=(60, 30, 10), embed=8, bottom=(16,), top=(16,))
DATA = ClickData(field_rows=CONFIG.field_rows)
STEPS, BATCH, LR = 6, 32, 0.05
ROWS = {"sgd": (RowOptimizer(kind="sgd", learning_rate=LR), optax.sgd(LR)),
        "adagrad": (RowOptimizer(kind="adagrad", learning_rate=LR), optax.adagrad(LR))}


def rows_loss(model, batch, rows):
    """The click loss on pulled rows: ``batch["ids"]`` holds each id's index into ``rows``."""
    return loss_fn(model, batch, rows, batch["ids"])


def host_trainer(table, config=None, tx=None):
    """A Trainer of the dense DLRM whose rows come from ``table`` (one device without ``config``)."""
    config = config or jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    model = jaxpar.init(lambda: DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), config, mesh)
    return jaxpar.Trainer(model, tx or optax.adam(LR), rows_loss, config, mesh,
                          rows=HostRows(table, ids=CONFIG.table_ids))


def dense_params(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


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
    trainer = host_trainer(table)
    losses = [float(trainer.step(DATA.batch(s, BATCH))["loss"]) for s in range(STEPS)]
    ref_losses, ref_table, ref_dense = reference(row_kind, initial)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert not np.allclose(table.numpy(), initial), "the table trained"
    np.testing.assert_allclose(table.numpy(), ref_table, rtol=1e-6, atol=1e-7)
    # (the dense step is compiled as the Trainer's program: summation orders differ in the last bits)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), dense_params(trainer), ref_dense)
    # evaluation pulls the rows and pushes nothing
    before = table.numpy()
    assert np.isfinite(trainer.evaluate([DATA.batch(STEPS, BATCH)]))
    np.testing.assert_array_equal(table.numpy(), before)


@pytest.mark.parametrize("mode", ["semi_auto", "hybrid"])
def test_host_rows_compose_with_precision_accumulation_and_zero(mode):
    """Host rows on 8 devices with ZeRO-1, bf16 and grad_accum=2 equal the table as a device
    parameter on one device under the same precision and accumulation: the rows go through
    the step chain like parameters (cast, accumulated, averaged over the data axis; in hybrid
    mode inside the per-device shard_map, reduced with the ZeRO gradients)."""
    initial = np.asarray(DLRM(CONFIG, rngs=nnx.Rngs(0)).table[...])
    common = dict(precision="bf16", grad_accum=2)
    table = HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, ROWS["sgd"][0], init=initial, storage="pinned_host")
    split = jaxpar.ParallelConfig(mesh={"data": 8}, mode=mode, optimizer={"level": 1, "threshold_kb": 0}, **common)
    trainer = host_trainer(table, split, optax.sgd(LR))
    assert trainer.plan.zero_level == 1
    losses = [float(trainer.step(DATA.batch(s, BATCH))["loss"]) for s in range(4)]

    one = jaxpar.ParallelConfig(mesh={"data": 1}, **common)
    model = DLRM(CONFIG, rngs=nnx.Rngs(0))
    model.table[...] = initial
    # SGD on the table (the host rows' optimizer) and on the dense part
    ref = jaxpar.Trainer(model, optax.sgd(LR), loss_fn, one, jaxpar.make_mesh(one, devices=jax.devices()[:1]))
    ref_losses = [float(ref.step(DATA.batch(s, BATCH))["loss"]) for s in range(4)]
    ref_params = dense_params(ref)
    ref_table = ref_params.pop("table")
    np.testing.assert_allclose(losses, ref_losses, rtol=4e-3)    # a bf16 loss: one ulp is 2**-8
    assert not np.allclose(table.numpy(), initial), "the table trained"
    np.testing.assert_allclose(table.numpy(), ref_table, rtol=1e-3, atol=1e-5)
    assert_close(dense_params(trainer), ref_params, rtol=1e-2)   # bf16: errors about 3e-3


def test_trainer_refuses_what_is_not_a_row_source():
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    with pytest.raises(TypeError, match="rows must be a row source with pull.*got HostEmbedding"):
        jaxpar.Trainer(DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), optax.adam(LR), rows_loss, config, mesh,
                       rows=HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, RowOptimizer(), storage="callback"))
    source = HostRows(HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, RowOptimizer(), storage="callback"),
                      key="item")
    with pytest.raises(ValueError, match=r"no ids under key 'item' \(its keys: \['dense', 'ids', 'label'\]\)"):
        source.pull(DATA.batch(0, BATCH))


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
        trainer = host_trainer(table, config)
        losses = [float(trainer.step(DATA.batch(s, BATCH))["loss"]) for s in range(4)]
        return losses, table.numpy(), trainer

    one, one_table, _ = train()
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                   rules={"batch": "data", "mlp": "model"})
    split, split_table, trainer = train(config)
    hidden = trainer.params["bottom"]["weights"][0][...]
    assert hidden.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_allclose(split, one, rtol=1e-5)
    np.testing.assert_allclose(split_table, one_table, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("module", ["jaxpar.ps.host_embedding", "jaxpar.ps.rows",
                                    "jaxpar.ps.row_file", "jaxpar.models.dlrm",
                                    "jaxpar.data.clicks"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module)).failed == 0


class _Recording:
    """A row source over a whole numpy table that records what it pushes; its first pull hands
    over a NaN row."""

    def __init__(self):
        self.table = np.full((CONFIG.rows, CONFIG.embed), 0.01, np.float32)
        self.pushed, self.pulls = [], 0

    def pull(self, batch):
        unique, inverse = np.unique(CONFIG.table_ids(batch["ids"]), return_inverse=True)
        rows = self.table[unique].copy()
        if self.pulls == 0:
            rows[0] = np.nan
        self.pulls += 1
        return {**batch, "ids": inverse.reshape(batch["ids"].shape).astype(np.int32)}, rows, unique

    def push(self, unique, row_grads, step):
        self.pushed.append((step, None if row_grads is None else np.asarray(row_grads)))
        if row_grads is not None:
            self.table[unique] -= LR * np.asarray(row_grads)


def test_skipped_step_pushes_no_row_gradients_and_fit_runs():
    """nonfinite="skip": a step whose pulled rows make the loss NaN keeps the dense state and
    tells the source to apply nothing (row_grads None: a lazy Adam on a server would still move
    rows on zero gradients); fit (its first-step metrics read the last pull) runs with rows."""
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    source = _Recording()
    trainer = jaxpar.Trainer(DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), optax.adam(LR), rows_loss, config, mesh,
                             rows=source, nonfinite="skip")
    before = dense_params(trainer)
    trainer.step(DATA.batch(0, BATCH))
    trainer.check_finite()
    assert trainer.skipped_steps == [1]
    assert source.pushed[0] == (1, None)
    jax.tree.map(np.testing.assert_array_equal, dense_params(trainer), before)
    history = trainer.fit([DATA.batch(s, BATCH) for s in range(1, 3)], steps=2, progress=False)
    assert [h["step"] for h in history] == [2, 3] and all(np.isfinite(h["loss"]) for h in history)
    assert all(g.any() for _, g in source.pushed[1:])


def test_row_sources_refuse_what_cannot_run_them():
    """mode="auto" searches on loss_fn(model, batch) without rows: refused by name."""
    config = jaxpar.ParallelConfig(mode="auto", mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="rows= with mode='auto'"):
        jaxpar.Trainer(DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), optax.adam(LR), rows_loss, config, mesh,
                       rows=_Recording())
