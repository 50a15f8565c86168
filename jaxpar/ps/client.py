"""The worker's side of the parameter server: pull rows, push row gradients, save, restore.

A client holds one ZeroMQ DEALER socket per server *per thread* (sockets are not thread-safe,
and a prefetching thread must be able to wait on a pull while the training thread pushes).
Every call has a deadline: it polls for its reply, sends the same request again every
``resend`` seconds (servers recognise a repeated request id, and a push already taken is not
applied twice), so a restarted server is reached again without the caller noticing; past the
deadline it raises ``TimeoutError`` naming the server address, the table and the operation.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import threading
import time
from typing import Any, Sequence

import numpy as np
import zmq

from jaxpar.ps.tables import TableSpec
from jaxpar.ps.wire import ADDRESSES_ENV, TOKEN_ENV, decode, encode


class Client:
    """Pulls and pushes the rows of ``tables`` on the servers at ``addresses``; made by
    :func:`connect`.

    Example:
        >>> client = jaxpar.ps.connect([spec], addresses=["127.0.0.1:5555"], token="t")  # doctest: +SKIP
        >>> rows = client.pull("users", np.array([1, 5]), step=0)  # doctest: +SKIP
        >>> client.push("users", np.array([1, 5]), grads, step=0)  # doctest: +SKIP
        >>> client.stats()["tables"]["users"]["clock"]  # doctest: +SKIP
        1
    """

    def __init__(self, tables: Sequence[TableSpec], *, mode: str, staleness: int,
                 addresses: list[str], token: str, timeout: float, worker: int, workers: int,
                 resend: float = 1.0):
        self.tables = {t.name: t for t in tables}
        self.mode, self.staleness = mode, staleness
        self.addresses, self.timeout, self.resend = addresses, timeout, resend
        self.worker, self.workers = worker, workers
        self._token = token
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._rids = itertools.count()
        self._stats = {"pulls": 0, "rows_pulled": 0, "pushes": 0, "rows_pushed": 0,
                       "rejected": 0, "staleness": {}, "pull_wait_s": 0.0}
        self._lock = threading.Lock()
        try:
            self._call([(s, {"op": "hello", "mode": mode, "staleness": staleness, "workers": workers,
                             "tables": [t.to_json() for t in tables]}, ())
                        for s in range(len(addresses))], table="*")
        except BaseException:
            self.close()  # a context left to the garbage collector can block in its finaliser
            raise

    # -- public calls -------------------------------------------------------------------------

    def pull(self, table: str, ids: np.ndarray, step: int) -> np.ndarray:
        """The rows ``ids`` of ``table`` as ``float32 ids.shape + (dim,)`` (``[len(ids), dim]``
        for a vector of ids), for worker step ``step`` (waits until the mode allows reading at
        that step).

        Example:
            >>> rows = client.pull("users", np.array([3, 7]), step=0)  # doctest: +SKIP
        """
        return self.pull_many({table: ids}, step)[table]

    def pull_many(self, ids: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """:meth:`pull` for several tables at once: every server is asked in parallel."""
        start = time.perf_counter()
        step = _check_step("pull_many", "step", step)
        plan, requests, shapes = {}, [], {}
        for name, table_ids in ids.items():
            shapes[name] = np.shape(table_ids)
            spec, table_ids = self._spec(name), self._check_ids(name, table_ids)
            owner = spec.owner(table_ids, len(self.addresses))
            for s in range(len(self.addresses)):
                where = np.flatnonzero(owner == s)
                if len(where):
                    plan[len(requests)] = (name, s, where)
                    requests.append((s, {"op": "pull", "table": name, "step": step,
                                         "worker": self.worker}, (table_ids[where],)))
        replies = self._call(requests, table=",".join(ids))
        out = {n: np.empty((int(np.prod(shape)), self._spec(n).dim), np.float32) for n, shape in shapes.items()}
        for k, (header, arrays) in enumerate(replies):
            name, s, where = plan[k]
            out[name][where] = arrays[0]
        out = {n: rows.reshape(shapes[n] + (rows.shape[1],)) for n, rows in out.items()}
        with self._lock:
            self._stats["pulls"] += 1
            self._stats["rows_pulled"] += sum(int(np.prod(shape)) for shape in shapes.values())
            self._stats["pull_wait_s"] += time.perf_counter() - start
        return out

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray, step: int,
             pulled_at: int | None = None) -> None:
        """Sends the gradients of ``table``'s rows ``ids`` computed at worker step ``step``
        (``grads``: ``ids.shape + (dim,)``, or ``[ids.size, dim]``; an id given twice gets the
        sum of its gradients).

        ``pulled_at`` is the step whose pull gave the rows (default ``step``): a worker that
        reuses rows pulled earlier says so. In async mode each server measures the push's
        staleness from the clock at which it served this worker's pull of ``pulled_at``, rejects
        (and counts) the push when it is more than ``staleness`` steps, and raises ``ValueError``
        when it served this worker no pull of ``pulled_at``. Every server gets a push for every
        step (an empty one when it owns none of ``ids``): in sync mode it is how a server knows
        this worker is done with the step.

        Example:
            >>> client.push("users", ids, grads, step=0)  # doctest: +SKIP
        """
        self.push_many({table: (ids, grads)}, step, pulled_at)

    def push_many(self, grads: dict[str, tuple[np.ndarray, np.ndarray]], step: int,
                  pulled_at: int | None = None) -> None:
        """:meth:`push` for several tables at once."""
        step = _check_step("push_many", "step", step)
        pulled_at = step if pulled_at is None else pulled_at
        pulled_at = _check_step("push_many", "pulled_at", pulled_at)
        requests = []
        for name, (ids, g) in grads.items():
            shape = np.shape(ids)
            spec, ids = self._spec(name), self._check_ids(name, ids)
            g = np.asarray(g)
            if g.dtype.kind not in "iuf":
                raise TypeError(f"table {name!r}: gradients of dtype {g.dtype}; give numbers (float32)")
            if g.shape == shape + (spec.dim,):   # ids of any shape: their rows' gradients, flattened alike
                g = g.reshape(len(ids), spec.dim)
            g = g.astype(np.float32)
            if g.shape != (len(ids), spec.dim):
                flat = f" or [{len(ids)}, {spec.dim}]" if len(shape) != 1 else ""
                raise ValueError(f"table {name!r}: gradients of shape {list(g.shape)} for ids of shape "
                                 f"{list(shape)}; expected {list(shape) + [spec.dim]}{flat}")
            owner = spec.owner(ids, len(self.addresses))
            for s in range(len(self.addresses)):
                where = owner == s
                requests.append((s, {"op": "push", "table": name, "step": step, "worker": self.worker,
                                     "pulled_at": pulled_at}, (ids[where], g[where])))
        replies = self._call(requests, table=",".join(grads))
        stale: dict[str, int] = {}  # the servers' measure (those that got rows); one count per
        for (_, header, _), (reply, _) in zip(requests, replies):  # push and table: its oldest rows
            if "staleness" in reply:
                stale[header["table"]] = max(stale.get(header["table"], 0), int(reply["staleness"]))
        for s in stale.values():
            self._record_staleness(s)
        with self._lock:
            self._stats["pushes"] += 1
            self._stats["rows_pushed"] += sum(int(np.prod(np.shape(i))) for i, _ in grads.values())
            self._stats["rejected"] += any(h.get("status") == "rejected" for h, _ in replies)

    def save(self, step: int) -> None:
        """Makes every server snapshot its shards at clock ``step`` (call it where the workers'
        orbax checkpoint of step ``step`` is written)."""
        step = _check_step("save", "step", step)
        self._call([(s, {"op": "save", "step": step}, ()) for s in range(len(self.addresses))], table="*")

    def restore(self, step: int) -> None:
        """Brings every server back to its snapshot of ``step`` (after the workers restored
        their orbax checkpoint of ``step``); a server already at ``step`` keeps its state."""
        step = _check_step("restore", "step", step)
        self._call([(s, {"op": "restore", "step": step}, ()) for s in range(len(self.addresses))], table="*")

    def next_step(self) -> int:
        """The step the servers expect this worker to push next: where a killed and restarted
        worker rejoins (the step it was killed in had not been pushed, so it is done again).

        Example:
            >>> step = client.next_step()  # doctest: +SKIP
        """
        replies = self._call([(s, {"op": "stats"}, ()) for s in range(len(self.addresses))], table="*")
        return min((st["done"][self.worker] for h, _ in replies for st in h["tables"].values()), default=0)

    def stats(self) -> dict[str, Any]:
        """This worker's counters and, per table, the servers' summed counters: the staleness
        histogram (pushes per staleness, one count per server a push reached), rejected pushes,
        the clock, rows pushed; and the number of server restarts."""
        replies = self._call([(s, {"op": "stats"}, ()) for s in range(len(self.addresses))], table="*")
        tables: dict[str, Any] = {}
        for header, _ in replies:
            for name, st in header["tables"].items():
                t = tables.setdefault(name, {"clock": st["clock"], "rejected": 0, "rows_pushed": 0,
                                             "staleness_histogram": {}})
                t["clock"] = min(t["clock"], st["clock"])
                t["rejected"] += st["rejected"]
                t["rows_pushed"] += st["rows_pushed"]
                for k, v in st["staleness_histogram"].items():
                    t["staleness_histogram"][int(k)] = t["staleness_histogram"].get(int(k), 0) + v
        with self._lock:
            worker = {**self._stats, "staleness": dict(sorted(self._stats["staleness"].items()))}
        return {"worker": worker, "tables": tables,
                "server_restarts": sum(h["restarts"] for h, _ in replies)}

    def close(self) -> None:
        """Closes the sockets (any thread's) and the context."""
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- checks -------------------------------------------------------------------------------

    def _spec(self, name: str) -> TableSpec:
        if name not in self.tables:
            raise ValueError(f"unknown table {name!r}; this client's tables are {sorted(self.tables)}")
        return self.tables[name]

    def _check_ids(self, name: str, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"table {name!r}: ids of dtype {ids.dtype}; row ids must be integers "
                            "(cast with ids.astype(np.int64) if they hold whole numbers)")
        ids = ids.reshape(-1).astype(np.int64)
        rows = self.tables[name].rows
        bad = (ids < 0) | (ids >= rows)
        if bad.any():
            raise ValueError(f"table {name!r}: {int(bad.sum())} ids outside [0, {rows}), e.g. "
                             f"{int(ids[bad][0])} (ids seen span [{int(ids.min())}, {int(ids.max())}])")
        return ids

    def _record_staleness(self, stale: int) -> None:
        with self._lock:
            h = self._stats["staleness"]
            h[stale] = h.get(stale, 0) + 1

    # -- transport ----------------------------------------------------------------------------

    def _sockets(self) -> list:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = []
            for address in self.addresses:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if address.startswith("["):       # "[::1]:PORT": IPv6
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(f"tcp://{address}")
                socks.append(sock)
            self._local.socks = socks
        return socks

    def _call(self, requests: list[tuple[int, dict, tuple]], table: str) -> list[tuple[dict, list]]:
        """Sends every request, waits for every reply (resending), in request order."""
        socks = self._sockets()
        frames = {}
        for k, (s, header, arrays) in enumerate(requests):
            rid = f"{self.worker}-{next(self._rids)}"
            frames[rid] = (k, s, encode({**header, "rid": rid, "token": self._token}, arrays))
        replies: list = [None] * len(requests)
        deadline = time.monotonic() + self.timeout
        while frames:
            for k, s, f in frames.values():
                socks[s].send_multipart(f)
            self._collect(socks, frames, replies, min(deadline, time.monotonic() + self.resend))
            if frames and time.monotonic() >= deadline:
                k, s, _ = next(iter(frames.values()))
                op = requests[k][1]["op"]
                raise TimeoutError(f"parameter server {self.addresses[s]} did not answer {op!r} on table "
                                   f"{requests[k][1].get('table', table)!r} within timeout={self.timeout} s; is it running, "
                                   "is the address right, and (sync) did every worker push the previous step?")
        return replies

    def _collect(self, socks, frames, replies, until: float) -> None:
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while frames and (left := until - time.monotonic()) > 0:
            for sock, _ in poller.poll(left * 1000):
                header, arrays = decode(sock.recv_multipart())
                entry = frames.pop(header.get("rid"), None)
                if entry is None:
                    continue  # the answer to a request sent again and already answered
                if not header.get("ok"):
                    error = header.get("error", "unknown error")
                    kind = PermissionError if "token" in error else ValueError
                    raise kind(f"parameter server {self.addresses[entry[1]]}: {error}")
                replies[entry[0]] = (header, arrays)


def _check_step(call: str, name: str, value: Any) -> int:
    """``value`` as a JSON int; ``ValueError`` unless it is a whole number >= 0."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 0:
        raise ValueError(f"{call}: {name}={value!r} must be a worker step, an int >= 0 "
                         "(ServerRows numbers them from client.next_step())")
    return int(value)


def connect(tables: Sequence[TableSpec], *, mode: str = "sync", staleness: int = 0,
            addresses: Sequence[str] | None = None, token: str | None = None, timeout: float = 30.0,
            worker: int | None = None, workers: int | None = None) -> Client:
    """Connects this worker to the parameter servers and declares the job's tables.

    Args:
        tables: the ``TableSpec`` of every table (servers create their shards on first sight).
        mode: ``"sync"`` (equal to training the tables in-process) or ``"async"``.
        staleness: async's bound τ: a pull at step t waits for the updates through t-τ-1.
        addresses: ``host:port`` of each server by index (default: ``$JAXPAR_PS_ADDRESSES``).
        token: the job token (default: ``$JAXPAR_PS_TOKEN``).
        timeout: seconds any call may take before it raises ``TimeoutError``.
        worker, workers: this worker's index and the worker count (default: the
            ``jax.process_index()`` / ``jax.process_count()`` of a jax.distributed job).

    Example:
        >>> client = jaxpar.ps.connect([spec], addresses=["127.0.0.1:5555"], token="t")  # doctest: +SKIP
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"connect: mode={mode!r}; use 'sync' or 'async'")
    if (not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0
            or (mode == "sync" and staleness)):
        raise ValueError(f"connect: staleness={staleness!r} with mode={mode!r}; staleness is an integer >= 0, "
                         "and 0 in sync mode (use mode='async' for a bound > 0)")
    tables = list(tables)
    names = [t.name for t in tables]
    if not tables or len(set(names)) != len(names) or not all(isinstance(t, TableSpec) for t in tables):
        raise ValueError(f"connect: tables={names!r}; give one or more TableSpec with distinct names")
    addresses = list(addresses) if addresses is not None else [
        a for a in os.environ.get(ADDRESSES_ENV, "").split(",") if a]
    if not addresses:
        raise ValueError(f"connect: no server addresses; pass addresses=[...] or set {ADDRESSES_ENV}")
    for address in addresses:
        host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"connect: server address {address!r} is not HOST:PORT with a port in 1..65535 "
                             "(e.g. '127.0.0.1:5555', '[::1]:5555'); the servers print theirs when ready")
    # any real number (a numpy scalar of any width too), not a bool
    if (not isinstance(timeout, numbers.Real) or isinstance(timeout, (bool, np.bool_))
            or not 0 < float(timeout) < math.inf):
        raise ValueError(f"connect: timeout={timeout!r} must be a positive finite number of seconds "
                         "(e.g. timeout=30.0)")
    timeout = float(timeout)
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"connect: no job token; pass token=... or set {TOKEN_ENV}")
    if worker is None or workers is None:
        import jax

        worker = jax.process_index() if worker is None else worker
        workers = jax.process_count() if workers is None else workers
    if not 0 <= worker < workers:
        raise ValueError(f"connect: worker={worker} must be in [0, workers={workers})")
    return Client(tables, mode=mode, staleness=staleness, addresses=addresses, token=token,
                  timeout=timeout, worker=worker, workers=workers)
