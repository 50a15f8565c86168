"""Watching a run: JSONL and TensorBoard metrics, the profiled step window, no reads between logs.

One Trainer (one compile) is shared by the file: a fit with metrics, TensorBoard and a profile
window, then a second fit that checks no step between two logging steps waits for the device.
"""

import gzip
import json
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.metrics import MetricsConfig, MetricsLogger, check_profile_steps, read_jsonl, tensorboard_tag
from jaxpar.models.gpt import GPT, gpt_flops_per_token, loss_fn
from jaxpar.report import flops, memory
from helpers import MEGATRON, TINY, batches

# one worker runs this module: its module-scoped fixtures are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("test_metrics")

BATCH = 64            # a step long enough on the device that the host is ahead of it between logs
PEAK = 1e12
SCHEDULE = optax.linear_schedule(1e-3, 0.0, 20)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Seven steps logged every 3 (steps 1, 3, 6, 7), TensorBoard on, steps 3 and 4 profiled."""
    d = tmp_path_factory.mktemp("run")
    metrics = MetricsConfig(dir=str(d), every=3, tensorboard=True, learning_rate=SCHEDULE, peak_flops=PEAK)
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(SCHEDULE), loss_fn, config, mesh, metrics=metrics,
                             profile_steps=(3, 5))
    history = trainer.fit(iter(batches(7, batch=BATCH)), steps=7, progress=False)
    eval_loss = trainer.evaluate(batches(1, batch=BATCH))
    compiled = trainer.lower(batches(1, batch=BATCH)[0]).compile()
    yield {"dir": d, "history": history, "eval": eval_loss, "compiled": compiled, "trainer": trainer}
    trainer.close()


def test_jsonl_holds_the_logged_steps(run):
    records = read_jsonl(run["dir"] / "metrics.jsonl")
    train, evals = records[:-1], records[-1:]
    assert [r["step"] for r in train] == [1, 3, 6, 7]
    h = {r["step"]: r for r in run["history"]}
    windows = {1: [1], 3: [2, 3], 6: [4, 5, 6], 7: [7]}
    for r in train:
        assert r["loss"] == pytest.approx(np.mean([h[s]["loss"] for s in windows[r["step"]]]), rel=1e-6)
        assert r["grad_norm"] == pytest.approx(np.mean([h[s]["grad_norm"] for s in windows[r["step"]]]), rel=1e-6)
        assert r["lr"] == pytest.approx(float(SCHEDULE(r["step"] - 1)))      # the lr the step's update used
        assert r["tokens_per_s"] == pytest.approx(BATCH * TINY.seq_len / r["step_time_s"])
        model_flops = gpt_flops_per_token(TINY, TINY.seq_len) * BATCH * TINY.seq_len   # MFU: model FLOPs
        assert r["mfu"] == pytest.approx(model_flops / (r["step_time_s"] * PEAK * 8))
        hardware_flops = flops(run["compiled"]) * 8                                 # HFU: what XLA counts
        assert r["hfu"] == pytest.approx(hardware_flops / (r["step_time_s"] * PEAK * 8))
    assert train[0]["mfu_source"] == "model" and train[0]["flops_per_step"] == pytest.approx(model_flops)
    m = memory(run["compiled"])
    assert train[0]["memory_temp_bytes"] == m.temp_bytes and train[0]["memory_total_bytes"] == m.total
    assert not any(k.startswith("memory_") for r in train[1:] for k in r)         # read once
    assert not any(k.startswith("moe_") for r in records + run["history"] for k in r)    # a dense model
    assert evals[0]["step"] == 7 and evals[0]["eval_loss"] == pytest.approx(run["eval"])
    assert evals[0]["eval_perplexity"] == pytest.approx(math.exp(run["eval"]))


def test_tensorboard_reads_the_event_files(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["dir"]))
    acc.Reload()
    records = read_jsonl(run["dir"] / "metrics.jsonl")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
        events = acc.Scalars(tensorboard_tag(key))
        assert [e.step for e in events] == [1, 3, 6, 7]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records[:-1]], rel=1e-6)
    assert [e.value for e in acc.Scalars("eval/loss")] == pytest.approx([run["eval"]], rel=1e-6)
    # integers (byte sizes, MoE dropped counts) are int64 scalar tensors of the scalars plugin: exact
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator as TensorAccumulator
    from tensorboard.util import tensor_util

    tensors = TensorAccumulator(str(run["dir"]))
    tensors.Reload()
    (event,) = tensors.Tensors("memory/temp_bytes")
    assert event.step == 1 and tensors.SummaryMetadata("memory/temp_bytes").plugin_data.plugin_name == "scalars"
    value = tensor_util.make_ndarray(event.tensor_proto).item()
    assert type(value) is int and value == records[0]["memory_temp_bytes"]


def test_profile_trace_holds_the_requested_steps(run):
    runs = list((run["dir"] / "profile" / "plugins" / "profile").iterdir())
    assert len(runs) == 1
    assert list(runs[0].glob("*.xplane.pb"))                                    # TensorBoard / XProf
    (trace,) = runs[0].glob("*.trace.json.gz")                                  # Perfetto, chrome://tracing
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = {e["args"]["step_num"] for e in events if e.get("name") == "train"}
    assert steps == {"3", "4"}


def test_steps_between_logs_never_wait_for_the_device(run):
    """When the batch of step j+1 is asked for, step j's outputs are still being computed unless
    step j logged (then fit read them, so they are ready): the readiness pattern is the log pattern."""
    trainer = run["trainer"]
    start = trainer.step_count
    ready = {}

    def watched():
        for j, batch in enumerate(batches(9, batch=BATCH)):
            if j:    # step start + j has run: is its state computed yet? (asks, never waits)
                ready[start + j] = trainer.state.step.is_ready()
            yield batch

    # On an accelerator this guard also fails any read between logs (CPU arrays are host memory).
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        trainer.fit(watched(), steps=9, log_every=4, progress=False)
    logged = {start + 1, start + 4, start + 8}
    assert all(ready[s] for s in logged)   # fit read their metrics, so they are computed
    # the others are dispatched ahead: on 2 busy cores the device may still finish one before
    # its next batch is asked for, but not all of them
    assert not all(ready[s] for s in range(start + 1, start + 9) if s not in logged), ready


def test_learning_rate_from_inject_hyperparams(tmp_path):
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    params = {"w": jax.numpy.ones(3)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(params, state, params)
    logger = MetricsLogger(MetricsConfig(dir=str(tmp_path)))
    assert logger.learning_rate(3, state) == pytest.approx(float(SCHEDULE(2)))
    assert logger.learning_rate(3, optax.adam(1e-3).init(params)) is None       # no schedule known: not logged


def test_bad_settings_name_the_fix(run, tmp_path):
    for kw, words in [({"every": 0}, "every=0"), ({"peak_flops": -1.0}, "peak_flops=-1.0"),
                      ({"tokens_per_example": 2.5}, "tokens_per_example=2.5"), ({"learning_rate": "x"}, "learning_rate")]:
        with pytest.raises(ValueError, match=words):
            MetricsConfig(dir=str(tmp_path), **kw)
    with pytest.raises(TypeError, match="non-empty path"):
        MetricsConfig(dir="")
    assert check_profile_steps("10:13") == (10, 13) and check_profile_steps([2, 3]) == (2, 3)
    for bad in ("13:10", "0:2", "5"):
        with pytest.raises(ValueError, match="the profile window"):
            check_profile_steps(bad)
    trained = run["trainer"]
    with pytest.raises(ValueError, match="pass metrics=MetricsConfig"):     # refused before any work
        jaxpar.Trainer(trained.model, optax.adam(1e-3), loss_fn, trained.config, trained.mesh, profile_steps=(1, 2))


def test_profile_window_over_several_fits_and_a_run_that_ends_before_it(run, tmp_path, capsys):
    """Fits without ``until`` may reach the window later (three fits of 2 steps trace steps 3-4);
    with ``until`` (the run's last step) fit refuses, before its first step, a window the run
    would never reach or stop short of; a Trainer that closes before the window's end warns."""
    trained = run["trainer"]

    def trainer(name, window):   # a model of its own: a step donates the arrays it starts from
        model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), trained.config, trained.mesh)
        return jaxpar.Trainer(model, optax.adam(1e-3), loss_fn, trained.config, trained.mesh,
                              metrics=MetricsConfig(dir=str(tmp_path / name)), profile_steps=window)

    with trainer("epochs", (3, 5)) as t:
        for _ in range(3):
            t.fit(iter(batches(2, batch=BATCH)), steps=2, progress=False)
    assert list((tmp_path / "epochs").glob("profile/plugins/profile/*/*.xplane.pb"))
    with pytest.warns(UserWarning, match=r"Services\(profile=\(10, 13\)\) \(steps 10 to 12\): the run ended at step 4, "
                                         r"before the window: nothing was traced; run to step 12, or choose a "
                                         r"window inside steps 1 to 4"):
        with trainer("short", (10, 13)) as t:
            with pytest.raises(ValueError, match=r"Services\(profile=\(10, 13\)\) traces steps 10 to 12, but the run this "
                                                 r"fit is part of ends at step until=5, so nothing would be traced; "
                                                 r"run to step 12 \(until=12 and the fits to reach it\), or choose "
                                                 r"a window inside the run, e.g. Services\(profile=\(5, 6\)\)"):
                t.fit(iter(batches(5)), steps=5, until=5, progress=False)
            t.step_count = 7                                          # as if resumed at step 7
            with pytest.raises(ValueError, match=r"until=11, so the trace would stop short of step 12"):
                t.fit(iter(batches(3)), steps=3, until=11, progress=False)
            with pytest.raises(ValueError, match=r"until=9 must be an int >= 10, the last step this fit runs"):
                t.fit(iter([]), steps=3, until=9, progress=False)
            t.step_count = 0
            capsys.readouterr()
            t.fit(iter(batches(2, batch=BATCH)), steps=2, until=20)  # part of a run: its bar counts the run's steps
            assert "step 2/20" in capsys.readouterr().out
            t.fit(iter(batches(2, batch=BATCH)), steps=2, progress=False)
    assert not (tmp_path / "short" / "profile").exists()


def test_jsonl_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_jsonl(path)


def test_a_sigterm_preemption_logs_the_saved_step(tmp_path, default_sigterm):
    # SIGTERM lands before step 5 ends: the Trainer saves step 5 and exits, and metrics.jsonl
    # holds step 5's record (the mean of steps 4 and 5), not only the logging steps before it
    import os
    import signal

    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(SCHEDULE), loss_fn, config, mesh, checkpoint_dir=str(tmp_path / "ckpt"),
                             metrics=MetricsConfig(dir=str(tmp_path / "log"), every=3))
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)   # never SIGTERM pytest itself

    def preempted(n=7, at=4):
        for i, batch in enumerate(batches(n)):
            if i == at:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    with pytest.raises(SystemExit) as stop:
        trainer.fit(preempted(), steps=7, progress=False)
    trainer.close()
    assert stop.value.code == 0 and jaxpar.checkpoint.latest_step(str(tmp_path / "ckpt")) == 5
    records = read_jsonl(tmp_path / "log" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 3, 5]
    h = {r["step"]: r["loss"] for r in trainer.history}
    assert records[-1]["loss"] == pytest.approx((h[4] + h[5]) / 2, rel=1e-6)


def test_saves_are_not_step_time_and_the_compiled_step_is_read_once(tmp_path, monkeypatch):
    """A checkpoint save inside a window is logged as checkpoint_s, not as the steps' time; the
    memory and FLOPs of the compiled step are in the Trainer's first record, not again in the first
    record of every fit (fits between evaluations)."""
    import time

    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(SCHEDULE), loss_fn, config, mesh, checkpoint_dir=str(tmp_path / "ckpt"),
                             save_every=2, metrics=MetricsConfig(dir=str(tmp_path / "log"), every=2))
    save = trainer.checkpointer.save

    def slow_save(*args, **kwargs):    # a save that holds the host 1 s (a first save on a slow disk)
        time.sleep(1.0)
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpointer, "save", slow_save)
    data = batches(6)
    with trainer:
        history = trainer.fit(iter(data[:4]), steps=4, progress=False)
        trainer.evaluate(data[:1])
        history += trainer.fit(iter(data[4:]), steps=2, progress=False)
    records = [r for r in read_jsonl(tmp_path / "log" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 4, 5, 6]
    saved = {r["step"]: r for r in records if "checkpoint_s" in r}
    assert sorted(saved) == [2, 4, 6] and all(r["checkpoint_s"] >= 1.0 for r in saved.values()), records
    assert all(r["step_time_s"] < 0.5 for r in saved.values()), records          # the 1 s is not a step's
    assert all(h["time_s"] < 0.5 for h in history if h["step"] in saved), history
    once = ("mfu_source", "flops_per_step", "memory_total_bytes")
    assert all(k in records[0] for k in once) and not any(k in r for r in records[1:] for k in once), records
