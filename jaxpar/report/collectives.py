"""Collectives of a compiled program, read from its optimized HLO text.

XLA decides which collectives a sharded program needs only when it compiles it, so the place
to look is the optimized HLO (``compiled.as_text()``), not the jaxpr or the StableHLO of a
``Lowered``. This module parses that text: one `Collective` per all-reduce, all-gather,
reduce-scatter, all-to-all or collective-permute instruction (their asynchronous ``-start``
forms included, ``-done`` / ``-update`` halves ignored), with its bytes, its device groups and
the mesh axes those groups run over.

Device ids in an SPMD program's replica groups are *positions* in the mesh's device order
(``mesh.devices.flat``), not ``Device.id``; the mapping to mesh axes relies on that, and so does
the host of each position (``mesh.devices.flat[i].process_index``): a collective whose groups
(or source → target pairs) hold devices of several processes crosses the network between hosts.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from jaxpar.report.hlo import INSTRUCTION, HloModule, hlo_text, loop_context, parse_module

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Groups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      name: the HLO instruction name, e.g. ``"all-reduce.2"``.
      kind: one of `KINDS`; an asynchronous ``all-gather-start`` has kind ``"all-gather"``.
      dtype: element type as HLO spells it (``"f32"``, ``"bf16"``, ``"s32"``); types of a
        tuple-shaped collective that differ are joined with ``","``.
      shapes: the per-device result shape of each buffer (several when XLA combined
        collectives into one tuple-shaped instruction).
      bytes: bytes per device, by kind: all-reduce, all-gather, all-to-all and
        collective-permute count the result buffer(s) (tuple results summed; for all-gather
        the gathered size); reduce-scatter counts its operand, i.e. result size × group size.
        The same convention gives the same number for "reduce a block over 4 devices" whether
        XLA emits an all-reduce or a reduce-scatter.
      replica_groups: the device groups, as positions in the mesh's device order. For a
        collective-permute: the connected groups of its source → target pairs.
      group_size: devices per group.
      num_groups: number of groups.
      mesh_axes: the mesh axes the groups run over, in mesh order, e.g. ``("model",)``;
        ``()`` for groups of one device; ``None`` when no mesh was given or the groups match
        no set of mesh axes.
      in_loop: inside the body (or condition) of a ``while`` loop, e.g. a ``lax.scan``: such
        an instruction runs once per iteration, not once per step.
      executions: times it runs per call of the program: 1 outside loops, the product of
        the known trip counts inside loops, ``None`` when a loop's trip count is unknown.
      is_async: issued as an asynchronous start/done pair.
      source_target_pairs: a collective-permute's (source, target) pairs; ``()`` otherwise.
      computation: the HLO computation holding the instruction.
      hosts_spanned: the most hosts (processes) one group holds devices of: 1 when every
        group (every source → target pair) stays inside a host; ``None`` when the device →
        host map is unknown (no concrete mesh nor ``hosts=`` given).
      intra_host_bytes, inter_host_bytes: the most bytes one device moves over the links
        inside a host and over the network between hosts (``None`` when unknown), in the
        ``bytes`` convention. Inside one host: ``bytes`` and 0. A group of ``h`` hosts with
        ``a`` devices on each runs hierarchically (NCCL, XLA's DCN collectives): all-reduce,
        all-gather and reduce-scatter move ``bytes`` inside the host (0 when ``a = 1``) and
        ``bytes / a`` between hosts (each device its ``1/a`` share); an all-to-all sends
        ``(n - a) / n`` of its buffer to other hosts and the rest inside; a collective-permute
        moves ``bytes`` over each network one of its pairs uses.
      num_hosts: the hosts the program's devices are on (``None`` when unknown).

    Example:
      >>> c = collectives(compiled, mesh)[0]          # doctest: +SKIP
      >>> c.kind, c.mesh_axes, c.bytes                # doctest: +SKIP
      ('all-reduce', ('model',), 256)
    """

    name: str
    kind: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    bytes: int
    replica_groups: Groups
    group_size: int
    num_groups: int
    mesh_axes: tuple[str, ...] | None
    in_loop: bool
    executions: int | None
    is_async: bool = False
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    computation: str = ""
    hosts_spanned: int | None = None
    intra_host_bytes: int | None = None
    inter_host_bytes: int | None = None
    num_hosts: int | None = None

    @property
    def crosses_hosts(self) -> bool | None:
        """Whether a group (or pair) holds devices of several hosts; ``None`` when unknown."""
        return None if self.hosts_spanned is None else self.hosts_spanned > 1


def collectives(compiled_or_hlo_text, mesh=None, *, hosts=None) -> list[Collective]:
    """Lists every collective of a compiled program, in the order of its HLO text.

    Args:
      compiled_or_hlo_text: a ``jax.stages.Compiled`` or its optimized HLO text
        (``compiled.as_text()``).
      mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the program was compiled for;
        when given, each collective's ``mesh_axes`` names the axes its groups run over, and
        a concrete ``Mesh`` gives each device position's host (its ``process_index``).
      hosts: the host of each device position (``hosts[i]`` for ``mesh.devices.flat[i]``),
        to read a program of another cluster (or a simulated one); overrides the mesh's.

    Returns:
      One `Collective` per instruction. An instruction inside a loop body appears once;
      see ``Collective.in_loop`` and ``Collective.executions``.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> s = lambda *spec: jax.sharding.NamedSharding(mesh, jax.P(*spec))
      >>> f = jax.jit(lambda x, w: x @ w, in_shardings=(s("data", "model"), s("model", None)),
      ...             out_shardings=s("data", None))
      >>> x = jax.ShapeDtypeStruct((16, 32), "float32")
      >>> w = jax.ShapeDtypeStruct((32, 8), "float32")
      >>> [(c.kind, c.mesh_axes, c.bytes) for c in collectives(f.lower(x, w).compile(), mesh)]
      [('all-reduce', ('model',), 256)]
    """
    return module_collectives(parse_module(hlo_text(compiled_or_hlo_text)), mesh, hosts=hosts)


def module_collectives(module: HloModule, mesh=None, *, hosts=None, computations=None) -> list[Collective]:
    """`collectives` of a parsed module (`jaxpar.report.hlo.parse_module`); ``computations``: only
    the instructions of these computations."""
    mesh_shape = _mesh_shape(mesh)
    if mesh_shape is not None and module.num_devices not in (None, math.prod(mesh_shape.values())):
        raise ValueError(
            f"collectives(): the program runs on {module.num_devices} devices but the mesh "
            f"{dict(mesh_shape)} has {math.prod(mesh_shape.values())}; pass the mesh the "
            "program was compiled for.")
    num_devices = module.num_devices or (math.prod(mesh_shape.values()) if mesh_shape else 1)
    host_of = _host_map(mesh, hosts, num_devices)
    context = loop_context(module)
    found = []
    for comp, line in module.lines:
        if computations is not None and comp not in computations:
            continue
        if not any(kind in line for kind in KINDS):     # most lines: no collective's name in them
            continue
        instr = INSTRUCTION.match(line)
        if instr is None or not _is_collective(instr["op"], instr["rest"]):
            continue
        in_loop, executions = context.get(comp, (False, None))
        c = _make_collective(instr, comp, num_devices, mesh_shape, in_loop, executions, comp in module.async_wrapped)
        found.append(_with_hosts(c, host_of) if host_of is not None else c)
    return found


def collective_summary(cols: Iterable[Collective]) -> dict:
    """Totals the counts and bytes of collectives, overall, per kind and per mesh axes.

    Returns a dict::

      {"count": int, "bytes": int,            # each instruction counted once
       "executed_bytes": int | None,          # bytes × executions; None if a trip count is unknown
       "in_loop": {"count": int, "bytes": int},
       "by_kind": {kind: {"count": int, "bytes": int}},
       "by_mesh_axes": {mesh_axes: {"count": int, "bytes": int}},   # keys: tuples or None
       "crossing_hosts": {"count": int, "bytes": int} | None,   # None: host map unknown
       "intra_host_bytes": int | None, "inter_host_bytes": int | None}

    Example:
      >>> collective_summary(collectives(compiled, mesh))["by_kind"]   # doctest: +SKIP
      {'all-reduce': {'count': 1, 'bytes': 256}}
    """
    cols = list(cols)
    for c in cols:
        if not isinstance(c, Collective):
            raise TypeError(f"collective_summary() expects Collective objects (from "
                            f"collectives(...)), got {type(c).__name__}: {c!r}")
    executed = [None if c.executions is None else c.bytes * c.executions for c in cols]
    unknown = any(c.hosts_spanned is None for c in cols)
    return {
        "count": len(cols),
        "bytes": sum(c.bytes for c in cols),
        "executed_bytes": None if None in executed else sum(executed),
        "in_loop": _tally([c for c in cols if c.in_loop]),
        "by_kind": _group(cols, lambda c: c.kind),
        "by_mesh_axes": _group(cols, lambda c: c.mesh_axes),
        "crossing_hosts": None if unknown else _tally([c for c in cols if c.crosses_hosts]),
        "intra_host_bytes": None if unknown else sum(c.intra_host_bytes for c in cols),
        "inter_host_bytes": None if unknown else sum(c.inter_host_bytes for c in cols),
    }


def _tally(cols: list[Collective]) -> dict:
    return {"count": len(cols), "bytes": sum(c.bytes for c in cols)}


def _group(cols: list[Collective], key) -> dict:
    keys = dict.fromkeys(key(c) for c in cols)
    return {k: _tally([c for c in cols if key(c) == k]) for k in keys}


# --------------------------------------------------------------------------- inputs

def _mesh_shape(mesh) -> dict[str, int] | None:
    if mesh is None:
        return None
    shape = getattr(mesh, "shape", None)
    if not isinstance(shape, Mapping):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                        f"{type(mesh).__name__}; build one with jax.make_mesh(...).")
    return dict(shape)


# --------------------------------------------------------------------------- one instruction

def _is_collective(op: str, rest: str) -> bool:
    if op in KINDS:
        return True
    # A generic async-start names a wrapped computation (calls=...) whose plain collective
    # is listed on its own; counting the start as well would count it twice.
    return op.endswith("-start") and op[: -len("-start")] in KINDS and "calls=" not in rest


def _make_collective(instr, comp, num_devices, mesh_shape, in_loop, executions, wrapped):
    op, rest = instr["op"], instr["rest"]
    is_start = op.endswith("-start")
    kind = op[: -len("-start")] if is_start else op
    shape = instr["shape"]
    if is_start and kind != "all-reduce" and shape.lstrip().startswith("("):
        shape = _tuple_elements(shape)[1]     # (operands, results[, context...])
    buffers = _arrays(shape)
    pairs = _pairs(rest) if kind == "collective-permute" else ()
    groups = _permute_groups(pairs) if pairs else _replica_groups(rest, num_devices)
    size = len(groups[0]) if groups else 0
    nbytes = sum(_buffer_bytes(dtype, dims) for dtype, dims in buffers)
    return Collective(
        name=instr["name"].lstrip("%"), kind=kind,
        dtype=",".join(dict.fromkeys(dtype for dtype, _ in buffers)),
        shapes=tuple(dims for _, dims in buffers),
        bytes=nbytes * size if kind == "reduce-scatter" else nbytes,
        replica_groups=groups, group_size=size, num_groups=len(groups),
        mesh_axes=_mesh_axes(groups, mesh_shape) if mesh_shape is not None else None,
        in_loop=in_loop, executions=executions, is_async=is_start or wrapped,
        source_target_pairs=pairs, computation=comp)


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip()))
            for dtype, dims in _ARRAY.findall(shape)]


def _buffer_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    if dtype == "token":
        return 0
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype)[0])
    return -(-math.prod(dims) * bits // 8)


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape ``(a, (b, c), d)``."""
    inner, depth, parts, start = shape.strip()[1:-1], 0, [], 0
    for i, ch in enumerate(inner):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    return parts + [inner[start:]]


# --------------------------------------------------------------------------- device groups

_RG_LIST = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_RG_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_RG_MESH = re.compile(r"replica_groups=@?mesh[\[<](?P<axes>[^\]>]*)[\]>]"
                      r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?"
                      r"\s*\{(?P<refs>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")
_INTS = re.compile(r"\d+")


def _replica_groups(rest: str, num_devices: int) -> Groups:
    if m := _RG_IOTA.search(rest):
        ids = _iota(_ints(m[3]), _ints(m[4]) if m[4] else None)
        return _rows(ids.reshape(int(m[1]), int(m[2])))
    if m := _RG_MESH.search(rest):
        return _mesh_groups(m["axes"], m["ids"], m["refs"])
    m = _RG_LIST.search(rest)
    groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m[1])) if m else ()
    # No groups (or the empty list) means one group of every device.
    return groups or (tuple(range(num_devices)),)


def _ints(text: str) -> list[int]:
    return [int(v) for v in _INTS.findall(text)]


def _rows(array: np.ndarray) -> Groups:
    return tuple(tuple(int(v) for v in row) for row in array)


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota device list ``[dims]T(perm)``, flattened."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _mesh_groups(axes: str, device_ids: str | None, refs: str) -> Groups:
    """Groups of ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'a':(pre)size`` included)."""
    names, sizes = [], []
    for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", axes):
        names.append(name)
        sizes.append(int(size))
    if device_ids and device_ids.lstrip().startswith("["):
        m = re.match(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", device_ids)
        ids = _iota(_ints(m[2] or m[1]), _ints(m[3]) if m[3] else None)
    else:
        ids = np.array(_ints(device_ids)) if device_ids else np.arange(math.prod(sizes))
    parsed = [(names.index(n), (int(p), int(s)) if s else None)
              for n, p, s in re.findall(r"'?([^',:()\s]+)'?(?::\((\d+)\)(\d+))?", refs)]
    dims, grouped = [], []
    for axis, size in enumerate(sizes):
        subs = [sub for a, sub in parsed if a == axis]
        if not subs:
            dims.append(size)
            continue
        split, aggregate = _split_axis(size, subs)
        grouped += [len(dims) + a for a in aggregate]
        dims += split
    kept = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    return _rows(ids.reshape(dims).transpose(kept + grouped).reshape(-1, group_size))


def _split_axis(size: int, subs: list) -> tuple[list[int], list[int]]:
    """Splits one mesh axis into the sub-axes a group uses; returns (dims, grouped dims)."""
    if subs == [None]:
        return [size], [0]
    order = sorted(range(len(subs)), key=lambda i: subs[i][0])
    dims, aggregate, covered = [], [0] * len(subs), 1
    for i in order:
        pre, sub = subs[i]
        if pre != covered:
            dims.append(pre // covered)
            covered = pre
        aggregate[i] = len(dims)
        dims.append(sub)
        covered *= sub
    if covered != size:
        dims.append(size // covered)
    return dims, aggregate


def _pairs(rest: str) -> tuple[tuple[int, int], ...]:
    m = _PAIRS.search(rest)
    values = _ints(m[1]) if m else []
    return tuple(zip(values[::2], values[1::2]))


def _permute_groups(pairs: tuple[tuple[int, int], ...]) -> Groups:
    """Connected groups of devices that exchange data, e.g. one ring per mesh row."""
    parent: dict[int, int] = {}

    def root(d: int) -> int:
        while parent.setdefault(d, d) != d:
            d = parent[d]
        return d

    for src, dst in pairs:
        parent[root(src)] = root(dst)
    members: dict[int, list[int]] = {}
    for d in sorted(parent):
        members.setdefault(root(d), []).append(d)
    return tuple(sorted(tuple(g) for g in members.values()))


# --------------------------------------------------------------------------- hosts

def _host_map(mesh, hosts, num_devices: int) -> tuple[int, ...] | None:
    """The host of each device position: ``hosts`` when given, else the concrete mesh's
    ``process_index`` per device; ``None`` when neither says."""
    if hosts is None:
        if not isinstance(mesh, jax.sharding.Mesh):      # an AbstractMesh has no devices
            return None
        devices = mesh.devices
        hosts = [d.process_index for d in devices.flat]
    hosts = tuple(int(h) for h in hosts)
    if len(hosts) != num_devices:
        raise ValueError(f"collectives(): hosts has {len(hosts)} entries but the program runs on {num_devices} "
                         f"devices; give one host per device position (hosts[i] for mesh.devices.flat[i])")
    return hosts


def _with_hosts(c: Collective, host_of: tuple[int, ...]) -> Collective:
    """``c`` with how many hosts its groups span and its bytes on each network (`Collective`)."""
    spanned = max((len({host_of[d] for d in g}) for g in c.replica_groups), default=1)
    if c.source_target_pairs:
        crossing = {host_of[s] != host_of[t] for s, t in c.source_target_pairs if s != t}
        intra, inter = (c.bytes if False in crossing else 0), (c.bytes if True in crossing else 0)
    else:
        n = max(c.group_size, 1)
        a = max(n // spanned, 1)
        if spanned == 1:
            intra, inter = c.bytes, 0
        elif c.kind == "all-to-all":
            inter = -(-c.bytes * (n - a) // n)
            intra = c.bytes - inter
        else:
            intra, inter = (c.bytes if a > 1 else 0), -(-c.bytes // a)
    return dataclasses.replace(c, hosts_spanned=spanned, intra_host_bytes=intra, inter_host_bytes=inter,
                               num_hosts=len(set(host_of)))


# --------------------------------------------------------------------------- mesh axes

def _mesh_axes(groups: Groups, mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
    """The smallest set of mesh axes whose device groups are exactly ``groups``."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    target = {frozenset(g) for g in groups}
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    usable = [i for i, s in enumerate(sizes) if s > 1]
    for r in range(len(usable) + 1):
        for subset in itertools.combinations(usable, r):
            rest = [i for i in range(len(sizes)) if i not in subset]
            size = math.prod(sizes[i] for i in subset)
            candidate = ids.transpose(rest + list(subset)).reshape(-1, size)
            if {frozenset(row.tolist()) for row in candidate} == target:
                return tuple(names[i] for i in subset)
    return None
