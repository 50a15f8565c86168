"""A parameter server process: a ZeroMQ ROUTER that owns one shard of every table.

    JAXPAR_PS_TOKEN=... python -m jaxpar.ps.server --index 0 --count 2 \\
        --bind 127.0.0.1:5555 --checkpoint-dir /tmp/ps

prints ``jaxpar-ps-server ready 127.0.0.1:5555`` once it serves, exits 0 on SIGTERM after a
final checkpoint, and, started again with the same arguments, restores ``state.npz`` and
replays ``wal.bin`` before serving. One thread: requests are handled in arrival order, and a
pull (or a save) that may not be answered yet waits in a list re-examined after every push.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from typing import Any

import numpy as np
import zmq

from jaxpar.ps.shard import TableShard
from jaxpar.ps.store import (StoreError, WriteAheadLog, commit_snapshot, finish_commit, read_state, server_dir,
                             write_state)
from jaxpar.ps.tables import TableSpec
from jaxpar.ps.wire import (MAX_FRAME_BYTES, READY, TOKEN_ENV, WireError, decode, encode, reply_rid, show,
                            token_ok)

# An error reply carries at most this many characters of message (an exception's text may quote
# a received value at length, e.g. int() of a 60 KiB string).
MAX_ERROR_CHARS = 2000


class Server:
    """The state and request handlers of one server (no sockets: testable in-process)."""

    def __init__(self, index: int, count: int, checkpoint_dir: str, every: int = 10):
        self.index, self.count, self.every = index, count, every
        self.dir = server_dir(checkpoint_dir, index, count)
        self.tables: dict[str, TableShard] = {}
        self.job: dict[str, Any] | None = None
        self.last_checkpoint = 0
        self.restarts = 0
        # The step snapshots (step-S.npz) of the current history: one of another history (written
        # before a restore to an earlier step) is replaced when the same step is saved again.
        self.snapshots: set[int] = set()
        self._recover()

    # -- durable state ------------------------------------------------------------------------

    def _recover(self) -> None:
        state = self.dir / "state.npz"
        if state.exists():
            finish_commit(self.dir, self._load(state))
            self.restarts = self.job.get("restarts", 0) + 1
        checkpoint_clocks = {name: shard.clock for name, shard in self.tables.items()}
        self.wal = WriteAheadLog(self.dir / "wal.bin")   # (verified; an incomplete last record cut off)
        if self.wal.dropped:
            at, size = self.wal.dropped
            print(f"{self.wal.path}: dropped an incomplete last record ({size} bytes at byte {at}): a push "
                  "cut short by a kill while it was logged, never acknowledged; its worker sends it again",
                  file=sys.stderr, flush=True)
        try:
            for header, arrays in self.wal.replay():
                self._push(header, arrays)
        except BaseException:
            self.wal.close()
            raise
        for name, clock in checkpoint_clocks.items():  # the pulls served since the checkpoint
            self.tables[name].pulls_lost(clock)

    def _load(self, path) -> dict[str, Any]:
        arrays, meta = read_state(path)
        self.job = meta["job"]
        self.snapshots = set(meta.get("snapshots", ()))
        self.tables = {}
        for name, tmeta in meta["tables"].items():
            shard = self._new_shard(TableSpec.from_json(tmeta["spec"]))
            shard.load(name, arrays, tmeta)
            self.tables[name] = shard
        self.last_checkpoint = self._clock()
        return meta

    def _new_shard(self, spec: TableSpec) -> TableShard:
        return TableShard(spec, self.index, self.count, self.job["mode"], self.job["staleness"],
                          self.job["workers"])

    def _clock(self) -> int:
        return min((t.clock for t in self.tables.values()), default=0)

    def checkpoint(self, snapshot: int | None = None) -> None:
        """Writes every table (atomically) and starts a new write-ahead log; with ``snapshot=S``,
        also the snapshot ``step-S.npz``, committed with the state that lists it."""
        arrays: dict[str, np.ndarray] = {}
        for name, shard in self.tables.items():
            arrays.update(shard.arrays(name))
        meta = {"job": {**(self.job or {}), "restarts": self.restarts},
                "tables": {n: s.meta() for n, s in self.tables.items()}, "snapshots": sorted(self.snapshots)}
        if snapshot is None:
            write_state(self.dir / "state.npz", arrays, meta)
        else:
            commit_snapshot(self.dir, snapshot, arrays, meta)
        self.wal.truncate()
        self.last_checkpoint = self._clock()

    # -- requests -----------------------------------------------------------------------------

    def handle(self, header: dict[str, Any], arrays: list[np.ndarray]) -> tuple[dict, tuple] | None:
        """The reply to one request, or ``None`` when it must wait (a pull or save ahead of the
        clock). Bad requests raise ``ValueError``."""
        op = header.get("op")
        handler = {"hello": self._hello, "pull": self._pull, "push": self._push_logged,
                   "save": self._save, "restore": self._restore, "stats": self._stats,
                   "ping": lambda h, a: ({}, ())}.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError(f"unknown operation {show(op)}")
        return handler(header, arrays)

    def _hello(self, header, arrays):
        job = {k: header.get(k) for k in ("mode", "staleness", "workers")}
        if (job["mode"] not in ("sync", "async") or not _count(job["staleness"], 0)
                or not _count(job["workers"], 1)):
            raise ValueError(f"hello: mode={show(job['mode'])}, staleness={show(job['staleness'])}, "
                             f"workers={show(job['workers'])}; expected 'sync' or 'async', an integer "
                             ">= 0 and an integer >= 1")
        if self.job is not None and {k: self.job[k] for k in job} != job:
            raise ValueError(f"this server serves a job with {self.job}; the client asks for {job}")
        fresh = self.job is None
        self.job = {**job, "restarts": self.restarts}
        tables = header.get("tables")
        if not isinstance(tables, list):
            raise ValueError(f"hello: tables={show(tables)}; expected a JSON array of table descriptions "
                             "(TableSpec.to_json())")
        specs = [_spec(d) for d in tables]   # every one checked before any is created
        for spec in specs:
            if spec.name in self.tables and self.tables[spec.name].spec != spec:
                raise ValueError(f"table {spec.name!r} exists here as {self.tables[spec.name].spec}; "
                                 f"the client asks for {spec}")
            if spec.name not in self.tables:
                self.tables[spec.name] = self._new_shard(spec)
                fresh = True
        if fresh:  # a restart must find the tables even before the first push
            self.checkpoint()
        return {"clock": self._clock(), "restarts": self.restarts}, ()

    def _table(self, header) -> TableShard:
        name = header.get("table")
        if not isinstance(name, str) or name not in self.tables:
            raise ValueError(f"unknown table {show(name)}; this server holds {sorted(self.tables)}")
        return self.tables[name]

    def _pull(self, header, arrays):
        shard = self._table(header)
        step = _field(header, "step")
        if len(arrays) != 1:
            raise ValueError(f"a pull carries ids; this one carries {len(arrays)} arrays")
        if not shard.can_serve(step):
            return None
        rows = shard.pull(arrays[0])
        shard.record_pull(header.get("worker"), step)  # what the worker's pushes are measured from
        return {"clock": shard.clock}, (rows,)

    def _push_logged(self, header, arrays):
        if len(arrays) != 2:
            raise ValueError(f"a push carries ids and gradients; this one carries {len(arrays)} arrays")
        shard = self._table(header)
        step, worker = _field(header, "step"), _field(header, "worker")
        pulled_at = _field(header, "pulled_at") if "pulled_at" in header else step
        shard.check_push(worker, *arrays)  # nothing bad reaches the log
        # The clock the rows were read at is this server's record of the worker's pull, never a
        # number the client sends: the log keeps it, so a replay takes the same decision.
        read = shard.read_clock(worker, step, pulled_at, len(arrays[0]))
        logged = {"op": "push", "table": shard.spec.name, "step": step, "worker": worker, "read_clock": read}
        self.wal.append(encode(logged, tuple(arrays)))
        status = self._push(logged, arrays)
        if self._clock() >= self.last_checkpoint + self.every:
            self.checkpoint()
        fields = {"status": status}
        if len(arrays[0]) and status != "duplicate":
            fields["staleness"] = max(0, step - read)
        return fields, ()

    def _push(self, header, arrays) -> str:
        ids, grads = arrays
        return self._table(header).push(int(header["step"]), int(header["worker"]),
                                        int(header.get("read_clock", header["step"])), ids, grads)

    def _save(self, header, arrays):
        step = _field(header, "step")
        if self._clock() < step:
            return None
        path = self.dir / f"step-{step}.npz"
        if step not in self.snapshots or not path.exists():  # (several workers ask for each snapshot)
            # committed with a state.npz that lists it: a restart never writes it again
            self.snapshots.add(step)
            try:
                self.checkpoint(snapshot=step)
            except BaseException:
                self.snapshots.discard(step)
                raise
        return {"clock": self._clock()}, ()

    def _restore(self, header, arrays):
        step = _field(header, "step")
        # Snapshots of later steps belong to the history this restore leaves: a save of one of
        # those steps in the new history writes it again (their files stay for a restore to them).
        later = {s for s in self.snapshots if s > step}
        if self.tables and all(t.clock == step for t in self.tables.values()):
            if later:
                self.snapshots -= later
                self.checkpoint()
            return {"clock": step, "restored": False}, ()  # already there (another worker asked)
        path = self.dir / f"step-{step}.npz"
        if not path.exists():
            have = sorted(int(p.stem[5:]) for p in self.dir.glob("step-*.npz"))
            raise ValueError(f"server {self.index}: no shard snapshot of step {step} in {self.dir}; "
                             f"snapshots: {have}")
        kept = self.snapshots - later
        self._load(path)
        self.snapshots = kept | {step}
        for shard in self.tables.values():  # the workers pull again from the restored rows
            shard.clear_pulls()
        self.checkpoint()
        return {"clock": self._clock(), "restored": True}, ()

    def _stats(self, header, arrays):
        return {"tables": {n: s.stats() for n, s in self.tables.items()},
                "restarts": self.restarts}, ()


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < (1 << 31)


def _field(header: dict[str, Any], name: str) -> int:
    """A request's ``step`` / ``worker`` / ``pulled_at``: an integer >= 0, or ``ValueError``
    naming the operation, the field and the value received."""
    value = header.get(name)
    if not _count(value, 0):
        got = "is missing" if name not in header else f"is {show(value)}"
        raise ValueError(f"malformed {show(header.get('op'))} request: field {name!r} {got}; expected an "
                         f"integer in [0, 2**31) ({'a worker index' if name == 'worker' else 'a worker step'})")
    return value


_SPEC_FIELDS = ("name", "rows", "dim", "optimizer", "partition", "init_scale", "seed")


def _spec(d: Any) -> TableSpec:
    """A table of a hello request (``TableSpec.to_json()``); a malformed one raises ``ValueError``
    naming what is wrong."""
    if not isinstance(d, dict):
        raise ValueError(f"malformed 'hello' request: a table description is {show(d)}; expected a JSON object "
                         "(TableSpec.to_json())")
    missing = [k for k in _SPEC_FIELDS if k not in d]
    opt = d.get("optimizer")
    if missing or not isinstance(opt, dict) or not isinstance(opt.get("kind"), str):
        raise ValueError(f"malformed 'hello' request: table {show(d.get('name'))} lacks fields {missing} or an "
                         f"optimizer object with a 'kind' (got optimizer={show(opt)}); send TableSpec.to_json()")
    bad = [k for k in ("rows", "dim") if not _count(d[k], 1)]
    if bad:
        raise ValueError(f"malformed 'hello' request: table {show(d.get('name'))}: "
                         + ", ".join(f"{k}={show(d[k])}" for k in bad) + " must be integers >= 1")
    try:
        return TableSpec.from_json(d)
    except TypeError:   # an optimizer field the optimizer does not take
        raise ValueError(f"malformed 'hello' request: table {show(d.get('name'))}: optimizer {show(opt['kind'])} "
                         f"does not take the fields {show(sorted(k for k in opt if k != 'kind'))}") from None


def send_reply(sock, identity: bytes, rid: str | int | None, fields: dict, arrays: tuple = ()) -> None:
    """Sends one reply; a reply that cannot be encoded becomes an error reply (``rid`` is a short
    string, an integer or ``None``: that one always encodes)."""
    try:
        frames = encode({"rid": rid, **fields}, arrays)
    except Exception as e:   # noqa: BLE001 - a reply the encoder refuses never kills the server
        print(f"reply to request {show(rid)} not sent: {type(e).__name__}", file=sys.stderr, flush=True)
        frames = encode({"rid": rid, "ok": False, "error": f"the server could not encode its reply: {type(e).__name__}"})
    sock.send_multipart([identity, *frames])


def send_error(sock, identity: bytes, rid: str | int | None, message: str) -> None:
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... (message cut at {MAX_ERROR_CHARS} characters)"
    send_reply(sock, identity, rid, {"ok": False, "error": message})


def bind_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) of ``--bind``, the port in 0..65535 (0: any free port); anything
    else raises ``ValueError`` naming the value."""
    host, _, port = text.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"--bind {text!r} is not HOST:PORT with a port in 0..65535 (0: any free port); "
                         "e.g. --bind 127.0.0.1:5555, 0.0.0.0:5555 (every interface) or [::1]:5555")
    return host, int(port)


def listen(bind: str) -> tuple[zmq.Context, zmq.Socket, str]:
    """A ROUTER socket bound to ``bind`` and the address it got; an address this machine cannot
    listen on raises ``ValueError`` naming it and what to give instead."""
    host, port = bind_address(bind)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # a peer (token or not) cannot make the server buffer more than this per frame
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if host.startswith("["):                     # an IPv6 address, "[::1]:PORT"
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(f"tcp://{host}:{port or '*'}")  # port 0: any free port
    except zmq.ZMQError as e:
        sock.close()
        ctx.term()
        if e.errno == errno.EADDRINUSE:
            fix = (f"port {port} is in use (another server still running?): stop that process, give another "
                   "port, or port 0 for any free one")
        else:
            fix = (f"{host!r} is not an address of this machine: give one of its IP addresses, 127.0.0.1 "
                   "(loopback) or 0.0.0.0 (every interface)")
        raise ValueError(f"--bind {bind!r}: cannot listen there ({os.strerror(e.errno)}); {fix}") from None
    return ctx, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")


def serve(server: Server, ctx: zmq.Context, sock: zmq.Socket, bind: str, token: str) -> None:
    """Answers requests on ``sock`` (bound to ``bind``, from `listen`) until SIGTERM, then
    checkpoints and returns."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print(f"{READY} {bind}", flush=True)
    waiting: list[tuple[bytes, dict, list]] = []
    while not stop:
        if not sock.poll(100):
            continue
        identity, *frames = sock.recv_multipart()
        waiting = receive(server, sock, identity, frames, waiting, token=token, bind=bind)
    server.checkpoint()
    sock.close()
    ctx.term()


def receive(server: Server, sock, identity: bytes, frames: list[bytes], waiting: list, *,
            token: str, bind: str) -> list:
    """Handles one received message (any bytes at all): replies through ``sock`` to every request
    that can be answered now and returns the requests still waiting."""
    try:
        header, arrays = decode(frames)
    except WireError as e:
        send_error(sock, identity, None, f"malformed message: {e}")
        return waiting
    rid = reply_rid(header)  # never echo unbounded client data: a short string, an integer or None
    if not token_ok(header, token):
        send_error(sock, identity, rid,
                    f"wrong job token: server {bind} refused the request ({TOKEN_ENV} differs)")
        return waiting
    header["rid"] = rid
    if rid is not None:  # a resent request replaces the copy of it that waits
        waiting = [w for w in waiting if not (w[0] == identity and w[1]["rid"] == rid)]
    return _answer(server, sock, [*waiting, (identity, header, arrays)])


def _answer(server: Server, sock, waiting: list) -> list:
    """Answers every request that can be answered (a push may unblock pulls); returns the rest."""
    progress = True
    while progress:
        progress, left = False, []
        for identity, header, arrays in waiting:
            try:
                reply = server.handle(header, arrays)
            except ValueError as e:      # (the handlers' checks: a message naming what is wrong)
                send_error(sock, identity, header["rid"], str(e))
                continue
            except Exception as e:   # noqa: BLE001 - one bad request (a step of 1e999, a huge table) never kills the server
                print(f"request {show(header.get('op'))} failed: {type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}",
                      file=sys.stderr, flush=True)
                send_error(sock, identity, header["rid"],
                            f"the server could not handle this {show(header.get('op'))} request ({type(e).__name__}; "
                            "its log has the detail); check the request against the wire format "
                            "(docs/parameter_server.md)")
                continue
            if reply is None:
                left.append((identity, header, arrays))
                continue
            fields, out = reply
            send_reply(sock, identity, header["rid"], {"ok": True, **fields}, out)
            progress = progress or header.get("op") == "push"
        waiting = left
    return waiting


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar.ps.server", description=__doc__.split("\n")[0])
    parser.add_argument("--index", type=int, required=True, help="this server's index, 0 .. count-1")
    parser.add_argument("--count", type=int, required=True, help="number of servers of the job")
    parser.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback by default)")
    parser.add_argument("--checkpoint-dir", required=True, help="where shard checkpoints and the log live")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between shard checkpoints")
    args = parser.parse_args(argv)
    if not 0 <= args.index < args.count:
        parser.error(f"--index {args.index} must be in [0, --count {args.count})")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every {args.checkpoint_every} must be an integer >= 1 (steps between shard "
                     "checkpoints; the write-ahead log covers the steps between)")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        parser.error(f"set the job token in the environment variable {TOKEN_ENV} (never on the command line)")
    try:
        ctx, sock, bind = listen(args.bind)   # first: a busy port leaves the directory untouched
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        server = Server(args.index, args.count, args.checkpoint_dir, args.checkpoint_every)
    except (StoreError, WireError, OSError) as e:   # a damaged log or checkpoint: one line, not a traceback
        sock.close()
        ctx.term()
        if isinstance(e, OSError):
            e = (f"--checkpoint-dir {args.checkpoint_dir!r}: {e.strerror} ({e.filename}); give a directory this "
                 "user can read and write")
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    serve(server, ctx, sock, bind, token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
