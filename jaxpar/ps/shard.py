"""One server's shard of one table: rows, optimizer slots, and the step clock of sync / async.

The clock of a shard is the number of worker steps whose updates it has applied from every
worker: ``min(done)``, where ``done[w]`` counts the steps worker ``w`` has pushed. A pull for
worker step ``t`` is served once ``clock >= t - staleness`` (sync is ``staleness = 0``), and
carries the clock it was read at. In async mode the shard records, per worker, the clock at
which it served each of the worker's recent pulls; a push at step ``t`` names the step whose
pull gave its rows (``pulled_at``), and its staleness is ``t - read_clock`` with the recorded
``read_clock``: a push that names a pull this shard never served to that worker is refused.

* sync: the pushes of step ``t`` wait in ``pending[t]`` until every worker's is there; they
  are summed per row and applied together, and the clock moves to ``t + 1``.
* async: a push is applied on arrival (or rejected and counted when its staleness exceeds the
  bound); ``done[w]`` moves either way, so a rejected push never stalls the other workers.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxpar.ps.tables import TableSpec, init_rows
from jaxpar.ps.wire import show


_INIT_CHUNK = 1 << 20
# Pull steps per worker a shard remembers the clock of (a push from rows older than that many
# steps of pulls is an error, however large the staleness bound).
PULL_WINDOW = 64


def _init_weights(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """``init_rows`` a million rows at a time: its 64-bit temporaries are 2-3 times the rows'
    size, which for a shard of millions of rows would triple the server's peak memory."""
    out = np.empty((len(ids), spec.dim), np.float32)
    for lo in range(0, len(ids), _INIT_CHUNK):
        out[lo:lo + _INIT_CHUNK] = init_rows(spec, ids[lo:lo + _INIT_CHUNK])
    return out


class TableShard:
    """The rows of ``spec`` that server ``index`` of ``count`` owns, and their update state."""

    def __init__(self, spec: TableSpec, index: int, count: int, mode: str, staleness: int,
                 workers: int):
        self.spec, self.index, self.count = spec, index, count
        self.mode, self.staleness, self.workers = mode, staleness, workers
        self.global_ids = spec.shard_ids(index, count)
        self.weights = _init_weights(spec, self.global_ids)
        self.slots = spec.optimizer.slots(len(self.global_ids), spec.dim)
        self.done = [0] * workers
        self.pending: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self.histogram: dict[int, int] = {}
        self.rejected = 0
        self.rows_pushed = 0
        self.clear_pulls()

    def clear_pulls(self) -> None:
        """Forgets every pull (after a restore: the workers pull again)."""
        self.pulls: list[dict[int, int]] = [{} for _ in range(self.workers)]  # step -> clock served
        self.forgotten = [-1] * self.workers  # the newest pull step that left PULL_WINDOW
        # After a restart: the pulls served between the last checkpoint and the kill were recorded
        # nowhere, but each was served at a clock >= the checkpoint's, for a step <= the clock at
        # the kill + staleness. (lowest such clock, highest such step) over every restart, or None.
        self.lost_pulls: tuple[int, int] | None = None

    def pulls_lost(self, checkpoint_clock: int) -> None:
        """Tells a shard a restarted server brought back (checkpoint, then log) that the pulls it
        served since the checkpoint at ``checkpoint_clock`` are lost."""
        floor, last = checkpoint_clock, self.clock + self.staleness
        if self.lost_pulls is not None:  # pulls lost in an earlier restart are still unrecorded
            floor, last = min(floor, self.lost_pulls[0]), max(last, self.lost_pulls[1])
        self.lost_pulls = (floor, last)

    @property
    def clock(self) -> int:
        return min(self.done)

    def can_serve(self, step: int) -> bool:
        """Whether a pull for worker step ``step`` may be answered now."""
        return self.clock >= step - self.staleness

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        """Local row indices of ``ids``; ids this server does not own raise ``ValueError``."""
        if ids.dtype.kind not in "iu":
            raise ValueError(f"table {self.spec.name!r}: ids of dtype {ids.dtype}; ids must be integers")
        bad = (ids < 0) | (ids >= self.spec.rows)
        if ids.size and bad.any():
            raise ValueError(f"table {self.spec.name!r}: id {int(ids[bad][0])} outside [0, {self.spec.rows})")
        mine = self.spec.owner(ids, self.count) == self.index
        if ids.size and not mine.all():
            raise ValueError(f"table {self.spec.name!r}: id {int(ids[~mine][0])} belongs to another server "
                             f"than {self.index} of {self.count}")
        return self.spec.local(ids, self.count)

    def pull(self, ids: np.ndarray) -> np.ndarray:
        return self.weights[self.check_ids(ids)]

    def record_pull(self, worker: Any, step: int) -> None:
        """Remembers (async) that ``worker``'s pull of step ``step`` is served at this clock."""
        if self.mode != "async":
            return  # sync pulls wait for the clock: every push is fresh
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < self.workers:
            raise ValueError(f"table {self.spec.name!r}: a pull from worker {show(worker)}; workers are "
                             f"0 .. {self.workers - 1}")
        pulls = self.pulls[worker]
        # A pull sent again may be served twice: the worker may have used either reply.
        pulls[step] = min(pulls.get(step, self.clock), self.clock)
        while len(pulls) > PULL_WINDOW:
            oldest = min(pulls)
            del pulls[oldest]
            self.forgotten[worker] = max(self.forgotten[worker], oldest)

    def read_clock(self, worker: int, step: int, pulled_at: int, rows: int) -> int:
        """The clock at which ``worker`` read the ``rows`` rows it pushes at ``step``: this shard's
        record of its pull of step ``pulled_at`` (async; sync pushes, empty pushes and resent ones
        are not measured). A pull this shard never served to the worker raises ``ValueError``."""
        if self.mode != "async" or rows == 0 or step < self.done[worker]:
            return step
        if pulled_at in self.pulls[worker]:
            return self.pulls[worker][pulled_at]
        if self.lost_pulls is not None and self.forgotten[worker] < pulled_at <= self.lost_pulls[1]:
            return self.lost_pulls[0]  # maybe served after the checkpoint this restart came from
        recorded = sorted(self.pulls[worker])
        seen = f"steps {recorded[0]} .. {recorded[-1]}" if recorded else "none"
        raise ValueError(
            f"table {self.spec.name!r}: worker {worker} pushes step {step} from rows pulled at step "
            f"{pulled_at}, but server {self.index} of {self.count} served worker {worker} no pull of "
            f"step {pulled_at} (its recorded pulls: {seen}; it keeps the last {PULL_WINDOW} steps); "
            f"pass pulled_at= the step whose pull gave the rows, or pull them again")

    def check_push(self, worker: int, ids: np.ndarray, grads: np.ndarray) -> np.ndarray:
        """The local rows of a push; a malformed push raises ``ValueError`` before it is logged."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"table {self.spec.name!r}: worker {worker} outside [0, {self.workers})")
        if ids.ndim != 1 or grads.shape != (len(ids), self.spec.dim):
            raise ValueError(f"table {self.spec.name!r}: gradients of shape {list(grads.shape)} for "
                             f"ids of shape {list(ids.shape)}; expected [{len(ids)}, {self.spec.dim}]")
        return self.check_ids(ids)

    def push(self, step: int, worker: int, read_clock: int, ids: np.ndarray, grads: np.ndarray) -> str:
        """Takes worker ``worker``'s row gradients of step ``step``; returns what happened to them:
        ``"applied"``, ``"pending"`` (sync, waiting for the other workers), ``"rejected"`` (async,
        too stale) or ``"duplicate"`` (a resent push already taken)."""
        local = self.check_push(worker, ids, grads)
        if self.mode == "sync":
            return self._push_sync(step, worker, local, grads.astype(np.float32))
        return self._push_async(step, worker, read_clock, local, grads.astype(np.float32))

    def _push_sync(self, step: int, worker: int, local: np.ndarray, grads: np.ndarray) -> str:
        if step < self.clock or worker in self.pending.get(step, {}):
            return "duplicate"
        self.pending.setdefault(step, {})[worker] = (local, grads)
        if len(local):  # sync pulls wait for the clock: every push is fresh
            self.histogram[0] = self.histogram.get(0, 0) + 1
        status = "pending"
        while len(self.pending.get(self.clock, {})) == self.workers:
            parts = self.pending.pop(self.clock)
            # Summed in worker order: the same sum whichever worker's push came first.
            self._apply(np.concatenate([parts[w][0] for w in range(self.workers)]),
                        np.concatenate([parts[w][1] for w in range(self.workers)]))
            self.done = [self.clock + 1] * self.workers
            status = "applied"
        return status

    def _push_async(self, step: int, worker: int, read_clock: int, local: np.ndarray,
                    grads: np.ndarray) -> str:
        if step < self.done[worker]:
            return "duplicate"
        self.done[worker] = step + 1
        if len(local) == 0:
            return "applied"
        stale = max(0, step - read_clock)
        self.histogram[stale] = self.histogram.get(stale, 0) + 1
        if stale > self.staleness:
            self.rejected += 1
            return "rejected"
        self._apply(local, grads)
        return "applied"

    def _apply(self, local: np.ndarray, grads: np.ndarray) -> None:
        if len(local) == 0:
            return
        rows, inverse = np.unique(local, return_inverse=True)
        summed = np.zeros((len(rows), self.spec.dim), np.float32)
        np.add.at(summed, inverse, grads)
        slots = {k: v[rows] for k, v in self.slots.items()}
        self.weights[rows] = self.spec.optimizer.apply(self.weights[rows], slots, summed)
        for k, v in slots.items():
            self.slots[k][rows] = v
        self.rows_pushed += len(rows)

    def stats(self) -> dict[str, Any]:
        return {"clock": self.clock, "done": list(self.done), "rejected": self.rejected,
                "staleness_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                "rows_pushed": self.rows_pushed}

    # -- checkpoint state: arrays and a JSON-able summary -------------------------------------

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}/weights": self.weights}
        out.update({f"{prefix}/slot/{k}": v for k, v in self.slots.items()})
        for step, parts in self.pending.items():
            for w, (ids, grads) in parts.items():
                out[f"{prefix}/pending/{step}/{w}/ids"] = ids
                out[f"{prefix}/pending/{step}/{w}/grads"] = grads
        return out

    def meta(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "done": self.done, "rejected": self.rejected,
                "histogram": {str(k): v for k, v in self.histogram.items()},
                "rows_pushed": self.rows_pushed,
                "pulls": [sorted(p.items()) for p in self.pulls], "forgotten": self.forgotten,
                "lost_pulls": self.lost_pulls}

    def load(self, prefix: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if TableSpec.from_json(meta["spec"]) != self.spec:
            raise ValueError(f"table {self.spec.name!r}: the checkpoint holds {json.dumps(meta['spec'])}, "
                             f"the job asks for {json.dumps(self.spec.to_json())}")
        self.weights = arrays[f"{prefix}/weights"].copy()
        self.slots = {k: arrays[f"{prefix}/slot/{k}"].copy() for k in self.slots}
        self.done = list(meta["done"])
        self.rejected = meta["rejected"]
        self.histogram = {int(k): v for k, v in meta["histogram"].items()}
        self.rows_pushed = meta["rows_pushed"]
        self.clear_pulls()
        if "pulls" in meta:  # (a checkpoint of an earlier version has none)
            self.pulls = [{int(s): int(c) for s, c in p} for p in meta["pulls"]]
            self.forgotten = list(meta["forgotten"])
            self.lost_pulls = tuple(meta["lost_pulls"]) if meta["lost_pulls"] is not None else None
        self.pending = {}
        mine = f"{prefix}/pending/"   # this table's keys alone: another table's name may be as long
        for key in arrays:
            parts = key[len(mine):].split("/")
            if key.startswith(mine) and len(parts) == 3 and parts[2] == "ids":
                step, w = int(parts[0]), int(parts[1])
                grads = arrays[f"{prefix}/pending/{step}/{w}/grads"]
                self.pending.setdefault(step, {})[w] = (arrays[key].copy(), grads.copy())
