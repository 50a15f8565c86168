"""``train.offload``: a job's ``Trainer(offload=...)``. Checked when the job is loaded (naming
the field), refused where the Trainer would refuse it (a GPU) as the command line's one line
before the model is built, shown in the job's plan, and trained: a scanned tiny Llama whose
parameters and optimizer state live in ``pinned_host`` trains and resumes with the losses of the
same job without offload."""

import json
import re
import shutil

import jax
import pytest

from jaxpar.cli import main
from jaxpar.data import prepare
from jaxpar.job import JobConfig
from jaxpar.models.data import arithmetic_text

JOB = """
model: {{name: llama, size: tiny, fields: {{scan_layers: true}}}}
data: {{path: {store}, seq_len: 16, batch: 8, seed: 3}}
optimizer: {{lr: 1.0e-2, warmup_steps: 1, schedule: constant}}
parallel: {{mesh: {{data: 8}}}}
train: {{steps: 4}}
logging: {{every: 1}}
"""
BOTH = ["--train.offload", "[params, opt_state]"]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload_job")
    (tmp / "corpus.txt").write_text(arithmetic_text(1000, seed=1))
    prepare([str(tmp / "corpus.txt")], str(tmp / "store"), docs="line", progress=False)
    (tmp / "job.yaml").write_text(JOB.format(store=tmp / "store"))
    return tmp / "job.yaml"


@pytest.mark.parametrize("d, overrides, error, words", [
    ({"train": {"offload": ["param"]}}, [], ValueError,
     "job config train.offload=['param']: offload=('param',): unknown targets ['param']; choose from "
     "('opt_state', 'params'); e.g. --train.offload '[params, opt_state]', or [] for no offload"),
    ({}, ["--train.offload", "optimizer"], ValueError, "train.offload='optimizer': offload=('optimizer',): unknown"),
    ({}, BOTH[:1] + ["[params, params]"], ValueError,
     "train.offload=['params', 'params']: ['params'] given more than once"),
    ({"train": {"offload": [1]}}, [], TypeError, "train.offload=[1] holds 1, an int; it must be a list of names"),
    ({"train": {"offload": {"params": True}}}, [], TypeError, "train.offload={'params': True} is a dict; it must"),
])
def test_a_bad_offload_is_refused_naming_the_field(d, overrides, error, words):
    with pytest.raises(error, match=re.escape(words)):
        JobConfig.from_dict(d, overrides)


def test_offload_is_read_as_a_list_or_one_name_and_saved_as_a_list():
    job = JobConfig.from_dict({"train": {"offload": ["params", "opt_state"]}})
    assert job.train.offload == ("params", "opt_state")
    assert job.to_dict()["train"]["offload"] == ["params", "opt_state"]
    assert JobConfig.from_dict(json.loads(json.dumps(job.to_dict()))) == job        # the saved job.yaml
    assert "offload:\n  - params\n  - opt_state" in job.to_yaml()
    assert JobConfig.from_dict({}, ["--train.offload", "opt_state"]).train.offload == ("opt_state",)
    for none in ("[]", "null"):
        assert JobConfig.from_dict({"train": {"offload": ["params"]}}, ["--train.offload", none]).train.offload == ()
    assert JobConfig.from_dict({}).train.offload == ()


def test_the_plan_of_a_job_says_what_it_offloads(job_file, capsys):
    assert main(["plan", "--config", str(job_file), *BOTH]) == 0
    out = capsys.readouterr().out
    assert "offload ['params', 'opt_state']" in out
    assert "kept in pinned_host between steps" in out
    assert main(["plan", "--config", str(job_file)]) == 0
    assert "offload" not in capsys.readouterr().out


def test_a_gpu_refuses_offload_in_one_line_before_the_model_is_built(job_file, tmp_path, monkeypatch, capsys):
    from jaxpar.job import run
    from jaxpar.optim import offload

    real = offload.unpaid_on
    monkeypatch.setattr(offload, "unpaid_on", lambda platform, *a, **k: real("gpu", *a, **k))   # these CPUs as a GPU

    def never(*a, **k):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(run, "build_model", never)
    assert main(["train", "--config", str(job_file), "--quiet", "--logging.dir", str(tmp_path), *BOTH]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar train: error: job config train.offload=['params', 'opt_state']: "
                          "offload=('params', 'opt_state') cannot pay on a GPU"), err
    assert err.rstrip().endswith("in this job: drop train.offload (or give --train.offload '[]')"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _run(job_file, run_dir, *overrides, samples=0):
    """``(losses by step, the Trainer's memory kinds)`` of the job file run from Python (with
    ``samples``: and the samples decoded at the end)."""
    from jaxpar.job.run import run_job

    job = JobConfig.load(str(job_file), ["--logging.dir", str(run_dir / "log"), *overrides])
    kinds = {}

    def look(built):
        trainer = built.trainer
        kinds["opt_state"] = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)}
        kinds["params"] = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.state.params)}

    result = run_job(job, progress=False, print_fn=lambda *a: None, before_fit=look, samples=samples)
    losses = {r["step"]: r["loss"] for r in result["history"]}
    return (losses, kinds, result["samples"]) if samples else (losses, kinds)


def test_a_scanned_model_trains_with_offload_as_without(job_file, tmp_path):
    plain, kinds, texts = _run(job_file, tmp_path / "plain", samples=1)
    assert kinds == {"opt_state": {"device"}, "params": {"device"}}
    offloaded, kinds, offloaded_texts = _run(job_file, tmp_path / "offload", *BOTH, samples=1)
    assert kinds == {"opt_state": {"pinned_host"}, "params": {"pinned_host"}}
    assert sorted(plain) == [1, 2, 3, 4]
    assert offloaded == pytest.approx(plain, rel=1e-6)
    # the samples decode the trained model (trainer.model: in device memory, offloaded parameters included)
    assert offloaded_texts == texts and texts[0].startswith("def ")


def test_an_offloaded_job_resumes_its_checkpoint_with_the_losses_of_one_without(job_file, tmp_path):
    plain, _ = _run(job_file, tmp_path / "plain")
    ckpt = ["--checkpoint.dir", str(tmp_path / "ckpt")]
    first, _ = _run(job_file, tmp_path / "a", *ckpt, *BOTH, "--train.steps", "2")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-2")
    rest, kinds = _run(job_file, tmp_path / "b", *ckpt, *BOTH)                   # resumed at 2, offloaded
    assert kinds["params"] == {"pinned_host"}
    assert {**first, **rest} == pytest.approx(plain, rel=1e-6)
    without, kinds = _run(job_file, tmp_path / "c", "--checkpoint.dir", str(tmp_path / "ckpt-2"))
    assert kinds["params"] == {"device"}                                          # and without offload
    assert without == pytest.approx({s: plain[s] for s in (3, 4)}, rel=1e-6)
