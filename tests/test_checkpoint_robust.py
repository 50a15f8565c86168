"""Checkpoints under stress: a writer killed mid-save, memory bounds on restore, two processes."""

import errno
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest

import jaxpar.checkpoint as ckpt
from jaxpar.checkpoint.state import flat_state
from workers_ckpt import common

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers_ckpt")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": common.ROOT}


def _tmp_dirs(directory):
    return [d for d in os.listdir(directory) if ".orbax-checkpoint-tmp" in d] if os.path.isdir(directory) else []


class _Saved:
    """The newest step a `kill_worker.py` has committed: its ``SAVED k`` lines (printed when a save
    returns), read in a thread. The tests wait on it and on a listing of the directory, a few
    microseconds, where opening the checkpoint with orbax every 2 ms cost a second of CPU per kill."""

    def __init__(self, proc: subprocess.Popen):
        self.step = 0
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if line.startswith("SAVED "):
                self.step = int(line.split()[1])


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_kill_during_save_keeps_the_last_complete_step(tmp_path, delay):
    """SIGKILL the writer while a step is being written; the previous step restores exactly."""
    rows, cols = 2048, 2048                       # 16 MiB per step
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "kill_worker.py"), str(directory), str(rows),
                             str(cols)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved = _Saved(proc)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if saved.step and _tmp_dirs(directory):   # a step is committed and a later one being written
                break
            time.sleep(0.002)
        time.sleep(delay)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    step = ckpt.latest_step(directory)
    assert step >= 1
    trainer = common.big_trainer(rows, cols, {"mesh": {"model": 8}, "rules": {"mlp": "model"}})
    assert ckpt.restore(trainer, directory)["step"] == step == trainer.step_count
    base = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(trainer.params["w"].get_value()), base + np.float32(step))
    # The next writer replaces the half-written step and saves normally.
    with ckpt.Checkpointer(directory, keep=None, asynchronous=False) as saver:
        trainer.step_count = step + 1
        saver.save(trainer.plan, trainer.state, trainer.mesh)
    assert ckpt.latest_step(directory) == step + 1 and not _tmp_dirs(directory)


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak`` minus ``start`` is the growth."""

    def __init__(self):
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def test_restore_allocates_only_the_target_shards(tmp_path):
    """8 devices → 8 devices: each device receives exactly its shards; the host never holds a full copy."""
    rows, cols = 2048, 4096                       # 32 MiB weight, adam: 96 MiB of state, 12 MiB per device
    config = {"mesh": {"model": 8}, "rules": {"mlp": "model"}}
    source = common.big_trainer(rows, cols, config, tx=optax.adam(1e-3))
    common.fill(source, np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32), 0)
    t0 = time.perf_counter()
    ckpt.save(source, tmp_path)
    save_s = time.perf_counter() - t0
    expected = {p: np.asarray(x) for p, x in flat_state(source).items() if x.ndim}
    del source
    target = common.big_trainer(rows, cols, config, tx=optax.adam(1e-3))
    gc.collect()
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        ckpt.restore(target, tmp_path)
        restore_s = time.perf_counter() - t0
    per_device = {d: 0 for d in jax.devices()}
    total = 0
    for path, x in flat_state(target).items():
        assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(target.mesh, x.sharding.spec), x.ndim)
        for shard in x.addressable_shards:
            assert shard.data.shape == x.sharding.shard_shape(x.shape), path
            per_device[shard.device] += shard.data.nbytes
        total += x.nbytes
        if path in expected:
            np.testing.assert_array_equal(np.asarray(x), expected[path])
    largest = rows * cols * 4
    assert max(per_device.values()) <= 3 * largest // 8 + 64          # w, mu, nu: one eighth each
    growth = rss.peak - rss.start
    print(f"\nsave {save_s:.2f} s, restore {restore_s:.2f} s, bytes/device {max(per_device.values()):,}, "
          f"state {total:,} B, host RSS growth during restore {growth:,} B")
    # CPU devices live in host memory, so the restored shards themselves count (``total``).
    # Read buffers come on top; a full host copy of the state would add another ``total``,
    # one full copy per device 8 x ``total``. Measured: ~total + 0.4 x total.
    assert growth < 2 * total, growth


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_save_and_restore(tmp_path):
    """Two processes (4 devices each) save one checkpoint of a mesh spanning both; it restores
    in the same two processes under data=8 and in one process under data=2,model=4."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    directory, out = tmp_path / "ckpt", tmp_path
    procs = [subprocess.Popen([sys.executable, os.path.join(WORKERS, "mp_worker.py"), str(directory), str(out),
                               f"127.0.0.1:{port}", str(i)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    results = [json.loads((out / f"rank_{i}.json").read_text()) for i in range(2)]
    assert all(r["processes"] == 2 and r["devices"] == 8 for r in results)
    assert results[0]["saved"] == results[1]["saved"]
    for r in results:
        for path, value in r["saved"].items():
            np.testing.assert_allclose(r["restored"][path], value, rtol=1e-6, err_msg=path)
    # every shard is written once, whole, by its first replica: under data=2 x model=4 the first
    # data row, process 0's devices, holds a first replica of every shard (process 1 the second)
    written = sorted(os.listdir(directory / "2" / "state"))
    assert "ocdbt.process_0" in written and "ocdbt.process_1" not in written, written
    trainer = common.gpt_trainer(common.MEGATRON_2x4)
    assert ckpt.restore(trainer, directory) == results[0]["meta"]
    for path, value in common.sums(trainer).items():
        np.testing.assert_allclose(value, results[0]["saved"][path], rtol=1e-6, err_msg=path)


@pytest.mark.slow
def test_twenty_random_kills_every_restart_loads_the_newest_complete_step(tmp_path):
    """SIGKILL the writer at 20 random moments in one directory; after each, the newest complete
    step restores exactly, and the next writer carries on from it."""
    rows, cols = 512, 512
    directory = tmp_path / "ckpt"
    rng = np.random.default_rng(1)
    trainer = common.big_trainer(rows, cols, {"mesh": {"model": 8}, "rules": {"mlp": "model"}})
    base = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    seen = []
    for _ in range(20):
        before = ckpt.latest_step(directory) or 0
        proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "kill_worker.py"), str(directory), str(rows),
                                 str(cols)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        saved = _Saved(proc)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None and not (
                    saved.step > before and _tmp_dirs(directory)):
                time.sleep(0.002)                     # this writer committed a step and writes the next
            time.sleep(float(rng.uniform(0.0, 0.08)))  # then kill it at a random moment
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        step = ckpt.latest_step(directory)
        assert step is not None and step > before
        assert ckpt.restore(trainer, directory)["step"] == step
        np.testing.assert_array_equal(np.asarray(trainer.params["w"].get_value()), base + np.float32(step))
        seen.append(step)
    assert seen == sorted(seen) and len(set(seen)) == 20


def fill_disk(monkeypatch, directory):
    """Writes under ``directory`` fail as on a full disk (ENOSPC), where orbax writes its JSON items
    (in its own threads when the save is asynchronous)."""
    from etils.epath import abstract_path

    write = abstract_path.Path.write_text

    def full(self, *args, **kwargs):
        if str(self).startswith(str(directory)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(abstract_path.Path, "write_text", full)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_full_disk_is_one_error_naming_the_directory_and_loses_nothing(tmp_path, monkeypatch, caplog, capsys,
                                                                        asynchronous):
    trainer = common.mlp_trainer()
    common.run(trainer, 1)
    directory = tmp_path / "ckpt"
    checkpointer = ckpt.Checkpointer(directory, keep=None, asynchronous=asynchronous)
    checkpointer.save(trainer.plan, trainer.state, trainer.mesh)
    checkpointer.wait()
    saved = common.values(trainer)
    common.run(trainer, 1)
    caplog.clear()
    with monkeypatch.context() as patch:
        fill_disk(patch, directory)
        with pytest.raises(ckpt.CheckpointWriteError) as failed:
            checkpointer.save(trainer.plan, trainer.state, trainer.mesh)   # asynchronous: the write fails in orbax's threads ...
            checkpointer.wait()                 # ... and is reported when the save is waited for
    error = failed.value
    assert error.errno == errno.ENOSPC and isinstance(error, OSError) and error.step == 2
    assert str(error).startswith(f"saving checkpoint step 2 to {directory} failed: [Errno 28] No space left "
                                 "on device") and "the steps before it ([1]) are intact" in str(error), str(error)
    # orbax's own tracebacks of the failure are not printed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert "Traceback" not in capsys.readouterr().err
    checkpointer.close()
    assert ckpt.latest_step(directory) == 1
    fresh = common.mlp_trainer()
    ckpt.restore(fresh, directory)
    common.assert_same(common.values(fresh), saved)
    ckpt.save(trainer, directory)           # space freed: the step saves, past the failed attempt's leftovers
    assert ckpt.latest_step(directory) == 2


def _rewrite(step_dir, key: str, change) -> None:
    """Change the stored values of one array of a step in place, as damaged bytes that still decode
    do (orbax's array chunks are zstd frames without a checksum): the files stay well-formed."""
    import tensorstore as ts

    array = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir}/state/"},
                     "path": f"{key}/"}).result()
    array.write(change(array.read().result())).result()


def _bump(x):
    x = x.copy()
    x[0, 3] += 1.0
    return x


def test_values_that_read_back_changed_are_named_not_restored(tmp_path):
    """Bytes of an array file that decode to other values raise no error in orbax: the checksums
    jaxpar saves with each step name the leaf, in any layout, and resume passes over the step."""
    trainer = common.mlp_trainer()
    common.run(trainer, 1)
    ckpt.save(trainer, tmp_path)
    step_one = common.values(trainer)
    common.run(trainer, 1)
    ckpt.save(trainer, tmp_path)
    _rewrite(tmp_path / "2", "params.up", _bump)
    damaged = (r"step 2 in .* is damaged \(ValueError: 1 array\(s\) read back without an error but with other "
               r"values than were saved \(their checksums differ\): params/up\)")
    for config in (None, {"mesh": {"data": 2, "model": 4}, "rules": {"mlp": "model"}}):     # any layout
        with pytest.raises(ckpt.CheckpointDamagedError, match=damaged):
            ckpt.restore(common.mlp_trainer(config), tmp_path)
    with pytest.raises(ckpt.CheckpointDamagedError, match=damaged + r".*Read another complete step \[1\]"):
        ckpt.merge(tmp_path, tmp_path / "merged")
    fresh = common.mlp_trainer()
    with ckpt.Checkpointer(tmp_path, resume="newest_intact") as checkpointer, \
            pytest.warns(UserWarning, match=r"step 2 .*params/up.*resuming from the previous step 1"):
        state, meta = checkpointer.resume(fresh.state, fresh.mesh)
        assert meta["step"] == 1
    fresh.state = state
    common.assert_same(common.values(fresh), step_one)


def test_an_unreadable_chunk_names_the_leaf_in_one_clean_line(tmp_path):
    """A chunk that no longer decodes fails inside orbax's array read, whose error is an index slice
    and the repr of a TensorStore method: the damage names the step, the leaf and tensorstore's account."""
    import tensorstore as ts

    trainer = common.mlp_trainer()
    for _ in range(2):
        common.run(trainer, 1)
        ckpt.save(trainer, tmp_path)
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/2/state/"}).result()
    store.write("opt_state.0.nu.up/0.0", b"\x28\xb5\x2f\xfd not a zstd frame").result()
    with pytest.raises(ckpt.CheckpointDamagedError) as caught:
        ckpt.restore(common.mlp_trainer(), tmp_path)
    message = str(caught.value)
    assert caught.value.leaf == "opt_state/0/nu/up" and "\n" not in message, message
    assert (f"checkpoint step 2 in {tmp_path} is damaged (optimizer-state leaf opt_state/0/nu/up: ValueError: "
            'FAILED_PRECONDITION: Error reading "opt_state.0.nu.up/0.0"') in message, message
    assert "ZSTD_decompressStream() failed" in message, message
    assert not any(junk in message for junk in ("<bound method", "TensorStore(", "slice(", "tensorstore_spec")), message
    assert "newest_intact" in message and f"jaxpar ckpt inspect {tmp_path}" in message, message
    assert ckpt.restore(common.mlp_trainer(), tmp_path, step=1)["step"] == 1     # the step before reads back


def _edit_meta(step_dir, change) -> None:
    """Rewrite a step's ``meta`` item (a JSON file) through ``change(meta)``, as a damaged byte
    in a key would: the file stays valid JSON."""
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _rename(record: dict, old: str, new: str) -> None:
    record[new] = record.pop(old)


def test_a_damaged_checksum_record_is_damage_not_a_skipped_check(tmp_path):
    """A checksum record that does not cover every leaf (a key renamed), names unknown leaves or
    tables, holds no pair of numbers, or a meta entry under an unknown name (the record's own
    name renamed), is a damaged step naming what is wrong: never a check silently left out.
    The row tables' record is checked the same way."""
    trainer = common.mlp_trainer()
    common.run(trainer, 1)
    table = {"table": np.arange(12, dtype=np.float32).reshape(3, 4)}
    with ckpt.Checkpointer(tmp_path / "intact") as writer:
        writer.save(trainer.plan, trainer.state, trainer.mesh, rows=table)
    cases = {
        "leaf_renamed": (lambda m: _rename(m["checksums"], "params/up", "params/uq"),
                         r"checksum record .*no checksums for \['params/up'\].*unknown leaves \['params/uq'\]"),
        "leaf_dropped": (lambda m: m["checksums"].pop("opt_state/0/mu/down"),
                         r"checksum record .*no checksums for \['opt_state/0/mu/down'\]"),
        "not_a_pair": (lambda m: m["checksums"].__setitem__("params/down", [1]),
                       r"checksum record .*not two 32-bit numbers: \['params/down'\]"),
        "record_renamed": (lambda m: _rename(m, "checksums", "checksumz"),
                           r"meta .*unknown entries \['checksumz'\]"),
        "table_renamed": (lambda m: _rename(m["row_checksums"], "['table']", "['tablf']"),
                          r"row checksum record .*no checksums for \[\"\['table'\]\"\].*unknown"),
    }
    for name, (change, match) in cases.items():
        directory = tmp_path / name
        subprocess.run(["cp", "-r", str(tmp_path / "intact"), str(directory)], check=True)
        _edit_meta(directory / "1", change)
        with pytest.raises(ckpt.CheckpointDamagedError, match=r"step 1 in .* is damaged \(.*" + match):
            ckpt.restore(common.mlp_trainer(), directory)
            ckpt.restore_rows(directory, 1)
    assert ckpt.restore(common.mlp_trainer(), tmp_path / "intact")["step"] == 1
    np.testing.assert_array_equal(ckpt.restore_rows(tmp_path / "intact", 1)["table"], table["table"])


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_two_processes_agree_when_one_meets_the_fault(tmp_path, tag):
    """Under `jaxpar launch`, 2 processes x 4 devices, each fault met by one process only
    (tests/workers_ckpt/agree_worker.py): a rename refused on process 0 while moving steps
    aside is the same error on both (neither waits at a barrier for the other); the newest step
    unreadable in process 1's files alone makes both resume the step before it; a real SIGTERM
    to process 1 alone during an evaluation-only script stops both before the same batch, with
    the step saved and exit code 0."""
    from jaxpar.launch.ports import free_port
    from workers.procs import Launch

    run = Launch(tmp_path, tag, ["--worker-num", 2, "--local-worker-num", 2, "--simulated-devices", 4,
                                 "--master-port", free_port(), "--cluster-time-out", 120],
                 script=os.path.join(WORKERS, "agree_worker.py"))
    try:
        ready = run.out_dir / "rank_1.ready"
        deadline = time.monotonic() + 300
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline and run.process.poll() is None, \
                f"{run.stderr}\n{run.log(0)[-3000:]}\n{run.log(1)[-3000:]}"
            time.sleep(0.1)
        os.kill(int(ready.read_text()), signal.SIGTERM)       # process 1 only
        code = run.wait(timeout=90)
    finally:
        run.close()
    logs = f"{run.stderr}\n--- rank 0\n{run.log(0)[-3000:]}\n--- rank 1\n{run.log(1)[-3000:]}"
    assert code == 0, logs
    first, second = run.results()
    assert first["processes"] == 2
    # 1. the same error on both processes
    assert first["rename"] == second["rename"] and "could not be moved aside" in first["rename"], logs
    assert "Permission denied" in first["rename"], first["rename"]
    # 2. both resumed the step before the one process 1 could not read, and set that one aside
    newest = first["newest"]
    assert first["resumed"] == second["resumed"] == newest - 1, logs
    assert f"damaged-{newest}" in first["damage_entries"] and str(newest) not in first["damage_entries"]
    assert "ZSTD" in second["damage_warnings"][0], second          # process 1 met the damage itself ...
    assert "process(es) [1] of 2 could not read" in first["damage_warnings"][0], first   # ... process 0 heard
    # 3. both stopped before the same batch, soon after the signal, the step saved
    assert first["evaluate"] == second["evaluate"] == "Preempted step 2", logs
    assert first["evaluated"] == second["evaluated"] < 100, (first["evaluated"], second["evaluated"])
    assert ckpt.latest_step(tmp_path / "out" / "evaluate") == 2
    assert all("preempted (SIGTERM): saved step 2" in run.log(r) for r in (0, 1)), logs
