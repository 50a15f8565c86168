"""One executor for every pipeline schedule: a ``shard_map`` over the pipe axis, a scan over ticks.

``pipeline_value_and_grad`` runs the forward and backward of a stack of stages under any
``Schedule`` table in one compiled program:

- ``jax.shard_map`` is manual over the pipe axis only; every other mesh axis stays under
  the compiler, so data and tensor sharding of the stage computation compose with it;
- ``lax.scan`` runs the table's steps; at each step every stage looks up its own row with
  ``lax.axis_index`` and ``lax.switch`` runs its op: idle, F, B or W;
- one ``lax.ppermute`` per step and direction moves activations to the next stage and
  gradients to the previous one (a ring, so interleaved chunks wrap from the last stage
  to the first);
- a stage keeps only the *inputs* of the micro-batches it has started and not finished
  (and the output gradients a pending W needs), in buffers sized by the schedule, so 1F1B
  really holds fewer activations than GPipe. B (and W) recompute the stage forward from
  that input under ``jax.vjp``: exact, and the memory of full activation recompute.

The pure part — turning a table into per-step integer instructions and buffer slots —
is ``lower``; it has no devices in it and is tested on its own.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.pipeline.schedules import Kind, Op, Schedule, validate

__all__ = ["Program", "lower", "pipeline_value_and_grad", "pipeline_loss", "to_stage_layout",
           "from_stage_layout"]

# Branch codes of the per-step op; the "last" variants run on the last virtual stage, which
# applies the loss instead of sending activations on.
IDLE, F, F_LAST, B, B_LAST, W, W_LAST = range(7)
# Columns of the instruction table.
OP, MB, CHUNK, X_SLOT, G_SLOT, RECV_X, RECV_G, FROM_INPUT, DX_MB = range(9)


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule lowered to lock-step instructions.

    ``code[step, stage]`` holds the columns ``OP, MB, CHUNK, X_SLOT, G_SLOT, RECV_X, RECV_G,
    FROM_INPUT, DX_MB``. A stage writes the activation that arrived from its predecessor
    into slot ``RECV_X`` (``x_slots`` = nowhere) and the gradient from its successor into
    ``RECV_G``, then runs ``OP`` on micro-batch ``MB`` of chunk ``CHUNK`` reading its input
    from slot ``X_SLOT`` (or from the pipeline inputs when ``FROM_INPUT``) and its output
    gradient from ``G_SLOT``; an input gradient of virtual stage 0 lands in row ``DX_MB``
    (``microbatches`` = nowhere).
    """

    code: np.ndarray
    x_slots: int
    g_slots: int
    split_backward: bool

    @property
    def steps(self) -> int:
        return self.code.shape[0]


def lower(schedule: Schedule) -> Program:
    """Turn ``schedule`` into a ``Program``: one step per tick where some stage starts an op.

    A result computed at step ``k`` reaches its neighbour at step ``k+1``; a validated table
    never uses it sooner. Buffer slots are reused as soon as their item's last reader ran.

    Example:
        >>> from jaxpar.pipeline.schedules import build
        >>> prog = lower(build("1f1b", 4, 8))
        >>> prog.steps, prog.x_slots
        (30, 4)
    """
    validate(schedule)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    start = {(s, op): t for s in range(p) for t, op in schedule.ops(s)}
    ticks = sorted(set(start.values()))
    step_of = {t: k for k, t in enumerate(ticks)}
    step = {key: step_of[t] for key, t in start.items()}
    code = np.zeros((len(ticks), p, 9), np.int32)
    code[:, :, DX_MB] = m
    last_kind = Kind.W if schedule.split_backward else Kind.B
    x_items, g_items = _buffer_items(schedule, step, last_kind)
    x_slot, x_slots = _allocate(x_items, p)
    g_slot, g_slots = _allocate(g_items, p)
    code[:, :, RECV_X], code[:, :, RECV_G] = x_slots, g_slots
    for (s, i, c), (arrive, _) in x_items.items():
        code[arrive, s, RECV_X] = x_slot[(s, i, c)]
    for (s, i, c), (arrive, _) in g_items.items():
        code[arrive, s, RECV_G] = g_slot[(s, i, c)]
    for (s, op), k in step.items():
        _fill(code[k, s], op, s, p, v, x_slot, g_slot)
    return Program(code, x_slots, g_slots, schedule.split_backward)


def _fill(row: np.ndarray, op: Op, s: int, p: int, v: int, x_slot: dict, g_slot: dict) -> None:
    i, c = op.microbatch, op.chunk
    first, last = (c == 0 and s == 0), (c == v - 1 and s == p - 1)
    base = {Kind.F: F, Kind.B: B, Kind.W: W}[op.kind]
    row[OP] = base + 1 if last else base
    row[MB], row[CHUNK] = i, c
    row[FROM_INPUT] = first
    row[X_SLOT] = x_slot.get((s, i, c), 0)
    row[G_SLOT] = g_slot.get((s, i, c), 0)
    if op.kind is Kind.B and first:
        row[DX_MB] = i


def _buffer_items(schedule: Schedule, step: dict, last_kind: Kind) -> tuple[dict, dict]:
    """``(stage, mb, chunk) -> (arrival step, last use step)`` for inputs and out-grads."""
    p, v = schedule.stages, schedule.virtual_stages
    x_items, g_items = {}, {}
    for (s, op), k in step.items():
        i, c = op.microbatch, op.chunk
        if op.kind is Kind.F and not (s == p - 1 and c == v - 1):  # sends to the next one
            to = (s + 1, i, c) if s < p - 1 else (0, i, c + 1)
            x_items[to] = (k + 1, step[(to[0], Op(last_kind, i, to[2]))])
        if op.kind is Kind.B and not (s == 0 and c == 0):  # sends to the previous one
            to = (s - 1, i, c) if s > 0 else (p - 1, i, c - 1)
            g_items[to] = (k + 1, step[(to[0], Op(last_kind, i, to[2]))])
    return x_items, g_items


def _allocate(items: dict, p: int) -> tuple[dict, int]:
    """Give each item a slot of its stage's buffer, free again after its last use."""
    slot, size = {}, 0
    for s in range(p):
        busy_until: list[int] = []  # per slot, the last step it is read
        for key, (arrive, last) in sorted(
                ((k, span) for k, span in items.items() if k[0] == s), key=lambda kv: kv[1]):
            free = [j for j, until in enumerate(busy_until) if until < arrive]
            j = free[0] if free else len(busy_until)
            busy_until[j:j + 1] = [last]
            slot[key] = j
        size = max(size, len(busy_until))
    return slot, size


# --------------------------------------------------------------------------- layout


def to_stage_layout(tree: Any, stages: int, virtual_stages: int = 1) -> Any:
    """Stacked layers ``[L, ...]`` → stage layout ``[p·v, L/(p·v), ...]``.

    Row ``s·v + c`` holds model chunk (virtual stage) ``c·p + s``, so sharding the leading
    axis over the pipe axis gives stage ``s`` exactly its chunks ``s, s+p, ...``.

    Example:
        >>> to_stage_layout(jnp.arange(8), 2, 2)[:, 0].tolist()  # chunks 0,2 | 1,3
        [0, 4, 2, 6]
    """
    pv = stages * virtual_stages

    def one(a):
        if a.shape[0] % pv:
            raise ValueError(f"a stacked layer axis of size {a.shape[0]} does not split into "
                             f"stages*virtual_stages={pv} equal chunks; use a multiple of {pv}")
        a = a.reshape(virtual_stages, stages, a.shape[0] // pv, *a.shape[1:])
        return jnp.swapaxes(a, 0, 1).reshape(pv, *a.shape[2:])

    return jax.tree.map(one, tree)


def from_stage_layout(tree: Any, stages: int, virtual_stages: int = 1) -> Any:
    """Inverse of ``to_stage_layout``: ``[p·v, n, ...]`` → stacked layers ``[p·v·n, ...]``."""
    def one(a):
        a = a.reshape(stages, virtual_stages, *a.shape[1:])
        return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[3:])

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------- executor

StageFn = Callable[[Any, jax.Array], jax.Array]
LossFn = Callable[[Any, jax.Array, Any], jax.Array]


def pipeline_value_and_grad(
    stage_fn: StageFn,
    loss_fn: LossFn,
    schedule: Schedule,
    mesh: Mesh,
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any = None,
    *,
    axis: str = "pipe",
    specs: tuple[Any, Any, Any] | None = None,
    consts: Any = None,
) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
    """Mean loss over micro-batches and its gradients, run as the pipeline ``schedule``.

    The model is ``loss_fn(head, stage_fn(θ[k-1], ... stage_fn(θ[0], x)), target)``
    averaged over the ``m`` micro-batches, with ``k = p·v`` chunks.

    Args:
      stage_fn: ``stage_fn(chunk_params, x) -> y``, one model chunk; ``y`` has the shape
        and dtype of ``x``. Runs inside ``shard_map`` manual over ``axis`` only.
      loss_fn: ``loss_fn(head_params, y, target) -> scalar`` on the last chunk's output.
      schedule: a ``Schedule`` with ``stages`` equal to the size of mesh axis ``axis``.
      mesh: the mesh; axes other than ``axis`` stay automatic (data / tensor sharding of
        the arguments carries through).
      stage_params: pytree whose leaves have a leading axis of ``p·v`` chunks in stage
        layout (see ``to_stage_layout``), sharded or shardable over ``axis``.
      head_params: pytree used by ``loss_fn`` (replicated over ``axis``), or ``None``.
      inputs: ``[m, micro_batch, ...]`` activations entering chunk 0.
      targets: pytree of ``[m, ...]`` arrays handed to ``loss_fn`` per micro-batch, or None.
      axis: the pipe mesh axis.
      specs: ``(stage_specs, head_specs, activation_spec)``: ``PartitionSpec`` trees over the
        *other* mesh axes for one chunk of ``stage_params`` (without its two leading axes),
        for ``head_params``, and the spec of one micro-batch's activations. Each op's
        operands and results are pinned to them, so no layout chosen outside (e.g. a ZeRO
        shard of the update) propagates into the per-stage branches, where a resharding
        collective would run on the devices of some stages only (a deadlock).
      consts: a pytree in stage layout like ``stage_params`` that is not differentiated
        (e.g. the blocks' RNG state); ``stage_fn`` is then called as
        ``stage_fn(chunk, x, const_chunk)``.

    Returns:
      ``(loss, (stage_grads, head_grads, input_grads))``; ``input_grads`` has the shape of
      ``inputs``, for back-propagating into whatever produced them (an embedding).

    Example:
        >>> loss, (g_blocks, g_head, g_x) = pipeline_value_and_grad(  # doctest: +SKIP
        ...     block_stack, head_loss, build("1f1b", 4, 8), mesh, blocks, head, x, y)
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    _check_args(mesh, axis, p, m, v, stage_params, inputs, targets)
    if consts is None:
        fn, consts = (lambda chunk, x, const: stage_fn(chunk, x)), ()
    else:
        fn = stage_fn
    _check_stage_fn(fn, stage_params, consts, inputs)
    program = lower(schedule)
    body = _make_body(fn, loss_fn, program, axis, m, specs)
    run = jax.shard_map(
        body, mesh=mesh, axis_names={axis},
        in_specs=(P(axis), P(), P(), P(), P(axis)), out_specs=(P(), P(axis), P(), P()), check_vma=True)
    loss, stage_grads, head_grads, input_grads = run(stage_params, head_params, inputs, targets, consts)
    return loss, (stage_grads, head_grads, input_grads)


def pipeline_loss(
    stage_fn: StageFn, loss_fn: LossFn, schedule: Schedule, mesh: Mesh, *, axis: str = "pipe",
    specs: tuple[Any, Any, Any] | None = None, with_consts: bool = False,
) -> Callable[..., jax.Array]:
    """``pipeline_value_and_grad`` as a differentiable loss function (a ``jax.custom_vjp``).

    Returns ``f(stage_params, head_params, inputs, targets) -> loss`` whose gradient is the
    pipeline's (with ``with_consts``: ``f(stage_params, head_params, inputs, targets, consts)``,
    see ``pipeline_value_and_grad``). Use it inside an ordinary loss function so that ``jax.grad`` (or
    ``nnx.value_and_grad``) also reaches what produced ``inputs`` (an embedding) and
    ``stage_params`` (a reshape of stacked layers). Calling it runs the whole schedule,
    backward included, and keeps the gradients for the backward pass (so evaluating it
    without differentiating costs a training step). ``targets`` get zero cotangents.

    Example:
        >>> f = pipeline_loss(blocks_fn, head_loss, build("1f1b", 4, 8), mesh)  # doctest: +SKIP
        >>> g = jax.grad(lambda e: f(blocks, head, embed(e, tokens), labels))(e)  # doctest: +SKIP
    """
    def value_and_grad(stage_params, head_params, inputs, targets, consts):
        return pipeline_value_and_grad(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs,
                                       targets, axis=axis, specs=specs, consts=consts if with_consts else None)

    @jax.custom_vjp
    def loss(stage_params, head_params, inputs, targets, consts):
        return value_and_grad(stage_params, head_params, inputs, targets, consts)[0]

    def fwd(stage_params, head_params, inputs, targets, consts):
        value, grads = value_and_grad(stage_params, head_params, inputs, targets, consts)
        return value, (grads, targets, consts)

    def bwd(res, cotangent):
        (stage_grads, head_grads, input_grads), targets, consts = res
        def scale(tree):
            return jax.tree.map(lambda g: g * cotangent.astype(g.dtype), tree)

        return (scale(stage_grads), scale(head_grads), scale(input_grads),
                jax.tree.map(_zero_cotangent, targets), jax.tree.map(_zero_cotangent, consts))

    loss.defvjp(fwd, bwd)
    if with_consts:
        return loss
    return lambda stage_params, head_params, inputs, targets: loss(stage_params, head_params, inputs, targets, ())


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


def _check_args(mesh, axis, p, m, v, stage_params, inputs, targets) -> None:
    if axis not in mesh.shape:
        raise ValueError(f"pipeline axis {axis!r} is not in the mesh axes {list(mesh.shape)}; "
                         f"add it to the mesh or pass axis=<one of them>")
    if mesh.shape[axis] != p:
        raise ValueError(f"schedule has stages={p} but mesh axis {axis!r} has size "
                         f"{mesh.shape[axis]}; build the schedule with {mesh.shape[axis]} stages")
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if leaf.ndim == 0 or leaf.shape[0] != p * v:
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; its leading "
                f"axis must be stages*virtual_stages={p * v} (see to_stage_layout)")
    leaves = [("inputs", inputs)] + [
        (f"targets{jax.tree_util.keystr(k)}", a)
        for k, a in jax.tree_util.tree_leaves_with_path(targets)]
    for name, leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != m:
            raise ValueError(f"{name} has shape {leaf.shape}; its leading axis must be the {m} "
                             f"micro-batches of the schedule (reshape to [{m}, batch/{m}, ...])")


def _check_stage_fn(stage_fn, stage_params, consts, inputs) -> None:
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
    const = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), consts)
    x = jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype)
    y = jax.eval_shape(stage_fn, chunk, x, const)
    if (getattr(y, "shape", None), getattr(y, "dtype", None)) != (x.shape, x.dtype):
        raise ValueError(f"stage_fn must map activations to the same shape and dtype: "
                         f"x {x.shape} {x.dtype} gave {y}; move shape changes into the "
                         f"function producing the inputs or into loss_fn")


def _pin(tree, specs, lead: int = 0):
    """``with_sharding_constraint`` on the automatic mesh axes (inside the shard_map)."""
    if specs is None:
        return tree
    return jax.tree.map(lambda a, s: lax.with_sharding_constraint(a, P(*(None,) * lead, *s)), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def _pinned_branch(branch, stage_specs, head_specs, act_spec):
    def run(chunk, head, x, g, t, c):
        chunk, head = _pin(chunk, stage_specs, 1), _pin(head, head_specs)
        x, g = _pin((x, g), (act_spec, act_spec))
        y, dx, dp, dh, loss = branch(chunk, head, x, g, t, c)
        y, dx = _pin((y, dx), (act_spec, act_spec))
        return y, dx, _pin(dp, stage_specs, 1), _pin(dh, head_specs), loss

    return run


def _make_body(stage_fn, loss_fn, program: Program, axis: str, m: int, specs=None):
    code = np.array(program.code)
    # The last chunk's F does nothing (its B recomputes the forward and the loss anyway), so
    # it shares the idle branch; without W the W branches are left out of the switch.
    code[..., OP] = np.array([0, 1, 0, 2, 3, 4, 5])[code[..., OP]]
    branches = _branches(stage_fn, loss_fn, program.split_backward, m)

    varying = functools.partial(_varying, axis=axis)

    stage_specs, head_specs, act_spec = specs if specs is not None else (None, None, None)
    if specs is not None:
        branches = [_pinned_branch(b, stage_specs, head_specs, act_spec) for b in branches]

    def body(params, head, inputs, targets, consts):
        params, head = _pin(params, stage_specs, 2), _pin(head, head_specs)
        head, inputs, targets = varying((head, inputs, targets))
        stage = lax.axis_index(axis)
        carry = varying(_initial_carry(params, head, inputs, program, m))

        def step(carry, rows):
            r = rows[stage]
            carry = _tick(carry, r, params, head, inputs, targets, consts, branches, axis)
            carry["grads"] = _pin(carry["grads"], stage_specs, 2)
            carry["hgrads"] = _pin(carry["hgrads"], head_specs)
            return carry, None

        carry, _ = lax.scan(step, carry, jnp.asarray(code))
        return (lax.psum(carry["loss"], axis), carry["grads"], lax.psum(carry["hgrads"], axis),
                lax.psum(carry["dinputs"][:m], axis))

    return body


def _varying(tree, axis: str):
    """Mark invariant values as differing across ``axis``, as scan carries must be."""
    return jax.tree.map(lambda a: lax.pcast(a, axis, to="varying"), tree)


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _initial_carry(params, head, inputs, program: Program, m: int) -> dict:
    x = inputs[0]

    def buffer(n):  # one more row: the dump that writes of "nothing" go to
        return jnp.zeros((n + 1,) + x.shape, x.dtype)

    return dict(xbuf=buffer(program.x_slots), gbuf=buffer(program.g_slots),
                fmsg=buffer(0)[0], bmsg=buffer(0)[0], grads=_zeros(params),
                hgrads=_zeros(head), loss=jnp.zeros((), jnp.float32), dinputs=buffer(m))


def _tick(carry, r, params, head, inputs, targets, consts, branches, axis: str) -> dict:
    p = lax.axis_size(axis)
    xbuf = carry["xbuf"].at[r[RECV_X]].set(carry["fmsg"])
    gbuf = carry["gbuf"].at[r[RECV_G]].set(carry["bmsg"])
    x = jnp.where(r[FROM_INPUT] == 1, inputs[r[MB]], xbuf[r[X_SLOT]])
    chunk = jax.tree.map(lambda a: a[r[CHUNK]], params)
    target = jax.tree.map(lambda a: a[r[MB]], targets)
    const = jax.tree.map(lambda a: a[r[CHUNK]], consts)
    y, dx, dp, dh, loss = lax.switch(r[OP], branches, chunk, head, x, gbuf[r[G_SLOT]], target, const)
    return dict(
        xbuf=xbuf, gbuf=gbuf,
        fmsg=lax.ppermute(y, axis, [(s, (s + 1) % p) for s in range(p)]),
        bmsg=lax.ppermute(dx, axis, [(s, (s - 1) % p) for s in range(p)]),
        grads=jax.tree.map(lambda acc, d: acc.at[r[CHUNK]].add(d), carry["grads"], dp),
        hgrads=jax.tree.map(jnp.add, carry["hgrads"], dh),
        loss=carry["loss"] + loss.astype(jnp.float32),
        dinputs=carry["dinputs"].at[r[DX_MB]].add(dx))


def _branches(stage_fn, loss_fn, split: bool, m: int) -> list[Callable]:
    """One function per op code: ``(chunk, head, x, g, target, const) -> (y, dx, dθ, dhead, loss)``."""
    scale = 1.0 / m  # the loss is the mean over micro-batches

    def out(x, chunk, head, y=None, dx=None, dp=None, dh=None, loss=None):
        def zero(like, value):  # zeros_like keeps the type "varying over the pipe axis"
            return jax.tree.map(jnp.zeros_like, like) if value is None else value

        return (zero(x, y), zero(x, dx), zero(chunk, dp), zero(head, dh),
                jnp.zeros_like(x, jnp.float32, shape=()) if loss is None else loss)

    def last(chunk, head, x, target, k):
        return loss_fn(head, stage_fn(chunk, x, k), target).astype(jnp.float32) * scale

    def idle(chunk, head, x, g, t, k):
        return out(x, chunk, head)

    def fwd(chunk, head, x, g, t, k):
        return out(x, chunk, head, y=stage_fn(chunk, x, k))

    def bwd(chunk, head, x, g, t, k):
        if split:
            _, vjp = jax.vjp(lambda x_: stage_fn(chunk, x_, k), x)
            return out(x, chunk, head, dx=vjp(g)[0])
        _, vjp = jax.vjp(lambda c, x_: stage_fn(c, x_, k), chunk, x)
        dp, dx = vjp(g)
        return out(x, chunk, head, dx=dx, dp=dp)

    def bwd_last(chunk, head, x, g, t, k):
        if split:
            loss, vjp = jax.vjp(lambda x_: last(chunk, head, x_, t, k), x)
            return out(x, chunk, head, dx=vjp(jnp.ones_like(loss))[0], loss=loss)
        loss, vjp = jax.vjp(lambda c, h, x_: last(c, h, x_, t, k), chunk, head, x)
        dp, dh, dx = vjp(jnp.ones_like(loss))
        return out(x, chunk, head, dx=dx, dp=dp, dh=dh, loss=loss)

    def wgt(chunk, head, x, g, t, k):
        _, vjp = jax.vjp(lambda c: stage_fn(c, x, k), chunk)
        return out(x, chunk, head, dp=vjp(g)[0])

    def wgt_last(chunk, head, x, g, t, k):
        loss, vjp = jax.vjp(lambda c, h: last(c, h, x, t, k), chunk, head)
        dp, dh = vjp(jnp.ones_like(loss))
        return out(x, chunk, head, dp=dp, dh=dh)

    return [idle, fwd, bwd, bwd_last] + ([wgt, wgt_last] if split else [])
