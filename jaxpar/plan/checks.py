"""Combinations refused before anything is built, decided once for every entry point.

Pairs of features that the config alone rules out are refused by ``ParallelConfig`` itself.
What depends on the model (a context axis needs attention that masks by position; experts
need their auxiliary loss carried out of pipeline stages), on the loss (a pipeline needs a
``PipelineLoss`` or ``StagedLoss``) or on the backend is refused here, by
`check_combination`, which `make_train_plan`, the ``Trainer``, ``jaxpar plan`` and the job
runner call: a plan is never made for a combination the Trainer would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ParallelConfig
from jaxpar.data import batch_axes
from jaxpar.mesh import resolve_axes
from jaxpar.nn.fp8 import fp8_unavailable
from jaxpar.nn.moe import MoE
from jaxpar.nn.specs import is_variable, logical_names, matching_patterns, path_str, variable_spec
from jaxpar.optim.zero import zero_axes
from jaxpar.ops import ContextParallel
from jaxpar.pipeline import PipelineLoss, StagedLoss
from jaxpar.pipeline.model import check_layers, stacked_layers
from jaxpar.pipeline.schedules import build
from jaxpar.strategy import mesh_sizes, spec_axes


def check_combination(config: ParallelConfig, model: nnx.Module | None = None, loss_fn: Any = None, *,
                      mesh: Any = None, platform: str | None = None, rows: Any = None, batch: Any = None,
                      who: str = "make_train_plan") -> None:
    """Raise a ``ValueError`` / ``TypeError`` naming both features when ``config`` cannot train
    ``model`` with ``loss_fn`` on ``platform``. What is not given (``None``) is not checked:
    without ``loss_fn`` the loss-dependent refusals wait for the Trainer, which gives it.
    ``mesh`` (a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``) is the mesh the plan is for: a
    ``-1`` axis of ``config.mesh`` takes the rest of its devices (without it, of
    ``jax.device_count()``, as ``jaxpar.make_mesh(config)`` would). ``rows``: the row source the Trainer pulls
    embedding rows through (``Trainer(rows=...)``), if any. ``batch``: an example global batch
    (arrays or ``jax.ShapeDtypeStruct`` leaves); with it and ``loss_fn``, rules that nothing
    consults are refused as the first traced step refuses them (`check_rules_used`).

    >>> check_combination(ParallelConfig(mesh={"data": 8}), model)            # doctest: +SKIP
    """
    sizes = _mesh_sizes(config, mesh)
    check_pipe_axis(config, mesh, who)
    if platform is not None:
        _check_platform(config, platform)
    if rows is not None:
        check_rows_pipeline(config, who)
    check_hybrid_optimizer_axis(config, sizes, who)
    if loss_fn is not None and config.pipeline.stages > 1 and not isinstance(loss_fn, (PipelineLoss, StagedLoss)):
        raise TypeError(
            f"{who}: pipeline.stages={config.pipeline.stages} needs loss_fn as a jaxpar.pipeline.PipelineLoss "
            f"(embed / blocks / head / head_loss) or StagedLoss (modules by path), got {type(loss_fn).__name__}; "
            "see docs/pipeline.md")
    if model is None:
        return
    params = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=is_variable)[0]
    if isinstance(loss_fn, PipelineLoss) and config.pipeline.stages > 1:
        pipe = config.pipeline
        virtual = build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages).virtual_stages
        check_layers(config, stacked_layers(loss_fn, model), virtual, who)
        _check_stage_layers(config, model, params, loss_fn, who)
    _check_param_dtypes(params, who)
    _check_context(model, config, loss_fn, who, loss_fn is not None)
    _check_experts(model, config, loss_fn, who, loss_fn is not None)
    _check_expert_routing(model, config, sizes, who)
    _check_hybrid_params(config, params, sizes, who)
    if loss_fn is not None and batch is not None:
        check_rules_used(config, model, loss_fn, batch)


def check_pipe_axis(config: ParallelConfig, mesh: Any = None, who: str = "make_train_plan") -> None:
    """``pipeline.stages`` stages live on the pipe axis, one stage per device along it: the axis's
    size must be the stage count (``ParallelConfig`` checks that the axis exists; its size may
    be ``-1``, the rest of the devices of ``mesh``, known here)."""
    pipe = config.pipeline
    if pipe.stages == 1:
        return
    if mesh is not None:
        sizes = mesh_sizes(mesh)
    else:
        try:
            sizes = resolve_axes(config.mesh, jax.device_count())
        except ValueError:      # a mesh for other devices: only a size the config gives is known
            sizes = dict(config.mesh)
    size = sizes.get(pipe.axis)
    if size in (None, -1) or size == pipe.stages:
        return
    raise ValueError(f"{who}: pipeline.stages={pipe.stages} but mesh axis {pipe.axis!r} has size {size} (mesh "
                     f"{dict(sizes)}): each stage runs on its own devices along that axis; make them equal "
                     f"(pipeline.stages={size}, or mesh {{{pipe.axis!r}: {pipe.stages}, ...}})")


def check_rows_pipeline(config: ParallelConfig, who: str = "make_train_plan") -> None:
    """A row source (``Trainer(rows=...)``) hands its pulled rows to ``loss_fn(model, batch,
    rows)``; a pipeline's stages take the hidden state and their micro-batch only."""
    if config.pipeline.stages > 1:
        raise ValueError(f"{who}: rows= with pipeline.stages={config.pipeline.stages}: the pipeline's stages take "
                         "no pulled rows; train the embedding rows with pipeline.stages=1")


def check_hybrid_optimizer_axis(config: ParallelConfig, sizes: Mapping[str, int],
                                who: str = "make_train_plan") -> None:
    """``mode="hybrid"`` with optimizer parallel reduces each device's gradients to its ZeRO
    shard inside the per-device ``shard_map``, over the batch axes, the only axes its
    gradients differ over: ``optimizer.axis`` must name batch axes."""
    if config.mode != "hybrid" or config.optimizer.level == 0:
        return
    axes, batch = zero_axes(config.optimizer, sizes), batch_axes(config, sizes)
    off = [a for a in axes if a not in batch]
    if not off:
        return
    raise ValueError(f"{who}: mode='hybrid' with optimizer.level={config.optimizer.level} shards the optimizer state "
                     f"over optimizer.axis {axes}, but {off} {'is' if len(off) == 1 else 'are'} not among the batch "
                     f"axes {batch}, over which the per-device gradients are reduced to their shards; set "
                     f"optimizer.axis to {batch[0] if len(batch) == 1 else batch!r}, or use mode='semi_auto'")


def _check_stage_layers(config: ParallelConfig, model, params: list, loss: PipelineLoss, who: str) -> None:
    """Each pipeline stage holds its own layers: the stacked blocks' leading (layer) axis must
    map to the pipe axis (a rule for its logical name, or a ``parameter_strategy`` entry for the
    parameter), or every stage would hold and update every layer, silently."""
    pipe = config.pipeline
    blocks = {id(v) for v in jax.tree.leaves(nnx.state(loss.blocks(model), nnx.Param), is_leaf=is_variable)}
    rules = dict(config.rules or {})
    for path, var in params:
        if id(var) not in blocks or matching_patterns(path_str(path), config.parameter_strategy or {}):
            continue
        names = logical_names(var)
        name = names[0] if names else None
        rule = rules.get(name) if name is not None else None
        if pipe.axis in ((rule,) if isinstance(rule, str) else tuple(rule or ())):
            continue
        fix = (f"add the rule {name!r}: {pipe.axis!r} (the logical name of that axis)" if name is not None else
               f"name the stacked axis (nnx.vmap(..., transform_metadata={{nnx.PARTITION_NAME: 'layers'}})) and "
               f"add the rule 'layers': {pipe.axis!r}")
        raise ValueError(f"{who}: pipeline.stages={pipe.stages} gives each stage its own layers, but the leading "
                         f"(layer) axis of the pipeline blocks' parameter '{path_str(path)}' (logical names "
                         f"{names}) is not split over mesh axis {pipe.axis!r} by rules={rules}, so every stage would "
                         f"hold every layer; {fix}, or give the parameter a parameter_strategy entry")


def _check_hybrid_params(config: ParallelConfig, params: list, sizes: dict[str, int], who: str) -> None:
    """``mode="hybrid"`` runs ``loss_fn`` per device and averages its value over the batch axes.
    A parameter whose compute layout splits it over a batch axis reaches each device's loss as a
    shard, and that mean hides the partial results (the loss then differs across no axis the
    step could check): the model would train silently wrong, or fail inside JAX. ZeRO is how
    hybrid mode splits parameters over the batch axes: stored split, gathered to the compute
    layout inside the loss, so only the compute layout (the rules) is checked here."""
    if config.mode != "hybrid":
        return
    axes = batch_axes(config, sizes)
    split = tuple(a for a in axes if sizes[a] != 1)      # a size-1 axis splits nothing
    for path, var in params:
        key = path_str(path)
        spec = variable_spec(config, sizes, key, var)
        on = tuple(a for a in split if a in {b for entry in spec for b in spec_axes(entry)})
        if not on:
            continue
        patterns = matching_patterns(key, config.parameter_strategy)
        if patterns:
            source = f"parameter_strategy[{patterns[0]!r}]={config.parameter_strategy[patterns[0]]!r}"
            fix = ("give it a strategy over a mesh axis that is not a batch axis and write the collectives "
                   "over it in the model (jax.lax.psum, or the jaxpar.ops operators)")
        else:
            rules = dict(config.rules)
            names = [n for n in logical_names(var) or () if n in rules and set(on) & set(spec_axes(rules[n]))]
            source = ("rules {" + ", ".join(f"{n!r}: {rules[n]!r}" for n in names) + "}" if names else
                      f"its logical names {logical_names(var)}, which name the mesh axes themselves")
            fix = (f"map {' and '.join(repr(n) for n in names or logical_names(var))} to a mesh axis that is not a "
                   "batch axis and write the collectives over it in the model (jax.lax.psum, or the jaxpar.ops "
                   "operators)")
        shape = tuple(np.shape(var.get_value()))
        sized = "{" + ", ".join(f"{a!r}: {sizes[a]}" for a in axes) + "}"
        raise ValueError(
            f"{who}: mode='hybrid' runs loss_fn per device and averages it over the batch axes {sized}, but "
            f"parameter '{key}' {shape} has the compute spec {spec} from {source}, which splits it over the batch "
            f"axes {on}: each device's loss would see a shard of it, and the mean over {on} would hide the partial "
            "results. Use mode='semi_auto' (XLA inserts the collectives); or drop that split and set "
            f"optimizer={{'level': 3}} (ZeRO-3 stores the parameters split over {on} and gathers them where the loss "
            f"uses them); or {fix}")


def _mesh_sizes(config: ParallelConfig, mesh: Any = None) -> dict[str, int]:
    """``config.mesh`` with a ``-1`` taken as the rest of the devices of ``mesh``, the mesh the
    plan is for (without one, of ``jax.device_count()``, as ``jaxpar.make_mesh(config)``
    resolves it). Where it cannot be (a mesh for other devices), the ``-1`` axis counts as
    split (size 2): only which axes a spec names is read from it."""
    devices = jax.device_count() if mesh is None else math.prod(mesh_sizes(mesh).values())
    try:
        return resolve_axes(config.mesh, devices)
    except ValueError:
        return {a: 2 if s == -1 else s for a, s in config.mesh.items()}


def _check_param_dtypes(params: list, who: str) -> None:
    """Every ``nnx.Param`` (``params``: ``(path, Variable)`` pairs) is differentiated, so each
    must hold floating-point values."""
    for path, var in params:
        dtype = getattr(var.get_value() if is_variable(var) else var, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"{who}: parameter '{path_str(path)}' has dtype {dtype}, but every nnx.Param is "
                            "differentiated and gradients need floating-point values; keep integer or boolean "
                            "state in an nnx.Variable (not nnx.Param), or give the parameter a float dtype")


def _check_platform(config: ParallelConfig, platform: str) -> None:
    """Combinations one backend cannot compile (refused before it aborts the process) or cannot
    gain from."""
    if config.precision is not None and config.precision.matmuls == "fp8":
        why = fp8_unavailable(platform)
        if why:
            raise ValueError(f"ParallelConfig: precision {config.precision.label!r} runs the matmuls in fp8, but "
                             f"{why}: there it would only lose precision; use precision='bf16'")
    half = config.precision is not None and config.precision.compute != "float32"
    if half and config.pipeline.stages > 1 and platform == "cpu":
        raise ValueError(
            f"ParallelConfig: pipeline.stages={config.pipeline.stages} with precision compute="
            f"{config.precision.compute!r} is not supported on CPU (XLA:CPU aborts while widening the "
            "pipeline's half-precision collectives to fp32); on CPU use precision='fp32' or None with the "
            "pipeline, or precision without the pipeline")


def _check_context(model, config, loss_fn, who: str, loss_known: bool) -> None:
    """A context axis needs attention that masks by position (batches are reordered and split),
    and refuses the techniques it does not compose with, naming both."""
    if config.context is None:
        return
    if loss_known and config.pipeline.stages > 1 and not (isinstance(loss_fn, PipelineLoss)
                                                         and loss_fn.block_call is not None):
        raise ValueError(f"{who}: context={config.context} with pipeline.stages={config.pipeline.stages} needs a "
                         f"PipelineLoss with block_call= (got {type(loss_fn).__name__}): without it the stages pass "
                         "only the hidden state, not the positions context attention masks by; use the GPT / Llama "
                         "pipeline_loss(), give block_call=lambda model: lambda block, h, batch: ..., or drop one")
    if not isinstance(getattr(model, "constrain", None), ContextParallel):
        raise ValueError(
            f"{who}: ParallelConfig.context={config.context} reorders and splits the sequence, but the model's "
            "constrain is not a jaxpar.ops.ContextParallel, so its attention would mask by index; build the model "
            "with constrain=jaxpar.nn.model_constraint(mesh, config) (a ContextParallel of the config's activation "
            "rules)")


def _moe_path(model) -> str | None:
    """The path of the model's first ``jaxpar.nn.MoE`` layer, or None without one."""
    return next(("/".join(str(p) for p in path) for path, node in nnx.iter_graph(model) if isinstance(node, MoE)),
                None)


def _check_expert_routing(model, config: ParallelConfig, sizes: dict[str, int], who: str) -> None:
    """An MoE layer routes the tokens its model's ``constrain`` says each device holds (its
    mesh and ``"batch"`` rule). A model that holds its constrain (jaxpar's GPT and Llama) with
    none of those, while the batch is split over several devices, would have every device
    route the whole batch through the experts: refused, naming `jaxpar.nn.model_constraint`.
    (Under a ``dataset_strategy``, ``mode="auto"`` or ``"hybrid"`` the batch is placed
    otherwise and the constraint's rules are the user's.)"""
    if config.mode in ("hybrid", "auto") or config.dataset_strategy is not None or not hasattr(model, "constrain"):
        return
    constrain = model.constrain
    if getattr(constrain, "mesh", None) is not None and "batch" in dict(getattr(constrain, "rules", ()) or ()):
        return
    split = {a: sizes[a] for a in batch_axes(config, sizes) if sizes[a] > 1}
    if not split:
        return
    where = _moe_path(model)
    if where is None:
        return
    held = "no mesh" if getattr(constrain, "mesh", None) is None else "no 'batch' rule"
    raise ValueError(f"{who}: the mixture-of-experts layer at {where!r} routes the tokens its model's constrain "
                     f"says each device holds, but that constrain has {held}, while the batch is split over "
                     f"{split}: every device would route the whole batch through the experts; build the model "
                     "with constrain=jaxpar.nn.model_constraint(mesh, config) (the config's rules with the batch "
                     "axes), or give the constraint a 'batch' rule")


def _check_experts(model, config, loss_fn, who: str, loss_known: bool) -> None:
    """A ``PipelineLoss`` carries an MoE layer's auxiliary loss (``aux_loss``) out of each stage;
    a ``StagedLoss`` hands on only the hidden state, so the loss recorded on the layer during
    the forward would never reach the last stage's loss."""
    piped = config.pipeline.stages > 1
    if not piped and config.mode not in ("hybrid", "auto"):
        return
    where = _moe_path(model)
    if where is None:
        return
    if piped and loss_known and not (isinstance(loss_fn, PipelineLoss) and loss_fn.aux_loss is not None):
        raise ValueError(f"{who}: pipeline.stages={config.pipeline.stages} with a mixture-of-experts model "
                         f"(jaxpar.nn.MoE at {where!r}) needs a PipelineLoss with aux_loss= (e.g. the GPT / Llama "
                         f"pipeline_loss(), or aux_loss=jaxpar.nn.moe_aux_loss), got {type(loss_fn).__name__}: the "
                         "experts' auxiliary losses would not reach the last stage's loss")
    if piped and loss_known and loss_fn.block_call is None and "expert" in dict(config.rules or {}):
        raise ValueError(f"{who}: pipeline.stages={config.pipeline.stages} with a mixture-of-experts model "
                         f"(jaxpar.nn.MoE at {where!r}) and rules['expert']={dict(config.rules)['expert']!r} needs a "
                         "PipelineLoss with block_call= (the GPT / Llama pipeline_loss() set it): without it the "
                         "stages run block(h), whose experts do not see the model's constraint and would all run "
                         "where the tokens are, with no expert parallelism")
    if config.mode not in ("hybrid", "auto"):
        return
    why = ("per-device code would run every expert on every device, with no expert parallelism"
           if config.mode == "hybrid" else "the strategy search does not read the expert dispatch's scatters")
    raise ValueError(f"{who}: mode={config.mode!r} with a mixture-of-experts model (jaxpar.nn.MoE at {where!r}) is "
                     f"not supported ({why}); use mode='semi_auto' with an 'expert' rule, e.g. "
                     "rules={'batch': 'data', 'expert': 'data'} (jaxpar.auto.search_job prices expert parallel "
                     "and returns such a config)")


def check_rules_used(config: ParallelConfig, model: nnx.Module, loss_fn: Any = None, batch: Any = None) -> None:
    """Refuse rules that nothing consults, as the Trainer does when it traces its step: the
    names of the model's parameters (and the ``parameter_strategy`` / ``dataset_strategy``
    entries) first; then, only when some rule names none of them and ``loss_fn`` and ``batch``
    (``ShapeDtypeStruct`` leaves) are given, the names its activation constraints look up in an
    abstract trace of ``loss_fn(model, batch)``. Without them a rule the parameters do not use
    may still be an activation's, and waits for the step's trace.

    >>> config = ParallelConfig(mesh={"data": 8}, rules={"mlpp": "data"})
    >>> check_rules_used(config, model, loss_fn, batch)                     # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: ParallelConfig.rules: 'mlpp' -> 'data' (did you mean 'mlp'?) names a logical axis that ...
    """
    from jaxpar.nn.specs import check_rules_used as refuse_unused, declared_names
    from jaxpar.strategy.resolve import recording_rules

    if config.allow_unused_rules or not config.rules:
        return
    used = declared_names(config, nnx.state(model))
    if set(config.rules) <= used or loss_fn is None or batch is None:
        return
    with recording_rules() as seen:
        nnx.eval_shape(lambda m, b: loss_fn(m, b), model, _shapes(batch))
    refuse_unused(config, used | seen, type(model).__name__)


def check_rules_consulted(config: ParallelConfig, model: nnx.Module, loss_fn: Any, batch: Any) -> None:
    """`check_rules_used` with the loss and a batch (what ``jaxpar plan --config`` runs, so that
    it refuses a rule typo exactly where ``jaxpar train`` would)."""
    check_rules_used(config, model, loss_fn, batch)


def _shapes(batch: Any) -> Any:
    """``jax.ShapeDtypeStruct`` per leaf of ``batch`` (arrays or shapes)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else
                                                       np.result_type(x)), batch)


def check_plan_args(config: Any, mesh: Any, model_or_state: Any, tx: Any, who: str = "make_train_plan") -> None:
    """The arguments of `make_train_plan`, refused by name with what would be valid.

    A mesh given as ``{axis: size}`` is read for its sizes only, so it is checked here as
    ``ParallelConfig`` checks its own: each size a positive int (a plan needs the sizes a ``-1``
    resolves to), the config's axes present with the config's sizes.

    >>> check_plan_args(ParallelConfig(mesh={"data": 8}), {"data": 2.5}, None, None)
    Traceback (most recent call last):
    ...
    ValueError: make_train_plan: mesh={'data': 2.5}: axis 'data' has size 2.5; ...
    """
    import optax

    from jaxpar.strategy.resolve import mesh_sizes

    if not isinstance(config, ParallelConfig):
        raise TypeError(f"{who}: config must be a jaxpar.ParallelConfig, got {type(config).__name__}")
    if isinstance(mesh, Mapping):
        for axis, size in mesh.items():
            if not isinstance(size, (int, np.integer)) or isinstance(size, (bool, np.bool_)) or size < 1:
                raise ValueError(f"{who}: mesh={dict(mesh)!r}: axis {axis!r} has size {size!r}; give every axis a "
                                 "positive int size (a plan needs concrete sizes: a -1 in config.mesh resolves with "
                                 "jaxpar.mesh.resolve_axes(config.mesh, device_count)), or pass the Mesh itself")
    sizes = mesh_sizes(mesh)
    for axis, size in config.mesh.items():
        if axis not in sizes or (size != -1 and sizes[axis] != size):
            raise ValueError(f"{who}: config.mesh {dict(config.mesh)} does not match the mesh {sizes}; plan on "
                             "jaxpar.make_mesh(config) (or its sizes)")
    if not isinstance(model_or_state, nnx.Module) and not (
            isinstance(model_or_state, (tuple, list)) and len(model_or_state) == 2):
        raise TypeError(f"{who}: model_or_state must be a flax.nnx.Module (nnx.eval_shape(make_model) works) or "
                        f"its (params, rest) states, got {type(model_or_state).__name__}")
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"{who}: tx must be an optax.GradientTransformation (optax.adamw(1e-3), optax.chain(...)), "
                        f"got {type(tx).__name__}")

