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


def host_trainer(table, config=None, tx=None, **kwargs):
    """A Trainer of the dense DLRM whose rows come from ``table`` (one device without ``config``)."""
    config = config or jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    model = jaxpar.init(lambda: DLRM(CONFIG, rngs=nnx.Rngs(0), table=False), config, mesh)
    rows = HostRows(table, ids=CONFIG.table_ids) if isinstance(table, HostEmbedding) else table
    return jaxpar.Trainer(model, tx or optax.adam(LR), rows_loss, config, mesh, rows=rows, **kwargs)


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
    over a NaN row (unless ``nan=False``)."""

    def __init__(self, nan: bool = True):
        self.table = np.full((CONFIG.rows, CONFIG.embed), 0.01, np.float32)
        self.pushed, self.pulls, self.nan = [], 0, nan

    def pull(self, batch):
        unique, inverse = np.unique(CONFIG.table_ids(batch["ids"]), return_inverse=True)
        rows = self.table[unique].copy()
        if self.pulls == 0 and self.nan:
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


# --------------------------------------------------------------------------- refused in a job of several processes
# Each check reads jax.process_count() where it decides; the tests give it 2 there, and the step
# runs the same path as in a job of two processes up to the refusal.


def test_host_rows_refuse_a_job_of_several_processes(monkeypatch):
    table = HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, RowOptimizer(), storage="callback")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError) as err:
        HostRows(table)
    assert ("HostRows (table 'clicks'): a job of 2 processes would train one copy of the table per process; run "
            "one process (its devices form the mesh), or keep the table on parameter servers "
            "(jaxpar.ps.ServerRows)") in str(err.value)


class _Placed:
    """A row source whose rows are the whole table, as ``place(table)`` gives them."""

    def __init__(self, place):
        self.place = place

    def pull(self, batch):
        ids = CONFIG.table_ids(batch["ids"]).astype(np.int32)
        return {**batch, "ids": ids}, self.place(np.full((CONFIG.rows, CONFIG.embed), 0.01, np.float32)), None

    def push(self, handle, row_grads, step):
        pass


def _no_agreement(monkeypatch):
    """One process posing as two has no other process to gather the batch's agreement from
    (`jaxpar.train.programs.Programs.agree`, tested under jaxpar launch): skip it."""
    from jaxpar.train.programs import Programs

    monkeypatch.setattr(Programs, "agree", lambda self, batch: None)


@pytest.mark.parametrize("where, got", [("host", "ndarray of shape (100, 8)"),
                                        ("one device", "ArrayImpl of shape (100, 8)")])
def test_rows_of_several_processes_must_be_global_arrays_on_the_mesh(monkeypatch, where, got):
    """In a job of several processes each process pulls its own rows: the step takes them only
    as global arrays on the Trainer's mesh; host rows or rows on one device are refused."""
    place = (lambda x: x) if where == "host" else (lambda x: jax.device_put(x, jax.devices()[0]))
    trainer = host_trainer(_Placed(place))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    _no_agreement(monkeypatch)
    with pytest.raises(ValueError) as err:
        trainer.step(DATA.batch(0, BATCH))
    assert (f"Trainer: in a job of 2 processes the row source must pull its rows as global jax.Arrays on the "
            f"Trainer's mesh (got {got}); e.g. jaxpar.ps.ServerRows(client, fields, mesh=mesh)") in str(err.value)


def test_hybrid_mode_refuses_rows_split_over_the_mesh(monkeypatch):
    """Hybrid mode runs the loss per device: rows a job of several processes pulled as blocks
    split over the batch axis (what ServerRows(mesh=...) gives) are refused, naming the specs."""
    config = jaxpar.ParallelConfig(mesh={"data": 2}, mode="hybrid")
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:2])
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    trainer = host_trainer(_Placed(lambda x: jax.device_put(x, split)), config)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    _no_agreement(monkeypatch)
    with pytest.raises(ValueError) as err:
        trainer.step(DATA.batch(0, BATCH))
    assert ("mode='hybrid' runs the loss per device, where pulled rows must be replicated; these are split "
            "(P('data',)): use mode='semi_auto' with a row source that splits them") in str(err.value)


# --------------------------------------------------------------------------- checkpoints keep the tables
K, MORE = 2, 2      # steps before the save, steps compared after it


def _table(storage, row_kind, path=None):
    initial = None if storage == "file" else np.asarray(DLRM(CONFIG, rngs=nnx.Rngs(0)).table[...])
    return HostEmbedding("clicks", CONFIG.rows, CONFIG.embed, ROWS[row_kind][0], init=initial, storage=storage,
                         path=None if path is None else str(path))


def _steps(trainer, first, count):
    return [float(trainer.step(DATA.batch(s, BATCH))["loss"]) for s in range(first, first + count)]


def _uninterrupted(storage, row_kind, tmp_path):
    table = _table(storage, row_kind, tmp_path / "straight.rows" if storage == "file" else None)
    trainer = host_trainer(table)
    _steps(trainer, 0, K)
    losses = _steps(trainer, K, MORE)
    return losses, table.numpy(), dense_params(trainer)


STORAGES = [("callback", "sgd"), ("pinned_host", "adagrad"), ("file", "adagrad")]


@pytest.mark.parametrize("storage, row_kind", STORAGES)
def test_a_checkpoint_holds_the_host_tables(storage, row_kind, tmp_path):
    """Train K steps, save, train on; a fresh Trainer and table restored from the save then
    trains as the uninterrupted run: the same losses, table and dense parameters (the table's
    optimizer state came back too: Adagrad's sums change every later update)."""
    want_losses, want_table, want_dense = _uninterrupted(storage, row_kind, tmp_path)
    path = lambda name: tmp_path / name if storage == "file" else None  # noqa: E731
    first = host_trainer(_table(storage, row_kind, path("first.rows")))
    _steps(first, 0, K)
    assert first.save(str(tmp_path / "ckpt")) == K
    _steps(first, K, 2)         # the table moves on after the save
    table = _table(storage, row_kind, path("again.rows"))
    again = host_trainer(table)
    assert again.restore(str(tmp_path / "ckpt"))["step"] == K
    assert _steps(again, K, MORE) == want_losses
    np.testing.assert_array_equal(table.numpy(), want_table)
    jax.tree.map(np.testing.assert_array_equal, dense_params(again), want_dense)


@pytest.mark.parametrize("storage, row_kind", [("callback", "adagrad"), ("file", "adagrad")])
def test_asynchronous_saves_hold_the_tables_of_their_step(storage, row_kind, tmp_path):
    """checkpoint_dir= saves every K steps in the background while the next steps update the
    table in place: the step's tables are the ones of that step. Trainer.restore() goes back
    to them (a file table's rows written since then back to their initial values), and a new
    Trainer on the directory resumes with them."""
    want_losses, want_table, _ = _uninterrupted(storage, row_kind, tmp_path)
    path = lambda name: tmp_path / name if storage == "file" else None  # noqa: E731
    directory = str(tmp_path / "ckpt")
    table = _table(storage, row_kind, path("first.rows"))
    first = host_trainer(table, checkpoint_dir=directory, save_every=K)
    _steps(first, 0, K + 1)     # step K is saved in the background while step K + 1 updates the table
    first.checkpointer.wait()
    fresh = _table(storage, row_kind, path("again.rows"))
    resumed = host_trainer(fresh, checkpoint_dir=directory, save_every=100)
    assert resumed.step_count == K
    assert _steps(resumed, K, MORE) == want_losses
    np.testing.assert_array_equal(fresh.numpy(), want_table)
    resumed.close()
    assert first.restore()["step"] == K
    assert _steps(first, K, MORE) == want_losses
    np.testing.assert_array_equal(table.numpy(), want_table)
    first.close()


def test_the_local_tier_holds_the_tables_of_its_step(tmp_path):
    """The local checkpoint tier keeps the tables of each of its steps (a copy taken when the
    save starts) and a new Trainer resumes them with the state: the uninterrupted run's losses
    and table."""
    want_losses, want_table, _ = _uninterrupted("callback", "adagrad", tmp_path)
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(
        dir=tmp_path / "ckpt", save_every=100, local_dir=tmp_path / "local", local_every=K))
    first = host_trainer(_table("callback", "adagrad"), services=services)
    _steps(first, 0, K + 1)     # local step K, then the table moves on
    first.close()
    fresh = _table("callback", "adagrad")
    resumed = host_trainer(fresh, services=services)
    assert resumed.step_count == K and resumed.service("checkpoint").local.recovery.step == K
    assert _steps(resumed, K, MORE) == want_losses
    np.testing.assert_array_equal(fresh.numpy(), want_table)
    resumed.close()


class _ServerKept(_Placed):
    """A row source whose servers keep their own tables at each checkpoint (as ServerRows)."""

    def save(self, step):
        pass

    def restore(self, step):
        pass


def test_the_local_tier_refuses_a_source_whose_servers_keep_their_tables(tmp_path):
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(
        dir=tmp_path / "ckpt", local_dir=tmp_path / "local", local_every=2))
    with pytest.raises(ValueError, match=r"CheckpointConfig\(local_dir=\.\.\., local_every=2\) with the row source "
                       r"_ServerKept, whose servers save their own tables at persistent checkpoints only"):
        host_trainer(_ServerKept(lambda x: x), services=services)


def test_a_checkpoint_without_tables_is_refused_naming_the_way_out(tmp_path):
    """A step saved without row tables (a source that keeps none in the checkpoint, or an older
    jaxpar) does not restore into HostRows, whose tables would silently start afresh: refused,
    with nothing changed; the message's way out takes the dense state alone."""
    directory = str(tmp_path / "old")
    old = host_trainer(_Recording(nan=False))
    _steps(old, 0, 1)
    old.save(directory)
    table = _table("callback", "sgd")
    before = table.numpy()
    trainer = host_trainer(table)
    with pytest.raises(ValueError) as err:
        trainer.restore(directory)
    assert (f"checkpoint {directory} step 1 holds no row tables, but the row source HostRows keeps its tables in "
            "the Trainer's checkpoints") in str(err.value)
    assert (f"trainer.state = jaxpar.checkpoint.restore_state({directory!r}, trainer.state, trainer.mesh, "
            "step=1)[0]") in str(err.value)
    assert trainer.step_count == 0
    np.testing.assert_array_equal(table.numpy(), before)
    with pytest.raises(ValueError, match="holds no row tables"):      # resuming from it: the same
        host_trainer(_table("callback", "sgd"), checkpoint_dir=directory)
    trainer.state = jaxpar.checkpoint.restore_state(directory, trainer.state, trainer.mesh, step=1)[0]
    assert trainer.step_count == 1
    jax.tree.map(np.testing.assert_array_equal, dense_params(trainer), dense_params(old))


def test_merged_checkpoints_keep_the_tables(tmp_path):
    """The offline tools rewrite a step with its row tables."""
    table = _table("callback", "adagrad")
    trainer = host_trainer(table)
    _steps(trainer, 0, 1)
    trainer.save(str(tmp_path / "ckpt"))
    jaxpar.checkpoint.merge(str(tmp_path / "ckpt"), str(tmp_path / "merged"))
    saved = table.snapshot()
    merged = jaxpar.checkpoint.restore_rows(str(tmp_path / "merged"), 1)
    assert sorted(merged) == ["slot", "table"]
    for name in saved:
        np.testing.assert_array_equal(merged[name], saved[name])


@pytest.mark.parametrize("saved, restored, words", [
    (dict(optimizer=ROWS["adagrad"][0]), dict(optimizer=ROWS["sgd"][0]),
     "the checkpoint holds arrays {'table': (10, 4), 'slot': (10, 4)}, this table (num_rows=10, dim=4, optimizer "
     "kind='sgd', storage='callback') takes {'table': (10, 4)}; restore into a HostEmbedding made as the saved one"),
    (dict(), dict(num_rows=12), "holds arrays {'table': (10, 4)}, this table (num_rows=12"),
    (dict(storage="file"), dict(), "the checkpoint holds only the 2 rows a file table (storage='file') wrote; "
                                   "this table (num_rows=10, dim=4, optimizer kind='sgd', storage='callback') "
                                   "needs the whole table"),
    (dict(storage="file", seed=1), dict(storage="file"), "drew its rows with seed=1, init_scale=0.01, this table "
                                                         "(num_rows=10, dim=4, optimizer kind='sgd', storage='file') "
                                                         "with seed=0"),
])
def test_snapshots_of_another_table_are_refused(saved, restored, words, tmp_path):
    def make(name, optimizer=ROWS["sgd"][0], num_rows=10, storage="callback", seed=0):
        path = str(tmp_path / name) if storage == "file" else None
        return HostEmbedding("clicks", num_rows, 4, optimizer, storage=storage, path=path, seed=seed)

    source = make("saved.rows", **saved)
    source.apply(source.prepare(np.array([1, 3])), np.ones((2, 4), np.float32))
    target = make("restored.rows", **restored)
    before = target.numpy()
    with pytest.raises(ValueError) as err:
        target.load_snapshot(source.snapshot())
    assert words in str(err.value)
    np.testing.assert_array_equal(target.numpy(), before)


def _two_saved_steps(tmp_path):
    """Steps 1 and 2 saved with their tables: ``(directory, the table at step 1)``."""
    directory = tmp_path / "ckpt"
    table = _table("callback", "sgd")
    first = host_trainer(table, checkpoint_dir=str(directory), save_every=1)
    _steps(first, 0, 1)
    at_step_1 = table.numpy()
    _steps(first, 1, 1)
    first.close()
    return directory, at_step_1


def _resumes_step_1(directory, at_step_1, warning: str) -> None:
    """``resume="newest_intact"`` passes step 2 over (warning ``warning``) for step 1 and its table."""
    fresh = _table("callback", "sgd")
    with pytest.warns(UserWarning, match=warning):
        resumed = host_trainer(fresh, checkpoint_dir=str(directory), resume="newest_intact")
    assert resumed.step_count == 1
    np.testing.assert_array_equal(fresh.numpy(), at_step_1)
    resumed.close()


def test_a_damaged_table_is_a_damaged_step_when_resuming(tmp_path):
    """Resuming reads a step's tables as part of the step: a damaged ``rows`` item is named like
    a damaged state, and ``resume="newest_intact"`` passes the step over for the one before."""
    from jaxpar.checkpoint import CheckpointDamagedError

    directory, at_step_1 = _two_saved_steps(tmp_path)
    # the file of the table's values (the largest): the item's metadata still reads
    largest = max((p for p in (directory / "2" / "rows").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(b"\0" * 7)
    with pytest.raises(CheckpointDamagedError, match=r"step 2 in .* is damaged"):
        host_trainer(_table("callback", "sgd"), checkpoint_dir=str(directory))
    _resumes_step_1(directory, at_step_1, r"resuming from the previous step 1")


def test_a_table_that_reads_back_changed_is_a_damaged_step(tmp_path):
    """Bytes of a table's file that decode to other values raise no error in orbax: the CRC-32
    saved with each table names it, restoring is refused, and resuming passes over the step."""
    import tensorstore as ts

    from jaxpar.checkpoint import CheckpointDamagedError

    directory, at_step_1 = _two_saved_steps(tmp_path)
    stored = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{directory}/2/rows/"},
                      "path": "table/"}).result()
    changed = stored.read().result().copy()
    changed[0, 0] += 1.0
    stored.write(changed).result()          # well-formed files, other values
    damaged = (r"step 2 in .* is damaged \(ValueError: 1 row table\(s\) read back without an error but with other "
               r"values than were saved \(their checksums differ\): \['table'\]\)")
    with pytest.raises(CheckpointDamagedError, match=damaged):
        host_trainer(_table("callback", "sgd")).restore(str(directory))
    with pytest.raises(CheckpointDamagedError, match=damaged):
        jaxpar.checkpoint.restore_rows(str(directory), 2)
    _resumes_step_1(directory, at_step_1, r"step 2 .*\['table'\].*resuming from the previous step 1")
