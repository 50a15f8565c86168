"""The jaxpar command answers a mistake with exit code 2 and one paragraph, and no flag is a no-op.

Everything runs `main([...])` in-process on the 8 simulated devices of conftest; the expensive
parts (building and compiling the GPT, launching processes, reading checkpoints) are replaced
by recorders, so the file trains nothing.
"""

import argparse
import json
import os
import subprocess
import sys
import types

import jax
import pytest

import jaxpar.checkpoint.offline as offline
import jaxpar.cli as cli
import jaxpar.data.store as store
import jaxpar.job.reports as reports
import jaxpar.job.run as job_run
import jaxpar.job.search as job_search
import jaxpar.launch.launcher as launcher
import jaxpar.report
from jaxpar.cli import jobflags
from jaxpar.cli import plan as plan_command
from jaxpar.cli import main

DP = ["--search", "dynamic_programming"]
# Start JAX's backend with conftest's 8 devices now: main() asks for --devices N CPU devices,
# which would otherwise take effect in this test process.
assert len(jax.devices()) == 8


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Input files of every kind, in a scratch working directory (outputs land there too)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("mesh: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "typo.yaml").write_text("mesg: {data: 8}\n")
    (tmp_path / "dp.yaml").write_text("mesh: {data: 8}\nrules: {batch: data}\n")
    (tmp_path / "tp.yaml").write_text("mesh: {data: 2, model: 4}\nrules: {mlp: model}\n")
    (tmp_path / "remat.yaml").write_text("mesh: {data: 8}\nremat: full\n")
    (tmp_path / "hosts.yaml").write_text("mesh: {data: 4, model: 2}\nhosts: {data: 2}\nrules: {batch: data}\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "t.py").write_text("")                  # the script `jaxpar launch` is given
    (tmp_path / "adir").mkdir()
    (tmp_path / "run").mkdir()                          # a run's goodput ledger (jaxpar goodput)
    (tmp_path / "run" / "goodput.jsonl").write_text(
        '{"event": "start", "time": 1.0, "process_start": 0.0, "step": 0, "pid": 1}\n'
        '{"event": "steps", "time": 5.0, "first": 1, "last": 3, "wall_s": 4.0, "compile_s": 1.0, "data_s": 0.0, '
        '"checkpoint_s": 0.0, "productive_s": 3.0}\n')
    (tmp_path / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp_path / "job.yaml").write_text("model: {size: tiny}\ndata: {path: store}\n")     # a job file
    (tmp_path / "arith.yaml").write_text("model: {name: gpt}\ndata: {source: arithmetic}\n")   # the example's data
    (tmp_path / "llama.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}))
    return tmp_path


class Stop(Exception):
    """Raised by the recorders where the real command would start its work."""


@pytest.fixture
def recorded(monkeypatch):
    """Replace the expensive steps of every command by recorders; returns what they received."""
    calls = []

    def record(name, stop=False, result=0):
        def fake(*args, **kwargs):
            calls.append((name, args, kwargs))
            if stop:
                raise Stop(name)
            return result
        return fake

    # train, plan and report build the job's Trainer with jaxpar.job.run.build (train within run_job)
    monkeypatch.setattr(job_run, "build", record("build", stop=True))
    monkeypatch.setattr(reports, "llama_size_report", record("llama_report", result=FakeReport()))
    monkeypatch.setattr(job_search, "run_plan_search", record("search"))
    monkeypatch.setattr(launcher, "launch", lambda config, script, script_args, echo: record("launch")(
        config, script, script_args))
    monkeypatch.setattr(offline, "inspect", record("inspect", result={"step": 1}))
    monkeypatch.setattr(offline, "format_inspect", lambda report: "TABLE")
    monkeypatch.setattr(offline, "transform", record("transform", result=1))
    monkeypatch.setattr(offline, "merge", record("merge", result=1))
    import jaxpar.interop.hf as hf
    from jaxpar.models.llama import LlamaConfig

    monkeypatch.setattr(hf, "import_hf", record("import_hf", result=(LlamaConfig(), None)))
    monkeypatch.setattr(hf, "export_hf", record("export_hf", result=["config.json"]))
    monkeypatch.setattr(store, "prepare", record("prepare", stop=True))
    return calls


# (argv, words the error must contain). Files are relative to the `files` fixture's folder.
BAD = [
    (["train", "--batch", "0"], "--batch 0: out of range; expected an integer >= 1"),
    (["train", "--batch", "2.5"], "--batch '2.5': not an integer"),
    (["train", "--seq-len", "0"], "--seq-len 0"),
    (["train", "--embed", "0"], "--embed 0"),
    (["train", "--heads", "-2"], "--heads -2"),
    (["train", "--layers", "0"], "--layers 0"),
    (["train", "--lr", "nan"], "--lr nan: out of range; expected a finite number > 0"),
    (["train", "--lr", "inf"], "--lr inf"),
    (["train", "--lr=-1e-3"], "--lr -1e-3"),
    (["train", "--lr", "-1e-3"], "a value that starts with '-' is written --lr=VALUE"),
    (["train", "--steps", "0"], "--steps 0"),
    (["train", "--steps", "-1"], "--steps -1"),
    (["train", "--seed", "-1"], "--seed -1: out of range; expected an integer >= 0"),
    (["train", "--grad-accum", "0"], "--grad-accum 0"),
    (["train", "--devices", "0"], "--devices 0"),
    (["train", "--devices", "-4"], "--devices -4"),
    (["train", "--devices", "64"], "--devices 64: only 8 cpu devices are available"),
    (["train", "--config", "missing.yaml"], "--config 'missing.yaml': does not exist; give a job file (train, plan: "
                                                 "e.g. examples/configs/tiny.yaml) or a YAML file of ParallelConfig"),
    (["train", "--config", "adir"], "--config 'adir': a directory, not a file"),
    (["train", "--config", "bad.yaml"], "--config 'bad.yaml': not valid YAML at line 2"),
    (["train", "--config", "list.yaml"], "holds a YAML list, not a mapping"),
    (["train", "--config", "typo.yaml"], "unknown ParallelConfig fields ['mesg']"),
    (["train", "--config", "binary.yaml"], "--config 'binary.yaml': is not a text file (byte 0x89 at offset 0"),
    (["plan", "--config", "binary.yaml"], "--config 'binary.yaml': is not a text file"),
    (["plan", "--config", "arith.yaml", "--parallel.mode", "auto"],
     "parallel.mode 'auto' is planned by the strategy search on a batch, which jaxpar train runs"),
    (["train", "--config", "job.yaml", "--checkpoint.dir", "afile/ckpt"],
     "checkpoint.dir='afile/ckpt' cannot be written ("),
    (["train", "--config", "job.yaml", "--logging.dir", "afile"], "logging.dir='afile' cannot be written ("),
    (["train", "--config", "arith.yaml", "--samples", "2"], "data.source 'arithmetic' has none; drop --samples"),
    (["train", "--metrics", "afile/m.json"], "--metrics 'afile/m.json' cannot be written"),
    (["train", "--metrics", "adir"], "--metrics 'adir' is a directory"),
    (["train", "--mesh", "data=3,model=2"], "mesh {'data': 3, 'model': 2} has 6 devices but 8 are available"),
    (["train", "--mesh", "data=8", "--rules", "mlp=model"], "names mesh axis 'model', but the mesh axes are ['data']"),
    (["train", "--mode", "sideways"], "mode='sideways'"),
    (["train", "--rules", "mlp=modle"], "names mesh axis 'modle'"),
    (["train", "--embed", "60"], "--embed 60 is not divisible by --heads 8"),
    (["train", "--bogus"], "unrecognized arguments --bogus"),
    (["train", "--profile-steps", "5"], "--profile-steps '5' is not START:STOP"),
    (["train", "--profile-steps", "4:2"], "--profile-steps '4:2' is not START:STOP with 1 <= START < STOP"),
    (["train", "--steps", "5", "--profile-steps", "10:13"], "traces steps 10 to 12, but the run has --steps 5"),
    (["train", "--log-dir", "", "--tensorboard"], "--tensorboard writes into the run directory, but --log-dir is ''"),
    (["train", "--log-dir", "afile"], "--log-dir 'afile' cannot be written"),
    (["train", "--log-every", "0"], "--log-every '0' is not an integer >= 1"),
    (["train", "--peak-flops", "-1"], "--peak-flops '-1' is not a number > 0"),
    (["plan", "--memory-budget", "1"], "--memory-budget applies to --search only"),
    (["plan", "--annotate", "blocks/*/mlp/up=None,model"], "--annotate applies to --search only"),
    (["plan", "--plan-out", "p.json"], "--plan-out applies to --search only"),
    # (--batch is the plain plan's too: its step is traced on the example batch, which must split)
    (["plan", "--mesh", "data=3", "--devices", "3"], "--batch 32 does not split"),
    (["plan", "--steps", "5"], "--steps is for 'jaxpar train' only"),
    (["plan", "--search", "dynamic"], "invalid choice: 'dynamic'"),
    (["plan", *DP, "--zero-levels", "0,1"], "--zero-levels applies only when the whole job is planned"),
    (["plan", *DP, "--schedule", "gpipe", "--remat-options", "full"], "--remat-options, --schedule apply only"),
    (["plan", *DP, "--save", "p.json"], "write the searched strategy with --plan-out 'p.json'"),
    (["plan", *DP, "--mode", "data"], "--mode data is replaced by mode 'auto'"),
    (["plan", *DP, "--memory-budget", "0"], "--memory-budget 0: out of range"),
    (["plan", *DP, "--memory-budget", "nan"], "--memory-budget nan"),
    (["plan", *DP, "--memory-budget", "1e6", "--zero-levels", "x"], "--zero-levels 'x': not a list of integers"),
    (["plan", *DP, "--memory-budget", "1e6", "--accum-options", "0,1"], "--accum-options '0,1'"),
    (["plan", *DP, "--memory-budget", "1e6", "--remat-options", "some"], "unknown policies ['some']"),
    (["plan", *DP, "--memory-budget", "1e6", "--remat", "full"], "--remat full is chosen by the job search"),
    (["plan", *DP, "--config", "remat.yaml", "--memory-budget", "1e6"],
     "--config 'remat.yaml' sets remat 'full', which the job search under --memory-budget chooses itself"),
    (["plan", *DP, "--flops", "-1"], "--flops -1"),
    (["plan", *DP, "--latency", "-1"], "--latency -1: out of range; expected a finite number >= 0"),
    (["plan", *DP, "--annotate", "blocks"], "--annotate 'blocks': not GLOB=SPEC"),
    (["plan", *DP, "--plan-out", "adir"], "--plan-out 'adir' is a directory"),
    (["plan", "--inter-host-bandwidth", "1e9"], "--inter-host-bandwidth applies to --search only"),
    (["plan", *DP, "--inter-host-bandwidth", "0"], "--inter-host-bandwidth 0: out of range"),
    (["plan", *DP, "--inter-host-latency", "-1"], "--inter-host-latency -1: out of range"),
    (["plan", *DP, "--devices-per-host", "0"], "--devices-per-host 0: out of range"),
    (["plan", *DP, "--inter-host-latency", "1e-4"], "only --inter-host-bandwidth BYTES_PER_S prices"),
    (["plan", *DP, "--inter-host-bandwidth", "1e9"], "no mesh axis spans hosts; give the layout with --hosts"),
    (["plan", *DP, "--hosts", "data=2"], "--hosts data=2: the strategy search prices the collectives that cross "
                                         "hosts only with the network between them; add --inter-host-bandwidth"),
    (["plan", *DP, "--memory-budget", "1e6", "--hosts", "data=2"], "chooses which axes span hosts itself"),
    (["plan", *DP, "--memory-budget", "1e6", "--inter-host-bandwidth", "1e9"], "needs --devices-per-host N"),
    (["plan", *DP, "--memory-budget", "1e6", "--inter-host-bandwidth", "1e9", "--devices-per-host", "8"],
     "--devices-per-host 8: the 8 devices the job search plans fit on one host"),
    (["plan", *DP, "--memory-budget", "1e6", "--inter-host-bandwidth", "1e9", "--devices-per-host", "3"],
     "do not fill hosts of 3"),
    (["plan", *DP, "--memory-budget", "1e6", "--mesh", "x=8"], "--mesh x=8 names axes ['x']"),
    (["plan", *DP, "--memory-budget", "1e6", "--mesh", "data=8", "--pipeline-options", "1,2"],
     "--mesh data=8 fixes the mesh, but --pipeline-options 1,2 add meshes"),
    (["plan", *DP, "--mesh", "data=8", "--batch", "12"], "--batch 12 does not split: each step splits it over the "
                                                         "batch axes ('data',) (8 devices)"),
    (["report", "--mesh", "data=8", "--batch", "12"], "multiple of 8; give --batch 16 (or 8)"),
    (["report", "--model", "llama", "--mesh", "data=3"], "--batch 32 does not split"),
    (["train", "--hosts", "data=3"], "hosts={'data': 3} is invalid: axis 'data' of size 2 cannot span 3 hosts"),
    # the hosts of a layout that does not fit this one process are named by the flag that set them
    (["train", "--hosts", "data=2", "--mesh", "data=8"], "--hosts data=2 with --mesh: make_mesh: hosts={'data': 2}"),
    (["plan", *DP, "--memory-budget", "1e6", "--mesh", "data=-1,context=2"], "e.g. --mesh data=-1, or leave"),
    (["report", "--lr", "0.1"], "--lr is for 'jaxpar train' only"),
    (["report", "--batch", "0"], "--batch 0"),
    (["report", "--json", "--config", "missing.yaml"], "--config 'missing.yaml': does not exist"),
    (["ckpt", "transform", "adir", "--to", "typo.yaml", "out"], "unknown ParallelConfig fields ['mesg']"),
    (["ckpt", "inspect", "adir", "--step", "-1"], "--step -1: out of range; expected an integer >= 0"),
    (["ckpt", "merge", "adir", "out", "--step", "x"], "--step 'x': not an integer"),
    (["ckpt", "transform", "adir", "--to", "missing.yaml", "out"], "missing.yaml"),
    (["ckpt", "transform", "adir", "--to", "bad.yaml", "out"], "--to 'bad.yaml' is not valid YAML"),
    (["ckpt", "transform", "adir", "--to", "list.yaml", "out"], "--to 'list.yaml' holds a list"),
    (["ckpt", "transform", "adir", "--to", "dp.yaml", "out", "--devices", "0"], "--devices 0"),
    (["ckpt", "frobnicate"], "invalid choice: 'frobnicate'"),
    (["k8s", "--workers", "0", "--image", "img", "--", "python", "t.py"], "workers=0"),
    (["k8s", "--workers", "two", "--image", "img"], "invalid int value: 'two'"),
    (["k8s", "--workers", "2", "--image", "img", "--env", "A", "--", "python", "t.py"], "--env 'A'"),
    (["launch", "--worker-num", "0", "t.py"], "worker_num=0"),
    (["launch", "--master-port", "70000", "t.py"], "master_port=70000"),
    (["launch", "--cluster-time-out", "-1", "t.py"], "cluster_time_out=-1.0"),
    (["launch", "--exit-time-out", "0", "t.py"], "exit_time_out"),
    (["launch", "adir"], "script 'adir' is a directory; give the Python script (or executable) each worker runs"),
    (["launch", "missing.py"], "script 'missing.py' does not exist (relative paths start at "),
    (["launch", "sh"], "script 'sh' does not exist (relative paths start at "),     # a command: its path is asked
    (["data", "prepare", "missing.txt", "--out", "store"], "input 'missing.txt' is not a file"),
    (["data", "prepare", "afile", "--out", "afile"], "--out 'afile' is a file"),
    (["data", "prepare", "afile", "--out", "afile/sub"], "--out 'afile/sub' is inside"),
    (["data", "verify", "adir"], "no token store index at 'adir/index.json'"),
    (["data", "prepare", "afile", "--out", "store", "--tokenizer", "missing.json"], "tokenizer 'missing.json' does"),
    (["data", "prepare", "afile", "--out", "store", "--tokenizer", "afile"], "is not a Hugging Face tokenizer.json"),
    (["data", "prepare", "afile", "--out", "store", "--eos", "</s>"], "eos='</s>' is for a tokenizer.json"),
    (["data", "prepare", "afile", "--out", "store", "--shard-tokens", "0"], "--shard-tokens '0' is not valid"),
    (["data", "prepare", "afile", "--out", "store", "--docs", "para"], "invalid choice: 'para'"),
    (["data", "prepare", "afile"], "the following arguments are required: --out"),
    (["sideways"], "invalid choice: 'sideways'"),
    (["goodput", "nodir"], "RUN_DIR 'nodir' is not a directory"),
    (["goodput", "adir"], "goodput.jsonl does not exist"),
    (["goodput", "run", "--plot", "afile/g.png"], "--plot 'afile/g.png' cannot be written"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_exits_2_with_one_paragraph(files, recorded, capsys, argv, words):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    assert words in err, err
    assert "\n\n" not in err.strip() and err.startswith("jaxpar"), err   # one paragraph
    assert not [c for c in recorded if c[0] in ("build", "search", "launch", "transform", "merge", "prepare")], \
        "the command started its work before refusing"


def test_there_are_at_least_40_bad_inputs_over_every_command():
    assert len(BAD) >= 40
    assert {a[0] for a, _ in BAD} >= {"train", "plan", "report", "ckpt", "k8s", "launch", "data"}


# -- every flag changes the result or is refused ------------------------------------------------

# A non-default value for every flag, per command; files are those of the `files` fixture.
JOB = {"--config": "dp.yaml", "--mesh": "data=8", "--hosts": "data=2", "--rules": "mlp=model", "--mode": "data", "--remat": "full",
       "--optimizer": "level=1", "--pipeline": "stages=2,microbatches=4", "--grad-accum": "2", "--devices": "4",
       "--layers": "3", "--embed": "32", "--heads": "4", "--seq-len": "16", "--scan": None, "--batch": "16"}
SEARCH = {"--search": "recursive_programming", "--annotate": "blocks/*/mlp/up=None,model",
          "--memory-budget": "2e6", "--zero-levels": "0,1", "--accum-options": "1", "--remat-options": "none,full",
          "--pipeline-options": "1,2", "--microbatch-options": "2", "--schedule": "gpipe", "--context-options": "1,2",
          "--context-strategies": "ulysses", "--flops": "1e9",
          "--bandwidth": "1e9", "--latency": "1e-6", "--inter-host-bandwidth": "1e9", "--inter-host-latency": "1e-4",
          "--devices-per-host": "4"}
VALUES = {
    ("train",): {**JOB, "--steps": "5", "--lr": "0.01", "--seed": "1", "--log-dir": "L", "--log-every": "5",
                 "--tensorboard": None, "--profile-steps": "2:4", "--peak-flops": "1e12"},
    ("plan",): {**JOB, **SEARCH},
    ("report",): {**JOB, "--model": "llama", "--size": "1b", "--step-time": "0.5", "--peak-flops": "1e15",
                  "--dtype": "bfloat16", "--backend": "gpu"},
    ("ckpt", "inspect"): {"--json": None, "--step": "3"},
    ("ckpt", "transform"): {"--to": "tp.yaml", "--step": "3", "--devices": "4"},
    ("ckpt", "merge"): {"--step": "3"},
    ("ckpt", "import-hf"): {"--out": "ck2", "--to": "tp.yaml", "--devices": "4", "--scan-layers": None,
                            "--dtype": "bfloat16", "--force": None},
    ("ckpt", "export-hf"): {"--out": "hf2", "--step": "3", "--dtype": "bfloat16", "--max-shard-size": "1GB",
                            "--hf-config": "llama.json", "--force": None},
    ("data", "prepare"): {"--out": "other", "--tokenizer": "afile", "--train-tokenizer": "300", "--eos": "</s>", "--docs": "line",
                          "--shard-tokens": "1000", "--errors": "replace", "--quiet": None},
    ("data", "verify"): {},
    ("launch",): {"--worker-num": "8", "--local-worker-num": "4", "--master-addr": "127.0.0.2",
                  "--master-port": "9001", "--bind-address": "127.0.0.1", "--node-rank": "1", "--log-dir": "L",
                  "--join": None, "--cluster-time-out": "7", "--simulated-devices": "2", "--devices-per-worker": "1",
                  "--kill-time-out": "3", "--exit-time-out": "4", "--servers": "2",
                  "--server-restarts": "1", "--server-port": "9100", "--server-time-out": "5",
                  "--server-checkpoint-dir": "C", "--server-module": "m.server", "--worker-restarts": "1",
                  "--server-checkpoint-every": "5", "--min-workers": "2", "--rendezvous-port": "9002",
                  "--rejoin-time-out": "7"},
    ("goodput",): {"--json": None, "--plot": "g.png"},
    ("k8s",): {"--workers": "3", "--image": "other", "--name": "job2", "--jobset": None, "--port": "9001",
               "--namespace": "ns", "--gpus-per-worker": "1", "--simulated-devices": "2",
               "--cluster-time-out": "9", "--env": "A=1", "--servers": "2", "--server-port": "8600",
               "--server-storage": "5Gi", "--ps-token-secret": "sec"},
}
# Flags that only choose where or how the result is shown; each has its own test:
#   train --metrics (test_cli.py::test_train_writes_metrics, unwritable paths in BAD),
#   train --quiet (the progress bar only), plan --save and --plan-out (test_cli.py),
#   report --json (test_report_json_prints_only_json below), --debug (test_debug_*).
EXEMPT = {("train",): {"--metrics", "--quiet"}, ("plan",): {"--save", "--plan-out"}, ("report",): {"--json"}}
# The argv each flag is added to: the cheapest run of the command. The search flags other
# than --search join `plan --search`, those of the job search `plan --search --memory-budget`.
BASE = {
    ("train",): ["train"], ("plan",): ["plan"], ("report",): ["report"],
    ("ckpt", "inspect"): ["ckpt", "inspect", "src"], ("ckpt", "transform"): ["ckpt", "transform", "src", "--to",
                                                                                "dp.yaml", "out"],
    ("ckpt", "merge"): ["ckpt", "merge", "src", "out"],
    ("ckpt", "import-hf"): ["ckpt", "import-hf", "src", "--out", "ck"],
    ("ckpt", "export-hf"): ["ckpt", "export-hf", "ck", "--out", "hf"],
    ("launch",): ["launch", "--worker-num", "4", "--local-worker-num", "2"],
    ("data", "prepare"): ["data", "prepare", "afile", "--out", "store"],
    ("k8s",): ["k8s", "--workers", "2", "--image", "img"],
    ("goodput",): ["goodput", "run"],
}
BUDGET_FLAGS = {"--zero-levels", "--accum-options", "--remat-options", "--pipeline-options", "--microbatch-options",
                "--schedule", "--context-options", "--context-strategies"}
TAIL = {("launch",): ["t.py", "--x"], ("k8s",): ["--", "python", "t.py"]}


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _commands():
    """(command path, its parser) for every command whose flags the table covers."""
    top = _subparsers(cli.make_parser())
    for name, parser in top.items():
        if name in ("ckpt", "data"):
            yield from (((name, sub), p) for sub, p in _subparsers(parser).items())
        else:
            yield (name,), parser


def _flags(parser):
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_the_table_names_every_flag():
    for path, parser in _commands():
        covered = set(VALUES[path]) | EXEMPT.get(path, set())
        assert set(_flags(parser)) == covered, f"{path}: flags without a value in VALUES or EXEMPT"


def _base(path, flag):
    base = list(BASE[path])
    if path == ("plan",) and flag in SEARCH and flag != "--search":
        base += DP + (["--memory-budget", "1e6"] if flag in BUDGET_FLAGS else [])
    return base


def _outcome(argv, recorded, capsys):
    """("refused", err) when main exits 2, else ("ran", what the command's work received, stdout)."""
    recorded.clear()
    try:
        code = main(argv)
    except Stop:
        code = 0
    out, err = capsys.readouterr()
    if code == 2:
        assert "Traceback" not in err and err.startswith("jaxpar"), err
        return "refused", err
    assert code == 0, (argv, out, err)
    return "ran", [(name, args, kwargs) for name, args, kwargs in recorded], out


CASES = [(path, flag) for path, parser in _commands() for flag in _flags(parser)
         if flag not in EXEMPT.get(path, set())]


@pytest.mark.parametrize("path, flag", CASES, ids=[" ".join(p) + " " + f for p, f in CASES])
def test_every_flag_changes_the_result_or_is_refused(files, recorded, capsys, path, flag):
    base = _base(path, flag)
    value = VALUES[path][flag]
    given = base + [flag] + ([] if value is None else [value])
    without = _outcome(base + TAIL.get(path, []), recorded, capsys)
    assert without[0] == "ran", without
    with_flag = _outcome(given + TAIL.get(path, []), recorded, capsys)
    assert with_flag != without, f"{' '.join(given)} changed nothing"


def test_flags_in_the_generic_test_that_are_refused_alone_say_why(files, recorded, capsys):
    """A few flags need another one; the refusal names what to add (not a silent no-op)."""
    kind, err = _outcome(["train", "--pipeline", "stages=2,microbatches=4"], recorded, capsys)
    assert kind == "refused" and "pipe" in err


def test_annotations_reach_the_job_search(files, recorded, capsys, monkeypatch):
    """--annotate with --memory-budget goes to search_job through the base config's parameter_strategy."""
    seen = {}

    def search_job(*args, base_config, **kwargs):
        seen["parameter_strategy"] = dict(base_config.parameter_strategy)
        raise Stop("search_job")

    import jaxpar.auto

    monkeypatch.setattr(jaxpar.auto, "search_job", search_job)
    args = cli.make_parser().parse_args(["plan", *DP, "--memory-budget", "1e6", "--annotate",
                                         "blocks/*/mlp/up=None,model"])
    job, devices = jobflags.resolve_job(args)
    settings = plan_command.search_settings(args, job)
    with pytest.raises(Stop):
        job_search._search_job(settings, job, job_search.search_space(settings, len(devices)), batch=None)
    from jax.sharding import PartitionSpec

    assert seen["parameter_strategy"] == {"blocks/*/mlp/up": PartitionSpec(None, "model")}


def test_the_two_network_flags_and_the_mesh_reach_the_job_search(files):
    """--inter-host-bandwidth, --inter-host-latency and --devices-per-host become the CostParams
    fields of the same names; --mesh (even with -1) the job search's one mesh."""
    args = cli.make_parser().parse_args(["plan", *DP, "--memory-budget", "1e6", "--mesh", "data=-1,model=2",
                                         "--inter-host-bandwidth", "2e9", "--inter-host-latency", "1e-4",
                                         "--devices-per-host", "4"])
    job, devices = jobflags.resolve_job(args, plan_hosts=True)
    settings = plan_command.search_settings(args, job)
    costs = settings.costs
    assert (costs.inter_host_bandwidth, costs.inter_host_latency, costs.devices_per_host) == (2e9, 1e-4, 4)
    assert job_search.search_space(settings, len(devices)).meshes == ({"data": 4, "model": 2},)


def test_a_hosts_layout_is_priced_by_the_strategy_search(files, monkeypatch):
    """plan --search --hosts data=2 --inter-host-bandwidth: built as one host on this process,
    searched with the machine numbers placed on the layout (`CostParams.placed`)."""
    seen = {}

    def build(job, devices):
        seen["hosts"] = dict(job.parallel.hosts)
        return types.SimpleNamespace(mesh=types.SimpleNamespace(shape={"data": 4, "model": 2}),
                                     trainer=types.SimpleNamespace(model=None), example_batch=lambda: {})

    def search(model, loss_fn, batch, config, mesh, *, cost_params, annotate):
        seen["costs"] = cost_params
        raise Stop("search")

    import jaxpar.auto

    monkeypatch.setattr(job_run, "build", build)
    monkeypatch.setattr(jaxpar.auto, "search", search)
    args = cli.make_parser().parse_args(["plan", *DP, "--mesh", "data=4,model=2", "--hosts", "data=2",
                                         "--inter-host-bandwidth", "1e9", "--inter-host-latency", "1e-3"])
    job, devices = jobflags.resolve_job(args, plan_hosts=True)
    with pytest.raises(Stop):
        job_search.run_plan_search(plan_command.search_settings(args, job), job, devices)
    costs = seen["costs"]
    assert seen["hosts"] == {} and costs.hosts == {"data": 2} and costs.inter_host_bandwidth == 1e9
    assert costs.latency_per_axis["data"] == 1e-3 and "model" not in costs.bandwidth    # data crosses hosts


def test_plan_and_report_lay_a_hosts_layout_out_on_this_process(files, recorded, capsys):
    """Two hosts on the 8 simulated devices of one process: planned as one host, with a note."""
    for argv in (["plan", "--config", "hosts.yaml"], ["report", "--mesh", "data=4,model=2", "--hosts", "data=2"],
                 ["report", "--config", "hosts.yaml", "--model", "llama"]):
        try:
            assert main(argv) == 0, capsys.readouterr().err
        except Stop:        # at the build of the GPT's Trainer
            pass
        assert "note: hosts {'data': 2} (2 hosts of 4 devices) planned on this one process as one host" in capsys.readouterr().out
        name, args, kwargs = recorded[-1]
        config = args[0].parallel if name == "build" else args[1]
        assert config.hosts == {} and config.mesh == {"data": 4, "model": 2}, recorded[-1]
    assert main(["train", "--config", "hosts.yaml"]) == 2      # training needs the hosts' processes
    assert "asks for 2 hosts of 4 devices each" in capsys.readouterr().err


# -- output streams, --debug, help --------------------------------------------------------------

class FakeReport:
    def format(self, detail=True):
        return "MEMORY TABLE"

    def summary(self):
        return {"memory": {"argument_bytes": 1}}


def test_report_json_prints_only_json(files, monkeypatch, capsys):
    monkeypatch.setattr(job_run, "build", lambda job, devices: types.SimpleNamespace(trainer=None,
                                                                                     example_batch=lambda: {}))
    monkeypatch.setattr(jaxpar.report, "step_report", lambda trainer, batch: FakeReport())
    assert main(["report", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"memory": {"argument_bytes": 1}}
    assert "MEMORY TABLE" in err
    assert main(["report"]) == 0
    out, err = capsys.readouterr()
    assert "MEMORY TABLE" in out and not err


def test_debug_shows_the_traceback_of_a_user_error(files, recorded):
    with pytest.raises(cli.UserError, match="--memory-budget applies to --search only"):
        main(["--debug", "plan", "--memory-budget", "1"])


def test_a_bug_keeps_its_traceback(files, monkeypatch):
    """A ValueError that jaxpar's validation did not raise is a bug: it is not turned into exit 2."""
    def broken(job, devices):
        return int("not a number")       # raised by int(), not by a jaxpar check

    monkeypatch.setattr(job_run, "build", broken)
    with pytest.raises(ValueError, match="invalid literal"):
        main(["report"])


def test_a_message_jaxpar_wrote_after_resolution_is_one_paragraph(files, monkeypatch, capsys):
    from jaxpar.distributed import process_rows

    monkeypatch.setattr(job_run, "build", lambda job, devices: process_rows(3, process_index=0, process_count=2))
    assert main(["report"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar report: error: global_batch_size=3 does not split over 2 processes")


def test_top_level_help_is_plain_and_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out
    for name in ("train", "plan", "report", "launch", "k8s", "ckpt"):
        assert f"\n    {name} " in out, name


def test_ckpt_prints_no_absl_warnings(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", "ckpt", "inspect", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == f"jaxpar ckpt inspect: error: no complete checkpoint in {tmp_path / 'none'}"


# -- one job system: the flags and the job file make the same JobConfig --------------------------

EQUIVALENT = """\
model: {name: gpt, fields: {vocab_size: 16, seq_len: 16, embed: 32, heads: 4, mlp: 128, layers: 3}}
data: {source: arithmetic, seq_len: 16, batch: 16, seed: 1}
optimizer: {lr: 0.01, warmup_steps: 10, schedule: cosine, min_lr_ratio: 0.0, weight_decay: 1.0e-4,
            decay_1d: true, clip_norm: null, b2: 0.999}
parallel: {mesh: {data: 4, model: 2}, rules: {mlp: model}, grad_accum: 2}
train: {steps: 50, seed: 1}
logging: {dir: L, every: 5, profile_steps: "2:4", peak_flops: 1.0e+12}
"""


def test_train_flags_and_the_equivalent_job_file_run_the_same_job(files, recorded, capsys):
    """`jaxpar train --flags` and `jaxpar train --config job.yaml` reach the one runner
    (jaxpar.job.run.run_job -> build) with equal JobConfig values and the same devices."""
    (files / "same.yaml").write_text(EQUIVALENT)
    flags = ["train", "--mesh", "data=4,model=2", "--rules", "mlp=model", "--grad-accum", "2", "--devices", "8",
             "--layers", "3", "--embed", "32", "--heads", "4", "--seq-len", "16", "--batch", "16", "--steps", "50",
             "--lr", "0.01", "--seed", "1", "--log-dir", "L", "--log-every", "5", "--profile-steps", "2:4",
             "--peak-flops", "1e12"]
    runs = []
    for argv in (flags, ["train", "--config", "same.yaml", "--devices", "8"]):
        recorded.clear()
        with pytest.raises(Stop):
            main(argv)
        (name, args, kwargs), = recorded
        runs.append((args[0], list(kwargs["devices"])))
    (by_flags, devices), (by_file, file_devices) = runs
    assert by_flags == by_file, (by_flags, by_file)
    assert devices == file_devices == jax.devices()
    # and a default `jaxpar train` is a job a file can say too: the YAML it prints reads back to it
    recorded.clear()
    with pytest.raises(Stop):
        main(["train"])
    job = recorded[0][1][0]
    (files / "default.yaml").write_text(job.to_yaml())
    recorded.clear()
    with pytest.raises(Stop):
        main(["train", "--config", "default.yaml"])
    assert recorded[0][1][0] == job
    # `jaxpar plan` of the job file plans the example GPT from shapes alone
    capsys.readouterr()
    assert main(["plan", "--config", "same.yaml"]) == 0
    assert "train plan (given) on mesh {'data': 4, 'model': 2}" in capsys.readouterr().out


def test_the_example_data_keeps_its_position_for_a_resume():
    from jaxpar.job.example import ArithmeticLoader

    loader = ArithmeticLoader(seq_len=8, batch=2, seed=3)
    it = iter(loader)
    next(it), next(it)
    state, third = loader.state(), next(it)
    again = ArithmeticLoader(seq_len=8, batch=2, seed=3)
    again.restore(state)
    assert state == {"next_batch": 2} and (next(iter(again))["inputs"] == third["inputs"]).all()
    assert (again.batch(0)["inputs"] == loader.batch(0)["inputs"]).all()


@pytest.mark.parametrize("flags, words", [
    (["--parallel.mesh", "{data: 4}"], "parallel.mesh: mesh {'data': 4} has 4 devices but 8 are available; make the "
     "sizes multiply to 8, or set one axis to -1 to take the rest; or give --devices 4 to run on the first 4"),
    (["--checkpoint.keep", "0"], "job config checkpoint.keep=0: the number of newest steps to keep must be 1 or more"),
    (["--checkpoint.local_every", "5"], "job config checkpoint.local_every=5: the local tier needs both "
     "checkpoint.local_dir (node-local storage, e.g. /dev/shm/run1) and checkpoint.local_every"),
    (["--devices", "0"], "error: --devices 0: out of range; expected an integer >= 1"),
    (["--samples", "-1"], "error: --samples -1: out of range; expected an integer >= 0"),
])
def test_a_job_files_mistakes_are_named_in_the_command_lines_terms(files, recorded, capsys, flags, words):
    # the job file's fields and flags, not the Python API's arguments (devices=..., Checkpointer keep=)
    assert main(["train", "--config", "job.yaml", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "devices=jax.devices()" not in err and "Checkpointer" not in err, err
    assert "--samples" not in err or "--devices" not in err, err           # only the flag given
    assert not recorded
    if flags[0] != "--parallel.mesh":
        return
    assert main(["train", "--mesh", "data=4"]) == 2      # the example's flags: the same fix
    assert "--mesh: mesh {'data': 4} has 4 devices" in capsys.readouterr().err


def test_ckpt_to_names_the_flag_and_takes_a_job_files_parallel_section(files, recorded, capsys):
    """--to a missing file named --to and what it takes (it was '[Errno 2] No such file or
    directory'); --to a job file used its parallel section (it was 'unknown ParallelConfig fields
    ['checkpoint', 'data', ...]'); --force reaches import_hf / export_hf."""
    assert main(["ckpt", "transform", "adir", "--to", "nothere.yaml", "out"]) == 2
    err = capsys.readouterr().err
    assert "--to 'nothere.yaml': no such file or directory; give a YAML/JSON ParallelConfig file" in err, err
    assert "a job file (its parallel section is used)" in err and not recorded
    (files / "tpjob.yaml").write_text("model: {size: tiny}\ndata: {path: store}\n"
                                      "parallel: {mesh: {data: 2, model: 4}, rules: {mlp: model}}\n")
    assert main(["ckpt", "transform", "adir", "--to", "tpjob.yaml", "out"]) == 0
    assert main(["ckpt", "import-hf", "adir", "--to", "tpjob.yaml", "--out", "c", "--force"]) == 0
    assert main(["ckpt", "export-hf", "adir", "--out", "h", "--force"]) == 0
    (_, transform_args, _), (_, _, import_kwargs), (_, _, export_kwargs) = recorded
    assert transform_args[2].mesh == {"data": 2, "model": 4} and transform_args[2].rules == {"mlp": "model"}
    assert import_kwargs["config"].mesh == {"data": 2, "model": 4} and import_kwargs["force"] is True
    assert export_kwargs["force"] is True
    assert "laid out on mesh {'data': 2, 'model': 4}" in capsys.readouterr().out


def test_report_config_refuses_a_job_file_with_the_command_for_it(files, recorded, capsys):
    assert main(["report", "--config", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--config 'job.yaml' is a job file (sections model, data)" in err, err
    assert "jaxpar plan --config job.yaml" in err and "unknown ParallelConfig fields" not in err, err
    assert not recorded


def test_the_scripts_flags_reach_it_untouched_even_when_they_begin_a_launcher_flag(files, recorded):
    # --local began --local-worker-num and --worker began --worker-num / --worker-restarts: with
    # argparse's abbreviations the launcher refused them as "ambiguous" before the script ran
    argv = ["--local", "--worker", "3", "--log-dir", "x", "--steps", "2"]
    assert main(["launch", "--worker-num", "1", "--local-worker-num", "1", "t.py", *argv]) == 0
    (name, (config, script, script_args), _), = recorded
    assert (name, script, script_args, config.log_dir) == ("launch", "t.py", argv, launcher.LaunchConfig().log_dir)
