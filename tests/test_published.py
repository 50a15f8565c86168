"""benchmarks/published.py: the prediction for two small published rows, the JSON's fields, and a
source on every published number of benchmarks/published_runs.json."""

import importlib.util
import json
import pathlib

from jaxpar.remat import POLICY_NAMES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("published_bench", ROOT / "benchmarks" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_published_number_has_a_source_and_a_status():
    data = json.loads((ROOT / "benchmarks" / "published_runs.json").read_text())
    for run in data["runs"]:
        src = run["source"]
        assert src["repo"] and src["path"] and len(src["commit"]) == 40, run["id"]
        assert run["quote"], run["id"]
        assert run["published"]["mfu"], run["id"]
        for name, figure in run["published"].items():
            assert figure["status"] in ("SRC", "DERIVED"), (run["id"], name)
            if figure["status"] == "DERIVED":
                assert figure["arithmetic"], (run["id"], name)
        remat = run["remat"]      # the recompute policy its layout is priced with, and why
        assert remat["value"] in POLICY_NAMES and remat["status"] in ("SRC", "NEAREST", "NOT STATED"), run["id"]
        if remat["status"] == "NEAREST":
            assert remat["published"] and remat["source"] and remat["why"], run["id"]
        if "sequence_parallel" in run:     # a reading of the source, said as one
            sp = run["sequence_parallel"]
            assert isinstance(sp["value"], bool) and sp["status"] == "INFERRED" and sp["why"], run["id"]
    for kind in data["hardware"].values():
        for name, figure in kind.items():
            if isinstance(figure, dict):
                assert figure["status"] == "SRC" and figure["source"], name


def test_a_partial_run_never_overwrites_the_committed_results():
    import argparse

    bench = _bench()
    whole = dict(quick=False, runs=None, no_search=False, no_sequence_parallel=False)
    assert bench.default_out(argparse.Namespace(**whole)).name == "published.json"
    for flag, value in (("quick", True), ("runs", ["megatron_32b"]), ("no_search", True),
                        ("no_sequence_parallel", True)):
        out = bench.default_out(argparse.Namespace(**{**whole, flag: value}))
        assert out.name.startswith("tmp") and out.parent.name == "results", (flag, out)


def test_quick_rows_predict_and_write_the_json(tmp_path):
    out = tmp_path / "published.json"
    result = _bench().main(["--quick", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["meta"]["command"] == f"python benchmarks/published.py --quick --out {out}"
    assert written["summary"]["fitted_on"] == ["maxtext_llama2_7b_16gpu"]
    # the machine is measured on the GPU profile, not fitted: the matmul fraction is the step's
    # matmul FLOPs over its matmul and attention kernels' time, at the H200's peak
    cal = written["summary"]["gpu_calibration"]
    assert 0 < written["summary"]["sustained_fraction_of_peak"] == cal["matmul_fraction"] <= 1
    assert abs(cal["matmul_flops"] / (cal["matmul_s"] + cal["attention_s"]) / 989e12 - cal["matmul_fraction"]) < 1e-12
    assert abs(cal["matmul_s"] + cal["attention_s"] + cal["other_s"] - cal["step_s"]) < 1e-9
    assert [r["id"] for r in result["rows"]] == ["megatron_1.7b", "maxtext_llama2_7b_8gpu"]
    for row in written["rows"]:
        assert row["source"]["repo"] and len(row["source"]["commit"]) == 40
        assert row["use"] in ("fitted", "held out")
        p = row["predicted"]
        assert p["step_s"] > 0 and p["memory_bytes"] > 0 and 0 < p["mfu"] < 1
        assert abs(row["error"] - (p["mfu"] / row["published_mfu"] - 1)) < 1e-12
