"""A job in one file: `JobConfig` (sections, overrides, bad keys) and `jaxpar train --config JOB`
end to end: determinism, resume on the same and on a different process count."""

import dataclasses
import json
import os
import re
import shutil

import pytest

import jaxpar
from jaxpar.cli import main
from jaxpar.data import prepare
from jaxpar.job import JobConfig
from jaxpar.launch.ports import free_port
from jaxpar.models.data import arithmetic_text
from workers.procs import WORKERS, Launch


def test_sections_overrides_and_round_trip():
    # YAML 1.1 would read 10:13 as the base-60 integer 613 and 3e-4 as text: the job loader does not
    job = JobConfig.from_dict({"logging": {"dir": "runs/x"}}, ["--logging.profile_steps", "10:13", "--optimizer.lr", "3e-4"])
    assert job.logging.profile_steps == "10:13" and job.optimizer.lr == 3e-4
    job = JobConfig.from_dict({"model": {"size": "tiny", "fields": {"layers": 1}}, "parallel": {"mesh": {"data": 8}}},
                              ["--optimizer.lr", "3e-4", "--parallel.optimizer.level", "2", "--train.steps=7"])
    assert (job.optimizer.lr, job.parallel.optimizer.level, job.train.steps) == (3e-4, 2, 7)
    assert JobConfig.from_dict(job.to_dict()) == job


def test_a_job_file_saved_with_parameter_plan_loads():
    """Job files saved before the rename hold ``parallel.parameter_plan``; an override under the
    new name replaces it; both names in one section are refused."""
    old = {"parallel": {"mesh": {"data": 2, "model": 4}, "parameter_plan": {"blocks/*/mlp/up": [1, 4]}}}
    job = JobConfig.from_dict(old)
    assert job.parallel.parameter_strategy == {"blocks/*/mlp/up": (1, 4)}
    assert "parameter_plan" not in job.to_dict()["parallel"]
    job = JobConfig.from_dict(old, ["--parallel.parameter_strategy", "{blocks/*/mlp/down: [4, 1]}"])
    assert job.parallel.parameter_strategy == {"blocks/*/mlp/down": (4, 1)}
    with pytest.raises(ValueError, match="both 'parameter_plan' and 'parameter_strategy'"):
        JobConfig.from_dict({"parallel": {**old["parallel"], "parameter_strategy": {}}})


@pytest.mark.parametrize("d, overrides, error, words", [
    ({"optimzer": {"lr": 1.0}}, [], ValueError, "unknown key 'optimzer'; did you mean 'optimizer'"),
    ({}, ["--optimizer.lrr", "1"], ValueError, "unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'"),
    ({"parallel": {"meshh": {"data": 8}}}, [], ValueError, "did you mean 'parallel.mesh'"),
    ({"train": {"steps": "ten"}}, [], TypeError, "train.steps='ten' is a str; it must be int"),
    ({"optimizer": {"lr": -1}}, [], ValueError, "optimizer.lr=-1.0"),
    ({"model": {"factory": "pkg.mod:make"}}, [], ValueError, "give both"),
    ({"logging": {"dir": "runs/x", "profile_steps": "13:10"}}, [], ValueError, "logging.profile_steps='13:10'"),
    ({"logging": {"profile_steps": "10:13"}}, [], ValueError, "set logging.dir"),
    ({"logging": {"dir": "runs/x"}}, ["--train.steps", "4", "--logging.profile_steps", "6:8"], ValueError,
     "logging.profile_steps='6:8': the window traces steps 6 to 7, but the run ends at train.steps=4; choose a "
     "window inside it, e.g. --logging.profile_steps 4:5, or give --train.steps 7 or more"),
    ({"checkpoint": {"every": 10}}, [], ValueError, "saving needs checkpoint.dir"),
    ({"eval": {"every": 10}}, [], ValueError, "evaluation reads data.eval_path"),
    ({"data": "x"}, [], ValueError, "a section is a mapping"),
    ({"data": {"source": "web"}}, [], ValueError, "data.source='web': choose one of ('store', 'arithmetic')"),
    ({"data": {"source": "arithmetic", "path": "runs/x"}}, [], ValueError,
     "data.path='runs/x': data.source 'arithmetic' generates its text and reads no store"),
    ({"logging": {"peak_flops": 0}}, [], ValueError, "logging.peak_flops=0.0: one device's peak FLOP/s must be"),
    # every optimizer field in its own range, named with the value and the range
    ({"optimizer": {"b2": 2.0}}, [], ValueError, "optimizer.b2=2.0: Adam's second-moment decay must be a number in [0, 1)"),
    ({}, ["--optimizer.b1", "1"], ValueError, "optimizer.b1=1.0: Adam's first-moment decay must be a number in [0, 1)"),
    ({"optimizer": {"eps": 0}}, [], ValueError, "optimizer.eps=0.0: Adam's denominator epsilon must be a number in (0, inf)"),
    ({"optimizer": {"lr": float("inf")}}, [], ValueError, "optimizer.lr=inf: the peak learning rate must be a number in (0, inf)"),
    ({"optimizer": {"min_lr_ratio": 1.5}}, [], ValueError, "optimizer.min_lr_ratio=1.5: the fraction of lr the decay ends at must be a number in [0, 1]"),
    ({"optimizer": {"weight_decay": -0.1}}, [], ValueError, "optimizer.weight_decay=-0.1: AdamW's weight decay must be a number in [0, inf)"),
    ({"optimizer": {"warmup_steps": -1}}, [], ValueError, "optimizer.warmup_steps=-1: the warmup's length in steps must be an integer >= 0"),
    ({"optimizer": {"clip_norm": 0}}, [], ValueError, "optimizer.clip_norm=0.0: the global-norm clipping threshold must be a number in (0, inf)"),
    ({"optimizer": {"warmup_steps": 2.5}}, [], TypeError, "optimizer.warmup_steps=2.5 is a float; it must be int"),
])
def test_bad_job_configs_name_the_key(d, overrides, error, words):
    with pytest.raises(error, match=re.escape(words)):
        JobConfig.from_dict(d, overrides)


def test_the_edges_of_the_optimizer_ranges_are_accepted():
    from jaxpar.job.config import OptimizerSection

    section = OptimizerSection(b1=0.0, b2=0.0, min_lr_ratio=1.0, weight_decay=0.0, warmup_steps=0, clip_norm=None)
    assert (section.b1, section.b2, section.min_lr_ratio) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"optimizer\.b2=True: .* \[0, 1\)"):
        OptimizerSection(b2=True)


def test_model_fields_are_applied_as_llama_config_named_does():
    # head_dim follows the job's embed / heads (embed // heads), as LlamaConfig.named(size, **fields)
    from jaxpar.job.run import model_config
    from jaxpar.models.llama_config import LlamaConfig

    job = JobConfig.from_dict({"model": {"size": "tiny", "fields": {"embed": 128, "heads": 4}}})
    assert model_config(job).head_dim == LlamaConfig.named("tiny", embed=128, heads=4).head_dim == 32
    job = JobConfig.from_dict({"model": {"fields": {"embed": 128, "heads": 4, "head_dim": 16}}})
    assert model_config(job).head_dim == 16                             # an explicit head_dim wins
    demo = model_config(JobConfig.load(os.path.join(CONFIGS, "tiny.yaml")), vocab=257)
    assert demo.head_dim == demo.embed // demo.heads == 32
    with pytest.raises(ValueError, match=r"model\.fields=\{'embed': 130\} \(llama size 'tiny'\): LlamaConfig: "
                                         r"embed=130 is not divisible by heads=4"):
        model_config(JobConfig.from_dict({"model": {"fields": {"embed": 130}}}))


JOB = """
model: {{name: llama, size: tiny}}
data: {{path: {store}, seq_len: 16, batch: 16, seed: 3}}
optimizer: {{lr: 1.0e-2, warmup_steps: 1, schedule: constant}}   # one schedule for 2, 10 and 20 steps
parallel: {{mesh: {{data: 8}}}}
train: {{steps: 20}}
checkpoint: {{every: 10}}
logging: {{every: 1}}
"""


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    (tmp / "corpus.txt").write_text(arithmetic_text(2000, seed=1))
    prepare([str(tmp / "corpus.txt")], str(tmp / "store"), docs="line", progress=False)
    (tmp / "job.yaml").write_text(JOB.format(store=tmp / "store"))
    return tmp / "job.yaml"


def _train(job_file, run_dir, *flags):
    return main(["train", "--config", str(job_file), "--checkpoint.dir", str(run_dir / "ckpt"),
                 "--logging.dir", str(run_dir / "log"), "--quiet", *flags])


def _losses(run_dir):
    lines = (run_dir / "log" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "eval_loss" not in r}


def test_a_refused_resume_keeps_the_job_yaml_of_the_saved_steps(job_file, tmp_path, capsys):
    assert _train(job_file, tmp_path, "--train.steps", "2") == 0
    saved = (tmp_path / "ckpt" / "job.yaml").read_text()
    for flags, words in ((["--model.fields", "{layers: 1}"], "step 2 does not fit"),        # another model
                         (["--data.batch", "8"], "global_batch=16 but this loader has global_batch=8")):
        assert _train(job_file, tmp_path, "--train.steps", "3", *flags) == 2
        assert words in capsys.readouterr().err
        # the record of the job that made the checkpoints is still there, beside them and the logs
        assert (tmp_path / "ckpt" / "job.yaml").read_text() == (tmp_path / "log" / "job.yaml").read_text() == saved
    # the same command again, or fewer steps than were saved: the finished run's records stay
    summary = (tmp_path / "log" / "summary.json").read_text()
    assert json.loads(summary)["loss"] is not None
    assert _train(job_file, tmp_path, "--train.steps", "2") == 0
    assert "already at step 2 = train.steps" in capsys.readouterr().out
    assert _train(job_file, tmp_path, "--train.steps", "1", "--optimizer.warmup_steps", "0") == 2
    assert ("holds step 2, past train.steps=1: a run cannot train back to step 1; give --train.steps 3 or more to "
            "train on from step 2, or another --checkpoint.dir" in capsys.readouterr().err)
    assert (tmp_path / "log" / "summary.json").read_text() == summary
    assert (tmp_path / "ckpt" / "job.yaml").read_text() == saved


def test_a_damaged_newest_step_is_passed_over_quietly(job_file, tmp_path, capfd):
    assert _train(job_file, tmp_path, "--train.steps", "2", "--checkpoint.every", "1") == 0
    arrays = tmp_path / "ckpt" / "2" / "state" / "d"
    max(arrays.iterdir(), key=lambda p: p.stat().st_size).unlink()        # step 2's array file is lost
    assert _train(job_file, tmp_path, "--train.steps", "2") == 2
    err = capfd.readouterr().err
    assert "checkpoint step 2" in err and "is damaged" in err and "--checkpoint.resume newest_intact" in err, err
    assert _train(job_file, tmp_path, "--train.steps", "2", "--checkpoint.resume", "newest_intact") == 0
    out, err = capfd.readouterr()
    assert "resumed at step 1" in out
    # orbax's read of step 2 fails; the reads still in flight must not echo it through a closed event loop
    assert "Event loop is closed" not in out + err and "Traceback" not in out + err, err[-3000:]


def test_an_output_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    import tempfile

    from jaxpar.job.run import check_directory

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=re.escape(f"job config checkpoint.dir='{tmp_path}/afile/ckpt' cannot be "
                                                   f"written ('{tmp_path}/afile' is a file, not a folder); give a folder")):
        check_directory("checkpoint.dir", str(tmp_path / "afile" / "ckpt"))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", denied)
    with pytest.raises(ValueError, match=re.escape(f"logging.dir='{tmp_path}' cannot be written (Permission denied: "
                                                   f"'{tmp_path}'); give a folder you can write")):
        check_directory("logging.dir", str(tmp_path))


def test_the_example_flags_are_refused_with_the_field_to_use(job_file, tmp_path, capsys):
    assert _train(job_file, tmp_path, "--steps", "3") == 2
    assert "--train.steps" in capsys.readouterr().err
    assert _train(job_file, tmp_path, "--optimizer.lrr", "1") == 2
    assert "did you mean 'optimizer.lr'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_job_resumes_with_the_same_losses_on_one_two_or_four_processes(job_file, tmp_path, tag):
    whole, part = tmp_path / "whole", tmp_path / "part"
    # the uninterrupted run also evaluates every 5 steps (four fits, one run) and traces steps 7-8,
    # a profile window inside the second fit; neither changes the training losses
    store = str(job_file.parent / "store")
    assert _train(job_file, whole, "--data.eval_path", store, "--eval.every", "5", "--eval.steps", "1",
                  "--logging.profile_steps", "7:9") == 0
    expected = _losses(whole)
    assert sorted(expected) == list(range(1, 21))
    evals = [r["step"] for r in map(json.loads, (whole / "log" / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    assert evals == [5, 10, 15, 20] and list((whole / "log").glob("profile/plugins/profile/*/*.xplane.pb"))
    assert (whole / "ckpt" / "job.yaml").exists()                       # the resolved job beside the steps

    assert _train(job_file, part, "--train.steps", "10") == 0
    shutil.copytree(part, tmp_path / "two")
    assert _train(job_file, part) == 0                                  # same process count: resumes at 10
    assert _losses(part) == expected                                    # bit-identical, steps 1-20

    # the checkpoint goes from process count to process count, each run resuming where the last
    # stopped: 1 -> 2 -> 4 -> 2 -> 1 (steps 10, 13, 16, 18, 20), every loss the uninterrupted one's
    two = tmp_path / "two"
    for processes, until in ((2, 13), (4, 16), (2, 18), (1, 20)):
        flags = ["--config", job_file, "--checkpoint.dir", two / "ckpt", "--logging.dir", two / "log", "--quiet",
                 "--train.steps", str(until)]
        if processes == 1:
            assert main([str(f) for f in ["train", *flags]]) == 0
            continue
        args = ["--worker-num", processes, "--local-worker-num", processes, "--simulated-devices", 8 // processes,
                "--master-port", free_port(), "--cluster-time-out", 60]
        run = Launch(tmp_path, tag, args, flags, script=os.path.join(WORKERS, "job_worker.py"),
                     entry=("-m", "jaxpar.cli", "launch"))
        try:
            assert run.wait(timeout=240) == 0, run.stderr + "".join(run.log(i) for i in range(processes))
        finally:
            run.close()
    resumed = _losses(two)
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), step


PIPE = ["--parallel.mesh", "{pipe: 2, data: 4}", "--parallel.rules", "{layers: pipe, batch: data}",
        "--parallel.pipeline", "{stages: 2, microbatches: 4, schedule: zb-h1}"]


@pytest.mark.slow
def test_a_pipelined_job_trains_packed_data_as_accumulation_does(job_file, tmp_path):
    # the job's Llama is stacked and trained with its pipeline_loss: every stage gets the packed
    # data's segment ids, and the loss per micro-batch is the one accumulation computes
    steps = ["--train.steps", "3"]
    assert _train(job_file, tmp_path / "pipe", *steps, *PIPE) == 0
    stacked = ["--model.fields", "{scan_layers: true}"]   # the same initial parameters as the pipeline's
    assert _train(job_file, tmp_path / "accum", *steps, *stacked, "--parallel.mesh", "{data: 4, model: 2}",
                  "--parallel.grad_accum", "4") == 0
    piped, accumulated = _losses(tmp_path / "pipe"), _losses(tmp_path / "accum")
    assert sorted(piped) == [1, 2, 3]
    for step in piped:
        assert piped[step] == pytest.approx(accumulated[step], rel=1e-5), step


def test_a_pipelined_job_refuses_unstacked_blocks_and_a_plain_loss():
    from jaxpar.job.run import build_model, model_config

    job = JobConfig.from_dict({"model": {"fields": {"scan_layers": False}}}, PIPE)
    with pytest.raises(ValueError, match=r"scan_layers=False with parallel\.pipeline\.stages=2"):
        model_config(job)
    job = JobConfig.from_dict({"model": {"factory": "jaxpar.models.llama:Llama", "loss": "jaxpar.models.llama:loss_fn"}},
                              PIPE)
    with pytest.raises(TypeError, match=r"model\.loss='jaxpar\.models\.llama:loss_fn' is a function; with "
                                        r"parallel\.pipeline\.stages=2 it must name a jaxpar\.pipeline\.PipelineLoss"):
        build_model(job, jaxpar.make_mesh(job.parallel))


CONFIGS = os.path.join(os.path.dirname(WORKERS), "..", "examples", "configs")


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
def test_example_job_files_load_and_name_a_model(name):
    from jaxpar.job.run import model_config

    job = JobConfig.load(os.path.join(CONFIGS, name))
    cfg = model_config(job, vocab=257)
    assert cfg.max_seq_len >= job.data.seq_len and cfg.vocab_size >= 257


def test_plan_of_a_job_file_has_the_vocabulary_of_its_token_store(tmp_path):
    """`run_job` grows the model's vocabulary to the token store's; the plan from shapes does too
    (from the store's index), so it plans the parameters the run trains."""
    from jaxpar.job.shapes import plan_of_job

    (tmp_path / "a.txt").write_text("a line\n")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "store"), progress=False)      # the byte tokenizer: 257 ids
    job = JobConfig.from_dict({"model": {"size": "tiny"}, "data": {"path": str(tmp_path / "store"), "seq_len": 16},
                               "parallel": {"mesh": {"data": 8}}})
    plan, _ = plan_of_job(job, {"data": 8})
    assert plan.shapes["embedding"][0][0] == 257          # tiny's own vocabulary is 64


def test_plan_of_a_job_file_on_64_planned_devices(capsys):
    assert main(["plan", "--config", os.path.join(CONFIGS, "llama3_8b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "mesh {'data': 8, 'model': 8} (64 devices), ZeRO-3" in out and "precision bf16" in out
    total = next(line for line in out.splitlines() if "│ total" in line)
    params, per_device = (int(x.replace(",", "")) for x in total.split("│")[-3:-1])
    assert per_device == pytest.approx(params / 64, rel=0.01)           # ZeRO-3 x TP: every parameter / 64
    assert main(["plan", "--config", os.path.join(CONFIGS, "llama3_8b.yaml"), "--samples", "2"]) == 2


def test_a_warmup_that_does_not_end_inside_the_run_is_shortened_with_a_word(job_file, tmp_path):
    from jaxpar.job import make_optimizer
    from jaxpar.job.config import OptimizerSection

    with pytest.warns(UserWarning, match=re.escape(
            "optimizer.warmup_steps=50 with train.steps=10: the warmup would not end inside the run, so it is "
            "shortened to 9 step(s) (the rate reaches optimizer.lr at step 9); give --optimizer.warmup_steps below "
            "10 to choose it, or --train.steps 51 or more")):
        _, schedule = make_optimizer(OptimizerSection(lr=1.0, warmup_steps=50, schedule="constant"), 10)
    assert [float(schedule(i)) for i in (8, 9)] == pytest.approx([8 / 9, 1.0])     # the last warmup that fits


def test_a_factory_that_returns_no_module_is_named(tmp_path, monkeypatch):
    from jaxpar.job.run import build_model

    config = jaxpar.ParallelConfig(mesh={"data": 8})
    mesh = jaxpar.make_mesh(config)
    with pytest.raises(TypeError, match=re.escape("init: the model function returned a value of type int, not an "
                                                  "nnx.Module; it must build the model and return it")):
        jaxpar.init(lambda: 42, config, mesh)
    (tmp_path / "nomodule.py").write_text("def factory(rngs):\n    return 42\ndef loss(model, batch):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = JobConfig.from_dict({"model": {"factory": "nomodule:factory", "loss": "nomodule:loss"}})
    with pytest.raises(TypeError, match=re.escape("job config model.factory='nomodule:factory' returned a value of "
                                                  "type int, not an nnx.Module; the factory is called as "
                                                  "factory(rngs)")):
        build_model(job, mesh)


def test_a_missing_eval_store_is_named_as_data_eval_path(tmp_path):
    from jaxpar.job.run import _eval_store

    job = JobConfig.from_dict({"data": {"path": "train", "eval_path": str(tmp_path / "none")}})
    with pytest.raises(ValueError, match=re.escape(f"job config data.eval_path='{tmp_path}/none': no token store "
                                                   f"index at '{tmp_path}/none/index.json'")):
        _eval_store(job)


def test_a_batch_that_does_not_split_is_named_before_the_model_is_built(job_file, tmp_path, capsys):
    from jaxpar.job.batch import check_batch

    # 3 processes x 2 devices: the processes alone would take 15, the 6 devices of the batch axis not
    job = JobConfig.from_dict({"data": {"batch": 15}, "parallel": {"mesh": {"data": -1}}})
    with pytest.raises(ValueError, match=re.escape(
            "job config data.batch=15 does not split: each of the 3 processes reads its own block of rows, and each "
            "step splits it over the batch axes ('data',) (6 devices), so the global batch must be a multiple of "
            "6; give --data.batch 18 (or 12)")):
        check_batch(job, {"data": 6}, process_count=3)
    pipe = JobConfig.from_dict({"data": {"batch": 16}, "parallel": {
        "mesh": {"pipe": 2, "data": 4}, "rules": {"layers": "pipe", "batch": "data"}, "grad_accum": 2,
        "pipeline": {"stages": 2, "microbatches": 4}}})
    with pytest.raises(ValueError, match=re.escape("multiple of 32 = 4 x 2 x 4; give --data.batch 32, or a smaller "
                                                   "--parallel.grad_accum or --parallel.pipeline.microbatches")):
        check_batch(pipe, {"pipe": 2, "data": 4}, process_count=1)
    check_batch(dataclasses.replace(job, data=dataclasses.replace(job.data, batch=18)), {"data": 6}, process_count=3)
    # the CLI: refused before the model is built, naming the job's fields; nothing is written
    for flags, words in ((["--data.batch", "12"], "data.batch=12 does not split"),
                         (["--parallel.grad_accum", "3"], "into 3 parts (parallel.grad_accum=3)")):
        assert _train(job_file, tmp_path, "--train.steps", "2", *flags) == 2
        assert words in capsys.readouterr().err
        assert not (tmp_path / "ckpt" / "job.yaml").exists() and not (tmp_path / "log" / "job.yaml").exists()


def test_a_run_refused_at_its_first_step_writes_no_job_yaml(job_file, tmp_path, capsys):
    assert _train(job_file, tmp_path, "--train.steps", "2", "--parallel.rules", "{batchh: data}") == 2
    assert "'batchh' -> 'data' (did you mean 'batch'?)" in capsys.readouterr().err
    assert not (tmp_path / "ckpt" / "job.yaml").exists() and not (tmp_path / "log" / "job.yaml").exists()


def test_the_plan_of_a_job_file_checks_its_batch_as_its_run_does():
    from jaxpar.job.shapes import plan_of_job

    job = JobConfig.from_dict({"data": {"batch": 12}, "parallel": {"mesh": {"data": 8}}})
    with pytest.raises(ValueError, match=re.escape("job config data.batch=12 does not split: each step splits it over "
                                                   "the batch axes ('data',) (8 devices)")):
        plan_of_job(job, {"data": 8})


JOB_TEXT = ("model: {name: llama, size: tiny}\ndata: {source: arithmetic, seq_len: 16, batch: 8}\n"
            "parallel: {mesh: {data: 2, model: 4}, rules: {mlp: model}}\ntrain: {steps: 1}\n")


@pytest.mark.parametrize("text, words", [
    (JOB_TEXT.replace("{mlp: model}", "{mpl: model}"), "'mpl' -> 'model' (did you mean 'mlp'?) names a logical "
                                                       "axis that no parameter, activation constraint or batch"),
    ("", "job file '{f}' is empty (or holds only comments): it gives no section to run"),
    ("# a job, to be written\n", "job file '{f}' is empty (or holds only comments)"),
    (JOB_TEXT + "train: {steps: 500}\n", "{f}: key 'train' is given twice, at line 4 and at line 5"),
    (JOB_TEXT.replace("batch: 8}", "batch: 8, seq_len: 32}"), "{f}: key 'seq_len' is given twice, at line 2 and at "
                                                             "line 2"),
])
def test_plan_refuses_what_train_refuses_when_the_job_loads(tmp_path, capsys, text, words):
    """`jaxpar plan --config` printed a plan for a rule typo (train refused it at its first step), for an
    empty file and for a key given twice (YAML kept the last); an empty file trained the built-in example."""
    f = tmp_path / "job.yaml"
    f.write_text(text)
    for command in ("plan", "train"):
        assert main([command, "--config", str(f), *(["--quiet"] if command == "train" else [])]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"jaxpar {command}: error: ") and words.format(f=f) in err, (command, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_override_that_gives_a_key_twice_is_refused():
    with pytest.raises(ValueError, match=r"override value '\{data: 2, data: 4\}' gives key 'data' twice"):
        JobConfig.from_dict({}, overrides=["--parallel.mesh", "{data: 2, data: 4}"])
    merged = JobConfig.from_dict({}, overrides=["--parallel.mesh", "{data: 2, model: 4}"])
    assert dict(merged.parallel.mesh) == {"data": 2, "model": 4}
