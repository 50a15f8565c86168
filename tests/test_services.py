"""The services around the loop, each a hook built from one frozen value (`jaxpar.Services`):
every hook alone (on a small stand-in Trainer where it needs one), the pairings refused when the
value is built, the former keywords folded in with a warning, and a loop over ``step`` that
writes metrics."""

import json
import os
import signal
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar.metrics import MetricsConfig
from jaxpar.train import (BUILT_IN, CheckpointHook, EveryHook, Hook, MetricsHook, NonfiniteHook, PreemptionHook,
                          ProfileHook)


# the model, loss and batches of the reliability tests: one linear layer, NaN rows on demand
from test_reliability import Linear, _batch, _loss  # noqa: E402


def _trainer(services=None, **kw):
    config = jaxpar.ParallelConfig(mesh={"data": 8})
    return jaxpar.Trainer(Linear(), optax.sgd(0.1), _loss, config, jaxpar.make_mesh(config), services=services, **kw)


# ------------------------------------------------------------------ the value
def test_pairings_and_bad_values_are_refused_when_the_value_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"profile=\(2, 4\) writes its trace under the run directory; pass metrics="):
        jaxpar.Services(profile=(2, 4))
    with pytest.raises(ValueError, match=r"nonfinite='maybe'; choose 'stop'"):
        jaxpar.Services(nonfinite="maybe")
    with pytest.raises(TypeError, match=r"checkpoint must be a jaxpar.CheckpointConfig, got str"):
        jaxpar.Services(checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match=r"save_every=-1 must be an int >= 0"):
        jaxpar.CheckpointConfig(dir=str(tmp_path), save_every=-1)
    with pytest.raises(ValueError, match=r"resume='latest'; choose one of \('newest', 'newest_intact'\)"):
        jaxpar.CheckpointConfig(dir=str(tmp_path), resume="latest")
    with pytest.raises(TypeError, match=r"hooks holds 'print', which has none of"):
        jaxpar.Services(hooks=("print",))
    with pytest.raises(TypeError, match=r"Placement: donate='yes' must be True or False"):
        jaxpar.Placement(donate="yes")
    assert jaxpar.Services(metrics=MetricsConfig(dir=str(tmp_path)), profile="2:4").profile == (2, 4)


def test_the_built_in_hooks_come_in_order_and_the_user_places_theirs(tmp_path):
    early, late = Hook(), Hook()
    ckpt = jaxpar.CheckpointConfig(dir=str(tmp_path / "ckpt"), save_every=2)
    services = jaxpar.Services(checkpoint=ckpt, metrics=MetricsConfig(dir=str(tmp_path / "run")), profile=(2, 3),
                               hooks=(early, BUILT_IN, late))
    built = services.build()
    try:
        assert [type(h) for h in built] == [Hook, ProfileHook, NonfiniteHook, PreemptionHook, CheckpointHook,
                                            MetricsHook, Hook]
        assert built[0] is early and built[-1] is late
        assert [type(h) for h in jaxpar.Services(hooks=(early,)).build()] == [NonfiniteHook, Hook]   # after them
    finally:
        for hook in built:
            hook.on_close(None)


# ------------------------------------------------------------------ each hook alone
def test_nonfinite_hook_reads_flags_in_bulk_and_stops_or_counts():
    stop = NonfiniteHook("stop")
    for step in (1, 2, 3):
        stop.after_step(None, step, {"finite": jnp.asarray(step != 2)})
    assert len(stop.pending) == 3
    with pytest.raises(FloatingPointError, match=r"step 2 had a non-finite loss"):
        stop.check()
    skip = NonfiniteHook("skip")
    skip.after_step(None, 1, {"finite": jnp.asarray(False)})
    skip.check()
    assert skip.skipped == [1] and not skip.pending
    every = NonfiniteHook("stop")
    for step in range(1, 101):      # read at step 100 without being asked
        every.after_step(None, step, {"finite": jnp.asarray(True)})
    assert not every.pending


def test_every_hook_calls_at_its_steps():
    seen = []
    hook = EveryHook(lambda step, m: seen.append(step), every=3)
    for step in range(1, 8):
        hook.after_step(None, step, {})
    assert seen == [3, 6]
    with pytest.raises(ValueError, match=r"every=0 must be a positive int"):
        EveryHook(print, every=0)


def test_checkpoint_hook_saves_resumes_and_retires(tmp_path):
    config = jaxpar.CheckpointConfig(dir=str(tmp_path), save_every=2, preemption=False)
    with _trainer(jaxpar.Services(checkpoint=config)) as trainer:
        hook = trainer.service("checkpoint")
        assert isinstance(hook, CheckpointHook) and trainer.checkpointer is hook.checkpointer
        for i in range(4):
            trainer.step(_batch(i))
        hook.checkpointer.wait()
        assert hook.checkpointer.manager.all_steps() == [2, 4]
        trainer.restore(step=2)
        assert hook.diverges == (2, False)
        trainer.step(_batch(9))              # training goes on: step 4 of the left history is retired
        assert hook.diverges is None and 4 not in hook.checkpointer.manager.all_steps()
    with _trainer(jaxpar.Services(checkpoint=config)) as resumed:   # on_start resumes the newest complete step
        assert resumed.step_count == 2


def test_preemption_hook_saves_the_step_reached_and_leaves(tmp_path):
    config = jaxpar.CheckpointConfig(dir=str(tmp_path))
    trainer = _trainer(jaxpar.Services(checkpoint=config))
    hook = trainer.service("preemption")
    assert isinstance(hook, PreemptionHook) and hook.listening
    trainer.step(_batch(0))
    os.kill(os.getpid(), signal.SIGTERM)     # the handler sets the flag; the next step boundary acts
    with pytest.raises(jaxpar.train.Preempted) as stop:
        trainer.step(_batch(1))
    assert stop.value.step == 2 and stop.value.code == 0 and not hook.listening
    assert trainer.checkpointer.manager.all_steps() == [2]
    trainer.close()


def test_metrics_hook_alone_logs_what_it_is_given(tmp_path):
    hook = MetricsHook(MetricsConfig(dir=str(tmp_path), every=5))

    class Stand:      # what the hook reads of a Trainer
        save_s, fitting = 0.0, False
        state = type("S", (), {"opt_state": None})()

        def check_finite(self):
            pass

    hook.log(Stand(), [{"step": 5, "loss": 2.0, "grad_norm": 1.0}], 0.5)
    hook.on_close(None)
    [line] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 5 and line["loss"] == 2.0 and line["step_time_s"] == 0.5


def test_profile_hook_traces_its_window(tmp_path):
    hook = ProfileHook(str(tmp_path), (2, 3))
    for step in (1, 2, 3):
        hook.before_step(None, step)
        hook.after_step(None, step, {"loss": jnp.ones(())})
    hook.on_close(None)
    assert hook.window.done and list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))


# ------------------------------------------------------------------ the loop
def test_a_loop_over_step_writes_metrics(tmp_path):
    """Only fit wrote metrics before; the metrics hook logs a loop over ``step`` at the first
    step, every ``every`` steps and the last steps when the Trainer closes."""
    with _trainer(jaxpar.Services(metrics=MetricsConfig(dir=str(tmp_path), every=2))) as trainer:
        losses = [float(trainer.step(_batch(i))["loss"]) for i in range(5)]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 4, 5]
    assert lines[0]["loss"] == pytest.approx(losses[0]) and lines[-1]["loss"] == pytest.approx(losses[4])
    assert lines[2]["loss"] == pytest.approx(np.mean(losses[2:4]))       # steps 3 and 4 averaged
    assert lines[0]["tokens_per_s"] > 0 and "memory_total_bytes" in lines[0]


def test_a_user_hook_placed_before_the_built_in_ones_sees_the_step_first(tmp_path):
    order = []

    class Mine(Hook):
        def after_step(self, trainer, step, metrics):
            order.append(("mine", len(trainer.service("nonfinite").pending)))

    with _trainer(jaxpar.Services(hooks=(Mine(), BUILT_IN))) as trainer:
        trainer.step(_batch(0))
    assert order == [("mine", 0)]        # before the non-finite hook recorded the step's flag


def test_the_former_keywords_fold_into_the_new_values_with_a_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"Trainer\(checkpoint_dir=...\) is deprecated: use Trainer\(services="
                                                r"jaxpar.Services\(checkpoint=jaxpar.CheckpointConfig\(dir=...\)\)\)"):
        trainer = _trainer(checkpoint_dir=str(tmp_path), preemption=False)
    assert trainer.service("checkpoint") is not None and trainer.service("preemption") is None
    trainer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=r"save_every=2 without checkpoint_dir=.*CheckpointConfig\(dir=..."):
            _trainer(save_every=2)
        with pytest.raises(TypeError, match=r"both services= and the former keywords \['nonfinite'\]"):
            _trainer(jaxpar.Services(), nonfinite="skip")
