"""Compiled programs kept on disk by the processes JAX's persistent cache leaves out
(`jaxpar.executables`). The restart of a real job (processes 1-3 read their step back) is in
tests/test_checkpoint_local.py; here one process stands in for process 1 of a job."""

import os
import uuid
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import executables
from jaxpar.checkpoint import checksum


EVENTS: list = []      # the programs read and written (jax.monitoring has no way to unregister a listener)
jax.monitoring.register_event_listener(lambda event, **_: EVENTS.append(event) if event.startswith("/jaxpar/") else None)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """This process keeps its programs in ``tmp_path`` (as process 1 of a job would), and the
    programs read and written are counted from here."""
    monkeypatch.setattr(executables, "cache_dir", lambda: str(tmp_path))
    EVENTS.clear()
    return tmp_path, EVENTS


# The suite's JAX cache may hold a program compiled before, which jaxpar does not keep (see
# `compile_lowered`): each test's programs are its own (a constant, a shape no other run has).
UNIQUE = 1 + uuid.uuid4().int % 100_000


def _entries(folder) -> list[str]:
    """The programs kept in ``folder`` (not the claims' lock files, nor ``.none`` markers)."""
    return [n for n in os.listdir(folder) if not n.endswith((".lock", ".none"))]


def _program(k: int):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), sharding)
    return jax.jit(lambda x: (jnp.sin(x) @ x.T).sum() * (UNIQUE + k)), x


def test_one_process_keeps_nothing_and_the_function_is_its_own():
    fn = jax.jit(lambda x: x + 1)
    assert executables.cache_dir() is None
    assert executables.on_disk(fn) is fn


def test_a_restarted_process_reads_its_program_back(kept):
    folder, events = kept
    fn, x = _program(1)
    first = executables.on_disk(fn)
    assert isinstance(first, executables.OnDisk)
    want = first(x)
    assert events == [executables.WRITTEN_EVENT] and len(_entries(folder)) == 1
    assert executables.compiled_program(first, x) is executables.compiled_program(first, x)  # kept, not compiled again

    again = executables.on_disk(jax.jit(lambda x: (jnp.sin(x) @ x.T).sum() * (UNIQUE + 1)))   # a new process's function
    assert float(again(x)) == float(want)
    assert events == [executables.WRITTEN_EVENT, executables.READ_EVENT]

    # the same program on the devices in another order is another program
    devices = np.array(jax.devices()[:4])[::-1].reshape(2, 2)
    y = jax.device_put(np.asarray(x), NamedSharding(jax.sharding.Mesh(devices, ("data", "model")), x.sharding.spec))
    assert float(executables.on_disk(fn)(y)) == float(want)
    assert events[-1] == executables.WRITTEN_EVENT and len(_entries(folder)) == 2


def test_a_damaged_entry_is_compiled_again_with_a_warning(kept):
    folder, events = kept
    fn, x = _program(2)
    want = float(executables.on_disk(fn)(x))
    (entry,) = _entries(folder)
    with open(folder / entry, "r+b") as f:
        f.truncate(100)
    with pytest.warns(RuntimeWarning, match="could not be loaded.*compiling it again"):
        assert float(executables.on_disk(fn)(x)) == want
    # removed (here JAX's own caches gave the program back, which is not kept), or kept anew whole
    assert not (folder / entry).exists() or os.path.getsize(folder / entry) > 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the next start meets no damaged entry
        assert float(executables.on_disk(jax.jit(lambda x: (jnp.sin(x) @ x.T).sum() * (UNIQUE + 2)))(x)) == want


def _forget(fn: executables.OnDisk) -> None:
    fn.programs.clear()
    fn.last = None


def test_checkpoint_checksums_are_kept_too(kept):
    _, events = kept
    x = jax.device_put(np.arange(2 * UNIQUE, dtype=np.float32), NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data")))
    _forget(checksum._leaf_jit)       # another test of this process may have kept it in memory
    before = checksum.checksums({"w": x})
    assert executables.WRITTEN_EVENT in events
    _forget(checksum._leaf_jit)       # as a restarted process: nothing in memory
    assert checksum.checksums({"w": x}) == before and events[-1] == executables.READ_EVENT


def test_a_program_from_jax_cache_is_not_kept(kept):
    """XLA:CPU serializes a program JAX loaded from its persistent cache without its machine code
    (one read back from such an entry fails when it runs): only compiled programs are kept."""
    folder, events = kept
    fn, x = _program(3)
    want = float(fn(x))           # compiled, and written to JAX's cache (this is its process 0)
    jax.clear_caches()            # as a new process: JAX's cache on disk only
    assert float(executables.on_disk(jax.jit(lambda x: (jnp.sin(x) @ x.T).sum() * (UNIQUE + 3)))(x)) == want
    assert events == [] and _entries(folder) == []


def test_a_program_that_drops_an_argument_is_read_back_and_one_with_a_host_callback_is_not_kept(kept):
    folder, events = kept
    _, x = _program(4)
    unused = jax.jit(lambda x, y: x.sum() * (UNIQUE + 4))        # y is not used: no input sharding
    want = float(executables.on_disk(unused)(x, x))
    assert float(executables.on_disk(jax.jit(lambda x, y: x.sum() * (UNIQUE + 4)))(x, x)) == want
    assert events == [executables.WRITTEN_EVENT, executables.READ_EVENT]

    def shown(x):
        jax.debug.print("{}", x.sum() * (UNIQUE + 5))
        return x + 1
    before = sorted(_entries(folder))
    executables.on_disk(jax.jit(shown))(x)
    assert sorted(_entries(folder)) == before and events[-1] == executables.READ_EVENT


def test_a_claim_of_a_dead_process_is_void_and_a_live_one_is_waited_for(kept, monkeypatch):
    """The processes of a job share the folder: on a CPU one claims a program (an exclusive
    flock on ``<key>.lock``) and compiles it while the others wait to read it; the claim of a
    process that ended is gone with it, and a live one is waited for only `WAIT_S` seconds."""
    import fcntl
    import subprocess
    import sys
    import time

    folder, events = kept
    fn, x = _program(4)
    lowered = fn.lower(x)
    path = os.path.join(folder, executables._key(lowered.as_text(), (x,), ""))
    os.makedirs(folder, exist_ok=True)
    subprocess.run([sys.executable, "-c", f"import fcntl, os; fd = os.open({path + '.lock'!r}, os.O_CREAT | os.O_RDWR); "
                    "fcntl.flock(fd, fcntl.LOCK_EX); os._exit(0)"], check=True)     # claimed, then killed
    want = float(executables.compile_lowered(lowered, (x,))(x))                     # not waited for
    assert events == [executables.WRITTEN_EVENT] and os.path.exists(path)
    os.remove(path)
    held = os.open(path + ".lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)                   # a live claim (another open file: another claimer)
    monkeypatch.setattr(executables, "WAIT_S", 0.5)
    start = time.monotonic()
    assert float(executables.compile_lowered(fn.lower(x), (x,))(x)) == want
    assert time.monotonic() - start >= 0.5              # waited, then compiled itself
    os.close(held)


def test_a_claimer_that_kept_nothing_lets_each_process_compile_its_own(kept, monkeypatch):
    folder, events = kept
    fn, x = _program(5)
    monkeypatch.setattr(executables, "_write", lambda path, compiled: False)   # (a disk that refuses it)
    lowered = fn.lower(x)
    path = os.path.join(folder, executables._key(lowered.as_text(), (x,), ""))
    want = float(executables.compile_lowered(lowered, (x,))(x))
    assert os.path.exists(path + ".none") and not os.path.exists(path)
    assert float(executables.compile_lowered(fn.lower(x), (x,))(x)) == want     # no claim: compiled here
