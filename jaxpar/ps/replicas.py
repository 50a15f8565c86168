"""Replica groups: data-parallel copies of one job that keep training when one of them dies.

Each group is its own ``jax.distributed`` job (one process or many) with its own mesh; the
groups train the same model on different rows, and every step they average their gradients
through a coordinator (`jaxpar.ps.replica_server`) over the parameter server's wire. A group
that dies is dropped from the mean after ``--timeout`` seconds without a beat, and the others
step on; restarted, it gets a live group's state at the end of the next step and is in the
mean from the step after. The groups' parameters are bit-identical throughout.

``ReplicaGroup`` is one process's connection; give it to the Trainer as
``Placement(replicas=jaxpar.ps.replicas.connect())`` (`jaxpar.train.replicas` does the rest).

>>> group = jaxpar.ps.replicas.connect(address="127.0.0.1:5600", group=1, token="t")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import zmq

from jaxpar.ps.replica_server import ADDRESS_ENV, GROUP_ENV, TOKEN_ENV
from jaxpar.ps.wire import decode, encode


class ReplicaGroup:
    """This process's link to the coordinator: rank ``rank`` of ``ranks`` processes of group ``group``.

    ``timeout``: seconds a request may wait for its answer (a join waits for the other groups at
    the start, or for a live group's state; an average for the slowest group's step);
    ``beat_every``: seconds between beats, from a thread of its own, so a long compile is not
    taken for a death (keep it well under the coordinator's ``--timeout``).
    """

    def __init__(self, address: str, group: int, *, token: str, rank: int, ranks: int,
                 timeout: float = 600.0, beat_every: float = 1.0, incarnation: str | None = None):
        self.address, self.group, self.rank, self.ranks = address, group, rank, ranks
        self.timeout, self.beat_every = timeout, beat_every
        # this start of the group: the same on its every process (`connect` agrees on it)
        self.incarnation = incarnation or uuid.uuid4().hex
        self._token = token
        self._ctx = zmq.Context()
        self._sock = self._socket()
        self._rids = itertools.count()
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self.joined = False            # its join was answered (close() then says it leaves)
        self.donate = False            # the last average asked this group for its state
        self.groups: list[int] = []    # the groups of the last mean
        self.wait_s = 0.0              # time spent in averages (transfer and waiting for the others)

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.address.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://{self.address}")
        return sock

    def _call(self, header: dict, arrays: tuple = (), *, sock=None, timeout: float | None = None) -> tuple[dict, list]:
        sock = self._sock if sock is None else sock
        rid = f"{self.group}.{self.rank}-{next(self._rids)}"
        sock.send_multipart(encode({**header, "group": self.group, "rank": self.rank,
                                    "incarnation": self.incarnation, "token": self._token, "rid": rid}, arrays))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(min(left, 1.0) * 1000):
                continue
            reply, out = decode(sock.recv_multipart())
            if reply.get("rid") != rid:
                continue            # an answer to an earlier request given up on
            if not reply.get("ok"):
                error = reply.get("error", "unknown error")
                raise (PermissionError if "token" in error else RuntimeError)(
                    f"replica coordinator {self.address} (group {self.group}, rank {self.rank}): {error}")
            return reply, out
        raise TimeoutError(f"replica coordinator {self.address} did not answer {header['op']!r} of group {self.group} "
                           f"rank {self.rank} within timeout={self.timeout} s; is it running (python -m "
                           "jaxpar.ps.replica_server), is the address right, did the other groups start?")

    # ------------------------------------------------------------------ the protocol
    def join(self, step: int, layout: str, digest: str = "") -> tuple[bool, int, Any, list[np.ndarray]]:
        """Joins the mean at ``step`` with a state of ``layout`` (and ``digest``, a fingerprint of
        its values: founders that differ from the first take its state); returns ``(healed, step,
        data, arrays)``: whether a live group's state (its shards for this rank, its step and
        data position) came back to replace this one's. Beats start here."""
        self._start_beats()
        reply, arrays = self._call({"op": "join", "ranks": self.ranks, "layout": layout, "step": int(step),
                                    "digest": digest})
        self.joined = True
        return bool(reply.get("heal")), int(reply["step"]), reply.get("data"), arrays

    def loader_process(self, groups: int):
        """The rows of each global batch this process reads when ``groups`` groups split it (a
        `jaxpar.data.LoaderProcess` for `jaxpar.data.TokenLoader`): every group's loader reads
        the same global batches, so a healed group's data position, taken from its donor, is its own."""
        from jaxpar.data import LoaderProcess

        if not isinstance(groups, int) or isinstance(groups, bool) or groups <= self.group:
            raise ValueError(f"ReplicaGroup.loader_process: groups={groups!r} must be an int above this group's "
                             f"number {self.group} (the job's group count)")
        return LoaderProcess(index=self.group * self.ranks + self.rank, count=groups * self.ranks)

    def average(self, step: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The mean of ``arrays`` over the live groups' rank ``rank`` for ``step``; sets
        ``donate`` when this group must send its state after the step (`send_state`)."""
        start = time.perf_counter()
        reply, out = self._call({"op": "average", "step": int(step)}, tuple(arrays))
        self.wait_s += time.perf_counter() - start
        self.donate, self.groups = bool(reply.get("donate")), list(reply.get("groups", ()))
        return out

    def send_state(self, step: int, arrays: list[np.ndarray], data: Any) -> None:
        """This rank's shards of the state after ``step`` (and the data position), for the groups
        that heal from it."""
        self._call({"op": "state", "step": int(step), "data": data}, tuple(arrays))
        self.donate = False

    def stats(self) -> dict[str, Any]:
        """The coordinator's view: its step, members, groups joining, and its recent events."""
        reply, _ = self._call({"op": "stats"})
        return {k: reply[k] for k in ("step", "members", "joining", "history")}

    # ------------------------------------------------------------------ beats and the end
    def _start_beats(self) -> None:
        if self._beats is None:
            self._beats = threading.Thread(target=self._beat_loop, name=f"jaxpar-replicas-beat-{self.group}",
                                           daemon=True)
            self._beats.start()

    def _beat_loop(self) -> None:
        sock = self._socket()          # a socket of its own: a request never waits behind a beat
        try:
            while not self._stop.wait(self.beat_every):
                sock.send_multipart(encode({"op": "beat", "group": self.group, "rank": self.rank,
                                            "incarnation": self.incarnation, "token": self._token}))
                while sock.poll(0):
                    sock.recv_multipart()       # (a dropped group learns it at its next request)
        finally:
            sock.close()

    def close(self) -> None:
        """Leaves the mean (the others stop waiting for this group at once) and stops beating."""
        if self._sock.closed:
            return
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5)
        if self.joined:
            try:
                self._call({"op": "leave"}, timeout=5.0)
            except (TimeoutError, RuntimeError):
                pass       # the coordinator is gone, or dropped this group already: nothing waits for it
        self.joined = False
        self._sock.close()
        self._ctx.term()

    def __repr__(self) -> str:
        return f"ReplicaGroup(group={self.group}, rank={self.rank}/{self.ranks}, coordinator={self.address})"


def connect(address: str | None = None, group: int | None = None, *, token: str | None = None,
            timeout: float = 600.0, beat_every: float = 1.0) -> ReplicaGroup:
    """This process's `ReplicaGroup`: the coordinator's ``address`` (``HOST:PORT``; default
    ``$JAXPAR_REPLICAS_ADDRESS``), this job's ``group`` number (default ``$JAXPAR_REPLICA_GROUP``)
    and the job ``token`` (default ``$JAXPAR_REPLICAS_TOKEN``). The rank and rank count are this
    ``jax.distributed`` job's process index and count; in a job of several processes every
    process must call it (they agree on this start's name). Nothing is sent before the Trainer joins."""
    import jax

    address = os.environ.get(ADDRESS_ENV) if address is None else address
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"jaxpar.ps.replicas.connect: address={address!r} must be the coordinator's HOST:PORT "
                         f"(as python -m jaxpar.ps.replica_server printed it); pass address= or set {ADDRESS_ENV}")
    if group is None:
        text = os.environ.get(GROUP_ENV, "")
        if not text.isdigit():
            raise ValueError(f"jaxpar.ps.replicas.connect: no group given and {GROUP_ENV}={text!r} is not a group "
                             f"number; pass group= (0, 1, ...) or set {GROUP_ENV} for each group's job")
        group = int(text)
    if not isinstance(group, int) or isinstance(group, bool) or group < 0:
        raise ValueError(f"jaxpar.ps.replicas.connect: group={group!r} must be an int >= 0 (this job's replica group)")
    token = os.environ.get(TOKEN_ENV) if token is None else token
    if not token:
        raise ValueError(f"jaxpar.ps.replicas.connect: no job token; pass token= or set {TOKEN_ENV} (the "
                         "coordinator's)")
    for name, value in (("timeout", timeout), ("beat_every", beat_every)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"jaxpar.ps.replicas.connect: {name}={value!r} must be a positive number of seconds")
    incarnation = None
    if jax.process_count() > 1:       # process 0's name for this start, on every process
        from jax.experimental import multihost_utils

        mine = np.frombuffer(uuid.uuid4().bytes, np.uint32)
        incarnation = np.asarray(multihost_utils.broadcast_one_to_all(mine)).tobytes().hex()
    return ReplicaGroup(address, group, token=token, rank=jax.process_index(), ranks=jax.process_count(),
                        timeout=float(timeout), beat_every=float(beat_every), incarnation=incarnation)


__all__ = ["ReplicaGroup", "connect"]
