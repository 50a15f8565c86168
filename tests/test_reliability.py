"""Nothing is lost: saves finish at exit, a NaN never reaches a checkpoint, a damaged newest step
is named (and can be passed over). Rows of the fault table in docs/reliability.md."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.checkpoint import CheckpointDamagedError

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((4, 4)))

    def __call__(self, x):
        return x @ self.w[...]


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(i, bad=False):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    if bad:
        x[0, 0] = np.nan
    return {"x": x, "y": rng.normal(size=(8, 4)).astype(np.float32)}


def _trainer(directory=None, tx=None, **kw):
    config = jaxpar.ParallelConfig(mesh={"data": 8})
    mesh = jaxpar.make_mesh(config)
    return jaxpar.Trainer(Linear(), tx or optax.sgd(0.1), _loss, config, mesh, checkpoint_dir=directory, **kw)


def test_a_script_that_trains_and_returns_keeps_its_last_save(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT / "tests")!r})
        import jax; jax.config.update("jax_num_cpu_devices", 8)
        import test_reliability as t
        trainer = t._trainer({str(tmp_path / "ckpt")!r}, save_every=2, keep=2)
        for i in range(4):
            trainer.step(t._batch(i))
        # no close(), no wait(): the interpreter's exit must finish the save of step 4
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    entries = sorted(os.listdir(tmp_path / "ckpt"))
    assert entries == ["2", "4"], entries                      # committed, no *-tmp directory left
    assert jaxpar.checkpoint.latest_step(str(tmp_path / "ckpt")) == 4


def test_fit_and_close_finish_pending_saves(tmp_path):
    with _trainer(str(tmp_path), save_every=1, keep=None) as trainer:
        trainer.fit([_batch(i) for i in range(3)], steps=3, progress=False)
        assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]      # fit waited for its saves


def test_a_nan_step_never_reaches_a_checkpoint(tmp_path):
    trainer = _trainer(str(tmp_path), save_every=1, keep=2)
    trainer.step(_batch(0))
    trainer.step(_batch(1))
    with pytest.raises(FloatingPointError, match="step 3 had a non-finite loss"):
        trainer.step(_batch(2, bad=True))             # read before step 3's save: stop, naming the step
    trainer.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # rotation kept the finite steps
    fresh = _trainer(str(tmp_path))
    assert fresh.step_count == 2 and np.all(np.isfinite(np.asarray(fresh.params["w"].get_value())))


def test_nonfinite_skip_counts_and_goes_on(tmp_path):
    trainer = _trainer(str(tmp_path), save_every=2, keep=None, nonfinite="skip")
    trainer.step(_batch(0))
    good = np.asarray(trainer.params["w"].get_value())
    trainer.step(_batch(1, bad=True))
    assert np.array_equal(np.asarray(trainer.params["w"].get_value()), good)   # the update was skipped
    history = trainer.fit([_batch(2), _batch(3)], steps=2, progress=False)
    assert trainer.skipped_steps == [2] and np.all(np.isfinite([r["loss"] for r in history]))
    assert np.all(np.isfinite(np.asarray(trainer.params["w"].get_value())))
    with pytest.raises(ValueError, match="nonfinite='maybe'"):
        _trainer(nonfinite="maybe")


def test_a_finite_step_whose_update_is_not_finite_is_judged_by_the_state_it_writes(tmp_path):
    """Step 1's loss and gradient are finite, but adam(nan) makes every parameter NaN: under
    'stop' the save of step 1 refuses it naming the step and the leaf (a FloatingPointError, and
    nothing is written), 'skip' keeps the previous state (and saves that), and no checkpoint ever
    holds the NaN update."""
    nan_adam = optax.adam(float("nan"))
    stop = _trainer(str(tmp_path / "stop"), tx=nan_adam, save_every=1, keep=None)
    with pytest.raises(FloatingPointError, match=r"save of step 1: .*non-finite values .*params/w"):
        stop.step(_batch(0))
    stop.close()
    assert os.listdir(tmp_path / "stop") == []                 # nothing saved: step 1 never reached a save
    assert _trainer(str(tmp_path / "stop"), tx=nan_adam).step_count == 0

    skip = _trainer(str(tmp_path / "skip"), tx=nan_adam, save_every=1, keep=None, nonfinite="skip")
    first = np.asarray(skip.params["w"].get_value())
    skip.step(_batch(0))
    skip.step(_batch(1))
    skip.check_finite()
    assert skip.skipped_steps == [1, 2]
    assert np.array_equal(np.asarray(skip.params["w"].get_value()), first)          # the previous state kept
    assert int(skip.opt_state[0].count) == 0                                        # the optimizer's too
    skip.close()
    resumed = _trainer(str(tmp_path / "skip"), tx=nan_adam)
    assert resumed.step_count == 2 and np.array_equal(np.asarray(resumed.params["w"].get_value()), first)

    # saving a state that holds a non-finite parameter is refused, naming the leaf
    trainer = _trainer()
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, trainer.state.params))
    with pytest.raises(ValueError, match=r"non-finite .*params/w"):
        jaxpar.checkpoint.save(trainer, str(tmp_path / "direct"))
    assert jaxpar.checkpoint.latest_step(str(tmp_path / "direct")) is None


def _damage(directory: pathlib.Path, step: int) -> None:
    files = sorted(p for p in (directory / str(step) / "state").rglob("*") if p.is_file() and p.stat().st_size)
    for p in files:
        p.write_bytes(b"\0" * 7)


def test_a_damaged_newest_step_is_named_passed_over_and_saved_again(tmp_path):
    trainer = _trainer(str(tmp_path), save_every=1, keep=None)
    for i in range(2):
        trainer.step(_batch(i))
    trainer.close()
    _damage(tmp_path, 2)
    with pytest.raises(CheckpointDamagedError, match=r"step 2 in .* is damaged.*newest_intact"):
        _trainer(str(tmp_path))
    with pytest.warns(UserWarning, match=r"resuming from the previous step 1; .*2 moved aside to .*damaged-2"):
        resumed = _trainer(str(tmp_path), save_every=1, keep=None, resume="newest_intact")
    assert resumed.step_count == 1
    damaged = tmp_path / "damaged-2" / "state"
    assert sorted(os.listdir(tmp_path)) == ["1", "damaged-2"] and {p.stat().st_size for p in damaged.rglob("*")
                                                                    if p.is_file()} <= {0, 7}   # kept as found
    resumed.step(_batch(1))                              # the retrained step 2 is saved ...
    retrained = np.asarray(resumed.params["w"].get_value())
    resumed.close()
    again = _trainer(str(tmp_path))                      # ... and the next restart resumes from it
    assert again.step_count == 2 and np.array_equal(np.asarray(again.params["w"].get_value()), retrained)


def test_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        _trainer(str(path))


WORKER = ROOT / "tests" / "workers_ckpt" / "preempt_worker.py"
STEPS = 12


def _preempt_run(tmp_path, processes: int):
    import json
    import signal
    import socket
    import time

    coordinator = "-"
    if processes == 2:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    directory, out = tmp_path / "ckpt", tmp_path
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def start():
        return [subprocess.Popen([sys.executable, str(WORKER), str(directory), str(out), coordinator, str(i), str(STEPS)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(processes)]

    procs = start()
    try:
        deadline = time.time() + 300
        while not all((out / f"rank_{i}.ready").exists() for i in range(processes)):
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                "\n".join(p.communicate()[0][-2000:] for p in procs if p.poll() is not None)
            time.sleep(0.1)
        for p in procs:                                   # what SLURM / Kubernetes send to every task
            p.send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * processes, "\n".join(x[-3000:] for x in logs)
        assert all("preempted (SIGTERM): saved step" in x for x in logs), logs[0][-2000:]
        saved = jaxpar.checkpoint.latest_step(str(directory))
        assert 1 <= saved < STEPS
        procs = start()                                   # the restart
        logs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * processes, "\n".join(x[-3000:] for x in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [json.loads(x) for x in (out / "rank_0.jsonl").read_text().splitlines()]
    return saved, lines


def _uninterrupted():
    sys.path.insert(0, str(ROOT / "tests" / "workers_ckpt"))
    import common

    trainer = common.gpt_trainer(common.DATA8)
    return [float(trainer.step(b)["loss"]) for b in common.batches(STEPS)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_saves_at_a_step_boundary_and_the_restart_resumes_exactly(tmp_path, processes):
    saved, lines = _preempt_run(tmp_path, processes)
    steps = [x["step"] for x in lines]
    # the first run logged steps 1.. up to the saved one (whose step call raised Preempted);
    # the restart resumes right after the saved step and runs to the end
    restart = steps.index(saved + 1)
    assert steps[:restart] == list(range(1, restart + 1)) and restart <= saved
    assert steps[restart:] == list(range(saved + 1, STEPS + 1))
    expected = _uninterrupted()
    np.testing.assert_allclose([x["loss"] for x in lines], [expected[s - 1] for s in steps], rtol=1e-5)


# ---------------------------------------------------------------- rules nothing consults
def _gpt_trainer(rules, *, constrain=True, **config):
    from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=rules, **config)
    mesh = jaxpar.make_mesh(cfg)
    hook = jaxpar.LogicalConstraint(mesh, cfg.rules) if constrain else (lambda x, names: x)
    gpt = GPTConfig(layers=1, embed=32, heads=4, seq_len=8)
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), constrain=hook), cfg, mesh)
    batch = {"inputs": np.zeros((8, 8), np.int32), "targets": np.zeros((8, 8), np.int32)}
    return jaxpar.Trainer(model, optax.sgd(0.1), loss_fn, cfg, mesh), batch


def test_a_rule_no_parameter_or_constraint_uses_is_refused_naming_it():
    trainer, batch = _gpt_trainer({"mlpp": "model", "heads": "model"})
    with pytest.raises(ValueError, match=r"'mlpp' -> 'model' \(did you mean 'mlp'\?\).*allow_unused_rules") as e:
        trainer.step(batch)
    assert e.value.__traceback__ is not None and trainer.step_count == 0   # refused before anything ran
    trainer, batch = _gpt_trainer({"mlpp": "model"}, allow_unused_rules=True)
    assert np.isfinite(float(trainer.step(batch)["loss"]))


def test_a_rule_only_an_activation_constraint_consults_is_in_use():
    # "length" names no parameter: only the model's constrain(x, ("batch", "length", "embed")) reads it.
    trainer, batch = _gpt_trainer({"length": "model"})
    assert np.isfinite(float(trainer.step(batch)["loss"]))
    trainer, batch = _gpt_trainer({"length": "model"}, constrain=False)
    with pytest.raises(ValueError, match="'length' -> 'model'"):
        trainer.step(batch)
