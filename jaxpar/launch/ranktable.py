"""Rank table files: a JSON list of hosts and their devices, as MindSpore's ``RANK_TABLE_FILE``.

The format is MindSpore's (``server_list`` → ``device`` → ``device_id`` / ``rank_id``), with
one optional jaxpar field, ``coordinator_port``::

    {
      "version": "1.0",
      "server_count": "2",
      "coordinator_port": 8476,
      "server_list": [
        {"server_id": "10.0.0.1",
         "device": [{"device_id": "0", "rank_id": "0"}, {"device_id": "1", "rank_id": "1"}]},
        {"server_id": "10.0.0.2",
         "device": [{"device_id": "0", "rank_id": "2"}, {"device_id": "1", "rank_id": "3"}]}
      ],
      "status": "completed"
    }

Each distinct ``rank_id`` is one process (MindSpore: one process per device). Entries that
share a ``rank_id`` belong to one process that drives all of them (JAX's habit: one process per
host), so ``"rank_id": "0"`` on all four devices of a host means one process with four devices.
Process 0 serves as coordinator, on its host (``server_id``). A process learns which rank it
is from ``JAXPAR_PROCESS_ID`` or MindSpore's ``RANK_ID``; without either, from its host name
when that host runs exactly one rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpar.launch.sources import (
    COORDINATOR_PORT,
    DEFAULT_PORT,
    PROCESS_ID,
    Reading,
    parse_int,
    parse_port,
)

RANK_TABLE_FILE = "JAXPAR_RANK_TABLE_FILE"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankEntry:
    """One process of a rank table: its id, host and devices on that host."""

    rank: int
    host: str
    device_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankTable:
    """A parsed rank table file.

    Example:
        >>> table = load_rank_table("rank_table.json")  # doctest: +SKIP
        >>> table.coordinator_address, len(table.ranks)  # doctest: +SKIP
        ('10.0.0.1:8476', 4)
    """

    path: str
    port: int
    ranks: tuple[RankEntry, ...]

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of rank 0, which serves as the coordinator."""
        return f"{self.ranks[0].host}:{self.port}"


def _bad(path: str, where: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"rank table {path}: {where}={value!r} is not valid; {fix}")


def _servers(path: str, data: Any) -> list:
    if not isinstance(data, dict) or not isinstance(data.get("server_list"), list):
        raise _bad(path, "server_list", None if not isinstance(data, dict) else data.get("server_list"),
                   'the file must be a JSON object with a "server_list" list of servers.')
    servers = data["server_list"]
    if not servers:
        raise _bad(path, "server_list", servers, "list at least one server.")
    count = data.get("server_count")
    if count is not None and str(count) != str(len(servers)):
        raise _bad(path, "server_count", count, f"server_list has {len(servers)} servers.")
    return servers


def _entries(path: str, servers: list) -> dict[int, RankEntry]:
    by_rank: dict[int, RankEntry] = {}
    seen: dict[tuple[str, int], int] = {}       # (host, device id) -> rank
    for s, server in enumerate(servers):
        host = server.get("server_id") if isinstance(server, dict) else None
        if not isinstance(host, str) or not host:
            raise _bad(path, f"server_list[{s}].server_id", host, "give the host's name or IP.")
        devices = server.get("device")
        if not isinstance(devices, list) or not devices:
            raise _bad(path, f"server_list[{s}].device", devices, "list the server's devices.")
        for d, dev in enumerate(devices):
            where = f"server_list[{s}].device[{d}]"
            dev = dev if isinstance(dev, dict) else {}
            rank = parse_int(f"rank table {path}: {where}.rank_id", dev.get("rank_id", ""))
            device = parse_int(f"rank table {path}: {where}.device_id", dev.get("device_id", ""))
            entry = by_rank.get(rank, RankEntry(rank=rank, host=host, device_ids=()))
            if entry.host != host:
                raise _bad(path, f"{where}.rank_id", rank,
                           f"rank {rank} is already on server {entry.host!r}; one rank lives on one server.")
            owner = seen.get((host, device))
            if owner is not None:
                raise _bad(path, f"{where}.device_id", device,
                           f"device {device} of server {host!r} is already listed (for rank {owner}); each device "
                           "belongs to one entry, and two processes cannot drive one device.")
            seen[(host, device)] = rank
            by_rank[rank] = dataclasses.replace(entry, device_ids=entry.device_ids + (device,))
    return by_rank


def parse_rank_table(path: str, data: Any) -> RankTable:
    """Validates rank table ``data`` (already decoded JSON) read from ``path``."""
    by_rank = _entries(path, _servers(path, data))
    missing = sorted(set(range(len(by_rank))) - set(by_rank))
    if missing:
        raise _bad(path, "rank_id", sorted(by_rank),
                   f"rank ids must be 0..{len(by_rank) - 1} without gaps; missing {missing}.")
    port = parse_int(f"rank table {path}: coordinator_port",
                     data.get("coordinator_port", DEFAULT_PORT), minimum=1)
    if port > 65535:
        raise _bad(path, "coordinator_port", port, "give a TCP port in 1..65535, or leave it out for "
                   f"{DEFAULT_PORT}.")
    ranks = tuple(by_rank[r] for r in range(len(by_rank)))
    return RankTable(path=path, port=port, ranks=ranks)


def load_rank_table(path: str) -> RankTable:
    """Reads and validates the rank table JSON file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"rank table {path!r} does not exist; check {RANK_TABLE_FILE}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"rank table {path!r} is not valid JSON: {err}.") from None
    except OSError as err:
        raise ValueError(f"rank table {path!r} cannot be read ({err.strerror or err}); set {RANK_TABLE_FILE} to "
                         "the rank table JSON file.") from None
    return parse_rank_table(path, data)


def _my_rank(table: RankTable, env: Mapping[str, str], host_names: Sequence[str]):
    given = [(name, parse_int(name, env[name])) for name in (PROCESS_ID, "RANK_ID") if env.get(name, "").strip()]
    if len({rank for _, rank in given}) > 1:
        raise ValueError(f"{PROCESS_ID}={env[PROCESS_ID]} but RANK_ID={env['RANK_ID']}, for rank table "
                         f"{table.path}: the two say different ranks; set one (or both to the same rank).")
    if given:
        name, rank = given[0]
        return rank, f"{name}={env[name]}"
    mine = [e for e in table.ranks if e.host in set(host_names)]
    if len(mine) == 1:
        return mine[0].rank, f"the only rank on host {mine[0].host}"
    return None, None


def read_rank_table(table: RankTable, env: Mapping[str, str], host_names: Sequence[str]) -> Reading:
    """Settings from a rank table, for the process that ``env`` and ``host_names`` describe."""
    origin = f"rank table {table.path}"
    values: dict[str, tuple[Any, str]] = {
        "num_processes": (len(table.ranks), f"{origin} ({len(table.ranks)} ranks)"),
        "coordinator_address": (table.coordinator_address, f"{origin} (host of rank 0)"),
    }
    if COORDINATOR_PORT in env:
        port = parse_port(COORDINATOR_PORT, env[COORDINATOR_PORT])
        values["coordinator_address"] = (f"{table.ranks[0].host}:{port}", f"{origin} and {COORDINATOR_PORT}")
    rank, how = _my_rank(table, env, host_names)
    if rank is None:
        return Reading("rank_table", values)
    if rank >= len(table.ranks):
        raise ValueError(f"{how} but {origin} has ranks 0..{len(table.ranks) - 1}; "
                         "set the process id to one of them.")
    entry = table.ranks[rank]
    local = [e.rank for e in table.ranks if e.host == entry.host].index(rank)
    values["process_id"] = (rank, how)
    values["local_process_id"] = (local, f"{origin} (rank {rank} on {entry.host})")
    values["local_device_ids"] = (entry.device_ids, f"{origin} (devices of rank {rank})")
    return Reading("rank_table", values)
