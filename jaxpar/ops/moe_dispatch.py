"""Expert-parallel dispatch for a mixture of experts: tokens to their experts and back.

Each token goes to ``k`` experts (ids and combine weights from a router). The experts are
stacked SwiGLU weights ``gate, up [E, D, F]`` and ``down [E, F, D]``; with ``expert_axis``
the ``E`` experts are split over that mesh axis (``E / n`` per device) and, on every device:

1. the local token–expert assignments are sorted by expert, so the rows for each peer are
   contiguous;
2. one ``all_to_all`` sends them to the device owning their expert (``ragged_all_to_all``
   where the backend has it, else padded per-peer buffers);
3. the received rows are grouped by local expert and go through a grouped matmul
   (`jaxpar.ops.grouped_matmul`: JAX's Mosaic GPU kernels on Hopper, ``jax.lax.ragged_dot``
   elsewhere);
4. a second ``all_to_all`` brings the outputs back, and they are combined with the router
   weights.

Dropless with static shapes: a padded exchange needs one buffer size, known when the program
is compiled, but the rows a device sends to one peer depend on the routing. The dispatch
compiles a short ladder of capacities (growing by ``bucket_growth`` from the balanced load to
the worst case, all ``tokens · k`` rows for one peer), reads the routing histogram of every device
(an all-gather of ``E`` integers) and runs the smallest one that fits: no token is ever
dropped and the buffers exceed the largest per-peer load by at most ``bucket_growth``.
``capacity_factor`` instead gives every (device, expert) pair a fixed number of slots,
``ceil(capacity_factor · tokens · k / E)``; assignments beyond it are dropped and counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.deprecation import FormerForm, accepts_former_form, former_signature
from jaxpar.ops.activations import swiglu
from jaxpar.ops.grouped_matmul import KERNELS, grouped_matmul
from jaxpar.ops._common import AnyMesh, axes_of, axes_size, axis_position, inner_shard_map, resolve_mesh
from jaxpar.strategy import mesh_sizes, spec_entry

TRANSPORTS = ("auto", "all_to_all", "ragged")
Axes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertDispatch:
    """How ``moe_dispatch`` moves tokens to their experts: the mesh axes, the capacity and the
    kernels (the router's top-k is the width of the ``expert_ids`` it is given).

    >>> ExpertDispatch(expert_axis="data", capacity_factor=1.25).transport
    'auto'
    """

    expert_axis: Axes = None
    """Mesh axis (or axes) splitting the experts; None runs every expert here."""
    batch_axis: Axes = None
    """Mesh axes already splitting the tokens (the data axes); the tokens are split over
    ``batch_axis + expert_axis`` inside the dispatch."""
    mlp_axis: Axes = None
    """Mesh axes splitting ``F`` (tensor parallel inside the experts: one all-reduce after ``down``)."""
    capacity_factor: float | None = None
    """None = dropless; else slots per (device, expert) are
    ``ceil(capacity_factor · tokens_per_device · k / E)`` and the rest is dropped."""
    bucket_growth: float = 1.25
    """Ratio between the compiled dropless buffer sizes (> 1)."""
    transport: str = "auto"
    """``"auto"`` (ragged all-to-all where the backend compiles it), ``"all_to_all"`` (padded
    buffers) or ``"ragged"``."""
    kernel: str = "auto"
    """The experts' grouped matmul (`jaxpar.ops.grouped_matmul`): ``"auto"`` (JAX's Mosaic GPU
    kernels on a Hopper GPU, ``jax.lax.ragged_dot`` elsewhere), ``"xla"`` or ``"mosaic"``."""

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ExpertDispatch: transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.kernel not in KERNELS:
            raise ValueError(f"ExpertDispatch: kernel={self.kernel!r} is not one of {KERNELS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"ExpertDispatch: capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or "
                             f"None for dropless routing")
        if not self.bucket_growth > 1:
            raise ValueError(f"ExpertDispatch: bucket_growth={self.bucket_growth} must be > 1 (e.g. 1.25)")


_FIELDS = tuple(f.name for f in dataclasses.fields(ExpertDispatch))
_FORMER = FormerForm(
    "jaxpar.ops.moe_dispatch",
    former_signature("x expert_ids weights gate up down", {"*": None, **{
        f.name: f.default for f in dataclasses.fields(ExpertDispatch)}, "mesh": None}),
    lambda args, kwargs: any(name in kwargs for name in _FIELDS),
    lambda a: ((a["x"], a["expert_ids"], a["weights"], a["gate"], a["up"], a["down"],
                ExpertDispatch(**{name: a[name] for name in _FIELDS})), {"mesh": a["mesh"]}),
    "jaxpar.ops.moe_dispatch(x, expert_ids, weights, gate, up, down, jaxpar.ops.ExpertDispatch(expert_axis=..., "
    "capacity_factor=..., ...), mesh=...)")


class _Experts(NamedTuple):
    """The stacked SwiGLU weights: ``gate, up [E, D, F]``, ``down [E, F, D]``."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


@dataclasses.dataclass(frozen=True)
class _Route:
    """A dispatch resolved on a mesh: the axes as tuples and what runs on each device."""

    dispatch: ExpertDispatch
    ep_axes: tuple[str, ...] = ()
    tok_axes: tuple[str, ...] = ()
    mlp_axes: tuple[str, ...] = ()
    n: int = 1            # devices over the expert axes
    ragged: bool = False  # the exchange is a ragged all-to-all

    def mm(self, x, w, group_sizes):
        """The experts' grouped matmul with the kernel asked for."""
        return grouped_matmul(x, w, group_sizes, kernel=self.dispatch.kernel)


@accepts_former_form(_FORMER)
def moe_dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    dispatch: ExpertDispatch | None = None,
    *,
    mesh: AnyMesh | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``sum_k weights[t, k] · SwiGLU_{expert_ids[t, k]}(x[t])`` for tokens ``x [T, D]``.

    Args:
      x: tokens ``[T, D]``.
      expert_ids, weights: ``[T, k]`` router choices (ints in ``[0, E)``; a token may name one
        expert more than once) and combine weights.
      gate, up: ``[E, D, F]``; down: ``[E, F, D]``: the stacked expert weights.
      dispatch: an ``ExpertDispatch``: the expert, batch and mlp axes, the capacity (dropless
        by default), the transport and the grouped-matmul kernel; None: every expert here.
      mesh: the mesh; default the one set with ``jax.set_mesh``.

    Returns ``(y [T, D], stats)`` with ``stats["dropped"]`` (assignments dropped, over all
    devices), ``stats["capacity"]`` (rows per exchange buffer that ran) and
    ``stats["needed"]`` (rows the fullest buffer needed).

    Example:
      >>> mesh = jaxpar.make_mesh({"expert": 4}, devices=jax.devices()[:4])
      >>> x, w = jnp.ones((16, 8)), jnp.full((16, 2), 0.5)
      >>> ids = jnp.tile(jnp.array([[0, 5]]), (16, 1))
      >>> gate = up = jnp.ones((8, 8, 4)); down = jnp.ones((8, 4, 8))
      >>> y, stats = moe_dispatch(x, ids, w, gate, up, down, ExpertDispatch(expert_axis="expert"), mesh=mesh)
      >>> y.shape, int(stats["dropped"])
      ((16, 8), 0)
    """
    dispatch = ExpertDispatch() if dispatch is None else dispatch
    if not isinstance(dispatch, ExpertDispatch):
        raise TypeError(f"moe_dispatch: dispatch must be a jaxpar.ops.ExpertDispatch, got {type(dispatch).__name__}; "
                        f"e.g. ExpertDispatch(expert_axis='expert')")
    experts = _Experts(gate, up, down)
    d = dispatch
    if mesh is None and d.expert_axis is d.batch_axis is d.mlp_axis is None and jax.sharding.get_abstract_mesh().empty:
        # no mesh at all: every expert here, no shard_map (the one-device path)
        _check(x, expert_ids, weights, experts, None, _Route(d))
        return _local(x, expert_ids, weights, experts, _Route(d))
    ep_axes, tok_axes, mlp_axes, mesh = _axes(mesh, d.expert_axis, d.batch_axis, d.mlp_axis)
    if d.transport == "ragged" and not ragged_all_to_all_supported():
        raise ValueError(f"moe_dispatch: transport='ragged' but the {jax.default_backend()} backend cannot "
                         f"compile ragged_all_to_all; use transport='auto' or 'all_to_all'")
    ragged = d.transport == "ragged" or (d.transport == "auto" and ragged_all_to_all_supported())
    route = _Route(d, ep_axes, tok_axes, mlp_axes, axes_size(mesh, ep_axes), ragged and bool(ep_axes))
    _check(x, expert_ids, weights, experts, mesh, route)
    tok = PartitionSpec(spec_entry(tok_axes), None)
    w_in = PartitionSpec(spec_entry(ep_axes), None, spec_entry(mlp_axes))
    w_out = PartitionSpec(spec_entry(ep_axes), spec_entry(mlp_axes))
    stat = {"dropped": PartitionSpec(), "capacity": PartitionSpec(), "needed": PartitionSpec()}

    def local(x, ids, w, gate, up, down):
        return _local(x, ids, w, _Experts(gate, up, down), route)

    return inner_shard_map(local, mesh, "moe_dispatch", in_specs=(tok, tok, tok, w_in, w_in, w_out),
                           out_specs=(tok, stat), diff=(0, 2, 3, 4, 5), diff_out=0)(
        x, expert_ids, weights, gate, up, down)


def _axes(mesh, expert_axis, batch_axis, mlp_axis):
    mesh = resolve_mesh(mesh, "moe_dispatch")
    ep = axes_of("moe_dispatch", "expert_axis", expert_axis, mesh)
    batch = axes_of("moe_dispatch", "batch_axis", batch_axis, mesh)
    mlp = axes_of("moe_dispatch", "mlp_axis", mlp_axis, mesh)
    tok = batch + tuple(a for a in ep if a not in batch)
    # an F split over an axis that also splits the tokens would mix two token sets in one sum
    return ep, tok, tuple(a for a in mlp if a not in tok), mesh


@functools.cache
def ragged_all_to_all_supported(backend: str | None = None) -> bool:
    """Whether ``backend`` (default: JAX's default) compiles ``jax.lax.ragged_all_to_all``.

    Compiles a one-device exchange once per backend; XLA:CPU answers False.

    >>> ragged_all_to_all_supported("cpu")
    False
    """
    device = jax.devices(backend)[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("i",))

    def exchange(x):
        one = jnp.ones((1,), jnp.int32)
        zero = jnp.zeros((1,), jnp.int32)
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), zero, one, zero, one, axis_name="i")

    fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=PartitionSpec("i"), out_specs=PartitionSpec("i")))
    try:
        fn.lower(jax.ShapeDtypeStruct((1, 1), jnp.float32)).compile()
    except Exception:   # noqa: BLE001 - any refusal of the compiler means "not here"
        return False
    return True


# ----------------------------------------------------------------------------- per device

def _local(x, ids, w, experts: _Experts, route: _Route):
    t, k = ids.shape
    e = experts.gate.shape[0] * route.n
    flat = ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)          # assignments grouped by expert, so by peer too
    sorted_e = flat[order]
    rows = x[order // k]
    hist = jnp.bincount(flat, length=e).astype(jnp.int32)
    capacity_factor = route.dispatch.capacity_factor
    if capacity_factor is not None:
        out, stats = _dropping(rows, sorted_e, hist, experts, route, math.ceil(capacity_factor * t * k / e))
    elif not route.ep_axes:
        out = _experts(rows, hist, experts, route)
        stats = {"capacity": jnp.int32(t * k), "needed": jnp.int32(t * k), "dropped": jnp.int32(0)}
    else:
        out, stats = _dropless(rows, sorted_e, hist, experts, route)
    back = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    y = jnp.einsum("tkd,tk->td", back.reshape(t, k, -1), w.astype(back.dtype))
    tok_axes = route.tok_axes
    stats = {**stats, "dropped": _psum(stats["dropped"], tok_axes),
             "capacity": _pmax(stats["capacity"], tok_axes), "needed": _pmax(stats["needed"], tok_axes)}
    return y, stats


def _psum(v, axes):
    return jax.lax.psum(v, axes) if axes else v


def _pmax(v, axes):
    return jax.lax.pmax(v, axes) if axes else v


def _experts(rows, group_sizes, experts: _Experts, route: _Route):
    """SwiGLU of rows grouped by local expert (rows past the groups come out zero), with the
    grouped matmul of the kernel asked for."""
    dtype, mm = rows.dtype, route.mm
    h = swiglu(mm(rows, experts.gate.astype(dtype), group_sizes), mm(rows, experts.up.astype(dtype), group_sizes))
    return _psum(mm(h, experts.down.astype(dtype), group_sizes), route.mlp_axes)


def capacity_ladder(balanced: int, worst: int, growth: float) -> tuple[int, ...]:
    """Buffer sizes from ``balanced`` up to ``worst``, each at most ``growth`` times the last.

    >>> capacity_ladder(4, 16, 1.5)
    (4, 6, 9, 13, 16)
    """
    sizes_, c = [], max(1, balanced)
    while c < worst:
        sizes_.append(c)
        c = max(c + 1, math.floor(c * growth))
    return tuple(sizes_ + [worst])


def _dropless(rows, sorted_e, hist, experts: _Experts, route: _Route):
    a, d, el = rows.shape[0], rows.shape[1], experts.gate.shape[0]
    ep_axes, tok_axes, n = route.ep_axes, route.tok_axes, route.n
    # The top rung holds every row for one peer: no routing of ids in [0, E) can overflow it, even
    # a token naming one expert twice (the layer's top-k never does; the op stays exact if it does).
    worst = a
    peer = sorted_e // el
    per_peer = hist.reshape(n, el).sum(1)
    starts = jnp.cumsum(per_peer) - per_peer
    table = jax.lax.all_gather(hist, ep_axes).reshape(n, n, el)   # [source, peer, local expert]
    mine = table[:, axis_position(ep_axes)]            # [source, local expert]: the rows I receive
    if route.ragged:
        return _ragged(rows, table, (per_peer, starts), experts, route, n * worst)
    rank = jnp.arange(a) - starts[peer]               # position among the rows for that peer
    needed = jax.lax.pmax(per_peer.max(), tok_axes)   # the same on every device: all take one branch
    ladder = capacity_ladder(math.ceil(a / n), worst, route.dispatch.bucket_growth)
    index = jnp.searchsorted(jnp.asarray(ladder, jnp.int32), needed, side="left")

    def branch(c):
        def run(rows):
            send = jnp.zeros((n * c, d), rows.dtype).at[peer * c + rank].set(rows, unique_indices=True)
            recv = jax.lax.all_to_all(send, ep_axes, 0, 0, tiled=True)
            j = jnp.arange(n * c)
            out = _grouped(recv, (j // c, j % c), mine, experts, route)
            return jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)[peer * c + rank]
        return run

    out = jax.lax.switch(index, [branch(c) for c in ladder], rows)
    return out, {"capacity": jnp.asarray(ladder, jnp.int32)[index], "needed": needed, "dropped": jnp.int32(0)}


def _ragged(rows, table, sends, experts: _Experts, route: _Route, worst: int):
    """The exchange with ``ragged_all_to_all``: only real rows move; the receive buffer is sized
    by the same ladder, on the rows the fullest device receives. ``table``: ``[source, peer, local
    expert]`` rows; ``sends``: ``(per_peer, starts)``, the rows this device sends each peer and
    where they start."""
    a, d = rows.shape
    per_peer, starts = sends
    ep_axes, n = route.ep_axes, route.n
    me = axis_position(ep_axes)
    mine = table[:, me]
    pair = table.sum(-1)                               # [source, peer]
    recv_sizes = pair[:, me]
    recv_starts = jnp.cumsum(recv_sizes) - recv_sizes
    land = (jnp.cumsum(pair, 0) - pair)[me]            # where my rows start in each peer's buffer
    home = (jnp.cumsum(pair, 1) - pair)[:, me]         # where each source put its rows for me
    needed = jax.lax.pmax(recv_sizes.sum(), route.tok_axes)
    ladder = capacity_ladder(a, worst, route.dispatch.bucket_growth)
    index = jnp.searchsorted(jnp.asarray(ladder, jnp.int32), needed, side="left")

    def branch(c):
        def run(rows):
            recv = jax.lax.ragged_all_to_all(rows, jnp.zeros((c, d), rows.dtype), starts, per_peer, land,
                                             recv_sizes, axis_name=ep_axes)
            j = jnp.arange(c)
            src = jnp.searchsorted(jnp.cumsum(recv_sizes), j, side="right")
            within = j - recv_starts[jnp.minimum(src, n - 1)]
            out = _grouped(recv, (src, within), mine, experts, route)
            return jax.lax.ragged_all_to_all(out, jnp.zeros_like(rows), recv_starts, recv_sizes, home,
                                             per_peer, axis_name=ep_axes)
        return run

    out = jax.lax.switch(index, [branch(c) for c in ladder], rows)
    return out, {"capacity": jnp.asarray(ladder, jnp.int32)[index], "needed": needed, "dropped": jnp.int32(0)}


def _grouped(recv, origin, mine, experts: _Experts, route: _Route):
    """Experts applied to received rows: ``origin = (src, within)``, row ``j`` came from source
    ``src[j]`` at position ``within[j]`` of its rows (sorted by local expert, ``mine[source]`` rows
    each); the rest is padding. Rows are grouped by expert for ``ragged_dot`` and put back where
    they were."""
    src, within = origin
    n, el = mine.shape
    cum = jnp.cumsum(mine, 1)
    expert = (within[:, None] >= cum[jnp.minimum(src, n - 1)]).sum(1)   # el = past the source's rows
    expert = jnp.where(src < n, expert, el)
    order = jnp.argsort(expert, stable=True)
    y = _experts(recv[order], mine.sum(0), experts, route)
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def _dropping(rows, sorted_e, hist, experts: _Experts, route: _Route, slots: int):
    """Fixed ``slots`` per (device, expert): one all-to-all each way, dense per-expert matmuls."""
    gate, up, down = experts
    ep_axes, mlp_axes, n = route.ep_axes, route.mlp_axes, route.n
    a, d, el = rows.shape[0], rows.shape[1], gate.shape[0]
    e = n * el
    rank = jnp.arange(a) - (jnp.cumsum(hist) - hist)[sorted_e]
    keep = rank < slots
    pos = jnp.where(keep, sorted_e * slots + rank, e * slots)          # out of bounds = dropped
    send = jnp.zeros((e * slots, d), rows.dtype).at[pos].set(rows, mode="drop", unique_indices=True)
    recv = jax.lax.all_to_all(send, ep_axes, 0, 0, tiled=True) if ep_axes else send
    grouped = recv.reshape(n, el, slots, d).transpose(1, 0, 2, 3).reshape(el, n * slots, d)
    dtype = rows.dtype
    h = swiglu(jnp.einsum("esd,edf->esf", grouped, gate.astype(dtype)), jnp.einsum("esd,edf->esf", grouped,
                                                                                up.astype(dtype)))
    y = _psum(jnp.einsum("esf,efd->esd", h, down.astype(dtype)), mlp_axes)
    back = y.reshape(el, n, slots, d).transpose(1, 0, 2, 3).reshape(e * slots, d)
    back = jax.lax.all_to_all(back, ep_axes, 0, 0, tiled=True) if ep_axes else back
    out = jnp.where(keep[:, None], back[jnp.minimum(pos, e * slots - 1)], 0)
    return out, {"capacity": jnp.int32(slots), "needed": hist.max(), "dropped": (~keep).sum().astype(jnp.int32)}


def _check(x, ids, w, experts: _Experts, mesh, route: _Route) -> None:
    gate, up, down = experts
    ep_axes, tok_axes = route.ep_axes, route.tok_axes
    xs, shapes = jnp.shape(x), {"x": jnp.shape(x), "expert_ids": jnp.shape(ids), "weights": jnp.shape(w),
                                "gate": jnp.shape(gate), "up": jnp.shape(up), "down": jnp.shape(down)}
    if (len(xs) != 2 or len(shapes["expert_ids"]) != 2 or shapes["weights"] != shapes["expert_ids"]
            or shapes["expert_ids"][0] != xs[0] or len(shapes["gate"]) != 3 or shapes["up"] != shapes["gate"]
            or shapes["gate"][1] != xs[1] or shapes["down"] != (shapes["gate"][0], shapes["gate"][2], xs[1])):
        raise ValueError(f"moe_dispatch: needs x [T, D], expert_ids and weights [T, k], gate and up [E, D, F], "
                         f"down [E, F, D]; got {shapes}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"moe_dispatch: expert_ids must be integers, got {ids.dtype}")
    count, n = shapes["gate"][0], axes_size(mesh, ep_axes) if ep_axes else 1
    if count % n:
        raise ValueError(f"moe_dispatch: {count} experts are not divisible by {n}, the size of expert_axis "
                         f"{ep_axes} of mesh {mesh_sizes(mesh)}; use a number of experts that is a multiple of {n} "
                         f"or a smaller expert axis")
    nt = axes_size(mesh, tok_axes) if tok_axes else 1
    if xs[0] % nt:
        raise ValueError(f"moe_dispatch: {xs[0]} tokens are not divisible by {nt}, the devices of the batch and "
                         f"expert axes {tok_axes} of mesh {mesh_sizes(mesh)}; use a batch whose tokens are a multiple "
                         f"of {nt}")
