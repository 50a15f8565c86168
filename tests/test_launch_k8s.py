"""`jaxpar k8s`: the manifest's objects, and the environment each pod gets."""

import copy
import io
import json
import pathlib
import re
import sys

import jsonschema
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
    # the API server refuses a Service (and JobSet its subdomain) whose name starts with a digit
    ({"name": "1gpt"}, "name='1gpt' must be a lowercase DNS label of at most 40 characters that "
                       "starts with a letter"),
    ({"name": "a" * 41}, "at most 40 characters"),
    ({"namespace": "ML_team"}, "namespace='ML_team' must be a lowercase DNS label"),
    ({"namespace": "n" * 64}, "(--namespace)"),
    # "20GB" is no Kubernetes quantity: the API server refused the whole StatefulSet
    ({"servers": 1, "server_storage": "20GB"}, "server_storage='20GB' must be a positive "
                                               "Kubernetes quantity such as '20Gi'"),
    ({"servers": 1, "server_storage": "0Gi"}, "(--server-storage)"),
    ({"servers": 1, "server_storage": "-5Gi"}, "(--server-storage)"),
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
    (["--name", "1gpt"], "name='1gpt' must be a lowercase DNS label"),
    (["--namespace", "ML"], "(--namespace)"),
    (["--servers", "1", "--server-storage", "20GB"], "server_storage='20GB' must be a positive "
                                                     "Kubernetes quantity"),
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


# --- the manifests against the upstream schemas (tests/schemas/README.md says where from) ---

SCHEMAS = pathlib.Path(__file__).parent / "schemas"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
KINDS = {  # (apiVersion, kind) -> definition in the Kubernetes schema
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("apps/v1", "StatefulSet"): "io.k8s.api.apps.v1.StatefulSet",
}


def strict(schema):
    """The CRD schema refusing unknown fields, as the API server does with strict field
    validation (``kubectl apply --validate=strict``, the default since Kubernetes 1.27)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (schema.get("type") == "object" and isinstance(schema.get("properties"), dict)
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _validators():
    definitions = json.loads((SCHEMAS / "kubernetes-v1.30.0-strict.json").read_text())["definitions"]
    found = {key: jsonschema.Draft4Validator({"$ref": f"#/definitions/{name}",
                                              "definitions": definitions})
             for key, name in KINDS.items()}
    jobset = strict(json.loads((SCHEMAS / "jobset-v1alpha2.json").read_text()))
    # The CRD leaves the top-level metadata to the API server: check it as ObjectMeta.
    jobset["properties"]["metadata"] = {"$ref": f"#/definitions/{_OBJECT_META}"}
    jobset["definitions"] = definitions
    found[("jobset.x-k8s.io/v1alpha2", "JobSet")] = jsonschema.Draft4Validator(jobset)
    for validator in found.values():
        validator.check_schema(validator.schema)
    return found


VALIDATORS = _validators()


def schema_errors(obj) -> list[str]:
    """Every way ``obj`` breaks its kind's upstream schema (empty: it validates)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in VALIDATORS:
        return [f"no schema for apiVersion={key[0]!r} kind={key[1]!r}"]
    validator = VALIDATORS[key]
    return [f"{obj['kind']} {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in validator.iter_errors(obj)]


def _job(**kw):
    return K8sJob(**{"workers": 2, "image": "me/train:1", "command": ("python", "t.py"), **kw})


VARIANTS = {
    "workers only": {},
    "one worker": {"workers": 1},
    "gpus": {"workers": 4, "gpus_per_worker": 8},
    "simulated devices": {"simulated_devices": 4},
    "every worker option": {"name": "gpt-train", "namespace": "ml", "port": 9000,
                            "gpus_per_worker": 1, "cluster_time_out": 30.5,
                            "env": {"A": "1", "EMPTY": ""}},
    "servers, emptyDir": {"servers": 2},
    "servers, volume claims": {"servers": 3, "server_storage": "20Gi", "server_port": 9100,
                               "ps_token_secret": "my-token", "namespace": "ml",
                               "gpus_per_worker": 8},
}


@pytest.mark.parametrize("kind", ["job", "jobset"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_validates_against_the_upstream_schemas(kind, variant):
    objects = list(yaml.safe_load_all(k8s_manifest(_job(kind=kind, **VARIANTS[variant]))))
    kinds = sorted(o["kind"] for o in objects)
    servers = ["Service", "StatefulSet"] if VARIANTS[variant].get("servers") else []
    assert kinds == sorted(servers + (["Job", "Service"] if kind == "job" else ["JobSet"]))
    errors = [e for obj in objects for e in schema_errors(obj)]
    assert not errors, "\n".join(errors)


def test_cli_manifest_with_every_flag_validates():
    out = io.StringIO()
    argv = ["k8s", "--workers", "3", "--image", "img", "--name", "ctr", "--port", "7000",
            "--namespace", "team", "--gpus-per-worker", "2", "--simulated-devices", "2",
            "--cluster-time-out", "60", "--env", "A=1", "--servers", "2", "--server-port", "7001",
            "--server-storage", "5Gi", "--ps-token-secret", "ctr-secret"]
    for jobset in ([], ["--jobset"]):
        out.seek(0), out.truncate()
        sys_stdout, sys.stdout = sys.stdout, out
        try:
            assert main([*argv, *jobset, "--", "python", "train.py"]) == 0
        finally:
            sys.stdout = sys_stdout
        errors = [e for obj in yaml.safe_load_all(out.getvalue()) for e in schema_errors(obj)]
        assert not errors, "\n".join(errors)


def _broken(objects, kind, path, value):
    """A copy of the object of ``kind`` with ``value`` put at ``path`` (a key list)."""
    (obj,) = [copy.deepcopy(o) for o in objects if o["kind"] == kind]
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return obj


POD = ["spec", "template", "spec"]
JOBSET_POD = ["spec", "replicatedJobs", 0, "template", "spec", "template", "spec"]


@pytest.mark.parametrize("kind, path, value, words", [
    ("Job", ["spec", "completionMode"], 3, "is not of type 'string'"),
    ("Job", ["spec", "backofLimit"], 0, "'backofLimit' was unexpected"),
    ("Job", [*POD, "containers", 0, "env", 2, "valueFrom", "fieldRef"], {}, "'fieldPath' is a required"),
    ("Job", [*POD, "containers", 0, "ports", 0, "containerPort"], "8476", "is not of type 'integer'"),
    ("Service", ["spec", "clusterIp"], "None", "'clusterIp' was unexpected"),
    ("JobSet", ["spec", "replicatedJobs", 0, "replica"], 1, "'replica' was unexpected"),
    ("JobSet", ["spec", "failurePolicy", "maxRestarts"], "0", "is not of type 'integer'"),
    ("JobSet", ["spec", "network", "enableDnsHostnames"], True, "'enableDnsHostnames' was unexpected"),
    ("JobSet", [*JOBSET_POD, "containers", 0, "resources", "limit"], {}, "'limit' was unexpected"),
    ("JobSet", ["metadata", "labels"], ["app"], "is not of type 'object'"),
    ("StatefulSet", ["spec", "template", "spec", "containers", 0, "image"], None, "is not of type"),
])
def test_a_broken_manifest_fails_validation(kind, path, value, words):
    """The schemas catch mistakes of the kind a generator makes: a misspelt field, a wrong type,
    a missing required field (so the validation above can fail)."""
    job = _job(kind="jobset" if kind == "JobSet" else "job", gpus_per_worker=1,
               servers=1 if kind == "StatefulSet" else None)
    objects = list(yaml.safe_load_all(k8s_manifest(job)))
    (good,) = [o for o in objects if o["kind"] == kind]
    assert schema_errors(good) == []
    errors = schema_errors(_broken(objects, kind, path, value))
    assert errors and any(words in e for e in errors), errors


def test_an_unknown_kind_has_no_schema():
    assert schema_errors({"apiVersion": "batch/v2", "kind": "Job"}) == [
        "no schema for apiVersion='batch/v2' kind='Job'"]


_RFC1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


@pytest.mark.parametrize("storage", ["20Gi", "500G", "1.5Ti", "1e9", "100", ".5Gi"])
def test_kubernetes_quantities_are_taken(storage):
    objects = yaml.safe_load_all(k8s_manifest(_job(servers=1, server_storage=storage)))
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == storage


@pytest.mark.parametrize("kind", ["job", "jobset"])
def test_the_longest_names_pass_the_api_servers_name_rules(kind):
    """What the JSON schemas cannot say: Service names are RFC 1035 labels, and a pod's host name
    (JobSet's webhook: the longest pod name plus a 6-character suffix) fits in 63 characters."""
    job = _job(kind=kind, name="g" + "-x" * 19 + "9", workers=100_000, servers=2)
    assert len(job.name) == 40
    objects = list(yaml.safe_load_all(k8s_manifest(job)))
    for obj in objects:
        assert re.match(_RFC1035, obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 63
    if kind == "jobset":
        (jobset,) = [o for o in objects if o["kind"] == "JobSet"]
        (rjob,) = jobset["spec"]["replicatedJobs"]
        longest = f"{job.name}-{rjob['name']}-{rjob['replicas'] - 1}-{job.workers - 1}-abcde"
        assert jobset["spec"]["network"]["subdomain"] == job.name
    else:
        longest = f"{job.name}-{job.workers - 1}"
    assert re.match(_RFC1035, longest) and len(longest) <= 63, longest
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    assert len(sts["metadata"]["name"]) <= 52  # its pods' controller-revision-hash label fits


def test_jobset_rules_beyond_the_schema_do_not_concern_the_manifest():
    """The CRD's CEL rules (which a JSON schema validator cannot run) only constrain fields that
    jaxpar never sets; a new rule in an updated CRD makes this test fail and ask for a look."""
    rules = set()

    def collect(node):
        if isinstance(node, dict):
            rules.update(r["rule"] for r in node.get("x-kubernetes-validations", ())
                         if r["rule"] != "self == oldSelf")
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(json.loads((SCHEMAS / "jobset-v1alpha2.json").read_text()))
    assert len(rules) == 2 and all("startupPolicy" in r or "templates" in r for r in rules), rules
    (jobset,) = yaml.safe_load_all(k8s_manifest(_job(kind="jobset")))
    assert not {"startupPolicy", "volumeClaimPolicies"} & set(jobset["spec"])
    assert all("dependsOn" not in r for r in jobset["spec"]["replicatedJobs"])
