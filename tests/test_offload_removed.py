"""Host offload was removed (issue #42: no mode paid on an H200). Every way to ask for it still
fails for a release, naming why (the 1B figures) and what lowers device memory instead:
``Placement(offload=...)``, the Trainer's former ``offload=``, ``ParallelConfig(remat="offload_dots")``,
a job file's ``offload`` key, the removed modules and names, and the 0.1.0 fields and keywords."""

import importlib
import json
import re

import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cli import main
from jaxpar.job import JobConfig

# what every refusal says: removed, why (the 1B figures on an H200) and what to use instead
WHY = (r"host offload was removed in this release because it did not pay on a GPU \(one H200, Llama-1B shape, "
       r"8 x 2048 tokens: offload='opt_state' made the step 2\.17x slower, offload='params' 1\.42x with no lower "
       r"peak, remat='offload_dots' 1\.88x\); to lower device memory use ZeRO-3 parameter sharding "
       r"\(ParallelConfig\(optimizer=\{'level': 3\}\)\), recompute .*remat=.*gradient accumulation "
       r"\(ParallelConfig\(grad_accum=4\)\) or the model's chunked loss \(LlamaConfig\(loss_chunks=8\).*"
       r"\(see docs/offload\.md and CHANGELOG\.md\)")


def _model():
    return nnx.Linear(4, 4, rngs=nnx.Rngs(0))


def _loss(model, batch):
    return (model(batch["x"]) ** 2).mean()


@pytest.mark.parametrize("value", ["opt_state", "params", ("params", "opt_state"), ["opt_state"]])
def test_placement_refuses_any_offload(value):
    with pytest.raises(ValueError, match=re.escape(f"Placement(offload={value!r}): ") + WHY):
        jaxpar.Placement(offload=value)


@pytest.mark.parametrize("value", [(), [], None])
def test_an_empty_offload_is_ignored_with_a_warning(value):
    with pytest.warns(DeprecationWarning, match=re.escape(f"Placement(offload={value!r}) asks for nothing and is "
                                                          "ignored: ") + WHY):
        assert jaxpar.Placement(offload=value, donate=False) == jaxpar.Placement(donate=False)


def test_the_trainer_s_former_offload_keyword_is_refused_not_folded():
    config = jaxpar.ParallelConfig(mesh={"data": 8})
    mesh = jaxpar.make_mesh(config)
    with pytest.raises(ValueError, match=re.escape("Trainer(offload=('opt_state',)): ") + WHY):
        jaxpar.Trainer(_model(), optax.sgd(0.1), _loss, config, mesh, offload=("opt_state",))
    with pytest.raises(AttributeError, match=r"Trainer\.offload was removed after jaxpar 0\.1\.0: " + WHY):
        jaxpar.Trainer.offload  # noqa: B018


def test_the_offload_dots_policy_is_refused_wherever_a_policy_is_named():
    assert "offload_dots" not in jaxpar.config.REMAT_POLICIES
    from jaxpar.remat import POLICY_NAMES

    assert "offload_dots" not in POLICY_NAMES
    with pytest.raises(ValueError, match=re.escape("ParallelConfig(remat='offload_dots'): ") + WHY):
        jaxpar.ParallelConfig(remat="offload_dots")
    with pytest.raises(ValueError, match=re.escape("ParallelConfig(remat='offload_dots'): ") + WHY):
        jaxpar.ParallelConfig.from_dict({"mesh": {"data": 8}, "remat": "offload_dots"})
    with pytest.raises(ValueError, match=re.escape("jaxpar.remat policy 'offload_dots': ") + WHY):
        jaxpar.remat(lambda x: x, "offload_dots")
    from jaxpar.auto import JobSearchSpace

    with pytest.raises(ValueError, match=re.escape("JobSearchSpace: remat has 'offload_dots': ") + WHY):
        JobSearchSpace(devices=8, memory_budget=1e9, remat=("none", "offload_dots"))


@pytest.mark.parametrize("d, overrides, key", [
    ({"train": {"steps": 2, "offload": ["params", "opt_state"]}}, [], "train.offload"),
    ({"train": {"offload": []}}, [], "train.offload"),             # even none: the key is gone
    ({"parallel": {"offload": "opt_state"}}, [], "parallel.offload"),
    ({}, ["--train.offload", "[params]"], "train.offload"),
])
def test_a_job_with_an_offload_key_is_refused_when_loaded(d, overrides, key):
    with pytest.raises(ValueError, match=re.escape(f"job config key '{key}' (delete it): ") + WHY):
        JobConfig.from_dict(d, overrides)


def test_the_command_refuses_a_job_file_with_offload_in_one_line(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("model: {name: llama, size: tiny}\ntrain: {steps: 2, offload: [opt_state]}\n")
    assert main(["plan", "--config", str(job)]) == 2
    err = capsys.readouterr().err
    assert re.search(re.escape("job config key 'train.offload' (delete it): ") + WHY, err), err


@pytest.mark.parametrize("module", ["jaxpar.optim.offload", "jaxpar.nn.stream"])
def test_the_removed_modules_say_why_and_what_to_use(module):
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"module {module} was removed after jaxpar 0.1.0: ") + WHY):
        importlib.import_module(module)


@pytest.mark.parametrize("name", ["on_host", "to_device"])
def test_the_removed_optim_names_say_why_and_what_to_use(name):
    with pytest.raises(AttributeError, match=re.escape(f"jaxpar.optim.{name} was removed after jaxpar 0.1.0: ") + WHY):
        getattr(jaxpar.optim, name)
    with pytest.raises(ImportError, match=WHY):
        exec(f"from jaxpar.optim import {name}", {})
    assert name not in jaxpar.optim.__all__


def test_the_plan_s_offload_is_refused_and_a_0_1_0_plan_file_still_loads(tmp_path):
    config = jaxpar.ParallelConfig(mesh={"data": 8})
    model, tx = nnx.eval_shape(_model), optax.adamw(1e-3)
    with pytest.raises(ValueError, match=re.escape("make_train_plan(offload='opt_state'): ") + WHY):
        jaxpar.make_train_plan(config, {"data": 8}, model, tx, offload="opt_state")
    plan = jaxpar.make_train_plan(config, {"data": 8}, model, tx)
    with pytest.raises(AttributeError, match=r"TrainPlan\.offload was removed after jaxpar 0\.1\.0: " + WHY):
        plan.offload  # noqa: B018
    fields = {f: getattr(plan, f) for f in ("config", "mesh", "source", "params", "stored", "grads", "update",
                                            "opt_state", "rest")}
    with pytest.raises(ValueError, match=re.escape("TrainPlan(offload=('params',)): ") + WHY):
        jaxpar.TrainPlan(**fields, offload=("params",))
    # 0.1.0's default, which asked for nothing: ignored with a warning through the next release
    with pytest.warns(DeprecationWarning, match=re.escape("TrainPlan(offload=()) asks for nothing and is ignored")):
        assert jaxpar.TrainPlan(**fields, offload=()) == jaxpar.TrainPlan(**fields)
    # 0.1.0 wrote "offload": [] into every plan file: it loads; one that offloaded is refused
    saved = {**plan.to_dict(), "offload": []}
    (tmp_path / "plan.json").write_text(json.dumps(saved))
    assert jaxpar.TrainPlan.from_json(str(tmp_path / "plan.json")) == plan
    with pytest.raises(ValueError, match=re.escape("train plan with offload=['opt_state']: ") + WHY):
        jaxpar.TrainPlan.from_dict({**saved, "offload": ["opt_state"]})
    from jaxpar.auto import plan_for, plan_training

    mesh = jaxpar.make_mesh(config)
    with pytest.raises(ValueError, match=re.escape("plan_for(offload=('params',)): ") + WHY):
        plan_for(model, tx, _loss, config, mesh, offload=("params",))
    with pytest.raises(ValueError, match=re.escape("plan_training(offload=('params',)): ") + WHY):
        plan_training(model, _loss, None, config, mesh, tx, offload=("params",))


def test_the_memory_estimate_has_no_host_part():
    from jaxpar.report import MemoryEstimate, estimate_memory

    plan = jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 8}), {"data": 8}, nnx.eval_shape(_model),
                                  optax.adamw(1e-3))
    estimate = estimate_memory(plan, optax.adamw(1e-3))
    assert "host" not in estimate.summary() and estimate.params > 0
    with pytest.raises(AttributeError, match=r"MemoryEstimate\.host was removed after jaxpar 0\.1\.0: " + WHY):
        estimate.host  # noqa: B018
    with pytest.raises(ValueError, match=re.escape("MemoryEstimate(host={}): ") + WHY):
        MemoryEstimate(params=1, grads=1, opt_state=1, activations=None, zero_level=0, dtypes={}, host={})


def test_a_saved_config_with_the_removed_policy_still_loads_as_full_recompute():
    """Checkpoint metadata, strategy files and plan files saved with remat="offload_dots" load
    (the policy does not change where anything lives), read as remat="full" with a warning;
    a config a user writes is still refused."""
    from jaxpar.checkpoint.strategy import strategy_config

    saved = jaxpar.ParallelConfig(mesh={"data": 8}).to_dict() | {"remat": "offload_dots"}
    with pytest.warns(UserWarning, match=r"remat='offload_dots', which was removed .*read as remat='full'"):
        assert jaxpar.ParallelConfig.from_saved(saved).remat == "full"
    with pytest.warns(UserWarning, match="read as remat='full'"):
        assert strategy_config({"config": saved, "leaves": {}}).remat == "full"
    with pytest.raises(ValueError, match="host offload was removed"):
        jaxpar.ParallelConfig.from_dict(saved)


def test_jaxpar_plan_names_the_removed_policy_in_its_options(capsys):
    assert main(["plan", "--remat-options", "none,offload_dots"]) == 2
    err = capsys.readouterr().err
    assert "--remat-options offload_dots" in err and "host offload was removed" in err and "Traceback" not in err
