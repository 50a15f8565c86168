"""Parameter-server processes under ``jaxpar launch --servers N`` (msrun's server role).

Where they run: the launcher of node 0 starts all ``N`` servers, on the ``--master-addr``
host (so loopback for a one-node job). One place for them keeps one token, one set of ports
and one restart budget per job; the launchers of other nodes start none and only tell their
workers where the servers are. Servers never join ``jax.distributed``: they get neither the
coordinator address nor a process id, so jaxpar's SPMD collectives stay among the workers.

The contract with a server (``python -m jaxpar.ps.server``):

* it is started as ``python -m <module> --index I --count N --bind HOST:PORT
  --checkpoint-dir DIR`` (and ``--checkpoint-every S`` when ``--server-checkpoint-every``
  is given) with the job token in ``JAXPAR_PS_TOKEN`` (never on the command
  line, where ``ps`` shows it to every user of the host);
* it prints ``jaxpar-ps-server ready HOST:PORT`` once it serves; the workers start only when
  every server has said so;
* SIGTERM: it saves a final checkpoint and exits 0; started again with the same arguments
  after a crash, it restores its shards from ``DIR``. A server that dies is restarted (same
  port, same arguments) up to ``--server-restarts`` times; one more death fails the job.

Workers find the servers through ``JAXPAR_PS_ADDRESSES`` (``host:port`` by server index,
comma-separated) and ``JAXPAR_PS_TOKEN``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from typing import TYPE_CHECKING

from jaxpar.launch import sources
from jaxpar.launch.ports import free_port
from jaxpar.launch.worker import Worker, die_with_parent, stop_all

if TYPE_CHECKING:  # launcher imports this module
    from jaxpar.launch.launcher import LaunchConfig

ADDRESSES = "JAXPAR_PS_ADDRESSES"
"""Comma-separated ``host:port`` of every server, in server-index order."""
TOKEN = "JAXPAR_PS_TOKEN"
"""The job's shared secret, checked by the servers on every connection."""
READY = "jaxpar-ps-server ready"
"""A server prints this, then its ``HOST:PORT``, when it accepts connections."""


class ServerError(RuntimeError):
    """The servers could not be started or kept alive; the message names the server's log."""


def server_addresses(host: str, ports: list[int]) -> list[str]:
    """``host`` and ports → ``["host:port", ...]`` (IPv6 hosts in brackets).

    Example:
        >>> server_addresses("127.0.0.1", [9000, 9001])
        ['127.0.0.1:9000', '127.0.0.1:9001']
    """
    shown = f"[{host}]" if ":" in host else host
    return [f"{shown}:{port}" for port in ports]


def job_token(env: Mapping[str, str], several_nodes: bool) -> str:
    """The token given to servers and workers: ``JAXPAR_PS_TOKEN`` from the launcher's
    environment if set, else a new random one (only for a one-node job: each node's launcher
    must hand its workers the same token, so a many-node job brings its own).

    Example:
        >>> len(job_token({}, several_nodes=False)), job_token({TOKEN: "s3"}, True)
        (32, 's3')
    """
    given = env.get(TOKEN, "")
    if given:
        return given
    if several_nodes:
        raise ServerError(
            f"--servers on a job of several nodes needs the same {TOKEN} on every node: "
            f"export {TOKEN}=$(python -c 'import secrets; print(secrets.token_hex(16))') and "
            "pass that value to every node's jaxpar launch.")
    return secrets.token_hex(16)


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """How the job's servers are started (the contract in the module docstring): ``count``
    servers ``python -m <module>`` bound to ``host`` at ``ports`` (None: free ones found on this
    host), saving into ``checkpoint_dir``, with ``extra_args`` after the contract's flags.

    Example:
        >>> spec = ServerSpec(count=2, module="jaxpar.ps.server", host="127.0.0.1", ports=[9000, 9001],
        ...                   checkpoint_dir="ckpt")
        >>> spec.command(1, "127.0.0.1:9001")[3:]
        ['jaxpar.ps.server', '--index', '1', '--count', '2', '--bind', '127.0.0.1:9001', '--checkpoint-dir', 'ckpt']
    """

    count: int
    module: str
    host: str
    ports: list[int] | None
    checkpoint_dir: str
    extra_args: tuple[str, ...] = ()

    def command(self, index: int, address: str) -> list[str]:
        """Server ``index``'s command line, bound to ``address``."""
        return [sys.executable, "-u", "-m", self.module, "--index", str(index), "--count", str(self.count),
                "--bind", address, "--checkpoint-dir", self.checkpoint_dir, *self.extra_args]


class _ServerProcess(Worker):
    """A server process whose output goes straight into its log file: no pipe and no copying
    thread (the launcher forks workers, and restarted servers, while it runs), and the ready
    line is read back from the file. Stopped, polled and reported like a worker."""

    def __init__(self, *, index: int, command: list[str], env: Mapping[str, str], log_path: str):
        self.rank, self.log_path, self.ended_at = index, log_path, None
        self._log = open(log_path, "ab", buffering=0)
        self._start = self._log.tell()
        self.process = subprocess.Popen(
            command, env=dict(env), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()))  # no server outlives the launcher
        self._pump = self._reaper = None


class _Server:
    """One server: its arguments (kept for restarts), its current process and restarts so far."""

    def __init__(self, index: int, command: list[str], env: dict, log_path: str, address: str):
        self.index, self.command, self.env = index, command, env
        self.log_path, self.address = log_path, address
        self.restarts = 0
        self.process: _ServerProcess | None = None
        self.ready = False
        self._offset = 0

    def start(self) -> None:
        # The ready line of *this* run: read the log from where it ends now.
        self._offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self.ready = False
        self.process = _ServerProcess(index=self.index, command=self.command, env=self.env,
                                      log_path=self.log_path)

    def said_ready(self) -> bool:
        if not self.ready:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(self._offset)
                    self.ready = READY.encode() in f.read()
            except OSError:
                pass
        return self.ready


class ServerPool:
    """The job's servers: start them, wait until they serve, restart the dead, stop them all.

    ``spec``: how the servers are started (`ServerSpec`); ``log_dir``: where each writes its
    log; ``restarts``: the restarts a server may use; ``token``: the job's token;
    ``base_env``: the servers' environment (the token added); ``log``: the launcher's log.

    Example:
        >>> spec = ServerSpec(count=2, module="jaxpar.ps.server", host="127.0.0.1", ports=[9000, 9001],
        ...                   checkpoint_dir="ckpt")
        >>> pool = ServerPool(spec, log_dir="logs", restarts=3, token="t", base_env={}, log=print)
        >>> pool.worker_env()[ADDRESSES]
        '127.0.0.1:9000,127.0.0.1:9001'
    """

    def __init__(self, spec: ServerSpec, *, log_dir: str, restarts: int, token: str, base_env: Mapping[str, str],
                 log: Callable[[str], None]):
        ports = spec.ports if spec.ports is not None else [free_port() for _ in range(spec.count)]
        self.spec, self.addresses = spec, server_addresses(spec.host, ports)
        self.token, self.restarts, self._log = token, restarts, log
        env = {**base_env, TOKEN: token, "PYTHONUNBUFFERED": "1"}
        self.servers = [_Server(i, spec.command(i, address), env, os.path.join(log_dir, f"server_{i}.log"), address)
                        for i, address in enumerate(self.addresses)]

    def worker_env(self) -> dict[str, str]:
        """What every worker gets to find and talk to the servers."""
        return {ADDRESSES: ",".join(self.addresses), TOKEN: self.token}

    def start(self) -> None:
        """Starts every server (none waits for another)."""
        for s in self.servers:
            s.start()
            self._log(f"started server {s.index} (pid {s.process.pid}) at {s.address}, "
                      f"log {s.log_path}")

    def wait_ready(self, timeout: float, interrupted: Callable[[], bool]) -> bool:
        """Waits until every server has printed its ready line; restarts those that die.

        Returns False when ``interrupted()`` turns True first; raises ServerError when a
        server is not ready after ``timeout`` s or dies past its restarts.
        """
        deadline = time.monotonic() + timeout
        while not all(s.said_ready() for s in self.servers):
            if interrupted():
                return False
            self.check()
            late = [s for s in self.servers if not s.said_ready()]
            if late and time.monotonic() > deadline:
                s = late[0]
                raise ServerError(
                    f"server {s.index} (pid {s.process.pid}, {s.address}) did not print "
                    f"'{READY} HOST:PORT' within {timeout:g} s (--server-time-out); its log: "
                    f"{s.log_path}{_tail(s.process)}")
            time.sleep(0.05)
        self._log(f"all {len(self.servers)} servers ready: {','.join(self.addresses)}")
        return True

    def check(self) -> None:
        """Restarts every server that ended; ServerError once one has used up its restarts."""
        for s in self.servers:
            if s.ready is False and s.said_ready() and s.restarts:
                self._log(f"server {s.index} ready again at {s.address}")
            code = s.process.poll()
            if code is None:
                continue
            how = s.process.describe_exit()
            if s.restarts >= self.restarts:
                raise ServerError(
                    f"server {s.index} (pid {s.process.pid}, {s.address}) {how} after "
                    f"{s.restarts} restart(s), the most --server-restarts allows "
                    f"({self.restarts}); its log: {s.log_path}{_tail(s.process)}")
            s.restarts += 1
            old = s.process.pid
            s.process.signal_group(signal.SIGKILL)  # anything the dead server had started
            s.process.close()
            s.start()
            self._log(f"server {s.index} (pid {old}) {how}: restart {s.restarts} of "
                      f"{self.restarts} with the same arguments, pid {s.process.pid}, log "
                      f"{s.log_path}")

    def stop(self, grace: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM to every server (each saves a final checkpoint), SIGKILL after ``grace`` s
        or as soon as ``hurry()`` (a second Ctrl-C)."""
        running = [s.process for s in self.servers if s.process is not None]
        if not running:
            return
        took = stop_all(running, grace, hurry)
        codes = ", ".join(f"server {s.index} {s.process.describe_exit()}"
                          for s in self.servers if s.process is not None)
        self._log(f"stopped the servers in {took:.2f} s: {codes}")
        for p in running:
            p.close()


def wait_reachable(addresses: list[str], timeout: float, interrupted: Callable[[], bool]) -> bool:
    """Waits until a TCP connection to every ``host:port`` succeeds (a node other than 0: its
    workers start once node 0's servers serve). False when ``interrupted()`` turns True first;
    ServerError naming the address after ``timeout`` s.

    Example:
        >>> wait_reachable([], 1.0, lambda: False)
        True
    """
    deadline = time.monotonic() + timeout
    for address in addresses:
        host, _, port = address.rpartition(":")
        while True:
            if interrupted():
                return False
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                    break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"parameter server {address} did not accept a connection within "
                        f"{timeout:g} s (--server-time-out): {err}. Node 0's launcher starts the "
                        "servers: check that it runs with the same --servers and --server-port, "
                        "and that this node reaches --master-addr.") from None
            time.sleep(0.1)
    return True


def _tail(process: Worker, lines: int = 10) -> str:
    text = process.tail(lines)
    return (f"; last {len(text)} lines:\n" + "\n".join("  | " + t for t in text)) if text else ""


def check_config(config: LaunchConfig) -> None:
    """ValueError for bad server settings of a LaunchConfig (called by its ``__post_init__``)."""
    if config.servers is None:
        _unused_without_servers(config)
        return
    _positive_number("servers", config.servers, "--servers")
    _positive_number("server_time_out", config.server_time_out, "--server-time-out", number=float)
    restarts = config.server_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"server_restarts={restarts!r} must be a whole number >= 0 "
                         "(--server-restarts); 0 fails the job at the first server death.")
    every = config.server_checkpoint_every
    if every is not None:
        _positive_number("server_checkpoint_every", every, "--server-checkpoint-every")
    if not config.server_module:
        raise ValueError("server_module='' is empty; leave it out for 'jaxpar.ps.server'.")
    port, n = config.server_port, config.servers
    if port is None:
        if config.worker_num > config.local_worker_num:
            raise ValueError(
                f"servers={n} on a job of several nodes (worker_num={config.worker_num}, "
                f"local_worker_num={config.local_worker_num}) needs --server-port P: every "
                f"node's workers reach server i at {config.master_addr}:P+i.")
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65536 - n:
        raise ValueError(f"server_port={port!r} must leave room for {n} ports: 1..{65536 - n} "
                         "(--server-port).")
    if port <= config.master_port < port + n:
        raise ValueError(f"server ports {port}..{port + n - 1} include --master-port "
                         f"{config.master_port}; pick --server-port outside it.")


def _unused_without_servers(config: LaunchConfig) -> None:
    """A server setting without servers would do nothing: say so rather than ignore it."""
    for field in dataclasses.fields(config):
        if field.name.startswith("server_") and getattr(config, field.name) != field.default:
            flag = "--" + field.name.replace("_", "-")
            raise ValueError(f"{field.name}={getattr(config, field.name)!r} ({flag}) has no "
                             "effect without servers; add --servers N, or drop it.")


def _positive_number(name: str, value, flag: str, number=int) -> None:
    kinds = (int, float) if number is float else int
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
        what = "a positive, finite number of seconds" if number is float else f"a positive {number.__name__}"
        raise ValueError(f"{name}={value!r} must be {what} ({flag}).")


def pool_for(config: LaunchConfig, environ: Mapping[str, str], log: Callable[[str], None]
             ) -> tuple[ServerPool | None, dict[str, str]]:
    """Node 0's server pool (None on other nodes) and the variables every worker gets to
    reach the servers."""
    if config.servers is None:
        return None, {}
    token = job_token(environ, config.worker_num > config.local_worker_num)
    ports = (None if config.server_port is None
             else list(range(config.server_port, config.server_port + config.servers)))
    if config.node_rank != 0:
        return None, {ADDRESSES: ",".join(server_addresses(config.master_addr, ports)),
                      TOKEN: token}
    # Servers are host processes: no accelerator, and nothing that would make one of them
    # join jax.distributed.
    drop = {sources.COORDINATOR_ADDRESS, sources.COORDINATOR_PORT, sources.NUM_PROCESSES,
            sources.PROCESS_ID, sources.LOCAL_PROCESS_ID, sources.LOCAL_DEVICE_IDS}
    base = {k: v for k, v in environ.items() if k not in drop}
    base["JAX_PLATFORMS"] = "cpu"
    spec = ServerSpec(
        count=config.servers, module=config.server_module, host=config.master_addr, ports=ports,
        checkpoint_dir=config.server_checkpoint_dir or os.path.join(config.log_dir, "ps_checkpoints"),
        extra_args=(() if config.server_checkpoint_every is None
                    else ("--checkpoint-every", str(config.server_checkpoint_every))))
    pool = ServerPool(spec, log_dir=config.log_dir, restarts=config.server_restarts, token=token, base_env=base,
                      log=log)
    return pool, pool.worker_env()
