"""``jaxpar launch``: start this node's workers, watch them, and never leave one behind.

The launcher plays msrun's part on top of JAX's own runtime: it sets each worker's
``JAXPAR_*`` variables, and the worker's ``jaxpar.distributed.initialize()`` connects through
``jax.distributed`` (process 0 serves as coordinator at ``--master-addr:--master-port``).

Supervision, in one loop:

* a worker exits non-zero or is killed → SIGKILL to every other worker's process group at
  once (the job cannot go on, or save, without that process, and JAX's preemption handler
  swallows SIGTERM); exit with the status of the rank that failed *first*, naming it, how it
  ended, its log and its tail (a peer that died of it, e.g. with a gloo error, is not blamed:
  see ``jaxpar.launch.deaths``);
* a worker's script ends with status 0 while others run on for ``exit_time_out`` seconds → the
  same, exit 1 (a rank that leaves early leaves its peers waiting in a collective);
* with ``--worker-restarts K``, a worker that fails (not a join time-out) instead has the others
  killed and the whole group started again, up to K times, the servers left running: the
  script resumes from its own checkpoint (``JAXPAR_WORKER_RESTART`` counts the restarts); on
  several nodes every node's launcher stops and starts its workers as node 0's rendezvous
  says, and with ``--min-workers`` the group goes on without a node that does not come back
  (``jaxpar.launch.rendezvous``);
* a worker gives up waiting for the cluster (status 124 from ``initialize``) → the same, with
  the ranks that never joined;
* SIGINT / SIGTERM / SIGHUP to the launcher → SIGTERM to the workers (a loop that watches
  ``jax.experimental.multihost_utils.reached_preemption_sync_point`` can save a checkpoint),
  SIGKILL after ``kill_time_out`` seconds or at a second signal; exit ``128 + signal``;
* the launcher itself killed with SIGKILL → the kernel kills the workers (``PR_SET_PDEATHSIG``).

With ``--servers N`` the launcher of node 0 first starts N parameter-server processes and waits
for them to serve; see ``jaxpar.launch.servers`` (restarts, stopping, the contract).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from jaxpar.launch import cluster, deaths, rendezvous, servers, sources
from jaxpar.launch.ports import BIND_ADDRESS, check_bind_address, check_can_listen, listen_problem, port_problem
from jaxpar.launch.worker import Worker, signal_name, stop_all

# Names shared with jaxpar.distributed, which the launcher must not import (it imports jax).
SIMULATED_DEVICES = "JAXPAR_SIMULATED_DEVICES"
CLUSTER_TIMEOUT = "JAXPAR_CLUSTER_TIMEOUT"
LAUNCH_RUN_DIR = "JAXPAR_LAUNCH_RUN_DIR"
WORKER_RESTART = "JAXPAR_WORKER_RESTART"
"""How many times the launcher has restarted the worker group before this run (0 at first)."""
NODE_RANK = "JAXPAR_NODE_RANK"
JOIN_TIMEOUT_EXIT_CODE = 124
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
SETTLE_SECONDS = 0.2
"""After the first failure is seen, how long the launcher lets other deaths land first."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start this node's share of a job; the options of ``jaxpar launch``.

    Example:
        >>> config = LaunchConfig(worker_num=16, local_worker_num=8, node_rank=1,
        ...                       master_addr="10.0.0.1")
        >>> list(config.ranks)[:2], config.coordinator_address
        ([8, 9], '10.0.0.1:8118')
    """

    worker_num: int = 8
    """Processes in the whole job, over all nodes (msrun ``--worker_num``)."""
    local_worker_num: int = 8
    """Processes on this node; rank = node_rank * local_worker_num + local index."""
    master_addr: str = "127.0.0.1"
    """Host of rank 0, which serves as the coordinator."""
    master_port: int = 8118
    """Coordinator port on ``master_addr``."""
    node_rank: int = 0
    """Index of this node, 0 .. nodes - 1."""
    log_dir: str = "jaxpar_logs"
    """Folder for ``worker_<rank>.log`` and ``launcher_<node_rank>.log``."""
    join: bool = False
    """Stream the workers' output, prefixed with their rank, to the launcher's stdout."""
    cluster_time_out: float = 600.0
    """Seconds every worker waits for all the others to join before it gives up."""
    simulated_devices: int | None = None
    """On CPU machines: this many CPU devices in each worker (``JAXPAR_SIMULATED_DEVICES``); not with
    ``devices_per_worker``."""
    devices_per_worker: int | None = None
    """Give worker ``i`` of this node accelerators ``i*d .. i*d + d - 1`` (several workers a node);
    not with ``simulated_devices``."""
    kill_time_out: float = 10.0
    """Seconds between SIGTERM and SIGKILL when the launcher is interrupted."""
    exit_time_out: float = 10.0
    """Seconds the other workers may run on after one worker's script ended with status 0."""
    bind_address: str | None = None
    """Where rank 0's coordinator listens (``host`` or ``host:port``). Default: the
    ``master_addr`` interface (loopback for ``127.0.0.1``); ``0.0.0.0`` listens on all."""
    servers: int | None = None
    """Parameter-server processes of the job (``--servers``), all started by node 0's
    launcher on the ``master_addr`` host; ``None``: none."""
    server_restarts: int = 3
    """How many times each server is restarted after it dies before the job fails."""
    server_port: int | None = None
    """Server ``i`` listens on ``server_port + i``; ``None``: free ports (one node only)."""
    server_time_out: float = 60.0
    """Seconds to wait for every server's ready line before the workers start."""
    server_checkpoint_dir: str | None = None
    """Where the servers checkpoint their shards; default ``<log_dir>/ps_checkpoints``."""
    server_module: str = "jaxpar.ps.server"
    """The module each server runs as ``python -m <module>``."""
    server_checkpoint_every: int | None = None
    """Steps between a server's full shard checkpoints (``--checkpoint-every``; its write-ahead
    log covers the steps between); ``None``: the server's default."""
    worker_restarts: int = 0
    """When a worker fails, stop the others and start the whole worker group again, at most
    this many times (servers keep running); the script resumes from its own checkpoint. On
    several nodes the launchers agree through node 0's rendezvous (``jaxpar.launch.rendezvous``)."""
    min_workers: int | None = None
    """Several nodes: after a failure, a node that does not come back within ``rejoin_time_out``
    is left out and the group goes on with the others while they hold at least this many
    workers (whole nodes: a multiple of ``local_worker_num``); ``None``: ``worker_num`` (never
    fewer)."""
    rendezvous_port: int | None = None
    """Several nodes with ``worker_restarts``: the port of node 0's rendezvous on ``master_addr``;
    ``None``: ``master_port + 1``."""
    rejoin_time_out: float = 60.0
    """Several nodes: seconds node 0 waits for every node to join again after a failure."""

    def __post_init__(self):
        _positive("worker_num", self.worker_num, "--worker-num")
        _positive("local_worker_num", self.local_worker_num, "--local-worker-num")
        _positive("cluster_time_out", self.cluster_time_out, "--cluster-time-out", number=float)
        _positive("kill_time_out", self.kill_time_out, "--kill-time-out", number=float)
        _positive("exit_time_out", self.exit_time_out, "--exit-time-out", number=float)
        _positive("rejoin_time_out", self.rejoin_time_out, "--rejoin-time-out", number=float)
        if self.bind_address is not None:
            check_bind_address(self.bind_address, self.master_port, "--bind-address")
        for name in ("simulated_devices", "devices_per_worker"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), "--" + name.replace("_", "-"))
        if self.simulated_devices is not None and self.devices_per_worker is not None:
            # simulated devices are CPU devices (JAX_PLATFORMS=cpu); the device ids pick accelerators,
            # which a CPU worker never uses: each worker got K devices and D said nothing
            raise ValueError(
                f"simulated_devices={self.simulated_devices} with devices_per_worker={self.devices_per_worker}: "
                f"--simulated-devices {self.simulated_devices} gives each worker {self.simulated_devices} CPU "
                f"devices, --devices-per-worker {self.devices_per_worker} picks accelerators "
                f"i*{self.devices_per_worker}..i*{self.devices_per_worker}+{self.devices_per_worker - 1} for "
                "worker i; a worker runs on one or the other. On a CPU machine drop --devices-per-worker; on "
                "an accelerator node drop --simulated-devices.")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip() or \
                any(c.isspace() or c in "/[]" for c in self.master_addr):
            raise ValueError(f"master_addr={self.master_addr!r} must be the host name or IP of rank 0's node, "
                             "such as 10.0.0.1, node-0 or ::1 (IPv6 without brackets) (--master-addr).")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port!r} must be in 1..65535 (--master-port).")
        servers.check_config(self)
        _check_worker_restarts(self)
        if not isinstance(self.node_rank, int) or self.node_rank < 0:
            raise ValueError(f"node_rank={self.node_rank!r} must be a whole number >= 0 (--node-rank).")
        first = self.node_rank * self.local_worker_num
        if first + self.local_worker_num > self.worker_num:
            raise ValueError(
                f"node_rank={self.node_rank} with local_worker_num={self.local_worker_num} "
                f"gives ranks {first}..{first + self.local_worker_num - 1}, but worker_num="
                f"{self.worker_num}; use --worker-num >= {first + self.local_worker_num} or a "
                "smaller --node-rank / --local-worker-num."
            )

    @property
    def ranks(self) -> range:
        """The global ranks of this node's workers."""
        first = self.node_rank * self.local_worker_num
        return range(first, first + self.local_worker_num)

    @property
    def elastic(self) -> bool:
        """Whether node 0's rendezvous decides the worker groups (several nodes, restarts)."""
        return self.worker_restarts > 0 and self.worker_num > self.local_worker_num

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        return self.master_addr, self.rendezvous_port or self.master_port + 1

    @property
    def coordinator_address(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"


def _positive(name: str, value, flag: str, number=int) -> None:
    ok = isinstance(value, (int, float) if number is float else int) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive, finite number of seconds" if number is float else f"a positive {number.__name__}"
        raise ValueError(f"{name}={value!r} must be {kind} ({flag}).")


class WorkerStartError(RuntimeError):
    """A worker process could not be started (the launcher stops the ones already started)."""


def check_node(config: LaunchConfig) -> None:
    """What only this node can check, before any worker starts: that ``log_dir`` can be written, and on
    node 0 that ``bind_address`` (JAX's coordinator dies of SIGSEGV otherwise), or without it
    ``master_addr``, is an address of this host.
    Raises a ValueError naming the flag."""
    if os.path.exists(config.log_dir) and not os.path.isdir(config.log_dir):
        raise ValueError(f"--log-dir {config.log_dir!r} is a file, not a folder; give a folder for the logs, "
                         "e.g. --log-dir jaxpar_logs.")
    try:
        os.makedirs(config.log_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--log-dir {config.log_dir!r} cannot be created ({err.strerror or err}); give a folder "
                         "this user can write, e.g. --log-dir jaxpar_logs.") from None
    if not os.access(config.log_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {config.log_dir!r} is not writable by this user; give a folder it can write, "
                         "e.g. --log-dir jaxpar_logs.")
    if config.node_rank == 0 and config.bind_address is not None:
        check_can_listen(check_bind_address(config.bind_address, config.master_port, "--bind-address"),
                         "--bind-address")
    elif config.node_rank == 0 and (problem := listen_problem(config.master_addr)):
        # node 0 runs rank 0: its coordinator listens on --master-addr, where every other process
        # connects; an address of another host would leave them waiting the whole cluster time-out
        raise ValueError(f"--master-addr {config.master_addr!r}: {config.master_addr} {problem}, but this node "
                         "(--node-rank 0) runs rank 0, whose coordinator the other processes reach there. Give "
                         "this host's IP or name on the network the other nodes reach (ip -brief address lists "
                         "them); if they reach it through NAT at that address, also say where to listen with "
                         "--bind-address IP (0.0.0.0: every interface).")


def _check_worker_restarts(config: "LaunchConfig") -> None:
    k = config.worker_restarts
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"worker_restarts={k!r} must be a whole number >= 0 (--worker-restarts); "
                         "0 ends the job at the first worker failure.")
    port = config.rendezvous_port
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
                             or port == config.master_port):
        raise ValueError(f"rendezvous_port={port!r} must be in 1..65535 and not --master-port "
                         f"{config.master_port} (--rendezvous-port).")
    m = config.min_workers
    if m is None:
        return
    local, total = config.local_worker_num, config.worker_num
    if isinstance(m, bool) or not isinstance(m, int) or not 0 < m <= total:
        raise ValueError(f"min_workers={m!r} must be a whole number in 1..{total} (--min-workers; "
                         f"--worker-num is {total}).")
    if m < total and total == local:
        raise ValueError(f"min_workers={m} on a one-node job (worker_num={total} = local_worker_num): the group "
                         "shrinks by the nodes that do not come back, and this job has one; drop --min-workers, "
                         "or start one jaxpar launch per node (--node-rank).")
    if m < total and not k:
        raise ValueError(f"min_workers={m} with worker_restarts=0: the job ends at the first failure and never "
                         "goes on with fewer workers; add --worker-restarts K.")
    if m % local:
        raise ValueError(f"min_workers={m} is not a multiple of local_worker_num={local}: a group loses whole "
                         f"nodes; use --min-workers {max(local, m // local * local)} or "
                         f"{-(-m // local) * local}.")


def worker_command(script: str, args: Sequence[str]) -> list[str]:
    """``script.py args`` → ``python -u .../jaxpar/launch/runner.py script.py args``.

    The runner records how the script ended (see ``jaxpar.launch.runner``). It runs as a file,
    not ``-m jaxpar.launch.runner``: importing the jaxpar package would import JAX before the
    script could set JAX's environment variables. Any other executable runs as is.
    """
    is_python = script.endswith(".py") or not (os.path.isfile(script) and os.access(script, os.X_OK))
    if is_python:
        return [sys.executable, "-u", RUNNER, script, *args]
    # "train.sh" would be looked up on PATH: run the file the user named, from the working directory
    return [script if os.sep in script else os.path.join(os.curdir, script), *args]


def worker_env(config: LaunchConfig, rank: int, run_dir: str, base: Mapping[str, str]) -> dict:
    """The environment of the worker with global ``rank``: ``base`` plus the JAXPAR_* names."""
    local = rank - config.ranks.start
    env = dict(base)
    env.update({
        sources.COORDINATOR_ADDRESS: config.coordinator_address,
        sources.NUM_PROCESSES: str(config.worker_num),
        sources.PROCESS_ID: str(rank),
        sources.LOCAL_PROCESS_ID: str(local),
        NODE_RANK: str(config.node_rank),
        CLUSTER_TIMEOUT: str(config.cluster_time_out),
        # Only these variables count: an srun or mpirun around the launcher describes the
        # launchers, not the workers.
        cluster.CLUSTER_SOURCE: "env",
        LAUNCH_RUN_DIR: run_dir,
        "PYTHONUNBUFFERED": "1",
    })
    if config.bind_address is not None:
        env[BIND_ADDRESS] = config.bind_address
    if config.simulated_devices is not None:
        env[SIMULATED_DEVICES] = str(config.simulated_devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    if config.devices_per_worker is not None:
        d = config.devices_per_worker
        env[sources.LOCAL_DEVICE_IDS] = ",".join(str(i) for i in range(local * d, local * d + d))
    return env


class _Log:
    """The launcher's messages: to stderr and to launcher_<node>.log."""

    def __init__(self, path: str, lock: threading.Lock):
        self._file = open(path, "a", encoding="utf-8")
        self._lock = lock

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._lock:
            for line in message.splitlines():
                sys.stderr.write(f"jaxpar launch: {line}\n")
                self._file.write(f"{stamp} {line}\n")
            sys.stderr.flush()
            self._file.flush()

    def close(self) -> None:
        self._file.close()


class _Signals:
    """Turns SIGINT/SIGTERM/SIGHUP into a flag the loop reads (main thread only)."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: int | None = None
        self.count = 0
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.NAMES:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum
        self.count += 1

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def launch(config: LaunchConfig, script: str, args: Sequence[str] = (), *,
           echo: IO[str] | None = None) -> int:
    """Runs this node's workers of ``script`` until all end; returns the exit status.

    0 when every worker exits 0; otherwise the failing worker's status (``128 + signal``
    when killed), ``124`` when the cluster did not form in time, ``128 + signal`` when the
    launcher was interrupted. Raises ValueError when this node cannot run its share (``check_node``).

    Example:
        >>> launch(LaunchConfig(worker_num=2, local_worker_num=2, simulated_devices=4),
        ...        "train.py", ["--steps", "5"])  # doctest: +SKIP
        0
    """
    check_node(config)
    lock = threading.Lock()
    log = _Log(os.path.join(config.log_dir, f"launcher_{config.node_rank}.log"), lock)
    run_dir = tempfile.mkdtemp(prefix="jaxpar-launch-")
    try:
        if config.node_rank == 0 and not _port_free(config, log):
            return 1
        with _Signals() as signals:
            return _run(config, worker_command(script, args), run_dir, log, signals,
                        echo if config.join else None, lock)
    except (servers.ServerError, WorkerStartError) as err:
        log(f"error: {err}")
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        log.close()


def _port_free(config: LaunchConfig, log: _Log) -> bool:
    problem = port_problem(config.master_port)
    if problem:
        log(f"error: --master-port {config.master_port} {problem}; pick a free port with "
            f"--master-port, or stop the process holding it (ss -ltnp 'sport = :{config.master_port}').")
    return not problem


def _start(config, command, run_dir, log, workers: list[Worker], extra_env: dict) -> None:
    """Starts the workers, appending each as it starts (so a failure leaves none unwatched)."""
    for rank in config.ranks:
        path = os.path.join(config.log_dir, f"worker_{rank}.log")
        env = worker_env(config, rank, run_dir, {**os.environ, **extra_env})
        try:
            workers.append(Worker(rank=rank, command=command, env=env, log_path=path))
        except OSError as err:       # not executable, a #! line naming no interpreter, ...
            raise WorkerStartError(f"rank {rank} could not start {command[0]!r}: {err.strerror or err}; check the "
                                   "script's path, its permissions and its #! line") from None
        log(f"started rank {rank} (pid {workers[-1].pid}), log {path}")


def _run(config, command, run_dir, log, signals, echo, lock) -> int:
    log(f"node {config.node_rank}: ranks {config.ranks.start}..{config.ranks.stop - 1} of "
        f"{config.worker_num}, coordinator {config.coordinator_address}: {shlex.join(command)}")
    workers: list[Worker] = []
    pool, server_env = servers.pool_for(config, os.environ, log)
    try:
        if not _servers_up(config, pool, server_env, signals):
            log(f"received {signal_name(signals.received)} before the servers were ready")
            return 128 + signals.received
        if config.elastic:
            return _run_elastic(_NodeRun(config, command, run_dir, log, signals, echo, lock, pool, server_env,
                                         workers))
        restart = 0
        while True:
            _start(config, command, run_dir, log, workers, {**server_env, WORKER_RESTART: str(restart)})
            # Copy output only once every worker has forked: no thread runs during a fork.
            for w in workers:
                w.start_copying(echo, lock)
            code, worker_failed = _watch(config, workers, run_dir, log, signals, pool)
            if not worker_failed or restart == config.worker_restarts:
                return code
            restart += 1
            log(f"restarting the worker group ({restart} of {config.worker_restarts}, --worker-restarts)"
                + ("; the servers keep running" if pool is not None else ""))
            _clear_group(workers, run_dir)
    finally:
        stop_all(workers, 0.0)  # normally all have ended: this reaps them and their children
        for w in workers:
            w.close()
        if pool is not None:  # after the workers: their last pushes reach the final checkpoint
            pool.stop(config.kill_time_out, hurry=lambda: signals.count > 1)


@dataclasses.dataclass
class _NodeRun:
    """What one node's supervision works with (`_run`'s state, for the elastic loop)."""

    config: LaunchConfig
    command: list
    run_dir: str
    log: _Log
    signals: _Signals
    echo: IO[str] | None
    lock: threading.Lock
    pool: object
    server_env: dict
    workers: list


def _run_elastic(node: _NodeRun) -> int:
    """`_run` on several nodes with restarts: each worker group as node 0's rendezvous decides
    (``jaxpar.launch.rendezvous``); node 0's launcher also serves it."""
    config, log, workers = node.config, node.log, node.workers
    terms = rendezvous.Terms(config.worker_num, config.local_worker_num, config.worker_restarts,
                             config.min_workers or config.worker_num)
    host, port = config.rendezvous_address
    server = None
    try:
        if config.node_rank == 0:
            bind = host
            if config.bind_address is not None:
                bind = check_bind_address(config.bind_address, port).rpartition(":")[0].strip("[]")
            try:
                server = rendezvous.Server(bind, port, terms, first_time_out=config.cluster_time_out,
                                           rejoin_time_out=config.rejoin_time_out, log=log,
                                           exit_time_out=config.exit_time_out)
            except OSError as err:
                log(f"error: node 0's rendezvous cannot listen on {bind}:{port} ({err.strerror or err}); pick a "
                    "free port with --rendezvous-port (the same on every node)")
                return 1
        client = rendezvous.Client(host, port, config.node_rank, terms, time_out=config.cluster_time_out,
                                   interrupted=lambda: node.signals.received is not None)
        try:
            return _elastic_groups(node, client, server)
        finally:
            client.close()
    except rendezvous.RendezvousError as err:
        stop_all(workers, 0.0)
        if node.signals.received is not None:
            return 128 + node.signals.received
        log(f"error: {err}")
        return rendezvous.REFUSED_EXIT_CODE if isinstance(err, rendezvous.Refused) else 1
    finally:
        if server is not None:
            server.end(1, "node 0's launcher stopped (see its log)")     # nothing if the job has ended
            server.close()


def _elastic_groups(node: _NodeRun, client: rendezvous.Client, server: rendezvous.Server | None) -> int:
    config, log, signals, workers, run_dir = node.config, node.log, node.signals, node.workers, node.run_dir
    interrupted = lambda: signals.received is not None  # noqa: E731

    def interrupt() -> int:
        code = 128 + signals.received
        reason = f"its launcher received {signal_name(signals.received)}"
        if server is not None:     # node 0's coordinator goes with it: the job ends on every node
            server.end(code, f"node 0: {reason}")
        else:
            client.interrupted(code, reason)
        return code

    while True:
        got = client.wait(interrupted)
        if got is None:
            return interrupt()
        if isinstance(got, rendezvous.End):
            log(f"the job ended with status {got.code}: {got.reason}")
            return got.code
        group = dataclasses.replace(config, node_rank=got.index, worker_num=got.worker_num,
                                    worker_restarts=0, min_workers=None)
        if got.generation:
            log(f"worker group {got.generation}: node index {got.index} of nodes {list(got.nodes)}, "
                f"ranks {group.ranks.start}..{group.ranks.stop - 1} of {got.worker_num}")
        _start(group, node.command, run_dir, log, workers, {**node.server_env, WORKER_RESTART: str(got.generation)})
        for w in workers:
            w.start_copying(node.echo, node.lock)
        code, restartable = _watch(group, workers, run_dir, log, node.signals, node.pool, stopped=client.stopped)
        if code is None:                                    # node 0 stopped the group (or ended the job)
            _clear_group(workers, run_dir)
            client.rejoin()
            continue
        _clear_group(workers, run_dir)
        if interrupted():
            return interrupt()
        if code == 0:
            client.done()
            while client.stopped() is None:                  # every node done (end) or another failed (stop)
                if interrupted():
                    return interrupt()
                time.sleep(0.05)
        else:
            client.failed(code, f"its worker group failed with status {code} (its launcher's log: "
                                f"{os.path.join(config.log_dir, f'launcher_{config.node_rank}.log')})",
                          final=not restartable)
        client.rejoin()


def _clear_group(workers: list[Worker], run_dir: str) -> None:
    """Forgets the ended worker group: its processes (already stopped) and its records, so the
    next group's deaths and joins are read afresh."""
    stop_all(workers, 0.0)
    for w in workers:
        w.close()
    workers.clear()
    for name in os.listdir(run_dir):
        os.remove(os.path.join(run_dir, name))


def _servers_up(config, pool, server_env: dict, signals) -> bool:
    """Node 0 starts the servers and waits for their ready lines; another node waits until it
    reaches each of them. False when a signal came first."""
    interrupted = lambda: signals.received is not None  # noqa: E731
    if pool is not None:
        pool.start()
        return pool.wait_ready(config.server_time_out, interrupted)
    if servers.ADDRESSES in server_env:
        return servers.wait_reachable(server_env[servers.ADDRESSES].split(","),
                                      config.server_time_out, interrupted)
    return True


def _marked(run_dir: str, stage: str) -> set[int]:
    """Ranks that wrote ``<stage>.<rank>`` (``waiting`` / ``joined``) in ``run_dir``."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    return {int(n.split(".", 1)[1]) for n in names if n.startswith(stage + ".")}


def _watch(config, workers, run_dir, log, signals, pool, stopped=None) -> tuple[int | None, bool]:
    """Supervises one worker group until it ends: (exit status, whether a worker failed in a
    way a restarted group may get past). ``stopped()``: why the rendezvous stopped the group,
    or ``None``; when it says, the workers are killed and the status is ``None``."""
    while True:
        if signals.received is not None:
            return _interrupted(config, workers, signals, log), False
        if stopped is not None and (stop := stopped()) is not None:
            running = [w for w in workers if w.poll() is None]
            # the job's end: SIGTERM first (a preemption handler may save); a restart: SIGKILL at once
            took = stop_all(workers, config.kill_time_out if stop.final else 0.0, hurry=lambda: signals.count > 1)
            log(f"node 0 stopped the worker group ({stop.reason}): stopped {len(running)} running worker(s) "
                f"in {took:.2f} s")
            return None, False
        if pool is not None:
            try:
                pool.check()
            except servers.ServerError as err:
                took = stop_all(workers, 0.0)
                log(f"error: {err}\nkilled the {len(workers)} worker(s) in {took:.2f} s: the "
                    "job cannot go on without that server's rows.")
                return 1, False
        codes = [w.poll() for w in workers]
        if any(code not in (None, 0) for code in codes):
            code = _failed(config, workers, run_dir, log)
            return code, code != JOIN_TIMEOUT_EXIT_CODE  # a cluster that never formed stays so
        if all(code == 0 for code in codes):
            log(f"all {len(workers)} workers of node {config.node_rank} exited with code 0")
            return 0, False
        first = _first_finish(workers, run_dir)
        if first is not None and time.time() - first[1] > config.exit_time_out:
            return _left_early(config, workers, first, log), False
        time.sleep(0.05)


def _first_finish(workers, run_dir) -> tuple[Worker, float] | None:
    """The worker whose script ended first with status 0 (its record, or its exit), and when."""
    ends = []
    for w in workers:
        record = deaths.read_record(run_dir, w.rank)
        if record is not None and record.get("code") == 0:
            ends.append((float(record["time"]), w.rank, w))
        elif w.poll() == 0:
            ends.append((w.ended_at, w.rank, w))
    if not ends:
        return None
    at, _, worker = min(ends)
    return worker, at


def _interrupted(config, workers, signals, log) -> int:
    running = [w for w in workers if w.poll() is None]
    name = signal_name(signals.received)
    log(f"received {name}: sending SIGTERM to {len(running)} worker(s), SIGKILL in "
        f"{config.kill_time_out:g} s (--kill-time-out) or at the next signal")
    took = stop_all(workers, config.kill_time_out, hurry=lambda: signals.count > 1)
    log(f"stopped {len(running)} worker(s) in {took:.2f} s")
    return 128 + signals.received


def _deaths(workers, run_dir) -> list[deaths.Death]:
    """The workers that have failed on their own so far (before the launcher stops the rest).

    A worker whose runner recorded a failure counts even while its process still tears down
    (flushing output, say): a peer may die of it, and exit, before it does.
    """
    found = []
    for w in workers:
        record = deaths.read_record(run_dir, w.rank)
        if w.poll() is not None:
            found.append(deaths.death_of(w.rank, w.process.returncode, w.ended_at, w.tail(),
                                         record))
        elif record is not None and record.get("code", 0) != 0:
            found.append(deaths.death_of(w.rank, record["code"], time.time(), w.tail(), record))
    return found


def _failed(config, workers, run_dir: str, log) -> int:
    # A peer that died of this failure may have been noticed first: give the deaths a moment
    # to be stamped, then take them, before the launcher's own kills (which are no causes).
    time.sleep(SETTLE_SECONDS)
    for w in workers:
        w.has_exited()
    ended = _deaths(workers, run_dir)
    joined = _marked(run_dir, "joined")
    running = [w for w in workers if w.poll() is None]
    took = stop_all(workers, 0.0)
    root = deaths.root_cause(ended)
    failed = next(w for w in workers if w.rank == root.rank)
    log(f"rank {root.rank} {root.describe()}: killed the {len(running)} other running "
        f"worker(s) in {took:.2f} s")
    if root.code == JOIN_TIMEOUT_EXIT_CODE and root.rank not in joined:
        _join_timeout_report(config, failed, _marked(run_dir, "waiting"), log)
        return JOIN_TIMEOUT_EXIT_CODE
    log(f"error: rank {root.rank} (pid {failed.pid}) {root.describe()}, the first rank to "
        f"fail; its log: {failed.log_path}")
    if root.consequence and config.worker_num > config.local_worker_num:
        log(f"rank {root.rank}'s error says a peer failed, and no rank of this node failed on "
            "its own: look at the other nodes' launcher logs for the first failure.")
    elif root.consequence:     # one node: every rank is here, and none failed on its own
        log(f"rank {root.rank}'s error says a peer failed, but no rank failed on its own (all "
            f"{config.worker_num} run on this node): a collective failed or timed out under them. Ranks "
            "that run different collectives, or different numbers of them (a step, an eval or a save "
            "that only some ranks run), wait for each other until one gives up; compare where each "
            f"rank's log ends: {os.path.join(config.log_dir, 'worker_<rank>.log')}.")
    _report_others(root, ended, log)
    tail = failed.tail()
    if tail:
        log(f"last {len(tail)} lines of {failed.log_path}:\n" + "\n".join("  | " + t for t in tail))
    return root.code if root.code > 0 else 128 - root.code


def _report_others(root: deaths.Death, ended: list[deaths.Death], log) -> None:
    for d in sorted(ended, key=lambda d: d.time):
        if d.rank != root.rank and d.failed:
            why = "after a peer failed" if d.consequence else "on its own"
            log(f"rank {d.rank} also {d.describe()}, {d.time - root.time:+.2f} s from rank "
                f"{root.rank} ({why})")


def _left_early(config, workers, first: tuple[Worker, float], log) -> int:
    worker, _ = first
    running = [w.rank for w in workers if w.poll() is None and w is not worker]
    took = stop_all(workers, 0.0)
    log(f"error: rank {worker.rank} ended its script with code 0, but rank(s) {running} were "
        f"still running {config.exit_time_out:g} s later (--exit-time-out). A rank that leaves "
        "early leaves the others waiting for it in a collective or in JAX's shutdown "
        f"barrier; stopped the workers in {took:.2f} s. Every rank must run the same steps; "
        "raise --exit-time-out if some rank does long work of its own at the end. "
        f"Its log: {worker.log_path}")
    return 1


def _join_timeout_report(config, failed: Worker, waiting: set[int], log) -> None:
    absent = [r for r in config.ranks if r not in waiting]
    remote = config.worker_num - config.local_worker_num
    parts = [f"error: the cluster did not form within {config.cluster_time_out:g} s "
             f"(--cluster-time-out); rank {failed.rank} gave up waiting (log: {failed.log_path})"]
    if absent:
        parts.append(f"on this node, rank(s) {absent} never joined (never reached "
                     "jaxpar.distributed.initialize)")
    if remote:
        parts.append(f"{remote} rank(s) run on other nodes: check that every node runs jaxpar "
                     "launch with the same --worker-num, --master-addr and --master-port and "
                     "its own --node-rank")
    log("; ".join(parts) + ".")
