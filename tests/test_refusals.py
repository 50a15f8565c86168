"""Refused combinations are decided once: what the config alone rules out is refused when the
``ParallelConfig`` is built, and every combination the ``Trainer`` refuses for a model, a loss or
a backend is refused by ``make_train_plan`` too, with the same message (only who says it differs).
"""

import dataclasses

import jax
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.nn.moe import MoEConfig
from jaxpar.plan import make_train_plan

GPT_CFG = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=2, scan_layers=True)
MOE_CFG = dataclasses.replace(GPT_CFG, moe=MoEConfig(experts=4, top_k=1))
PIPE = {"stages": 2, "microbatches": 2}


def _without(loss, **parts):
    return dataclasses.replace(loss, **parts)


def _context_model(config, mesh):
    constrain = jaxpar.ops.ContextParallel(jaxpar.LogicalConstraint(mesh, config.rules), mesh, config)
    return GPT(GPT_CFG, rngs=nnx.Rngs(0), constrain=constrain)


class CountingLinear(nnx.Module):
    """A linear layer that keeps a step counter as an nnx.Param by mistake (an integer parameter)."""

    def __init__(self):
        self.kernel = nnx.Param(jax.numpy.ones((16, 16)))
        self.calls = nnx.Param(jax.numpy.zeros((), jax.numpy.int32))

    def __call__(self, x):
        return x @ self.kernel


# name: (config fields, model builder, loss, what the message names)
CASES = {
    "integer-parameter": (dict(mesh={"data": 8}), lambda c, m: CountingLinear(),
                          lambda model, batch: (model(batch["x"]) ** 2).mean(),
                          r"parameter 'calls' has dtype int32.*nnx\.Variable \(not nnx\.Param\)"),
    "pipeline-plain-loss": (dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                 pipeline=PIPE),
                            lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), loss_fn, r"pipeline\.stages=2.*PipelineLoss"),
    "bf16-pipeline-cpu": (dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"}, pipeline=PIPE,
                               precision="bf16"),
                          lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), pipeline_loss(),
                          r"pipeline\.stages=2 with precision compute='bfloat16'.*CPU"),
    "context-without-context-attention": (dict(mesh={"data": 2, "context": 4}, rules={"batch": "data"},
                                               context={"axis": "context"}),
                                          lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), loss_fn,
                                          r"context=.*ContextParallel"),
    "context-pipeline-without-block-call": (dict(mesh={"pipe": 2, "data": 2, "context": 2},
                                                 rules={"layers": "pipe", "batch": "data"}, pipeline=PIPE,
                                                 context={"axis": "context"}),
                                            _context_model, _without(pipeline_loss(), block_call=None),
                                            r"context=.*pipeline\.stages=2.*block_call"),
    "moe-pipeline-without-aux-loss": (dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                           pipeline=PIPE),
                                      lambda c, m: GPT(MOE_CFG, rngs=nnx.Rngs(0)), _without(pipeline_loss(), aux_loss=None),
                                      r"pipeline\.stages=2 with a mixture-of-experts.*aux_loss"),
    "moe-pipeline-expert-rule-without-block-call": (
        dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data", "expert": "data"}, pipeline=PIPE),
        lambda c, m: GPT(MOE_CFG, rngs=nnx.Rngs(0)), _without(pipeline_loss(), block_call=None),
        r"pipeline\.stages=2 with a mixture-of-experts.*block_call"),
    "moe-hybrid": (dict(mesh={"data": 8}, mode="hybrid"), lambda c, m: GPT(MOE_CFG, rngs=nnx.Rngs(0)), loss_fn,
                   r"mode='hybrid' with a mixture-of-experts"),
    "moe-routing-without-the-batch": (  # the default config has no rules: LogicalConstraint(mesh, {}) names no batch
        dict(mesh={"data": 8}),
        lambda c, m: GPT(MOE_CFG, rngs=nnx.Rngs(0), constrain=jaxpar.LogicalConstraint(m, c.rules)), loss_fn,
        r"the mixture-of-experts layer at '.*' routes the tokens its model's constrain says each device holds, "
        r"but that constrain has no 'batch' rule, while the batch is split over \{'data': 8\}.*"
        r"constrain=jaxpar.nn.model_constraint\(mesh, config\)"),
    "pipeline-layers-not-split-over-the-stages": (
        dict(mesh={"pipe": 2, "data": 4}, rules={"batch": "data"}, pipeline=PIPE),
        lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), pipeline_loss(),
        r"pipeline\.stages=2 gives each stage its own layers, but the leading \(layer\) axis of the pipeline blocks' "
        r"parameter 'blocks/.*' \(logical names \('layers', .*\)\) is not split over mesh axis 'pipe'.*add the rule "
        r"'layers': 'pipe'"),
    "pipeline-layers-not-divisible": (dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                           pipeline=PIPE),
                                      lambda c, m: GPT(dataclasses.replace(GPT_CFG, layers=3), rngs=nnx.Rngs(0)),
                                      pipeline_loss(), r"3 layers, not divisible by stages × chunks per stage = 2 × 1"),
    "hybrid-parameter-split-over-the-batch-axis": (
        dict(mesh={"data": 8}, mode="hybrid", rules={"mlp": "data"}), lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)),
        loss_fn, r"mode='hybrid' runs loss_fn per device and averages it over the batch axes \{'data': 8\}, but "
                 r"parameter 'blocks/mlp/down' \(2, 64, 32\) has the compute spec P\(None, 'data', None\) from "
                 r"rules \{'mlp': 'data'\}.*"
                 r"mode='semi_auto'.*optimizer=\{'level': 3\}.*map 'mlp' to a mesh axis that is not a batch axis"),
}


def _host_rows():
    from jaxpar.ps import HostEmbedding, HostRows, RowOptimizer

    return HostRows(HostEmbedding("items", 10, 4, RowOptimizer(kind="sgd", learning_rate=1.0), storage="callback"))


TOKENS = jax.ShapeDtypeStruct((8, GPT_CFG.seq_len), jax.numpy.int32)

# Refusals the Trainer once made only when its step was traced (or that make_train_plan could not
# make for want of an argument): name -> (fields, model builder, loss, what the message names,
# the Trainer's and make_train_plan's further arguments: rows (a builder), example_batch (the
# Trainer lowers its step on it)).
CASES |= {
    "pipeline-stages-against-the-pipe-axis": (
        dict(mesh={"pipe": 4, "data": 2}, rules={"layers": "pipe", "batch": "data"}, pipeline=PIPE),
        lambda c, m: GPT(dataclasses.replace(GPT_CFG, layers=4), rngs=nnx.Rngs(0)), pipeline_loss(),
        r"pipeline\.stages=2 but mesh axis 'pipe' has size 4 \(mesh \{'pipe': 4, 'data': 2\}\).*make them equal "
        r"\(pipeline\.stages=4, or mesh \{'pipe': 2, \.\.\.\}\)", {}),
    "hybrid-optimizer-axis-not-a-batch-axis": (
        dict(mesh={"data": 4, "model": 2}, mode="hybrid", optimizer={"level": 1, "axis": "model"}),
        lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), loss_fn,
        r"mode='hybrid' with optimizer\.level=1 shards the optimizer state over optimizer\.axis \('model',\), but "
        r"\['model'\] is not among the batch axes \('data',\).*set optimizer\.axis to 'data', or use "
        r"mode='semi_auto'", {}),
    "rule-nothing-consults": (
        dict(mesh={"data": 8}, rules={"batch": "data", "mlpp": "data"}), lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)),
        loss_fn, r"ParallelConfig\.rules: 'mlpp' -> 'data' \(did you mean 'mlp'\?\) names a logical axis that no "
                 r"parameter, activation constraint or batch of GPT uses",
        dict(example_batch={"inputs": TOKENS, "targets": TOKENS})),
    "row-source-with-a-pipeline": (
        dict(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"}, pipeline=PIPE),
        lambda c, m: GPT(GPT_CFG, rngs=nnx.Rngs(0)), pipeline_loss(),
        r"rows= with pipeline\.stages=2: the pipeline's stages take no pulled rows", dict(rows=_host_rows)),
}


@pytest.mark.parametrize("name", CASES)
def test_make_train_plan_refuses_what_the_trainer_refuses(name):
    fields, build, loss, names, *more = CASES[name]
    args = dict(more[0]) if more else {}
    batch = args.pop("example_batch", None)
    config = jaxpar.ParallelConfig(**fields)
    mesh = jaxpar.make_mesh(config)
    model = build(config, mesh)
    with pytest.raises((ValueError, TypeError), match=names) as by_trainer:
        trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss, config, mesh,
                                 rows=args["rows"]() if "rows" in args else None)
        if batch is not None:      # rules nothing consults: refused where the step is traced
            trainer.lower(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), batch))
    with pytest.raises(by_trainer.type, match=names) as by_plan:
        make_train_plan(config, mesh, nnx.eval_shape(lambda: build(config, mesh)), optax.adamw(1e-3), loss_fn=loss,
                        rows=args["rows"]() if "rows" in args else None, example_batch=batch)
    assert str(by_trainer.value).removeprefix("Trainer") == str(by_plan.value).removeprefix("make_train_plan")


CONFIG_ONLY = {
    "pipeline-hybrid": (dict(mode="hybrid"), r"pipeline\.stages > 1 with mode='hybrid'"),
    "pipeline-auto": (dict(mode="auto"), r"pipeline\.stages > 1 with mode='auto'"),
}


@pytest.mark.parametrize("name", CONFIG_ONLY)
def test_pairs_the_config_rules_out_are_refused_when_it_is_built(name):
    fields, names = CONFIG_ONLY[name]
    with pytest.raises(ValueError, match=names):
        jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, pipeline=PIPE, **fields)


@pytest.mark.parametrize("mode", ["hybrid", "auto"])
def test_context_with_hybrid_or_auto_is_refused_when_the_config_is_built(mode):
    with pytest.raises(ValueError, match=rf"context=.*mode='{mode}'"):
        jaxpar.ParallelConfig(mesh={"data": 2, "context": 4}, mode=mode, context={"axis": "context"})


def test_without_a_loss_the_plan_still_refuses_what_the_model_decides():
    config = jaxpar.ParallelConfig(mesh={"data": 2, "context": 4}, rules={"batch": "data"}, context={"axis": "context"})
    model = nnx.eval_shape(lambda: GPT(GPT_CFG, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="make_train_plan: ParallelConfig.context=.*ContextParallel"):
        make_train_plan(config, jaxpar.make_mesh(config), model, optax.adamw(1e-3))
    assert jax.device_count() == 8


def test_a_minus_one_axis_is_judged_on_the_mesh_the_plan_is_for():
    """mesh={"data": -1} takes the rest of the devices of the mesh given, not jax.device_count():
    an MoE GPT whose constrain names no batch routes correctly on a one-device mesh (nothing is
    split) and is refused on two devices naming the mesh's size, though 8 devices exist."""
    from jaxpar.plan.checks import check_combination

    config = jaxpar.ParallelConfig(mesh={"data": -1})
    model = nnx.eval_shape(lambda: GPT(MOE_CFG, rngs=nnx.Rngs(0)))
    assert jax.device_count() == 8
    check_combination(config, model, loss_fn, mesh={"data": 1})
    check_combination(config, model, loss_fn, mesh=jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]))
    make_train_plan(config, {"data": 1}, model, optax.adamw(1e-3), loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"has no mesh, while the batch is split over \{'data': 2\}"):
        check_combination(config, model, loss_fn, mesh={"data": 2})
    with pytest.raises(ValueError, match=r"split over \{'data': 8\}"):    # no mesh: this process's devices
        check_combination(config, model, loss_fn)
    # the Trainer judges it on its mesh too: one device, nothing split, nothing refused
    one = jaxpar.make_mesh(config, jax.devices()[:1])
    jaxpar.Trainer(GPT(MOE_CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config, one)


def test_the_plan_carries_the_pipeline_schedule():
    """The schedule is built once per pipeline setting and carried by the plan; the step runs
    the plan's (not one re-derived when it is traced)."""
    from jaxpar.pipeline.schedules import build

    config = jaxpar.ParallelConfig(mesh={"pipe": 2, "data": 4}, rules={"layers": "pipe", "batch": "data"},
                                   pipeline=PIPE)
    mesh = jaxpar.make_mesh(config)
    model = nnx.eval_shape(lambda: GPT(GPT_CFG, rngs=nnx.Rngs(0)))
    plan = make_train_plan(config, mesh, model, optax.adamw(1e-3), loss_fn=pipeline_loss())
    pipe = config.pipeline
    assert plan.schedule.ticks == build(pipe.schedule, pipe.stages, pipe.microbatches).ticks
    assert make_train_plan(config, mesh, model, optax.adamw(1e-3), loss_fn=pipeline_loss()).schedule is plan.schedule
    flat = make_train_plan(jaxpar.ParallelConfig(mesh={"data": 8}), jaxpar.make_mesh(jaxpar.ParallelConfig(
        mesh={"data": 8})), model, optax.adamw(1e-3))
    assert flat.schedule is None


def test_hybrid_mode_plans_parameters_split_over_data_only_where_zero_stores_them():
    """In mode='hybrid' the loss runs per device and is averaged over the batch axes, so a
    compute layout over a batch axis is refused (above, and for a parameter_strategy entry
    here); ZeRO-3 stores parameters split over 'data' and gathers them in the loss, so it is
    planned, as are rules on a non-batch axis (the model's own collectives) and a size-1 data axis."""
    model = nnx.eval_shape(lambda: GPT(GPT_CFG, rngs=nnx.Rngs(0)))
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", parameter_strategy={"*/mlp/up": (1, 1, 8)})
    with pytest.raises(ValueError, match=r"parameter 'blocks/mlp/up' \(2, 32, 64\) has the compute spec "
                                         r"P\(None, None, 'data'\) from parameter_strategy\['\*/mlp/up'\]"):
        make_train_plan(config, {"data": 8}, model, optax.sgd(0.1))
    zero3 = jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", optimizer={"level": 3, "threshold_kb": 0})
    plan = make_train_plan(zero3, {"data": 8}, model, optax.sgd(0.1))
    assert any("data" in str(spec) for spec in plan.stored.values())
    assert not any("data" in str(spec) for spec in plan.params.values())
    for mesh, rules in (({"data": 4, "model": 2}, {"batch": "data", "mlp": "model"}),
                        ({"data": 1, "model": 8}, {"mlp": "data"})):
        make_train_plan(jaxpar.ParallelConfig(mesh=mesh, mode="hybrid", rules=rules), mesh, model, optax.sgd(0.1))


def test_a_trainer_advises_each_batch_by_what_it_is_for():
    """grad_accum cuts a training batch, not an evaluation batch: a Trainer asks for a multiple of
    the batch devices x grad_accum to train and of the batch devices alone to evaluate."""
    from helpers import batches

    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", grad_accum=4)
    trainer = jaxpar.Trainer(GPT(GPT_CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, config,
                             jaxpar.make_mesh(config))
    twelve = batches(1, 12)[0]
    with pytest.raises(ValueError, match=r"a multiple of 8 \(e\.g\. 8 or 16\)"):
        trainer.evaluate([twelve])
    with pytest.raises(ValueError, match=r"multiple of 32 = 8 x 4"):
        trainer.step(twelve)
    assert trainer.evaluate([batches(1, 16)[0]]) > 0


def test_make_train_plan_refuses_bad_mesh_sizes_and_arguments_by_name():
    """A mesh dict bypassed ParallelConfig's own checks: sizes -4 and 2.5 planned (2.5 read as 2), an axis
    the config lacks planned; tx=None / model=None gave AttributeError / TypeError from deep inside."""
    import optax
    from flax import nnx

    from jaxpar.plan import make_train_plan

    config = jaxpar.ParallelConfig(mesh={"data": 8})
    model, tx = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0))), optax.sgd(0.1)
    for mesh, size in (({"data": -4}, "-4"), ({"data": 2.5}, "2.5"), ({"data": 0}, "0"), ({"data": True}, "True")):
        with pytest.raises(ValueError, match=rf"make_train_plan: mesh=\{{'data': {size}\}}: axis 'data' has size "
                                             rf"{size}; give every axis a positive int size"):
            make_train_plan(config, mesh, model, tx)
    for mesh in ({"dta": 8}, {"data": 4}):
        with pytest.raises(ValueError, match=r"config.mesh \{'data': 8\} does not match the mesh"):
            make_train_plan(config, mesh, model, tx)
    with pytest.raises(TypeError, match=r"make_train_plan: tx must be an optax.GradientTransformation .*got NoneType"):
        make_train_plan(config, {"data": 8}, model, None)
    with pytest.raises(TypeError, match=r"make_train_plan: model_or_state must be a flax.nnx.Module .*got NoneType"):
        make_train_plan(config, {"data": 8}, None, tx)
    with pytest.raises(TypeError, match=r"make_train_plan: config must be a jaxpar.ParallelConfig, got dict"):
        make_train_plan({"mesh": {"data": 8}}, {"data": 8}, model, tx)
    mesh = jaxpar.make_mesh(config)
    for args, what in (((model, None), "tx must be an optax.GradientTransformation"),
                       ((None, tx), "model must be a flax.nnx.Module")):
        with pytest.raises(TypeError, match=f"Trainer: {what}.*got NoneType"):
            jaxpar.Trainer(*args, lambda m, b: m(b).sum(), config, mesh)
    for mesh_value in ({"data": -4}, {"data": 2.5}):                 # ParallelConfig's own check names the field
        with pytest.raises(ValueError, match=r"ParallelConfig.mesh=.* axis 'data' has size .*; use a positive int or -1"):
            jaxpar.ParallelConfig(mesh=mesh_value)
