"""Trainer(checkpoint_dir=..., save_every=N): periodic asynchronous saves and automatic resume."""

import dataclasses
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, batches
from jaxpar.models.gpt import GPT, loss_fn


def _trainer(config, mesh, directory, keep=2):
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, checkpoint_dir=directory,
                          save_every=2, keep=keep)


def test_periodic_save_and_resume(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    data = batches(6)
    first = _trainer(config, mesh, str(tmp_path))
    for b in data:
        first.step(b)
    first.checkpointer.wait()
    # A new trainer on the same directory resumes from the newest complete step (6), keeping 2.
    resumed = _trainer(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}), jaxpar.make_mesh({"data": 2, "model": 4}),
                       str(tmp_path))
    assert resumed.step_count == 6
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "6"]
    # and trains on as the first would have.
    nxt = batches(7)[6]
    a, b = float(first.step(nxt)["loss"]), float(resumed.step(nxt)["loss"])
    assert abs(a - b) <= 1e-5 * abs(a)
    first.close()
    resumed.close()


def _leaves(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def test_a_restore_to_an_earlier_step_starts_a_new_history(tmp_path):
    """Back to step 2 and trained on other batches: reading steps changes nothing (restoring one
    step after another to evaluate each is safe); at the first step after the restore the steps 4
    and 6 of the history left are moved aside (a kill then resumes step 2, not 6), the new step 4
    is saved, and a new Trainer on the directory resumes the new history's step 4. Restored from
    another directory, the Trainer's own step of that number goes too."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    make = lambda d=tmp_path: jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh),  # noqa: E731
                                             optax.adamw(1e-3), loss_fn, config, mesh, checkpoint_dir=str(d),
                                             save_every=2, keep=3)
    first, data = make(), batches(10)
    for i, b in enumerate(data[:6]):
        first.step(b)
        if i == 3:
            old = _leaves(first)           # the history left behind, at step 4
    first.checkpointer.wait()
    for step in (2, 4, 6, 2):              # reading, and restoring to evaluate, change nothing
        first.checkpointer.read(first.state, mesh, step=step)
        assert first.restore(step=step)["step"] == step
        first.evaluate(data[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4", "6"]
    with pytest.warns(UserWarning, match=r"went back to step 2; the steps \[4, 6\] hold the history abandoned"):
        first.step(data[6])                # training goes on from 2: another history
    assert jaxpar.checkpoint.latest_step(str(tmp_path)) == 2
    first.step(data[7])                    # another step 4
    first.checkpointer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4", "abandoned-4", "abandoned-6"]
    new = _leaves(first)
    assert any(not np.array_equal(a, b) for a, b in zip(old, new))
    with make() as resumed:
        assert resumed.step_count == 4
        for a, b in zip(_leaves(resumed), new):
            np.testing.assert_array_equal(a, b)
    first.close()
    # from another directory: the own step 4 (another history) goes as well, at the first save
    other = make(tmp_path / "other")
    for b in data[:4]:
        other.step(b)
    other.checkpointer.wait()
    assert other.restore(str(tmp_path), step=2)["step"] == 2 and other.restore(str(tmp_path), step=4)["step"] == 4
    with pytest.warns(UserWarning, match=r"went back to step 4; the steps \[4\] hold"):
        other.save()
    other.checkpointer.wait()
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["2", "4", "abandoned-4"]
    with make(tmp_path / "other") as resumed:
        for a, b in zip(_leaves(resumed), new):
            np.testing.assert_array_equal(a, b)
    other.close()


def test_an_explicit_save_after_a_restore_saves_the_state_as_the_newest_step(tmp_path):
    """restore(step=2) then save(): steps 4 and 6 go aside and step 2, which holds exactly this
    state, is kept as the newest step (no refusal); a state changed since is saved in its place
    (the old one moved aside), and a save right after resuming is a no-op."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    trainer, data = _trainer(config, mesh, str(tmp_path), keep=3), batches(6)
    for b in data:
        trainer.step(b)
    trainer.checkpointer.wait()
    trainer.restore(step=2)
    restored = _leaves(trainer)
    with pytest.warns(UserWarning, match=r"went back to step 2; the steps \[4, 6\]"):
        assert trainer.save() == 2
    trainer.checkpointer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "abandoned-4", "abandoned-6"]
    assert trainer.save() == 2                               # saved already, exactly: nothing to do
    # the same step number, other values: saved in its place, the old step 2 kept aside
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda x: x + 1, trainer.state.params))
    changed = _leaves(trainer)
    with pytest.warns(UserWarning, match=r"step 2 .*holds another state"):
        assert trainer.save() == 2
    trainer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "abandoned-4", "abandoned-6", "replaced-2"]
    with _trainer(config, mesh, str(tmp_path)) as resumed:
        assert resumed.step_count == 2
        for a, b in zip(_leaves(resumed), changed):
            np.testing.assert_array_equal(a, b)
        assert resumed.save() == 2                           # right after resuming: no-op, no refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "abandoned-4", "abandoned-6", "replaced-2"]
    assert not any(np.array_equal(a, b) for a, b in zip(restored, changed))


def test_closing_the_trainers_gives_sigterm_back(tmp_path, default_sigterm):
    """One handler serves every open Trainer: a SIGTERM reaches each; the last to close restores
    the default action, so the process is not left deaf to SIGTERM once training is over."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    first, second = _trainer(config, mesh, str(tmp_path / "a")), _trainer(config, mesh, str(tmp_path / "b"))
    handler = signal.getsignal(signal.SIGTERM)
    assert handler not in (signal.SIG_DFL, None)
    handler(signal.SIGTERM, None)              # what the signal does, without sending one to pytest
    assert first._preemption.reached(0) and second._preemption.reached(0)
    first.close()
    assert signal.getsignal(signal.SIGTERM) is handler
    second.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_refused_construction_leaves_nothing_open(tmp_path, default_sigterm, monkeypatch):
    """Refused after its checkpoint directory and SIGTERM handler were opened (here: the
    directory holds another model's checkpoint), a Trainer closes them again."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    with _trainer(config, mesh, str(tmp_path)) as saved:
        saved.save()
    closed = []
    close = jaxpar.checkpoint.Checkpointer.close
    monkeypatch.setattr(jaxpar.checkpoint.Checkpointer, "close", lambda self: closed.append(self) or close(self))
    other = dataclasses.replace(TINY, embed=2 * TINY.embed)
    with pytest.raises(ValueError, match="shape"):
        jaxpar.Trainer(jaxpar.init(lambda: GPT(other, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3), loss_fn,
                       config, mesh, checkpoint_dir=str(tmp_path))
    assert len(closed) == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# a child process's Trainer with a checkpoint directory (argv[1]), its SIGTERM handler installed
CHILD_TRAINER = """
import os, signal, sys, time
import optax
from flax import nnx
import jaxpar
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
config = jaxpar.ParallelConfig(mesh={"data": 1})
mesh = jaxpar.make_mesh(config)
gpt = GPTConfig(vocab_size=16, seq_len=8, embed=16, heads=2, mlp=32, layers=1)
trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1), loss_fn,
                         config, mesh, checkpoint_dir=sys.argv[1])
"""

SIGTERMED = CHILD_TRAINER + """
os.kill(os.getpid(), signal.SIGTERM)    # noticed: the Trainer would save and leave at its next step
time.sleep(0.1)
os.kill(os.getpid(), signal.SIGTERM)    # the same request again (a launcher and the scheduler): nothing more
time.sleep(0.1)
print("still running", flush=True)
time.sleep(1.2)                          # past jaxpar.train.hooks.SAME_REQUEST_S, and no step acted on it:
os.kill(os.getpid(), signal.SIGTERM)    # the default action
time.sleep(5)
print("not reached", flush=True)
"""


def test_a_second_sigterm_before_any_step_ends_the_process(tmp_path):
    """A SIGTERM repeated at once is one request; one that comes later while no Trainer has
    stepped (none will act on the first) ends the process, as without jaxpar."""
    done = subprocess.run([sys.executable, "-c", SIGTERMED, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "XLA_FLAGS": ""})
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["still running"]


# SIGTERM, then again 1.5 s later (past jaxpar.train.hooks.SAME_REQUEST_S), while the Trainer runs:
# inside a long step (here its first step's trace, as a long compile would be) of a hand-written
# loop, inside fit between two steps (a slow loader), or inside an evaluation between two parts of
# a run (as a job does). Each is one request: the Trainer saves at the end of the step (the
# evaluation: before its next batch, the step the run reached) and leaves with code 0.
RUNNING_TRAINER = """
import os, signal, sys, time
import optax
from flax import nnx
import jaxpar
from jaxpar.models.data import ArithmeticData
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

def sigterm_twice():
    os.kill(os.getpid(), signal.SIGTERM)    # noticed: the Trainer saves at its next step boundary
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGTERM)    # sent again (a scheduler's warning, then its time limit)
    time.sleep(0.2)
    print("still running", flush=True)

def long_step_loss(model, batch):
    if sys.argv[2] == "step":
        sigterm_twice()
    return loss_fn(model, batch)

def slow_loader(data, inside):
    for i in range(3):
        if i == 1 and sys.argv[2] == inside:
            sigterm_twice()
        yield data.batch(2, i)

config = jaxpar.ParallelConfig(mesh={"data": 1})
mesh = jaxpar.make_mesh(config)
gpt = GPTConfig(vocab_size=16, seq_len=8, embed=16, heads=2, mlp=32, layers=1)
trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                         long_step_loss, config, mesh, checkpoint_dir=sys.argv[1])
data = ArithmeticData(8)
if sys.argv[2] == "step":
    for i in range(3):
        trainer.step(data.batch(2, i))
elif sys.argv[2] == "fit":
    trainer.fit(slow_loader(data, "fit"), steps=3, progress=False)
else:
    trainer.fit([data.batch(2, 0)], steps=1, progress=False)       # a part of the run, not saved
    trainer.evaluate(slow_loader(data, "evaluate"))
    trainer.fit(slow_loader(data, "fit"), steps=3, progress=False)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("inside, saved", [("step", 1), ("fit", 2), ("evaluate", 1)])
def test_a_repeated_sigterm_while_a_trainer_runs_is_the_same_request(tmp_path, inside, saved):
    """A Trainer inside ``step``, ``fit`` or ``evaluate`` will act on a SIGTERM at its next step
    boundary, however long that takes: a second SIGTERM does not end the process before the save."""
    done = subprocess.run([sys.executable, "-c", RUNNING_TRAINER, str(tmp_path / "ckpt"), inside],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "still running" in done.stdout and "not reached" not in done.stdout
    assert f"preempted (SIGTERM): saved step {saved}" in done.stderr
    assert jaxpar.checkpoint.latest_step(str(tmp_path / "ckpt")) == saved


# A script that only evaluates (argv[2] "fresh": a Trainer that never trained; "saved": one whose
# step 2 is saved), over many held-out batches; the scheduler's SIGTERM comes during the first.
EVALUATING_ONLY = CHILD_TRAINER + """
from jaxpar.models.data import ArithmeticData
data = ArithmeticData(8)
if sys.argv[2] == "saved":
    trainer.fit([data.batch(2, i) for i in range(2)], steps=2, progress=False)
    trainer.save()
    trainer.checkpointer.wait()
evaluated = 0

def held_out():
    global evaluated
    for i in range(2000):
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        yield data.batch(2, i % 4)
        evaluated += 1

try:
    trainer.evaluate(held_out())
    print("not reached", flush=True)
finally:
    print("evaluated", evaluated, flush=True)
"""


@pytest.mark.parametrize("before, step", [("fresh", 0), ("saved", 2)])
def test_a_sigterm_ends_a_script_that_only_evaluates(tmp_path, before, step):
    """No step follows the evaluation, so no step boundary would ever act on the SIGTERM: the
    evaluation acts on it before its next batch, as a step boundary does (here nothing to save:
    nothing trained, or the step saved already), and the process ends with code 0."""
    done = subprocess.run([sys.executable, "-c", EVALUATING_ONLY, str(tmp_path / "ckpt"), before],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["evaluated 1"]       # the batch it was in, no other
    said = "saved step 2 to" if step else "stopped at step 0, nothing trained to save"
    assert f"jaxpar: preempted (SIGTERM): {said}" in done.stderr
    assert jaxpar.checkpoint.latest_step(str(tmp_path / "ckpt")) == (step or None)


SIGTERMED_AFTER_FIT = CHILD_TRAINER + """
from jaxpar.models.data import ArithmeticData
data = ArithmeticData(8)
trainer.fit([data.batch(2, i) for i in range(2)], steps=2, progress=False)
os.kill(os.getpid(), signal.SIGTERM)    # fit has returned: no Trainer runs to act on it
time.sleep(1.2)
print("still running", flush=True)
os.kill(os.getpid(), signal.SIGTERM)    # past SAME_REQUEST_S: the default action
time.sleep(5)
print("not reached", flush=True)
"""


def test_a_second_sigterm_after_fit_returned_ends_the_process(tmp_path):
    """Once fit has returned (the user's code runs on, the Trainer still open), nothing would act
    on a SIGTERM: a second one ends the process, as without jaxpar."""
    done = subprocess.run([sys.executable, "-c", SIGTERMED_AFTER_FIT, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["still running"]


SIGTERMED_WHILE_SAVING = CHILD_TRAINER + """
from jaxpar.models.data import ArithmeticData
save = trainer.checkpointer.save

def save_while_sigtermed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)    # a second SIGTERM while the Trainer saves for the first
    return save(*args, **kwargs)

trainer.checkpointer.save = save_while_sigtermed
os.kill(os.getpid(), signal.SIGTERM)
data = ArithmeticData(8)
trainer.fit([data.batch(2, i) for i in range(3)], steps=3, progress=False)
print("not reached", flush=True)
"""


def test_a_sigterm_while_the_trainer_saves_for_the_first_does_not_end_it(tmp_path):
    """The save a SIGTERM asked for is not cut short by another SIGTERM (a launcher and the
    scheduler both signalling, say): the step is saved and the process leaves with code 0."""
    done = subprocess.run([sys.executable, "-c", SIGTERMED_WHILE_SAVING, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "not reached" not in done.stdout and jaxpar.checkpoint.latest_step(str(tmp_path / "ckpt")) == 1


def test_a_checkpointer_that_fails_to_close_still_gives_sigterm_back(tmp_path, default_sigterm, monkeypatch):
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    trainer = _trainer(config, jaxpar.make_mesh(config), str(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL

    close = jaxpar.checkpoint.Checkpointer.close

    def fail(self):
        raise OSError("the save in flight failed")

    monkeypatch.setattr(jaxpar.checkpoint.Checkpointer, "close", fail)
    with pytest.raises(OSError, match="the save in flight failed"):
        trainer.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    close(trainer.checkpointer)
