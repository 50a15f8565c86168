"""Compiled programs kept on disk by every process of a job, where JAX keeps process 0's only.

JAX writes its persistent compilation cache from process 0 alone, and on some backends (XLA:CPU)
each process computes another cache key for the same program. So when a job restarts after a
failure, process 0 loads its step from the cache while every other process compiles it again,
and the whole job waits at the step's first collective for the slowest of them; the same again at
the first checkpoint save (the checksum programs).

`compile_lowered` is ``lowered.compile()`` that, in a process other than 0 of a job whose JAX
compilation cache is on (``jax_compilation_cache_dir`` set to a local folder,
``jax_enable_compilation_cache`` true), first looks for the program in
``<cache dir>/jaxpar-executables/process-<i>-of-<n>/`` and writes what it compiles there
(`jax.experimental.serialize_executable`). `OnDisk` wraps a ``jax.jit`` function so that each
argument signature's program goes through `compile_lowered`; `on_disk` gives the function itself
where there is nothing to keep (one process, process 0, no cache), so the step's dispatch is
unchanged there.

The key of a program is a SHA-256 of its StableHLO, the devices of its arguments' shardings in
order, the compiler options, XLA's flags, the JAX and jaxlib versions, the backend's platform
version and this process's index and count; a program read back must also take the arguments'
shardings, else it is compiled again. A damaged or unreadable entry is compiled again and
rewritten, with a warning. Reading an entry unpickles it: keep the cache folder as private as the
checkpoints (JAX's own cache holds executables too).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib

FOLDER = "jaxpar-executables"
# jax.monitoring events, one for each program read back and each written
READ_EVENT, WRITTEN_EVENT = "/jaxpar/executables/read", "/jaxpar/executables/written"


_cache_hits = threading.local()     # programs this thread had from JAX's persistent cache


def _count_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _cache_hits.count = getattr(_cache_hits, "count", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


def cache_dir() -> str | None:
    """This process's folder of programs, or None where JAX's cache serves (one process, process
    0), where it is off, or where it is not a local folder (``gs://...``: JAX's cache only)."""
    if jax.process_count() == 1 or jax.process_index() == 0:
        return None
    if not jax.config.jax_enable_compilation_cache:
        return None
    base = jax.config.jax_compilation_cache_dir
    if not base or "://" in str(base):
        return None
    return os.path.join(str(base), FOLDER, f"process-{jax.process_index()}-of-{jax.process_count()}")


def _placement(x) -> str:
    """The devices, in order, and the layout an argument's sharding puts it on (part of the key)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return f"host{getattr(x, 'shape', ())}"
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        return f"{[d.id for d in mesh.devices.flat]}{mesh.axis_names}{sharding.spec}"
    return repr(sharding)


def _key(lowered: jax.stages.Lowered, args: Sequence, salt: str) -> str:
    backend = jax.devices()[0].client
    parts = [lowered.as_text(), salt, os.environ.get("XLA_FLAGS", ""), jax.__version__, jaxlib.__version__,
             backend.platform, backend.platform_version, f"{jax.process_index()}/{jax.process_count()}",
             *(_placement(x) for x in jax.tree.leaves(args))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _takes(compiled: jax.stages.Compiled, args: Sequence) -> bool:
    """Whether a program read back takes ``args`` where they are (its input shardings)."""
    wanted = jax.tree.leaves(compiled.input_shardings[0])
    leaves = jax.tree.leaves(args)
    if len(wanted) != len(leaves):
        return False
    return all(getattr(x, "sharding", None) is None or s.is_equivalent_to(x.sharding, len(x.shape))
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


def _read(path: str, lowered: jax.stages.Lowered, args: Sequence) -> jax.stages.Compiled | None:
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(blob, lowered.in_tree, lowered.out_tree,
                                                             execution_devices=_devices(args))
    except Exception as e:      # a damaged or foreign entry: compiled again below and rewritten
        warnings.warn(f"jaxpar: the compiled program {path} could not be loaded ({type(e).__name__}: {e}); "
                      "compiling it again", RuntimeWarning, stacklevel=3)
        return None
    return compiled if _takes(compiled, args) else None


def _write(path: str, compiled: jax.stages.Compiled) -> bool:
    from jax.experimental import serialize_executable

    try:
        blob = serialize_executable.serialize(compiled)[0]
    except (ValueError, NotImplementedError):      # a program JAX cannot serialize: compiled each time
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


def compile_lowered(lowered: jax.stages.Lowered, args: Sequence = (), salt: str = "") -> jax.stages.Compiled:
    """``lowered.compile()``, kept on disk by this process where `cache_dir` names a folder:
    read back when a program of the same key (see the module) that takes ``args`` (the arguments
    it was lowered for) is there, else compiled and written. ``salt``: what else decides the
    program (the compiler options given to ``jax.jit``)."""
    folder = cache_dir()
    if folder is None or _devices(args) is None:
        return lowered.compile()
    path = os.path.join(folder, _key(lowered, args, salt))
    compiled = _read(path, lowered, args)
    if compiled is not None:
        jax.monitoring.record_event(READ_EVENT)
        return compiled
    hits = getattr(_cache_hits, "count", 0)
    compiled = lowered.compile()
    # an XLA:CPU program JAX loaded from its own cache serializes without its machine code (a
    # program read back from such an entry fails when it runs): only what was compiled is kept
    if getattr(_cache_hits, "count", 0) == hits and _write(path, compiled):
        jax.monitoring.record_event(WRITTEN_EVENT)
    return compiled


class OnDisk:
    """A ``jax.jit`` function whose program for each argument signature comes from
    `compile_lowered`; ``lower`` and ``trace`` are the function's. Build it with `on_disk`."""

    __slots__ = ("fn", "salt", "programs", "last")

    def __init__(self, fn, salt: str = ""):
        self.fn, self.salt, self.programs, self.last = fn, salt, {}, None

    def __call__(self, *args):
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
        """The program for ``args``: the one kept since its first call, else read or compiled."""
        compiled = self.programs.get(self._signature(args))
        return self.compile_for(args) if compiled is None else compiled

    @staticmethod
    def _signature(args) -> tuple:
        leaves, treedef = jax.tree.flatten(args)
        return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                               getattr(x, "sharding", None)) for x in leaves)

    def compile_for(self, args: tuple, lowered: jax.stages.Lowered | None = None) -> jax.stages.Compiled:
        """The program for ``args`` (lowered here unless given), kept for the calls that follow."""
        lowered = self.fn.lower(*args) if lowered is None else lowered
        compiled = self.programs[self._signature(args)] = compile_lowered(lowered, args, self.salt)
        return compiled

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


def on_disk(fn: Callable, salt: Any = "") -> Callable:
    """``fn`` (a ``jax.jit`` function without static arguments) as an `OnDisk` where this
    process keeps programs (`cache_dir`), else ``fn`` itself. ``salt``: as `compile_lowered`'s."""
    return fn if cache_dir() is None else OnDisk(fn, str(salt))


__all__ = ["FOLDER", "READ_EVENT", "WRITTEN_EVENT", "OnDisk", "cache_dir", "compile_lowered", "compiled_program", "on_disk"]
