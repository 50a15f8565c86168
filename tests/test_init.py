"""jaxpar.init: sharded from the start; parameter strategies by logical names or by path."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import LR, MEGATRON, TINY, batches
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.nn import init_program
from jaxpar.nn.sliced_init import SMALL


class ThirdPartyMLP(nnx.Module):
    """A model with no sharding annotations at all (written elsewhere)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_logical_rules_plan():
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh)
    state = nnx.state(model, nnx.Param)
    assert state["wte"].get_value().sharding.spec == P("model", None)
    assert state["blocks"][1]["attn"]["wo"].get_value().sharding.spec == P("model", None, None)
    assert state["ln_f"]["scale"].get_value().sharding.spec == P(None)


class Wide(nnx.Module):
    """Random kernels, zero biases, an array the constructor closes over and a Python scalar."""

    def __init__(self, rngs):
        self.up = nnx.Linear(256, 1024, rngs=rngs)
        self.down = nnx.Linear(1024, 256, rngs=rngs)
        self.table = nnx.Param(np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
        self.scale = nnx.Param(0.5)


def test_no_device_holds_a_full_replica():
    """Every device holds 1/8 of a parameter split 8 ways — also inside each init program."""
    cfg = jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy={"up/kernel": (1, 8), "down/kernel": (8, 1)})
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), cfg, mesh)
    kernel = model.up.kernel.get_value()
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 8)}

    patterns = {"up/kernel": (1, 8), "down/kernel": (8, 1), "table": (8, 1)}
    cfg = jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy=patterns)
    _, program = init_program(lambda: Wide(nnx.Rngs(0)), cfg, mesh, split="variables")
    programs = program.programs()
    # Only the computed variables have a program; the closed-over table and the scalar are
    # placed shard by shard (device_put), the biases share one program per shape.
    assert sorted(path for path, _, _ in programs) == ["0/down/bias/value", "0/down/kernel/value",
                                                       "0/up/bias/value", "0/up/kernel/value"]
    for path, jitted, args in programs:
        assert all(np.size(a) <= SMALL for a in args), path  # what comes in: a key, never a parameter
        per_device = jaxpar.report.memory(jitted.lower(*args).compile())
        full = (256 * 1024 if "kernel" in path else 1024 if "up" in path else 256) * 4
        if "kernel" in path:   # split 8 ways: its shard out, and no room for the whole of it
            assert per_device.output_bytes == full // 8, path
            assert per_device.output_bytes + per_device.temp_bytes < full, path
        else:
            assert per_device.output_bytes == full, path
    # as one program (what split="auto" picks for a model this small): every shard out, and no
    # room for one whole kernel
    _, whole = init_program(lambda: Wide(nnx.Rngs(0)), cfg, mesh)
    assert whole.whole
    [(path, jitted, args)] = whole.programs()
    assert path == "(whole model)" and all(np.size(a) <= SMALL for a in args)
    per_device = jaxpar.report.memory(jitted.lower(*args).compile())
    shards = 2 * 256 * 1024 * 4 // 8 + (1024 + 256) * 4
    assert 0 <= per_device.output_bytes - shards <= 64     # and the output tuple's pointers
    assert per_device.output_bytes + per_device.temp_bytes < 256 * 1024 * 4
    params, _ = program()
    table = params["table"].get_value()
    assert {s.data.shape for s in table.addressable_shards} == {(8, 8)}
    np.testing.assert_array_equal(np.asarray(table), np.arange(64 * 8).reshape(64, 8))
    assert float(params["scale"].get_value()) == 0.5


def whole_program_init(model_fn, cfg, mesh):
    """What jaxpar.init did before: one jax.jit of the whole constructor, out_shardings = plan."""
    graphdef, abs_params, abs_rest = nnx.split(jaxpar.nn.abstract_model(model_fn), nnx.Param, ...)
    shardings = tuple(jaxpar.nn.to_shardings(jaxpar.nn.state_specs(cfg, mesh, s, check_unused=False), mesh)
                      for s in (abs_params, abs_rest))

    def make():
        with nnx.use_eager_sharding(False):
            return nnx.split(model_fn(), nnx.Param, ...)[1:]

    return nnx.merge(graphdef, *jax.jit(make, out_shardings=shardings)())


class KeepsRngs(nnx.Module):
    """Non-parameter state: a dropout's PRNG key and counter, batch statistics."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)


MODELS = {
    "llama-unrolled": lambda: Llama(LlamaConfig.named("tiny", layers=2), rngs=nnx.Rngs(3)),
    "llama-scanned": lambda: Llama(LlamaConfig.named("tiny", layers=2, scan_layers=True), rngs=nnx.Rngs(3)),
    "keys-and-batch-stats": lambda: KeepsRngs(nnx.Rngs(0, dropout=5)),
}


@pytest.mark.parametrize("split", ["variables", "whole"])
@pytest.mark.parametrize("name", list(MODELS))
def test_init_equals_one_whole_model_program(name, split):
    """Variable by variable, bit for bit, the values and placements of one jitted init."""
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    graphdef, program = init_program(MODELS[name], cfg, mesh, split=split)
    assert program.whole == (split == "whole")
    mine = nnx.to_flat_state(nnx.state(nnx.merge(graphdef, *program())))
    theirs = dict(nnx.to_flat_state(nnx.state(whole_program_init(MODELS[name], cfg, mesh))))
    assert len(mine) == len(theirs) > 5
    for path, variable in mine:
        a, b = variable.get_value(), theirs[path].get_value()
        assert a.sharding == b.sharding, path
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_unrolled_layers_share_their_programs():
    """One program per kind of variable: 3 unrolled layers compile what 1 layer does."""
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    counts = [init_program(lambda: Llama(LlamaConfig.named("tiny", layers=n), rngs=nnx.Rngs(0)), cfg, mesh)[1]
              .program_count for n in (1, 3)]
    # tiny: embedding = down (64, 32), gate = up = head (32, 64), wq, wk = wv, wo, the norm scales
    assert counts == [6, 6]


def test_auto_split_compiles_the_cheaper_way_and_a_second_init_compiles_nothing(caplog):
    """A model with variables of many kinds runs one program, a tiny Llama a program per kind
    (`sliced_init.WHOLE_EQNS_PER_PROGRAM`); building either again reuses its jitted programs."""
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(cfg)
    many = lambda: KeepsRngs(nnx.Rngs(0, dropout=5))  # noqa: E731
    few = lambda: Llama(LlamaConfig.named("tiny", layers=2), rngs=nnx.Rngs(3))  # noqa: E731
    assert init_program(many, cfg, mesh)[1].whole
    assert not init_program(few, cfg, mesh)[1].whole
    with pytest.raises(ValueError, match=r"split='layers' is not one of \('auto', 'variables', 'whole'\)"):
        init_program(few, cfg, mesh, split="layers")
    for fn in (many, few):
        jaxpar.init(fn, cfg, mesh)
        programs = [jitted for _, jitted, _ in init_program(fn, cfg, mesh)[1].programs()]
        again = [jitted for _, jitted, _ in init_program(fn, cfg, mesh)[1].programs()]
        assert all(a is b for a, b in zip(programs, again)) and len(programs) == len(again)
        caplog.clear()
        with jax.log_compiles(), caplog.at_level(logging.WARNING):
            jaxpar.init(fn, cfg, mesh)
        assert not [r for r in caplog.records if "Compiling" in r.getMessage()]   # nothing traced or compiled again


class PrintsAParameter(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))
        jax.debug.print("sum {}", self.w[...].sum())


def test_init_refuses_a_side_effect_on_initializer_values():
    mesh = jaxpar.make_mesh({"data": 8})
    with pytest.raises(ValueError, match=r"runs 'debug_\w+', which has side effects.*jaxpar.nn.place"):
        jaxpar.init(lambda: PrintsAParameter(nnx.Rngs(0)), jaxpar.ParallelConfig(mesh={"data": 8}), mesh)


def test_parameter_strategy_trains_third_party_model_like_one_device():
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x)}

    def mse(model, b):
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    def run(cfg, n):
        mesh = jaxpar.make_mesh(cfg, devices=jax.devices()[:n])
        model = jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), cfg, mesh)
        trainer = jaxpar.Trainer(model, optax.adam(1e-2), mse, cfg, mesh)
        return [float(trainer.step(batch)["loss"]) for _ in range(4)]

    patterns = {"up/kernel": (1, 4), "up/bias": (4,), "down/kernel": (4, 1)}
    sharded = run(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, parameter_strategy=patterns), 8)
    np.testing.assert_allclose(sharded, run(jaxpar.ParallelConfig(mesh={"data": 1}), 1), rtol=1e-5)


def test_parameter_strategy_errors():
    mesh = jaxpar.make_mesh({"model": 8})
    fn = lambda: ThirdPartyMLP(nnx.Rngs(0))  # noqa: E731
    with pytest.raises(ValueError, match=r"patterns \['upp/\*'\] match no parameter"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy={"upp/*": (1, 8)}), mesh)
    with pytest.raises(ValueError, match="matches several parameter_strategy patterns"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy={"up/*": (1,), "*/bias": (1,)}), mesh)
    with pytest.raises(ValueError, match=r"parameter 'down/bias'.*factor 3 does not divide dimension 0 of size 16"):
        jaxpar.init(fn, jaxpar.ParallelConfig(mesh={"model": 8}, parameter_strategy={"down/bias": (3,)}), mesh)


def test_init_type_errors():
    mesh = jaxpar.make_mesh({"data": 8})
    with pytest.raises(TypeError, match="function that builds the model"):
        jaxpar.init(ThirdPartyMLP(nnx.Rngs(0)), jaxpar.ParallelConfig(), mesh)
    with pytest.raises(TypeError, match="expects a ParallelConfig"):
        jaxpar.init(lambda: ThirdPartyMLP(nnx.Rngs(0)), {"mesh": {"data": 8}}, mesh)


def test_trainer_errors():
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh)
    with pytest.raises(ValueError, match="pipeline.stages > 1 with mode='hybrid' is not supported"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, jaxpar.ParallelConfig(
            mesh={"data": 4, "pipe": 2}, mode="hybrid", pipeline={"stages": 2}), jaxpar.make_mesh({"data": 4, "pipe": 2}))
    with pytest.raises(ValueError, match="does not match the mesh"):
        jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}), mesh)
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jaxpar.Trainer(model, "adam", loss_fn, cfg, mesh)
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        jaxpar.Trainer({"w": 1}, optax.sgd(0.1), loss_fn, cfg, mesh)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, cfg, mesh)
    bad = {k: v[:6] for k, v in batches(1)[0].items()}
    with pytest.raises(ValueError, match=r"batch dimension 6 is not divisible by 8.*multiple of 8"):
        trainer.step(bad)
    with pytest.raises(ValueError, match="scalar loss"):
        jaxpar.Trainer(model, optax.sgd(0.1), lambda m, b: m(b["inputs"]), cfg, mesh).step(batches(1)[0])


@pytest.mark.slow  # ~20 s of compiling on an empty compilation cache (6 inits from a fresh state), ~6 s warm
def test_init_benchmark_quick(tmp_path):
    """benchmarks/init.py --quick runs end to end and writes its table's rows."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "init.py"
    spec = importlib.util.spec_from_file_location("bench_init", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--out", str(tmp_path / "init.json")]) == 0
    rows = json.loads((tmp_path / "init.json").read_text())["results"]
    assert [(r["layers"], r["method"]) for r in rows] == [(layers, m) for layers in ("unrolled", "scanned")
                                                          for m in bench.METHODS]
    assert all(r["seconds"] > 0 and r["over_eager"] > 0 for r in rows)
    assert {r["programs"] for r in rows if r["method"] == "jaxpar.init"} == {6, 9}
    assert (tmp_path / "init.png").stat().st_size > 0


def test_restored_values_compile_nothing_and_a_resume_overwrites_every_one(tmp_path):
    """``init(values="restored")`` places zeros (dropout keys included) without compiling a
    program; the Trainer's resume overwrites every leaf of the state, which then equals a
    computed model's resumed state, and trains on to the same losses."""
    import dataclasses

    gpt = dataclasses.replace(TINY, dropout=0.1)
    cfg = jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, rules=MEGATRON, optimizer={"level": 3, "threshold_kb": 0})
    mesh = jaxpar.make_mesh(cfg)
    make = lambda: GPT(gpt, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=str(tmp_path), save_every=2))
    data = batches(4)
    with jaxpar.Trainer(jaxpar.init(make, cfg, mesh), optax.adamw(LR), loss_fn, cfg, mesh, services=services) as t:
        for b in data[:2]:
            t.step(b)
    compiled = []

    def record(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        placeholders = jaxpar.init(make, cfg, mesh, values="restored")
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert not compiled
    state = nnx.state(placeholders)
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(state))
    computed = jaxpar.init(make, cfg, mesh)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(computed))):
        assert x.shape == y.shape and x.dtype == y.dtype and x.sharding == y.sharding

    resumed = [jaxpar.Trainer(m, optax.adamw(LR), loss_fn, cfg, mesh,
                              services=jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=str(tmp_path))))
               for m in (placeholders, computed)]
    assert [t.step_count for t in resumed] == [2, 2]
    keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    for x, y in zip(jax.tree.leaves(resumed[0].state), jax.tree.leaves(resumed[1].state)):
        np.testing.assert_array_equal(np.asarray(keys(x)), np.asarray(keys(y)))
    losses = [[float(t.step(b)["loss"]) for b in data[2:]] for t in resumed]
    assert losses[0] == losses[1]
    for t in resumed:
        t.close()


def test_restored_values_are_refused_when_nothing_is_restored(tmp_path):
    cfg = jaxpar.ParallelConfig(mesh={"data": 8})
    mesh = jaxpar.make_mesh(cfg)
    make = lambda: GPT(TINY, rngs=nnx.Rngs(0))  # noqa: E731
    with pytest.raises(ValueError, match=r"values='mean' is not one of \('computed', 'restored'\)"):
        jaxpar.init(make, cfg, mesh, values="mean")
    for services, words in ((None, "services has no checkpoint to resume"),
                            (jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=str(tmp_path / "empty"))),
                             "services.checkpoint.dir=.*empty' holds no step to resume")):
        with pytest.raises(ValueError, match="built with jaxpar.init\\(..., values='restored'\\), whose variables "
                                             f"are zeros for a checkpoint to overwrite, but {words}; build it with "
                                             "values='computed'"):
            jaxpar.Trainer(jaxpar.init(make, cfg, mesh, values="restored"), optax.adamw(LR), loss_fn, cfg, mesh,
                           services=services)
