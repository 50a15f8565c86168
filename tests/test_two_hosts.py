"""Two processes as two hosts (`jaxpar launch`, 2 x 4 simulated devices): a mesh built with
``ParallelConfig.hosts`` keeps the inner axes inside a process, and the collective report says
which collectives cross hosts, checked against the processes of each replica group."""

import json
import os

import pytest

from jaxpar.launch.ports import free_port
from workers.procs import WORKERS, Launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_inner_axes_stay_inside_a_host_and_the_report_says_so(tmp_path, tag):
    from test_launch_multiprocess import one_device_run

    args = ["--worker-num", 2, "--local-worker-num", 2, "--simulated-devices", 4, "--master-port", free_port(),
            "--cluster-time-out", 60]
    run = Launch(tmp_path, tag, args, (), script=os.path.join(WORKERS, "hosts_worker.py"), entry=("-m", "jaxpar.launch"))
    try:
        assert run.wait(timeout=100) == 0, run.stderr + run.log(0)
    finally:
        run.close()
    result = json.loads((run.out_dir / "results.json").read_text())
    assert result["processes"] == 2
    losses, _ = one_device_run()
    for name, inside in (("data_across", "model"), ("data_2x2", "model")):
        cell = result["cells"][name]
        assert cell["host_map"] == {"data": 2}, name
        assert cell["losses"] == pytest.approx(losses, rel=1e-5), name
        cols = cell["collectives"]
        assert all(c["hosts"] == c["truth"] for c in cols), cols      # the report agrees with the mesh
        over_inner = [c for c in cols if c["axes"] == [inside]]
        assert over_inner and all(c["hosts"] == 1 and c["inter"] == 0 for c in over_inner), cols
        assert any(c["hosts"] == 2 and c["inter"] > 0 for c in cols if "data" in c["axes"]), cols
        assert "inter-host" in cell["table"]
    across = result["model_across"]
    assert across["host_map"] == {"model": 2}
    assert [(c["kind"], c["axes"], c["hosts"], c["truth"]) for c in across["collectives"]] == [
        ("all-reduce", ["model"], 2, 2)]
    assert "asks for 4 hosts of 2 devices each, but the 8 devices are on 2 processes (hosts) of 4" in result["refusal"]
    machine = result["calibrated"]
    assert machine["hosts"] == {"data": 2} and machine["devices_per_host"] == 4
    assert machine["inter_host_bandwidth"] > 0 and set(machine["bandwidth"]) == {"data", "model"}
