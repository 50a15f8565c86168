"""The launchers of a job of several nodes agreeing on each worker group: restarts and shrinking.

On one node the launcher restarts its own workers (``--worker-restarts``). On several nodes a
rank's failure must stop every node's workers, and the group must start again on every node
at once, with the same ranks and the same ``--worker-num``; a node that is gone for good (its
launcher killed, its host lost) must not hold the others forever. Node 0's launcher therefore
serves a small *rendezvous* (torchrun's elastic agent plays this part for PyTorch), and every
launcher, node 0's included, is its client:

1. each launcher **joins** generation ``g`` (0 at first) and waits; one whose ``--worker-num``,
   ``--local-worker-num``, ``--worker-restarts`` or ``--min-workers`` differ from node 0's is
   **refused**, and before the first group starts that ends the job on every node at once
   (status 2, naming the flags), rather than after ``--cluster-time-out``;
2. when every node of the last group has joined (a node that came back while they gathered
   joins too) — or, after a failure, when
   ``--rejoin-time-out`` seconds have passed and the nodes that came back hold at least
   ``--min-workers`` workers — node 0 sends each a **start**: its node index in the new group
   (the order of the nodes' ``--node-rank``), the group's ``worker_num``, the generation;
3. a launcher whose worker fails reports **failed** (or, when a restart cannot help — a worker
   that never joined the cluster, one that left early, a parameter server past its restarts —
   node 0 ends the job at once); a launcher whose connection ends (or that
   sends nothing for ``HEARTBEAT_TIME_OUT`` s: its host is gone) is **lost**. Either way node 0
   sends every node a **stop** for that generation (up to ``--worker-restarts`` times): each
   kills its workers and joins ``g + 1``; past the restarts it sends **end** with the failure's
   status;
4. a launcher whose workers all exit 0 reports **done**; when every node of the group is done,
   node 0 sends **end** with status 0 (and status 1 when some node still runs
   ``--exit-time-out`` s after the first finished: its ranks wait for ones that left);
5. a launcher interrupted by a signal reports **interrupted**: node 0 sends **end** with its
   status, and every node's workers get SIGTERM and ``--kill-time-out`` s to save.

Node 0 beats every second on every connection, as the launchers do towards it: a launcher
that hears nothing for ``HEARTBEAT_TIME_OUT`` s counts node 0's host as gone and ends.

Node 0 cannot be lost: its process 0 is JAX's coordinator, and its launcher this rendezvous.
The wire is one JSON object per line over TCP (nothing is unpickled); a connection that sends
anything else — a malformed or oversized line, an unknown operation — is closed and logged,
and the rendezvous goes on. It listens on the ``--master-addr`` interface, as the coordinator
does, and has no authentication either: keep the port behind a firewall.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable

HEARTBEAT_SECONDS = 1.0
"""How often a launcher tells node 0 that it is alive."""
HEARTBEAT_TIME_OUT = 15.0
"""Seconds of silence after which node 0 counts a node as lost (a host that lost power sends no FIN)."""
MAX_LINE = 64 * 1024
"""Longest line the rendezvous reads; a longer one closes the connection."""
REFUSED_EXIT_CODE = 2
"""Status of every launcher when node 0 refuses a node's launcher before the first group starts (its
flags differ from node 0's): a mistake in how the job was started, as a bad flag is."""


@dataclasses.dataclass(frozen=True)
class Terms:
    """What every node's launcher must agree on (checked when it joins)."""

    worker_num: int
    local_worker_num: int
    worker_restarts: int
    min_workers: int

    @property
    def nodes(self) -> int:
        return self.worker_num // self.local_worker_num


@dataclasses.dataclass(frozen=True)
class Start:
    """Start generation ``generation`` of the worker group: this node is ``index`` of ``nodes``
    (their original ``--node-rank`` values), the group has ``worker_num`` workers."""

    generation: int
    index: int
    nodes: tuple[int, ...]
    worker_num: int


@dataclasses.dataclass(frozen=True)
class End:
    """The job is over: every launcher exits with ``code``."""

    code: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Stop:
    """Node 0 stopped the running group (``final``: the job is over, so the workers get SIGTERM
    and ``--kill-time-out`` seconds to save, rather than SIGKILL at once)."""

    reason: str
    final: bool


class RendezvousError(RuntimeError):
    """The rendezvous refused this node or could not be reached; the message says why."""


class Refused(RendezvousError):
    """Node 0 refused this node's launcher (other flags than node 0's, or another launcher took its
    ``--node-rank``): a mistake in how the launchers were started (exit status 2)."""


def _differences(theirs: dict, ours: dict) -> str:
    """``--worker-num 3 (node 0: 2), ...``: the terms in which a node's launcher differs from node 0's."""
    defaults = theirs["min_workers"] == theirs["worker_num"] and ours["min_workers"] == ours["worker_num"]
    return ", ".join(f"--{name.replace('_', '-')} {theirs[name]} (node 0: {ours[name]})" for name in ours
                     if theirs[name] != ours[name] and not (name == "min_workers" and defaults))


def _send(sock: socket.socket, lock: threading.Lock, message: dict) -> bool:
    data = (json.dumps(message) + "\n").encode()
    with lock:
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False


class _Lines:
    """Reads JSON objects, one per line, from a socket; ``None`` at the end of the stream."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def read(self) -> dict | None:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        if len(line) > MAX_LINE:
            raise ValueError(f"a line longer than {MAX_LINE} bytes")
        message = json.loads(line)
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise ValueError(f"not an object with an 'op': {line[:80]!r}")
        return message


class Server:
    """Node 0's side: decides every generation of the worker group (see the module's docstring).

    ``log(message)`` receives one line per decision. ``rejoin_time_out``: seconds to wait for
    the nodes after a failure; ``first_time_out``: for every node to join the first time.
    """

    def __init__(self, host: str, port: int, terms: Terms, *, first_time_out: float,
                 rejoin_time_out: float, log: Callable[[str], None], exit_time_out: float = 10.0,
                 heartbeat_time_out: float = HEARTBEAT_TIME_OUT):
        self.terms, self.log, self.exit_time_out, self.heartbeat_time_out = terms, log, exit_time_out, heartbeat_time_out
        self._closed = False
        self._accepted: list[socket.socket] = []
        self._first_done: float | None = None
        self.first_time_out, self.rejoin_time_out = first_time_out, rejoin_time_out
        self._cond = threading.Condition()
        self._conns: dict[int, tuple[socket.socket, threading.Lock]] = {}
        self._joined: set[int] = set()
        self._expected: set[int] = set(range(terms.nodes))
        self._members: tuple[int, ...] = ()
        self._done: set[int] = set()
        self._generation = 0
        self._phase = "gathering"
        self._deadline = time.monotonic() + first_time_out
        self._end: End | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self.address = self._listener.getsockname()[:2]
        for target in (self._accept, self._tick):
            threading.Thread(target=target, daemon=True, name=f"jaxpar-rendezvous-{target.__name__}").start()

    # -- connections ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return           # closed
            with self._cond:
                self._accepted = [a for a in self._accepted if a.fileno() != -1] + [sock]
            threading.Thread(target=self._serve, args=(sock,), daemon=True, name="jaxpar-rendezvous-conn").start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(self.heartbeat_time_out)
        lock, lines, node = threading.Lock(), _Lines(sock), None
        why = "its connection ended"
        try:
            while True:
                message = lines.read()
                if message is None:
                    break
                op = message["op"]
                if op == "beat":
                    continue
                if node is None:
                    if op != "join":
                        raise ValueError(f"{op!r} before 'join'")
                    node = self._join(message, sock, lock)
                    if node is None:
                        return
                    continue
                if op == "join":
                    self._rejoin(node)
                elif op in ("failed", "done", "interrupted"):
                    self._report(node, op, message)
                else:
                    raise ValueError(f"an unknown operation {op!r}")
        except socket.timeout:
            why = f"it sent nothing for {self.heartbeat_time_out:g} s"
        except (ValueError, KeyError, TypeError) as err:   # json.JSONDecodeError is a ValueError
            why = f"it sent a bad frame ({err}); closed its connection"
            self.log(f"rendezvous: {'node ' + str(node) if node is not None else 'a connection'}: {why}")
        except OSError as err:
            why = f"its connection failed ({err})"
        finally:
            try:
                sock.close()
            except OSError:
                pass
            if node is not None:
                self._lost(node, sock, why)

    def _join(self, message: dict, sock, lock) -> int | None:
        node = message.get("node")
        theirs, ours = message.get("terms"), dataclasses.asdict(self.terms)
        # terms a launcher sent (not a stray frame) that differ: a launcher of this job started with other flags
        mismatch = isinstance(theirs, dict) and theirs.keys() == ours.keys() and theirs != ours
        in_range = isinstance(node, int) and not isinstance(node, bool) and 0 <= node < self.terms.nodes
        refuse = None
        if mismatch or (in_range and theirs != ours):
            refuse = f"node {node} was started with {_differences(theirs, ours) if mismatch else theirs}; " \
                     "give every node's launcher the same --worker-num, --local-worker-num, --worker-restarts " \
                     "and --min-workers"
        elif not in_range:
            refuse = f"node rank {node!r} is not in 0..{self.terms.nodes - 1} (--node-rank)"
        with self._cond:
            if refuse is not None:
                _send(sock, lock, {"op": "refused", "reason": refuse})
                sock.close()
                if mismatch and self._end is None and self._generation == 0 and self._phase == "gathering":
                    # the first group cannot form without that node: end the job now on every node, not
                    # after --cluster-time-out with "never joined"
                    self._finish(End(REFUSED_EXIT_CODE, f"node 0 refused node {node}: {refuse}"))
                else:
                    self.log(f"rendezvous: refused a launcher: {refuse}")
                return None
            if node in self._conns:        # a restarted launcher, before its old connection timed out
                self.log(f"rendezvous: node {node} joined again on a new connection; the old one is closed")
                _send(*self._conns[node], {"op": "refused", "reason": f"another launcher joined as node {node} "
                                                                       "(a restarted one, or a --node-rank given twice)"})
                try:
                    self._conns[node][0].shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                if self._end is None and self._phase == "running" and node in self._members:
                    self._failed(f"node {node}'s launcher started again", 1)
            self._conns[node] = (sock, lock)
            if self._end is not None:
                _send(sock, lock, {"op": "end", "code": self._end.code, "reason": self._end.reason})
                return node
            self._joined.add(node)
            if self._phase == "running" and node not in self._members:
                self.log(f"rendezvous: node {node} joined while generation {self._generation} runs without it; "
                         "it joins the group at the next restart")
            elif self._generation > 0 and node not in self._expected:
                self.log(f"rendezvous: node {node} is back; it joins generation {self._generation}")
            self._maybe_start()
        return node

    def _rejoin(self, node: int) -> None:
        with self._cond:
            if self._end is not None:
                sock, lock = self._conns[node]
                _send(sock, lock, {"op": "end", "code": self._end.code, "reason": self._end.reason})
                return
            self._joined.add(node)
            self._maybe_start()

    def _report(self, node: int, op: str, message: dict) -> None:
        with self._cond:
            if op == "interrupted" and self._end is None:      # a signal to any launcher ends the job
                code = message.get("code")
                self._finish(End(code if isinstance(code, int) and not isinstance(code, bool) else 1,
                                 f"node {node}: {str(message.get('reason', ''))[:500]}"))
                return
            if message.get("generation") != self._generation or self._phase != "running" \
                    or node not in self._members:
                return                     # about a group that has already ended
            if op == "done":
                self._done.add(node)
                self._first_done = self._first_done or time.monotonic()
                if self._done == set(self._members):
                    self._finish(End(0, f"all {len(self._members)} node(s) finished"))
                return
            code = message.get("code")
            code = code if isinstance(code, int) and not isinstance(code, bool) and code else 1
            reason = f"node {node}: {str(message.get('reason', ''))[:500]}"
            if message.get("final") is True:      # a failure a restart cannot get past
                self._finish(End(code, reason))
            else:
                self._failed(reason, code)

    def _lost(self, node: int, sock, why: str) -> None:
        with self._cond:
            if self._conns.get(node, (None,))[0] is not sock:
                return                     # a connection this node has since replaced
            del self._conns[node]
            self._joined.discard(node)
            if self._end is None and self._phase == "running" and node in self._members and node not in self._done:
                self._failed(f"node {node}'s launcher is gone ({why})", 1)

    # -- decisions (called with the lock held) -------------------------------------------------
    def _failed(self, reason: str, code: int) -> None:
        if self._generation >= self.terms.worker_restarts:
            self._finish(End(code, f"{reason}; no restarts left ({self.terms.worker_restarts}, --worker-restarts)"))
            return
        self._generation += 1
        self._phase = "gathering"
        self._first_done = None
        self._joined -= set(self._members)         # a node that came back late joins the next group
        self._expected = set(self._members) | self._joined
        self._done = set()
        self._deadline = time.monotonic() + self.rejoin_time_out
        self.log(f"rendezvous: {reason}: stopping every node's workers; restart {self._generation} of "
                 f"{self.terms.worker_restarts} (--worker-restarts)")
        self._broadcast({"op": "stop", "generation": self._generation, "reason": reason})

    def _maybe_start(self, timed_out: bool = False) -> None:
        if self._phase != "gathering" or self._end is not None:
            return
        present = sorted(self._joined)
        if self._expected <= self._joined:
            self._launch(tuple(present))          # with any node that came back meanwhile
        elif timed_out:
            workers = len(present) * self.terms.local_worker_num
            missing = sorted(self._expected - self._joined)
            if self._generation == 0:
                self._finish(End(124, f"node(s) {missing} never joined within {self.first_time_out:g} s "
                                      "(--cluster-time-out)"))
            elif 0 in self._joined and workers >= self.terms.min_workers:
                self.log(f"rendezvous: node(s) {missing} did not come back within {self.rejoin_time_out:g} s "
                         f"(--rejoin-time-out): going on with {workers} of {self.terms.worker_num} workers "
                         f"(--min-workers {self.terms.min_workers})")
                self._launch(tuple(present))
            else:
                self._finish(End(1, f"only {workers} worker(s) came back within {self.rejoin_time_out:g} s "
                                    f"(node(s) {missing} did not), fewer than --min-workers "
                                    f"{self.terms.min_workers}"))

    def _launch(self, nodes: tuple[int, ...]) -> None:
        self._members, self._phase, self._done, self._first_done = nodes, "running", set(), None
        worker_num = len(nodes) * self.terms.local_worker_num
        self.log(f"rendezvous: generation {self._generation}: node(s) {list(nodes)}, {worker_num} workers")
        for index, node in enumerate(nodes):
            sock, lock = self._conns[node]
            _send(sock, lock, {"op": "start", "generation": self._generation, "index": index,
                               "nodes": list(nodes), "worker_num": worker_num})

    def _finish(self, end: End) -> None:
        self._end, self._phase = end, "ended"
        self.log(f"rendezvous: the job ends with status {end.code}: {end.reason}")
        self._broadcast({"op": "end", "code": end.code, "reason": end.reason})

    def _broadcast(self, message: dict) -> None:
        for sock, lock in list(self._conns.values()):
            _send(sock, lock, message)

    def _tick(self) -> None:
        beat = time.monotonic()
        while not self._closed:
            time.sleep(0.1)
            with self._cond:
                if time.monotonic() - beat > HEARTBEAT_SECONDS:    # the clients see node 0's host alive
                    beat = time.monotonic()
                    self._broadcast({"op": "beat"})
                if self._end is not None:
                    continue
                if self._phase == "gathering" and time.monotonic() > self._deadline:
                    self._maybe_start(timed_out=True)
                elif self._first_done is not None and time.monotonic() - self._first_done > self.exit_time_out:
                    running = sorted(set(self._members) - self._done)
                    self._finish(End(1, f"node(s) {sorted(self._done)} finished, but node(s) {running} still ran "
                                        f"{self.exit_time_out:g} s later (--exit-time-out): a rank that leaves early "
                                        "leaves the others waiting in a collective; every rank must run the same steps"))

    def end(self, code: int, reason: str) -> None:
        """Ends the job from node 0's side (its launcher was interrupted)."""
        with self._cond:
            if self._end is None:
                self._finish(End(code, reason))

    def close(self, linger: float = 5.0) -> None:
        """Stops serving: after an end, first waits up to ``linger`` s for the launchers to read
        it and leave (a connection closed under unread data may reset before they do)."""
        deadline = time.monotonic() + linger
        while self._end is not None and self._conns and time.monotonic() < deadline:
            time.sleep(0.05)
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._cond:
            for sock in [c for c, _ in self._conns.values()] + self._accepted:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Client:
    """One launcher's side: ``join`` → `Start` or `End`; while its workers run, ``stopped()``
    says whether node 0 has stopped the group; ``failed`` / ``done`` report how it ended."""

    def __init__(self, host: str, port: int, node: int, terms: Terms, *, time_out: float,
                 interrupted: Callable[[], bool] = lambda: False, heartbeat_time_out: float = HEARTBEAT_TIME_OUT):
        deadline = time.monotonic() + time_out
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as err:
                if interrupted():
                    raise RendezvousError("interrupted while reaching node 0's launcher") from None
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"node 0's launcher at {host}:{port} (--rendezvous-port) could not be reached within "
                        f"{time_out:g} s ({err}); start node 0's jaxpar launch, with the same --master-addr and "
                        "--rendezvous-port on every node") from None
                time.sleep(0.5)
        self._sock.settimeout(heartbeat_time_out)     # node 0 beats every second: silence is a lost host
        self.node, self.terms = node, terms
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._inbox: list[dict] = []
        self._closed = False
        self.generation = 0
        self._send({"op": "join", "node": node, "terms": dataclasses.asdict(terms)})
        threading.Thread(target=self._read, daemon=True, name="jaxpar-rendezvous-read").start()
        threading.Thread(target=self._beat, daemon=True, name="jaxpar-rendezvous-beat").start()

    def _send(self, message: dict) -> None:
        _send(self._sock, self._lock, message)

    def _read(self) -> None:
        lines = _Lines(self._sock)
        try:
            while (message := lines.read()) is not None:
                if message["op"] == "beat":
                    continue
                with self._cond:
                    self._inbox.append(message)
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _beat(self) -> None:
        while not self._closed:
            time.sleep(HEARTBEAT_SECONDS)
            self._send({"op": "beat"})

    def _take(self, ops: tuple[str, ...], timeout: float | None) -> dict | None:
        """The first message of one of ``ops`` (older ones of other kinds dropped), waiting up to
        ``timeout`` s; ``None`` on time-out. Raises RendezvousError when node 0 is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                while self._inbox:
                    message = self._inbox.pop(0)
                    if message["op"] == "refused":
                        raise Refused(f"node 0 refused this node: {message.get('reason')}")
                    if message["op"] in ops and (message["op"] != "stop"
                                                 or message.get("generation", 0) > self.generation):
                        return message
                if self._closed:
                    raise RendezvousError("node 0's launcher is gone (its rendezvous connection ended); the "
                                          "job cannot go on without process 0, JAX's coordinator")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.2 if left is None else min(left, 0.2))

    def wait(self, interrupted: Callable[[], bool] = lambda: False) -> Start | End | None:
        """Blocks until node 0 starts a group (`Start`) or ends the job (`End`); ``None`` when
        ``interrupted()`` turned true first."""
        while not interrupted():
            message = self._take(("start", "end"), 0.2)
            if message is None:
                continue
            if message["op"] == "end":
                return End(int(message["code"]), str(message["reason"]))
            self.generation = int(message["generation"])
            return Start(self.generation, int(message["index"]), tuple(message["nodes"]),
                         int(message["worker_num"]))
        return None

    def stopped(self) -> Stop | None:
        """Whether node 0 stopped the running group (or ended the job), or ``None`` while it runs on."""
        message = self._take(("stop", "end"), 0)
        if message is None:
            return None
        if message["op"] == "end":       # put back: wait() reads it next
            with self._cond:
                self._inbox.insert(0, message)
        return Stop(str(message["reason"]), message["op"] == "end")

    def rejoin(self) -> None:
        self._send({"op": "join", "node": self.node})

    def failed(self, code: int, reason: str, final: bool = False) -> None:
        """Reports this node's group failed with ``code``; ``final``: a restart would not get past
        it (a worker that never joined, one that left early, a server past its restarts)."""
        self._send({"op": "failed", "generation": self.generation, "code": code, "reason": reason,
                    "final": final})

    def done(self) -> None:
        self._send({"op": "done", "generation": self.generation})

    def interrupted(self, code: int, reason: str) -> None:
        """This launcher was interrupted (a signal): node 0 ends the job on every node."""
        self._send({"op": "interrupted", "code": code, "reason": reason})

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)     # wakes the reading thread; the peer sees the end
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
