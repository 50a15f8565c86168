"""The click dataset (deterministic, disjoint across processes, resumable) and the DLRM-style
model (its loss falls well below log 2 on it; pulled rows give the same logits as its table)."""

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.data.clicks import ClickData
from jaxpar.models.dlrm import DLRM, DLRMConfig, loss_fn

DATA = ClickData(field_rows=(200, 100, 52))   # 352 rows: the table splits over 4 or 8 devices
CONFIG = DLRMConfig(field_rows=DATA.field_rows, embed=8, bottom=(16,), top=(16,))


def test_dataset_is_deterministic_and_disjoint_across_processes():
    first = DATA.batch(3, 64)
    again = ClickData(field_rows=DATA.field_rows).batch(3, 64)  # a new object: nothing cached counts
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert not np.array_equal(first["dense"], DATA.batch(4, 64)["dense"])
    # Any process count reads the same global batch, each process its own contiguous block.
    for count in (2, 4):
        parts = [DATA.batch(3, 64, process_index=p, process_count=count) for p in range(count)]
        for key in first:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), first[key])
    # Examples are functions of their index: a block of step 3 is a block of the whole stream.
    np.testing.assert_array_equal(DATA.examples(np.arange(3 * 64, 4 * 64))["ids"], first["ids"])
    with pytest.raises(ValueError, match="batch_size=10 must split evenly over process_count=4"):
        DATA.batch(0, 10, process_index=0, process_count=4)


def test_ids_follow_zipf_and_labels_carry_signal():
    ids = DATA.batch(0, 4096)["ids"]
    counts = np.bincount(ids[:, 0], minlength=200)
    assert counts[0] > 5 * counts[10] > 0 and counts[0] > counts[1] > counts[3]
    assert ids.min() >= 0 and all(ids[:, f].max() < r for f, r in enumerate(DATA.field_rows))
    assert 0.3 < DATA.batch(0, 4096)["label"].mean() < 0.7


def test_model_loss_falls_well_below_log2():
    model = DLRM(CONFIG, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    held_out = DATA.eval_batch(2048)
    start = float(loss_fn(model, held_out))
    for s in range(40):
        step(model, opt, DATA.batch(s, 256))
    end = float(loss_fn(model, held_out))
    assert start > 0.6 and end < 0.6 * math.log(2), (start, end)


def test_pulled_rows_give_the_table_logits():
    model = DLRM(CONFIG, rngs=nnx.Rngs(0))
    batch = DATA.batch(0, 16)
    ids = CONFIG.table_ids(batch["ids"])
    unique, inverse = np.unique(ids, return_inverse=True)
    rows = np.asarray(model.table[...])[unique]
    np.testing.assert_allclose(model(batch["dense"], rows=rows, inverse=inverse.reshape(ids.shape)),
                               model(batch["dense"], batch["ids"]), rtol=1e-6)


def test_table_splits_over_a_mesh_axis_like_one_device():
    """The in-model table names its dimensions ("rows", "embed"): a rule shards its rows, the
    batch goes over "data", and jaxpar's Trainer gives the one-device losses."""
    def losses(config):
        n = math.prod(config.mesh.values())
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
        model = jaxpar.init(lambda: DLRM(CONFIG, rngs=nnx.Rngs(0)), config, mesh)
        trainer = jaxpar.Trainer(model, optax.adam(0.02), loss_fn, config, mesh)
        out = [float(trainer.step(DATA.batch(s, 64))["loss"]) for s in range(4)]
        return out, trainer.model.table[...].sharding.spec

    one, _ = losses(jaxpar.ParallelConfig(mesh={"data": 1}))
    split, spec = losses(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                               rules={"batch": "data", "rows": "model"}))
    assert spec[0] == "model"
    np.testing.assert_allclose(split, one, rtol=1e-5)


@pytest.mark.parametrize("make, error", [
    (lambda: DATA.batch(0, 8, process_count=0), "process_count=0 must be a whole number >= 1"),
    (lambda: DATA.batch(-1, 8), "step=-1 must be a whole number >= 0"),
    (lambda: ClickData(field_rows=(5,), dense=0), "dense=0 must be a whole number from 1 to 400"),
    (lambda: ClickData(field_rows=(5,), seed=-1), "seed=-1 must be a whole number from 0"),
    # field 100 would draw its ids from dense feature 0's stream, field 500 from the labels'
    (lambda: ClickData(field_rows=(5,) * 101), "field_rows has 101 fields; at most 100"),
    (lambda: DLRMConfig(field_rows=[10, 5]), r"field_rows=\[10, 5\] must be a tuple"),
    (lambda: DLRMConfig(field_rows=(10,), embed=0), "embed=0 must be a positive whole number"),
    (lambda: DLRMConfig(field_rows=(10,), bottom=(0,)), r"bottom=\(0,\) must be a tuple of positive"),
])
def test_bad_data_and_config_values_are_named(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_bad_ids_and_inputs_are_named_before_the_lookup():
    """An id past its field's rows would read the next field's row (or a clamped one) silently."""
    model, dense = DLRM(CONFIG, rngs=nnx.Rngs(0)), np.zeros((2, CONFIG.dense), np.float32)
    with pytest.raises(ValueError, match=r"field 0 has rows 0..199, but the ids \(shape \(2, 3\)\) hold 200"):
        model(dense, np.array([[200, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="field 2 has rows 0..51, but the ids .* hold -1"):
        CONFIG.table_ids(np.array([[0, 0, -1]]))
    with pytest.raises(ValueError, match=r"ids of shape \(2, 2\) must be \[batch, 3\]"):
        model(dense, np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match=r"DLRM: ids of dtype float32 \(shape \(2, 3\)\); ids must be integers"):
        model(dense, np.zeros((2, 3), np.float32))     # was JAX's "Indexer must have integer or boolean type"
    with pytest.raises(TypeError, match=r"DLRM: ids of dtype float32"):
        jax.jit(model)(dense, jax.numpy.zeros((2, 3)))  # traced ids too
    with pytest.raises(ValueError, match=r"dense of shape \(2, 3\) must be \[batch, 4\]"):
        model(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="built with table=False"):
        DLRM(CONFIG, rngs=nnx.Rngs(0), table=False)(dense, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match=r"rows= needs inverse= of shape \[batch, fields\] = \(2, 3\)"):
        model(dense, rows=np.zeros((4, CONFIG.embed), np.float32))
