"""Multi-process runs on localhost: `jaxpar launch`, the other ways to start, and the faults.

Each test starts real processes under a hard timeout, bounds how long the launcher takes, and
checks with `ps` that none of its processes is left.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch, start_worker, wait_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture
def launches():
    started = []
    yield started
    for launch in started:
        launch.close()


JAXPAR_LAUNCH = ("-m", "jaxpar.cli", "launch")  # the `jaxpar launch` command


def launch(launches, tmp_path, tag, workers, local, devices, *worker_args, **options):
    entry = options.pop("entry", ("-m", "jaxpar.launch"))
    script = os.path.join(WORKERS, options.pop("script", "psum_worker.py"))
    args = ["--worker-num", workers, "--local-worker-num", local, "--simulated-devices", devices,
            "--master-port", free_port(), "--cluster-time-out", options.pop("time_out", 60)]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [value])
    started = Launch(tmp_path, tag, args, worker_args, script=script, entry=entry)
    launches.append(started)
    return started


@pytest.mark.parametrize("processes, devices, entry", [
    (2, 4, JAXPAR_LAUNCH),
    (4, 2, ("-m", "jaxpar.launch")),
])
def test_launch_runs_cross_process_collectives(launches, tmp_path, tag, processes, devices, entry):
    run = launch(launches, tmp_path, tag, processes, processes, devices, "--steps", 2, join=True,
                 entry=entry)
    assert run.wait(timeout=90) == 0, run.stderr
    results = run.results()
    assert [r["rank"] for r in results] == list(range(processes))
    for r in results:
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (
            processes, 8, devices)
        assert r["psum"] == 8.0 and r["batch_equal"] and r["full_equal"]
        assert r["source"] == "env"
    assert "[rank 1] rank 1: step 1" in run.stdout  # --join streams prefixed output
    logs = sorted(p.name for p in run.log_dir.iterdir())
    assert logs == ["launcher_0.log"] + [f"worker_{i}.log" for i in range(processes)]


def test_crashing_worker_stops_the_job(launches, tmp_path, tag):
    run = launch(launches, tmp_path, tag, 2, 2, 4, "--steps", 1000, "--step-sleep", 0.05,
                 "--fail-rank", 1, "--fail-step", 3)
    assert run.wait(timeout=60) == 1
    assert "rank 1" in run.stderr and "exited with code 1" in run.stderr
    assert str(run.log_dir / "worker_1.log") in run.stderr
    assert "fails on purpose" in run.stderr  # the tail of its log
    assert not wait_gone(tag, timeout=5)


def test_killed_worker_mid_training(launches, tmp_path, tag):
    run = launch(launches, tmp_path, tag, 2, 2, 4, "--steps", 100000, "--step-sleep", 0.05)
    run.wait_for_log(1, "step 3", timeout=60)
    killed_at = time.monotonic()
    os.kill(run.worker_pid(1), signal.SIGKILL)
    assert run.wait(timeout=30) == 128 + signal.SIGKILL
    assert not wait_gone(tag, timeout=1)
    took = time.monotonic() - killed_at
    print(f"launcher and workers gone {took:.2f} s after the kill")
    assert took < 30
    assert "rank 1" in run.stderr and "killed by signal 9 (SIGKILL)" in run.stderr
    assert "worker_1.log" in run.stderr


def test_worker_that_never_joins_times_out(launches, tmp_path, tag):
    run = launch(launches, tmp_path, tag, 2, 2, 4, "--never-join-rank", 1, time_out=4)
    assert run.wait(timeout=60) == 124
    took = run.ended - run.started
    print(f"join timeout reported after {took:.2f} s (--cluster-time-out 4)")
    assert took < 4 + 20
    assert "did not form within 4 s" in run.stderr and "[1] never joined" in run.stderr


def test_missing_node_times_out(launches, tmp_path, tag):
    run = launch(launches, tmp_path, tag, 2, 1, 4, time_out=3)  # node 1 never starts
    assert run.wait(timeout=60) == 124
    assert "1 rank(s) run on other nodes" in run.stderr


def test_coordinator_port_in_use(tmp_path, tag):
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        run = Launch(tmp_path, tag, ["--worker-num", 2, "--local-worker-num", 2,
                                     "--master-port", port])
        try:
            assert run.wait(timeout=30) == 1
        finally:
            run.close()
    assert f"--master-port {port} is already in use" in run.stderr
    assert not list(run.log_dir.glob("worker_*.log"))  # no worker started


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_ends_every_worker(launches, tmp_path, tag, sig):
    run = launch(launches, tmp_path, tag, 2, 2, 4, "--steps", 100000, "--step-sleep", 0.05,
                 kill_time_out=2)
    for rank in (0, 1):
        run.wait_for_log(rank, "step 2", timeout=60)
    sent = time.monotonic()
    run.process.send_signal(sig)
    assert run.wait(timeout=30) == 128 + sig
    assert not wait_gone(tag, timeout=1), "orphans after the launcher exited"
    took = time.monotonic() - sent
    print(f"{signal.Signals(sig).name}: all gone after {took:.2f} s (--kill-time-out 2)")
    assert took < 2 + 10


def test_launcher_killed_takes_workers_along(launches, tmp_path, tag):
    run = launch(launches, tmp_path, tag, 2, 2, 4, "--steps", 100000, "--step-sleep", 0.05)
    for rank in (0, 1):
        run.wait_for_log(rank, "step 1", timeout=60)
    run.process.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG does it
    run.wait(timeout=10)
    assert not wait_gone(tag, timeout=10)


def run_workers(tmp_path, tag, envs, timeout=90):
    """Starts one worker per environment, without the launcher; all must succeed."""
    procs = [start_worker(tmp_path, tag, e, f"w{i}") for i, e in enumerate(envs)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join((tmp_path / f"w{i}.log").read_text() for i in range(len(envs)))
    assert codes == [0] * len(envs), logs
    return [json.loads((tmp_path / f"rank_{i}.json").read_text()) for i in range(len(envs))]


def test_dynamic_cluster_from_environment(tmp_path, tag):
    port = free_port()
    envs = [{"JAXPAR_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAXPAR_NUM_PROCESSES": "2",
             "JAXPAR_PROCESS_ID": str(i), "JAXPAR_SIMULATED_DEVICES": "4"} for i in range(2)]
    results = run_workers(tmp_path, tag, envs)
    assert all(r["source"] == "env" and r["psum"] == 8.0 for r in results)


def test_openmpi_variables_without_mpirun(tmp_path, tag):
    port = free_port()
    envs = [{"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
             "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i),
             "JAXPAR_COORDINATOR_PORT": str(port), "JAXPAR_SIMULATED_DEVICES": "4"}
            for i in range(2)]
    results = run_workers(tmp_path, tag, envs)
    assert all(r["source"] == "openmpi" and r["batch_equal"] for r in results)


def test_slurm_variables_without_srun(tmp_path, tag):
    port = free_port()
    envs = [{"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
             "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
             "JAXPAR_COORDINATOR_PORT": str(port), "JAXPAR_SIMULATED_DEVICES": "4"}
            for i in range(2)]
    results = run_workers(tmp_path, tag, envs)
    assert all(r["source"] == "slurm" and r["psum"] == 8.0 for r in results)


def test_rank_table_on_localhost(tmp_path, tag):
    table = {"version": "1.0", "server_count": "1", "coordinator_port": free_port(),
             "server_list": [{"server_id": "127.0.0.1", "device": [
                 {"device_id": "0", "rank_id": "0"}, {"device_id": "1", "rank_id": "1"}]}]}
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(table))
    envs = [{"JAXPAR_RANK_TABLE_FILE": str(path), "RANK_ID": str(i),
             "JAXPAR_SIMULATED_DEVICES": "4"} for i in range(2)]
    results = run_workers(tmp_path, tag, envs)
    assert all(r["source"] == "rank_table" and r["psum"] == 8.0 for r in results)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_real_mpirun(tmp_path, tag):
    from workers.procs import PSUM_WORKER, env

    command = ["mpirun", "--oversubscribe", "-n", "2",
               "-x", "JAXPAR_SIMULATED_DEVICES=4", "-x", f"JAXPAR_COORDINATOR_PORT={free_port()}",
               "-x", "PYTHONPATH", "-x", "JAX_PLATFORMS",
               sys.executable, "-u", PSUM_WORKER, "--out", str(tmp_path), "--tag", tag]
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=90,
                            env={**env(), **root}, start_new_session=True)
    assert result.returncode == 0, result.stdout + result.stderr
    results = [json.loads((tmp_path / f"rank_{i}.json").read_text()) for i in range(2)]
    assert all(r["source"] == "openmpi" and r["psum"] == 8.0 and r["batch_equal"]
               for r in results)


def one_device_run():
    """The per-host worker's training on one device, fed the whole global batches."""
    import jax
    import optax

    import jaxpar
    from workers.per_host_worker import STEPS, global_batches, loss_fn, model_fn

    config = jaxpar.ParallelConfig(mesh={"data": 1})
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.sgd(0.1), loss_fn, config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in global_batches(STEPS)]
    return losses, trainer.evaluate(global_batches(2, start=100))


def test_each_process_feeds_its_own_rows(launches, tmp_path, tag):
    """4 processes x 2 devices, each feeding its 4 rows of a global batch of 16: mode data on
    {"data": 8} (fit; place, step, lower), ZeRO-3, ZeRO-3 x grad_accum=2, and {"model": 2,
    "data": 4} with a process's devices along model or along data, each with evaluate: the
    losses of one device on the same global batches. 3 rows a process are refused by name, and so
    are 8 (or 6) rows on process 0 beside 4 on the others, and own rows given to a Trainer that
    takes the whole global batch on every process."""
    from workers.per_host_worker import CELLS

    run = launch(launches, tmp_path, tag, 4, 4, 2, script="per_host_worker.py")
    assert run.wait(timeout=200) == 0, run.stderr + run.log(0)
    result = json.loads((run.out_dir / "results.json").read_text())
    assert (result["processes"], result["local_devices"]) == (4, 2)
    losses, evaluated = one_device_run()
    assert sorted(result["cells"]) == sorted(CELLS)
    for name, cell in result["cells"].items():
        assert cell["losses"] == pytest.approx(losses, rel=1e-5), name
        assert cell["eval"] == pytest.approx(evaluated, rel=1e-5), name
    assert result["cells"]["data"]["spec"] == "P('data',)"
    step, evaluate = result["refusals"]["step"], result["refusals"]["evaluate"]
    assert step.startswith("batch['x']: this process's 3 rows do not split: the global batch is 3 rows x 4 "
                           "processes = 12 rows, and this process's 2 devices on the batch axes ('data',) (ids 0, 1) "
                           "hold 2 of their 8 shards; grad_accum=2 cuts"), step
    assert "must feed a multiple of 4 rows; feed 4 rows per process (a global batch of 16)" in step, step
    assert "must feed a multiple of 2 rows; feed 2 or 4 rows per process" in evaluate, evaluate
    # a process feeding other rows than the others: refused on every process, naming each one's rows
    for what, rows in (("uneven_step", 8), ("uneven_evaluate", 6)):
        said = result["refusals"][what]
        assert said and said.startswith("Trainer: batch['x']: the processes feed different numbers of their own "
                                        f"rows (process 0: {rows}, process 1: 4, process 2: 4, process 3: 4)"), said
    said = result["refusals"]["no_rows_on_one"]       # refused on process 1 alone, the others waiting
    assert said and said.startswith("Trainer: batch['x']: the processes feed different numbers of their own "
                                    "rows (process 0: 4, process 1: 0, process 2: 4, process 3: 4)"), said
    # Placement(global_batch=True) given each process's own rows (a global batch of mixed rows)
    said = result["refusals"]["global_batch_own_rows"]
    assert said and said.startswith("Trainer: Placement(global_batch=True) takes the whole global batch on every "
                                    "process, but process(es) [1, 2, 3] passed other values than process 0"), said
