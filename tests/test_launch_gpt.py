"""The example GPT trained by `jaxpar launch` on several processes equals the one-process run.

2 processes x 4 simulated devices and 4 processes x 2, data=2 x model=4 (Megatron rules), 5
adamw steps: losses within 1e-5 of the same training in one process on 8 devices.
"""

import json

import pytest

import jaxpar
from helpers import MEGATRON, STEPS, train_gpt
from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240)]

GPT_WORKER = f"{WORKERS}/gpt_worker.py"


@pytest.fixture(scope="module")
def one_process_losses():
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON)
    losses, _, _ = train_gpt(config)
    return losses


def run_gpt(tmp_path, tag, processes, devices, feeds):
    args = ["--worker-num", processes, "--local-worker-num", processes, "--simulated-devices",
            devices, "--master-port", free_port(), "--cluster-time-out", 120]
    run = Launch(tmp_path, tag, args, ["--steps", STEPS, "--feed", ",".join(feeds)],
                 script=GPT_WORKER)
    try:
        code = run.wait(timeout=200)
    finally:
        run.close()
    assert code == 0, run.stderr
    result = json.loads((run.out_dir / "losses.json").read_text())
    assert result["processes"] == processes
    return result["losses"]


def assert_losses_equal(losses, reference, what):
    assert len(losses) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{what}, step {step}: {a} vs {b}"


def test_two_processes_by_four_devices(tmp_path, tag, one_process_losses):
    losses = run_gpt(tmp_path, tag, 2, 4, ["local", "full"])
    assert_losses_equal(losses["local"], one_process_losses, "2x4, per-process rows")
    assert_losses_equal(losses["full"], one_process_losses, "2x4, full batch everywhere")


def test_four_processes_by_two_devices(tmp_path, tag, one_process_losses):
    # data=2 over 4 processes: processes 0 and 1 share one data shard, so each process's
    # rows must travel to the other process of its shard.
    losses = run_gpt(tmp_path, tag, 4, 2, ["local"])
    assert_losses_equal(losses["local"], one_process_losses, "4x2, per-process rows")
