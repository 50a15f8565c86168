"""The replica-group coordinator: a ZeroMQ ROUTER that averages gradients over live groups.

    JAXPAR_REPLICAS_TOKEN=... python -m jaxpar.ps.replica_server --groups 3 --bind 0.0.0.0:5600

prints ``jaxpar-replicas ready HOST:PORT`` once it serves and exits 0 on SIGTERM. Each group's
processes connect with `jaxpar.ps.replicas.connect` (docs/reliability.md, "Replica groups").
One thread: requests are handled in arrival order (`jaxpar.ps.quorum.Quorum`), and every
``--timeout / 10`` seconds (and after the requests that came meanwhile) the groups whose beats
lapsed are dropped. It keeps no training state: after a restart of the coordinator, restart the
groups too (their requests are refused); they resume from their checkpoints and join anew.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import zmq

from jaxpar.ps.quorum import Quorum
from jaxpar.ps.server import MAX_ERROR_CHARS, listen, send_error, send_reply
from jaxpar.ps.wire import WireError, decode, reply_rid, show, token_ok

TOKEN_ENV = "JAXPAR_REPLICAS_TOKEN"
ADDRESS_ENV = "JAXPAR_REPLICAS_ADDRESS"
GROUP_ENV = "JAXPAR_REPLICA_GROUP"
READY = "jaxpar-replicas ready"


def serve(quorum: Quorum, sock: zmq.Socket, bind: str, token: str, stop: list) -> None:
    """Answers requests on ``sock`` until ``stop`` holds something (SIGTERM appends to it)."""
    print(f"{READY} {bind}", flush=True)
    tick = max(0.01, min(0.1, quorum.timeout / 10))
    while not stop:
        if sock.poll(int(tick * 1000)):
            for _ in range(10_000):    # the requests that came meanwhile (beats too) before the drop check
                identity, *frames = sock.recv_multipart()
                _send_all(sock, receive(quorum, identity, frames, token, bind))
                if not sock.poll(0):
                    break
        _send_all(sock, quorum.tick())


def receive(quorum: Quorum, identity: bytes, frames: list[bytes], token: str, bind: str) -> list:
    """The replies one received message (any bytes at all) causes; a bad one gets an error reply."""
    try:
        header, arrays = decode(frames)
    except WireError as e:
        return [(identity, {"rid": None, "ok": False, "error": f"malformed message: {e}"}, ())]
    rid = reply_rid(header)
    if not token_ok(header, token):
        return [(identity, {"rid": rid, "ok": False,
                            "error": f"wrong job token: coordinator {bind} refused the request ({TOKEN_ENV} differs)"}, ())]
    header["rid"] = rid
    try:
        return quorum.handle(identity, header, arrays)
    except ValueError as e:
        return [(identity, {"rid": rid, "ok": False, "error": str(e)}, ())]
    except Exception as e:   # noqa: BLE001 - one bad request never stops the mean
        print(f"request {show(header.get('op'))} failed: {type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}",
              file=sys.stderr, flush=True)
        return [(identity, {"rid": rid, "ok": False, "error": f"the coordinator could not handle this request "
                            f"({type(e).__name__}; its log has the detail)"}, ())]


def _send_all(sock, replies: list) -> None:
    for identity, fields, arrays in replies:
        fields = dict(fields)
        rid = fields.pop("rid", None)
        if fields.get("ok", True) is False:
            send_error(sock, identity, rid, fields["error"])
        else:
            send_reply(sock, identity, rid, {"ok": True, **fields}, arrays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar.ps.replica_server", description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, required=True, help="replica groups expected at the start")
    parser.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback by default)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds without a beat after which a group is dropped from the mean (default 10)")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds after the first join to start with the groups there, if not all --groups "
                             "joined (default 300)")
    args = parser.parse_args(argv)
    if args.groups < 1:
        parser.error(f"--groups {args.groups} must be an integer >= 1 (the replica groups of the job)")
    for name in ("timeout", "start_timeout"):
        value = getattr(args, name)
        if not value > 0 or value == float("inf"):
            parser.error(f"--{name.replace('_', '-')} {value} must be a positive number of seconds")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        parser.error(f"set the job token in the environment variable {TOKEN_ENV} (never on the command line)")
    try:
        ctx, sock, bind = listen(args.bind)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    stop: list = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        serve(Quorum(args.groups, args.timeout, args.start_timeout), sock, bind, token, stop)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
