"""The goodput ledger (`jaxpar.metrics.goodput`): what a run with metrics writes, how its causes
add up to the wall time across restarts, and ``jaxpar goodput``."""

import json
import time

import optax
import pytest

import jaxpar
from jaxpar.cli import main
from jaxpar.metrics import MetricsConfig
from jaxpar.metrics.goodput import CAUSES, CompileClock, summarize

from test_reliability import Linear, _batch, _loss  # noqa: E402


def _trainer(tmp_path, **checkpoint):
    config = jaxpar.ParallelConfig(mesh={"data": 8})
    ckpt = jaxpar.CheckpointConfig(dir=str(tmp_path / "ckpt"), **checkpoint) if checkpoint else None
    services = jaxpar.Services(metrics=MetricsConfig(dir=str(tmp_path / "run"), every=2), checkpoint=ckpt)
    return jaxpar.Trainer(Linear(), optax.sgd(0.1), _loss, config, jaxpar.make_mesh(config), services=services)


def _ledger(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "goodput.jsonl").read_text().splitlines()]


class SlowBatches:
    """Batches that each take ``wait`` seconds to arrive."""

    def __init__(self, wait):
        self.wait, self.i = wait, 0

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(self.wait)
        self.i += 1
        return _batch(self.i)


def test_a_run_writes_its_ledger_and_the_causes_add_up_to_the_wall_time(tmp_path):
    with _trainer(tmp_path) as trainer:
        trainer.fit(SlowBatches(0.1), 6, log_every=2, progress=False)
        for i in range(2):                 # a loop over step is in the ledger too
            trainer.step(_batch(10 + i))
    records = _ledger(tmp_path)
    assert [r["event"] for r in records][0] == "start" and records[-1]["event"] == "end"
    windows = [r for r in records if r["event"] == "steps"]
    assert [(w["first"], w["last"]) for w in windows] == [(1, 1), (2, 2), (3, 4), (5, 6), (7, 7), (8, 8)]
    # the first step compiles (or loads from the persistent cache); the others run what it made
    assert windows[0]["compile_s"] > 0 and all(w["compile_s"] < windows[0]["compile_s"] / 2 for w in windows[1:])
    assert sum(w["data_s"] for w in windows) >= 0.9 * 6 * 0.1
    summary = summarize(tmp_path / "run")
    seconds = summary["seconds"]
    assert set(seconds) == set(CAUSES) and seconds["productive"] > 0 and seconds["startup"] > 0
    assert sum(seconds.values()) == pytest.approx(summary["wall_s"], rel=0.02)
    assert 0 < summary["goodput"] < 1 and summary["restarts"] == 0 and summary["mfu"] is None   # no peak on CPU


def test_a_restart_from_an_older_step_counts_the_steps_done_again(tmp_path):
    trainer = _trainer(tmp_path, save_every=2)
    trainer.fit((_batch(i) for i in range(5)), 5, log_every=1, progress=False)
    trainer.checkpointer.wait()
    del trainer                        # the process "dies" after step 5, its last save at step 4
    with _trainer(tmp_path, save_every=2) as again:
        assert again.step_count == 4
        again.fit((_batch(i) for i in range(4, 8)), 4, log_every=1, progress=False)
    summary = summarize(tmp_path / "run")
    # two Trainers of one process: two lives, no restart of a process
    assert summary["restarts"] == 0 and [life["resumed_from"] for life in summary["lives"]] == [0, 4]
    first = [r for r in _ledger(tmp_path) if r["event"] == "steps"][4]
    assert first["first"] == first["last"] == 5
    assert summary["seconds"]["recomputed"] == pytest.approx(first["productive_s"])
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_s"], rel=0.02)


def _write(path, records, torn=False):
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + ('{"event": "steps", "ti' if torn else "")
    (path / "goodput.jsonl").write_text(text)


def test_the_summary_of_a_ledger_with_a_kill_a_restart_and_a_torn_line(tmp_path):
    def window(t, first, last, wall, compile_s=0.0, data=0.0, ckpt=0.0):
        return {"event": "steps", "time": t, "first": first, "last": last, "wall_s": wall, "compile_s": compile_s,
                "data_s": data, "checkpoint_s": ckpt, "productive_s": wall - compile_s - data - ckpt}
    _write(tmp_path, [
        {"event": "start", "time": 2.0, "process_start": 0.0, "step": 0, "pid": 10},
        window(14.0, 1, 1, 4.0, compile_s=3.0),            # startup 0..10, then compile, the first step's 1 s
        window(24.0, 2, 10, 10.0, data=1.0, ckpt=1.0),      # killed after step 10
        {"event": "start", "time": 31.0, "process_start": 30.0, "step": 6, "pid": 11},   # resumed at 6: 7..10 again
        window(35.0, 7, 7, 3.0, compile_s=2.0),            # the restart's first step: 1 s of startup
        window(40.0, 8, 10, 5.0),
        window(44.0, 11, 12, 2.0),                          # 2 s of "other" between the windows
        {"event": "end", "time": 45.0, "step": 12, "pid": 11}], torn=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "mfu": m}) + "\n"
                                                    for s, m in ((1, 0.1), (2, 0.4), (4, 0.5), (6, 0.6))))
    s = summarize(tmp_path)
    sec = s["seconds"]
    assert s["wall_s"] == 45.0 and s["restarts"] == 1 and s["unreadable_lines"] == 1
    assert sec["startup"] == 10.0 + 1.0 + 2.0 + 1.0 and sec["compile"] == 5.0 and sec["data"] == 1.0
    assert sec["checkpoint"] == 1.0 and sec["restart"] == 6.0 and sec["other"] == 2.0 + 1.0
    assert sec["recomputed"] == pytest.approx(8.0 * 4 / 9)          # 4 of the 9 steps of that window
    assert sec["productive"] == pytest.approx(8.0 + 5.0 + 2.0 - 8.0 * 4 / 9)
    assert sum(sec.values()) == pytest.approx(45.0)
    assert s["goodput"] == pytest.approx(sec["productive"] / 45.0)
    assert s["mfu"] == 0.5 and s["effective_mfu"] == pytest.approx(0.5 * s["goodput"])


def test_nested_compile_spans_count_once():
    clock = CompileClock()
    now = time.time()
    for start, end in ((now - 10, now - 4), (now - 9, now - 5), (now - 3, now - 1), (now - 30, now - 20)):
        clock._spans.append((start, end))
    assert clock.spent(now - 12, now) == pytest.approx(6 + 2)
    assert clock.spent(now - 2, now) == pytest.approx(1)


def test_the_command_prints_the_table_writes_a_plot_and_refuses_a_bad_directory(tmp_path, capsys):
    _write(tmp_path / "run", [{"event": "start", "time": 1.0, "process_start": 0.0, "step": 0},
                              {"event": "steps", "time": 5.0, "first": 1, "last": 3, "wall_s": 4.0, "compile_s": 1.0,
                               "data_s": 0.0, "checkpoint_s": 0.0, "productive_s": 3.0}])
    assert main(["goodput", str(tmp_path / "run"), "--plot", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "productive" in out and "goodput 60.0%" in out and (tmp_path / "g.png").stat().st_size > 0
    assert main(["goodput", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput"] == pytest.approx(0.6)
    assert main(["goodput", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "RUN_DIR" in err and "is not a directory" in err and "Traceback" not in err
    (tmp_path / "a_file").write_text("")
    assert main(["goodput", str(tmp_path / "run"), "--plot", str(tmp_path / "a_file" / "g.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "cannot be written" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["goodput", str(tmp_path / "empty")]) == 2
    assert "goodput.jsonl does not exist" in capsys.readouterr().err


def test_a_later_life_resuming_further_back_makes_earlier_steps_recomputed_too(tmp_path):
    def life(pid, born, step, windows):
        return [{"event": "start", "time": born, "process_start": born, "step": step, "pid": pid}] + [
            {"event": "steps", "time": t, "first": a, "last": b, "wall_s": w, "compile_s": 0.0, "data_s": 0.0,
             "checkpoint_s": 0.0, "productive_s": w} for t, a, b, w in windows]
    _write(tmp_path, life(1, 0.0, 0, [(10.0, 1, 10, 10.0)]) + life(2, 11.0, 6, [(16.0, 7, 12, 5.0)])
           + life(3, 17.0, 4, [(25.0, 5, 12, 8.0)]) + [{"event": "end", "time": 25.0, "step": 12, "pid": 3},
                                                        {"event": "start", "time": "x", "step": 0},   # not a record
                                                        {"event": "end", "time": 26.0}])
    s = summarize(tmp_path)
    # life 1: steps 5..10 done again (life 3 resumed at 4); life 2: all of 7..12 (6 of 6 steps)
    assert s["seconds"]["recomputed"] == pytest.approx(6.0 + 5.0)
    assert s["restarts"] == 2 and s["seconds"]["restart"] == pytest.approx(1.0 + 1.0)
    assert s["unreadable_lines"] == 2 and s["lives"][-1]["clean_end"]
    assert sum(s["seconds"].values()) == pytest.approx(s["wall_s"]) and s["wall_s"] == 25.0


def test_fit_between_two_loops_over_step_is_counted_once(tmp_path):
    with _trainer(tmp_path) as trainer:
        for i in range(2):
            trainer.step(_batch(i))
        trainer.fit((_batch(i) for i in range(2, 8)), 6, log_every=3, progress=False)
        time.sleep(0.3)                     # user code between the fit and the next loop: "other"
        for i in range(2):
            trainer.step(_batch(10 + i))
    summary = summarize(tmp_path / "run")
    windows = [r for r in _ledger(tmp_path) if r["event"] == "steps"]
    # the loop: its first step and step 2; fit: its first step, then every 3; the loop again: 9..10
    assert [(w["first"], w["last"]) for w in windows] == [(1, 1), (2, 2), (3, 3), (4, 5), (6, 8), (9, 10)]
    # not the fit, not the sleep; the windows' edges are stamped around the ledger's own writes, so
    # the sleep is "other" to within a few milliseconds (one run of the suite read 0.2992 s)
    assert windows[-1]["wall_s"] < 0.3 and summary["seconds"]["other"] >= 0.29
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_s"], rel=0.02)


def test_a_trainer_whose_construction_fails_writes_no_end_line(tmp_path):
    """The checkpoint hook's restore fails before the metrics hook starts: no start, so no end."""
    from jaxpar.checkpoint import CheckpointDamagedError
    from test_reliability import _damage

    with _trainer(tmp_path, save_every=2) as trainer:
        trainer.fit((_batch(i) for i in range(2)), 2, log_every=1, progress=False)
    _damage(tmp_path / "ckpt", 2)
    lines = len(_ledger(tmp_path))
    with pytest.raises(CheckpointDamagedError):
        _trainer(tmp_path, save_every=2)
    assert _ledger(tmp_path)[lines:] == []
    assert summarize(tmp_path / "run")["lives"][0]["clean_end"]
