"""The fast checkpoint tiers: each process's newest steps on node-local storage, and a copy of
them on a peer process of another host.

A `LocalTier` (``CheckpointConfig(local_dir=..., local_every=N)``) saves, every ``N`` steps, the
shards this process holds of every leaf of the `TrainState` — each distinct shard once — with
the step's data position and a row source's tables. The loop waits only for the device-to-host
copy; a background thread writes the files, and then sends them to this process's peer
(`jaxpar.checkpoint.peer`). Layout on disk, under ``local_dir``::

    process-<p>/own/step-<s>/{manifest.json, shards.bin[, rows.npz]}   this process's steps
    process-<p>/peer-<q>/step-<s>/...                                   process q's, held for it

A step is written into a ``tmp-...`` directory, synced and renamed into place, so a kill during
a write leaves no step that a restore could take (the leftovers are removed at the next start).
Every shard and row table carries its CRC-32 in the manifest; a read checks every byte.

Retention is agreed: at each save the processes exchange their newest written step (one small
collective, at the same step on every process) and each drops its own and held steps older
than the oldest of those, so a step every process can read is always kept (a kill during a
write leaves the one before it).

Recovery (`LocalTier.resume`): the processes exchange which steps they hold, own and for
others; the newest step every process can get (its own copy, else its peer's) is read when it
is at least as new as the persistent tier's newest. Each process reads its own copy, or —
missing (a replaced host, a wiped disk) or damaged (moved aside to ``damaged-step-<s>``) —
fetches its peer's copy back first. The arrays are put straight into the target state's
shards: any layout whose shards on this process lie within what it saved (the same mesh, or
one this process's saved shards cover, such as a ZeRO level that splits further). A step one
process cannot use (no copy intact, or a layout its shards do not cover) is unusable on every
process alike: the persistent tier is resumed instead, with a warning saying why.

The peer of a process is the process of the same local rank on the next host (hosts in the
order of their first process; a host is ``JAXPAR_HOST_ID`` when set, else the host name), so a
lost host's steps live on in the next one. In a job on one host the peer is the next process:
a copy that outlives a lost process, not a lost host.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import socket
import sys
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.checkpoint import peer as wire
from jaxpar.checkpoint import state as st
from jaxpar.distributed import every_process

FORMAT = 1
RUN_ID_BYTES = 16
RUN_ID_FILE = "jaxpar-local-tier-run"   # in the persistent directory: which run the local steps belong to
SOURCES = 3         # held copies of at most this many other processes are reported at a resume
STEPS = 3           # ... and at most this many steps of each


class LocalDamage(Exception):
    """A local step that does not read back whole (a file missing or short, a CRC that differs)."""


class LayoutNotCovered(Exception):
    """The target's shards on this process are not within what this process saved."""


def host_id() -> str:
    """The host a process counts as: ``JAXPAR_HOST_ID`` when set (simulated hosts, containers
    that share a host name), else the host name."""
    return os.environ.get("JAXPAR_HOST_ID") or socket.gethostname()


def peers(hosts: list[str]) -> dict[int, int]:
    """``{process: the process that holds its copy}`` for the processes' hosts: the same local
    rank on the next host (a host with fewer processes takes them round), or the next process
    when every process is on one host.

    >>> peers(["a", "a", "b", "b"])
    {0: 2, 1: 3, 2: 0, 3: 1}
    >>> peers(["a", "a", "a"])
    {0: 1, 1: 2, 2: 0}
    """
    order = list(dict.fromkeys(hosts))
    if len(hosts) < 2:
        return {}
    if len(order) == 1:
        return {p: (p + 1) % len(hosts) for p in range(len(hosts))}
    members = {h: [p for p, x in enumerate(hosts) if x == h] for h in order}
    out = {}
    for i, h in enumerate(order):
        nxt = members[order[(i + 1) % len(order)]]
        for rank, p in enumerate(members[h]):
            out[p] = nxt[rank % len(nxt)]
    return out


def _box(index, shape) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as ((start, stop), ...) per dimension."""
    return tuple((0 if s.start is None else int(s.start), dim if s.stop is None else int(s.stop))
                 for s, dim in zip(index, shape))


def _region(pieces: dict, box: tuple, dtype) -> np.ndarray:
    """The values of ``box`` from the saved ``pieces`` ({box: array}); `LayoutNotCovered` when
    they do not cover it."""
    if box in pieces:
        return pieces[box]
    shape = tuple(b - a for a, b in box)
    out, covered = np.empty(shape, dtype), 0
    for pbox, arr in pieces.items():
        meet = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(box, pbox)]
        if any(lo >= hi for lo, hi in meet):
            continue
        out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(meet, box))] = \
            arr[tuple(slice(lo - pa, hi - pa) for (lo, hi), (pa, _) in zip(meet, pbox))]
        covered += math.prod(hi - lo for lo, hi in meet)
    if covered != math.prod(shape):
        raise LayoutNotCovered(f"the shard {list(box)} is not within the shards this process saved "
                               f"({[list(b) for b in list(pieces)[:3]]}...)")
    return out


def _flat_tables(tables: dict) -> tuple[list[list[str]], list[np.ndarray]]:
    paths, arrays = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(tables)[0]:
        paths.append([str(k.key) for k in path])
        arrays.append(np.ascontiguousarray(x))
    return paths, arrays


def _nest_tables(paths: list[list[str]], arrays: list[np.ndarray]) -> dict:
    out: dict = {}
    for path, x in zip(paths, arrays):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = x
    return out


@dataclasses.dataclass
class Recovery:
    """What `LocalTier.resume` did: the step taken, where each process got it, the seconds."""

    step: int
    source: str            # "own" or "peer" (this process)
    seconds: float


class LocalTier:
    """The local tier (and its peer copy) of one process; see the module docstring.

    ``run``: the persistent checkpoint directory of the run this tier belongs to; the run's
    identity is kept there (`_run_id`) and recorded in every local step, so steps written for
    another run are never taken."""

    def __init__(self, directory, *, run: str, peer: bool = True):
        path = os.path.abspath(os.fspath(directory))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"CheckpointConfig: local_dir={os.fspath(directory)!r} is a file, not a directory; give "
                             "a directory on fast node-local storage (e.g. /dev/shm/<run>), created if missing")
        self.root, self.run, self.use_peer = path, run, peer
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.mine = os.path.join(path, f"process-{self.process}")
        self.own = os.path.join(self.mine, "own")
        self.server: wire.PeerServer | None = None
        self.addresses: dict[int, tuple[str, int]] = {}
        self.key = b""
        self.run_id = ""                          # of the run (`_run_id`), set by `start`
        self.send_to: int | None = None          # the process that holds this one's copy
        self.written: int | None = None           # the newest step this process wrote (None: none since start)
        self.peer_failures: list[str] = []
        self.recovery: Recovery | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-local-tier")
        self._pending: Future | None = None
        self._started = False

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Create the directories, remove a killed write's leftovers, learn the run's identity
        and (several processes, a peer wanted) start this process's peer server and learn every
        process's address; a collective: every process calls it at the same point."""
        if self._started:
            return
        self._started = True
        ip = _advertised_ip() if self.use_peer and self.processes > 1 else "127.0.0.1"
        os.makedirs(self.own, exist_ok=True)
        for parent in [self.own] + [os.path.join(self.mine, d) for d in os.listdir(self.mine) if d.startswith("peer-")]:
            for name in os.listdir(parent):
                if name.startswith("tmp-"):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        run_id = _run_id(self.run) if self.process == 0 else bytes(RUN_ID_BYTES)
        drawn = np.frombuffer(run_id + secrets.token_bytes(32), np.uint8)
        if self.processes > 1:
            from jax.experimental import multihost_utils

            drawn = np.asarray(multihost_utils.broadcast_one_to_all(drawn)).astype(np.uint8)
        self.run_id, self.key = bytes(drawn[:RUN_ID_BYTES]).hex(), bytes(drawn[RUN_ID_BYTES:])
        if not (self.use_peer and self.processes > 1):
            return
        self.server = wire.PeerServer(self.mine, self.key, host=ip)
        crc = lambda name: zlib.crc32(name.encode()) & 0x7FFFFFFF    # noqa: E731
        mine = np.asarray([crc(host_id()), crc(socket.gethostname()), *map(int, ip.split(".")), self.server.port],
                          np.int32)
        every = every_process(mine)
        self.addresses = {p: (".".join(str(int(v)) for v in row[2:6]), int(row[6])) for p, row in enumerate(every)}
        hosts = [str(int(row[0])) for row in every]
        loopback = sorted(p for p, (a, _) in self.addresses.items() if a.startswith("127."))
        if len({int(row[1]) for row in every}) > 1 and loopback:      # machines of other names: not one host
            self.server.close()
            raise ValueError(
                f"local checkpoint tier: process(es) {loopback} would be reached by their peers on another host at a "
                f"loopback address ({self.addresses[loopback[0]][0]}: their host name resolves to it); set "
                "JAXPAR_PEER_ADDRESS to each host's address on the network between hosts, or "
                "CheckpointConfig(peer=False)")
        self.send_to = peers(hosts).get(self.process)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state, rows: dict | None = None) -> None:
        """Save this process's shards of ``state`` as local step ``step``: returns once they are
        on the host; the files (and the peer's copy) are written in the background. Waits for
        the previous save first; one that failed on any process raises on every process (a
        collective: every process calls it at the same step)."""
        self.start()
        error = None
        try:
            self.wait()
        except OSError as e:
            error = e
        self._prune(failed=error is not None)
        if error is not None:
            raise error
        leaves, arrays = {}, []
        for path, x in st.savable(st.flat_state(state)).items():
            shape = tuple(int(d) for d in np.shape(x))
            entry = {"dtype": str(jnp.dtype(x.dtype)), "shape": list(shape), "pieces": []}
            if isinstance(x, jax.Array):
                seen = set()
                for shard in x.addressable_shards:
                    box = _box(shard.index, shape)
                    if box not in seen:
                        seen.add(box)
                        entry["pieces"].append({"box": [list(b) for b in box]})
                        arrays.append(shard.data)
            else:
                entry["pieces"].append({"box": [[0, d] for d in shape]})
                arrays.append(np.asarray(x))
            leaves[path] = entry
        for a in arrays:
            if isinstance(a, jax.Array):
                a.copy_to_host_async()
        host = [np.array(a, copy=True) for a in arrays]     # the buffers may be donated to the next step
        manifest = {"format": FORMAT, "run": self.run_id, "step": int(step), "process": self.process,
                    "processes": self.processes, "data_state": state.data, "leaves": leaves}
        tables = None if rows is None else _flat_tables(rows)
        self._pending = self._pool.submit(self._write, int(step), manifest, host, tables)

    def _write(self, step: int, manifest: dict, host: list[np.ndarray], tables) -> None:
        tmp = os.path.join(self.own, f"tmp-step-{step}-{secrets.token_hex(4)}")
        final = os.path.join(self.own, f"step-{step}")
        os.makedirs(tmp)
        try:
            pieces = [p for leaf in manifest["leaves"].values() for p in leaf["pieces"]]
            with open(os.path.join(tmp, "shards.bin"), "wb") as f:
                offset = 0
                for piece, arr in zip(pieces, host):
                    data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                    f.write(data)
                    piece.update(offset=offset, nbytes=len(data), crc32=zlib.crc32(data))
                    offset += len(data)
                f.flush()
                os.fsync(f.fileno())
            if tables is not None:
                paths, arrays = tables
                with open(os.path.join(tmp, "rows.npz"), "wb") as f:
                    np.savez(f, *arrays)
                    f.flush()
                    os.fsync(f.fileno())
                manifest["rows"] = {"paths": paths, "crc32": [zlib.crc32(a) for a in arrays]}
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            wire.commit(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.written = step
        if self.send_to is not None:
            try:
                wire.put_step(self.addresses[self.send_to], self.key, self.process, step, final)
            except wire.PeerError as e:     # the job goes on: the own copy is there; a restart says what is missing
                self.peer_failures.append(f"step {step}: {e}")
                print(f"jaxpar: local tier: the copy of step {step} on process {self.send_to} failed ({e}); "
                      "the step is kept on this host only", file=sys.stderr)

    def wait(self) -> None:
        """Block until the newest save is written (and sent); raise the error of one that failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except OSError as e:
                raise OSError(e.errno, f"local checkpoint tier {self.own}: writing a step failed ({e}); free space on "
                              "the local storage, or point CheckpointConfig(local_dir=...) elsewhere") from e

    def _prune(self, failed: bool = False) -> None:
        """Drop own and held steps older than the oldest newest-written step of any process (an
        exchange on several processes, which also carries whether a process's last write
        failed: then every process raises), so a step every process holds is always kept."""
        # the step written last is known here; only the first save after a start reads the directory
        newest = self.written if self.written is not None else max(self._steps(self.own), default=-1)
        oldest, failures = newest, [self.process] if failed else []
        if self.processes > 1:
            every = every_process([newest, int(failed)])
            oldest, failures = int(every[:, 0].min()), [p for p in range(self.processes) if every[p, 1]]
        if failures and not failed:
            raise OSError(f"local checkpoint tier {self.root}: writing a step failed on process(es) {failures} (see "
                          "their messages); every process stops alike")
        if oldest < 0 or failures:
            return
        for parent in self._parents():
            for step in self._steps(parent, check=False):
                if step < oldest:
                    shutil.rmtree(os.path.join(parent, f"step-{step}"), ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """The run goes on from ``step`` (a restore, or a resume from the persistent tier): own
        and held steps after it hold another history and are removed. A collective: every
        process's copies in flight land first (each waits for its own, then all meet), so no
        copy of the old history arrives after the removal."""
        self.start()
        self.wait()
        if self.processes > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxpar local tier: drop after {step}")
        for parent in self._parents():
            for s in self._steps(parent, check=False):
                if s > step:
                    shutil.rmtree(os.path.join(parent, f"step-{s}"), ignore_errors=True)

    # ------------------------------------------------------------------ listing
    def _parents(self) -> list[str]:
        if not os.path.isdir(self.mine):
            return []
        return [self.own] + sorted(os.path.join(self.mine, d) for d in os.listdir(self.mine) if d.startswith("peer-"))

    def _steps(self, parent: str, *, source: int | None = None, check: bool = True) -> list[int]:
        """The committed steps under ``parent`` (newest first); ``check``: only those whose
        manifest says they are ``source``'s (default this process) of this run and job size."""
        if not os.path.isdir(parent):
            return []
        out = []
        for name in os.listdir(parent):
            if not name.startswith("step-") or not name[5:].isdigit():
                continue
            step = int(name[5:])
            if check:
                try:
                    with open(os.path.join(parent, name, "manifest.json")) as f:
                        m = json.load(f)
                    if (m.get("format"), m.get("run"), m.get("step"), m.get("process"), m.get("processes")) != (
                            FORMAT, self.run_id, step, self.process if source is None else source, self.processes):
                        continue
                except (OSError, ValueError, AttributeError):
                    continue
            out.append(step)
        return sorted(out, reverse=True)

    def _held(self) -> dict[int, list[int]]:
        out = {}
        for parent in self._parents()[1:]:
            name = os.path.basename(parent)
            if name[5:].isdigit():
                q = int(name[5:])
                steps = self._steps(parent, source=q)
                if steps:
                    out[q] = steps
        return out

    # ------------------------------------------------------------------ resume
    def resume(self, state, mesh, *, newer_than: int | None) -> tuple | None:
        """``(TrainState, meta, tables)`` of the newest step every process can get from the local
        tiers that is at least as new as ``newer_than`` (the persistent tier's newest as process
        0 sees it, or None); None when there is none. A step some process cannot use is passed
        over on every process alike (a warning says which and why) for the next older one. A
        collective: every process calls it."""
        start = time.perf_counter()
        self.start()
        own = self._steps(self.own)
        held = self._held() if self.addresses else {}     # held copies are reached through the peer servers
        candidates, holders = self._common(own, held, newer_than)
        for k, step in enumerate(candidates):
            code, why, result, source = self._take(step, own, holders, state, mesh)
            codes = [code]
            if self.processes > 1:
                codes = [int(c) for c in every_process([code])[:, 0]]
            if not any(codes):
                self.recovery = Recovery(step, source, time.perf_counter() - start)
                print(f"jaxpar: resumed step {step} from the local checkpoint tier ({source} copy) in "
                      f"{self.recovery.seconds:.2f} s", file=sys.stderr)
                return result
            bad = [p for p, c in enumerate(codes) if c]
            then = f"trying its step {candidates[k + 1]}" if k + 1 < len(candidates) else \
                "resuming from the persistent tier instead"
            mine = f" (process {self.process}: {why})" if code else ""
            warnings.warn(f"local checkpoint tier {self.root}: step {step} could not be taken on process(es) {bad}"
                          f"{mine}; {then}", stacklevel=3)
        return None

    def _take(self, step: int, own: list[int], holders: dict[int, int], state, mesh) -> tuple:
        """``(code, why, result, source)`` of reading ``step`` on this process: its own copy, else
        (missing or damaged: moved aside) the peer's, fetched back first; code 0 read, 1 the
        layout is not within the saved shards, 2 no intact copy, 3 another failure. Never raises:
        every process reports before any acts."""
        why, source = "", "own"
        try:
            loaded = None
            final = os.path.join(self.own, f"step-{step}")
            if step in own:
                try:
                    loaded = self._load(final, step)
                except LocalDamage as e:
                    why = f"its own copy is damaged ({e}); "
                    os.rename(final, os.path.join(self.own, f"damaged-step-{step}-{secrets.token_hex(2)}"))
            if loaded is None:
                holder = holders.get(step)
                if holder is None:
                    raise LocalDamage(f"no other process holds a copy of process {self.process}'s step {step}")
                source = "peer"
                wire.get_step(self.addresses[holder], self.key, self.process, step, final)
                loaded = self._load(final, step)
            return 0, "", self._install(state, mesh, loaded), source
        except LayoutNotCovered as e:
            return 1, f"{why}the layout changed: {e}", None, source
        except (LocalDamage, wire.PeerError) as e:
            return 2, f"{why}{e}", None, source
        except Exception as e:      # noqa: BLE001  (reported to every process, then the next source is tried)
            return 3, f"{why}{type(e).__name__}: {e}", None, source

    def _common(self, own: list[int], held: dict[int, list[int]], newer_than: int | None) -> tuple[list[int], dict]:
        """The steps every process can get (own or held by another), newest first, down to
        ``newer_than`` as process 0 has it; and for this process ``{step: a process holding its
        copy}``. One exchange of a small table of steps."""
        row = [-1 if newer_than is None else int(newer_than), *own[:STEPS], *[-1] * (STEPS - len(own[:STEPS]))]
        for q in sorted(held, key=lambda q: -held[q][0])[:SOURCES]:       # the sources with the newest copies
            steps = held[q][:STEPS]
            row += [q, *steps, *[-1] * (STEPS - len(steps))]
        width = 1 + STEPS + SOURCES * (1 + STEPS)
        rows = np.asarray([row + [-1] * (width - len(row))], np.int32)
        if self.processes > 1:
            rows = every_process(rows[0])
        floor = int(rows[0, 0])
        available = {p: {int(s) for s in rows[p, 1:1 + STEPS] if s >= 0} for p in range(self.processes)}
        holders: dict[int, int] = {}
        for p in range(self.processes):
            for i in range(SOURCES):
                q, *steps = (int(v) for v in rows[p, 1 + STEPS + i * (1 + STEPS): 1 + STEPS + (i + 1) * (1 + STEPS)])
                if 0 <= q < self.processes and q != p:
                    for s in steps:
                        if s >= 0:
                            available[q].add(s)
                            if q == self.process:
                                holders.setdefault(s, p)
        common = set.intersection(*available.values()) if available else set()
        return sorted((s for s in common if s >= floor), reverse=True), holders

    def _load(self, directory: str, step: int) -> dict:
        """``{"manifest", "pieces": {path: {box: array}}, "tables"}`` of this process's local step
        ``step``, every byte checked against its CRC-32 (`LocalDamage` otherwise, also for a
        manifest of another step, process or run)."""
        try:
            with open(os.path.join(directory, "manifest.json")) as f:
                manifest = json.load(f)
            identity = (manifest.get("step"), manifest.get("process"), manifest.get("run"))
            if identity != (step, self.process, self.run_id):
                raise LocalDamage(f"{directory} holds step {identity[0]} of process {identity[1]} (another run, or "
                                  f"misplaced), not step {step} of process {self.process}")
            leaves = manifest["leaves"]
            pieces: dict = {}
            with open(os.path.join(directory, "shards.bin"), "rb") as f:
                for path, leaf in leaves.items():
                    dtype = jnp.dtype(leaf["dtype"])
                    pieces[path] = {}
                    for piece in leaf["pieces"]:
                        box = tuple(tuple(int(v) for v in b) for b in piece["box"])
                        f.seek(piece["offset"])
                        data = f.read(piece["nbytes"])
                        if len(data) != piece["nbytes"] or zlib.crc32(data) != piece["crc32"]:
                            raise LocalDamage(f"{path} {list(box)}: its bytes differ from those saved (CRC-32)")
                        pieces[path][box] = np.frombuffer(data, dtype).reshape([b - a for a, b in box])
            tables = None
            if manifest.get("rows") is not None:
                rows = manifest["rows"]
                with np.load(os.path.join(directory, "rows.npz"), allow_pickle=False) as z:
                    arrays = [z[f"arr_{i}"] for i in range(len(rows["paths"]))]
                bad = [p for p, a, c in zip(rows["paths"], arrays, rows["crc32"]) if zlib.crc32(np.ascontiguousarray(a)) != c]
                if bad:
                    raise LocalDamage(f"row tables {bad}: their bytes differ from those saved (CRC-32)")
                tables = _nest_tables(rows["paths"], arrays)
        except LocalDamage:
            raise
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            raise LocalDamage(f"{directory} does not read back ({type(e).__name__}: {e})") from e
        return {"manifest": manifest, "pieces": pieces, "tables": tables}

    def _install(self, state, mesh, loaded: dict) -> tuple:
        manifest, pieces = loaded["manifest"], loaded["pieces"]
        target = st.target(state, mesh)
        if set(target) != set(pieces):
            raise ValueError(f"the saved leaves differ from the trainer's ({sorted(set(target) ^ set(pieces))[:3]})")
        flat = {}
        for path, t in target.items():
            leaf = manifest["leaves"][path]
            if tuple(leaf["shape"]) != tuple(t.shape) or jnp.dtype(leaf["dtype"]) != jnp.dtype(t.dtype):
                raise ValueError(f"{path}: saved {leaf['shape']} {leaf['dtype']}, the trainer has {t.shape} {t.dtype}")
            dtype = jnp.dtype(t.dtype)
            flat[path] = jax.make_array_from_callback(
                t.shape, t.sharding, lambda index, p=pieces[path], s=t.shape, d=dtype: _region(p, _box(index, s), d))
        new = st.install(state, flat)
        step = int(manifest["step"])
        step_value = jax.device_put(jnp.asarray(step, jnp.int32), state.step.sharding)
        data = dict(manifest.get("data_state") or {})
        meta = {"step": step, "data_state": data, "tier": "local"}
        return new.replace(step=step_value, data=data), meta, loaded["tables"]

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish the save in flight (and its peer copy), then stop the peer server."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self.server is not None:
                self.server.close()


def _run_id(directory: str) -> bytes:
    """The identity of the run whose persistent checkpoints are in ``directory``: random bytes
    kept there in `RUN_ID_FILE` (created by the first start). Local steps written under another
    identity — an earlier run whose persistent directory was deleted to start afresh — are no
    steps of this one."""
    path = os.path.join(directory, RUN_ID_FILE)
    try:
        with open(path) as f:
            value = bytes.fromhex(f.read().strip())
        if len(value) == RUN_ID_BYTES:
            return value
    except (OSError, ValueError):
        pass
    value = secrets.token_bytes(RUN_ID_BYTES)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(value.hex())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return value


def _advertised_ip() -> str:
    """The IPv4 address peers reach this process at: ``JAXPAR_PEER_ADDRESS``, else the host
    name's, else the loopback address (every process on one host)."""
    import ipaddress

    given = os.environ.get("JAXPAR_PEER_ADDRESS")
    if given:
        try:
            return str(ipaddress.IPv4Address(given.strip()))
        except ValueError:
            raise ValueError(f"JAXPAR_PEER_ADDRESS={given!r} is not an IPv4 address; give this host's address on the "
                             "network between hosts, e.g. JAXPAR_PEER_ADDRESS=10.0.0.5") from None
    try:
        return str(ipaddress.IPv4Address(socket.gethostbyname(socket.gethostname())))
    except (OSError, ValueError):
        return "127.0.0.1"
