"""Readers for the cluster sources: an environment in, settings with their origins out.

Each reader takes the environment as a mapping (never ``os.environ`` itself), so it is a pure
function that tests call with a plain dict. It returns ``None`` when its source is absent, and
otherwise a :class:`Reading`: for each field it knows, the value and where it came from
(``"OMPI_COMM_WORLD_RANK=3"``), so that a conflict can name both sides.

Variables read, by source:

=============  ==========================================================================
source         variables
=============  ==========================================================================
env            ``JAXPAR_COORDINATOR_ADDRESS``, ``JAXPAR_NUM_PROCESSES``,
               ``JAXPAR_PROCESS_ID``, ``JAXPAR_LOCAL_PROCESS_ID``,
               ``JAXPAR_LOCAL_DEVICE_IDS`` (set by ``jaxpar launch``, or by hand)
openmpi        ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``,
               ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
               ``OMPI_MCA_orte_hnp_uri`` (host of ``mpirun``)
slurm          ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_TASKS`` or
               ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``
kubernetes     ``KUBERNETES_SERVICE_HOST``, ``JOB_COMPLETION_INDEX`` and the pod's host
               name (``<job>-<index>.<subdomain>``)
=============  ==========================================================================

``JAXPAR_COORDINATOR_PORT`` sets the port wherever a source finds only the host.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

# Names of the environment variables jaxpar itself reads and the launcher sets.
COORDINATOR_ADDRESS = "JAXPAR_COORDINATOR_ADDRESS"
COORDINATOR_PORT = "JAXPAR_COORDINATOR_PORT"
NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
PROCESS_ID = "JAXPAR_PROCESS_ID"
LOCAL_PROCESS_ID = "JAXPAR_LOCAL_PROCESS_ID"
LOCAL_DEVICE_IDS = "JAXPAR_LOCAL_DEVICE_IDS"

DEFAULT_PORT = 8476
"""Coordinator port when a source finds the host but nothing says which port."""

FIELDS = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "local_process_id",
    "local_device_ids",
)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What one source says: ``values[field] = (value, origin)``."""

    source: str
    values: Mapping[str, tuple[Any, str]]
    guessed: frozenset[str] = frozenset()
    """Fields this source only guesses (a coordinator host from a host name): a source earlier
    in the order overrides them without a conflict."""


def parse_int(name: str, raw: str, *, minimum: int = 0) -> int:
    """Parses the whole number in variable ``name``, or raises a ValueError that names it."""
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(
            f"{name}={raw!r} is not a whole number >= {minimum}; "
            f"set {name} to a number such as {max(minimum, 0)} or unset it."
        )
    return value


def parse_device_ids(name: str, raw: str) -> tuple[int, ...]:
    """Parses ``"0,1,3"`` into ``(0, 1, 3)``."""
    parts = [p for p in str(raw).replace(" ", "").split(",") if p]
    if not parts:
        raise ValueError(f"{name}={raw!r} lists no device ids; write them like '0,1,2,3'.")
    ids = tuple(parse_int(name, p) for p in parts)
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"{name}={raw!r} lists device {', '.join(map(str, twice))} more than once; "
                         f"list each device once, e.g. {','.join(map(str, sorted(set(ids))))}.")
    return ids


def parse_port(name: str, raw: str) -> int:
    """Parses a TCP port (1..65535) in variable ``name``, or raises a ValueError that names it."""
    port = parse_int(name, raw, minimum=1)
    if port > 65535:
        raise ValueError(f"{name}={raw!r} is not a TCP port; set {name} to a port in 1..65535 or unset it.")
    return port


def _coordinator_port(env: Mapping[str, str], default: int) -> tuple[int, str]:
    if COORDINATOR_PORT in env:
        port = parse_port(COORDINATOR_PORT, env[COORDINATOR_PORT])
        return port, f"{COORDINATOR_PORT}={port}"
    return default, f"default port {default}"


def _add(values: dict, env: Mapping[str, str], field: str, name: str, parse=parse_int) -> None:
    if name in env and str(env[name]).strip() != "":
        values[field] = (parse(name, env[name]), f"{name}={env[name]}")


def read_env(env: Mapping[str, str]) -> Reading | None:
    """jaxpar's own variables: the dynamic cluster, and what ``jaxpar launch`` sets."""
    values: dict[str, tuple[Any, str]] = {}
    if env.get(COORDINATOR_ADDRESS, "").strip():
        raw = env[COORDINATOR_ADDRESS].strip()
        values["coordinator_address"] = (raw, f"{COORDINATOR_ADDRESS}={raw}")
    _add(values, env, "num_processes", NUM_PROCESSES, lambda n, r: parse_int(n, r, minimum=1))
    _add(values, env, "process_id", PROCESS_ID)
    _add(values, env, "local_process_id", LOCAL_PROCESS_ID)
    _add(values, env, "local_device_ids", LOCAL_DEVICE_IDS, parse_device_ids)
    return Reading("env", values) if values else None


_HNP_HOST = re.compile(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)")


def _openmpi_coordinator(env: Mapping[str, str]) -> tuple[str, str] | None:
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    job = uri.split(".", 1)[0]
    # Same port choice as JAX: spread jobs over the top 4096 ports by their job id.
    default = (int(job) // 4096) % 4096 + 61440 if job.isdigit() else DEFAULT_PORT
    port, port_origin = _coordinator_port(env, default)
    size, local_size = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if size is not None and size == local_size:
        # Every rank is on this node: rank 0 (which serves) is local too.
        return f"127.0.0.1:{port}", f"single-node mpirun, {port_origin}"
    match = _HNP_HOST.search(uri)
    if match is None:
        return None
    host = match.group(1) or f"[{match.group(2)}]"
    return f"{host}:{port}", f"OMPI_MCA_orte_hnp_uri (mpirun's host), {port_origin}"


def read_openmpi(env: Mapping[str, str]) -> Reading | None:
    """Ranks from ``mpirun``'s variables; the coordinator is ``mpirun``'s host."""
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
        return None
    values: dict[str, tuple[Any, str]] = {}
    _add(values, env, "num_processes", "OMPI_COMM_WORLD_SIZE", lambda n, r: parse_int(n, r, minimum=1))
    _add(values, env, "process_id", "OMPI_COMM_WORLD_RANK")
    _add(values, env, "local_process_id", "OMPI_COMM_WORLD_LOCAL_RANK")
    found = _openmpi_coordinator(env)
    if found is not None:
        values["coordinator_address"] = found
    return Reading("openmpi", values, frozenset({"coordinator_address"}))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[003-005,9],cpu1"`` gives ``"gpu003"``.

    >>> first_host("rack[1-2]-n[07,09]")
    'rack1-n07'
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"SLURM_STEP_NODELIST={nodelist!r} {why}; SLURM writes node lists such as "
                          "'gpu[003-005,9],cpu1'. Set JAXPAR_COORDINATOR_ADDRESS=host:port to name the coordinator.")

    out, depth, group = [], 0, []
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        if ch == "[":
            if depth:
                raise bad("opens a bracket inside a bracket")
            depth, group = 1, []
        elif ch == "]":
            if not depth:
                raise bad("closes a bracket it never opened")
            depth = 0
            first = re.split(r"[,-]", "".join(group))[0]
            if not first.isdigit():
                raise bad(f"has a range [{''.join(group)}] that does not start with a number")
            out.append(first)
        elif depth:
            group.append(ch)
        else:
            out.append(ch)
    if depth:
        raise bad("leaves a bracket open")
    host = "".join(out)
    if not host:
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist!r} names no host.")
    return host


def read_slurm(env: Mapping[str, str]) -> Reading | None:
    """Ranks of an ``srun`` step; the coordinator is the step's first node."""
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID")
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if any(name not in env for name in (*needed, tasks)):
        return None
    values: dict[str, tuple[Any, str]] = {}
    _add(values, env, "num_processes", tasks, lambda n, r: parse_int(n, r, minimum=1))
    _add(values, env, "process_id", "SLURM_PROCID")
    _add(values, env, "local_process_id", "SLURM_LOCALID")
    job = env["SLURM_JOB_ID"]
    default = int(job) % 4096 + 61440 if job.isdigit() else DEFAULT_PORT
    port, port_origin = _coordinator_port(env, default)
    try:
        host = first_host(env["SLURM_STEP_NODELIST"])
    except ValueError:
        if env.get(COORDINATOR_ADDRESS, "").strip():    # set: the node list is not needed
            return Reading("slurm", values, frozenset({"coordinator_address"}))
        raise
    origin = f"first node of SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']}, {port_origin}"
    values["coordinator_address"] = (f"{host}:{port}", origin)
    return Reading("slurm", values, frozenset({"coordinator_address"}))


def read_kubernetes(env: Mapping[str, str], hostname: str, fqdn: str) -> Reading | None:
    """A pod of an indexed Job (or a JobSet's job): its index, and pod 0 as coordinator.

    An indexed Job's pod ``i`` is named ``<job>-<i>``; with ``subdomain`` set to a headless
    Service its full name is ``<job>-<i>.<service>...``, so pod 0 is ``<job>-0.<service>``.
    The number of processes is not in a pod's environment: set ``JAXPAR_NUM_PROCESSES``
    (``jaxpar k8s`` does).
    """
    if "KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env:
        return None
    values: dict[str, tuple[Any, str]] = {}
    _add(values, env, "process_id", "JOB_COMPLETION_INDEX")
    suffix = f"-{env['JOB_COMPLETION_INDEX'].strip()}"
    if hostname.endswith(suffix) and len(hostname) > len(suffix):
        domain = fqdn[len(hostname):] if fqdn.startswith(hostname + ".") else ""
        subdomain = domain.split(".")[1] if domain.count(".") >= 1 else ""
        host = hostname[: -len(suffix)] + "-0" + (f".{subdomain}" if subdomain else "")
        port, port_origin = _coordinator_port(env, DEFAULT_PORT)
        values["coordinator_address"] = (f"{host}:{port}", f"pod 0 of host {fqdn}, {port_origin}")
    return Reading("kubernetes", values, frozenset({"coordinator_address"}))
