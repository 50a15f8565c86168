"""ParallelConfig: defaults, validation, loading from dict / YAML / overrides."""

import pytest

import jaxpar
from jaxpar.config import OptimizerConfig, PipelineConfig


def test_defaults_and_sub_configs_from_dicts():
    cfg = jaxpar.ParallelConfig(optimizer={"level": 1}, pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"},
                                mesh={"data": -1, "pipe": 2})
    assert cfg.mesh == {"data": -1, "pipe": 2}
    assert cfg.mode == "semi_auto"
    assert cfg.optimizer == OptimizerConfig(level=1)
    assert cfg.pipeline == PipelineConfig(stages=2, microbatches=4, schedule="1f1b")


def test_frozen_and_keyword_only():
    cfg = jaxpar.ParallelConfig()
    with pytest.raises(Exception):
        cfg.mode = "data"
    with pytest.raises(TypeError):
        jaxpar.ParallelConfig({"data": 8})


def test_round_trip_dict_and_yaml(tmp_path):
    cfg = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={"mlp": "model", "embed": None, "x": ("data", "model")},
                                parameter_strategy={"*/up": (1, 4)}, dataset_strategy=(2, 1), grad_accum=2, remat="full")
    assert jaxpar.ParallelConfig.from_dict(cfg.to_dict()) == cfg
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert jaxpar.ParallelConfig.from_yaml(str(path)) == cfg


def test_overrides():
    cfg = jaxpar.ParallelConfig.from_overrides(
        ["--mesh", "data=2,model=-1", "--rules", "mlp=model,heads=model,embed=None,batch=data+model",
         "--mode", "hybrid", "--optimizer.level", "2", "--grad-accum", "4"])
    assert cfg.mesh == {"data": 2, "model": -1}
    assert cfg.rules == {"mlp": "model", "heads": "model", "embed": None, "batch": ("data", "model")}
    assert cfg.mode == "hybrid" and cfg.optimizer.level == 2 and cfg.grad_accum == 4


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "fast"}, ["mode", "'fast'", "semi_auto"]),
    ({"mesh": {"data": -1, "model": -1}}, ["at most one axis may be -1"]),
    ({"mesh": {"data": 0}}, ["'data'", "size 0"]),
    ({"mesh": {}}, ["mesh", "non-empty"]),
    ({"rules": {"mlp": "tensor"}, "mesh": {"data": 8}}, ["'tensor'", "mesh axes are ['data']"]),
    ({"grad_accum": 0}, ["grad_accum", "positive"]),
    ({"remat": "sometimes"}, ["remat", "'sometimes'", "dots_saveable"]),
    ({"search": "greedy"}, ["search", "dynamic_programming"]),
    ({"optimizer": {"level": 4}}, ["optimizer.level", "4"]),
    ({"optimizer": {"lvl": 1}}, ["unknown keys", "lvl"]),
    ({"pipeline": {"stages": 2}}, ["pipe", "mesh has"]),
    ({"pipeline": {"schedule": "best"}}, ["pipeline.schedule", "1f1b"]),
    ({"mode": "data", "rules": {"mlp": "data"}, "mesh": {"data": 8}}, ["mode='data'", "semi_auto"]),
    ({"dataset_strategy": "half"}, ["dataset_strategy", "full_batch"]),
    # the batch on the axis that splits the sequence: refused naming both settings
    ({"mesh": {"data": 4, "context": 2}, "rules": {"batch": "context", "length": "context"}, "context": {}},
     ["rules['batch']='context'", "context.axis='context'", "put the batch on another axis (e.g. rules['batch']='data')"]),
    ({"mesh": {"data": 4, "context": 2}, "rules": {"batch": ("data", "context")}, "context": {}},
     ["rules['batch']=('data', 'context')", "mesh axis 'context'"]),
    ({"mesh": {"data": 8}, "context": {"axis": "data"}},
     ["default batch axis 'data'", "context.axis='data'", "add a mesh axis for the batch"]),
])
def test_bad_values_name_field_value_and_fix(kwargs, words):
    with pytest.raises(ValueError) as e:
        jaxpar.ParallelConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unknown_field_from_dict():
    with pytest.raises(ValueError, match="unknown ParallelConfig fields.*meshes"):
        jaxpar.ParallelConfig.from_dict({"meshes": {"data": 8}})


def test_the_former_name_parameter_plan_still_loads(tmp_path):
    """Files saved before the rename hold ``parameter_plan``: read as ``parameter_strategy``."""
    new = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, parameter_strategy={"*/up": (1, 4)})
    old = {("parameter_plan" if k == "parameter_strategy" else k): v for k, v in new.to_dict().items()}
    assert "parameter_strategy" not in old and old["parameter_plan"] == {"*/up": [1, 4]}
    assert jaxpar.ParallelConfig.from_dict(old) == new
    import yaml

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert jaxpar.ParallelConfig.from_yaml(str(path)) == new
    assert "parameter_plan" not in new.to_dict()     # written under the new name only
    # an override under the former name sets the field (not "both names given")
    assert jaxpar.ParallelConfig.from_overrides(["--parameter_plan", "{'*/up': [1, 4]}"],
                                                base=jaxpar.ParallelConfig(mesh={"data": 2, "model": 4})) == new


def test_both_names_of_parameter_strategy_are_refused():
    with pytest.raises(ValueError, match="both 'parameter_plan' and 'parameter_strategy'.*keep only 'parameter_strategy'"):
        jaxpar.ParallelConfig.from_dict({"parameter_plan": {"*/up": (1, 4)}, "parameter_strategy": {}})
    with pytest.raises(TypeError, match="both parameter_plan= and parameter_strategy= are given"):
        jaxpar.ParallelConfig(parameter_plan={"*/up": (1, 4)}, parameter_strategy={})


def test_from_yaml_refuses_a_key_given_twice_and_keeps_merge_keys(tmp_path):
    """PyYAML kept the last of two equal keys: 'mesh' given twice configured the second silently."""
    f = tmp_path / "p.yaml"
    f.write_text("mesh: {data: 8}\nmode: data\nmesh: {data: 2, model: 4}\n")
    with pytest.raises(ValueError, match=rf"{f}: key 'mesh' is given twice, at line 1 and at line 3"):
        jaxpar.ParallelConfig.from_yaml(str(f))
    f.write_text("mesh: {data: 2, model: 4}\nrules: {mlp: model, heads: model, mlp: data}\n")
    with pytest.raises(ValueError, match="key 'mlp' is given twice, at line 2 and at line 2"):
        jaxpar.ParallelConfig.from_yaml(str(f))
    f.write_text("base: &b {data: 2, model: 4}\n")          # a merge key overrides what it merges, as YAML means
    from jaxpar.yaml_files import load_yaml
    assert load_yaml("b: &b {data: 2, model: 4}\nmesh: {<<: *b, model: 2}\n", "x")["mesh"] == {"data": 2, "model": 2}
