"""One executor for every pipeline schedule: a ``shard_map`` over the pipe axis, a scan over ticks.

``pipeline_value_and_grad`` runs the forward and backward of a stack of stages under any
``Schedule`` table in one compiled program:

- ``jax.shard_map`` is manual over the pipe axis only; every other mesh axis stays under
  the compiler, so data and tensor sharding of the stage computation compose with it;
- ``lax.scan`` runs the table's steps; at each step every stage looks up its own row with
  ``lax.axis_index`` and ``lax.switch`` runs its op: idle, F, B or W;
- ``lax.ppermute`` moves activations and gradients between neighbouring stages each step,
  on the channels the schedule's placement uses (``jaxpar.pipeline.program``): a loop
  placement sends activations to the next stage and gradients to the previous one (a ring,
  so interleaved chunks wrap from the last stage to the first); a V placement sends both
  ways and keeps the turn on stage ``p-1`` local;
- a stage keeps only the *inputs* of the micro-batches it has started and not finished
  (and the output gradients a pending W needs), in buffers sized by the schedule, so 1F1B
  really holds fewer activations than GPipe. B (and W) recompute the stage forward from
  that input under ``jax.vjp``: exact, and the memory of full activation recompute.

The pure part — turning a table into per-step integer instructions and buffer slots —
is ``lower`` (``jaxpar.pipeline.program``); it has no devices in it and is tested on its own.
``pipeline_forward`` runs a forward-only table (``forward_only(schedule)``): the loss with
no backward, for evaluation.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.pipeline.program import (  # noqa: F401  (op codes re-exported for the planner's pricing)
    B, B_LAST, CHANNELS, DX_MB, F, F_LAST, FROM_INPUT, G_SLOT, IDLE, MB, OP, RECV_G, RECV_X, W, W_LAST,
    X_SLOT, CHUNK, Program, forward_only, lower)
from jaxpar.pipeline.schedules import Schedule, virtual_stage

__all__ = ["Program", "lower", "forward_only", "pipeline_value_and_grad", "pipeline_forward", "pipeline_loss",
           "to_stage_layout", "from_stage_layout"]

# --------------------------------------------------------------------------- layout


def _stage_rows(stages: int, virtual_stages: int, placement: str) -> np.ndarray:
    """Row ``s·v + c`` of the stage layout holds virtual stage ``rows[s·v + c]``."""
    return np.array([virtual_stage(placement, stages, s, c)
                     for s in range(stages) for c in range(virtual_stages)])


def to_stage_layout(tree: Any, stages: int, virtual_stages: int = 1, placement: str = "loop") -> Any:
    """Stacked layers ``[L, ...]`` → stage layout ``[p·v, L/(p·v), ...]``.

    Row ``s·v + c`` holds chunk ``c`` of stage ``s``: virtual stage ``c·p + s`` for the loop
    placement (``s, s+p, ...``), ``s`` and ``2p-1-s`` for the V placement (see
    ``jaxpar.pipeline.schedules``), so sharding the leading axis over the pipe axis gives
    each stage exactly its chunks.

    Example:
        >>> to_stage_layout(jnp.arange(8), 2, 2)[:, 0].tolist()  # chunks 0,2 | 1,3
        [0, 4, 2, 6]
        >>> to_stage_layout(jnp.arange(8), 2, 2, "v")[:, 0].tolist()  # chunks 0,3 | 1,2
        [0, 6, 2, 4]
    """
    pv = stages * virtual_stages
    rows = _stage_rows(stages, virtual_stages, placement)

    def one(a):
        if a.shape[0] % pv:
            raise ValueError(f"a stacked layer axis of size {a.shape[0]} does not split into "
                             f"stages*virtual_stages={pv} equal chunks; use a multiple of {pv}")
        return a.reshape(pv, a.shape[0] // pv, *a.shape[1:])[rows]

    return jax.tree.map(one, tree)


def from_stage_layout(tree: Any, stages: int, virtual_stages: int = 1, placement: str = "loop") -> Any:
    """Inverse of ``to_stage_layout``: ``[p·v, n, ...]`` → stacked layers ``[p·v·n, ...]``."""
    order = np.argsort(_stage_rows(stages, virtual_stages, placement))
    return jax.tree.map(lambda a: a[order].reshape(-1, *a.shape[2:]), tree)


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
    loss, stage_grads, head_grads, input_grads = _run(
        stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs, targets, axis, specs, consts)
    return loss, (stage_grads, head_grads, input_grads)


def pipeline_forward(
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
) -> jax.Array:
    """Mean loss over micro-batches, forwards only: ``schedule``'s F ops, no backward.

    Arguments as for ``pipeline_value_and_grad``; ``schedule`` may be a training schedule
    (its forwards are kept, see ``forward_only``). What ``evaluate`` and inference run.

    Example:
        >>> loss = pipeline_forward(  # doctest: +SKIP
        ...     block_stack, head_loss, build("zb-v", 4, 8), mesh, blocks, head, x, y)
    """
    if any(op is not None and op.kind.value != "F" for row in schedule.table for op in row):
        schedule = forward_only(schedule)
    return _run(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs, targets, axis, specs,
                consts)


def _run(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs, targets, axis, specs, consts):
    """The shard_map of the executor; its outputs follow the program (forward-only: the loss)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    _check_args(mesh, axis, p, m, v, stage_params, inputs, targets)
    if consts is None:
        fn, consts = (lambda chunk, x, const: stage_fn(chunk, x)), ()
    else:
        fn = stage_fn
    _check_stage_fn(fn, stage_params, consts, inputs)
    program = lower(schedule)
    out_specs = P() if program.forward_only else (P(), P(axis), P(), P())
    run = jax.shard_map(
        _make_body(fn, loss_fn, program, axis, m, specs), mesh=mesh, axis_names={axis},
        in_specs=(P(axis), P(), P(), P(), P(axis)), out_specs=out_specs, check_vma=True)
    return run(stage_params, head_params, inputs, targets, consts)


def pipeline_loss(
    stage_fn: StageFn, loss_fn: LossFn, schedule: Schedule, mesh: Mesh, *, axis: str = "pipe",
    specs: tuple[Any, Any, Any] | None = None, with_consts: bool = False,
) -> Callable[..., jax.Array]:
    """``pipeline_value_and_grad`` as a differentiable loss function (a ``jax.custom_vjp``).

    Returns ``f(stage_params, head_params, inputs, targets) -> loss`` whose gradient is the
    pipeline's (with ``with_consts``: ``f(stage_params, head_params, inputs, targets, consts)``,
    see ``pipeline_value_and_grad``). Use it inside an ordinary loss function so that ``jax.grad`` (or
    ``nnx.value_and_grad``) also reaches what produced ``inputs`` (an embedding) and
    ``stage_params`` (a reshape of stacked layers). Differentiated, it runs the whole
    schedule, backward included, and keeps the gradients for the backward pass; called
    without differentiating (evaluation) it runs the forwards only (``pipeline_forward``).
    ``targets`` get zero cotangents.

    Example:
        >>> f = pipeline_loss(blocks_fn, head_loss, build("1f1b", 4, 8), mesh)  # doctest: +SKIP
        >>> g = jax.grad(lambda e: f(blocks, head, embed(e, tokens), labels))(e)  # doctest: +SKIP
    """
    def value_and_grad(stage_params, head_params, inputs, targets, consts):
        return pipeline_value_and_grad(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs,
                                       targets, axis=axis, specs=specs, consts=consts if with_consts else None)

    @jax.custom_vjp
    def loss(stage_params, head_params, inputs, targets, consts):
        # The primal runs only when nothing differentiates the call: forwards alone suffice.
        return pipeline_forward(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs, targets,
                                axis=axis, specs=specs, consts=consts if with_consts else None)

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
        if isinstance(dp, tuple) and not dp:   # forward-only branches return no gradients
            return y, dx, dp, dh, loss
        return y, dx, _pin(dp, stage_specs, 1), _pin(dh, head_specs), loss

    return run


def _make_body(stage_fn, loss_fn, program: Program, axis: str, m: int, specs=None):
    code = np.array(program.code)
    if program.forward_only:
        # Forward only: the last chunk's F computes the loss (branch 2); nothing else runs.
        code[..., OP] = np.array([0, 1, 2, 0, 0, 0, 0])[code[..., OP]]
        branches = _forward_branches(stage_fn, loss_fn, m)
    else:
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
            carry = _tick(carry, r, params, head, inputs, targets, consts, branches, axis, program)
            carry["grads"] = _pin(carry["grads"], stage_specs, 2)
            carry["hgrads"] = _pin(carry["hgrads"], head_specs)
            return carry, None

        carry, _ = lax.scan(step, carry, jnp.asarray(code))
        if program.forward_only:
            return lax.psum(carry["loss"], axis)
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

    # A forward-only program keeps no gradients: zero-size accumulators cost nothing.
    grads = _zeros(jax.tree.map(lambda a: a[:0], params)) if program.forward_only else _zeros(params)
    hgrads = _zeros(jax.tree.map(lambda a: a[:0], head)) if program.forward_only else _zeros(head)
    return dict(xbuf=buffer(program.x_slots), gbuf=buffer(program.g_slots),
                fmsg={c: buffer(0)[0] for c in program.sends_x},
                bmsg={c: buffer(0)[0] for c in program.sends_g}, grads=grads,
                hgrads=hgrads, loss=jnp.zeros((), jnp.float32), dinputs=buffer(0 if program.forward_only else m))


_SHIFT = {"next": 1, "prev": -1}


def _send(value, channels, axis: str, p: int) -> dict:
    """``value`` on each channel a placement uses: to a ring neighbour, or kept (``self``)."""
    return {c: value if c == "self" else
            lax.ppermute(value, axis, [(s, (s + _SHIFT[c]) % p) for s in range(p)]) for c in channels}


def _tick(carry, r, params, head, inputs, targets, consts, branches, axis: str, program: Program) -> dict:
    p = lax.axis_size(axis)
    xbuf, gbuf = carry["xbuf"], carry["gbuf"]
    for c, msg in carry["fmsg"].items():   # what arrived on a channel nobody sent to goes to the dump row
        xbuf = xbuf.at[r[RECV_X[c]]].set(msg)
    for c, msg in carry["bmsg"].items():
        gbuf = gbuf.at[r[RECV_G[c]]].set(msg)
    x = jnp.where(r[FROM_INPUT] == 1, inputs[r[MB]], xbuf[r[X_SLOT]])
    chunk = jax.tree.map(lambda a: a[r[CHUNK]], params)
    target = jax.tree.map(lambda a: a[r[MB]], targets)
    const = jax.tree.map(lambda a: a[r[CHUNK]], consts)
    y, dx, dp, dh, loss = lax.switch(r[OP], branches, chunk, head, x, gbuf[r[G_SLOT]], target, const)
    if program.forward_only:
        grads, hgrads, dinputs = carry["grads"], carry["hgrads"], carry["dinputs"]
    else:
        grads = jax.tree.map(lambda acc, d: acc.at[r[CHUNK]].add(d), carry["grads"], dp)
        hgrads = jax.tree.map(jnp.add, carry["hgrads"], dh)
        dinputs = carry["dinputs"].at[r[DX_MB]].add(dx)
    return dict(xbuf=xbuf, gbuf=gbuf, fmsg=_send(y, program.sends_x, axis, p),
                bmsg=_send(dx, program.sends_g, axis, p), grads=grads, hgrads=hgrads,
                loss=carry["loss"] + loss.astype(jnp.float32), dinputs=dinputs)


def _forward_branches(stage_fn, loss_fn, m: int) -> list[Callable]:
    """Idle, forward, and forward + loss of the last chunk: no backward, no gradients."""
    scale = 1.0 / m

    def out(x, y=None, loss=None):
        return (jnp.zeros_like(x) if y is None else y, jnp.zeros_like(x), (), (),
                jnp.zeros_like(x, jnp.float32, shape=()) if loss is None else loss)

    def idle(chunk, head, x, g, t, k):
        return out(x)

    def fwd(chunk, head, x, g, t, k):
        return out(x, y=stage_fn(chunk, x, k))

    def fwd_last(chunk, head, x, g, t, k):
        return out(x, loss=loss_fn(head, stage_fn(chunk, x, k), t).astype(jnp.float32) * scale)

    return [idle, fwd, fwd_last]


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
