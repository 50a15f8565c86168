"""One executor for every pipeline schedule: a ``shard_map`` over the pipe axis, a scan over ticks.

``pipeline_value_and_grad`` runs the forward and backward of a stack of stages under any
``Schedule`` table in one compiled program:

- ``jax.shard_map`` is manual over the pipe axis only; every other mesh axis stays under
  the compiler, so data and tensor sharding of the stage computation compose with it;
- ``lax.scan`` runs the table's steps; at each step every stage looks up its own row by
  its index (an ``arange`` split over the pipe axis: ``lax.axis_index`` is XLA's partition
  id, which JAX may hoist out of the shard_map under recomputation, where XLA cannot
  partition it) and ``lax.switch`` runs its op: idle, F, B or W;
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

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.deprecation import FormerForm, accepts_former_form, former_signature

from jaxpar.pipeline.program import (  # noqa: F401  (op codes re-exported for the job search's pricing)
    B, B_LAST, CHANNELS, DX_MB, F, F_LAST, FROM_INPUT, G_SLOT, IDLE, MB, OP, RECV_G, RECV_X, W, W_LAST,
    X_SLOT, CHUNK, Program, forward_only, lower)
from jaxpar.pipeline.branches import branch_label, make_branches, scoped, stats_dtype
from jaxpar.pipeline.call import PipelineCall
from jaxpar.pipeline.schedules import Schedule, virtual_stage
from jaxpar.pipeline.stage_layout import from_stage_layout, to_stage_layout

__all__ = ["PipelineCall", "Program", "lower", "forward_only", "pipeline_value_and_grad", "pipeline_forward", "pipeline_loss",
           "to_stage_layout", "from_stage_layout"]

# --------------------------------------------------------------------------- executor

# stage_fn(chunk_params, h[, consts][, micro_batch]) -> h, or (h, aux_loss, stats) with stage_aux
StageFn = Callable[..., Any]
LossFn = Callable[[Any, jax.Array, Any], jax.Array]
EmbedFn = Callable[[Any, Any], jax.Array]


_FORMER = former_signature(
    "stage_fn loss_fn schedule mesh stage_params head_params inputs",
    {"targets": None, "*": None, "axis": "pipe", "specs": None, "consts": None, "embed_fn": None,
     "embed_params": None, "stage_batch": False, "stage_aux": False})
_CALL_FIELDS = ("stage_fn", "loss_fn", "schedule", "mesh", "axis", "specs", "embed_fn", "stage_batch", "stage_aux")


def _former_form(owner: str) -> FormerForm:
    """0.1.0's call: the functions, the schedule and the mesh beside the arrays."""
    def convert(a: dict) -> tuple[tuple, dict]:
        call = PipelineCall(**{k: a[k] for k in _CALL_FIELDS})
        return ((call, a["stage_params"], a["head_params"], a["inputs"], a["targets"]),
                {"consts": a["consts"], "embed_params": a["embed_params"]})

    return FormerForm(owner, _FORMER, lambda args, kwargs: not (args and isinstance(args[0], PipelineCall)),
                           convert, f"{owner}(PipelineCall(stage_fn=..., loss_fn=..., schedule=..., mesh=..., "
                                    f"axis=..., ...), stage_params, head_params, inputs, targets, consts=..., "
                                    f"embed_params=...)")


@accepts_former_form(_former_form("jaxpar.pipeline.pipeline_value_and_grad"))
def pipeline_value_and_grad(
    call: PipelineCall,
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any = None,
    *,
    consts: Any = None,
    embed_params: Any = None,
) -> tuple[Any, tuple[Any, Any, Any]]:
    """Mean loss over micro-batches and its gradients, run as the pipeline ``call.schedule``.

    The model is ``loss_fn(head, stage_fn(θ[k-1], ... stage_fn(θ[0], x)), target)``
    averaged over the ``m`` micro-batches, with ``k = p·v`` chunks.

    Args:
      call: a ``PipelineCall``: the stage, loss (and embedding) functions, the schedule, the
        mesh and the pipe axis (see its fields).
      stage_params: pytree whose leaves have a leading axis of ``p·v`` chunks in stage
        layout (see ``to_stage_layout``), sharded or shardable over ``call.axis``.
      head_params: pytree used by ``loss_fn`` (replicated over the pipe axis), or ``None``.
      inputs: ``[m, micro_batch, ...]`` activations entering chunk 0 (with ``call.embed_fn``:
        a pytree of ``[m, ...]`` raw inputs).
      targets: pytree of ``[m, ...]`` arrays handed to ``loss_fn`` per micro-batch, or None.
      consts: a pytree in stage layout like ``stage_params`` that is not differentiated
        (e.g. the blocks' RNG state); ``stage_fn`` is then called as
        ``stage_fn(chunk, x, const_chunk)``.
      embed_params: what ``call.embed_fn`` reads (replicated over the pipe axis; may share
        arrays with ``head_params``: a tied table gets a gradient for each use).

    Returns:
      ``(loss, (stage_grads, head_grads, last))``: ``last`` is the embedding's gradient
      with ``embed_fn``, else the gradient of ``inputs`` (same shape), for back-propagating
      into whatever produced them. With ``call.stage_aux``, ``loss`` is ``(loss, stats)``.

    Example:
        >>> call = PipelineCall(stage_fn=block_stack, loss_fn=head_loss,  # doctest: +SKIP
        ...                     schedule=build("1f1b", 4, 8), mesh=mesh)
        >>> loss, (g_blocks, g_head, g_x) = pipeline_value_and_grad(call, blocks, head, x, y)  # doctest: +SKIP
    """
    loss, stats, stage_grads, head_grads, last = _run(call, (stage_params, head_params, inputs, targets, consts,
                                                             embed_params))
    return ((loss, stats) if call.stage_aux else loss), (stage_grads, head_grads, last)


@accepts_former_form(_former_form("jaxpar.pipeline.pipeline_forward"))
def pipeline_forward(
    call: PipelineCall,
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any = None,
    *,
    consts: Any = None,
    embed_params: Any = None,
) -> Any:
    """Mean loss over micro-batches, forwards only: ``call.schedule``'s F ops, no backward.

    Arguments as for ``pipeline_value_and_grad``; the schedule may be a training schedule
    (its forwards are kept, see ``forward_only``). What ``evaluate`` and inference run.
    Returns the loss, or ``(loss, stats)`` with ``call.stage_aux``.

    Example:
        >>> call = PipelineCall(stage_fn=block_stack, loss_fn=head_loss,  # doctest: +SKIP
        ...                     schedule=build("zb-v", 4, 8), mesh=mesh)
        >>> loss = pipeline_forward(call, blocks, head, x, y)  # doctest: +SKIP
    """
    schedule = call.schedule
    if any(op is not None and op.kind.value != "F" for row in schedule.table for op in row):
        call = dataclasses.replace(call, schedule=forward_only(schedule))
    loss, stats = _run(call, (stage_params, head_params, inputs, targets, consts, embed_params))[:2]
    return (loss, stats) if call.stage_aux else loss


def _canonical(stage_fn: Callable, with_consts: bool, stage_batch: bool, stage_aux: bool) -> Callable:
    """``stage_fn`` as the branches call it: ``fn(chunk, x, const, batch) -> (y, aux_loss, stats)``."""
    def fn(chunk, x, const, batch):
        args = (chunk, x) + ((const,) if with_consts else ()) + ((batch,) if stage_batch else ())
        out = stage_fn(*args)
        if not stage_aux:
            return out, jnp.zeros((), jnp.float32), ()
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(f"stage_aux=True: stage_fn must return (y, aux_loss, stats), got {type(out).__name__}"
                            f"{'' if not isinstance(out, tuple) else f' of {len(out)} items'}; return stats=() "
                            "when there is nothing to report")
        y, aux, stats = out
        return y, jnp.asarray(aux, jnp.float32), stats

    return fn


def _run(call: PipelineCall, arrays: tuple):
    """The shard_map of the executor on ``arrays`` = ``(stage_params, head_params, inputs, targets,
    consts, embed_params)``: ``(loss, stats, stage_grads, head_grads, last)`` (forward-only: the
    first two)."""
    stage_params, head_params, inputs, targets, consts, embed_params = arrays
    schedule, axis, embed_fn = call.schedule, call.axis, call.embed_fn
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    _check_args(schedule, stage_params, inputs, targets, embed_fn is not None)
    fn = _canonical(call.stage_fn, consts is not None, call.stage_batch, call.stage_aux)
    consts = () if consts is None else consts
    embed_params = () if embed_fn is None or embed_params is None else embed_params
    stats = _check_stage_fn(fn, stage_params, consts, _activation(embed_fn, embed_params, inputs), targets)
    program = lower(schedule)
    out_specs = (P(), P(axis)) + (() if program.forward_only else (P(axis), P(), P()))
    run = jax.shard_map(
        _make_body(call, fn, program, stats), mesh=call.mesh, axis_names={axis},
        in_specs=(P(axis), P(), P(), P(), P(axis), P(), P(axis)), out_specs=out_specs, check_vma=True)
    return run(stage_params, head_params, inputs, targets, consts, embed_params, jnp.arange(p, dtype=jnp.int32))


def pipeline_loss(
    stage_fn: StageFn, loss_fn: LossFn, schedule: Schedule, mesh: Mesh, *, axis: str = "pipe",
    specs: tuple[Any, ...] | None = None, with_consts: bool = False, embed_fn: EmbedFn | None = None,
    stage_batch: bool = False, stage_aux: bool = False,
) -> Callable[..., Any]:
    """``pipeline_value_and_grad`` as a differentiable loss function (a ``jax.custom_vjp``).

    Returns ``f(stage_params, head_params, inputs, targets) -> loss`` whose gradient is the
    pipeline's (with ``with_consts``: ``f(stage_params, head_params, inputs, targets, consts)``,
    see ``pipeline_value_and_grad``; with ``embed_fn``, ``embed_params`` follows as the last
    argument and ``inputs`` are the raw inputs the first stage embeds). Use it inside an
    ordinary loss function so that ``jax.grad`` (or ``nnx.value_and_grad``) also reaches what
    produced ``inputs`` (an embedding outside) and ``stage_params`` (a reshape of stacked
    layers); a weight passed as both ``head_params`` and ``embed_params`` (tied) gets the sum
    of both gradients. Differentiated, it runs the whole schedule, backward included, and keeps
    the gradients for the backward pass; called without differentiating (evaluation) it runs
    the forwards only (``pipeline_forward``). ``targets`` get zero cotangents. ``stage_batch``
    and ``stage_aux`` as for ``pipeline_value_and_grad``; with ``stage_aux`` ``f`` returns
    ``(loss, stats)`` (differentiate it with ``has_aux=True``; ``stats`` carries no gradient).

    Example:
        >>> f = pipeline_loss(blocks_fn, head_loss, build("1f1b", 4, 8), mesh)  # doctest: +SKIP
        >>> g = jax.grad(lambda e: f(blocks, head, embed(e, tokens), labels))(e)  # doctest: +SKIP
    """
    call = PipelineCall(stage_fn=stage_fn, loss_fn=loss_fn, schedule=schedule, mesh=mesh, axis=axis, specs=specs,
                        embed_fn=embed_fn, stage_batch=stage_batch, stage_aux=stage_aux)

    def pair(value):   # one output structure, (loss, stats), for the custom_vjp
        return value if stage_aux else (value, ())

    @jax.custom_vjp
    def loss(stage_params, head_params, inputs, targets, consts, emb):
        # The primal runs only when nothing differentiates the call: forwards alone suffice.
        return pair(pipeline_forward(call, stage_params, head_params, inputs, targets,
                                     consts=consts if with_consts else None, embed_params=emb))

    def fwd(stage_params, head_params, inputs, targets, consts, emb):
        value, grads = pipeline_value_and_grad(call, stage_params, head_params, inputs, targets,
                                               consts=consts if with_consts else None, embed_params=emb)
        return pair(value), (grads, inputs, targets, consts, emb)

    def bwd(res, cotangent):
        (stage_grads, head_grads, last), inputs, targets, consts, emb = res
        cotangent = cotangent[0]   # the stats carry no gradient

        def scale(tree):
            return jax.tree.map(lambda g: g * cotangent.astype(g.dtype), tree)

        zero = lambda tree: jax.tree.map(_zero_cotangent, tree)  # noqa: E731
        if embed_fn is None:
            return scale(stage_grads), scale(head_grads), scale(last), zero(targets), zero(consts), zero(emb)
        return scale(stage_grads), scale(head_grads), zero(inputs), zero(targets), zero(consts), scale(last)

    loss.defvjp(fwd, bwd)
    if not stage_aux:   # a plain stage function: its (empty) stats are not returned
        fn = loss
        loss = lambda *args: fn(*args)[0]  # noqa: E731
    if embed_fn is not None:
        if with_consts:
            return loss
        return lambda stage_params, head_params, inputs, targets, emb: loss(
            stage_params, head_params, inputs, targets, (), emb)
    if with_consts:
        return lambda stage_params, head_params, inputs, targets, consts: loss(
            stage_params, head_params, inputs, targets, consts, ())
    return lambda stage_params, head_params, inputs, targets: loss(stage_params, head_params, inputs, targets,
                                                                   (), ())


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


def _check_args(schedule: Schedule, stage_params, inputs, targets, embedding: bool = False) -> None:
    """The arrays against the schedule (the mesh and the axis were checked by ``PipelineCall``)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if leaf.ndim == 0 or leaf.shape[0] != p * v:
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; its leading "
                f"axis must be stages*virtual_stages={p * v} (see to_stage_layout)")
    leaves = [(f"inputs{jax.tree_util.keystr(k)}", a) for k, a in jax.tree_util.tree_leaves_with_path(inputs)]
    if not embedding and not isinstance(inputs, jax.Array):
        raise TypeError(f"inputs must be one array of activations [m, micro_batch, ...] without embed_fn, got "
                        f"{type(inputs).__name__}; pass embed_fn to feed raw inputs (a pytree)")
    leaves += [
        (f"targets{jax.tree_util.keystr(k)}", a)
        for k, a in jax.tree_util.tree_leaves_with_path(targets)]
    for name, leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != m:
            raise ValueError(f"{name} has shape {leaf.shape}; its leading axis must be the {m} "
                             f"micro-batches of the schedule (reshape to [{m}, batch/{m}, ...])")


def _check_stage_fn(stage_fn, stage_params, consts, x: jax.ShapeDtypeStruct, targets) -> Any:
    """Checks the stage function's output; returns the shapes of its ``stats``."""
    first = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # noqa: E731
    y, aux, stats = jax.eval_shape(stage_fn, first(stage_params), x, first(consts), first(targets))
    if (getattr(y, "shape", None), getattr(y, "dtype", None)) != (x.shape, x.dtype):
        raise ValueError(f"stage_fn must map activations to the same shape and dtype: "
                         f"x {x.shape} {x.dtype} gave {y}; move shape changes into the "
                         f"function producing the inputs or into loss_fn")
    if aux.shape != ():
        raise ValueError(f"stage_fn's aux_loss must be a scalar, got shape {aux.shape}; sum it over its layers")
    return stats


def _pin(tree, specs, lead: int = 0):
    """``with_sharding_constraint`` on the automatic mesh axes (inside the shard_map)."""
    if specs is None:
        return tree
    return jax.tree.map(lambda a, s: lax.with_sharding_constraint(a, P(*(None,) * lead, *s)), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def _pinned_branch(branch, stage_specs, head_specs, act_spec, embed_specs):
    def run(chunk, head, emb, x, g, t, inp, c):
        chunk, head, emb = _pin(chunk, stage_specs, 1), _pin(head, head_specs), _pin(emb, embed_specs)
        x, g = _pin((x, g), (act_spec, act_spec))
        y, dx, dp, dh, de, loss, stats = branch(chunk, head, emb, x, g, t, inp, c)
        y, dx = _pin((y, dx), (act_spec, act_spec))
        if isinstance(dp, tuple) and not dp:   # forward-only branches return no gradients
            return y, dx, dp, dh, de, loss, stats
        return y, dx, _pin(dp, stage_specs, 1), _pin(dh, head_specs), _pin(de, embed_specs), loss, stats

    return run


_KIND = {IDLE: "I", F: "F", F_LAST: "F", B: "B", B_LAST: "B", W: "W", W_LAST: "W"}


def _branch_keys(program: Program, embedding: bool) -> tuple[np.ndarray, list]:
    """The instruction table with its ops renumbered to the branches that run them.

    An op's branch depends on its kind and on whether it runs the first virtual stage (with
    the embedding, when the executor runs it) or the last (with the loss). The last F of a
    training program does nothing (its B recomputes the forward), so it shares the idle branch.
    """
    code = np.array(program.code)
    keys: list = []
    index = np.zeros(code.shape[:2], np.int32)
    for step, stage in np.ndindex(*code.shape[:2]):
        op = int(code[step, stage, OP])
        last = op in (F_LAST, B_LAST, W_LAST)
        key = (_KIND[op], embedding and bool(code[step, stage, FROM_INPUT]), last)
        if op == IDLE or (op == F_LAST and not program.forward_only):
            key = ("I", False, False)
        if key not in keys:
            keys.append(key)
        index[step, stage] = keys.index(key)
    code[..., OP] = index
    return code, keys


def _make_body(call: PipelineCall, stage_fn, program: Program, stats=()):
    """The per-stage body of the shard_map; ``stage_fn``: ``call.stage_fn`` as the branches call it."""
    axis, embed_fn, specs, m = call.axis, call.embed_fn, call.specs, call.schedule.microbatches
    code, keys = _branch_keys(program, embed_fn is not None)
    branches = make_branches(keys, stage_fn, call.loss_fn, embed_fn, program.split_backward, m,
                             program.forward_only, stats)
    varying = functools.partial(_varying, axis=axis)
    stage_specs, head_specs, act_spec, embed_specs = (tuple(specs) + (None,))[:4] if specs else (None,) * 4
    if specs is not None:
        branches = [_pinned_branch(b, stage_specs, head_specs, act_spec, embed_specs) for b in branches]
    # each branch's ops carry its name (op, stages, virtual stages) into the compiled program, where
    # jaxpar.report.stage_collectives finds the collectives a branch holds and names who runs it
    branches = [scoped(b, branch_label(key, *_runners(code, i, call.schedule.placement, key[0] != "I")))
                for i, (b, key) in enumerate(zip(branches, keys))]

    def body(params, head, inputs, targets, consts, emb, index):
        params, head, emb = _pin(params, stage_specs, 2), _pin(head, head_specs), _pin(emb, embed_specs)
        head, emb, inputs, targets = varying((head, emb, inputs, targets))
        stage = index[0]   # this stage's position on the pipe axis
        x_like = _activation(embed_fn, emb, inputs)
        carry = varying(_initial_carry(params, head, emb, x_like, program, m, embed_fn is not None, stats))

        def step(carry, rows):
            r = rows[stage]
            carry = _tick(carry, r, (params, head, emb, inputs, targets, consts), branches, axis, program,
                          embed_fn is not None)
            carry["grads"] = _pin(carry["grads"], stage_specs, 2)
            carry["hgrads"] = _pin(carry["hgrads"], head_specs)
            carry["egrads"] = _pin(carry["egrads"], embed_specs)
            return carry, None

        carry, _ = lax.scan(step, carry, jnp.asarray(code))
        loss = lax.psum(carry["loss"], axis)
        if program.forward_only:
            return loss, carry["stats"]
        # the head's and the embedding's gradients live on the stages that ran them: the psum
        # over the pipe axis brings them (and a tied weight's two parts) to every stage
        last = lax.psum(carry["egrads"] if embed_fn is not None else carry["dinputs"][:m], axis)
        return loss, carry["stats"], carry["grads"], lax.psum(carry["hgrads"], axis), last

    return body


def _runners(code: np.ndarray, branch: int, placement: str, runs_chunk: bool = True
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stages that run ``branch`` at some tick, and the virtual stages they run it for (none
    for the idle branch)."""
    stages, virtual = set(), set()
    for step, stage in zip(*np.nonzero(code[..., OP] == branch)):
        stages.add(int(stage))
        if runs_chunk:
            virtual.add(virtual_stage(placement, code.shape[1], int(stage), int(code[step, stage, CHUNK])))
    return tuple(sorted(stages)), tuple(sorted(virtual))


def _activation(embed_fn, emb, inputs) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one micro-batch's activation between stages."""
    if embed_fn is None:
        return jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype)
    y = jax.eval_shape(embed_fn, emb, jax.tree.map(lambda a: a[0], inputs))
    return jax.ShapeDtypeStruct(y.shape, y.dtype)


def _varying(tree, axis: str):
    """Mark invariant values as differing across ``axis``, as scan carries must be."""
    return jax.tree.map(lambda a: lax.pcast(a, axis, to="varying"), tree)


def _zeros(tree, keep: bool = True):
    """Zero accumulators like ``tree``; zero-size ones (no cost) when nothing accumulates."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape if keep else (0,) + a.shape[1:], a.dtype), tree)


def _initial_carry(params, head, emb, x, program: Program, m: int, embedding: bool, stats=()) -> dict:
    def buffer(n):  # one more row: the dump that writes of "nothing" go to
        return jnp.zeros((n + 1,) + x.shape, x.dtype)

    train = not program.forward_only
    # with the embedding inside, no input gradient leaves the pipeline: a one-row dump
    dinputs = buffer(m if train and not embedding else 0)
    return dict(xbuf=buffer(program.x_slots), gbuf=buffer(program.g_slots),
                fmsg={c: buffer(0)[0] for c in program.sends_x},
                bmsg={c: buffer(0)[0] for c in program.sends_g}, grads=_zeros(params, train),
                hgrads=_zeros(head, train), egrads=_zeros(emb, train), loss=jnp.zeros((), jnp.float32),
                dinputs=dinputs, stats=_chunk_stats(params, stats))


def _chunk_stats(params, stats):
    """One accumulator of the stage function's stats per chunk this stage holds."""
    chunks = jax.tree.leaves(params)[0].shape[0]
    return jax.tree.map(lambda s: jnp.zeros((chunks,) + tuple(s.shape), stats_dtype(s.dtype)), stats)


_SHIFT = {"next": 1, "prev": -1}


def _send(value, channels, axis: str, p: int) -> dict:
    """``value`` on each channel a placement uses: to a ring neighbour, or kept (``self``)."""
    return {c: value if c == "self" else
            lax.ppermute(value, axis, [(s, (s + _SHIFT[c]) % p) for s in range(p)]) for c in channels}


def _tick(carry, r, arrays: tuple, branches, axis: str, program: Program, embedding: bool) -> dict:
    """One step of one stage: its row ``r`` of the program run on ``arrays`` = ``(params, head,
    embed_params, inputs, targets, consts)``; ``embedding``: the first virtual stage embeds."""
    params, head, emb, inputs, targets, consts = arrays
    p = lax.axis_size(axis)
    xbuf, gbuf = carry["xbuf"], carry["gbuf"]
    for c, msg in carry["fmsg"].items():   # what arrived on a channel nobody sent to goes to the dump row
        xbuf = xbuf.at[r[RECV_X[c]]].set(msg)
    for c, msg in carry["bmsg"].items():
        gbuf = gbuf.at[r[RECV_G[c]]].set(msg)
    inp = jax.tree.map(lambda a: a[r[MB]], inputs)
    x = xbuf[r[X_SLOT]] if embedding else jnp.where(r[FROM_INPUT] == 1, inp, xbuf[r[X_SLOT]])
    chunk = jax.tree.map(lambda a: a[r[CHUNK]], params)
    target = jax.tree.map(lambda a: a[r[MB]], targets)
    const = jax.tree.map(lambda a: a[r[CHUNK]], consts)
    y, dx, dp, dh, de, loss, stats = lax.switch(r[OP], branches, chunk, head, emb, x, gbuf[r[G_SLOT]], target,
                                                inp, const)
    out = dict(carry, xbuf=xbuf, gbuf=gbuf, fmsg=_send(y, program.sends_x, axis, p),
               bmsg=_send(dx, program.sends_g, axis, p), loss=carry["loss"] + loss.astype(jnp.float32),
               stats=jax.tree.map(lambda acc, d: acc.at[r[CHUNK]].add(d), carry["stats"], stats))
    if not program.forward_only:
        out["grads"] = jax.tree.map(lambda acc, d: acc.at[r[CHUNK]].add(d), carry["grads"], dp)
        out["hgrads"] = jax.tree.map(jnp.add, carry["hgrads"], dh)
        out["egrads"] = jax.tree.map(jnp.add, carry["egrads"], de)
        out["dinputs"] = carry["dinputs"].at[jnp.minimum(r[DX_MB], carry["dinputs"].shape[0] - 1)].add(dx)
    return out
