"""Cluster detection from each source's environment variables and files, and the SLURM batch
script of examples/slurm run on two simulated nodes (the only test here that starts processes)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar.launch import ClusterSpec, detect_cluster, load_rank_table
from jaxpar.launch.sources import first_host

HOST = "node-a"  # stands in for this machine's host name


def detect(env, **kw):
    return detect_cluster(env, hostname=kw.pop("hostname", HOST), **kw)


def test_no_source_is_one_process():
    spec = detect({})
    assert (spec.num_processes, spec.process_id, spec.source) == (1, 0, "single")
    assert not spec.is_multi_process


def test_jaxpar_env_dynamic_cluster():
    spec = detect({
        "JAXPAR_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAXPAR_NUM_PROCESSES": "4",
        "JAXPAR_PROCESS_ID": "2",
        "JAXPAR_LOCAL_DEVICE_IDS": "2,3",
    })
    assert spec.coordinator_address == "10.0.0.1:1234"
    assert (spec.num_processes, spec.process_id, spec.source) == (4, 2, "env")
    assert spec.local_device_ids == (2, 3)
    assert "JAXPAR_PROCESS_ID=2" in spec.describe()


OMPI = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_orte_hnp_uri": "2034630656.0;tcp://192.0.2.2,10.1.1.1:60491;tcp6://[fd00::2]:33949",
}


def test_openmpi():
    spec = detect(OMPI)
    assert (spec.num_processes, spec.process_id, spec.local_process_id) == (4, 3, 1)
    assert spec.source == "openmpi"
    # mpirun's host; the port from the job id, as JAX does it
    port = (2034630656 // 4096) % 4096 + 61440
    assert spec.coordinator_address == f"192.0.2.2:{port}"


def test_openmpi_single_node_uses_localhost_and_port_variable():
    env = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "JAXPAR_COORDINATOR_PORT": "5555"}
    assert detect(env).coordinator_address == "127.0.0.1:5555"


def test_openmpi_coordinator_from_jaxpar_env_wins_without_conflict():
    env = {**OMPI, "JAXPAR_COORDINATOR_ADDRESS": "head:7000"}
    spec = detect(env)
    assert spec.coordinator_address == "head:7000"
    assert spec.process_id == 3


SLURM = {
    "SLURM_JOB_ID": "12345",
    "SLURM_STEP_NODELIST": "gpu[007-009,011],cpu1",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}


def test_slurm():
    spec = detect(SLURM)
    assert (spec.num_processes, spec.process_id, spec.local_process_id) == (8, 5, 1)
    assert spec.coordinator_address == f"gpu007:{12345 % 4096 + 61440}"
    assert spec.source == "slurm"


def test_slurm_batch_script_without_srun_is_not_a_cluster():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert detect(env).num_processes == 1


@pytest.mark.parametrize("nodelist, host", [
    ("node001", "node001"),
    ("node001,host2", "node001"),
    ("node[001-015],host2", "node001"),
    ("node[001,007-015]", "node001"),
    ("rack[2-3]-n[07,09]", "rack2-n07"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist, words", [
    ("gpu[003", "leaves a bracket open"),           # each gave the host 'gpu' without a word
    ("gpu[]", "has a range [] that does not start with a number"),
    ("gpu]01", "closes a bracket it never opened"),
    ("gpu[[1-2]]", "opens a bracket inside a bracket"),
])
def test_malformed_slurm_nodelist_is_named(nodelist, words):
    with pytest.raises(ValueError) as err:
        first_host(nodelist)
    assert f"SLURM_STEP_NODELIST={nodelist!r} {words}" in str(err.value)
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": nodelist, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    with pytest.raises(ValueError, match="JAXPAR_COORDINATOR_ADDRESS=host:port"):
        detect(env)
    # ... which the fix it names gets past
    assert detect({**env, "JAXPAR_COORDINATOR_ADDRESS": "gpu003:9000"}).coordinator_address == "gpu003:9000"


K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "3",
       "JAXPAR_NUM_PROCESSES": "4"}


def test_kubernetes_indexed_job():
    spec = detect(K8S, hostname="train-3")
    assert (spec.num_processes, spec.process_id, spec.source) == (4, 3, "kubernetes")
    assert spec.coordinator_address == "train-0:8476"


def test_kubernetes_with_manifest_env_agrees():
    env = {**K8S, "JAXPAR_PROCESS_ID": "3", "JAXPAR_COORDINATOR_ADDRESS": "train-0.train:8476"}
    spec = detect(env, hostname="train-3")
    assert spec.process_id == 3 and spec.coordinator_address == "train-0.train:8476"


def write_table(tmp_path, table):
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(table))
    return str(path)


TABLE = {
    "version": "1.0",
    "server_count": "2",
    "coordinator_port": 9000,
    "server_list": [
        {"server_id": "10.0.0.1", "device": [{"device_id": "0", "rank_id": "0"},
                                             {"device_id": "1", "rank_id": "1"}]},
        {"server_id": "10.0.0.2", "device": [{"device_id": "0", "rank_id": "2"},
                                             {"device_id": "1", "rank_id": "3"}]},
    ],
    "status": "completed",
}


def test_rank_table_with_mindspore_rank_id(tmp_path):
    path = write_table(tmp_path, TABLE)
    spec = detect({"JAXPAR_RANK_TABLE_FILE": path, "RANK_ID": "3"})
    assert spec.coordinator_address == "10.0.0.1:9000"
    assert (spec.num_processes, spec.process_id, spec.local_process_id) == (4, 3, 1)
    assert spec.local_device_ids == (1,)
    assert spec.source == "rank_table"


def test_rank_table_one_process_per_host_found_by_host_name(tmp_path):
    table = {"server_list": [
        {"server_id": "node-a", "device": [{"device_id": str(d), "rank_id": "0"} for d in range(4)]},
        {"server_id": "node-b", "device": [{"device_id": str(d), "rank_id": "1"} for d in range(4)]},
    ]}
    spec = detect({}, rank_table=write_table(tmp_path, table), hostname="node-b")
    assert (spec.num_processes, spec.process_id) == (2, 1)
    assert spec.local_device_ids == (0, 1, 2, 3)
    assert spec.coordinator_address == "node-a:8476"


def one_server(device_id, rank_id):
    return {"server_count": None, "server_list": [
        {"server_id": "h", "device": [{"device_id": device_id, "rank_id": rank_id}]}]}


@pytest.mark.parametrize("change, words", [
    ({"server_list": []}, "server_list"),
    ({"server_count": "3"}, "server_count"),
    (one_server("0", "1"), "missing [0]"),
    (one_server("x", "0"), "device_id"),
])
def test_rank_table_errors_name_the_entry(tmp_path, change, words):
    path = write_table(tmp_path, {**TABLE, **change})
    with pytest.raises(ValueError, match="rank table") as err:
        load_rank_table(path)
    assert words in str(err.value)


def two_entries(first, second, host2="h"):
    return {"server_count": None, "server_list": [
        {"server_id": "h", "device": [{"device_id": first[0], "rank_id": first[1]}]},
        {"server_id": host2, "device": [{"device_id": second[0], "rank_id": second[1]}]}]}


@pytest.mark.parametrize("change, words", [
    # each was accepted: two processes (or one, twice) given the same device of a host, a port JAX cannot use
    (two_entries(("0", "0"), ("0", "1")), "server_list[1].device[0].device_id=0 is not valid; device 0 of server "
                                          "'h' is already listed (for rank 0)"),
    (two_entries(("1", "0"), ("1", "0")), "device 1 of server 'h' is already listed"),
    ({"coordinator_port": 70000}, "coordinator_port=70000 is not valid; give a TCP port in 1..65535"),
])
def test_rank_table_refuses_a_device_twice_and_a_bad_port(tmp_path, change, words):
    path = write_table(tmp_path, {**TABLE, **change})
    with pytest.raises(ValueError, match="rank table") as err:
        load_rank_table(path)
    assert words in str(err.value)
    load_rank_table(write_table(tmp_path, {**TABLE, **two_entries(("0", "0"), ("0", "1"), host2="g")}))


def test_rank_table_path_and_rank_mistakes_are_named(tmp_path):
    """A folder given as the table was an IsADirectoryError, not a ValueError naming the variable;
    JAXPAR_PROCESS_ID and RANK_ID naming different ranks silently took the first."""
    with pytest.raises(ValueError, match=r"rank table '.*' cannot be read \(Is a directory\); set JAXPAR_RANK_TABLE_FILE"):
        detect({"JAXPAR_RANK_TABLE_FILE": str(tmp_path)})
    path = write_table(tmp_path, TABLE)
    with pytest.raises(ValueError, match="JAXPAR_PROCESS_ID=2 but RANK_ID=1, for rank table"):
        detect({"JAXPAR_RANK_TABLE_FILE": path, "RANK_ID": "1", "JAXPAR_PROCESS_ID": "2"})
    assert detect({"JAXPAR_RANK_TABLE_FILE": path, "RANK_ID": "2", "JAXPAR_PROCESS_ID": "2"}).process_id == 2
    with pytest.raises(ValueError, match="JAXPAR_COORDINATOR_PORT='70000' is not a TCP port"):
        detect({"JAXPAR_RANK_TABLE_FILE": path, "RANK_ID": "2", "JAXPAR_COORDINATOR_PORT": "70000"})


def test_conflicting_sources_name_both():
    env = {**OMPI, "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "1"}
    with pytest.raises(ValueError) as err:
        detect(env)
    text = str(err.value)
    assert "num_processes" in text and "JAXPAR_NUM_PROCESSES=2" in text
    assert "OMPI_COMM_WORLD_SIZE=4" in text and "JAXPAR_CLUSTER_SOURCE" in text


def test_rank_table_and_env_conflict(tmp_path):
    env = {"JAXPAR_RANK_TABLE_FILE": write_table(tmp_path, TABLE), "RANK_ID": "1",
           "JAXPAR_NUM_PROCESSES": "8"}
    with pytest.raises(ValueError, match="rank_table says 4"):
        detect(env)


def test_explicit_settings_always_win():
    env = {**OMPI, "JAXPAR_NUM_PROCESSES": "2"}  # would conflict
    spec = detect(env, num_processes=4, process_id=0, coordinator_address="h:1")
    assert (spec.num_processes, spec.process_id, spec.coordinator_address) == (4, 0, "h:1")
    assert spec.source == "explicit"


def test_innermost_scheduler_wins_mpirun_inside_slurm():
    spec = detect({**SLURM, **OMPI})
    assert spec.source == "openmpi" and spec.process_id == 3


def test_cluster_source_picks_one():
    assert detect({**SLURM, **OMPI}, source="slurm").process_id == 5
    assert detect({**SLURM, "JAXPAR_CLUSTER_SOURCE": "none"}).num_processes == 1
    with pytest.raises(ValueError, match="JAXPAR_CLUSTER_SOURCE='mpi'.*openmpi"):
        detect({"JAXPAR_CLUSTER_SOURCE": "mpi"})


def test_launcher_env_ignores_outer_srun():
    env = {**SLURM, "JAXPAR_CLUSTER_SOURCE": "env", "JAXPAR_COORDINATOR_ADDRESS": "h:1",
           "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "1"}
    spec = detect(env)
    assert (spec.num_processes, spec.process_id, spec.source) == (2, 1, "env")


@pytest.mark.parametrize("env, words", [
    ({"JAXPAR_NUM_PROCESSES": "two"}, "JAXPAR_NUM_PROCESSES='two'"),
    ({"JAXPAR_NUM_PROCESSES": "2", "JAXPAR_COORDINATOR_ADDRESS": "h:1"}, "JAXPAR_PROCESS_ID"),
    ({"JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0"}, "JAXPAR_COORDINATOR_ADDRESS"),
    ({"JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "2",
      "JAXPAR_COORDINATOR_ADDRESS": "h:1"}, "process_id=2 must be in 0..1"),
    ({"JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0",
      "JAXPAR_COORDINATOR_ADDRESS": "nohost"}, "host:port"),
    ({"JAXPAR_PROCESS_ID": "3"}, "JAXPAR_NUM_PROCESSES"),
    # advised "a number such as 0", which was then refused
    ({"JAXPAR_NUM_PROCESSES": "-1"}, "JAXPAR_NUM_PROCESSES='-1' is not a whole number >= 1"),
    # was an error on coordinator_address telling to set JAXPAR_COORDINATOR_ADDRESS
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
      "JAXPAR_COORDINATOR_PORT": "70000"}, "JAXPAR_COORDINATOR_PORT='70000' is not a TCP port"),
    # two devices named the same were accepted: local_device_ids (0, 0)
    ({"JAXPAR_LOCAL_DEVICE_IDS": "0,1,0"}, "JAXPAR_LOCAL_DEVICE_IDS='0,1,0' lists device 0 more than once"),
])
def test_bad_settings_say_what_to_fix(env, words):
    with pytest.raises(ValueError) as err:
        detect(env)
    assert words in str(err.value)


def test_spec_is_frozen_and_validates():
    spec = ClusterSpec(coordinator_address="[::1]:80", num_processes=2, process_id=1)
    with pytest.raises(AttributeError):
        spec.process_id = 0
    with pytest.raises(ValueError, match="num_processes=0"):
        ClusterSpec(num_processes=0)


# --- examples/slurm: the sbatch script, run by a stand-in for srun on this machine ---

REPO = pathlib.Path(__file__).resolve().parent.parent
SLURM_EXAMPLE = REPO / "examples" / "slurm"

# What srun does in an allocation, for what the test needs: one task per node, each with the
# step's variables (SLURM_NODEID, SLURM_PROCID, SLURM_STEP_*), and --kill-on-bad-exit.
FAKE_SRUN = """#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
assert "--ntasks-per-node=1" in args and "--kill-on-bad-exit=1" in args, args
command = args[next(i for i, a in enumerate(args) if not a.startswith("-")):]
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
step = {{"SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"],
         "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(nodes),
         "SLURM_NTASKS": str(nodes), "SLURM_NNODES": str(nodes)}}
tasks = [subprocess.Popen(command, env={{**os.environ, **step, "SLURM_NODEID": str(i),
                                        "SLURM_PROCID": str(i), "SLURM_LOCALID": "0"}})
         for i in range(nodes)]
while any(t.poll() is None for t in tasks):
    if any(t.poll() not in (None, 0) for t in tasks):
        for t in tasks:
            if t.poll() is None:
                t.kill()
    time.sleep(0.1)
sys.exit(next((t.returncode for t in tasks if t.returncode), 0))
"""


def _slurm_env(tmp_path, **more):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    path = f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "SLURM_"))}
    return {**base, "PATH": path, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **more}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sbatch_script_trains_on_two_simulated_nodes(tmp_path, tag):
    """examples/slurm/train.sbatch as sbatch runs it on 2 nodes: srun starts launch_node.sh once
    per node, each runs `jaxpar launch` for its node, and the 2 workers (4 CPU devices each)
    form one job whose cross-process sums and global batches agree on both ranks."""
    from jaxpar.launch.ports import free_port

    out = tmp_path / "out"
    out.mkdir()
    env = _slurm_env(tmp_path, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                     SLURM_JOB_NODELIST="localhost,localhost", MASTER_PORT=str(free_port()),
                     LOG_DIR=str(tmp_path / "logs"),
                     LAUNCH_OPTIONS="--simulated-devices 4 --cluster-time-out 60")
    command = ["bash", str(SLURM_EXAMPLE / "train.sbatch"), "tests/workers/psum_worker.py",
               "--out", str(out), "--steps", "2", "--step-psum", "--tag", tag]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert run.returncode == 0, run.stderr + logs
    results = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["source"] == "env"
        assert (result["process_count"], result["device_count"], result["local_device_count"]) == (2, 8, 4)
        assert result["psum"] == 8.0 and result["batch_equal"] and result["full_equal"]
    launchers = sorted(p.name for p in (tmp_path / "logs").glob("launcher_*.log"))
    assert launchers == ["launcher_0.log", "launcher_1.log"]
    assert "--master-addr" not in run.stderr  # no usage error from either launcher


@pytest.mark.parametrize("env, words", [
    ({}, "launch_node.sh: SLURM_JOB_ID is not set: run this under srun, one task per node"),
    ({"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
      "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "16"},
     "SLURM_STEP_NUM_TASKS=16 tasks on SLURM_STEP_NUM_NODES=2 nodes: run one task per node"),
    ({"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2",
      "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2"},
     "launch_node.sh: SLURM_STEP_NODELIST='n[1-2' leaves a bracket open"),
])
def test_launch_node_script_names_what_is_wrong(tmp_path, env, words):
    run = subprocess.run(["bash", str(SLURM_EXAMPLE / "launch_node.sh"), "train.py"], cwd=REPO,
                         env=_slurm_env(tmp_path, **env), capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and words in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
