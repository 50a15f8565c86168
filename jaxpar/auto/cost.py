"""The cost model: per-device compute, communication and memory of one training step.

A *strategy* is an assignment of mesh axes to the graph's dimension classes (``axes[c]``, a
tuple of mesh axis names, ``()`` = not split). Each tensor then has a split: dimension ``d``
is divided by the product of the sizes of its class's axes. For every operator of the
forward program, with ``A(t)`` = the set of mesh axes splitting tensor ``t``:

* **compute**: ``flops × 3 / (product of the sizes of every axis in A(op))`` for matmuls
  (``2 ·`` result elements ``·`` contracting length, from the dot's dimension numbers),
  grouped matmuls (``ragged_dot``: ``2·m·k·n``, the groups cut the rows, they multiply
  nothing) and convolutions (forward + two backward products); for the rest, gathers
  included, ``3 ×`` the elements of its largest operand on one device (a gather reads one
  table row per index, its backward writes a table-sized gradient); time = flops /
  ``CostParams.flops_per_s``.
* **forward communication**: an operator whose inputs are split over axes its output is not
  (``A(inputs) − A(output)``: a split contracting dimension, a reduction over a split
  dimension, a gather from a split table) leaves partial sums → an **all-reduce** of the
  output's per-device bytes over those axes.
* **backward communication**: the gradient of input ``i`` (when it needs one: it depends on a
  parameter) sums over the axes the operator uses but ``i`` is not split over
  (``A(op) − A(i)``) → an **all-reduce** of ``i``'s per-device bytes. For ``x @ W`` with the
  batch split over ``data`` this is the data-parallel gradient all-reduce; with ``W``'s
  output columns split over ``model`` it is Megatron's all-reduce of ``dx``.
* **optimizer**: the gradient norm adds one 4-byte all-reduce per split parameter.
* **collective time**: an all-reduce of ``b`` bytes over a group of ``n`` devices takes
  ``latency + 2 (n − 1) / n · b / bandwidth`` (all-gather: ``(n − 1) / n · b / bandwidth``),
  with the slowest of the group's axes' bandwidths (``CostParams.bandwidth``, per axis).
  Two networks (`CostParams.inter_host_bandwidth` and ``hosts``): a group spanning ``h``
  hosts with ``a = n / h`` devices on each runs hierarchically, ``latency + f(a) · b /
  intra + f(h) · (b / a) / inter`` (``f``: the factor above; the inside part on the links of
  a host, the ``1/a`` share of each device between hosts).
  Gradient all-reduces (and the loss's own, which the backward pass never reads) are
  combined as XLA combines them: one latency per group of mesh axes and combiner bucket,
  and a parameter read twice reduced once (`jaxpar.auto.comm`).
* **memory** per device: parameters × (1 + ``optimizer_states``) + the batch (the step's
  arguments, exact), and the peak of temp buffers from a liveness walk of the forward and
  backward passes (`temp_peak`: saved values, cotangents, gradients; an estimate of XLA's temp).

Bytes follow `jaxpar.report.collectives`' convention (an all-reduce counts its result), so
predicted and compiled bytes can be compared directly.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from jaxpar.auto.comm import GRAD, NORM, SERIAL, TAIL, Comm, combined_time, comm_share, derivations, levels
from jaxpar.auto.derivatives import FREE, LINEAR, LINEAR_COLLECTIVES, derivative_reads, saved_reads
from jaxpar.auto.graph import Graph, Op, materialised

# XLA's GPU all-reduce / reduce-scatter combine threshold (kDefaultAllReduceCombineThreshold)
XLA_GPU_COMBINE_BYTES = 30 * 1024 * 1024 + 7

_PRODUCTS = ("dot_general", "ragged_dot_general", "conv_general_dilated")
_GATHER_LIKE = ("reshape", "concatenate", "slice", "dynamic_slice", "pad")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostParams:
    """Machine numbers of the cost model; set them or fit them with `calibrate`.

    Attributes:
      flops_per_s: sustained FLOP/s of one device.
      bandwidth: mesh axis name -> bytes/s of a collective over that axis (bus bandwidth);
        axes not named use ``default_bandwidth``.
      default_bandwidth: bytes/s for axes not in ``bandwidth``.
      latency: seconds per collective (per axis: ``latency_per_axis`` overrides).
      latency_per_axis: mesh axis name -> seconds per collective.
      optimizer_states: optimizer state tensors per parameter (Adam: 2).
      optimizer_scalar_bytes: step state that is not per parameter (Adam's int32 count and the
        `TrainState`'s int32 step counter).
      temp_activation_factor: a scale on the predicted peak of temp buffers (see `temp_peak`);
        1.0 is the liveness model as is; a backend that packs buffers differently can be fitted by
        comparing `Cost.temp_bytes` with ``jaxpar.report.memory(compiled).temp_bytes``.
      combine_threshold_bytes: the most bytes XLA's combiner puts in one combined gradient
        collective (`jaxpar.auto.comm`): XLA:GPU's default 30 MiB; ``math.inf`` for XLA:CPU,
        which has no byte limit (`calibrate` sets it from the backend).
      combine_threshold_count: the most collectives in one combined collective (XLA: 256).
      inter_host_bandwidth: two networks: bytes/s of a collective between hosts (InfiniBand,
        Ethernet, DCN), per device; ``None``: one network, every group priced as inside a host.
        ``bandwidth`` / ``default_bandwidth`` are then the links inside a host (NVLink, ICI).
      inter_host_latency: seconds per collective between hosts (``None``: ``latency``).
      devices_per_host: devices that share a host's fast links; `jaxpar.auto.search_job`
        searches which factor of each axis spans hosts when its devices need several.
      overlap: collectives that no operator waits for right away run behind compute, as
        XLA's async collectives and Megatron's ``--overlap-grad-reduce`` / ``--overlap-param-gather``
        run them (`jaxpar.auto.pricing`): the gradient reductions behind the last micro-batch's
        backward pass, ZeRO 3's parameter gathers behind the micro-batch before; only what
        does not fit under that compute is added to the step. ``False``: every collective is
        exposed (the tests' and CPU's setting).
      matmul_overlap: a matmul's own collectives (the all-reduce of its partial sums, the one of
        its input's gradient: tensor parallelism's) run in chunks behind the matmuls of their
        layer, as Megatron's ``--tp-comm-overlap`` (Transformer Engine's userbuffers: each
        all-gather / reduce-scatter pipelined with the GEMM next to it in the forward, the
        backward's bulk-overlapped with the dgrad / wgrad GEMMs) and XLA:GPU's windowed einsum
        (collective matmul) run them: per layer (the operators of one loop body; those outside
        loops are one pool) only the bytes' time above that layer's matmul compute counts
        (`pooled_hidden`); the latencies stay. ``False``: exposed.
      fused_attention: attention runs as one fused kernel (FlashAttention, cuDNN's fused
        attention, TPU Splash): its score matrices (two dimensions of one sequence: the scores,
        their mask, softmax and probabilities; `attention_scores`) stay in on-chip memory, are never saved
        for the backward pass (the kernel recomputes them there) and take no device memory.
        ``False``: saved as XLA saves any materialised value (jaxpar's own attention on CPU).
      gather_itemsize: bytes per element of the updated parameters' all-gather at ZeRO 1-2
        (`jaxpar.auto.pricing.price`): ``None``, the parameters' own dtype, as jaxpar gathers its
        fp32 master weights; ``2`` for a framework whose optimizer shards fp32 master weights and
        gathers the bf16 model weights (Megatron's distributed optimizer).
      hosts: the layout priced: mesh axis -> hosts it spans (``ParallelConfig.hosts``; set it
        with `placed`). A group over axes spanning ``h`` hosts is priced hierarchically (module
        docstring); the inside part of a spanning axis runs at ``default_bandwidth``, and its
        ``bandwidth`` / ``latency_per_axis`` entries hold the figures of a collective over that
        axis alone (what `placed` writes, for code that prices one axis at a time).
      memory_bandwidth: bytes/s the device's memory sustains for the operators that are not
        matmuls (elementwise fusions, reductions, the loss's softmax): each is priced at its
        largest operand's bytes, three times (forward and backward), at this rate, when that
        takes longer than its FLOPs. Set it from the memory's datasheet rate scaled by what a
        profile shows these operators reach (`op_terms`); ``None``: they are priced by FLOPs
        alone, as on a machine where they take no time beside the matmuls.
      sequence_parallel: mesh axes (tensor-parallel ones) over which the framework priced splits
        the sequence of the work between its tensor-parallel matmuls -- norms, residual adds,
        dropout (Megatron's ``--sequence-parallel``; in jaxpar, `jaxpar.ops.ContextParallel`'s
        ``residual`` constraint): with `memory_bandwidth`, an operator none of whose values is
        split over these axes moves its bytes divided by their sizes. Its collectives are priced
        as they are: the reduce-scatter and all-gather that replace an all-reduce move its bytes.

    Example:
      >>> CostParams(flops_per_s=1e9, default_bandwidth=1e9, latency=1e-6).latency_of(("data",))
      1e-06
      >>> two = CostParams(default_bandwidth=1e11, inter_host_bandwidth=1e10, devices_per_host=4)
      >>> two.placed({"data": 2}, {"data": 2, "model": 4}).bandwidth
      {'data': 10000000000.0}
    """

    flops_per_s: float = 1e14
    bandwidth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    default_bandwidth: float = 1e11
    latency: float = 1e-5
    latency_per_axis: Mapping[str, float] = dataclasses.field(default_factory=dict)
    optimizer_states: int = 2
    optimizer_scalar_bytes: int = 8
    temp_activation_factor: float = 1.0
    combine_threshold_bytes: float = XLA_GPU_COMBINE_BYTES
    combine_threshold_count: int = 256
    inter_host_bandwidth: float | None = None
    inter_host_latency: float | None = None
    devices_per_host: int | None = None
    hosts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    overlap: bool = False
    matmul_overlap: bool = False
    fused_attention: bool = False
    gather_itemsize: int | None = None
    memory_bandwidth: float | None = None
    sequence_parallel: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("flops_per_s", "default_bandwidth", "combine_threshold_bytes", "combine_threshold_count"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostParams.{name}={getattr(self, name)!r} is invalid: use a positive number "
                                 "(math.inf for combine_threshold_bytes: no byte limit, as on XLA:CPU)")
        if self.latency < 0 or self.optimizer_states < 0 or self.temp_activation_factor < 0:
            raise ValueError("CostParams: latency, optimizer_states and temp_activation_factor must be >= 0")
        for name, what, example in (("bandwidth", "positive bytes/s", "{'model': 4.5e11}"),
                                    ("latency_per_axis", "seconds >= 0", "{'data': 2e-5}")):
            table = getattr(self, name)
            bad = {a: v for a, v in table.items() if not isinstance(a, str) or isinstance(v, (bool, np.bool_))
                   or not isinstance(v, numbers.Real) or not (v > 0 if name == "bandwidth" else v >= 0)} \
                if isinstance(table, Mapping) else table
            if bad:
                raise ValueError(f"CostParams.{name}={table!r} is invalid at {bad!r}: give mesh axis name -> "
                                 f"{what}, e.g. {example}")
            object.__setattr__(self, name, dict(table))
        if self.inter_host_bandwidth is not None and not self.inter_host_bandwidth > 0:
            raise ValueError(f"CostParams.inter_host_bandwidth={self.inter_host_bandwidth!r} is invalid: use a "
                             "positive number of bytes/s, or None for one network")
        if not isinstance(self.sequence_parallel, (tuple, list)) or not all(
                isinstance(a, str) for a in self.sequence_parallel):
            raise ValueError(f"CostParams.sequence_parallel={self.sequence_parallel!r} is invalid: give a tuple of mesh "
                             "axis names, e.g. ('model',)")
        object.__setattr__(self, "sequence_parallel", tuple(self.sequence_parallel))
        if self.memory_bandwidth is not None and (isinstance(self.memory_bandwidth, bool) or not isinstance(
                self.memory_bandwidth, (int, float)) or not self.memory_bandwidth > 0):
            raise ValueError(f"CostParams.memory_bandwidth={self.memory_bandwidth!r} is invalid: use a positive "
                             "number of bytes/s (e.g. 2.5e12), or None to price elementwise operators by FLOPs")
        if self.inter_host_latency is not None and not self.inter_host_latency >= 0:
            raise ValueError(f"CostParams.inter_host_latency={self.inter_host_latency!r} is invalid: use seconds "
                             ">= 0, or None for `latency`")
        if self.devices_per_host is not None and (not isinstance(self.devices_per_host, int)
                                                  or isinstance(self.devices_per_host, bool)
                                                  or self.devices_per_host < 1):
            raise ValueError(f"CostParams.devices_per_host={self.devices_per_host!r} is invalid: use a positive "
                             "int (the devices one host holds), or None for one host")
        for name in ("overlap", "matmul_overlap", "fused_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CostParams.{name}={getattr(self, name)!r} is invalid: use True or False")
        if self.gather_itemsize is not None and (not isinstance(self.gather_itemsize, int)
                                                 or isinstance(self.gather_itemsize, bool)
                                                 or self.gather_itemsize not in (1, 2, 4, 8)):
            raise ValueError(f"CostParams.gather_itemsize={self.gather_itemsize!r} is invalid: use None (the "
                             "parameters' own dtype) or the bytes of the dtype the updated parameters are gathered "
                             "in: 1, 2, 4 or 8 (2: bf16 model weights beside fp32 master weights, as Megatron's "
                             "distributed optimizer)")
        if not isinstance(self.hosts, Mapping) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.hosts.values()):
            raise ValueError(f"CostParams.hosts={self.hosts!r} is invalid: give mesh axis -> hosts it spans "
                             "(positive ints), e.g. {'data': 2}")
        object.__setattr__(self, "hosts", {a: n for a, n in self.hosts.items() if n > 1})

    def collective_time(self, kind: str, axes: Sequence[str], nbytes: float, sizes: Mapping[str, int],
                        combined: bool = False) -> float:
        """Seconds for one collective; ``combined``: fused with others (gradients), no latency."""
        n = math.prod(sizes[a] for a in axes)
        if n <= 1:
            return 0.0
        lat = 0.0 if combined else self.latency_of(axes)
        h = self.hosts_of(axes)
        if h > 1:       # hierarchical: inside each host, then each device's 1/a share between hosts
            inside = min(self.default_bandwidth if a in self.hosts else self.bandwidth.get(a, self.default_bandwidth)
                         for a in axes)
            return lat + self._between(kind, n, h, nbytes, inside)
        bw = min(self.bandwidth.get(a, self.default_bandwidth) for a in axes)
        return lat + _factor(kind, n) * nbytes / bw

    def _between(self, kind: str, n: int, h: int, nbytes: float, inside: float) -> float:
        """Seconds (no latency) of a collective over ``n`` devices on ``h`` hosts."""
        a = n // h
        return _factor(kind, a) * nbytes / inside + _factor(kind, h) * nbytes / a / self.inter_host_bandwidth

    def hosts_of(self, axes: Sequence[str]) -> int:
        """Hosts a group over ``axes`` spans (1 with one network: no ``inter_host_bandwidth``)."""
        if self.inter_host_bandwidth is None:
            return 1
        return math.prod(self.hosts.get(a, 1) for a in axes)

    def check_axes(self, axes, where: str) -> None:
        """Refuse ``bandwidth`` / ``latency_per_axis`` entries for axes outside ``axes`` (the mesh
        axes ``where`` prices): a misspelt axis would be priced at the defaults unseen."""
        for name in ("bandwidth", "latency_per_axis"):
            stray = sorted(set(getattr(self, name)) - set(axes))
            if stray:
                raise ValueError(f"{where}: CostParams.{name} names {stray}, which no mesh it prices has (its axes: "
                                 f"{sorted(set(axes))}); use those names, or drop the entries")

    def only(self, axes) -> "CostParams":
        """These numbers with the ``bandwidth`` / ``latency_per_axis`` entries of ``axes`` alone."""
        return dataclasses.replace(self, bandwidth={a: b for a, b in self.bandwidth.items() if a in axes},
                                   latency_per_axis={a: t for a, t in self.latency_per_axis.items() if a in axes})

    def latency_of(self, axes: Sequence[str]) -> float:
        """Seconds of latency of one collective over ``axes`` (the slowest axis's; a group
        spanning hosts: ``inter_host_latency``, if slower)."""
        inside = max((self.latency_per_axis.get(a, self.latency) for a in axes if a not in self.hosts
                      or self.inter_host_bandwidth is None), default=0.0)
        if self.hosts_of(axes) > 1:
            return max(inside, self.latency if self.inter_host_latency is None else self.inter_host_latency)
        return inside

    def placed(self, hosts: Mapping[str, int], sizes: Mapping[str, int]) -> "CostParams":
        """These machine numbers for the layout ``hosts`` (mesh axis -> hosts it spans, the rest
        of the axis inside a host) of a mesh of ``sizes``: ``hosts`` set, and for each spanning
        axis the figures of a collective over it alone in ``bandwidth`` / ``latency_per_axis``
        (an earlier layout's figures dropped), as one-axis pricing (context attention, the
        experts' all-to-alls, pipeline sends) reads them.

        >>> placed = CostParams(inter_host_bandwidth=1e9).placed({"pipe": 2}, {"pipe": 2, "data": 4})
        >>> {axis: round(b / 1e9, 6) for axis, b in placed.bandwidth.items()}     # GB/s: the network between hosts
        {'pipe': 1.0}
        """
        for a, n in hosts.items():
            if a not in sizes or sizes[a] % n:
                raise ValueError(f"CostParams.placed: hosts={dict(hosts)} puts axis {a!r} on {n} hosts, but the mesh "
                                 f"{dict(sizes)} {'has no such axis' if a not in sizes else f'gives it {sizes[a]}'}; "
                                 f"use divisors of the axis sizes")
        bandwidth = {a: b for a, b in self.bandwidth.items() if a not in self.hosts}
        latency = {a: t for a, t in self.latency_per_axis.items() if a not in self.hosts}
        out = dataclasses.replace(self, hosts=dict(hosts), bandwidth=bandwidth, latency_per_axis=latency)
        if self.inter_host_bandwidth is None:
            return out
        for a in out.hosts:
            n, h = sizes[a], out.hosts[a]
            bandwidth[a] = _factor("all-gather", n) / out._between("all-gather", n, h, 1.0, self.default_bandwidth)
            latency[a] = out.latency_of((a,))
        return dataclasses.replace(out, bandwidth=bandwidth, latency_per_axis=latency)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _factor(kind: str, n: int) -> float:
    """Bytes on the wire per byte of a ring collective over ``n`` devices."""
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted per-device cost of one step under one strategy."""

    compute_s: float
    comm_s: float
    comm_bytes: int
    comm_by_axes: Mapping[str, int]          # "data" / "data+model" -> bytes
    argument_bytes: int
    temp_bytes: int
    invalid: int = 0                         # tensors that use one mesh axis twice
    grad_comm_s: float = 0.0                 # the parameter-gradient collectives' share of comm_s
    temp_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)   # `temp_parts`: the walk's terms
    comm_count: int = 0                      # collectives paying a latency, per step
    grad_comm_bytes: int = 0                 # bytes of the combined (gradient) collectives
    grad_comm_count: int = 0                 # combined collectives XLA makes of them, per step

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s if not self.invalid else math.inf

    @property
    def memory_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["comm_by_axes"] = dict(self.comm_by_axes)
        d["time_s"], d["memory_bytes"] = self.time_s, self.memory_bytes
        return d


# --------------------------------------------------------------------------- one operator

def tensor_axes(graph: Graph, t: int, axes: Sequence[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The mesh axes splitting tensor ``t`` (``None`` if one axis would split two dims)."""
    out: list[str] = []
    for c in graph.tensors[t].classes:
        if c >= 0:
            out.extend(axes[c])
    return tuple(out) if len(set(out)) == len(out) else None


def local_bytes(graph: Graph, t: int, axes, sizes: Mapping[str, int]) -> float:
    ta = tensor_axes(graph, t, axes) or ()
    return graph.tensors[t].nbytes / math.prod(sizes[a] for a in ta)


def op_terms(graph: Graph, op: Op, axes, sizes: Mapping[str, int], flags: "Flags",
             params: "CostParams | None" = None):
    """``(flops, [Comm], activation bytes, invalid)`` of one operator (`jaxpar.auto.comm.Comm`:
    kind, axes, bytes per step, combined group, runs per step, the tensor it carries).
    With ``params.memory_bandwidth`` an operator that is not a matmul counts the FLOPs that take
    as long as moving its largest operand (`CostParams.memory_bandwidth`), when that is more."""
    ts = [t for t in (*op.ins, *op.outs) if t >= 0]
    per = {}
    invalid = 0
    for t in ts:
        a = tensor_axes(graph, t, axes)
        if a is None:
            invalid += 1
            a = ()
        per[t] = frozenset(a)
    all_axes = frozenset().union(*per.values()) if per else frozenset()
    op_axes = [a for c in {c for t in ts for c in graph.tensors[t].classes if c >= 0} for a in axes[c]]
    if len(op_axes) != len(set(op_axes)):
        invalid += 1      # one mesh axis would split two dimensions of the iteration space
    shards = math.prod(sizes[a] for a in all_axes)
    comms = []
    if op.prim in _PRODUCTS:
        flops = 2 * _iteration_space(graph, op) * 3 / shards
    elif op.prim in FREE:
        flops = 0.0
    else:
        # each device's share of its largest operand (a table split over vocab while the lookup's
        # output is not: the output whole on every device; a table kept whole: its gradient too)
        local = {t: graph.tensors[t].nbytes / math.prod(sizes[a] for a in per[t]) for t in ts}
        flops = 3 * max((b / graph.tensors[t].itemsize for t, b in local.items()), default=0)
        if params is not None and params.memory_bandwidth and not (   # a fused kernel's scores stay on chip
                params.fused_attention and any(attention_scores(graph, t) for t in ts)):
            moved = 3 * max(local.values(), default=0)
            moved /= math.prod(sizes.get(a, 1) for a in params.sequence_parallel if a not in all_axes)
            flops = max(flops, moved * params.flops_per_s / params.memory_bandwidth)
    out = op.outs[0] if op.outs else -1
    if out >= 0:
        ins_axes = frozenset().union(*(per[t] for t in op.ins if t >= 0)) if any(t >= 0 for t in op.ins) else frozenset()
        lost = tuple(sorted(ins_axes - per[out], key=list(sizes).index))
        if lost:
            kind = "all-gather" if op.prim in _GATHER_LIKE else "all-reduce"
            # the loss's own reduction: nothing in the backward pass waits for it
            group = TAIL if kind == "all-reduce" and flags.tail and flags.tail[out] else SERIAL
            comms.append(Comm(kind, lost, local_bytes(graph, out, axes, sizes), group, tensor=out))
    forward = len(comms)          # the forward pass's collective; gradients' come next
    source = flags.source or tuple(t if p else -1 for t, p in enumerate(flags.param))
    # a reshape / transpose / cast does not sum its operand's gradient: a split result gives a
    # split cotangent, gathered (a broadcast sums over its new dims: an all-reduce)
    kind = "all-gather" if op.prim in FREE and op.prim != "broadcast_in_dim" else "all-reduce"
    for t in op.ins:
        if t >= 0 and flags.grad[t]:
            missing = tuple(sorted(all_axes - per[t], key=list(sizes).index))
            if missing:   # the gradient of a parameter (or of a value of parameters alone) waits
                nbytes = local_bytes(graph, t, axes, sizes)   # for the others
                if source[t] >= 0 and source[t] != t:   # a cast / view of a parameter: its gradient is
                    # reduced in the parameter's dtype (the step's fp32 master weights under "bf16")
                    nbytes *= max(1.0, graph.tensors[source[t]].itemsize / graph.tensors[t].itemsize)
                comms.append(Comm(kind, missing, nbytes, GRAD if source[t] >= 0 else SERIAL, 1, t))
    calls = flags.calls or (1,) * len(graph.tensors)
    act = sum(local_bytes(graph, t, axes, sizes) * max(1, calls[t] // max(op.repeat, 1))
              for t in op.outs if flags.saved[t])
    if op.keep == "recompute":    # the backward pass runs the forward again, collectives included
        flops += flops / 3
        comms += [c._replace(combined=SERIAL, tensor=-1) for c in comms[:forward]]
    if op.repeat != 1:      # inside a loop: every iteration computes, communicates and saves
        flops, act = flops * op.repeat, act * op.repeat
        comms = [c._replace(nbytes=c.nbytes * op.repeat, runs=op.repeat) for c in comms if op.repeat]
    return flops, comms, act, invalid


def matmul_hidden(op: Op, flops: float, comms: Sequence[Comm], sizes: Mapping[str, int],
                  params: "CostParams") -> float:
    """Seconds of a product's own (uncombined) collectives that run behind its compute under
    `CostParams.matmul_overlap`: their bytes' time, at most the operator's ``flops`` time (one
    operator alone; `pooled_hidden` pools the products of one layer)."""
    wire, compute = matmul_terms(op, flops, comms, sizes, params)
    return min(wire, compute)


def matmul_terms(op: Op, flops: float, comms: Sequence[Comm], sizes: Mapping[str, int],
                 params: "CostParams") -> tuple[float, float]:
    """``(seconds of a product's own uncombined collectives' bytes, seconds of its compute)``
    under `CostParams.matmul_overlap`; ``(0, 0)`` for anything else."""
    if not params.matmul_overlap or op.prim not in _PRODUCTS:
        return 0.0, 0.0
    wire = sum(params.collective_time(c.kind, c.axes, c.nbytes, sizes, True) for c in comms if not c.combined)
    return wire, flops / params.flops_per_s


def pooled_hidden(terms: Mapping[int, Sequence[float]]) -> float:
    """Seconds of tensor-parallel collectives hidden when each runs behind any matmul of its
    layer (`CostParams.matmul_overlap`): per pool (the operators of one loop body, keyed by its
    trip count: one layer, repeated; or the operators outside loops) the collectives' bytes'
    time, at most the pool's matmul compute. A layer's all-gather / reduce-scatter hides behind
    the GEMMs next to it, not only the one it feeds: Transformer Engine's userbuffers overlap
    pipelines each with the adjacent GEMM in the forward and bulk-overlaps the backward's with
    the dgrad / wgrad GEMMs; XLA's windowed einsum likewise.

    >>> pooled_hidden({1: (2.0, 1.0), 24: (1.0, 3.0)})
    2.0
    """
    return sum(min(wire, compute) for wire, compute in terms.values())


def _iteration_space(graph: Graph, op: Op) -> float:
    """Multiply-adds of one product. A ``dot_general``: its result's elements times the length of
    its contracting dims, read from the operator's own dimension numbers (not the dimension
    classes: attention's ``q·kᵀ`` has two sequence dims of one class, and counting a class once
    dropped the ``s²`` of its scores and of ``probs·v``)."""
    if op.prim == "dot_general" and op.get("contract") is not None and op.outs and op.outs[0] >= 0:
        lhs = graph.tensors[op.ins[0]].shape
        return math.prod(graph.tensors[op.outs[0]].shape) * math.prod(lhs[d] for d in op.get("contract")[0])
    sizes: dict[int, int] = {}
    fixed = 1
    tensors = [(t, ()) for t in (*op.ins, *op.outs)]
    if op.prim == "ragged_dot_general":     # lhs, rhs, out less their group dims; not group_sizes
        rhs_group, out_group = op.get("group")
        tensors = [(op.ins[0], ()), (op.ins[1], rhs_group), (op.outs[0], out_group)]
    for t, skip in tensors:
        if t < 0:
            continue
        for d, (c, n) in enumerate(zip(graph.tensors[t].classes, graph.tensors[t].shape)):
            if c >= 0 and d not in skip:
                sizes[c] = max(sizes.get(c, 1), n)
    if op.prim == "conv_general_dilated":
        rhs = graph.tensors[op.ins[1]]
        fixed = math.prod(rhs.shape) // max(1, math.prod(n for c, n in zip(rhs.classes, rhs.shape) if c >= 0))
    return math.prod(sizes.values()) * fixed


@dataclasses.dataclass(frozen=True)
class Flags:
    """Per tensor: needs a gradient, is a parameter, is kept for the backward pass, is
    recomputed in it."""

    grad: tuple[bool, ...]
    param: tuple[bool, ...]
    saved: tuple[bool, ...]
    recomputed: tuple[bool, ...] = ()     # would be saved, but a recompute region redoes it
    calls: tuple[int, ...] = ()           # a region input: saved once per call of its region
    source: tuple[int, ...] = ()          # `comm.derivations`: the parameter a value comes from
    tail: tuple[bool, ...] = ()           # `comm.derivations`: the backward pass never reads it


def analyse(graph: Graph, loops: bool = True, *, fused_attention: bool = False) -> Flags:
    """The per-tensor flags the cost model reads (computed once per graph).

    Saved for the backward pass: of the operators XLA materialises rather than fuses
    (`jaxpar.auto.graph.materialised`: matmuls, grouped ones too, convolutions, gathers,
    scatters, reductions, sorts and top-k, collectives, custom calls and kernels, linear
    algebra), the inputs and outputs their derivatives read (`saved_reads`: none of a
    running sum's, an in-place update's or a linear collective's, a scatter's indices); in a loop body (``repeat > 1``), also the operands a nonlinear
    operator's derivative reads (`derivative_reads`: JAX stacks a scan's residuals, and XLA
    cannot fuse them away across iterations; ``loops=False``: a loop of one iteration, which
    XLA removes). Inside a recompute region only what its policy keeps on the device is saved,
    plus the region's inputs and any of its values read after it; the rest is *recomputed*:
    it lives only while the region's backward runs. Values of one byte (masks) and scalars are
    never counted; half-precision ones are (a bf16 model's matmul outputs)."""
    params = {t for _, t in graph.params}
    for op in scan_slices(graph):     # a loop's slice of a stacked parameter is that parameter, per iteration
        params.update(op.outs)
    inputs = params | {t for _, t in (*graph.batch, *graph.others)}
    base = set()
    for op in graph.ops:
        if materialised(op.prim):
            base.update(t for t in saved_reads(op) if t >= 0)
    keep = {t: op.keep for op in graph.ops for t in op.outs}
    region_of = {t: op.region for op in graph.ops for t in op.outs}
    for op in graph.ops:      # a region's result read after it is saved like any value
        for t in op.ins:
            if t >= 0 and keep.get(t) == "recompute" and region_of[t] != op.region:
                keep[t] = "device"
    residual = {t for r in graph.regions for t in r.inputs}
    grad = needs_grad(graph)
    linear = (*LINEAR, *LINEAR_COLLECTIVES)
    for op in graph.ops:    # XLA does not fuse across a loop's iterations: what the derivative
        if loops and op.repeat > 1 and op.region < 0 and op.prim not in linear and not op.get("recomputed"):
            base.update(derivative_reads(op, grad))    # of a body reads is stacked (not one recomputed)

    def real(t):
        return t not in inputs and graph.tensors[t].itemsize >= 2 and len(graph.tensors[t].shape) > 0

    n = len(graph.tensors)
    if fused_attention:     # `CostParams.fused_attention`: score matrices stay in on-chip memory
        inputs = inputs | {t for t in range(n) if attention_scores(graph, t)}
    saved = tuple(real(t) and ((t in base and keep.get(t, "device") == "device") or t in residual)
                  for t in range(n))
    recomputed = tuple(real(t) and t in base and keep.get(t) == "recompute" and t not in residual
                       for t in range(n))
    calls = [1] * n
    for r in graph.regions:
        for t in r.inputs:
            calls[t] = max(calls[t], r.repeat)
    source, tail = derivations(graph, grad)
    return Flags(tuple(grad), tuple(t in params for t in range(n)), saved, recomputed, tuple(calls), source, tail)


def param_of(graph: Graph) -> dict[int, int]:
    """Each parameter tensor, and each whole cast of one (a ``convert_element_type`` of the same
    shape: the step's compute-dtype copy, `build_graph(compute_dtype=...)`), mapped to the
    parameter."""
    out = {t: t for _, t in graph.params}
    for op in graph.ops:
        if (op.prim == "convert_element_type" and op.ins and op.ins[0] in out and op.outs and op.outs[0] >= 0
                and graph.tensors[op.outs[0]].shape == graph.tensors[op.ins[0]].shape):
            out[op.outs[0]] = out[op.ins[0]]
    return out


def stacked_slices(graph: Graph) -> list[tuple[Op, int]]:
    """``(operator, parameter)`` for each operator by which a scan reads one slice of a
    parameter per step (``copy`` of a scan's ``xs``; the parameter or its compute-dtype cast,
    `param_of`, which the operator reads as ``op.ins[0]``): stacked layers' parameters, each
    read one layer at a time."""
    of = param_of(graph)
    return [(op, of[op.ins[0]]) for op in graph.ops
            if op.prim == "copy" and op.get("scan") == "xs" and op.ins[0] in of]


def scan_slices(graph: Graph) -> list[Op]:
    """The operators of `stacked_slices`."""
    return [op for op, _ in stacked_slices(graph)]


def attention_scores(graph: Graph, t: int) -> bool:
    """Whether tensor ``t`` is an attention score matrix (or its softmax, mask, probabilities):
    two of its dimensions are one class (query and key positions of one sequence) of equal
    length, beside at least one other (batch, heads). The two need not be the last ones: a
    grouped-query product ``btkgd,bskd`` leaves its group between them (``[B, K, T, G, S]``)."""
    tensor = graph.tensors[t]
    if len(tensor.shape) < 3:
        return False
    seen: dict[int, int] = {}
    for c, n in zip(tensor.classes, tensor.shape):
        if c >= 0 and n > 1:
            if seen.get(c) == n:
                return True
            seen[c] = n
    return False


def flags_for(graph: Graph, params: "CostParams", loops: bool = True) -> Flags:
    """`analyse` with the machine's settings (`CostParams.fused_attention`)."""
    return analyse(graph, loops, fused_attention=params.fused_attention)


def needs_grad(graph: Graph) -> list[bool]:
    """Tensors that depend on a parameter (and are floating point): their gradients exist."""
    flags = [False] * len(graph.tensors)
    for _, t in graph.params:
        flags[t] = True
    for op in graph.ops:
        if op.prim in ("stop_gradient", "iota") or not any(t >= 0 and flags[t] for t in op.ins):
            continue
        for t in op.outs:
            flags[t] = graph.tensors[t].itemsize >= 2 and op.prim not in ("argmax", "argmin") and \
                op.prim not in ("lt", "gt", "le", "ge", "eq", "ne", "is_finite", "sign")
    return flags


# --------------------------------------------------------------------------- a whole strategy

def param_terms(graph: Graph, axes, sizes, params: CostParams, batch_bytes: bool = True):
    """``(argument bytes, gradient bytes, [Comm])`` of the parameters and batch (the comms: the
    gradient norm's partial sums, one scalar per split parameter)."""
    args, grads = float(params.optimizer_scalar_bytes), 0.0
    comms = []
    for _, t in graph.params:
        b = local_bytes(graph, t, axes, sizes)
        args += b * (1 + params.optimizer_states)
        grads += b
        ta = tensor_axes(graph, t, axes) or ()
        if ta:
            comms.append(Comm("all-reduce", tuple(sorted(ta, key=list(sizes).index)), 4, NORM))
    for _, t in (*graph.others, *(graph.batch if batch_bytes else ())):
        args += local_bytes(graph, t, axes, sizes)
    return args, grads, comms


def evaluate(graph: Graph, axes: Sequence[tuple[str, ...]], sizes: Mapping[str, int],
             params: CostParams = CostParams(), *, flags: Flags | None = None) -> Cost:
    """The predicted `Cost` of the strategy ``axes`` (one tuple of mesh axes per class)."""
    flags = flags_for(graph, params) if flags is None else flags
    flops = act = 0.0
    by_axes: dict[str, float] = {}
    invalid = 0
    args, grads, comms = param_terms(graph, axes, sizes, params)
    per_op = []
    pools: dict[int, list[float]] = {}     # `CostParams.matmul_overlap`: per layer, `pooled_hidden`
    for op in graph.ops:
        f, c, a, bad = op_terms(graph, op, axes, sizes, flags, params)
        flops, act, invalid = flops + f, act + a, invalid + bad
        wire, compute = matmul_terms(op, f, c, sizes, params)
        pool = pools.setdefault(op.repeat, [0.0, 0.0])
        pool[0], pool[1] = pool[0] + wire, pool[1] + compute
        per_op.append(c)
    behind = pooled_hidden(pools)
    comms += levels(graph, per_op)
    priced = combined_time(comms, sizes, params)
    for c in comms:
        key = "+".join(c.axes)
        by_axes[key] = by_axes.get(key, 0) + c.nbytes
    parts = temp_parts(graph, axes, sizes, flags)
    temp = _peak(parts, params)
    return Cost(flops / params.flops_per_s, priced.seconds - behind, int(round(sum(by_axes.values()))),
                {k: int(round(v)) for k, v in by_axes.items()}, int(round(args)), int(round(temp)), invalid,
                priced.grad_s, parts, priced.count, int(round(priced.grad_bytes)), priced.grad_count)


def temp_peak(graph: Graph, axes, sizes: Mapping[str, int], params: CostParams, flags: Flags) -> float:
    """Predicted peak of XLA's temp buffers: a liveness walk over the forward program and its
    mirror-image backward pass, per device.

    Backward step ``i`` (operator ``i``'s backward; they run from the last operator to the
    first) holds: every saved forward value produced at or after ``i`` (``flags.saved``: the
    inputs and outputs of the operators XLA materialises rather than fuses, `analyse`), the
    cotangents of saved values still being summed (produced before ``i``, last read at or
    after it), and the gradients of parameters whose last reader is at or after ``i``. After
    the backward pass, gradients that are all-reduced exist twice (the sum is a new buffer)
    until the optimizer update reads them. The peak is the larger of the two. Values inside a
    loop are saved once per iteration (``Op.repeat``). A value a recompute region redoes
    (``flags.recomputed``) is live only from the start of that region's backward (its last
    operator) down to its producer, once per call.
    """
    return _peak(temp_parts(graph, axes, sizes, flags), params)


def _peak(parts: tuple[float, float, float], params: CostParams) -> float:
    act, grads, reduced = parts
    return max(params.temp_activation_factor * act, grads + reduced)


def temp_parts(graph: Graph, axes, sizes: Mapping[str, int], flags: Flags) -> tuple[float, float, float]:
    """``(peak during the passes, gradient bytes, bytes of gradients all-reduced)`` of `temp_peak`."""
    n = len(graph.ops)
    if n == 0:
        return 0.0, 0.0, 0.0
    produced: dict[int, int] = {}
    last: dict[int, int] = {}
    repeat: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.outs:
            produced[t], repeat[t] = i, op.repeat
        for t in op.ins:
            if t >= 0:
                last[t] = i
    for op in reversed(graph.ops):     # a loop slice is read where its readers read it
        if op.prim == "copy":
            for t in op.ins:
                if t >= 0:
                    last[t] = max(last[t], *(last.get(o, 0) for o in op.outs))
    diff = [0.0] * (n + 1)

    def add(lo: int, hi: int, nbytes: float) -> None:     # live at steps lo..hi
        diff[lo] += nbytes
        diff[hi + 1] -= nbytes

    recomputed = flags.recomputed or (False,) * len(graph.tensors)
    calls = flags.calls or (1,) * len(graph.tensors)    # a region input: once per call of it
    for t, i in produced.items():
        if flags.saved[t] or recomputed[t]:
            b = local_bytes(graph, t, axes, sizes)
            if flags.saved[t]:
                add(i, n - 1, b * max(repeat[t], calls[t]))
            else:   # redone when its region's backward starts, freed when that backward ends
                r = graph.regions[graph.ops[i].region]
                add(i, r.last, b * max(1, repeat[t] // max(r.repeat, 1)))
            if flags.grad[t] and t in last:
                add(i, max(last[t], i), b)
    grads = reduced = 0.0
    used = {a for c in range(graph.num_classes) for a in axes[c] if sizes[a] > 1}
    # a parameter's gradient exists from its last reader's backward on; a parameter the loss
    # reads through its cast (the compute-dtype copy, `param_of`) is read last where the cast
    # is (its gradient is summed in the cast's dtype until the cast's backward, counted here at
    # the parameter's bytes; measured: f64 parameters cast to f32 on XLA:CPU, 4.5 % under the
    # compiled temp, 21 % under it when the gradient was counted from the cast's backward on).
    # A cast whose value is kept (saved or recomputed) has its gradient counted above already.
    read_until: dict[int, int] = {}
    for v, t in param_of(graph).items():
        if v in last and (v == t or (flags.grad[v] and not (flags.saved[v] or recomputed[v]))):
            read_until[t] = max(read_until.get(t, 0), last[v])
    for _, t in graph.params:
        b = local_bytes(graph, t, axes, sizes)
        add(0, read_until.get(t, n - 1), b)
        grads += b
        if used - set(tensor_axes(graph, t, axes) or ()):    # summed over an axis it is not split on
            reduced += b
    peak = running = 0.0
    for i in range(n):
        running += diff[i]
        peak = max(peak, running)
    return peak, grads, reduced


def op_scalar(graph: Graph, op: Op, axes, sizes, params: CostParams, flags: Flags,
              runs: float = 1.0) -> tuple[float, float]:
    """One operator's (time, temp bytes): the DP's factor values.

    ``runs``: how many times a step runs the graph (the micro-batches of one step, when the
    graph is one micro-batch): the operator's FLOPs and its own collectives count ``runs``
    times, the parameter-gradient collectives it adds to the step's combined ones once, as
    `jaxpar.auto.pricing` prices a step."""
    f, comms, act, bad = op_terms(graph, op, axes, sizes, flags, params)
    if bad:
        return math.inf, math.inf
    once = sum(comm_share(c, sizes, params) for c in comms if c.combined and c.combined != TAIL)
    each = f / params.flops_per_s + sum(comm_share(c, sizes, params) for c in comms
                                        if not c.combined or c.combined == TAIL) \
        - matmul_hidden(op, f, comms, sizes, params)
    return runs * each + once, params.temp_activation_factor * act


def param_scalar(graph: Graph, t: int, axes, sizes, params: CostParams) -> tuple[float, float]:
    """One parameter's (time of its norm all-reduce, bytes: value + optimizer states + gradient)."""
    b = local_bytes(graph, t, axes, sizes)
    ta = tensor_axes(graph, t, axes)
    if ta is None:
        return math.inf, math.inf
    time = comm_share(Comm("all-reduce", ta, 4, NORM), sizes, params) if ta else 0.0
    return time, b * (2 + params.optimizer_states)
