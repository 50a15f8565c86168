"""Checkpoints: exact resume in a new process, resharding restores, strategy files, errors."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxpar
import jaxpar.checkpoint as ckpt
from jaxpar.checkpoint.state import Leaf, differences, flat_state, is_key
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.nn.specs import path_str, state_specs
from workers_ckpt import common

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers_ckpt")


def new_process(script, *args, timeout=240):
    """Run a worker in a fresh Python process; returns its ``RESULT`` JSON line."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": common.ROOT}
    proc = subprocess.run([sys.executable, os.path.join(WORKERS, script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """data=8: 5 steps, asynchronous save at step 5 while training goes on, 5 more steps."""
    directory = tmp_path_factory.mktemp("gpt") / "ckpt"
    trainer = common.gpt_trainer(common.DATA8)
    with ckpt.Checkpointer(directory, keep=2) as saver:
        first = common.run(trainer, 5)
        trainer.data_state = {"shard": 3}
        assert saver.save(trainer.plan, trainer.state, trainer.mesh) == 5
        second = common.run(trainer, 5)       # the arrays are donated while the files are written
    return directory, first + second


def test_exact_resume_in_a_new_process(gpt_run):
    directory, straight = gpt_run
    result = new_process("resume_worker.py", directory, 5, json.dumps(common.DATA8))
    assert result["step"] == 5 and result["data_state"] == {"shard": 3}
    assert result["losses"] == straight[5:]          # bitwise: the same floats


@pytest.mark.parametrize("layout", ["MEGATRON_2x4", "ONE"])
def test_resume_under_another_layout(gpt_run, layout):
    """data=8 → data=2,model=4 (tensor parallel), and 8 devices → 1."""
    directory, straight = gpt_run
    trainer = common.gpt_trainer(getattr(common, layout))
    meta = ckpt.restore(trainer, directory)
    assert meta["step"] == trainer.step_count == 5
    if layout == "MEGATRON_2x4":
        up = trainer.params["blocks"][0]["mlp"]["up"].get_value()
        assert up.sharding.spec == PartitionSpec(None, "model")
        assert up.addressable_shards[0].data.shape == (common.TINY.embed, common.TINY.mlp // 4)
        assert trainer.opt_state[0].mu["blocks"][0]["mlp"]["up"].get_value().sharding.spec == PartitionSpec(None, "model")
    np.testing.assert_allclose(common.run(trainer, 5), straight[5:], rtol=1e-5, atol=0)


def test_a_step_written_by_orbax_default_writer_restores_and_ours_splits_nothing(tmp_path, monkeypatch, caplog):
    """jaxpar writes every shard whole from its first replica, compiling nothing to cut it; a step
    that orbax's default writer split among the replicas (as jaxpar did before) restores alike."""
    import orbax.checkpoint as ocp

    from jaxpar.checkpoint import manager

    def slices_compiled(save):
        caplog.clear()
        with caplog.at_level("WARNING"), jax.log_compiles():
            save()
        return sum("Compiling jit(slice)" in r.getMessage() for r in caplog.records)

    trainer = common.gpt_trainer(common.DATA8)      # parameters replicated over 8 devices
    common.run(trainer, 2)
    assert slices_compiled(lambda: ckpt.save(trainer, tmp_path / "ours")) == 0
    straight = common.run(trainer, 2)
    init = manager.StateHandler.__init__

    def orbax_default(self):
        init(self)
        self._writer = ocp.PyTreeCheckpointHandler()     # orbax's global registry: replica-parallel on CPU
    monkeypatch.setattr(manager.StateHandler, "__init__", orbax_default)
    first = common.gpt_trainer(common.DATA8)
    common.run(first, 2)
    assert slices_compiled(lambda: ckpt.save(first, tmp_path / "orbax")) > 0     # the check sees them
    monkeypatch.undo()
    for directory in ("ours", "orbax"):
        again = common.gpt_trainer(common.DATA8)
        assert ckpt.restore(again, tmp_path / directory)["step"] == 2
        np.testing.assert_array_equal(common.run(again, 2), straight)


@pytest.mark.slow
def test_resume_zero1_into_zero3(tmp_path):
    """Optimizer-parallel levels store the same tree: ZeRO-1 saves restore into ZeRO-3."""
    zero = lambda level: {**common.DATA8, "mode": "semi_auto", "optimizer": {"level": level, "threshold_kb": 0}}
    source = common.gpt_trainer(zero(1))
    common.run(source, 3)
    ckpt.save(source, tmp_path)
    straight = common.run(source, 2)
    target = common.gpt_trainer(zero(3))
    ckpt.restore(target, tmp_path)
    np.testing.assert_allclose(common.run(target, 2), straight, rtol=1e-5, atol=0)


def test_rng_state_is_saved_and_restored(tmp_path):
    """RNG streams (``nnx.RngState`` in ``trainer.rest``: key and count) are part of the checkpoint."""
    trainer = common.mlp_trainer()
    keys = [p for p, x in flat_state(trainer).items() if is_key(x)]
    assert keys, "the model should keep an RNG stream in trainer.rest"

    def advance(var):  # what drawing 7 dropout masks would leave behind
        value = var.get_value()
        return var.replace(jax.random.fold_in(value, 7) if is_key(value) else value + 7)

    trainer.rest = jax.tree.map(advance, trainer.rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    ckpt.save(trainer, tmp_path)
    fresh = common.mlp_trainer()
    ckpt.restore(fresh, tmp_path)
    for path, value in flat_state(fresh).items():
        if path.startswith("rest/"):
            expected = flat_state(trainer)[path]
            assert is_key(value) == is_key(expected), path
            assert value.sharding.is_equivalent_to(expected.sharding, value.ndim), path
            if is_key(value):
                assert jax.random.key_impl(value) == jax.random.key_impl(expected)
                value, expected = jax.random.key_data(value), jax.random.key_data(expected)
            np.testing.assert_array_equal(value, expected, err_msg=path)


def test_checkpointer_keeps_the_last_k_and_resumes(tmp_path):
    trainer = common.mlp_trainer()
    with ckpt.Checkpointer(tmp_path, save_every=2, keep=2) as saver:
        assert saver.resume(trainer.state, trainer.mesh) is None
        for _ in range(6):
            common.run(trainer, 1)
            saver.maybe_save(trainer.plan, trainer.state, trainer.mesh)
        saver.wait()
        assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [4, 6]
    assert ckpt.latest_step(tmp_path) == 6
    fresh = common.mlp_trainer()
    with ckpt.Checkpointer(tmp_path, save_every=2, keep=2) as saver:
        state, meta = saver.resume(fresh.state, fresh.mesh)
        assert meta["step"] == int(state.step) == 6 and fresh.step_count == 0    # returned, not assigned
        fresh.state = state
    common.assert_same(common.values(fresh), common.values(trainer))


def test_checkpointer_takes_a_plan_and_a_state_not_a_trainer(tmp_path):
    """The Checkpointer never reaches into a Trainer: given one, it names what to pass instead."""
    trainer = common.mlp_trainer()
    with ckpt.Checkpointer(tmp_path, save_every=1) as saver:
        for call in (lambda: saver.save(trainer, trainer.state, trainer.mesh), lambda: saver.maybe_save(trainer, trainer.state, trainer.mesh)):
            with pytest.raises(TypeError, match=r"plan must be a jaxpar.TrainPlan, got Trainer; pass \(trainer.plan, "
                                                r"trainer.state, trainer.mesh\)"):
                call()
        for call in (lambda: saver.restore(trainer, trainer.mesh), lambda: saver.resume(trainer, trainer.mesh)):
            with pytest.raises(TypeError, match=r"state must be a jaxpar.TrainState, got Trainer; pass "
                                                r"\(trainer.state, trainer.mesh\) and assign"):
                call()


def test_mismatch_lists_every_difference(gpt_run):
    directory, _ = gpt_run
    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = common.mesh_for(config)
    other = GPTConfig(**{**common.TINY.__dict__, "layers": 3, "mlp": 128})
    model = jaxpar.init(lambda: GPT(other, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, config, mesh)
    before = common.sums(trainer)
    with pytest.raises(ckpt.CheckpointMismatchError) as err:
        ckpt.restore(trainer, directory)
    text = str(err.value)
    assert "missing params/blocks/2/mlp/up: the trainer has (32, 128) float32" in text
    assert "shape   params/blocks/0/mlp/up: checkpoint (32, 64), trainer (32, 128)" in text
    assert "extra   opt_state/0/mu/head: the checkpoint has (32, 16) float32" in text
    assert "nothing was restored" in text
    assert common.sums(trainer) == before and trainer.step_count == 0


def test_differences_reports_dtypes():
    saved = {"params/w": Leaf((2, 3), "float32"), "params/b": Leaf((3,), "float32")}
    wanted = {"params/w": Leaf((2, 3), "bfloat16"), "params/c": Leaf((3,), "float32")}
    assert differences(saved, wanted) == [
        "extra   params/b: the checkpoint has (3,) float32, the trainer has no such entry",
        "missing params/c: the trainer has (3,) float32, the checkpoint has no such entry",
        "dtype   params/w: checkpoint float32, trainer bfloat16",
    ]


def test_strategy_file_reproduces_the_layout(tmp_path):
    trainer = common.gpt_trainer(common.MEGATRON_2x4)
    ckpt.save(trainer, tmp_path)
    strategy = ckpt.load_strategy(tmp_path)
    assert strategy["mesh"] == {"axes": {"data": 2, "model": 4}, "devices": 8, "processes": 1}
    assert strategy["jaxpar_version"] == jaxpar.__version__
    assert strategy["leaves"]["params/blocks/0/mlp/up"] == {
        "shape": [32, 64], "dtype": "float32", "spec": [None, "model"], "logical": ["embed", "mlp"]}
    with open(tmp_path / "0" / "strategy" / "metadata") as f:   # plain JSON beside the arrays
        assert json.load(f) == strategy
    config = ckpt.strategy_config(strategy)
    assert config.mesh == {"data": 2, "model": 4}
    # A strategy file written before the rename holds its config under "parameter_plan".
    old = {("parameter_plan" if k == "parameter_strategy" else k): v for k, v in strategy["config"].items()}
    assert "parameter_plan" in old and "parameter_strategy" not in old
    assert ckpt.strategy_config({**strategy, "config": old}) == config
    # Without any rules, the pinned parameter_strategy alone reproduces every parameter's spec.
    config = jaxpar.ParallelConfig(**{**config.to_dict(), "rules": {}})
    abstract = nnx.state(nnx.eval_shape(lambda: GPT(common.TINY, rngs=nnx.Rngs(0))), nnx.Param)
    planned = state_specs(config, trainer.mesh, abstract)
    specs = ckpt.strategy_specs(strategy)
    for path, spec in jax.tree_util.tree_flatten_with_path(planned, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]:
        assert spec == specs["params/" + path_str(path)], path


def test_checkpoint_code_assigns_no_trainer_state():
    """Checkpoints return states; whoever holds one (the Trainer, the job runner) assigns it."""
    import ast
    import pathlib

    for path in pathlib.Path(ckpt.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assert not any(isinstance(t, ast.Attribute) and t.attr in ("state", "data_state", "step_count")
                               for t in targets), f"{path.name}:{node.lineno} assigns into another object's state"


def test_a_reading_manager_does_not_say_the_folder_is_read_only(tmp_path, caplog):
    """orbax logs "Given directory is read only" for every manager opened to read, which jaxpar
    does beside its writer on every restore of a job of several processes: the line read as if
    the folder could not be written, and is dropped (orbax's other lines are not)."""
    import logging

    from jaxpar.checkpoint.manager import open_manager

    with caplog.at_level(logging.INFO, logger="absl"):
        with open_manager(str(tmp_path)):
            pass
        with open_manager(str(tmp_path), read_only=True):
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert said and not any("read only" in line for line in said), said
