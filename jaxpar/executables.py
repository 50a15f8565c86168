"""Compiled programs shared by the processes of a job on one host, where JAX keeps process 0's only.

JAX writes its persistent compilation cache from process 0 alone, and on some backends (XLA:CPU)
each process computes another cache key for the same program. So every process of a job compiled
every program itself — the same program, once per process — and when a job restarted after a
failure, process 0 loaded its step from the cache while every other process compiled it again,
the whole job waiting at the step's first collective for the slowest of them.

`compile_lowered` is ``lowered.compile()`` that, in a job of several processes whose JAX
compilation cache is on (``jax_compilation_cache_dir`` set to a local folder,
``jax_enable_compilation_cache`` true), first looks for the program in
``<cache dir>/jaxpar-executables/job-of-<n>/<host>/``, the folder the job's processes on this
host share (and any job of as many processes with the same cache folder). On a CPU, on a miss,
one process claims the program (an exclusive `fcntl.flock` on ``<key>.lock``, which the kernel
releases when the process ends, however it ends), compiles it and writes it
(`jax.experimental.serialize_executable`); the others wait and read it (an XLA:CPU program loads
and runs in any process of the job: the same partitioned program on the same global devices). A
live claim is waited for `WAIT_S` seconds at most; a claimer that could keep nothing leaves
``<key>.none``, and then every process compiles its own. On other backends, whose compiles may
wait for the job's other processes (GPU autotuning shared between them), each process compiles
and writes, and reads what is there. `OnDisk` wraps a ``jax.jit`` function so that each argument
signature's program goes through `compile_lowered`; `on_disk` gives the function itself where
there is nothing to share (one process, no cache), so the step's dispatch is unchanged there.

The key of a program is a SHA-256 of its StableHLO, the devices of its arguments' shardings in
order, the compiler options, XLA's flags, the JAX and jaxlib versions, the backend's platform
version, the device kind (on a CPU the host's instruction-set flags) and the job's process
count; a program read back must also take the arguments' shardings, else it is compiled again.
A damaged or unreadable entry is removed and compiled again, with a warning. Kept are only
programs compiled here, without host callbacks (`jax.debug.print`, `jax.pure_callback`:
pointers into the process that wrote them). The folder only grows, as JAX's cache does by
default: delete it with the cache. Reading an entry unpickles it: keep the cache folder as
private as the checkpoints (JAX's own cache holds executables too).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib

FOLDER = "jaxpar-executables"
# jax.monitoring events, one for each program read back and each written
READ_EVENT, WRITTEN_EVENT = "/jaxpar/executables/read", "/jaxpar/executables/written"


# What this thread's compiles did (JAX records its events on the compiling thread): programs
# JAX loaded from its persistent cache, and backend compiles (JAX records one for a load too).
_seen = threading.local()
_HIT, _COMPILE = "/jax/compilation_cache/cache_hits", "/jax/core/compile/backend_compile_duration"
# a host callback (jax.debug.print, pure_callback) is baked into the program as a pointer into
# this process: such a program is never kept (JAX's cache keeps none either)
_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")


def _count(event: str, *_, **__) -> None:
    if event in (_HIT, _COMPILE):
        setattr(_seen, event, getattr(_seen, event, 0) + 1)


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count)


def _counts() -> tuple[int, int]:
    return getattr(_seen, _HIT, 0), getattr(_seen, _COMPILE, 0)


def cache_dir() -> str | None:
    """The folder of programs this job's processes share on this host, or None where JAX's cache
    serves alone (one process), where it is off, or where it is not a local folder
    (``gs://...``: JAX's cache only)."""
    if jax.process_count() == 1:
        return None
    if not jax.config.jax_enable_compilation_cache:
        return None
    base = jax.config.jax_compilation_cache_dir
    if not base or "://" in str(base):
        return None
    return os.path.join(str(base), FOLDER, f"job-of-{jax.process_count()}", _host())


def _host() -> str:
    import socket

    return socket.gethostname()


def _placement(x) -> str:
    """The devices, in order, and the layout an argument's sharding puts it on (part of the key)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return f"host{getattr(x, 'shape', ())}"
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        return f"{[d.id for d in mesh.devices.flat]}{mesh.axis_names}{sharding.spec}"
    return repr(sharding)


@functools.cache
def _machine() -> str:
    """What the program's machine code was made for beyond the backend's version: the device
    kind, and on a CPU the host's instruction-set flags (a folder shared between hosts of
    another kind must not hand one host the other's code)."""
    device = jax.devices()[0]
    flags = ""
    if device.platform == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
        except OSError:
            import platform

            flags = platform.processor() or platform.machine()
    return f"{device.device_kind}|{flags.strip()}|{os.environ.get('LIBTPU_INIT_ARGS', '')}"


def _key(text: str, args: Sequence, salt: str) -> str:
    backend = jax.devices()[0].client
    parts = [text, salt, os.environ.get("XLA_FLAGS", ""), jax.__version__, jaxlib.__version__,
             backend.platform, backend.platform_version, _machine(), f"of {jax.process_count()}",
             *(_placement(x) for x in jax.tree.leaves(args))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _takes(compiled: jax.stages.Compiled, args: Sequence) -> bool:
    """Whether a program read back takes ``args`` where they are (its input shardings; None for
    an argument the program does not use)."""
    wanted = jax.tree.leaves(compiled.input_shardings[0], is_leaf=lambda s: s is None)
    leaves = jax.tree.leaves(args)
    if len(wanted) != len(leaves):
        return False
    return all(s is None or getattr(x, "sharding", None) is None or s.is_equivalent_to(x.sharding, len(x.shape))
               for s, x in zip(wanted, leaves))


def _devices(args: Sequence) -> list | None:
    """The devices a program of ``args`` runs on, in the program's order: the mesh's of the first
    argument on a mesh, else a single device's; None when no argument says (not kept then)."""
    for x in jax.tree.leaves(args):
        sharding = getattr(x, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return list(mesh.devices.flat)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            return list(sharding.device_set)
    return None


def _read(path: str, lowered: jax.stages.Lowered, args: Sequence, devices: list) -> jax.stages.Compiled | None:
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"jaxpar: the compiled program {path} could not be read ({e}); compiling it again",
                      RuntimeWarning, stacklevel=3)
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(blob, lowered.in_tree, lowered.out_tree,
                                                             execution_devices=devices)
    except Exception as e:      # a damaged or foreign entry: removed, compiled again below (and kept anew)
        warnings.warn(f"jaxpar: the compiled program {path} could not be loaded ({type(e).__name__}: {e}); "
                      "compiling it again", RuntimeWarning, stacklevel=3)
        try:
            os.remove(path)
        except OSError:
            pass
        return None
    return compiled if _takes(compiled, args) else None


def _write(path: str, compiled: jax.stages.Compiled) -> bool:
    from jax.experimental import serialize_executable

    try:
        blob = serialize_executable.serialize(compiled)[0]
    except Exception as e:      # a program this backend or pickle cannot write: compiled at each start
        warnings.warn(f"jaxpar: the compiled program cannot be kept ({type(e).__name__}: {e}); a restart of "
                      "this process compiles it again", RuntimeWarning, stacklevel=3)
        return False
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)       # whole or absent: a reader never sees half an entry
    except OSError as e:
        warnings.warn(f"jaxpar: could not keep the compiled program in {folder} ({e}); a restart of this "
                      "process compiles it again", RuntimeWarning, stacklevel=3)
        return False
    return True


# How long a process waits for another one of its job to compile a program it claimed, at most
# (then it compiles the program itself). A claim is an exclusive `fcntl.flock` on ``<key>.lock``,
# which the kernel releases when its process ends, however it ends.
WAIT_S = 900.0


def _compile_and_keep(lowered: jax.stages.Lowered, path: str) -> jax.stages.Compiled:
    hits, compiles = _counts()
    compiled = lowered.compile()
    # Only a program compiled here is kept: an XLA:CPU program JAX loaded from its own cache
    # serializes without its machine code (one read back from such an entry fails when it runs),
    # and one JAX's in-memory caches handed back (no event) may have been such a load.
    now_hits, now_compiles = _counts()
    if now_hits == hits and now_compiles > compiles and _write(path, compiled):
        jax.monitoring.record_event(WRITTEN_EVENT)
    return compiled


def compile_lowered(lowered: jax.stages.Lowered, args: Sequence = (), salt: str = "") -> jax.stages.Compiled:
    """``lowered.compile()``, shared by the processes of a job on this host where `cache_dir`
    names a folder: read back when a program of the same key (see the module) that takes
    ``args`` (the arguments it was lowered for) is there. Else, on a CPU, one process claims it,
    compiles and writes it while the others wait to read it (a process that claimed and wrote
    nothing leaves ``<key>.none``: then each compiles its own); on other backends (whose compiles
    may wait for the other processes: GPU autotuning shared between them) each process compiles,
    and writes. ``salt``: what else decides the program (the compiler options given to ``jax.jit``)."""
    folder = cache_dir()
    devices = None if folder is None else _devices(args)
    text = None if devices is None else lowered.as_text()
    if text is None or _CALLBACK.search(text):
        return lowered.compile()
    path = os.path.join(folder, _key(text, args, salt))
    compiled = _read(path, lowered, args, devices)
    if compiled is not None:
        jax.monitoring.record_event(READ_EVENT)
        return compiled
    if devices[0].platform != "cpu" or os.path.exists(path + ".none"):
        return _compile_and_keep(lowered, path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:            # a folder this process cannot write: it compiles alone
        return lowered.compile()
    try:
        import fcntl

        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break           # claimed (or the claimer is done): read what it wrote, else compile
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return _compile_and_keep(lowered, path)    # its compile is overdue: this one's own
                time.sleep(0.05)
            except OSError:     # a filesystem without locks: each process compiles
                return _compile_and_keep(lowered, path)
        compiled = _read(path, lowered, args, devices)
        if compiled is not None:
            jax.monitoring.record_event(READ_EVENT)
            return compiled
        if os.path.exists(path + ".none"):      # the claimer kept nothing: no more turns
            return _compile_and_keep(lowered, path)
        compiled = _compile_and_keep(lowered, path)
        if not os.path.exists(path):
            with contextlib.suppress(OSError):
                open(path + ".none", "w").close()
        return compiled
    finally:
        os.close(fd)            # (releases the claim)


class OnDisk:
    """A ``jax.jit`` function (called with positional arguments only) whose program for each
    argument signature comes from `compile_lowered` where the job's processes share programs, else the
    function's own dispatch; ``lower`` and ``trace`` are the function's. `on_disk` gives the
    function itself where nothing is kept when it is built."""

    __slots__ = ("fn", "salt", "programs", "last")

    def __init__(self, fn, salt: str = ""):
        self.fn, self.salt, self.programs, self.last = fn, salt, {}, None

    def __call__(self, *args):
        if not self.programs and cache_dir() is None:    # nothing kept here: the function's own dispatch
            return self.fn(*args)
        # the program of the last call first: a step's arguments keep their signature, and the
        # program checks them itself before it runs (a TypeError or ValueError: another signature)
        if self.last is not None:
            try:
                return self.last(*args)
            except (TypeError, ValueError):
                pass
        self.last = self.compiled(*args)
        return self.last(*args)

    def compiled(self, *args) -> jax.stages.Compiled:
        """The program for ``args``: the one kept since its first call, else read or compiled (and kept)."""
        signature = self._signature(args)
        compiled = self.programs.get(signature)
        if compiled is None:
            compiled = self.programs[signature] = compile_lowered(self.fn.lower(*args), args, self.salt)
        return compiled

    @staticmethod
    def _signature(args) -> tuple:
        leaves, treedef = jax.tree.flatten(args)
        return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                               getattr(x, "sharding", None)) for x in leaves)

    def lower(self, *args, **kwargs):
        return self.fn.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.fn.trace(*args, **kwargs)


def compiled_program(fn: Callable, *args) -> jax.stages.Compiled:
    """The program ``fn`` runs for ``args``: an `OnDisk`'s (or a wrapper's with a ``compiled``
    method) is the one it keeps, not a second compile; a ``jax.jit`` function's comes from
    ``lower(*args).compile()``, which JAX's in-memory caches answer with the program its calls run."""
    compiled = getattr(fn, "compiled", None)
    return compiled(*args) if compiled is not None else fn.lower(*args).compile()


def jit_on_disk(fn: Callable, *, compiler_options: dict | None = None, **jit_kwargs) -> Callable:
    """``jax.jit(fn, compiler_options=..., **jit_kwargs)`` through `on_disk`, its programs' key
    salted with those compiler options (they decide the program as much as its StableHLO)."""
    return on_disk(jax.jit(fn, compiler_options=compiler_options or None, **jit_kwargs),
                   salt=sorted((compiler_options or {}).items()))


def on_disk(fn: Callable, salt: Any = "") -> Callable:
    """``fn`` (a ``jax.jit`` function without static arguments) as an `OnDisk` where the job's
    processes share programs (`cache_dir`), else ``fn`` itself. ``salt``: as `compile_lowered`'s."""
    return fn if cache_dir() is None else OnDisk(fn, str(salt))


__all__ = ["FOLDER", "READ_EVENT", "WRITTEN_EVENT", "OnDisk", "cache_dir", "compile_lowered", "compiled_program", "jit_on_disk",
           "on_disk"]
