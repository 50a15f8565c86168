"""Who is in the average: the replica-group coordinator's state, without sockets.

Replica groups (`jaxpar.ps.replicas`) are data-parallel copies of one training job, each its
own ``jax.distributed`` job of ``ranks`` processes. Every step, rank ``r`` of every live group
sends the coordinator its gradient shards and gets back their mean over the groups; a group
that stops beating for ``timeout`` seconds is dropped from the mean and the others step on; a
group that (re)joins a running job gets a live group's state and is in the mean from the next
step on. `Quorum` is that bookkeeping: every method takes one request (or the time) and
returns the replies to send as ``(identity, fields, arrays)``; `jaxpar.ps.replica_server` owns
the socket.

A step's mean is one round over every rank of every member (``members``): it completes when
all have sent, or when the ones missing were dropped, so every rank of every group averages
over the same groups. The mean is summed in group order and in float64, the same bytes go to
every group, and so the groups' parameters stay bit-identical.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar.ps.wire import show

Reply = tuple[bytes, dict, tuple]


@dataclasses.dataclass
class Group:
    """One replica group as the coordinator sees it: its processes' sockets and beats."""

    group: int
    ranks: int
    incarnation: str
    layout: str
    step: int
    digest: str = ""           # a fingerprint of its state at the join (founders must agree)
    joined: dict[int, tuple[bytes, Any]] = dataclasses.field(default_factory=dict)  # rank -> (identity, rid)
    beats: dict[int, float] = dataclasses.field(default_factory=dict)              # rank -> last beat (clock)


class Quorum:
    """The coordinator's state for ``groups`` replica groups (the number expected at the start).

    ``timeout``: seconds without a beat (or a request) after which a rank's group is dropped;
    ``start_timeout``: seconds after the first join that the job starts with the groups there
    (at least one), if not all ``groups`` have joined by then. ``clock``: the time, in seconds.

    >>> q = Quorum(groups=1, timeout=5.0)
    >>> [fields["heal"] for _, fields, _ in q.handle(b"a", {"op": "join", "group": 0, "rank": 0, "ranks": 1,
    ...     "incarnation": "x", "layout": "L", "step": 0, "rid": 1}, [])]
    [False]
    """

    def __init__(self, groups: int, timeout: float, start_timeout: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] | None = None):
        self.groups, self.timeout, self.start_timeout, self.clock = groups, timeout, start_timeout, clock
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.members: dict[int, Group] = {}
        self.joining: dict[int, Group] = {}
        self.started = False
        self.first_join: float | None = None
        self.step = 0                          # the last step every member has averaged
        self.layout: str | None = None         # the state layout every group must have
        self.round: dict[tuple[int, int], tuple[bytes, Any, list[np.ndarray]]] = {}   # (group, rank) -> contribution
        self.donor: tuple[int, int] | None = None      # (group, step) asked to send its state
        self.recipients: list[int] = []                 # the groups that donor's state goes to
        self.states: dict[int, tuple[Any, list]] = {}   # rank -> (data, arrays) received from the donor
        self.history: list[dict[str, Any]] = []         # what happened, for stats and tests
        self.outbox: list[Reply] = []                   # errors for the requests of a dropped group

    # ------------------------------------------------------------------ requests
    def handle(self, identity: bytes, header: dict[str, Any], arrays: list[np.ndarray]) -> list[Reply]:
        """The replies one request causes (to it, and to requests waiting on it). A bad request
        raises ``ValueError`` with the message its sender gets."""
        op = header.get("op")
        handler = {"join": self._join, "beat": self._beat, "average": self._average, "state": self._state,
                   "leave": self._leave, "stats": self._stats}.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError(f"unknown operation {show(op)}; one of join, beat, average, state, leave, stats")
        out = handler(identity, header, arrays)
        out, self.outbox = self.outbox + out, []
        return out

    def tick(self) -> list[Reply]:
        """Drops the groups whose beats lapsed and starts a job that waited long enough; returns
        the replies that this lets go (a round completed without a dropped group)."""
        now = self.clock()
        out: list[Reply] = []
        for table in (self.members, self.joining):
            for g in list(table.values()):
                late = [r for r, t in g.beats.items() if now - t > self.timeout]
                if late:
                    self._drop(g, f"rank {late[0]} sent nothing for {now - g.beats[late[0]]:.1f} s "
                                  f"(timeout {self.timeout} s)")
        if not self.started:
            out += self._start(force=self.first_join is not None and now - self.first_join >= self.start_timeout)
        out += self._complete()
        out, self.outbox = self.outbox + out, []
        return out

    # ------------------------------------------------------------------ join, start, heal
    def _join(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        group, rank, ranks = _int(h, "group", 0), _int(h, "rank", 0), _int(h, "ranks", 1)
        incarnation, layout, step = _str(h, "incarnation"), _str(h, "layout"), _int(h, "step", 0)
        digest = h.get("digest", "")
        if not isinstance(digest, str) or len(digest) > 128:
            raise ValueError(f"join: field 'digest' is {show(digest)}; it must be a string of at most 128 characters")
        if rank >= ranks:
            raise ValueError(f"join: rank={rank} is not below ranks={ranks} (the group's process count)")
        if self.layout is not None and layout != self.layout:
            raise ValueError(f"join: group {group}'s state layout {layout[:16]} differs from the job's "
                             f"{self.layout[:16]}: every replica group must train the same model and optimizer on "
                             "the same mesh and plan (the same process count and devices per process)")
        for table in (self.members, self.joining):
            old = table.get(group)
            if old is not None and old.incarnation != incarnation:
                self._drop(old, "a new incarnation of it joined (it was restarted)")
        g = self.joining.get(group) or self.members.get(group)
        if g is None:
            g = self.joining[group] = Group(group, ranks, incarnation, layout, step, digest)
        elif g.group in self.members:
            raise ValueError(f"join: group {group} rank {rank} is already in the mean (incarnation {incarnation}); "
                             "a process joins once per start")
        if (g.ranks, g.layout, g.step, g.digest) != (ranks, layout, step, digest):
            raise ValueError(f"join: group {group} rank {rank} says ranks={ranks}, step={step}; its rank "
                             f"{next(iter(g.joined), 0)} said ranks={g.ranks}, step={g.step}: the processes of a group "
                             "run one job and join at one step")
        g.joined[rank] = (identity, h.get("rid"))
        g.beats[rank] = self.clock()
        if self.first_join is None:
            self.first_join = self.clock()
        if self.layout is None:
            self.layout = layout
        if len(g.joined) < g.ranks:
            return self._complete()          # (a restarted group's old round entries are gone)
        if not self.started:
            return self._start()
        self.history.append({"event": "waiting", "group": group, "step": self.step})
        return self._complete()            # it heals at the next round's end (`_complete` asks a donor)

    def _start(self, force: bool = False) -> list[Reply]:
        ready = [g for g in self.joining.values() if len(g.joined) == g.ranks]
        if not ready or (len(ready) < self.groups and not force):
            return []
        self.started = True
        self.step = max(g.step for g in ready)
        newest = [g for g in ready if g.step == self.step]
        first = min(newest, key=lambda g: g.group)
        out: list[Reply] = []
        for g in newest:     # the founders: the first of the newest and those whose state equals its own;
            if g.digest == first.digest:    # a group behind them, or whose state differs, heals from one
                out += self._admit(g)
            else:
                self.log(f"jaxpar replicas: group {g.group}'s state at step {self.step} differs from group "
                         f"{first.group}'s (another seed or checkpoint?): it takes group {first.group}'s")
        for _, fields, _ in out:
            fields["members"] = sorted(self.members)
        self.log(f"jaxpar replicas: started at step {self.step} with groups {sorted(self.members)}"
                 f"{'' if len(ready) == self.groups else f' ({len(ready)} of {self.groups} joined in time)'}")
        return out

    def _admit(self, g: Group, healed: bool = False) -> list[Reply]:
        """``g`` joins the mean from the next step; the join requests of its ranks still waiting
        are answered (a healed group's were, with the donor's state)."""
        self.joining.pop(g.group, None)
        self.members[g.group] = g
        g.step = self.step
        now = self.clock()
        g.beats = {r: now for r in range(g.ranks)}
        self.history.append({"event": "healed" if healed else "joined", "group": g.group, "step": self.step})
        reply = {"heal": False, "step": self.step, "members": sorted(self.members)}
        out = [(ident, {"rid": rid, **reply}, ()) for r, (ident, rid) in g.joined.items()]
        g.joined = {}
        return out

    def _state(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        """A donor rank's state after step ``step``. Once every rank of the donor has sent its
        own, each group it was asked for gets them, rank by rank, and is in the next round; a
        donor dropped before that sends nothing to anyone (the next round asks another)."""
        group, rank, step = _int(h, "group", 0), _int(h, "rank", 0), _int(h, "step", 0)
        self._member(h, "state")
        if self.donor != (group, step):
            raise ValueError(f"state: group {group} was not asked for its state of step {step} (asked: "
                             f"{self.donor}); it sends its state only when an average's reply says donate")
        self.states[rank] = (h.get("data"), list(arrays))
        out: list[Reply] = [(identity, {"rid": h.get("rid")}, ())]
        if len(self.states) < self.members[group].ranks:
            return out
        for g in [self.joining[r] for r in self.recipients if r in self.joining]:
            if len(g.joined) < g.ranks:
                continue          # (it restarted again meanwhile: it waits for the next donor)
            for r, (ident, rid) in g.joined.items():
                data, shards = self.states[r]
                out.append((ident, {"rid": rid, "heal": True, "step": step, "donor": group, "data": data},
                            tuple(shards)))
            g.joined = {}
            self._admit(g, healed=True)
            self.log(f"jaxpar replicas: group {g.group} healed from group {group} at step {step}")
        self.donor, self.recipients, self.states = None, [], {}
        return out

    # ------------------------------------------------------------------ the rounds
    def _average(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        g = self._member(h, "average")
        rank, step = _int(h, "rank", 0), _int(h, "step", 0)
        if step != self.step + 1:
            raise ValueError(f"average: group {g.group} sends step {step}, and the groups are at step {self.step + 1}; "
                             "a group out of step restarts and heals from a live one")
        if self.donor is not None and self.donor[0] == g.group and rank not in self.states:
            raise ValueError(f"average: group {g.group} was asked for its state of step {self.donor[1]} and sent "
                             "no state first")
        self.round[(g.group, rank)] = (identity, h.get("rid"), arrays)
        g.beats[rank] = self.clock()
        return self._complete()

    def _complete(self) -> list[Reply]:
        """The round's replies once every rank of every member has sent (or nobody is left)."""
        if not self.members or not self.round:
            return []
        need = {(g.group, r) for g in self.members.values() for r in range(g.ranks)}
        if not need <= set(self.round):
            return []
        groups = sorted(self.members)
        ranks = self.members[groups[0]].ranks
        donate = None
        ready = [g.group for g in self.joining.values() if len(g.joined) == g.ranks]
        if self.donor is None and ready:
            donate = self.donor = (groups[0], self.step + 1)
            self.recipients, self.states = ready, {}
        out: list[Reply] = []
        for rank in range(ranks):
            parts = [self.round[(g, rank)][2] for g in groups]
            try:
                mean = _mean(parts)
            except ValueError as e:
                mean, error = (), str(e)
            else:
                error = None
            for g in groups:
                ident, rid, _ = self.round[(g, rank)]
                fields = {"rid": rid, "groups": groups, "donate": donate is not None and donate[0] == g}
                if error is not None:
                    fields = {"rid": rid, "ok": False, "error": f"average of step {self.step + 1}, rank {rank}: {error}"}
                out.append((ident, fields, tuple(mean)))
        self.step += 1
        for g in self.members.values():
            g.step = self.step
        self.round = {}
        if len(groups) < self.groups:
            self.history.append({"event": "step", "step": self.step, "groups": groups})
        return out

    # ------------------------------------------------------------------ beats and exits
    def _beat(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        group, rank = _int(h, "group", 0), _int(h, "rank", 0)
        incarnation = _str(h, "incarnation")
        g = self.members.get(group) or self.joining.get(group)
        alive = g is not None and g.incarnation == incarnation
        if alive:
            g.beats[rank] = self.clock()
        return [(identity, {"rid": h.get("rid"), "member": alive and group in self.members, "step": self.step}, ())]

    def _leave(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        group = _int(h, "group", 0)
        g = self.members.get(group) or self.joining.get(group)
        if g is not None and g.incarnation == _str(h, "incarnation"):
            self._drop(g, "it left (its training ended)", left=True)
        return [(identity, {"rid": h.get("rid")}, ())] + self._complete()

    def _stats(self, identity: bytes, h: dict, arrays) -> list[Reply]:
        return [(identity, {"rid": h.get("rid"), "step": self.step, "members": sorted(self.members),
                            "joining": sorted(self.joining), "history": self.history[-200:]}, ())]

    def _drop(self, g: Group, why: str, left: bool = False) -> None:
        table = self.members if g.group in self.members else self.joining
        if table.get(g.group) is not g:
            return
        del table[g.group]
        message = (f"group {g.group} was dropped from the mean at step {self.step}: {why}; restart it and it heals "
                   "from a live group")
        for (group, _), (ident, rid, _) in self.round.items():
            if group == g.group:
                self.outbox.append((ident, {"rid": rid, "ok": False, "error": message}, ()))
        for ident, rid in g.joined.values():
            self.outbox.append((ident, {"rid": rid, "ok": False, "error": message}, ()))
        self.round = {k: v for k, v in self.round.items() if k[0] != g.group}
        if self.donor is not None and self.donor[0] == g.group:
            self.donor, self.recipients, self.states = None, [], {}    # the next round asks another group
        if not self.members:      # every member is gone: the job starts again as at first, from those that join
            self.started, self.first_join = False, self.clock() if self.joining else None
            if not self.joining:
                self.layout = None
        self.history.append({"event": "left" if left else "dropped", "group": g.group, "step": self.step})
        self.log(f"jaxpar replicas: group {g.group} {'left' if left else 'dropped'} at step {self.step}: {why}; "
                 f"the mean goes on over groups {sorted(self.members)}")

    def _member(self, h: dict, op: str) -> Group:
        group = _int(h, "group", 0)
        g = self.members.get(group)
        if g is None or g.incarnation != _str(h, "incarnation"):
            raise ValueError(f"{op}: group {group} is not in the mean (dropped: no beat for {self.timeout} s, or "
                             "restarted); restart it and it heals from a live group")
        return g


def _mean(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The elementwise mean of each array over the groups, summed in group order in float64."""
    first = parts[0]
    for p in parts[1:]:
        if len(p) != len(first) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(p, first)):
            raise ValueError("the groups sent arrays of other shapes or dtypes (another model or layout?)")
    out = []
    for k, a in enumerate(first):
        total = a.astype(np.float64)
        for p in parts[1:]:
            total += p[k]
        out.append((total / len(parts)).astype(a.dtype))
    return out


def _int(h: dict, name: str, low: int) -> int:
    value = h.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < (1 << 62):
        raise ValueError(f"field {name!r} is {show(value)}; it must be an int >= {low}")
    return value


def _str(h: dict, name: str) -> str:
    value = h.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise ValueError(f"field {name!r} is {show(value)}; it must be a string of 1 to 128 characters")
    return value
