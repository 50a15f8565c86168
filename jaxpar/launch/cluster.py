"""Which cluster is this process part of? One frozen :class:`ClusterSpec`, from every source.

Detection order (see ``docs/startup.md``):

1. explicit arguments (``initialize(process_id=...)``): always win, field by field;
2. ``JAXPAR_*`` variables (``jaxpar launch`` sets them; a dynamic cluster sets them by hand);
3. a rank table file (``JAXPAR_RANK_TABLE_FILE``);
4. one scheduler, the innermost that started this process: OpenMPI (``mpirun``), then SLURM
   (``srun``), then Kubernetes (an indexed Job). ``mpirun`` runs inside a SLURM allocation and
   SLURM may run inside a pod, so the outer ones are ignored when an inner one is there.

Sources 2–4 must agree on the number of processes and this process's ids: a disagreement is a
``ValueError`` that names both sources and their values. ``JAXPAR_CLUSTER_SOURCE`` (or
``source=``) names the one source to read besides the ``JAXPAR_*`` variables (``env`` for
none, ``none`` for nothing at all). With no source at all, the job is one process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpar.launch import ranktable, sources

CLUSTER_SOURCE = "JAXPAR_CLUSTER_SOURCE"
SCHEDULERS = ("openmpi", "slurm", "kubernetes")
SOURCE_CHOICES = ("auto", "env", "rank_table", *SCHEDULERS, "none")


class ClusterError(RuntimeError):
    """The cluster cannot form: a port in use, a worker that never joined, a worker that died."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Where this process sits in a multi-process job; the arguments of
    ``jax.distributed.initialize``.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordination service; ``None`` for a
            one-process job.
        num_processes: number of processes in the job.
        process_id: this process's id, ``0 .. num_processes - 1``.
        local_process_id: its index among the processes on its host, when known.
        local_device_ids: the accelerators this process drives (``None``: all it sees).
        source: where ``process_id`` came from (``"env"``, ``"openmpi"``, ..., ``"single"``).
        origins: ``(field, origin)`` pairs saying where every field came from.

    Example:
        >>> spec = ClusterSpec(coordinator_address="10.0.0.1:8476", num_processes=2,
        ...                    process_id=1, source="env")
        >>> spec.is_multi_process
        True
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "single"
    origins: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes!r} must be a whole number >= 1.")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id!r} must be in 0..{self.num_processes - 1} "
                f"(num_processes={self.num_processes}); {self._where('process_id')}"
            )
        if self.num_processes > 1:
            split_address(self.coordinator_address, self._where("coordinator_address"))

    def _where(self, field: str) -> str:
        found = dict(self.origins).get(field)
        return f"it came from {found}." if found else "check how it was set."

    @property
    def is_multi_process(self) -> bool:
        """True when the job has more than one process."""
        return self.num_processes > 1

    def describe(self) -> str:
        """One line per field with its value and origin, for logs and error messages."""
        origins = dict(self.origins)
        return "\n".join(
            f"{name} = {getattr(self, name)!r}  ({origins.get(name, 'default')})"
            for name in ("coordinator_address", "num_processes", "process_id",
                         "local_process_id", "local_device_ids")
        )


def split_address(address: Any, where: str = "") -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``; a ValueError otherwise."""
    host, _, port = str(address or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator_address={address!r} must look like 'host:port', e.g. '10.0.0.1:8476'"
            f" (set {sources.COORDINATOR_ADDRESS}=host:port); {where}".rstrip("; ")
        )
    return host.strip("[]"), int(port)


def _chosen_source(env: Mapping[str, str], source: str | None) -> str:
    name = source if source is not None else env.get(CLUSTER_SOURCE, "").strip() or "auto"
    if name not in SOURCE_CHOICES:
        arg = "source" if source is not None else CLUSTER_SOURCE
        raise ValueError(f"{arg}={name!r} is not a cluster source; use one of {', '.join(SOURCE_CHOICES)}.")
    return name


def _host_names(hostname: str | None) -> tuple[str, str, tuple[str, ...]]:
    """(host name, full name, every name and address of this host); only looked up on demand,
    since a reverse lookup can be slow on a badly configured machine."""
    if hostname is not None:
        return hostname, hostname, (hostname,)
    name, fqdn = socket.gethostname(), socket.getfqdn()
    try:
        addresses = tuple(socket.gethostbyname_ex(name)[2])
    except OSError:
        addresses = ()
    return name, fqdn, (name, fqdn, *addresses)


def _scheduler_reading(name: str, env: Mapping[str, str], hostname: str | None):
    if name == "openmpi":
        return sources.read_openmpi(env)
    if name == "slurm":
        return sources.read_slurm(env)
    if "KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env:
        return None
    host, fqdn, _ = _host_names(hostname)
    return sources.read_kubernetes(env, host, fqdn)


def _readings(env, choice: str, rank_table: str | None, hostname: str | None) -> list:
    """The readings to merge, in order: env, rank table, the innermost scheduler."""
    if choice == "none":
        return []
    found = [sources.read_env(env)]
    table_path = rank_table if rank_table is not None else env.get(ranktable.RANK_TABLE_FILE, "").strip()
    if table_path and choice in ("auto", "rank_table"):
        table = ranktable.load_rank_table(table_path)
        found.append(ranktable.read_rank_table(table, env, _host_names(hostname)[2]))
    elif choice == "rank_table":
        raise ValueError(f"the cluster source is 'rank_table' but no rank table is given; "
                         f"set {ranktable.RANK_TABLE_FILE}=path/to/rank_table.json.")
    schedulers = SCHEDULERS if choice == "auto" else (choice,) if choice in SCHEDULERS else ()
    for sched in schedulers:
        reading = _scheduler_reading(sched, env, hostname)
        if reading is not None:
            found.append(reading)
            break
    return [r for r in found if r is not None]


def _conflict(field: str, seen: list[tuple[str, Any, str]]) -> ValueError:
    sides = "; ".join(f"{src} says {value!r} ({origin})" for src, value, origin in seen)
    return ValueError(
        f"cluster sources disagree on {field}: {sides}. Fix the wrong one, pass {field}= to "
        f"jaxpar.distributed.initialize(), or set {CLUSTER_SOURCE} to the one source to trust."
    )


def merge_readings(
    readings: Sequence[sources.Reading], skip: frozenset[str] = frozenset()
) -> dict[str, tuple[Any, str, str]]:
    """``field -> (value, origin, source)``: the first reading wins, the others must agree.

    A guess (a coordinator host derived from a host name) yields to any firm value; fields in
    ``skip`` are set explicitly and not read at all.
    """
    merged: dict[str, tuple[Any, str, str]] = {}
    for field in sources.FIELDS:
        if field in skip:
            continue
        said = [(r.source, *r.values[field], field in r.guessed) for r in readings if field in r.values]
        seen = [s[:3] for s in said if not s[3]] or [s[:3] for s in said]
        if not seen:
            continue
        if len({repr(value) for _, value, _ in seen}) > 1:
            raise _conflict(field, seen)
        src, value, origin = seen[0]
        merged[field] = (value, origin, src)
    return merged


def _spec(merged: dict[str, tuple[Any, str, str]]) -> ClusterSpec:
    num = merged.get("num_processes", (None,))[0]
    pid = merged.get("process_id", (None,))[0]
    origins = tuple((field, origin) for field, (_, origin, _) in merged.items())
    if num is None and pid not in (None, 0):
        raise ValueError(
            f"process_id={pid} ({merged['process_id'][1]}) is set but the number of processes is "
            f"not; set {sources.NUM_PROCESSES} or pass num_processes=."
        )
    if num is not None and num > 1 and pid is None:
        raise ValueError(
            f"num_processes={num} ({merged['num_processes'][1]}) but nothing says which process "
            f"this is; set {sources.PROCESS_ID} (0..{num - 1}) or pass process_id=."
        )
    if num is not None and num > 1 and "coordinator_address" not in merged:
        raise ValueError(
            f"num_processes={num} ({merged['num_processes'][1]}) but no coordinator address; "
            f"set {sources.COORDINATOR_ADDRESS}=host:port (the host of process 0) or pass "
            "coordinator_address=."
        )
    ids = merged.get("local_device_ids", (None,))[0]
    return ClusterSpec(
        coordinator_address=merged.get("coordinator_address", (None,))[0],
        num_processes=num if num is not None else 1,
        process_id=pid if pid is not None else 0,
        local_process_id=merged.get("local_process_id", (None,))[0],
        local_device_ids=tuple(ids) if ids is not None else None,
        source=merged["process_id"][2] if "process_id" in merged else "single",
        origins=origins,
    )


def detect_cluster(
    env: Mapping[str, str] | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    source: str | None = None,
    rank_table: str | None = None,
    hostname: str | None = None,
) -> ClusterSpec:
    """Reads every source in ``env`` (default ``os.environ``) into one :class:`ClusterSpec`.

    Arguments that are not ``None`` are explicit settings and win over every source.
    ``hostname`` replaces this machine's host name (for tests and rank-table lookups).

    Example:
        >>> detect_cluster({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
        ...                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}).process_id
        1
    """
    env = os.environ if env is None else env
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_device_ids": tuple(local_device_ids) if local_device_ids is not None else None,
    }
    given = frozenset(field for field, value in explicit.items() if value is not None)
    merged = merge_readings(_readings(env, _chosen_source(env, source), rank_table, hostname), given)
    for field, value in explicit.items():
        if value is not None:
            merged[field] = (value, f"explicit argument {field}={value!r}", "explicit")
    return _spec(merged)
