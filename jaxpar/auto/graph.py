"""The operator graph of a training step, read from the loss's jaxpr.

``build_graph(model, loss_fn, batch)`` traces ``loss_fn(nnx.merge(graphdef, params, rest),
batch)`` with ``jax.make_jaxpr`` (parameters are explicit inputs, so every jaxpr input maps
back to a parameter path or a batch leaf), inlines nested calls (``jit``, ``custom_jvp``,
``custom_vjp``) and keeps one `Op` per primitive. A ``jax.checkpoint`` call is inlined too
and recorded as a `Region` (`Graph.regions`); each of its operators carries its policy's
verdict (`Op.keep`). A ``custom_vjp`` of elementwise work whose forward keeps only its inputs
(`jaxpar.ops.swiglu`) is read as such a checkpoint is (see `_Builder._custom_vjp`).

Loops and branches are read too (see `_Builder.inline`): a ``lax.scan`` body is inlined once,
its operators' ``repeat`` multiplied by the trip count; a ``lax.while_loop`` (trip count
unknown) is costed as one iteration and said so in `Graph.notes`; every branch of a
``lax.cond`` / ``lax.switch`` is inlined (the compute of all branches is counted).

Every tensor dimension belongs to a *dimension class*: dimensions that an operator ties
together (the same position of an elementwise op's operands, a dot's contracting pair, a
dot's batch dimensions and the output dimension they become, a reduction's kept dimensions,
a transpose's permutation...: the rules per primitive are in `jaxpar.auto.graph_rules`) are
unified, so a class is a logical axis found from the program itself: "the batch", "the residual width", "layer 3's MLP width". A strategy assigns
mesh axes to classes; every operator's strategy (how each of its inputs and outputs is
split) follows from it. A class that appears twice in one tensor (the two sequence axes of
attention scores) is kept whole.

    >>> g = build_graph(model, loss_fn, batch)            # doctest: +SKIP
    >>> len(g.ops), g.class_names[:3]                     # doctest: +SKIP
    (221, ('batch', 'seq', 'wte:1'))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.ad_checkpoint import Offloadable, Recompute, Saveable
from jax.extend.core import ClosedJaxpr as _ClosedJaxpr
from jax.extend.core import DebugInfo as _DebugInfo
from jax.extend.core import DropVar as _DropVar
from jax.extend.core import Jaxpr as _Jaxpr
from jax.extend.core import Literal as _Literal
from jax.extend.core import jaxpr_as_fun, jaxprs_in_params

from jaxpar.auto.graph_rules import RULES, elementwise
from jaxpar.nn.specs import itemsize, logical_names, path_str

_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "custom_vjp_call_jaxpr": "fun_jaxpr", "custom_vmap_call": "call", "remat": "jaxpr",
           "remat2": "jaxpr", "checkpoint": "jaxpr"}
_CHECKPOINTS = ("checkpoint", "remat", "remat2")     # jax.checkpoint's primitive, by JAX version
_CUSTOM_VJPS = ("custom_vjp_call", "custom_vjp_call_jaxpr")   # jax.custom_vjp's, by JAX version
# operators that only carry a value on (`Builder._kept_by_name` walks back through them)
_PASS_THROUGH = ("reshape", "convert_element_type", "sharding_constraint", "transpose", "squeeze",
                 "expand_dims")
# scatters carry their combiner (``x + y``, ``y``, ...) as a sub-program: it is elementwise on one
# element, so the scatter is priced as one operator without reading it (an MoE layer's
# one-device path scatters its outputs back into token order and counts tokens per expert)
_OPAQUE = ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
           "scatter-max", "scatter_max")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One value of the program: shape, bytes per element, and one class id per dimension
    (``-1`` for size-1 dimensions, which are never split)."""

    shape: tuple[int, ...]
    itemsize: int
    classes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


# primitives whose results XLA writes to memory rather than fusing them into their readers, or
# that run as a kernel or a transfer of their own: matmuls (grouped ones too: an MoE layer's
# experts), convolutions, gathers and scatters (an MoE dispatch's ``.at[order].set``,
# ``jnp.bincount``) and in-place updates, reductions (running and windowed ones), sorts and
# top-k, collectives, custom calls and Pallas kernels, linear algebra. A loop's operators are
# inlined into the graph, so a scan or while loop holding one of these holds a materialised operator.
_MATERIALISED = frozenset({
    "dot_general", "ragged_dot_general", "conv_general_dilated", "gather", *_OPAQUE, "dynamic_update_slice",
    "reduce", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "select_and_scatter_add", "select_and_gather_add",
    "sort", "top_k", "approx_top_k",
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant", "all_to_all",
    "ragged_all_to_all", "ppermute", "reduce_scatter",
    "ffi_call", "custom_call", "pallas_call",
    "fft", "cholesky", "triangular_solve", "lu", "qr", "svd", "eig", "eigh", "schur", "hessenberg",
    "householder_product", "tridiagonal", "tridiagonal_solve",
})


def materialised(prim: str) -> bool:
    """Whether ``prim`` costs real work of its own: XLA writes the values it makes to memory
    rather than fusing them into their readers (`_MATERIALISED`; every ``reduce_*`` but
    ``reduce_precision``, which rounds element by element). The rest is elementwise work.

    >>> materialised("ragged_dot_general"), materialised("scatter-add"), materialised("mul")
    (True, True, False)
    """
    return prim in _MATERIALISED or (prim.startswith("reduce_") and prim != "reduce_precision")


@dataclasses.dataclass(frozen=True)
class Op:
    """One primitive: its name, input and output tensor ids and the few parameters the cost
    model needs (``contract``: input dims summed over, per input; ``reduce``: reduced dims).
    ``repeat``: how many times the operator runs per step (the trip count of an enclosing loop).
    ``region``: the recompute (``jax.checkpoint``) region it is in, an index into
    ``Graph.regions`` (``-1``: none); ``keep``: what that region's policy does with its outputs:
    ``"device"`` (saved for the backward pass, also outside regions), ``"host"`` (moved to host
    memory by a JAX policy the model sets itself, e.g. ``jax.checkpoint_policies.offload_dot_with_no_batch_dims``:
    jaxpar has no such policy of its own) or ``"recompute"`` (recomputed in the backward pass)."""

    prim: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    info: tuple = ()
    repeat: int = 1
    region: int = -1
    keep: str = "device"

    def get(self, key, default=None):
        return dict(self.info).get(key, default)


@dataclasses.dataclass(frozen=True)
class Region:
    """One ``jax.checkpoint`` call: its operators are ``ops[first:last + 1]``; ``inputs``, the
    tensors it reads from outside (saved for its backward instead of its own values);
    ``repeat``: runs per step of the call itself (its operators' ``repeat`` divided by it is
    how many loop iterations run inside one call)."""

    first: int
    last: int
    inputs: tuple[int, ...]
    repeat: int
    policy: str


@dataclasses.dataclass(frozen=True)
class Graph:
    """Tensors, operators and dimension classes of one loss; inputs named by path."""

    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    class_sizes: tuple[int, ...]
    class_names: tuple[str, ...]
    params: tuple[tuple[str, int], ...]          # (parameter path, tensor id)
    batch: tuple[tuple[str, int], ...]           # (batch leaf path, tensor id)
    others: tuple[tuple[str, int], ...]          # non-Param variables (rng counts, stats)
    param_logical: tuple[tuple | None, ...]      # the model's own logical names, per parameter
    unsplittable: frozenset[int]                 # classes kept whole (twice in one tensor, a scan's axis)
    notes: tuple[str, ...] = ()                  # what the graph approximates (while loops' trip counts)
    regions: tuple["Region", ...] = ()          # recompute regions (jax.checkpoint / nnx.remat)

    @property
    def num_classes(self) -> int:
        return len(self.class_sizes)

    def param_tensor(self, path: str) -> Tensor:
        return self.tensors[dict(self.params)[path]]


# --------------------------------------------------------------------------- tracing

def compute_dtype(config) -> str | None:
    """The dtype a step under ``config`` (a ``ParallelConfig``) computes in: its precision's
    ``compute``, or ``None`` without a precision (the model's own dtypes)."""
    precision = getattr(config, "precision", None)
    return None if precision is None else precision.compute


def build_graph(model: nnx.Module, loss_fn: Callable, batch: Any, *, compute_dtype: Any = None) -> Graph:
    """Trace ``loss_fn(model, batch)`` (abstractly, nothing runs) into a `Graph`.

    ``compute_dtype``: the dtype the step computes in (``ParallelConfig.precision``'s ``compute``,
    `compute_dtype`): floating-point parameters and batch leaves are cast to it inside the
    loss, as the Trainer's step casts them (`jaxpar.train.step.cast`), so the activations have
    the dtype they will have in training, while the parameters keep the model's dtype (their
    gradients are priced in it: the ``"bf16"`` preset reduces in fp32). The precision's other
    fields are not modelled (``params="bfloat16"`` storage, fp8 matmuls). ``None``: as the
    model gives them."""
    from jaxpar.precision import cast_floats

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
                                      if not hasattr(x, "dtype") else jax.ShapeDtypeStruct(x.shape, x.dtype), t)

    def loss(params, rest, batch):
        if compute_dtype is not None:
            params, batch = cast_floats(params, compute_dtype), cast_floats(batch, compute_dtype)
        out = loss_fn(nnx.merge(graphdef, params, rest), batch)
        out = out[0] if isinstance(out, tuple) else out
        return out.astype(np.float32) if compute_dtype is not None else out    # as the step returns it

    closed = jax.make_jaxpr(loss)(abstract(params), abstract(rest), abstract(batch))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    p_flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
    r_flat = jax.tree_util.tree_flatten_with_path(rest, is_leaf=is_var)[0]
    b_flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    builder = _Builder()
    invars = closed.jaxpr.invars
    if len(invars) != len(p_flat) + len(r_flat) + len(b_flat):
        raise ValueError(f"build_graph: the loss jaxpr has {len(invars)} inputs but the model and batch have "
                         f"{len(p_flat) + len(r_flat) + len(b_flat)} leaves; is loss_fn closing over arrays?")
    ids = [builder.var(v) for v in invars]
    for v in closed.jaxpr.constvars:
        builder.var(v)
    builder.inline(closed.jaxpr, {})
    n_p, n_r = len(p_flat), len(r_flat)
    params_named = tuple((path_str(p), ids[i]) for i, (p, _) in enumerate(p_flat))
    others = tuple((path_str(p), ids[n_p + i]) for i, (p, _) in enumerate(r_flat))
    batch_named = tuple((jax.tree_util.keystr(p), ids[n_p + n_r + i]) for i, (p, _) in enumerate(b_flat))
    logical = tuple(logical_names(v) for _, v in p_flat)
    return builder.finish(params_named, batch_named, others, logical)


def _itemsize(dtype) -> int:
    """`jaxpar.nn.specs.itemsize`; 1 for what holds no data (a ``float0`` cotangent, a token)."""
    if dtype is None or dtype == jax.dtypes.float0:
        return 1
    return itemsize(dtype)


class _Builder:
    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []
        self.itemsizes: list[int] = []
        self.ids: dict[Any, int] = {}
        self.ops: list[Op] = []
        self.parent: list[int] = []          # union-find over (tensor, dim) slots
        self.slot0: list[int] = []
        self.keep: list[Any] = []
        self.repeat = 1                      # runs per step of the ops appended now (enclosing scans)
        self.whole: list[tuple[int, int]] = []   # (tensor, dim) slots whose class stays whole
        self.notes: list[str] = []
        self.regions: list[Region] = []
        self.region = -1                     # the recompute region ops appended now belong to
        self.policy: Any = None              # its jax.checkpoint policy (None: save nothing)
        self.named: list[int] = []           # values its policy saves by name (`_kept_by_name`)

    # ------------------------------------------------------------ tensors and dims
    def var(self, v) -> int:
        """The tensor of a top-level jaxpr variable (inputs and constants)."""
        if id(v) not in self.ids:
            self.ids[id(v)] = self.new(v)
            self.keep.append(v)               # id(v) is the key: v must outlive the build
        return self.ids[id(v)]

    def new(self, v) -> int:
        """A fresh tensor for ``v`` (one per call: a jitted function called twice shares its jaxpr)."""
        aval = v.aval
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        tid = len(self.shapes)
        self.shapes.append(shape)
        self.itemsizes.append(_itemsize(getattr(aval, "dtype", None)))
        self.slot0.append(len(self.parent))
        self.parent.extend(range(len(self.parent), len(self.parent) + len(shape)))
        return tid

    def slot(self, t: int, d: int) -> int:
        return self.slot0[t] + d

    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def link(self, t1: int, d1: int, t2: int, d2: int) -> None:
        if t1 < 0 or t2 < 0:
            return
        if self.shapes[t1][d1] != self.shapes[t2][d2] or self.shapes[t1][d1] == 1:
            return
        a, b = self.find(self.slot(t1, d1)), self.find(self.slot(t2, d2))
        if a != b:
            self.parent[max(a, b)] = min(a, b)

    # ------------------------------------------------------------ jaxpr walking
    def inline(self, jaxpr, env: dict) -> None:
        """Append the ops of ``jaxpr`` (``env``: id of a variable -> its tensor).

        Nested calls are inlined with their inputs and outputs mapped to the caller's tensors.
        Loops and branches:

        * ``scan``: the body is inlined once, with ``self.repeat`` multiplied by ``length``
          (so nested scans multiply), which every op appended inside it records. Consts and
          carries map to the caller's tensors (a body carry output is linked dim by dim to
          its input); an ``xs`` input ``[length, ...]`` is read through a fresh slice tensor
          whose dim ``d`` is linked with dim ``d + 1`` of the stacked input, a ``ys`` output
          is a fresh stacked tensor linked the same way. The stacked (iteration) dims of one
          scan form one class, kept whole: the loop walks it in order.
        * ``while``: the trip count is not known statically: the body (and the condition)
          are inlined once, at the enclosing repeat, carries as for ``scan``; the graph's
          ``notes`` say so.
        * ``cond`` / ``switch``: every branch is inlined on the same operand tensors, and each
          result is linked dim by dim to every branch's result. The compute and communication
          of all branches are counted (an over-estimate by up to the number of branches:
          ``repeat`` is an integer, and which branch runs is known only at run time).

        The slices and merges are recorded as ``copy`` operators (no compute; they carry the
        gradient dependence the cost model reads): an ``xs`` slice as run ``0`` times (XLA
        reads the slice in place, and a stacked parameter's slice is no more an activation
        than the unrolled layer's parameter is), a ``ys`` stack and a branch merge once.
        Scatters are read as one operator (their combiner is elementwise). Any other primitive
        holding a sub-program raises ``NotImplementedError``.
        """
        def tid(atom):
            if isinstance(atom, _Literal):
                return -1
            return env[id(atom)] if id(atom) in env else self.var(atom)

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "name":       # checkpoint_name: the same value under a name a policy may save
                t = tid(eqn.invars[0])
                env[id(eqn.outvars[0])] = t
                if t >= 0 and self.region >= 0 and self._keep(eqn) != "recompute":
                    self.named.append(t)
                continue
            if name in _LOOPS:
                _LOOPS[name](self, eqn, [tid(a) for a in eqn.invars], env)
                continue
            sub = _INLINE.get(name)
            inner = eqn.params.get(sub) if sub else None
            if inner is None and name.startswith("custom_") and "call_jaxpr" in eqn.params:
                inner = eqn.params["call_jaxpr"]
            if inner is not None:
                inner_jaxpr = getattr(inner, "jaxpr", inner)
                args = [tid(a) for a in eqn.invars[len(eqn.invars) - len(inner_jaxpr.invars):]]
                sub_env = self._enter(inner_jaxpr, args)
                if name in _CHECKPOINTS:
                    self._checkpoint(eqn, inner_jaxpr, args, sub_env)
                elif name in _CUSTOM_VJPS:
                    self._custom_vjp(eqn, inner_jaxpr, sub_env)
                else:
                    self.inline(inner_jaxpr, sub_env)
                for out, t in zip(eqn.outvars, self._results(inner_jaxpr, sub_env)):
                    env[id(out)] = t if t >= 0 else self.new(out)
                continue
            if name not in _OPAQUE and next(iter(jaxprs_in_params(eqn.params)), None) is not None:
                raise NotImplementedError(
                    f"jaxpar.auto: the loss uses the primitive {name!r}, which holds a sub-program the "
                    "strategy search does not read (it reads jit/remat/custom_jvp/custom_vjp calls, "
                    "lax.scan, lax.while_loop and lax.cond). Search on a model without it.")
            ins = tuple(tid(a) for a in eqn.invars)
            outs = tuple(self.new(v) for v in eqn.outvars)
            for v, t in zip(eqn.outvars, outs):
                env[id(v)] = t
            self.ops.append(Op(name, ins, outs, self._link_op(name, ins, outs, eqn.params), self.repeat,
                               self.region, self._keep(eqn)))

    def _checkpoint(self, eqn, jaxpr, args, env) -> None:
        """A recompute region: its ops record the region and what its policy keeps.

        A checkpoint nested in another one is read as part of the outer region: what the
        step keeps between the forward and the backward is the outermost policy's choice
        (the inner policy only shapes the outer region's own backward)."""
        if self.region >= 0:
            self.inline(jaxpr, env)
            return
        policy = eqn.params.get("policy")
        first, idx = len(self.ops), len(self.regions)
        self.region, self.policy, self.named = idx, policy, []
        self.regions.append(None)   # reserve the index
        try:
            self.inline(jaxpr, env)
            self._kept_by_name(first)
        finally:
            self.region, self.policy, self.named = -1, None, []
        if not any(materialised(op.prim) for op in self.ops[first:]):
            # elementwise work alone (an activation recomputed from its inputs, `jaxpar.ops.swiglu`):
            # outside loops the model counts such values as fused, saved or not, so no region; in
            # a loop body its derivative's reads are not stacked either (``recomputed``)
            self.ops[first:] = [dataclasses.replace(op, region=-1, keep="device",
                                                    info=(*op.info, ("recomputed", True)))
                                for op in self.ops[first:]]
            self.regions.pop()
            return
        name = getattr(policy, "__name__", None) or ("nothing_saveable" if policy is None else repr(policy))
        inputs = tuple(dict.fromkeys(t for t in args if t >= 0))
        self.regions[idx] = Region(first, len(self.ops) - 1, inputs, self.repeat, name)

    def _custom_vjp(self, eqn, jaxpr, env) -> None:
        """A ``custom_vjp`` call, inlined (its primal): its backward keeps what its forward
        returns as residuals, not what the primal computes, whatever policy encloses it.

        One of elementwise work alone whose residuals are its inputs (`jaxpar.ops.swiglu`;
        `_keeps_its_inputs` traces its ``jax.vjp``) is read as a checkpoint of elementwise work
        is: outside a region its operators are marked ``recomputed`` (in a loop body its
        derivative's reads are not stacked); inside one, the values it computes on the way to its
        results are recomputed whatever the region's policy says (its results stay the policy's
        choice, as the enclosing region sees them). Any other ``custom_vjp`` (one holding a
        matmul, a collective: ring attention, the chunked cross-entropy) is read as its primal."""
        first = len(self.ops)
        self.inline(jaxpr, env)
        if any(materialised(op.prim) for op in self.ops[first:]) or not _keeps_its_inputs(eqn):
            return
        if self.region < 0:
            self.ops[first:] = [dataclasses.replace(op, info=(*op.info, ("recomputed", True)))
                                for op in self.ops[first:]]
            return
        results = set(self._results(jaxpr, env))
        self.ops[first:] = [op if results.intersection(op.outs) else dataclasses.replace(op, keep="recompute")
                            for op in self.ops[first:]]

    def _kept_by_name(self, first: int) -> None:
        """The values the region's policy saves by name (``checkpoint_name``, `named`) are not
        computed again in the backward pass: the operator that made each one, and those before
        it through reshapes, casts and constraints, are kept, not recomputed -- up to a value
        that another operator of the region also reads (that one still needs its maker)."""
        ops = self.ops[first:]
        made = {t: i for i, op in enumerate(ops) for t in op.outs}
        readers: dict[int, int] = {}
        for op in ops:
            for t in set(op.ins):
                readers[t] = readers.get(t, 0) + 1
        for t in self.named:
            while t in made:
                i = made[t]
                self.ops[first + i] = dataclasses.replace(ops[i], keep="device")
                op = ops[i]
                if op.prim not in _PASS_THROUGH or not op.ins or op.ins[0] < 0 or readers.get(op.ins[0], 0) > 1:
                    break
                t = op.ins[0]

    def _keep(self, eqn) -> str:
        """What the current region's policy does with ``eqn``'s outputs (see `Op`)."""
        if self.region < 0:
            return "device"
        if self.policy is None:
            return "recompute"
        decision = self.policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
        if isinstance(decision, bool):
            return "device" if decision else "recompute"
        if decision is Saveable:
            return "device"
        if decision is Recompute:
            return "recompute"
        if isinstance(decision, Offloadable):
            return "host"
        raise TypeError(f"jaxpar.auto: the checkpoint policy {self.policy!r} returned {decision!r} for "
                        f"{eqn.primitive.name}; a policy returns a bool, jax.ad_checkpoint.Saveable, Recompute "
                        "or an Offloadable")

    def _copy_keep(self) -> str:
        """A scan's or cond's copy inside a region is kept or redone as the region's values are."""
        return "device" if self.region < 0 or self.policy is not None else "recompute"

    def _enter(self, jaxpr, args) -> dict:
        """The env of a sub-jaxpr whose inputs are the tensors ``args`` (``-1``, a literal: a
        fresh tensor); its constants get fresh tensors."""
        sub = {}
        for v, t in zip(jaxpr.invars, args):
            sub[id(v)] = t if t >= 0 else self.new(v)
        for v in jaxpr.constvars:
            sub[id(v)] = self.new(v)
        return sub

    @staticmethod
    def _results(jaxpr, env) -> list[int]:
        """The tensors of a sub-jaxpr's outputs (``-1`` for literals)."""
        return [-1 if isinstance(v, _Literal) else env.get(id(v), -1) for v in jaxpr.outvars]

    def _link_all(self, t1: int, t2: int, shift: int = 0) -> None:
        """Link dim ``d`` of ``t1`` with dim ``d + shift`` of ``t2``."""
        if t1 >= 0 and t2 >= 0:
            for d in range(len(self.shapes[t1])):
                if d + shift < len(self.shapes[t2]):
                    self.link(t1, d, t2, d + shift)

    def _carry(self, carry_in, body_outs, outvars, env) -> None:
        """Loop carries: the body's output linked to its input, the loop's result is it."""
        for t_in, t_out, out in zip(carry_in, body_outs, outvars):
            self._link_all(t_in, t_out)
            if t_out < 0:
                t_out = self.new(out)
                self._link_all(t_in, t_out)
            env[id(out)] = t_out

    def _scan(self, eqn, ins, env) -> None:
        p = eqn.params
        body = p["jaxpr"].jaxpr
        nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
        outer = self.repeat
        self.repeat = outer * length
        try:
            sub = self._enter(body, ins[:nc + nk] + [-1] * (len(ins) - nc - nk))
            stacked: list[int] = []
            for v, t in zip(body.invars[nc + nk:], ins[nc + nk:]):
                s = sub[id(v)]
                if t >= 0:
                    self._link_all(s, t, 1)
                    stacked.append(t)
                    self.ops.append(Op("copy", (t,), (s,), (("scan", "xs"),), 0, self.region, self._copy_keep()))
            carry_in = [sub[id(v)] for v in body.invars[nc:nc + nk]]
            self.inline(body, sub)
            outs = self._results(body, sub)
        finally:
            self.repeat = outer
        self._carry(carry_in, outs[:nk], eqn.outvars[:nk], env)
        for y, out in zip(outs[nk:], eqn.outvars[nk:]):
            t = env[id(out)] = self.new(out)
            stacked.append(t)
            if y >= 0:
                self._link_all(y, t, 1)
                self.ops.append(Op("copy", (y,), (t,), (("scan", "ys"),), self.repeat, self.region,
                                   self._copy_keep()))
        for t in stacked:                 # one iteration axis, walked in order: kept whole
            self.link(stacked[0], 0, t, 0)
            self.whole.append((t, 0))

    def _while(self, eqn, ins, env) -> None:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
        sub = self._enter(body, ins[cn:])
        carry_in = [sub[id(v)] for v in body.invars[bn:]]
        cond_env = self._enter(cond, ins[:cn] + carry_in)
        self.inline(cond, cond_env)
        self.inline(body, sub)
        self._carry(carry_in, self._results(body, sub), eqn.outvars, env)
        self.notes.append(f"lax.while_loop at {_where(eqn)}: trip count unknown, costed as one iteration")

    def _cond(self, eqn, ins, env) -> None:
        results = []
        for branch in eqn.params["branches"]:
            j = branch.jaxpr
            sub = self._enter(j, ins[1:])
            self.inline(j, sub)
            results.append(self._results(j, sub))
        for k, out in enumerate(eqn.outvars):
            t = env[id(out)] = self.new(out)
            srcs = tuple(dict.fromkeys(r[k] for r in results if r[k] >= 0))
            for s in srcs:
                self._link_all(s, t)
            if srcs:
                self.ops.append(Op("copy", srcs, (t,), (("cond", "merge"),), self.repeat, self.region,
                                   self._copy_keep()))

    def _link_op(self, name: str, ins, outs, params) -> tuple:
        rule = RULES.get(name)
        if rule is not None:
            return rule(self, ins, outs, params) or ()
        return elementwise(self, ins, outs, params) or ()

    # ------------------------------------------------------------ result
    def finish(self, params, batch, others, logical) -> Graph:
        roots: dict[int, int] = {}
        tensors = []
        sizes: list[int] = []
        for t, shape in enumerate(self.shapes):
            cls = []
            for d, size in enumerate(shape):
                if size == 1:
                    cls.append(-1)
                    continue
                r = self.find(self.slot(t, d))
                if r not in roots:
                    roots[r] = len(sizes)
                    sizes.append(size)
                sizes[roots[r]] = math.gcd(sizes[roots[r]], size)   # merged reshape dims
                cls.append(roots[r])
            tensors.append(Tensor(shape, self.itemsizes[t], tuple(cls)))
        unsplittable = {c for t in tensors for c in t.classes if c >= 0 and t.classes.count(c) > 1}
        unsplittable |= {tensors[t].classes[d] for t, d in self.whole if tensors[t].classes[d] >= 0}
        names = _class_names(tensors, len(sizes), params, batch)
        return Graph(tuple(tensors), tuple(self.ops), tuple(sizes), names, params, batch, others,
                     logical, frozenset(unsplittable), tuple(self.notes), tuple(self.regions))


def _keeps_its_inputs(eqn) -> bool:
    """Whether the backward of the ``custom_vjp`` call ``eqn`` keeps only its inputs: its
    ``jax.vjp`` traced on abstract inputs, every residual is one of them. Literal operands, or a
    call that cannot be traced alone (it reads an enclosing ``shard_map``'s axes): no."""
    outs = [v for v in eqn.outvars if not isinstance(v, _DropVar)]
    if not outs or any(isinstance(v, _Literal) for v in eqn.invars):
        return False
    names = tuple(f"x{i}" for i in range(len(eqn.invars)))
    debug = _DebugInfo("custom_vjp", eqn.primitive.name, names, tuple(f"y{i}" for i in range(len(outs))))
    call = jaxpr_as_fun(_ClosedJaxpr(_Jaxpr([], list(eqn.invars), outs, [eqn], eqn.effects, debug), []))
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    try:
        kept = jax.make_jaxpr(lambda *a: jax.tree.leaves(jax.vjp(call, *a)[1]))(*args).jaxpr
    except Exception:     # noqa: BLE001 - any failure to trace it alone: read it as its primal
        return False
    ins = {id(v) for v in kept.invars}
    return all(not isinstance(v, _Literal) and id(v) in ins for v in kept.outvars)


_LOOPS = {"scan": _Builder._scan, "while": _Builder._while, "cond": _Builder._cond}


def _where(eqn) -> str:
    """``file:line (function)`` of an equation, for messages."""
    traceback = getattr(eqn.source_info, "traceback", None)
    for frame in (traceback.frames if traceback is not None else ()):
        if not any(part in frame.file_name for part in ("/jax/", "/jaxlib/", "/flax/", "/jaxpar/auto/")):
            return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
    return eqn.primitive.name


def _class_names(tensors, n, params, batch) -> tuple[str, ...]:
    names: list[str | None] = [None] * n
    for path, t in (*batch, *params):
        for d, c in enumerate(tensors[t].classes):
            if c >= 0 and names[c] is None:
                names[c] = f"{path}:{d}"
    return tuple(nm or f"c{i}" for i, nm in enumerate(names))
