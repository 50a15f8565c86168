"""`jaxpar k8s`: the manifest's objects, and the environment each pod gets."""

import io
import sys

import pytest
import yaml

from jaxpar.launch import K8sJob, detect_cluster, k8s_manifest
from jaxpar.cli import main


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_indexed_job_and_headless_service():
    job = K8sJob(workers=4, image="me/train:1", command=("python", "train.py", "--steps", "5"),
                 name="gpt", gpus_per_worker=8)
    service, batch_job = yaml.safe_load_all(k8s_manifest(job))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    spec = batch_job["spec"]
    assert batch_job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4 and spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "gpt"
    assert spec["template"]["metadata"]["labels"] == service["spec"]["selector"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "train.py", "--steps", "5"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(container)
    assert env["JAXPAR_COORDINATOR_ADDRESS"] == "gpt-0.gpt:8476"
    assert env["JAXPAR_NUM_PROCESSES"] == "4"
    assert "job-completion-index" in env["JAXPAR_PROCESS_ID"]["fieldRef"]["fieldPath"]


def test_jobset():
    job = K8sJob(workers=2, image="img", command=("python", "t.py"), name="js", kind="jobset")
    (obj,) = yaml.safe_load_all(k8s_manifest(job))
    assert obj["kind"] == "JobSet" and obj["spec"]["network"]["enableDNSHostnames"] is True
    rjob = obj["spec"]["replicatedJobs"][0]
    assert rjob["replicas"] == 1 and rjob["template"]["spec"]["completions"] == 2
    env = env_of(rjob["template"]["spec"]["template"]["spec"]["containers"][0])
    assert env["JAXPAR_COORDINATOR_ADDRESS"] == "js-workers-0-0.js:8476"


def test_pod_environment_is_detected():
    """What a pod of the manifest would see gives the right ClusterSpec."""
    job = K8sJob(workers=4, image="img", command=("python", "t.py"), name="gpt")
    env = env_of(list(yaml.safe_load_all(k8s_manifest(job)))[1]["spec"]["template"]["spec"]
                 ["containers"][0])
    pod_env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "2",
               "JAXPAR_PROCESS_ID": "2", **{k: v for k, v in env.items() if isinstance(v, str)}}
    spec = detect_cluster(pod_env, hostname="gpt-2")
    assert (spec.num_processes, spec.process_id) == (4, 2)
    assert spec.coordinator_address == "gpt-0.gpt:8476"


@pytest.mark.parametrize("kw, words", [
    ({"workers": 0}, "workers=0"),
    ({"name": "Bad_Name"}, "DNS label"),
    ({"command": ()}, "--"),
    ({"kind": "pod"}, "jobset"),
])
def test_bad_jobs(kw, words):
    args = {"workers": 2, "image": "img", "command": ("python", "t.py"), **kw}
    with pytest.raises(ValueError) as err:
        K8sJob(**args)
    assert words in str(err.value)


def test_cli_prints_manifest(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["k8s", "--workers", "2", "--image", "img", "--simulated-devices", "4",
                 "--env", "A=1", "--", "python", "train.py", "--steps", "5"])
    assert code == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    container = docs[1]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "train.py", "--steps", "5"]
    env = env_of(container)
    assert env["JAXPAR_SIMULATED_DEVICES"] == "4" and env["A"] == "1"


@pytest.mark.parametrize("argv, words", [
    (["--env", "JAXPAR_PROCESS_ID=7"], "--env JAXPAR_PROCESS_ID=7: jaxpar k8s sets "
                                       "JAXPAR_PROCESS_ID itself"),
    (["--simulated-devices", "2", "--env", "JAX_PLATFORMS=gpu"], "sets JAX_PLATFORMS itself"),
    (["--env", "A=1", "--env", "A=2"], "--env A is given twice"),
    (["--env", "A"], "--env 'A' must look like NAME=VALUE"),
    (["--cluster-time-out", "0"], "cluster_time_out=0.0 must be a positive, finite number "
                                  "(--cluster-time-out)"),
    # nan went into the manifest as JAXPAR_CLUSTER_TIMEOUT=nan: each pod gave up at once ("within nan s")
    (["--cluster-time-out", "nan"], "cluster_time_out=nan must be a positive, finite number"),
    (["--cluster-time-out", "inf"], "cluster_time_out=inf must be a positive, finite number"),
    (["--simulated-devices", "0"], "simulated_devices=0 must be a positive int "
                                   "(--simulated-devices)"),
    (["--gpus-per-worker", "-1"], "(--gpus-per-worker)"),
])
def test_cli_mistakes_exit_2_with_one_paragraph(monkeypatch, capsys, argv, words):
    code = main(["k8s", "--workers", "2", "--image", "img", *argv, "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert err.startswith("jaxpar k8s: error: ") and len(err.strip().splitlines()) == 1


def test_env_name_appears_once():
    job = K8sJob(workers=2, image="img", command=("python", "t.py"), env={"A": "1"},
                 cluster_time_out=5)
    container = list(yaml.safe_load_all(k8s_manifest(job)))[1]["spec"]["template"]["spec"][
        "containers"][0]
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)) and "A" in names
