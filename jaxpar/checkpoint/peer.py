"""The local tier's copy on a peer: a small TCP service each process runs, and its client.

Each process of a job with a local tier (`jaxpar.checkpoint.local.LocalTier`) holds its newest
local steps on node-local storage, and sends each one to a peer process on another host, whose
`PeerServer` keeps it under ``peer-<source>/``. When a host is lost, its processes (restarted
elsewhere, or on the same host with its storage wiped) fetch their step back from the peer.

The wire is plain TCP with length-prefixed frames: a JSON header (at most `HEADER_MAX` bytes),
then raw file bytes when the header announces them. Both ends prove they know the job's key
(32 random bytes process 0 drew and every process received) before anything else is read: an
HMAC-SHA256 over its role and both sides' fresh nonces (`_handshake`). The server takes any frame: a wrong key, a malformed or
oversized header, an unknown operation, a file name or number it did not expect, a connection
that stalls or drops — each ends that connection alone (with a reply saying why, where the
peer can still read one); the server goes on. File names on disk are made by the server from
integers it checked, never from what a client sent.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from typing import Any

HEADER_MAX = 1 << 20          # bytes of one JSON header
FILES = ("manifest.json", "shards.bin", "rows.npz")    # what a local step holds (rows.npz: only with row tables)
FILE_MAX = 1 << 40            # bytes of one file
CHUNK = 8 << 20               # bytes read or written at a time
TIMEOUT_S = 120.0             # a connection silent this long is dropped
HANDSHAKE_S = 20.0            # the whole handshake must be done within this
CONNECTIONS = 32              # connections served at once; more are closed at once
_LENGTH = struct.Struct("!Q")


class PeerError(OSError):
    """A peer could not be reached, refused the request, or broke the exchange."""


# ------------------------------------------------------------------ frames
def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{len(out)} of {n} bytes arrived within the time allowed")
        chunk = sock.recv(min(n - len(out), CHUNK))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _send_header(sock: socket.socket, header: dict) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_header(sock: socket.socket) -> dict:
    n, = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if n > HEADER_MAX:
        raise ValueError(f"a header of {n} bytes (at most {HEADER_MAX})")
    header = json.loads(_recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ValueError(f"a header that is a {type(header).__name__}, not an object")
    return header


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, b"jaxpar-peer/" + role + first + second, "sha256").digest()


def _handshake(sock: socket.socket, key: bytes, role: bytes) -> None:
    """Each side sends a fresh nonce, then proves it holds the key with HMAC-SHA256 over its role
    (``b"server"`` or ``b"client"``), the other's nonce and its own. A proof is bound to one role
    and to both nonces, so one side's answer is never the other's (nothing can be reflected back)
    and no answer of an earlier connection fits a later one."""
    deadline = time.monotonic() + HANDSHAKE_S
    mine = secrets.token_bytes(32)
    sock.sendall(mine)
    theirs = _recv_exact(sock, 32, deadline)
    if hmac.compare_digest(theirs, mine):
        raise PermissionError("the other side sent this side's own nonce back")
    other = b"client" if role == b"server" else b"server"
    sock.sendall(_proof(key, role, theirs, mine))
    answer = _recv_exact(sock, 32, deadline)
    if not hmac.compare_digest(answer, _proof(key, other, mine, theirs)):
        raise PermissionError("the other side does not hold the job's key")


def _files_of(directory: str) -> list[dict]:
    return [{"name": name, "size": os.path.getsize(os.path.join(directory, name))}
            for name in FILES if os.path.exists(os.path.join(directory, name))]


def _check_files(files: Any) -> list[tuple[str, int]]:
    if not isinstance(files, list) or not files or len(files) > len(FILES):
        raise ValueError(f"'files' must list 1 to {len(FILES)} files, got {files!r:.200}")
    out = []
    for entry in files:
        name, size = (entry.get("name"), entry.get("size")) if isinstance(entry, dict) else (None, None)
        if name not in FILES or not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= FILE_MAX:
            raise ValueError(f"a file entry {entry!r:.200} (names: {FILES}; sizes: 0 to {FILE_MAX} bytes)")
        out.append((name, size))
    if len({name for name, _ in out}) != len(out) or "manifest.json" not in dict(out):
        raise ValueError(f"'files' must name manifest.json once and no file twice, got {[n for n, _ in out]}")
    return out


def _send_files(sock: socket.socket, directory: str, files: list[dict]) -> None:
    for entry in files:
        with open(os.path.join(directory, entry["name"]), "rb") as f:
            sent = 0
            while sent < entry["size"]:
                chunk = f.read(min(CHUNK, entry["size"] - sent))
                if not chunk:
                    raise OSError(f"{entry['name']} in {directory} is shorter than announced")
                sock.sendall(chunk)
                sent += len(chunk)


def _check_space(parent: str, total: int, reserved: int = 0) -> None:
    """Refuse ``total`` bytes that do not fit the space free under ``parent`` less ``reserved``
    (what other transfers in flight will still write): before a byte is written, so a peer never
    fills this host's storage."""
    free = shutil.disk_usage(parent).free - reserved
    if total > free:
        raise OSError(errno.ENOSPC, f"a step of {total} bytes does not fit the {max(free, 0)} bytes free under "
                                    f"{parent}" + (f" ({reserved} bytes held for transfers in flight)" if reserved else ""))


def _recv_files(sock: socket.socket, files: list[tuple[str, int]], final: str) -> None:
    """The announced files into a temporary directory beside ``final``, synced, then renamed to
    ``final`` (replacing an older copy): a half-received step is never under its final name. The
    caller has checked that they fit (`_check_space`)."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"tmp-{os.path.basename(final)}-{secrets.token_hex(4)}")
    os.makedirs(tmp)
    try:
        for name, size in files:
            with open(os.path.join(tmp, name), "wb") as f:
                left = size
                while left:
                    chunk = sock.recv(min(CHUNK, left))
                    if not chunk:
                        raise ConnectionError(f"the connection closed {left} bytes short of {name}")
                    f.write(chunk)
                    left -= len(chunk)
                f.flush()
                os.fsync(f.fileno())
        commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit(tmp: str, final: str) -> None:
    """Rename the finished directory ``tmp`` to ``final`` (an older ``final`` is moved aside first
    and removed after), then sync the parent directory, so the rename survives a power loss."""
    old = None
    if os.path.exists(final):
        old = f"{tmp}-replaced"
        os.rename(final, old)
    os.rename(tmp, final)
    fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _int(header: dict, name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise ValueError(f"{name}={value!r:.100} must be an int from 0 to 2**31 - 1")
    return value


# ------------------------------------------------------------------ server
class PeerServer:
    """Keeps other processes' local steps under ``root/peer-<source>/step-<step>`` and hands
    them back: operations ``put`` (a step's files follow the header) and ``get``. One thread
    accepts; each connection is served by a thread of its own under `TIMEOUT_S`."""

    def __init__(self, root: str, key: bytes, host: str = "", port: int = 0):
        self.root, self.key = root, key
        self.sock = socket.create_server((host, port), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.rejected = 0          # connections ended for a bad frame, key or request
        self._closed = False
        self._slots = threading.BoundedSemaphore(CONNECTIONS)
        self._space, self._reserved = threading.Lock(), 0     # bytes promised to puts in flight
        self._thread = threading.Thread(target=self._accept, name="jaxpar-peer-server", daemon=True)
        self._thread.start()

    def held_dir(self, source: int, step: int) -> str:
        return os.path.join(self.root, f"peer-{source}", f"step-{step}")

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)          # out of file descriptors, say: wait instead of spinning
                continue
            if not self._slots.acquire(blocking=False):     # too many at once: this one waits for none
                self.rejected += 1
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="jaxpar-peer-conn", daemon=True).start()
            except RuntimeError:         # no thread to be had: drop this connection, keep accepting
                self._slots.release()
                self.rejected += 1
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            self._slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT_S)
            try:
                _handshake(conn, self.key, b"server")
            except Exception:        # noqa: BLE001  (anyone may connect: a wrong key ends this connection)
                self.rejected += 1
                return
            try:
                header = _recv_header(conn)
                op = header.get("op")
                if op == "put":
                    source, step = _int(header, "source"), _int(header, "step")
                    files = _check_files(header.get("files"))
                    held, total = self.held_dir(source, step), sum(size for _, size in files)
                    with self._space:        # puts in flight together never promise more than is free
                        os.makedirs(os.path.dirname(held), exist_ok=True)
                        _check_space(os.path.dirname(held), total, self._reserved)
                        self._reserved += total
                    try:
                        _recv_files(conn, files, held)
                    finally:
                        with self._space:
                            self._reserved -= total
                    _send_header(conn, {"ok": True})
                elif op == "get":
                    source, step = _int(header, "source"), _int(header, "step")
                    held = self.held_dir(source, step)
                    if not os.path.isfile(os.path.join(held, "manifest.json")):
                        _send_header(conn, {"missing": f"no copy of process {source}'s step {step} here"})
                        return
                    files = _files_of(held)
                    _send_header(conn, {"files": files})
                    _send_files(conn, held, files)
                else:
                    raise ValueError(f"unknown op {op!r:.50}; the operations are 'put' and 'get'")
            except Exception as e:      # noqa: BLE001  (a bad request ends its connection, never the server)
                self.rejected += 1
                try:
                    _send_header(conn, {"error": f"{type(e).__name__}: {e}"[:500]})
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


# ------------------------------------------------------------------ client
def _connect(address: tuple[str, int], key: bytes) -> socket.socket:
    try:
        sock = socket.create_connection(address, timeout=TIMEOUT_S)
    except OSError as e:
        raise PeerError(f"could not reach the peer at {address[0]}:{address[1]} ({e})") from e
    try:
        _handshake(sock, key, b"client")
    except Exception as e:
        sock.close()
        raise PeerError(f"the peer at {address[0]}:{address[1]} failed the handshake ({e})") from e
    return sock


def _reply(sock: socket.socket, address) -> dict:
    try:
        reply = _recv_header(sock)
    except Exception as e:
        raise PeerError(f"the peer at {address[0]}:{address[1]} gave no reply ({e})") from e
    if "error" in reply:
        raise PeerError(f"the peer at {address[0]}:{address[1]} refused: {reply['error']}")
    return reply


def put_step(address: tuple[str, int], key: bytes, source: int, step: int, directory: str) -> None:
    """Send process ``source``'s local step ``step`` (the files of ``directory``) to the peer."""
    files = _files_of(directory)
    with _connect(address, key) as sock:
        try:
            _send_header(sock, {"op": "put", "source": source, "step": step, "files": files})
            _send_files(sock, directory, files)
        except OSError as e:
            # the peer may have refused the step and closed while it was still arriving: its reply says why
            sock.settimeout(2.0)
            try:
                reply = _recv_header(sock)
            except Exception:        # noqa: BLE001  (no reply: the connection itself broke)
                reply = {}
            if "error" in reply:
                raise PeerError(f"the peer at {address[0]}:{address[1]} refused: {reply['error']}") from e
            raise PeerError(f"sending step {step} to the peer at {address[0]}:{address[1]} broke off ({e})") from e
        _reply(sock, address)


def get_step(address: tuple[str, int], key: bytes, source: int, step: int, final: str) -> None:
    """Fetch the peer's copy of process ``source``'s step ``step`` into the directory ``final``
    (written beside it and renamed into place); `PeerError` when the peer has none."""
    with _connect(address, key) as sock:
        _send_header(sock, {"op": "get", "source": source, "step": step})
        reply = _reply(sock, address)
        if "missing" in reply:
            raise PeerError(f"the peer at {address[0]}:{address[1]}: {reply['missing']}")
        try:
            files = _check_files(reply.get("files"))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            _check_space(os.path.dirname(final), sum(size for _, size in files))
            _recv_files(sock, files, final)
        except (OSError, ValueError) as e:
            raise PeerError(f"fetching step {step} from the peer at {address[0]}:{address[1]} broke off ({e})") from e
