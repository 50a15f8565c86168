"""The training step, built in one place from one wrapper per technique.

`build_step` reads top to bottom as the order the techniques apply in; each wrapper is a
verb-named function of this module that takes a loss (or gradient) function and returns one
of the same kind. Every variant of the step — training, gradients only (``lower_grads``),
evaluation — is a prefix of that one chain, so there is no second copy to drift.

The functions passed along the chain:

- a *model loss* ``loss_fn(model, batch) -> loss | (loss, aux)`` (the user's);
- a *state loss* ``(params, rest, batch) -> (loss, (aux, rest))`` on the split state;
- a *gradient function* ``(params, rest, batch) -> (loss, aux, rest, grads)``;
- the *step* ``(TrainState, batch) -> (TrainState, metrics)``.

With rows pulled from outside the model (``Trainer(rows=...)``, `jaxpar.ps.rows`) the model
loss is ``loss_fn(model, batch, rows)``, the differentiated ``params`` of the state loss and
gradient function are the pair ``(params, rows)`` (`Setting.join`), and the step is
``(TrainState, batch, rows) -> (TrainState, metrics, row_grads)``. The rows are replicated:
the wrappers that lay out parameters by the plan (ZeRO, hybrid's ``shard_map``) apply it to
the parameters alone; every other wrapper (precision, recompute, accumulation) treats the
rows as it treats parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.data import part_shapes
from jaxpar.nn import fp8
from jaxpar.nn.blocks import layer_constrained_loss, recompute_paths, recomputed_loss, stacked_blocks
from jaxpar.nn.moe import MoEMetric, moe_metrics
from jaxpar.optim import accumulate, fusion
from jaxpar.optim.zero import gather_params, reduce_gradients
from jaxpar.pipeline.model import pipelined
from jaxpar.pipeline.stages import StagedLoss
from jaxpar.plan.state import TrainState, sharded_tx
from jaxpar.precision import cast_floats, cast_like
from jaxpar.remat import checkpoint_policy
from jaxpar.strategy import spec_axes, varying_axes

_is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


class Setting:
    """What every wrapper may read: the plan, the mesh, the model's graph, and state shapes."""

    def __init__(self, plan, mesh, graphdef, params_like, rest_like, rows_like=None, row_specs=None):
        self.plan, self.mesh, self.graphdef = plan, mesh, graphdef
        self.params_like, self.rest_like = params_like, rest_like
        self.zero = plan.zero(params_like)
        self.rest_specs = plan.specs("rest", rest_like)
        self.precision = plan.precision
        # MoE layers record routing figures the step returns with its metrics (`record_moe`)
        self.moe = bool(jax.tree.leaves(nnx.state(nnx.merge(graphdef, params_like, rest_like), MoEMetric)))
        self.rows = rows_like       # shapes of the pulled rows (None: the model holds every parameter)
        # Replicated unless the source placed them (a job of several processes: each process's block)
        self.row_specs = row_specs if rows_like is None or row_specs is not None else \
            jax.tree.map(lambda _: PartitionSpec(), rows_like)
        if rows_like is not None and plan.loss_runs == "per_device" and any(
                s != PartitionSpec() for s in jax.tree.leaves(self.row_specs, is_leaf=_is_spec)):
            raise ValueError(f"mode='hybrid' runs the loss per device, where pulled rows must be replicated; these "
                             f"are split ({self.row_specs}): use mode='semi_auto' with a row source that splits them")

    def evaluating(self) -> "Setting":
        """This setting with the model in evaluation mode: ``nnx.Module.eval()`` sets every
        ``deterministic`` (dropout) and ``use_running_average`` (batch norm) attribute, which
        the graph carries; a model with neither is unchanged."""
        model = nnx.merge(self.graphdef, self.params_like, self.rest_like)
        model.eval()
        out = copy.copy(self)
        out.graphdef = nnx.graphdef(model)
        return out

    def join(self, params, rows: tuple):
        """What the chain differentiates: ``params``, or ``(params, rows)`` with pulled rows
        (``rows``: ``()`` or ``(rows,)``)."""
        return (params, *rows) if rows else params

    def split(self, tree) -> tuple[Any, tuple]:
        """``join``'s inverse: ``(params, ())`` or ``(params, (rows,))``."""
        return (tree, ()) if self.rows is None else (tree[0], (tree[1],))

    def on_params(self, fn: Callable, tree):
        """``fn`` on the parameters' part of a joined tree (the rows, replicated, pass as they are)."""
        params, rows = self.split(tree)
        return self.join(fn(params), rows)

    def with_rows(self, param_specs):
        """Specs of a joined tree: ``param_specs`` and the rows replicated."""
        return param_specs if self.rows is None else (param_specs, self.row_specs)

    def shardings(self, specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec)

    def constrain(self, tree, specs):
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, self.shardings(specs))

    def batch_constraint(self, part):
        """Pins a batch split into parts (``[k, B/k, ...]``) to the batch layout of one part."""
        specs = self.plan.batch_specs(part)
        return lambda split: jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, PartitionSpec(None, *s))), split, specs, is_leaf=_is_spec)


def split_loss_output(out) -> tuple[jax.Array, Any]:
    """``loss_fn`` may return a scalar or ``(loss, aux)``; anything else is named."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(f"loss_fn returned a tuple of {len(out)} values; return a scalar loss or "
                             "(loss, aux) with aux any pytree of arrays")
        loss, aux = out
    else:
        loss, aux = out, None
    if not hasattr(loss, "shape") or loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss (or (loss, aux)); its loss has shape "
                         f"{getattr(loss, 'shape', type(loss).__name__)}; reduce it, e.g. with .mean()")
    return loss, aux


# --------------------------------------------------------------------------- the chain


def build_grads(s: Setting, loss_fn: Callable, batch) -> Callable:
    """``(params as stored, rest, batch) -> (loss, aux, rest, grads)`` for a global ``batch`` shape."""
    plan = s.plan
    k, n = plan.grad_accum, plan.interleave
    plan.batch_layout.check_parts(batch)    # every part keeps each leaf split over its devices
    micro, part = part_shapes(batch, k), part_shapes(batch, k * n)
    # A pipeline is a model loss too: its stages run the blocks as the schedule over the
    # pipe axis, so every wrapper below applies to it unchanged.
    order = loss_fn.order if isinstance(loss_fn, StagedLoss) else None   # blocks named by the loss
    loss_fn = pipeline(s, loss_fn)
    # Recompute goes on each of the model's blocks (the scan body, or each layer), in the
    # pipeline's stages too: around the whole loss XLA keeps a scan's stacked activations.
    # A model without blocks keeps the whole-loss recompute below (`whole`: its policy).
    loss_fn, whole = recompute_blocks(s, loss_fn, plan.remat, order)
    # ZeRO-3 gathers scanned blocks' parameters one layer at a time, around their recompute
    loss_fn, by_layer = gather_by_layer(s, loss_fn, order)
    # MoE routing figures leave the model loss beside its aux: every wrapper below carries
    # them as it carries aux (accumulation and multi-copy average them over the parts, and
    # sum the dropped assignments: `combine_parts`).
    loss_fn = record_moe(s, loss_fn)
    parts = combine_parts(s)
    if plan.loss_runs == "per_device" and (plan.config.comm_fusion is not None or plan.zero_level):
        # Per-device gradients reduced by jaxpar: bucketed all-reduces and reduce-scatters
        # to the ZeRO shards, inside the same shard_map as the loss.
        grads = reduce_per_device(s, loss_fn, micro, lambda f: cast(s, interleave(recompute(f, whole), n,
                                                                                  combine_aux=parts)))
    else:
        loss = merge(s, loss_fn, part)
        # ZeRO-3 gathers the stored shards to the compute layout *inside* the loss, so that a
        # whole-loss recompute (next) gathers them again in the backward instead of keeping them.
        loss = gather(s, loss, by_layer)
        loss = recompute(loss, whole)
        # Multi-copy: the parts run one after another in one program, so one part's
        # collectives can overlap the next part's compute.
        loss = interleave(loss, n, s.batch_constraint(part), combine_aux=parts)
        # Precision casts the stored parameters to the compute dtype here: outside recompute
        # and the interleaved parts (one cast per micro-batch, the cast copy is what the
        # backward keeps), before the ZeRO-3 gather (the all-gather moves compute-dtype
        # shards), and inside differentiate, so gradients come back in the stored dtype and
        # the update lands on the master weights.
        loss = cast(s, loss)
        grads = reduce_in(s, differentiate(loss))
    # Accumulation scans everything above over k micro-batches; the running sum is kept in
    # the ZeRO gradient layout (sharded from level 2) and the reduce dtype; the optimizer
    # then gets the gradients in the stored dtype.
    return to_stored(s, accumulate_grads(s, grads, k, micro, combine_aux=parts))


def build_step(s: Setting, loss_fn: Callable, tx: optax.GradientTransformation, batch, *,
               skip_nonfinite: bool = False) -> Callable:
    """``(TrainState, batch) -> (TrainState, metrics)``: gradients, then the update."""
    grads = build_grads(s, loss_fn, batch)
    # The update runs on the ZeRO shards of the optimizer state (level >= 1).
    return update(s, grads, sharded_tx(s.plan, s.mesh, tx, s.params_like), skip_nonfinite=skip_nonfinite)


def build_eval(s: Setting, loss_fn: Callable, batch) -> Callable:
    """``(TrainState, batch) -> loss``: the forward of the chain, no gradients, the model in
    evaluation mode (`Setting.evaluating`: dropout off, batch norm on its running statistics)."""
    s = s.evaluating()
    order = loss_fn.order if isinstance(loss_fn, StagedLoss) else None
    by_layer_loss, by_layer = gather_by_layer(s, pipeline(s, loss_fn), order)
    loss = cast(s, gather(s, merge(s, by_layer_loss, batch), by_layer))

    def evaluate(state: TrainState, batch, *rows):
        return loss(s.join(state.params, rows), state.rest, batch)[0]

    return evaluate


# --------------------------------------------------------------------------- wrappers


def pipeline(s: Setting, loss_fn: Callable) -> Callable:
    """``pipeline.stages > 1``: the ``PipelineLoss`` run as the schedule over the pipe axis."""
    if s.plan.pipeline.stages == 1:
        return loss_fn
    specs = nnx.merge(s.graphdef, s.plan.specs("params", s.params_like), s.rest_specs)
    return pipelined(loss_fn, s.plan.config, s.mesh, specs=specs, schedule=s.plan.schedule,
                     layout=s.plan.batch_layout)


def merge(s: Setting, loss_fn: Callable, batch) -> Callable:
    """The model loss as a state loss: compiled SPMD, or per device in ``shard_map`` (hybrid)."""
    if s.plan.loss_runs == "per_device":
        return per_device(s, loss_fn, batch)

    def compute(params, rest, batch):
        params, rows = s.split(params)
        model = nnx.merge(s.graphdef, params, _fresh(rest))
        loss, aux = split_loss_output(loss_fn(model, batch, *rows))
        return loss, (aux, nnx.state(model, nnx.Not(nnx.Param)))

    return compute


def per_device(s: Setting, loss_fn: Callable, batch) -> Callable:
    """Hybrid: the user's loss per device in ``shard_map``, averaged over the batch axes; the
    non-parameter state it updates comes back (float statistics averaged like the loss)."""
    axes = s.plan.batch_axes()
    compute_specs = s.with_rows(s.plan.specs("params", s.params_like))
    batch_specs = s.plan.batch_specs(batch)

    def local(params, rest, batch):
        params, rows = s.split(params)
        model = nnx.merge(s.graphdef, params, _fresh(rest))
        loss, aux = split_loss_output(loss_fn(model, batch, *rows))
        loss = _same_everywhere(_mean(loss, axes), "the loss", axes)
        aux = jax.tree_util.tree_map_with_path(
            lambda path, x: _same_everywhere(_mean(x, axes), f"aux{jax.tree_util.keystr(path)}", axes), aux)
        return loss, aux, _agree(nnx.state(model, nnx.Not(nnx.Param)), axes)

    def compute(params, rest, batch):
        loss, aux, rest = jax.shard_map(
            local, mesh=s.mesh, in_specs=(compute_specs, s.rest_specs, batch_specs),
            out_specs=(PartitionSpec(), PartitionSpec(), s.rest_specs), check_vma=True,
        )(params, rest, batch)
        return loss, (aux, rest)

    return compute


def gather(s: Setting, loss: Callable, by_layer: frozenset = frozenset()) -> Callable:
    """ZeRO-3: parameters stored sharded are constrained to their compute layout where used;
    those ``by_layer`` gathers one layer at a time (`gather_by_layer`) stay sharded here."""
    if s.plan.zero_level < 3 or s.plan.loss_runs == "per_device":
        return loss   # (per device, `reduce_per_device` all-gathers inside the shard_map)
    specs = s.zero.compute if not by_layer else s.plan.specs(
        {**s.plan.params, **{k: s.plan.stored[k] for k in by_layer}}, s.params_like)

    def gathered(params, rest, batch):
        return loss(s.on_params(lambda p: s.constrain(p, specs), params), rest, batch)

    return gathered


def gather_by_layer(s: Setting, loss_fn: Callable, order=None) -> tuple[Callable, frozenset]:
    """ZeRO-3 with scanned blocks (`jaxpar.nn.blocks.stacked_blocks`): each layer's parameters
    are gathered in the scan's step that runs it, not all before the loop (where XLA puts the
    gather of parameters constrained to their compute layout at the loss's top: every layer's
    at once, the memory ZeRO 3 is for). Each block's parameters are pinned, per call, to their
    stored shard and then to their compute layout (`jaxpar.nn.blocks.layer_constrained_loss`;
    inside a block's recompute, so its backward gathers again). Returns the loss and the plan
    paths so gathered, which `gather` leaves sharded. Not in a pipeline (its stages hold their
    own layers) nor per device (hybrid: `reduce_per_device` gathers)."""
    plan = s.plan
    if plan.zero_level < 3 or plan.loss_runs == "per_device" or plan.pipeline.stages > 1:
        return loss_fn, frozenset()
    constraints: dict[str, dict[str, tuple]] = {}
    for block in stacked_blocks(nnx.merge(s.graphdef, s.params_like, s.rest_like), order):
        by_param = {}
        for key, stored in plan.stored.items():
            compute = plan.params[key]
            # (a stacked block's parameters all have "layers" first: `stacked_blocks`)
            if not key.startswith(block + "/") or stored == compute or tuple(stored)[:1] not in ((), (None,)) \
                    or tuple(compute)[:1] not in ((), (None,)):
                continue        # not this block's, not sharded by ZeRO, or its layers split (kept whole)
            by_param[key[len(block) + 1:]] = (NamedSharding(s.mesh, PartitionSpec(*tuple(stored)[1:])),
                                              NamedSharding(s.mesh, PartitionSpec(*tuple(compute)[1:])))
        if by_param:
            constraints[block] = by_param
    if not constraints:
        return loss_fn, frozenset()
    keys = frozenset(f"{block}/{rel}" for block, by_param in constraints.items() for rel in by_param)
    return layer_constrained_loss(loss_fn, constraints), keys



def recompute_blocks(s: Setting, loss_fn: Callable, policy: str, order=None) -> tuple[Callable, str]:
    """``remat`` on each block ``find_blocks`` names (``order``: a ``StagedLoss``'s module paths):
    the model loss with the blocks' classes swapped for recomputed ones on the model it gets,
    and ``"none"`` left for ``recompute``. A model without blocks gets it back unchanged with
    ``policy`` (the whole loss) and a warning; one whose blocks carry their own policy too is
    refused (`jaxpar.nn.blocks.recompute_paths`, which the job search prices with too)."""
    if policy == "none":
        return loss_fn, policy
    paths = recompute_paths(nnx.merge(s.graphdef, s.params_like, s.rest_like), policy, order)
    if not paths:
        return loss_fn, policy
    return recomputed_loss(loss_fn, paths, policy), "none"


def record_moe(s: Setting, loss_fn: Callable) -> Callable:
    """A model with MoE layers: the model loss returns ``(loss, (aux, routing))``, ``routing`` its
    `jaxpar.nn.moe_metrics`, read in the step (no wait of its own). The dropped count stays an
    int32 count: accumulation and multi-copy sum it over the parts (`combine_parts`). A model
    without MoE layers gets ``loss_fn`` back unchanged."""
    if not s.moe:
        return loss_fn

    def with_routing(model, batch, *rows):
        loss, aux = split_loss_output(loss_fn(model, batch, *rows))
        return loss, (aux, moe_metrics(model))

    return with_routing


def combine_parts(s: Setting) -> Callable:
    """How accumulation and multi-copy make one aux of their parts' (`accumulate.mean_parts`):
    with MoE layers the routing's losses averaged like the loss, and its dropped assignments
    summed as int32 (exact at any count, where a float32 mean is exact to 2**24 only)."""
    if not s.moe:
        return accumulate.mean_parts

    def combine(aux):
        aux, routing = aux
        summed = {"moe_dropped": jnp.sum(routing["moe_dropped"], 0, dtype=jnp.int32)}
        return accumulate.mean_parts(aux), accumulate.mean_parts(routing) | summed

    return combine


def recompute(loss: Callable, policy: str) -> Callable:
    """``remat`` over the whole loss (a model without blocks): keep only what the policy saves;
    recompute the rest in the backward."""
    if policy == "none":
        return loss
    return jax.checkpoint(loss, policy=checkpoint_policy(policy))


def interleave(loss: Callable, n: int, constrain: Callable = lambda b: b, *,
               combine_aux: Callable = accumulate.mean_parts) -> Callable:
    """``interleave=n``: the loss of ``n`` parts of the batch, unrolled one after another."""
    return accumulate.interleave_loss(loss, n, constrain_parts=constrain, combine_aux=combine_aux)


def cast(s: Setting, loss: Callable) -> Callable:
    """``precision``: parameters and float batch leaves cast to the compute dtype where the
    loss uses them, its matmuls in ``precision.matmuls``; the loss returned in fp32; non-parameter state back in its own dtypes
    (statistics stay as stored; keys and counters are never cast)."""
    if s.precision is None:
        return loss
    dtype, kind = s.precision.compute, s.precision.matmuls

    def cast_loss(params, rest, batch):
        with fp8.matmuls(kind):     # the model's projections in fp8 where the preset asks (jaxpar.nn.fp8)
            value, (aux, new_rest) = loss(cast_floats(params, dtype), rest, cast_floats(batch, dtype))
        return value.astype(jnp.float32), (aux, cast_like(new_rest, rest))

    return cast_loss


def _map_grads(grads: Callable, fn: Callable) -> Callable:
    """``grads`` with ``fn(g, params)`` applied to the gradients it returns."""
    def compute(params, rest, batch):
        loss, aux, rest, g = grads(params, rest, batch)
        return loss, aux, rest, fn(g, params)

    return compute


def reduce_in(s: Setting, grads: Callable) -> Callable:
    """``precision``: gradients in the reduce dtype from the backward on (sums, collectives)."""
    if s.precision is None:
        return grads
    return _map_grads(grads, lambda g, _: cast_floats(g, s.precision.reduce))


def to_stored(s: Setting, grads: Callable) -> Callable:
    """``precision``: gradients handed to the optimizer in the dtype of the stored parameters."""
    if s.precision is None:
        return grads
    return _map_grads(grads, cast_like)


def differentiate(loss: Callable) -> Callable:
    """A state loss → a gradient function (gradients with respect to the parameters)."""

    def compute(params, rest, batch):
        (value, (aux, rest)), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, batch)
        return value, aux, rest, grads

    return compute


def reduce_per_device(s: Setting, loss_fn: Callable, batch, wrap: Callable) -> Callable:
    """Hybrid with ZeRO or comm_fusion: per-device gradients reduced by jaxpar in ``shard_map``
    (parameters made varying first so nothing is reduced implicitly; ZeRO-3 shards gathered
    inside the loss, so recompute gathers them again)."""
    plan, zero = s.plan, s.zero
    axes = plan.batch_axes()     # optimizer.axis among them: `jaxpar.plan.check_combination`
    bucket = fusion.bucket_bytes(plan.config.comm_fusion) if plan.config.comm_fusion is not None else None
    others = (lambda leaves, on: fusion.bucketed_psum(leaves, on, bucket)) if bucket else None
    target = s.with_rows(zero.state if plan.zero_level else zero.compute)
    stored = s.with_rows(zero.params)
    batch_specs = plan.batch_specs(batch)

    def state_loss(params, rest, batch):
        params, rows = s.split(params)
        model = nnx.merge(s.graphdef, gather_params(params, zero.params, zero.compute), _fresh(rest))
        loss, aux = split_loss_output(loss_fn(model, batch, *rows))
        return loss, (aux, nnx.state(model, nnx.Not(nnx.Param)))

    state_loss = wrap(state_loss)

    def varying(x, spec):   # a parameter varies over the axes of its spec only
        missing = tuple(a for a in axes if a not in {b for e in spec for b in spec_axes(e)})
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def local(params, rest, batch):
        grad_fn = jax.value_and_grad(lambda p: state_loss(p, rest, batch), has_aux=True)
        (loss, (aux, rest)), grads = grad_fn(jax.tree.map(varying, params, stored, is_leaf=_is_spec))
        if s.precision is not None:       # the all-reduce / reduce-scatter runs in the reduce dtype
            grads = cast_floats(grads, s.precision.reduce)
        grads = reduce_gradients(grads, stored, target, axes, others) if axes else grads
        return _mean(loss, axes), jax.tree.map(lambda x: _mean(x, axes), aux), _agree(rest, axes), grads

    def compute(params, rest, batch):
        return jax.shard_map(
            local, mesh=s.mesh, in_specs=(stored, s.rest_specs, batch_specs),
            out_specs=(PartitionSpec(), PartitionSpec(), s.rest_specs, target), check_vma=True,
        )(params, rest, batch)

    return compute


def accumulate_grads(s: Setting, grads: Callable, k: int, micro, *,
                     combine_aux: Callable = accumulate.mean_parts) -> Callable:
    """``grad_accum=k``: a scan over ``k`` micro-batches; the sum kept in the ZeRO gradient layout."""
    return accumulate.accumulate_grads(grads, k, combine_aux=combine_aux,
                                       constrain_grads=lambda g: s.on_params(lambda p: s.constrain(p, s.zero.grads), g),
                                       constrain_parts=s.batch_constraint(micro),
                                       dtype=s.precision.reduce if s.precision is not None else None)


def update(s: Setting, grads: Callable, tx: optax.GradientTransformation, *, skip_nonfinite: bool = False
           ) -> Callable:
    """One optimizer update after ``grads``; the step counter advances on the device.

    ``metrics["finite"]`` says whether the loss and the gradient norm were finite (two scalars:
    free), and with ``skip_nonfinite`` also the state the update writes (`updated_finite`). A
    model with MoE layers adds ``moe_load_balance``, ``moe_z_loss`` and ``moe_dropped``
    (`record_moe`). With ``skip_nonfinite`` a step that was not keeps the previous parameters and
    optimizer state; the select costs the step temporary memory (old and new state side by
    side), so it is ``Services(nonfinite="skip")`` only.

    With pulled rows (``s.rows``) the step takes them after the batch and returns their
    gradients after the metrics (zeros for a skipped step); the gradient norm covers both."""
    def step(state: TrainState, batch, *rows):
        params, opt_state = state.params, state.opt_state
        loss, aux, rest, g = grads(s.join(params, rows), state.rest, batch)
        aux, routing = aux if s.moe else (aux, None)
        norm = optax.tree.norm(g)
        g, row_grads = s.split(g)
        updates, new_opt_state = tx.update(g, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)
        if skip_nonfinite:
            # What "skip" keeps is judged on what the step writes too: a finite loss and gradient
            # can still give a NaN update (a NaN learning rate, an optimizer overflow). Only here,
            # where the step must decide on the device: on sharded state the flag costs the step
            # all-reduces of its own. Under "stop" the saves check the state they write
            # (`jaxpar.checkpoint.checksum.checksums_to_save`), and a NaN update shows in the
            # next step's loss.
            finite = finite & updated_finite(new_params, new_opt_state)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
            row_grads = tuple(jax.tree.map(lambda x: jnp.where(finite, x, 0), r) for r in row_grads)
        params, opt_state = new_params, new_opt_state
        metrics = {"loss": loss, "grad_norm": norm, "finite": finite}
        if routing is not None:    # means over the grad_accum x interleave parts; dropped: their int32 sum
            metrics |= routing
        if aux is not None:
            metrics["aux"] = aux
        return (state.replace(params=params, rest=rest, opt_state=opt_state, step=state.step + 1), metrics,
                *row_grads)

    return step


def updated_finite(params, opt_state) -> jax.Array:
    """One boolean: every updated parameter is finite and no optimizer-state value is NaN.

    An infinity in the optimizer state may be meant (a sentinel such as
    ``optax.contrib.reduce_on_plateau``'s best value before any), a NaN never is. Each leaf is
    reduced where it lives (the reductions fuse with the update that writes it) and the leaves'
    flags are combined into one scalar."""
    floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]  # noqa: E731
    flags = [jnp.all(jnp.isfinite(x)) for x in floats(params)] + [~jnp.any(jnp.isnan(x)) for x in floats(opt_state)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


# --------------------------------------------------------------------------- helpers


def _fresh(rest):
    """New Variables for the non-parameter state, created in the current trace, so the loss
    may update them there (dropout advancing its RNG count)."""
    return jax.tree.map(lambda x: x, rest)


def _mean(x, axes):
    return jax.lax.pmean(x, axes) if axes else x


def _same_everywhere(x, what: str, axes):
    """``x`` (already averaged over the batch axes), refused with a ValueError naming the mesh
    axes it still varies over: the per-device loss and aux leave ``shard_map`` as one value."""
    varying = tuple(sorted(a for a in varying_axes(x) if a not in axes))
    if varying:
        raise ValueError(f"mode='hybrid': {what} returned by loss_fn differs across the mesh axes {varying} "
                         f"(after its mean over the batch axes {tuple(axes)}): parameters split over those axes "
                         "reach loss_fn as shards, so model code written for whole tensors computes partial "
                         "results. Reduce over them in the model or loss (jax.lax.psum, or the jaxpar.ops "
                         "operators, which work per device), or use mode='semi_auto', where XLA adds the collectives")
    return x


def _agree(rest, axes):
    """Per-device non-parameter state made equal across the batch axes: float statistics are
    averaged (as the loss is); integer state (RNG keys and counts) must already agree."""
    if not axes:
        return rest

    def one(x):
        varying = tuple(a for a in axes if a in varying_axes(x))
        if not varying:
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, varying)
        raise ValueError(f"mode='hybrid': a non-parameter variable of dtype {x.dtype} and shape {x.shape} "
                         f"differs across the batch axes {varying}; keep integer state (RNG counts) the same "
                         "on every device, or use mode='semi_auto'")

    return jax.tree.map(one, rest)
