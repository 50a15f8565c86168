"""The server role of ``jaxpar k8s --servers N``: a headless Service and a StatefulSet.

Server ``i`` is pod ``<name>-ps-<i>``, reachable as ``<name>-ps-<i>.<name>-ps``; a StatefulSet
gives it that stable name and restarts it in place when it dies (``restartPolicy: Always``),
and a server started again restores its shards from its checkpoint folder. The worker pods get
``JAXPAR_PS_ADDRESSES`` from these names, and every pod takes ``JAXPAR_PS_TOKEN`` from the
Secret ``--ps-token-secret`` (key ``token``), which the user creates once per job:

    kubectl create secret generic <name>-ps-token --from-literal=token=$(openssl rand -hex 16)

Servers stay up after the worker Job ends (a StatefulSet has no end): delete them with
``kubectl delete statefulset,service -l app=<name>-ps``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpar.launch import servers

if TYPE_CHECKING:
    from jaxpar.launch.k8s import K8sJob

CHECKPOINTS = "/ps-checkpoints"
_POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
INDEX = "JAXPAR_PS_INDEX"


def server_name(job: K8sJob) -> str:
    """Name of the servers' StatefulSet, Service and pod label."""
    return f"{job.name}-ps"


def addresses(job: K8sJob) -> str:
    """``JAXPAR_PS_ADDRESSES`` of the worker pods: the servers' DNS names, by index."""
    svc = server_name(job)
    return ",".join(f"{svc}-{i}.{svc}:{job.server_port}" for i in range(job.servers))


def token_env(job: K8sJob) -> dict:
    """``JAXPAR_PS_TOKEN`` from the job's Secret (never written into the manifest)."""
    ref = {"name": job.ps_token_secret or f"{job.name}-ps-token", "key": "token"}
    return {"name": servers.TOKEN, "valueFrom": {"secretKeyRef": ref}}


def worker_env(job: K8sJob) -> list[dict]:
    """What each worker pod gets to reach the servers (empty without servers)."""
    if not job.servers:
        return []
    return [{"name": servers.ADDRESSES, "value": addresses(job)}, token_env(job)]


def _container(job: K8sJob) -> dict:
    # $(VAR) in a command is expanded by Kubernetes from the container's env.
    command = ["python", "-m", "jaxpar.ps.server", "--index", f"$({INDEX})",
               "--count", str(job.servers), "--bind", f"0.0.0.0:{job.server_port}",
               "--checkpoint-dir", CHECKPOINTS]
    return {
        "name": "server",
        "image": job.image,
        "command": command,
        "env": [{"name": INDEX, "valueFrom": {"fieldRef": {"fieldPath": _POD_INDEX}}},
                token_env(job),
                {"name": "JAX_PLATFORMS", "value": "cpu"},  # host processes: no accelerator
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "ps", "containerPort": job.server_port}],
        "readinessProbe": {"tcpSocket": {"port": job.server_port}, "periodSeconds": 2},
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINTS}],
    }


def _statefulset(job: K8sJob, metadata: dict) -> dict:
    name = server_name(job)
    spec = {
        "serviceName": name,
        "replicas": job.servers,
        "podManagementPolicy": "Parallel",  # servers do not wait for each other
        "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}},
                     "spec": {"restartPolicy": "Always", "containers": [_container(job)]}},
    }
    volume = {"name": "checkpoints"}
    if job.server_storage:
        # A claim per server outlives the pod: a server moved to another node restores too.
        spec["volumeClaimTemplates"] = [{
            "metadata": volume,
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": job.server_storage}}}}]
    else:
        # Survives a container restart in the same pod, not the pod's deletion.
        spec["template"]["spec"]["volumes"] = [{**volume, "emptyDir": {}}]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": spec}


def _service(job: K8sJob, metadata: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"app": server_name(job)},
                 "ports": [{"name": "ps", "port": job.server_port}]},
    }


def server_objects(job: K8sJob) -> list[dict]:
    """The servers' Service and StatefulSet (empty without servers)."""
    if not job.servers:
        return []
    metadata = {"name": server_name(job), "labels": {"app": server_name(job)}}
    if job.namespace:
        metadata["namespace"] = job.namespace
    return [_service(job, dict(metadata)), _statefulset(job, dict(metadata))]
