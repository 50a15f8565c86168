"""``jaxpar k8s``: a Kubernetes manifest that runs a command on N worker pods.

Two shapes, both one pod per process:

* ``kind="job"``: a headless Service plus an indexed Job. Pod ``i`` is ``<name>-<i>``; with
  ``subdomain: <name>`` it resolves as ``<name>-<i>.<name>``, so process 0 is the coordinator at
  ``<name>-0.<name>:<port>``.
* ``kind="jobset"``: a JobSet (``jobset.x-k8s.io/v1alpha2``) with one replicated Job; JobSet
  makes the headless Service itself, and pod ``i`` is ``<name>-workers-0-<i>.<name>``.

Each pod gets ``JAXPAR_COORDINATOR_ADDRESS``, ``JAXPAR_NUM_PROCESSES`` and ``JAXPAR_PROCESS_ID``
(from the pod's ``batch.kubernetes.io/job-completion-index`` annotation). Any failed pod fails
the Job (``backoffLimit: 0``), and Kubernetes deletes the other pods.

``servers=N`` adds the parameter-server role (``jaxpar.launch.k8s_servers``): a StatefulSet of
N server pods behind their own headless Service; the workers get their DNS names in
``JAXPAR_PS_ADDRESSES`` and the job token from a Secret.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import yaml

from jaxpar.launch import k8s_servers, sources

_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_SERVER_FIELDS = {"server_port": "--server-port", "server_storage": "--server-storage",
                  "ps_token_secret": "--ps-token-secret"}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")   # RFC 1123 label: a namespace, a Secret
# Service names (and a JobSet's subdomain) are RFC 1035 labels: they start with a letter.
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# A Kubernetes quantity, as the API server parses it: "20Gi", "500M", "1.5e9", "100".
_QUANTITY = re.compile(r"^\+?(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
                       r"([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class K8sJob:
    """What to run on Kubernetes; ``manifest(job)`` turns it into YAML.

    Example:
        >>> K8sJob(workers=4, image="me/train:1", command=("python", "train.py"),
        ...        name="gpt").coordinator_host
        'gpt-0.gpt'
    """

    workers: int
    """Number of pods = processes."""
    image: str
    """Container image with Python, jaxpar and the script."""
    command: tuple[str, ...]
    """What each pod runs, e.g. ``("python", "train.py", "--steps", "100")``."""
    name: str = "jaxpar"
    """Name of the Job / JobSet and its Service (a DNS label)."""
    kind: str = "job"
    """``"job"`` (Service + indexed Job) or ``"jobset"``."""
    port: int = sources.DEFAULT_PORT
    """Coordinator port on pod 0."""
    namespace: str | None = None
    gpus_per_worker: int = 0
    """``nvidia.com/gpu`` limit per pod (0: none)."""
    simulated_devices: int | None = None
    """CPU devices per pod, for trying the manifest out on a CPU cluster."""
    cluster_time_out: float | None = None
    """Seconds each pod waits for the others (``JAXPAR_CLUSTER_TIMEOUT``)."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """More environment variables for every pod."""
    servers: int | None = None
    """Parameter-server pods (a StatefulSet ``<name>-ps``); ``None``: none."""
    server_port: int = 8500
    """Port every server listens on."""
    server_storage: str | None = None
    """Size of a volume claim per server for its checkpoints (``"20Gi"``); ``None``: emptyDir."""
    ps_token_secret: str | None = None
    """Secret (key ``token``) holding the job token; default ``<name>-ps-token``."""

    def __post_init__(self):
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be a whole number >= 1 (--workers).")
        if not self.image:
            raise ValueError("image='' is empty; name the container image (--image IMG).")
        if not self.command:
            raise ValueError("command=() is empty; put the command after '--', e.g. -- python train.py.")
        # 40: the longest pod name, <name>-workers-0-<index> plus JobSet's 6-character check
        # suffix, stays within the 63 characters of a DNS label.
        if not _SERVICE_NAME.match(self.name) or len(self.name) > 40:
            raise ValueError(
                f"name={self.name!r} must be a lowercase DNS label of at most 40 characters "
                "that starts with a letter (then letters, digits, '-'), such as 'gpt-train' "
                "(--name)."
            )
        if self.namespace is not None and (not _NAME.match(self.namespace) or len(self.namespace) > 63):
            raise ValueError(f"namespace={self.namespace!r} must be a lowercase DNS label of at "
                             "most 63 characters (letters, digits, '-'), such as 'ml-team' "
                             "(--namespace).")
        if self.kind not in ("job", "jobset"):
            raise ValueError(f"kind={self.kind!r} must be 'job' or 'jobset' (--jobset picks the latter).")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in 1..65535 (--port).")
        if not isinstance(self.gpus_per_worker, int) or self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker!r} must be a whole number "
                             ">= 0 (--gpus-per-worker).")
        _positive_or_none("servers", self.servers, "--servers", int)
        if self.servers is None:
            for field in dataclasses.fields(self):
                given = getattr(self, field.name)
                if field.name in _SERVER_FIELDS and given != field.default:
                    raise ValueError(f"{field.name}={given!r} ({_SERVER_FIELDS[field.name]}) has no "
                                     "effect without servers; add --servers N, or drop it.")
        if self.servers and (not 0 < self.server_port < 65536 or self.server_port == self.port):
            raise ValueError(f"server_port={self.server_port!r} must be in 1..65535 and differ "
                             f"from the coordinator port {self.port} (--server-port).")
        _check_quantity("server_storage", self.server_storage, "--server-storage")
        if self.ps_token_secret is not None and not _NAME.match(self.ps_token_secret):
            raise ValueError(f"ps_token_secret={self.ps_token_secret!r} must be a lowercase DNS "
                             "name, such as 'train-ps-token' (--ps-token-secret).")
        _positive_or_none("simulated_devices", self.simulated_devices, "--simulated-devices", int)
        _positive_or_none("cluster_time_out", self.cluster_time_out, "--cluster-time-out", float)
        taken = sorted(set(self.env) & set(_fixed_names(self)))
        if taken:
            raise ValueError(
                f"--env {taken[0]}={self.env[taken[0]]}: jaxpar k8s sets {taken[0]} itself "
                f"(it sets {', '.join(_fixed_names(self))}); drop that --env, or use the "
                "matching option (--workers, --port, --simulated-devices, --cluster-time-out)."
            )

    @property
    def coordinator_host(self) -> str:
        """DNS name of pod 0 inside the namespace."""
        pod = f"{self.name}-0" if self.kind == "job" else f"{self.name}-workers-0-0"
        return f"{pod}.{self.name}"


def _positive_or_none(name: str, value, flag: str, kind: type) -> None:
    kinds = (int, float) if kind is float else int
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
        what = "a positive, finite number" if kind is float else f"a positive {kind.__name__}"
        raise ValueError(f"{name}={value!r} must be {what} ({flag}); "
                         f"leave {flag} out for the default.")


def _check_quantity(name: str, value, flag: str) -> None:
    found = _QUANTITY.match(value) if isinstance(value, str) else None
    if value is not None and (not found or float(found["number"]) == 0):
        raise ValueError(f"{name}={value!r} must be a positive Kubernetes quantity such as "
                         f"'20Gi' or '500G' (binary suffixes Ki Mi Gi Ti Pi Ei, decimal k M G T "
                         f"P E; 'GB' is not one) ({flag}).")


def _fixed_names(job: K8sJob) -> list[str]:
    """The variables the manifest sets for every pod (``--env`` may not set them again)."""
    return [e["name"] for e in _env(job, extra=False)]


def _env(job: K8sJob, extra: bool = True) -> list[dict]:
    env = [
        {"name": sources.COORDINATOR_ADDRESS, "value": f"{job.coordinator_host}:{job.port}"},
        {"name": sources.NUM_PROCESSES, "value": str(job.workers)},
        {"name": sources.PROCESS_ID, "valueFrom": {"fieldRef": {"fieldPath": _INDEX}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if job.simulated_devices is not None:
        env += [{"name": "JAXPAR_SIMULATED_DEVICES", "value": str(job.simulated_devices)},
                {"name": "JAX_PLATFORMS", "value": "cpu"}]
    if job.cluster_time_out is not None:
        env.append({"name": "JAXPAR_CLUSTER_TIMEOUT", "value": f"{job.cluster_time_out:g}"})
    env += k8s_servers.worker_env(job)
    return env + ([{"name": k, "value": str(v)} for k, v in job.env.items()] if extra else [])


def _container(job: K8sJob) -> dict:
    container = {
        "name": "worker",
        "image": job.image,
        "command": list(job.command),
        "env": _env(job),
        "ports": [{"name": "coordinator", "containerPort": job.port}],
    }
    if job.gpus_per_worker:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_worker}}
    return container


def _job_spec(job: K8sJob, subdomain: bool) -> dict:
    pod = {"restartPolicy": "Never", "containers": [_container(job)]}
    if subdomain:
        pod["subdomain"] = job.name
    return {
        "completionMode": "Indexed",
        "completions": job.workers,
        "parallelism": job.workers,
        # One failed pod fails the job: a JAX job cannot go on with a process missing.
        "backoffLimit": 0,
        "template": {"metadata": {"labels": {"app": job.name}}, "spec": pod},
    }


def _metadata(job: K8sJob) -> dict:
    meta = {"name": job.name, "labels": {"app": job.name}}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _service(job: K8sJob) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job),
        "spec": {
            "clusterIP": "None",
            # Pods must resolve each other before they are ready: they are waiting for each other.
            "publishNotReadyAddresses": True,
            "selector": {"app": job.name},
            "ports": [{"name": "coordinator", "port": job.port}],
        },
    }


def _jobset(job: K8sJob) -> dict:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job),
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True, "subdomain": job.name,
                        "publishNotReadyAddresses": True},
            "replicatedJobs": [
                {"name": "workers", "replicas": 1, "template": {"spec": _job_spec(job, False)}}
            ],
        },
    }


def manifest_objects(job: K8sJob) -> list[dict]:
    """The Kubernetes objects for ``job``, as plain dicts."""
    roles = k8s_servers.server_objects(job)
    if job.kind == "jobset":
        return roles + [_jobset(job)]
    batch_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job),
                 "spec": _job_spec(job, True)}
    return roles + [_service(job), batch_job]


def manifest(job: K8sJob) -> str:
    """The YAML manifest for ``job`` (several documents separated by ``---``).

    Example:
        >>> text = manifest(K8sJob(workers=4, image="me/train:1", command=("python", "train.py")))
        >>> "completionMode: Indexed" in text
        True
    """
    return yaml.safe_dump_all(manifest_objects(job), sort_keys=False, default_flow_style=False)


def command_after_dashes(words: Sequence[str]) -> tuple[str, ...]:
    """Drops the ``--`` that separates ``jaxpar k8s`` options from the pod's command."""
    words = list(words)
    return tuple(words[1:] if words[:1] == ["--"] else words)
