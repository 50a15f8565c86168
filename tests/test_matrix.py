"""The combination matrix: every pair of features trains equal to one device, or is refused.

Cells run in child processes (a few cells each) under a timeout, so a cell that aborts the
process or hangs fails its test by name instead of taking the suite down.
"""

import fcntl
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jaxpar
import matrix

GROUP = 6
GROUPS = [matrix.CELLS[i:i + GROUP] for i in range(0, len(matrix.CELLS), GROUP)]
WORKER = os.path.join(os.path.dirname(__file__), "workers", "matrix_worker.py")
# Cells compile fresh: XLA:CPU executables loaded from the persistent compilation cache can
# deadlock in a collective rendezvous (seen with pipeline x ring attention x expert dispatch:
# the same program runs when compiled, and times out when loaded; docs/composition.md).
WORKER_ENV = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")


def _references(cells, path) -> str:
    """The one-device references the ``cells`` are compared with, saved to ``path``."""
    arrays = {}
    for key in sorted({matrix.reference_key(cell) for cell in cells}):
        name = matrix.reference_name(key)
        losses, params = matrix.reference(key)
        arrays[f"{name}/losses"] = np.asarray(losses)
        for i, (_, x) in enumerate(sorted(matrix.flat_params(params).items())):
            arrays[f"{name}/p/{i:04d}"] = np.asarray(x, np.float32)
    np.savez(path, **arrays)
    return str(path)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The references file, computed once per run: under xdist the first worker to need it
    writes it to the run's shared temporary folder (under a lock). A worker that finds the lock
    held does not wait: its cells' process trains its first cell meanwhile and reads the file
    when it appears (`matrix.load_references`)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:       # one process (no xdist, or no -n)
        return _references(matrix.CELLS, tmp_path_factory.mktemp("matrix") / "reference.npz")
    shared = tmp_path_factory.getbasetemp().parent     # one folder per run, shared by its workers
    path = shared / "matrix_reference.npz"
    with open(shared / "matrix_reference.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:         # another worker is writing it
            return str(path)
        if not path.exists():
            os.replace(_references(matrix.CELLS, shared / "matrix_reference.partial.npz"), path)
    return str(path)


def _run_worker(cells, references, tmp_path) -> list[dict]:
    """One JSON line per cell from a child process under a timeout; fails naming a cell that
    ended the process."""
    spec, out = tmp_path / "cells.json", tmp_path / "out.jsonl"
    spec.write_text(json.dumps(cells))
    proc = subprocess.run([sys.executable, WORKER, str(spec), references, str(out), str(tmp_path)],
                          capture_output=True, text=True, timeout=560, env=WORKER_ENV)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if len(lines) < len(cells):
        stuck = matrix.name(cells[len(lines)])
        pytest.fail(f"cell {stuck} ended the process (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return lines


def _failures(lines) -> list[str]:
    failures = []
    for line in lines:
        if "error" in line or "refused" in line:
            failures.append(f"{line['name']}: {line.get('error') or line['refused'] + chr(10) + line.get('where', '')}")
        elif line["loss_err"] > line["tolerance"][0] or line["param_err"] > line["tolerance"][1]:
            failures.append(f"{line['name']}: losses {line['loss_err']:.2e}, parameters {line['param_err']:.2e}")
        elif line.get("stray"):
            failures.append(f"{line['name']}: collectives a stage's branch must not hold: {line['stray'][:3]}")
    return failures


def test_cells_cover_every_pair():
    covered = {p for cell in matrix.CELLS for p in matrix._pairs(cell)}
    missing = matrix.all_pairs() - covered
    assert not missing, f"pairs no cell covers: {sorted(missing)[:5]}"
    # the full product of the three most used features is there too
    for schedule in matrix.FEATURES["pipeline"]:
        for zero in (0, 1):
            assert any(c["layout"] == "megatron" and c["pipeline"] == schedule and c["zero"] == zero
                       for c in matrix.CELLS)


@pytest.mark.slow
@pytest.mark.parametrize("cells", GROUPS, ids=[f"cells{i * GROUP}-{i * GROUP + len(g) - 1}" for i, g in enumerate(GROUPS)])
def test_cells_match_one_device(cells, references, tmp_path):
    failures = _failures(_run_worker(cells, references, tmp_path))
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def launched_expected(tmp_path_factory):
    """What the launched slice's extras (tests/workers/launched_extras.py) must equal, from one
    process: a token store and the losses and evaluation of a TokenLoader reading whole batches
    on it, and the ServerRows job's losses (one device, the tables in the process)."""
    from jaxpar.data import LoaderProcess, prepare
    from jaxpar.models.data import arithmetic_text
    from workers import launched_extras
    from workers.loader_worker import train
    from workers.ps_model import reference

    folder = tmp_path_factory.mktemp("launched")
    (folder / "corpus.txt").write_text(arithmetic_text(800, seed=2))
    store = str(folder / "store")
    prepare([str(folder / "corpus.txt")], store, docs="line", progress=False)
    losses, evaluated = train(store, 3, process=LoaderProcess(index=0, count=1))
    return {"store": store, "loader": (losses, evaluated), "server_rows": reference(launched_extras.STEPS_PS)[0]}


def _check_extras(extras: dict, processes: int) -> list[str]:
    """The errors of the launched extras' lines (``{name: line}``), and HostRows not refused by name."""
    failures = [f"{name}: {line['error']}" for name, line in extras.items() if "error" in line]
    refused = extras["host_rows"].get("refused", "")
    if not (f"a job of {processes} processes" in refused and "HostRows" in refused and "ServerRows" in refused):
        failures.append(f"host_rows: not refused by name: {extras['host_rows']}")
    return failures


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(560)
@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_cells_under_launch_match_one_device(references, launched_expected, tmp_path, tag, processes, devices):
    """`matrix.LAUNCHED` under `jaxpar launch` on localhost, every process feeding only its own
    rows of each global batch: the one-device losses and parameters, as in one process. In the
    same job (tests/workers/launched_extras.py): a TokenLoader per process and ServerRows with
    one parameter-server worker per process equal one process; HostRows is refused by name; a
    SIGTERM to one process makes every process save one agreed step, which one process restores
    and trains on to the uninterrupted losses and parameters."""
    from workers.procs import WORKERS, Launch
    from workers.ps_model import TOKEN
    from workers.ps_servers import Servers

    from jaxpar.launch.ports import free_port

    spec = tmp_path / "cells.json"
    spec.write_text(json.dumps(matrix.LAUNCHED))
    preempted = tmp_path / "preempted"
    args = ["--worker-num", processes, "--local-worker-num", processes, "--simulated-devices", devices,
            "--master-port", free_port(), "--cluster-time-out", 60]
    servers = run = None
    code, stopped = None, []
    try:
        servers = Servers(tmp_path, tag, count=2, token=TOKEN)
        run = Launch(tmp_path, tag, args, ["--cells", spec, "--references", references,
                                           "--store", launched_expected["store"],
                                           "--servers", ",".join(servers.addresses), "--preempt", preempted],
                     script=os.path.join(WORKERS, "matrix_launch_worker.py"), entry=("-m", "jaxpar.cli", "launch"))
        code = run.wait(timeout=500)
    except subprocess.TimeoutExpired:
        pass                # reported below with every process's log
    finally:
        try:
            if run is not None:
                run.close()
        finally:
            if servers is not None:
                stopped = servers.stop()
    out = run.out_dir / "out.jsonl"
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    extras = {line["name"]: line for line in lines[len(matrix.LAUNCHED):]}
    logs = "\n".join(f"process {r}:\n{run.log(r)[-2000:]}" for r in range(processes))
    assert len(lines) == len(matrix.LAUNCHED) + 4, (code, run.stderr[-3000:], logs)
    assert code == 0 and stopped == [0, 0], (stopped, run.stderr[-3000:], logs)
    assert all(line["processes"] == processes for line in lines)
    failures = _failures(lines[:len(matrix.LAUNCHED)]) + _check_extras(extras, processes)
    assert not failures, "\n".join(failures)
    losses, evaluated = launched_expected["loader"]
    np.testing.assert_allclose(extras["loader"]["losses"], losses, rtol=1e-5)
    assert extras["loader"]["evaluated"] == pytest.approx(evaluated, rel=1e-5)
    np.testing.assert_allclose(extras["server_rows"]["losses"], launched_expected["server_rows"], rtol=0, atol=1e-6)
    _check_preempted(extras["preempt"], references, str(preempted), processes)


def _check_preempted(line: dict, references: str, directory: str, processes: int) -> None:
    """Every process stopped at one step after the SIGTERM, that step is the directory's newest,
    and one process restoring it trains on to the one-device losses and parameters."""
    from workers import launched_extras

    stopped = line["stopped"]
    assert len(stopped) == processes and len(set(stopped)) == 1, stopped
    step = stopped[0]
    assert launched_extras.PREEMPT_AFTER < step <= matrix.STEPS, stopped
    assert jaxpar.checkpoint.latest_step(directory) == step
    refs = matrix.References(references)
    cell = matrix.BASE
    expected = matrix.load_references(references)[matrix.reference_name(matrix.reference_key(cell))]
    np.testing.assert_allclose(line["losses"], expected[0][:step], rtol=matrix.TOLERANCE["none"][0])
    trainer = matrix._trainer(matrix.config_for(cell), matrix.gpt_config(cell), 8)
    trainer.restore(directory)
    assert trainer.step_count == step
    losses = line["losses"] + [float(trainer.step(b)["loss"]) for b in matrix._batches()[step:]]
    loss_err, param_err = refs.errors(cell, losses, matrix._params(trainer))
    assert loss_err <= matrix.TOLERANCE["none"][0] and param_err <= matrix.TOLERANCE["none"][1], (loss_err, param_err)


@pytest.mark.slow
def test_llama_under_pipeline_and_vocab_split_megatron_matches_one_device(tmp_path):
    # The reported job (issue #29): pipe x Megatron with the vocabulary split on a Llama, 1F1B and
    # interleaved; equal to one device, and no stage's branch holds a collective that waits for
    # devices of another stage (what aborted it in the rendezvous).
    lines = _run_worker(matrix.EXTRA, _references(matrix.EXTRA, tmp_path / "reference.npz"), tmp_path)
    assert all("stray" in line for line in lines if "error" not in line)
    failures = _failures(lines)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_splits_off_shard_boundaries_in_a_stage_train_or_are_refused_by_name(tmp_path):
    # A fused QKV kernel cut into thirds that straddle the 'model' shards is refused when the step
    # compiles (naming the stage, the parameter, the axis), before it could abort the process; 3 heads
    # over model=2 train equal to one device when the heads live in a flat width, and are refused when
    # the model is built when they are a kernel dimension (naming the parameter, the sizes, the axis).
    trained = [c for c in matrix.MISALIGNED if c["model"] not in matrix.MISALIGNED_REFUSAL]
    lines = _run_worker(matrix.MISALIGNED, _references(trained, tmp_path / "reference.npz"), tmp_path)
    for cell, line in zip(matrix.MISALIGNED, lines):
        if cell["model"] in matrix.MISALIGNED_REFUSAL:
            assert "refused" in line, line
            for words in matrix.MISALIGNED_REFUSAL[cell["model"]]:
                assert re.search(words, line["refused"]), (words, line["refused"])
        else:
            assert not _failures([line]), _failures([line])


# How each feature is named in the Trainer's refusal.
NAMED = {"mode": "mode='{}'", "pipeline": r"pipeline\.stages( > 1|=2)", "context": "context=", "moe": "mixture-of-experts",
         "precision": "precision"}
ON = {"pipeline": "1f1b", "context": "ring", "moe": "ep"}   # the other feature of a refused pair, switched on


@pytest.mark.parametrize("pair", [p for p in matrix.REFUSED if p[0] != "precision"], ids="-".join)
def test_refused_pairs_name_both_features(pair):
    feature, value, other = pair
    cell = dict(matrix.BASE, **{feature: value, other: ON[other]})
    first, second = NAMED[feature].format(value), NAMED[other].format(ON[other])
    with pytest.raises(ValueError, match=rf"{first}.*{second}|{second}.*{first}"):
        matrix._trainer(matrix.config_for(cell), matrix.model_config(cell), 8)
    assert matrix.REFUSED[pair]


def test_bf16_with_pipeline_refused_on_cpu_naming_both():
    cell = dict(matrix.BASE, precision="bf16", pipeline="1f1b")
    with pytest.raises(ValueError, match=r"pipeline\.stages=2 with precision compute='bfloat16'.*CPU"):
        matrix._trainer(matrix.config_for(cell), matrix.model_config(cell), 8)


def test_stray_collectives_are_those_in_branches_that_leave_a_stage():
    hlo = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}
%fused (p: f32[2]) -> f32[2] {
  ROOT %ar4 = f32[2]{0} all-reduce(%p), channel_id=4, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
}
%branch_0 (x: f32[2]) -> f32[2] {
  %ar1 = (f32[2]{0}, /*index=1*/f32[2]{0}) all-reduce(%x, %x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %cp = f32[2]{0} collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
}
%branch_1 (x: f32[2]) -> f32[2] {
  ROOT %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
}
ENTRY %main (i: s32[], x: f32[2]) -> f32[2] {
  %outside = f32[2]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,2},{2,0}}
  ROOT %c = f32[2]{0} conditional(%i, %outside), branch_computations={%branch_0, %branch_1}
}
"""
    found = matrix.strays(hlo, {0: 0, 1: 0, 2: 1, 3: 1})   # devices 0, 1 on stage 0; 2, 3 on stage 1
    # the permute in a branch, and the all-reduce over {0, 2}, {1, 3} in what a branch calls; not the
    # all-reduce within a stage, nor the permute outside the conditional
    assert sorted(line.split(" = ")[0] for line in found) == ["ROOT %ar4", "ROOT %cp"], found
