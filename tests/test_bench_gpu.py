"""benchmarks/gpu.py runs its scaled-down set on a CPU, every row measured or skipped with a
reason; the example configs and benchmarks/step.py run on whatever device count there is."""

import glob
import importlib.util
import json
import os
import sys

import pytest

from jaxpar.cli import main
from jaxpar.data import prepare
from jaxpar.job import JobConfig
from jaxpar.mesh import resolve_axes
from jaxpar.models.data import arithmetic_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow   # about 14 programs compile: ~30 s on 2 idle CPU cores
def test_quick_run_has_every_row_measured_or_skipped_with_a_reason(tmp_path):
    gpu = load("gpu")
    out = tmp_path / "quick.json"
    assert gpu.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["case"], r["entry"]): r for r in result["rows"]}
    expected = set()
    for case in gpu.cases("quick"):
        if case.init:
            expected |= {(case.name, "jaxpar.init"), (case.name, "eager Flax init")}
        elif case.hf:
            expected.add((case.name, gpu.HFStep.label))
        else:
            expected |= {(case.name, gpu.HandStep.label)} | {(case.name, label) for label, _ in case.variants}
    assert set(rows) == expected
    for key, r in rows.items():
        if r["status"] == "skipped":
            assert r["reason"], key
            continue
        if "ms_first" in r:        # jaxpar.init against eager init
            assert r["ms_first"] > 0 and r["ms_again_median"] > 0 and r["ratio_to_eager_first"] > 0, key
            continue
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["compiled_gib"] > 0, key
        assert r["ratio_to_hand"] > 0 and len(r["ratio_p10_p90"]) == 2, key
        assert r["mfu"] is None and r["mfu_text"] == "n/a (no peak for CPU)", key    # never estimated
    # on a CPU only the torch peer is skipped: every jaxpar run and hand-written step is measured
    assert [k for k, r in rows.items() if r["status"] == "skipped"] == [
        (c.name, gpu.HFStep.label) for c in gpu.cases("quick") if c.hf]
    # the MoE against its dense twin, the plain 125m case (found by its name, gpu.DENSE_TWIN)
    assert (gpu.DENSE_TWIN, "jaxpar") in rows
    moe = next(r for (case, entry), r in rows.items() if "MoE" in case and entry == "jaxpar")
    assert moe["tokens_per_s_over_dense_twin"] > 0 and moe["efficiency_over_dense"] > 0
    # host offload was removed (it did not pay on an H200): no case or run of it, no field of its own
    assert not [k for k in rows if "offload" in " ".join(k) or "stream" in " ".join(k)]
    assert not [k for k, r in rows.items() if {"host_gib", "pays", "ratio_to_jaxpar"} & set(r)]
    assert [c.name for c in gpu.cases("quick")] == [
        "1b-shape", "125m-shape", "125m-shape MoE 8 x top-2", "tiny host-bound, 1 device", "jaxpar.init, 1b-shape",
        "1b-shape scanned, recompute", "1b-shape, 64 tokens (scanned, recompute)", "1b-shape, recompute",
        "1b-shape scanned", "1b-shape vs Hugging Face"]
    meta = result["meta"]
    assert meta["device_kind"] == "cpu" and meta["jax"] and meta["mode"] == "quick"


def test_fp8_benchmark_runs_its_cpu_check_and_writes_as_it_goes(tmp_path):
    fp8 = load("fp8")
    out = tmp_path / "fp8.json"
    args = ["--size", "tiny", "--steps", "20", "--round", "5", "--batch", "8", "--seq", "16",
            "--precisions", "bf16", "fp32", "--out", str(out)]
    assert fp8.main(args) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["steps_done"] == 20 and result["meta"]["command"].endswith(str(out))
    assert set(result["rows"]) == {"bf16", "fp32"} and all(len(v) == 20 for v in result["losses"].values())
    assert result["summary"]["tokens_per_s_ratio"] > 0


def test_the_pending_gpu_script_names_cases_and_flags_that_exist():
    """benchmarks/gpu_pending.sh is run on a lent GPU with no time to spare: a case renamed or a
    flag dropped here must fail on CPU first."""
    import shlex

    gpu, probe_text = load("gpu"), open(os.path.join(ROOT, "benchmarks", "gpu_probe.py")).read()
    script = open(os.path.join(ROOT, "benchmarks", "gpu_pending.sh")).read().replace("\\\n", " ")
    calls = [shlex.split(line.split("step ", 1)[1]) for line in script.splitlines() if line.startswith("step ")]
    assert [c[1] for c in calls] == ["benchmarks/gpu.py", "benchmarks/fp8.py", "benchmarks/gpu_probe.py",
                                     "benchmarks/gpu_probe.py"]
    args = gpu.parse_args(calls[0][2:])
    names = {c.name for c in gpu.cases("gpu")}
    assert set(args.cases or ()) <= names, set(args.cases) - names
    # an unknown flag or a bad value: argparse's SystemExit fails the test
    assert load("fp8").parse_args(calls[1][2:]).steps == 300
    for flag in (a for call in calls[2:] for a in call[2:] if a.startswith("--")):
        assert f'"{flag}"' in probe_text, flag
    for call in calls[2:]:      # the probe's sections it asks for by name
        assert "--only" in call, call
        assert f'"{call[call.index("--only") + 1]}": ' in probe_text, call


def test_every_example_config_runs_on_any_device_count():
    for path in sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))):
        job = JobConfig.load(path)
        if os.path.basename(path) == "llama3_8b.yaml":      # the 64-device job: planned anywhere, not trained here
            assert resolve_axes(job.parallel.mesh, 64) == {"data": 8, "model": 8}
            continue
        for n in (1, 2, 4, 8):
            sizes = resolve_axes(job.parallel.mesh, n)
            assert job.data.batch % sizes["data"] == 0, (path, n)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    (tmp / "corpus.txt").write_text(arithmetic_text(400, seed=1))
    prepare([str(tmp / "corpus.txt")], str(tmp / "store"), docs="line", progress=False)
    return str(tmp / "store")


def test_the_demo_job_trains_on_one_device_and_plans_on_this_machine(store, tmp_path, capsys):
    demo = os.path.join(CONFIGS, "tiny.yaml")
    # what a newcomer with one GPU runs (`make demo`), with a small store and two steps
    flags = ["--devices", "1", "--quiet", "--train.steps", "2", "--data.path", store, "--data.eval_path", store,
             "--data.seq_len", "16", "--data.batch", "4", "--eval.steps", "1",
             "--checkpoint.dir", str(tmp_path / "ckpt"), "--logging.dir", str(tmp_path / "log")]
    assert main(["train", "--config", demo, *flags, "--parallel.mesh", "{data: 8}"]) == 2     # the old mesh
    assert "has 8 devices but 1 are available" in capsys.readouterr().err
    assert main(["train", "--config", demo, *flags]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "log" / "summary.json").read_text())["step"] == 2
    assert main(["plan", "--config", demo]) == 0          # data: -1 = the 8 devices `train` would use here
    assert "ZeRO-0" in capsys.readouterr().out


def test_step_benchmark_skips_strategies_that_do_not_fit_and_needs_no_data8_row():
    step = load("step")
    assert isinstance(step.strategy("megatron", 1), str) and "does not divide the 1 devices" in step.strategy("megatron", 1)
    assert step.strategy("data", 1) == ({"mesh": {"data": 1}, "mode": "data"}, "data=1")
    assert step.strategy("megatron", 8)[1] == "data=2 x model=4 (Megatron)"
    baseline = {"name": "baseline", "layers": "unrolled", "step_s": 1.0}
    # only the baseline ran (1 device, --strategies model): no ratio and no paired A/B, no StopIteration
    assert step.data_over_baseline([baseline]) is None
    assert step.ab_pair([baseline], [lambda: None]) is None
    mine = {"name": "data", "layers": "unrolled", "step_s": 1.5}
    assert step.data_over_baseline([mine, baseline]) == 1.5 and baseline["jaxpar_over_baseline"] == 1.5
