"""TrainPlan / TrainState, and the combinations that used to break (each test names the failure it guards)."""

import dataclasses
import json
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from helpers import BATCH, MEGATRON, TINY, batches, no_unclosed_files
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.nn.specs import format_specs, itemsize, spec_rows, state_specs

DROPOUT = dataclasses.replace(TINY, dropout=0.1)
SCANNED = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=4, scan_layers=True, dropout=0.1)


def _trainer(config, gpt=DROPOUT, loss=loss_fn, **kw):
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss, config, mesh, **kw)


def _counts(trainer):
    return [int(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.rest) if "count" in jax.tree_util.keystr(p)]


# ------------------------------------------------------------------ the plan and the state


def test_train_plan_is_a_pure_value_that_saves_loads_and_diffs(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON, optimizer={"level": 1, "threshold_kb": 0})
    abstract = nnx.eval_shape(lambda: GPT(DROPOUT, rngs=nnx.Rngs(0)))
    plan = jaxpar.make_train_plan(config, {"data": 2, "model": 4}, abstract, optax.adamw(1e-3))
    again = jaxpar.make_train_plan(config, {"data": 2, "model": 4}, abstract, optax.adamw(1e-3))
    assert plan == again and hash(plan) == hash(again)
    assert plan.params["blocks/0/mlp/up"] == P(None, "model")
    assert plan.update["blocks/0/mlp/up"] == P("data", "model")          # ZeRO-1: the update runs on shards
    assert plan.stored["blocks/0/mlp/up"] == P(None, "model")            # ... parameters stay whole
    assert any(path.startswith("0/mu/") for path in plan.opt_state)
    assert plan.rest["blocks/0/drop/rngs/count"] == P()
    plan.to_json(tmp_path / "plan.json")
    assert jaxpar.TrainPlan.from_json(tmp_path / "plan.json") == plan
    zero3 = jaxpar.make_train_plan(dataclasses.replace(config, optimizer={"level": 3, "threshold_kb": 0}),
                                   {"data": 2, "model": 4}, abstract, optax.adamw(1e-3))
    diff = plan.diff(zero3)
    assert any(line.startswith("stored/blocks/0/mlp/up: (None, 'model') -> ('data', 'model')") for line in diff)
    with no_unclosed_files():    # the table's console once wrote to an open("/dev/null") never closed
        assert "blocks/0/mlp/up" in plan.table() and "ZeRO-1" in plan.table()
    with pytest.raises(ValueError, match="not a jaxpar train plan"):
        jaxpar.TrainPlan.from_dict({"format": "something else"})


def test_a_saved_plan_trains_like_the_config(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    direct = _trainer(config)
    direct.plan.to_json(tmp_path / "plan.json")
    loaded = _trainer(config, plan=jaxpar.TrainPlan.from_json(tmp_path / "plan.json"))
    for b in batches(2):
        np.testing.assert_allclose(float(loaded.step(b)["loss"]), float(direct.step(b)["loss"]), rtol=1e-6)
    with pytest.raises(ValueError, match="plan is for mesh"):
        other = jaxpar.ParallelConfig(mesh={"data": 8})
        _trainer(other, plan=direct.plan)


def test_a_plan_of_another_config_is_refused():
    """The Trainer checks ``config`` and runs the plan: a plan made for another config would run
    what was never checked, so it is refused naming the fields that differ."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    plan = _trainer(config).plan
    other = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON, grad_accum=2)
    with pytest.raises(ValueError, match=r"plan was made for another config than config= \(field: \(config, "
                                         r"plan's\): \{'grad_accum': \(2, 1\)\}\); pass config=plan.config"):
        _trainer(other, plan=plan)


def test_train_state_is_a_pytree_with_a_json_data_position():
    trainer = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}))
    trainer.step(batches(1)[0])
    state = trainer.state
    assert isinstance(state, jaxpar.TrainState) and int(state.step) == 1 == trainer.step_count
    doubled = jax.tree.map(lambda x: x, state)
    assert jax.tree.structure(doubled) == jax.tree.structure(state)
    trainer.data_state = {"epoch": np.int64(2), "files": ["a", "b"]}          # numpy scalars become ints
    assert trainer.state.data == {"epoch": 2, "files": ["a", "b"]}
    with pytest.raises(TypeError, match=r"data_state\['pos'\] = .*not JSON-able"):
        trainer.data_state = {"pos": object()}
    trainer.step(batches(2)[1])                                              # a data position never recompiles
    assert len(trainer._compiled) == 1 and trainer.state.data["epoch"] == 2


# ------------------------------------------------------------------ failures that were measured


def test_models_with_rng_state_plan_and_search():
    """Dropout RNG state made the search (key<fry> dtype) and spec_rows raise TypeError."""
    model = GPT(DROPOUT, rngs=nnx.Rngs(0))
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto", search="dynamic_programming")
    found = jaxpar.auto.search(model, loss_fn, batches(1)[0], config, {"data": 2, "model": 4})
    assert found.params
    rest = nnx.state(model, nnx.Not(nnx.Param))
    rows = spec_rows(rest, state_specs(config, {"data": 2, "model": 4}, rest, check_unused=False), {"data": 2, "model": 4})
    assert any("key" in r.dtype for r in rows)
    with no_unclosed_files():
        assert "count" in format_specs(rows)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_prng_key_is_its_key_data_in_every_byte_count(impl):
    """Four bytes-per-element helpers disagreed on keys: the train plan and the memory estimate
    counted a threefry key as 4 bytes, spec_rows and the auto graph as 8 (its two uint32)."""
    key = jax.random.key(0, impl=impl)
    data = jax.random.key_data(key)
    assert itemsize(key.dtype) == itemsize(str(key.dtype)) == data.nbytes == data.size * 4   # threefry 8, rbg 16
    keys = jax.random.split(key, 3)
    rows = spec_rows({"keys": nnx.Variable(keys)}, {"keys": P()}, {"data": 2})
    assert rows[0].bytes_total == 3 * data.nbytes
    abstract = nnx.eval_shape(lambda: GPT(TINY, rngs=nnx.Rngs(0)))
    plan = jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 2}), {"data": 2}, abstract, optax.sgd(0.1))
    path = next(iter(plan.shapes))
    keyed = dataclasses.replace(plan, shapes={**plan.shapes, path: ((3,), str(key.dtype))})   # as a saved plan holds it
    assert {r[0]: r[5] for r in keyed.rows()}[path] == 3 * data.nbytes
    with pytest.raises(ValueError, match="'key<nope>' is no PRNG key dtype"):
        itemsize("key<nope>")


def test_plan_summary_says_how_the_batch_is_split():
    """The summary named the default batch axes ("batch over ('data',)") whatever
    dataset_strategy said, so a replicated batch read as split over data."""
    abstract = nnx.eval_shape(lambda: GPT(TINY, rngs=nnx.Rngs(0)))
    shapes = {"x": jax.ShapeDtypeStruct((8, 4), np.float32), "y": jax.ShapeDtypeStruct((8,), np.int32)}
    layout = jaxpar.Layout((4, 2), ("data", "model"))
    default = jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}), {"data": 4, "model": 2},
                                     abstract, optax.sgd(0.1))
    for strategy, text, specs in (
            (None, "batch over ('data',);", {"x": P("data"), "y": P("data")}),
            ("full_batch", "batch replicated (dataset_strategy='full_batch');", {"x": P(), "y": P()}),
            ((4, 2), "batch by dataset_strategy (4, 2);", {"x": P("data", "model"), "y": None}),
            ({"x": "full_batch", "y": None}, "batch per key: x replicated (full_batch), y over ('data',);",
             {"x": P(), "y": P("data")}),
            # a Layout's spec or a PartitionSpec reads as the PartitionSpec it resolves to
            # (tuple(strategy) raised "'LayoutSpec' object is not iterable" in print(plan))
            (layout("data", "None"), "batch by dataset_strategy P('data', None);", {"x": P("data", None), "y": None}),
            ({"x": layout("data", "model"), "y": P("data")},
             "batch per key: x by strategy P('data', 'model'), y by strategy P('data',);",
             {"x": P("data", "model"), "y": P("data")})):
        config = jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, dataset_strategy=strategy)
        plan = jaxpar.make_train_plan(config, {"data": 4, "model": 2}, abstract, optax.sgd(0.1))
        assert text in plan.summary(), (strategy, plan.summary())
        assert str(plan).rstrip("\n").endswith(plan.summary())      # print(plan): the table, then the summary
        assert strategy is None or any(text in line for line in plan.diff(default)), plan.diff(default)
        got = plan.batch_specs({k: v for k, v in shapes.items() if specs[k] is not None})
        assert got == {k: v for k, v in specs.items() if v is not None}
    assert plan.batch_axes() == ("data",)      # the default axes, for the step, whatever the strategy


def test_an_idle_mesh_axis_is_named_by_the_plan_and_the_trainer():
    """A mesh axis that no rule, batch split or parameter uses had the devices along it repeat
    the same compute and memory, without a word: the plan's summary names it, and the Trainer
    warns at construction, naming the axis, its size and the fixes. Any use silences both."""
    abstract = nnx.eval_shape(lambda: GPT(TINY, rngs=nnx.Rngs(0)))
    states = nnx.split(abstract, nnx.Param, ...)[1:]     # (params, rest): no model check (context below)

    def plan(mesh=None, **kw):
        mesh = mesh or {"data": 2, "model": 4}
        return jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh=mesh, **kw), mesh, states, optax.adamw(1e-3))

    idle = plan()
    assert idle.idle_axes() == {"model": 4}
    assert "idle mesh axes {'model': 4}" in idle.summary() and str(idle).rstrip("\n").endswith(idle.summary())
    assert any("idle mesh axes" in line for line in idle.diff(plan(rules=MEGATRON)))
    for mesh, used in ((None, {"rules": {"mlp": "model"}}),                        # a rule
                       (None, {"rules": {"batch": ("data", "model")}}),            # the batch split
                       (None, {"dataset_strategy": (8, 1)}),
                       (None, {"parameter_strategy": {"blocks/*/mlp/up": P(None, "model")}}),
                       (None, {"optimizer": {"level": 1, "axis": ("data", "model"), "threshold_kb": 0}}),  # ZeRO
                       (None, {"mode": "data"}),             # the batch over every axis
                       (None, {"mode": "hybrid"}),           # the per-device loss's own collectives
                       ({"data": 4, "pipe": 2}, {"pipeline": {"stages": 2, "microbatches": 2}}),
                       ({"data": 2, "context": 4}, {"context": {"axis": "context"}}),
                       ({"data": 2, "expert": 4}, {"rules": {"expert": "expert"}}),
                       ({"data": 8, "model": 1}, {})):        # size 1: nothing repeats
        quiet = plan(mesh, **used)
        assert quiet.idle_axes() == {} and "idle" not in quiet.summary(), (mesh, used, quiet.summary())
    # a searched plan (mode="auto"): the search assigned the axes
    assert dataclasses.replace(idle, source="searched:dynamic_programming").idle_axes() == {}
    # mode="data" with an axis set aside for a pipeline that is off: the fix is the pipeline
    piped = plan({"data": 4, "pipe": 2}, mode="data")
    assert piped.idle_axes() == {"pipe": 2} and "pipeline={'stages': 2, 'axis': 'pipe'}" in piped.idle_axes_note()
    # the batch kept whole on every device: the fix is to split it (it advised rules={'batch': ('data', 'data')})
    whole = plan(dataset_strategy="full_batch")
    assert whole.idle_axes() == {"data": 2, "model": 4}
    assert "(dataset_strategy='full_batch' keeps the batch off it: drop it)" in whole.idle_axes_note()
    assert whole.idle_axes_note(used=("data", "model")) is None
    assert whole.idle_axes_note(("data",)).startswith("mesh axis 'model' (size 4)")

    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4})
    with warnings.catch_warnings():      # the step is not traced yet: the model may still split over 'model'
        warnings.simplefilter("error", jaxpar.plan.IdleAxisWarning)
        trainer = _trainer(config, gpt=TINY)
    with pytest.warns(jaxpar.plan.IdleAxisWarning) as caught:
        trainer.step(batches(1)[0])
    assert len(caught) == 1 and caught[0].filename == __file__       # at the user's line that traced the step
    assert str(caught[0].message) == (
        "Trainer: mesh axis 'model' (size 4) of mesh {'data': 2, 'model': 4} is idle: no rule, batch split, "
        "parameter, optimizer-state (ZeRO) shard, pipeline stage or context axis uses it, nor does a jaxpar "
        "strategy in the traced step (jaxpar.shard, jaxpar.ops, Layout, LogicalConstraint) or the row source, so "
        "the 4 devices along 'model' repeat the same compute and hold the same memory. To use it, map a logical "
        "axis to it (e.g. rules={'mlp': 'model'}), split the batch over it (rules={'batch': ('data', 'model')} or "
        "a dataset_strategy), or use a smaller mesh ({'data': 2} on 2 devices)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpar.plan.IdleAxisWarning)
        trainer.step(batches(2)[1])                                   # once per Trainer
        _trainer(dataclasses.replace(config, rules=MEGATRON), gpt=TINY).step(batches(1)[0])


class _Split(nnx.Module):
    """``mean((x @ w)^2)`` whose matmul splits as ``split(x, w)`` says: the model's own strategy."""

    def __init__(self, split):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (8, 16)) * 0.1)
        self.split = split

    def __call__(self, x):
        return jax.numpy.mean(self.split(x, self.w[...]) ** 2)


_LAYOUT = jaxpar.Layout((2, 4), ("data", "model"))


def _heads(x, w):
    q = (x @ w).reshape(8, 1, 4, 4)                   # [B, S, H, D]: 4 heads over 'model'
    return jaxpar.ops.attention(q, q, q, heads_axis="model").reshape(8, 16)


@pytest.mark.parametrize("split, warns", [
    (jaxpar.shard(jax.numpy.matmul, in_strategy=((2, 1), (1, 4))), False),                 # docs/operators.md
    (lambda x, w: jaxpar.ops.matmul(x, w, in_strategy=((2, 1), (1, 4))), False),
    (lambda x, w: jaxpar.shard(x @ w, _LAYOUT("data", "model")), False),                   # a Layout
    (_heads, False),                                                                       # an operator's axis
    (lambda x, w: jaxpar.shard(x @ w, (2, 1)), True),                                      # over 'data' only
    (jax.numpy.matmul, True),                                                              # no strategy
], ids=["shard", "ops.matmul", "layout", "ops.attention", "data-only", "none"])
def test_a_model_splitting_over_an_axis_itself_does_not_make_it_idle(split, warns):
    """The plan cannot see a model's own operator strategies: the Trainer warned at construction
    that 'model' was idle for a model that split its matmul over it with jaxpar.shard, jaxpar.ops
    or a Layout (documented usage). It now judges at the first traced step, by the axes the
    traced step's strategies resolved; a model that splits over nothing more still warns."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"batch": "data"})
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: _Split(split), config, mesh)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b: m(b["x"]), config, mesh)
    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
        warnings.simplefilter("always", jaxpar.plan.IdleAxisWarning)
        assert np.isfinite(float(trainer.step({"x": np.ones((8, 8), np.float32)})["loss"]))
    idle = [str(w.message) for w in caught if issubclass(w.category, jaxpar.plan.IdleAxisWarning)]
    assert len(idle) == warns, idle
    assert not warns or "mesh axis 'model' (size 4)" in idle[0]


class _Rows:
    """A row source pulling 8 rows of 4 values per batch (pushes nothing)."""

    def pull(self, batch):
        return batch, np.ones((8, 4), np.float32), None

    def push(self, handle, row_grads, step):
        pass


@pytest.mark.parametrize("split", [False, True])
def test_rows_split_over_an_axis_use_it(split, monkeypatch):
    """A row source whose pulled rows are split over a mesh axis (each process's block, in a job
    of several processes) uses that axis, which the plan does not see."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"batch": "data"})
    mesh = jaxpar.make_mesh(config)
    if split:     # as a source in a job of several processes places them; one process takes them whole
        monkeypatch.setattr(jaxpar.train.rows.RowPath, "shardings",
                            lambda self, rows: jax.tree.map(lambda _: NamedSharding(mesh, P(None, "model")), rows))
    model = jaxpar.init(lambda: _Split(jax.numpy.matmul), config, mesh)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b, rows: m(b["x"]) + rows.mean(), config, mesh,
                             rows=_Rows())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxpar.plan.IdleAxisWarning)
        trainer.step({"x": np.ones((8, 8), np.float32)})
    assert [w.category for w in caught if "mesh axis 'model'" in str(w.message)] == ([] if split else
                                                                                   [jaxpar.plan.IdleAxisWarning])


def test_save_with_partition_spec_and_layout_in_the_parameter_strategy(tmp_path):
    """orbax's JSON writer raised on a PartitionSpec or Layout in parameter_strategy."""
    layout = jaxpar.Layout((2, 4), ("data", "model"))
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"batch": "data"},
                                   parameter_strategy={"blocks/*/mlp/up": P(None, "model"),
                                                   "blocks/*/mlp/down": layout("model", "None")})
    trainer = _trainer(config, gpt=TINY)
    trainer.step(batches(1)[0])
    trainer.save(str(tmp_path))
    saved = jaxpar.checkpoint.load_strategy(str(tmp_path))["config"]
    assert jaxpar.ParallelConfig.from_dict(json.loads(json.dumps(saved))) == config
    rebuilt = _trainer(jaxpar.checkpoint.strategy_config(jaxpar.checkpoint.load_strategy(str(tmp_path))), gpt=TINY)
    assert rebuilt.restore(str(tmp_path))["step"] == 1
    rebuilt.step(batches(2)[1])
    rebuilt.save(str(tmp_path / "again"))                                     # a strategy_config trainer saves too


def test_an_auto_trainer_saves_and_restores(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="auto", search="dynamic_programming")
    trainer = _trainer(config, gpt=TINY, example_batch=batches(1)[0])
    assert trainer.plan.source == "searched:dynamic_programming" and trainer.searched is not None
    trainer.step(batches(1)[0])
    trainer.save(str(tmp_path))
    plain = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}), gpt=TINY)
    assert plain.restore(str(tmp_path))["step"] == 1


def test_hybrid_advances_the_non_parameter_state():
    """mode='hybrid' returned the incoming RNG counts: dropout masks repeated every step."""
    trainer = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid"))
    before = _counts(trainer)
    trainer.step(batches(1)[0])
    trainer.step(batches(2)[1])
    assert [c - b for c, b in zip(_counts(trainer), before)] == [4] * len(before)   # 2 dropouts x 2 steps


@pytest.mark.parametrize("stages", [1, 2])
def test_pipeline_loss_advances_the_blocks_rng_state(stages):
    """PipelineLoss dropped the blocks' RNG state: counts stood still, and with stages > 1 the
    executor failed on the key arrays."""
    rules = {"layers": "pipe", "batch": "data"} if stages > 1 else {"batch": "data"}
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4} if stages > 1 else {"data": 8}, rules=rules,
                                   pipeline={"stages": stages, "microbatches": 4})
    trainer = _trainer(config, gpt=SCANNED, loss=pipeline_loss())
    counts = np.asarray(trainer.rest["blocks"]["drop"]["rngs"]["count"].get_value())
    losses = [float(trainer.step(b)["loss"]) for b in batches(2)]
    after = np.asarray(trainer.rest["blocks"]["drop"]["rngs"]["count"].get_value())
    assert np.all(after == counts + 4) and np.all(np.isfinite(losses))


def test_pipeline_loss_is_exported():
    assert jaxpar.pipeline.PipelineLoss is type(pipeline_loss())


def test_pipelined_megatron_with_vocab_split_and_zero1_trains():
    """pipe x Megatron with vocab=model aborted the process; with ZeRO-1 it deadlocked."""
    rules = dict(MEGATRON, layers="pipe")
    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 2, "model": 2}, rules=rules,
                                   pipeline={"stages": 2, "microbatches": 4}, optimizer={"level": 1, "threshold_kb": 0})
    gpt = dataclasses.replace(SCANNED, dropout=0.0, fused_qkv=True)
    piped = _trainer(config, gpt=gpt, loss=pipeline_loss())
    one = _trainer(jaxpar.ParallelConfig(mesh={"data": 1}), gpt=gpt, loss=pipeline_loss()) if False else None
    losses = [float(piped.step(b)["loss"]) for b in batches(2)]
    assert np.all(np.isfinite(losses)) and one is None


# ------------------------------------------------------------------ the loop


def test_fit_reads_metrics_only_when_it_logs_and_keeps_the_history():
    trainer = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}), gpt=TINY)
    metrics = trainer.step(batches(1)[0])
    assert isinstance(metrics["loss"], jax.Array)                # not a Python float: no wait
    history = trainer.fit(batches(4), steps=4, log_every=3, progress=False)
    assert [r["step"] for r in history] == [2, 3, 4, 5] and all(np.isfinite(r["loss"]) for r in history)
    with pytest.raises(ValueError, match="ran out after 2 of 5 steps"):
        trainer.fit(batches(2), steps=5, log_every=10, progress=False)
    assert len(trainer.history) == 2


@pytest.mark.parametrize("batch, match", [
    ({"inputs": np.zeros((BATCH, 16), np.int32), "targets": np.zeros((), np.int32)}, r"batch\['targets'\] is a scalar"),
    ({"inputs": np.zeros((BATCH, 16), np.int32), "targets": np.zeros((8, 16), np.int32)}, "8 rows but"),
])
def test_bad_batches_are_named(batch, match):
    trainer = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}), gpt=TINY)
    with pytest.raises(ValueError, match=match):
        trainer.step(batch)


def test_a_loss_returning_three_values_is_named():
    trainer = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}), gpt=TINY,
                       loss=lambda m, b: (loss_fn(m, b), 1.0, 2.0))
    with pytest.raises(ValueError, match="tuple of 3 values"):
        trainer.step(batches(1)[0])
