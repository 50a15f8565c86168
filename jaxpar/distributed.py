"""Joining a multi-process job, and assembling global batches from per-process rows.

``initialize()`` reads the cluster from the environment (``jaxpar launch``, a dynamic cluster,
OpenMPI, SLURM, Kubernetes, a rank table: see ``jaxpar.launch.cluster``) and connects this
process with ``jax.distributed.initialize``. It is idempotent, and in a one-process job it only
applies ``JAXPAR_SIMULATED_DEVICES``.

Data: process ``i`` of ``n`` holds the ``i``-th contiguous block of rows of the global batch
(``process_rows``); ``make_global_batch`` assembles the global ``jax.Array`` from these pieces.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.launch.cluster import ClusterError, ClusterSpec, detect_cluster, split_address
from jaxpar.launch.ports import BIND_ADDRESS, coordinator_bind_address, port_problem
from jaxpar.launch.sources import COORDINATOR_ADDRESS, NUM_PROCESSES

SIMULATED_DEVICES = "JAXPAR_SIMULATED_DEVICES"
CLUSTER_TIMEOUT = "JAXPAR_CLUSTER_TIMEOUT"
LAUNCH_RUN_DIR = "JAXPAR_LAUNCH_RUN_DIR"
DEFAULT_TIMEOUT = 600.0
JOIN_TIMEOUT_EXIT_CODE = 124
"""Exit status of a process that gave up waiting for the cluster (as GNU ``timeout``)."""
MISCONFIGURED_EXIT_CODE = 2
"""Exit status of a process whose coordinator formed a job of another size than it was started for."""

# The one piece of process state: the spec this process joined with. jax.distributed is
# itself process-global, so this mirrors it rather than adding a new kind of state.
_joined: ClusterSpec | None = None

__all__ = [
    "ClusterSpec",
    "initialize",
    "is_initialized",
    "make_global_batch",
    "place",
    "place_leaf",
    "process_rows",
    "shutdown",
]


def _env_number(name: str, kind=int):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):      # nan compares false: refused too
        raise ValueError(f"{name}={raw!r} must be a positive, finite number; fix or unset it.")
    return value


def _apply_simulated_devices(count: int) -> None:
    """Gives the CPU backend ``count`` devices; only possible before JAX starts it."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"simulated_devices={count!r} must be a whole number >= 1.")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        raise RuntimeError(
            f"cannot give the CPU backend {count} simulated devices: JAX has already started "
            f"it. Call jaxpar.distributed.initialize() before any JAX operation ({err})."
        ) from None


def _use_cpu_collectives() -> None:
    # Cross-process collectives on CPU need gloo (the default in recent JAX); keep a user's
    # other choice (e.g. "mpi").
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def check_port_free(address: str) -> None:
    """Raises ClusterError when the coordinator's port is taken on this host.

    Process 0 binds ``[::]:port``; JAX would crash on a taken port, so look first.
    """
    _, port = split_address(address)
    problem = port_problem(port)
    if problem:
        raise ClusterError(
            f"coordinator port {port} {problem} (coordinator_address={address}); pick a free "
            f"port (jaxpar launch --master-port, or {COORDINATOR_ADDRESS}) or stop the process "
            f"holding it (`ss -ltnp 'sport = :{port}'` shows it)."
        )


def _give_up(spec: ClusterSpec, timeout: float) -> None:
    """Watchdog: JAX blocks in C++ while waiting, so leave with a clear message instead."""
    sys.stderr.write(
        f"jaxpar: the cluster did not form within {timeout:g} s: process {spec.process_id} of "
        f"{spec.num_processes} waited at {spec.coordinator_address} for the others to join. "
        f"Check that all {spec.num_processes} processes started and reach that address, or "
        f"raise the timeout (--cluster-time-out / {CLUSTER_TIMEOUT}).\n"
    )
    sys.stderr.flush()
    os._exit(JOIN_TIMEOUT_EXIT_CODE)


def _bind_address(spec: ClusterSpec, requested: str | None) -> str | None:
    """Process 0's listening address (see ``coordinator_bind_address``); warns when it is all."""
    where = "bind_address=" if requested is not None else BIND_ADDRESS
    if requested is None:
        requested = os.environ.get(BIND_ADDRESS)
    bind = coordinator_bind_address(spec.coordinator_address, requested, where)
    if bind is None or bind.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::"):
        sys.stderr.write(
            f"jaxpar: warning: the coordinator of {spec.coordinator_address} listens on all "
            "interfaces, and JAX's coordination service has no authentication: anyone who "
            "reaches the port can join or disrupt the job. Restrict it with jaxpar launch "
            f"--bind-address IP (or {BIND_ADDRESS}=IP) and a firewall.\n"
        )
    return bind


def _connect(spec: ClusterSpec, timeout: float, bind_address: str | None = None) -> None:
    bind = None
    if spec.process_id == 0:
        check_port_free(spec.coordinator_address)
        bind = _bind_address(spec, bind_address)
    watchdog = threading.Timer(timeout, _give_up, (spec, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
            # JAX aborts the process when its own timeout passes; ours fires first.
            initialization_timeout=int(timeout) + 30,
            coordinator_bind_address=bind,
        )
    except RuntimeError as err:
        raise RuntimeError(
            f"jax.distributed.initialize failed for process {spec.process_id} of "
            f"{spec.num_processes} ({err}). It must run before any JAX operation: call "
            "jaxpar.distributed.initialize() first thing in the script."
        ) from None
    finally:
        watchdog.cancel()


def _exit_on_uncaught(previous=None):
    """An uncaught exception ends the process at once, skipping JAX's shutdown barrier.

    Otherwise the crashed process would sit in that barrier (up to 5 minutes) while the
    others wait for it inside a collective: nobody exits, and nobody can tell it crashed.
    """
    previous = previous or sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    return hook


def _mark(spec: ClusterSpec, stage: str) -> None:
    # Tells `jaxpar launch` which ranks are waiting / joined, so a timeout report can name
    # the ranks that never came.
    run_dir = os.environ.get(LAUNCH_RUN_DIR)
    if run_dir and os.path.isdir(run_dir):
        with open(os.path.join(run_dir, f"{stage}.{spec.process_id}"), "w") as f:
            f.write(str(os.getpid()))


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    source: str | None = None,
    rank_table: str | None = None,
    simulated_devices: int | None = None,
    timeout: float | None = None,
    bind_address: str | None = None,
) -> ClusterSpec:
    """Joins this process to its job (idempotent) and returns where it sits in it.

    Arguments that are not ``None`` win over the environment (see
    ``jaxpar.launch.detect_cluster`` for the sources and their order). ``simulated_devices``
    (default ``JAXPAR_SIMULATED_DEVICES``) gives the CPU backend that many devices; ``timeout``
    (default ``JAXPAR_CLUSTER_TIMEOUT``, else 600 s) bounds the wait for all processes: past
    it the process prints why and exits with status 124 rather than hang. ``bind_address``
    (default ``JAXPAR_COORDINATOR_BIND_ADDRESS``) is where process 0's coordinator listens;
    without it, a loopback or local-IP coordinator address listens on that interface only
    (see ``jaxpar.launch.ports.coordinator_bind_address``).

    Must run before any JAX operation in a multi-process job (``Trainer`` calls it too).

    Example:
        >>> spec = jaxpar.distributed.initialize()  # doctest: +SKIP
        >>> spec.process_id, spec.num_processes  # doctest: +SKIP
        (0, 1)
    """
    global _joined
    explicit = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                    process_id=process_id, local_device_ids=local_device_ids, source=source,
                    rank_table=rank_table)
    if _joined is not None:
        given = {k: v for k, v in explicit.items() if v is not None}
        return _check_same(_joined, detect_cluster(**given)) if given else _joined
    spec = detect_cluster(**explicit)
    count, wait = _options(simulated_devices, timeout)
    if count is not None:
        _apply_simulated_devices(count)
    if spec.is_multi_process and not jax.distributed.is_initialized():
        _use_cpu_collectives()
        _mark(spec, "waiting")
        _connect(spec, wait, bind_address)
        sys.excepthook = _exit_on_uncaught(sys.excepthook)
        _check_formed(spec)
        _mark(spec, "joined")
    _joined = spec
    return spec


def _check_formed(spec: ClusterSpec) -> None:
    """The job the coordinator formed has the processes this one was started for: launchers of
    several nodes given different ``--worker-num`` each start their ranks, and a rank told of
    more processes than process 0 was joins a smaller job (and would train in it, or wait)."""
    formed = jax.process_count()
    if formed != spec.num_processes:        # a misconfigured job, as a cluster that never forms: leave
        sys.stderr.write(f"jaxpar: process {spec.process_id} was started for a job of {spec.num_processes} "
                         f"processes (--worker-num / {NUM_PROCESSES}), but the coordinator at "
                         f"{spec.coordinator_address} formed a job of {formed}: give every node's launcher the same "
                         "--worker-num (and --local-worker-num), then start the job again.\n")
        sys.stderr.flush()
        os._exit(MISCONFIGURED_EXIT_CODE)


def _options(simulated_devices: int | None, timeout: float | None) -> tuple[int | None, float]:
    """(simulated devices, join timeout) from the arguments, else from the environment."""
    count = simulated_devices if simulated_devices is not None else _env_number(SIMULATED_DEVICES)
    if timeout is not None and (isinstance(timeout, bool) or not 0 < timeout < float("inf")):
        raise ValueError(f"timeout={timeout!r} must be a positive, finite number of seconds.")
    wait = timeout if timeout is not None else _env_number(CLUSTER_TIMEOUT, float)
    return count, wait or DEFAULT_TIMEOUT


def _check_same(joined: ClusterSpec, spec: ClusterSpec) -> ClusterSpec:
    fields = ("coordinator_address", "num_processes", "process_id")
    differ = [f for f in fields if getattr(joined, f) != getattr(spec, f)]
    if differ and spec.is_multi_process:
        f = differ[0]
        raise ValueError(
            f"jaxpar.distributed.initialize() was already called with {f}="
            f"{getattr(joined, f)!r}; now {f}={getattr(spec, f)!r}. A process joins one "
            "cluster: drop the new arguments or restart the process."
        )
    return joined


def is_initialized() -> bool:
    """True once ``initialize()`` (or ``jax.distributed.initialize``) has run here."""
    return _joined is not None or jax.distributed.is_initialized()


def shutdown() -> None:
    """Leaves the cluster (``jax.distributed.shutdown``); ``initialize()`` may run again."""
    global _joined
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    _joined = None


def every_process(values) -> np.ndarray:
    """Each process's ``values`` (a few ints, as many on every process) on every process, as rows
    ``[process, value]``: one all-gather, which every process of the job must reach (one process:
    its own row)."""
    from jax.experimental import multihost_utils

    mine = np.asarray(values, np.int32).ravel()
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)


def process_rows(
    global_batch_size: int, process_index: int | None = None, process_count: int | None = None
) -> slice:
    """The rows of the global batch that process ``process_index`` holds: its contiguous block.

    Example:
        >>> process_rows(32, process_index=1, process_count=4)
        slice(8, 16, None)
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive whole number of rows, a "
                         f"multiple of the {count} processes (e.g. {8 * count})")
    if not 0 <= index < count:
        raise ValueError(f"process_index={index} must be in 0..{count - 1} (process_count={count}).")
    if global_batch_size % count:
        # a live job's processes split their rows over their devices too, where the batch axes
        # span them: the advice is a multiple of both; the Trainer checks what the mesh needs
        per = jax.local_device_count() if process_count is None else 1
        need = count * per
        also = f"; a multiple of {need} also splits over each process's {per} devices" if per > 1 else ""
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split over {count} processes; use a multiple of "
            f"{count}, such as {(global_batch_size // need + 1) * need}{also}."
        )
    rows = global_batch_size // count
    return slice(index * rows, (index + 1) * rows)


def place(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works where the shardings span several
    processes: a leaf already laid out so is kept, a global array laid out otherwise is moved by
    XLA (a jitted identity), and a host value (a NumPy array, a scalar, an array of this
    process's devices, a PRNG key) becomes the global array each process builds its own
    devices' shards of (every process must hold the same value)."""
    return jax.tree.map(place_leaf, tree, shardings)


def place_leaf(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """One leaf of `place`."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return _reshard(sharding)(x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        data = jax.random.key_data(x)
        spec = tuple(sharding.spec) + (None,) * (data.ndim - len(sharding.spec))
        placed = place_leaf(data, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec)))
        return _wrap_keys(jax.random.key_impl(x), sharding)(placed)
    return _full_leaf(x, sharding)


@functools.lru_cache(maxsize=64)
def _wrap_keys(impl, sharding: jax.sharding.Sharding):
    return jax.jit(lambda data: jax.random.wrap_key_data(data, impl=impl), out_shardings=sharding)


def _process_major_sharding(devices: Sequence[Any]) -> jax.sharding.NamedSharding:
    """Rows split by process, in process order, replicated over each process's devices."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(jax.process_count(), -1)
    mesh = jax.sharding.Mesh(grid, ("process", "local"))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))


def _holds_my_block(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """True when this process's devices need exactly its own block of rows."""
    mine = process_rows(shape[0])
    needed = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        needed.update(range(*index[0].indices(shape[0])) if index else range(shape[0]))
    return needed == set(range(mine.start, mine.stop))


@functools.lru_cache(maxsize=64)
def _reshard(sharding: jax.sharding.Sharding):
    return jax.jit(lambda x: x, out_shardings=sharding)


def _global_leaf(local: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    local = np.asarray(local)
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    if _holds_my_block(sharding, shape):
        return jax.make_array_from_process_local_data(sharding, local, shape)
    # This process's devices need other processes' rows (e.g. 4 processes, data axis 2):
    # place rows by process first, then let XLA move them to the target layout.
    staged = _process_major_sharding(list(sharding.device_set))
    staged_array = jax.make_array_from_process_local_data(staged, local, shape)
    return _reshard(sharding)(staged_array)


def _full_leaf(full: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    full = np.asarray(full)
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def make_global_batch(batch: Any, sharding: Any, *, per_process: bool = True) -> Any:
    """Turns host arrays into global ``jax.Array`` batches with ``sharding``.

    Args:
        batch: a pytree of host arrays. With ``per_process=True`` (default) each leaf holds
            this process's rows, the ``process_rows`` block of the global batch; with
            ``per_process=False`` every process passes the identical full global batch.
        sharding: one ``jax.sharding.Sharding`` for all leaves, or a pytree of them.

    Example:
        >>> rows = tokens[jaxpar.distributed.process_rows(len(tokens))]  # doctest: +SKIP
        >>> batch = make_global_batch({"tokens": rows}, NamedSharding(mesh, P("data")))  # doctest: +SKIP
    """
    leaf_fn = _global_leaf if per_process else _full_leaf
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda leaf: leaf_fn(leaf, sharding), batch)
    return jax.tree.map(leaf_fn, batch, sharding)
