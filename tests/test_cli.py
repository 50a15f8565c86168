"""The jaxpar command as a user runs it (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.slow
def test_train_writes_metrics(tmp_path):
    out, log = tmp_path / "m.json", tmp_path / "log"
    r = _run("train", "--steps", "12", "--batch", "16", "--metrics", str(out), "--log-dir", str(log), "--log-every",
             "4", "--tensorboard", "--profile-steps", "5:7", "--peak-flops", "1e12")
    assert r.returncode == 0, r.stderr
    assert "parameter specs" in r.stdout and "tokens/s" in r.stdout and "MFU" in r.stdout
    assert "tok/s" in r.stdout and "step 12/12" in r.stdout       # the progress bar: loss, tokens/s, ETA
    m = json.loads(out.read_text())
    assert m["mesh"] == {"data": 2, "model": 4}
    assert len(m["history"]) == 12 and m["history"][-1]["loss"] < m["history"][0]["loss"]
    assert m["report"]["collectives"]["count"] > 0 and m["report"]["memory"]["argument_bytes"] > 0
    assert 0 < m["mfu"] < 1
    lines = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 4, 8, 12, 12] and "eval_loss" in lines[-1]
    assert lines[1]["lr"] > 0 and lines[1]["tokens_per_s"] > 0 and lines[1]["mfu"] > 0
    assert list(log.glob("events.out.tfevents.*")) and list(log.glob("profile/plugins/profile/*/*.xplane.pb"))


def test_plan_and_bad_input(tmp_path):
    # two hosts of 4 devices, planned on the 8 simulated devices of this one process
    r = _run("plan", "--mesh", "data=4,model=2", "--hosts", "data=2", "--save", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    assert "PartitionSpec" in r.stdout and "blocks/0/mlp/up" in r.stdout
    assert "mesh {'data': 4, 'model': 2}  hosts {'data': 2}" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] == {"data": 4, "model": 2} and plan["config"]["hosts"] == {"data": 2}
    r = _run("plan", "--mesh", "data=3,model=2")
    assert r.returncode == 2
    assert "mesh {'data': 3, 'model': 2} has 6 devices but 8 are available" in r.stderr


def test_plan_the_job_within_a_memory_budget(tmp_path):
    """`jaxpar plan --mesh data=8 --memory-budget`: the planner prices ZeRO x micro-batches on
    the mesh --mesh gives (no other shape), the fastest plans (3.5 to 4.0 MB per device, one
    micro-batch) do not fit 2.4 MB, the dry run confirms the choice."""
    r = _run("plan", "--mesh", "data=8", "--search", "dynamic_programming",
             "--memory-budget", "2.4e6", "--flops", "1e9", "--bandwidth", "1e9", "--latency", "1e-6",
             "--accum-options", "1,2", "--plan-out", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    chosen = r.stdout.splitlines()[0]
    assert chosen.startswith("chosen: data=8, ") and ("grad_accum=1" not in chosen), chosen
    candidates = json.loads((tmp_path / "plan.job.json").read_text())["candidates"]
    assert len(candidates) == 8 and all(c["mesh"] == {"data": 8} for c in candidates)   # --mesh data=8 alone
    assert "CHOSEN (dry run confirms)" in r.stdout and "-> fits" in r.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["mesh"]
    r = _run("plan", "--mesh", "data=8", "--search", "dynamic_programming",
             "--memory-budget", "1e6", "--zero-levels", "x")
    assert r.returncode != 0 and "--zero-levels 'x'" in r.stderr


@pytest.mark.slow
def test_plan_picks_context_parallel_for_a_long_sequence():
    """At 128 tokens one device's attention temps (about 3.6 MB predicted) exceed 2.5 MB: with
    --context-options the planner splits the sequence over a context axis and the dry run fits."""
    r = _run("plan", "--search", "dynamic_programming", "--memory-budget", "2.5e6",
             "--flops", "1e9", "--bandwidth", "1e9", "--latency", "1e-6", "--accum-options", "1",
             "--zero-levels", "0", "--context-options", "1,2", "--seq-len", "128", "--batch", "8",
             "--layers", "1", "--embed", "32")
    assert r.returncode == 0, r.stderr
    chosen = r.stdout.splitlines()[0]
    assert chosen.startswith("chosen: context=2"), chosen
    assert "-> fits" in r.stdout and "context: the sequence split over 'context' (ring attention" in r.stdout
    r = _run("plan", "--mesh", "data=8", "--search", "dynamic_programming", "--memory-budget", "2.5e6",
             "--context-strategies", "ulysses")
    assert r.returncode == 2 and "add --context-options" in r.stderr and "Traceback" not in r.stderr


def test_plan_chooses_recompute_or_pipeline_stages_within_a_budget(tmp_path):
    """With recompute and pipeline options, 2.2 MB per device fits no unpipelined plan of
    the 4-layer GPT (about 10.7 MB without recompute, 4.8 MB with it): a pipeline wins."""
    r = _run("plan", "--search", "dynamic_programming",
             "--memory-budget", "2.2e6", "--flops", "1e9", "--bandwidth", "1e9", "--latency", "1e-6",
             "--accum-options", "1", "--zero-levels", "0", "--remat-options", "none, full",
             "--pipeline-options", "1,2,4", "--layers", "4", "--batch", "32", "--plan-out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    chosen = next(line for line in r.stdout.splitlines() if line.startswith("chosen: "))
    assert chosen.startswith("chosen: pipe="), chosen
    assert "(compiled on 8 devices)" in r.stdout and "-> fits" in r.stdout and "pipeline: " in r.stdout
    job = json.loads((tmp_path / "p.job.json").read_text())
    assert job["chosen"]["pipeline"]["stages"] > 1 and job["chosen"]["verdict"].startswith("CHOSEN")
    remat = [c for c in job["candidates"] if c["remat"] == "full"]
    assert remat and all(c["memory_bytes"] > 2.2e6 for c in remat)      # recompute alone is not enough
    r = _run("plan", "--mesh", "data=8", "--search", "dynamic_programming", "--memory-budget", "1e6",
             "--schedule", "sideways")
    assert r.returncode == 2 and "--schedule" in r.stderr


def test_report_shows_the_pipeline_schedule():
    # data spans 2 hosts (of this process's simulated devices): the gradient all-reduces over data cross them
    r = _run("report", "--mesh", "pipe=2,data=4", "--rules", "layers=pipe,batch=data",
             "--pipeline", "stages=2,microbatches=4,schedule=zb-h1", "--batch", "16", "--hosts", "data=2")
    assert r.returncode == 0, r.stderr
    assert "collectives: 7 (4 cross hosts: " in r.stdout and "| inter-host |" in r.stdout
    assert "pipeline schedule zb-h1: 2 stages, 4 micro-batches" in r.stdout
    assert "bubble fraction 1/13" in r.stdout            # (p-1)/(3m+p-1)
