"""Every public name of jaxpar 0.1.0 (commit 11aa738) still works, warns naming its replacement,
or fails naming what to use and the doc page; and the record of 0.1.0's names is complete.

The frozen lists at the end were generated once from ``git show 11aa738:jaxpar/...``: every
module, the public names of every package ``__all__`` (and of the modules of packages without
one, such as ``jaxpar.models``), and the parameters and members of each public callable and
class. A name dropped later without an entry in ``jaxpar/deprecation.py`` fails here.
"""

import dataclasses
import importlib
import inspect
import re
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import jaxpar
from jaxpar import deprecation as dep

ROOT = Path(__file__).resolve().parent.parent

# former name -> ("warns", replacement as the warning names it) or ("fails", what the error names, doc page)
EXPECTED = {
    "jaxpar.auto.Plan": ("warns", "jaxpar.auto.Strategy"),
    "jaxpar.auto.make_plan": ("warns", "jaxpar.auto.make_strategy"),
    "jaxpar.auto.hand_plan": ("warns", "jaxpar.auto.hand_strategy"),
    "jaxpar.auto.JobPlan": ("warns", "jaxpar.auto.JobSearchResult"),
    "jaxpar.auto.plan_job": ("fails", "jaxpar.auto.search_job", "docs/auto_parallel.md"),
    "jaxpar.checkpoint.plan_leaves": ("warns", "jaxpar.checkpoint.leaf_specs"),
    "jaxpar.train.plan_for": ("warns", "jaxpar.auto.plan_for"),
    "jaxpar.nn.HostEmbedding": ("warns", "jaxpar.ps.HostEmbedding"),
    "jaxpar.nn.RowOptimizer": ("warns", "jaxpar.ps.RowOptimizer"),
    "jaxpar.nn.HostEmbeddingStep": ("fails", "jaxpar.ps.HostRows", "docs/recommendation.md"),
    "jaxpar.nn.format_plan": ("warns", "jaxpar.nn.format_specs"),
    "jaxpar.nn.plan_rows": ("warns", "jaxpar.nn.spec_rows"),
    "jaxpar.nn.plan_state": ("warns", "jaxpar.nn.state_specs"),
    "jaxpar.optim.ZeroPlan": ("warns", "jaxpar.optim.ZeroSpecs"),
    "jaxpar.optim.zero_plan": ("warns", "jaxpar.optim.zero_specs"),
    "jaxpar.optim.on_host": ("fails", "ZeRO-3", "docs/offload.md"),        # host offload: removed
    "jaxpar.optim.to_device": ("fails", "ZeRO-3", "docs/offload.md"),
    "jaxpar.ps.SparseTrainer": ("fails", "jaxpar.ps.ServerRows", "docs/parameter_server.md"),
    "jaxpar.models.gpt.pipeline_loss": ("warns", "jaxpar.models.gpt_parallel.pipeline_loss"),
    "jaxpar.models.llama.pipeline_loss": ("warns", "jaxpar.models.llama_parallel.pipeline_loss"),
    **{f"jaxpar.cli.{name}": ("fails", "jaxpar.cli.main", "docs/jobs.md")
       for name in ("add_job_args", "check_plan_flags", "check_writable", "cmd_plan", "cmd_report", "cmd_train",
                    "config_file", "given")},
}
EXPECTED_MODULES = {
    "jaxpar.auto.plan": ("warns", "jaxpar.auto.strategy"),
    "jaxpar.nn.plan": ("warns", "jaxpar.nn.specs"),
    "jaxpar.nn.host_embedding": ("warns", "jaxpar.ps.host_embedding"),
    "jaxpar.nn.row_file": ("warns", "jaxpar.ps.row_file"),
    "jaxpar.auto.planner": ("fails", "jaxpar.auto.search_job", "docs/auto_parallel.md"),
    "jaxpar.nn.host_step": ("fails", "jaxpar.ps.HostRows", "docs/recommendation.md"),
    "jaxpar.train.guards": ("fails", "jaxpar.train.Preempted", "docs/reliability.md"),
    "jaxpar.ckpt_cli": ("fails", "python -m jaxpar.cli ckpt", "docs/checkpoint.md"),
    "jaxpar.plan_cli": ("fails", "python -m jaxpar.cli plan", "docs/auto_parallel.md"),
    "jaxpar.report_cli": ("fails", "jaxpar.job.reports.compiled_llama_memory", "docs/report.md"),
    "jaxpar.cli_job": ("fails", "python -m jaxpar.cli train", "docs/jobs.md"),
    "jaxpar.job.cli": ("fails", "python -m jaxpar.cli train", "docs/jobs.md"),
    "jaxpar.data.cli": ("fails", "python -m jaxpar.cli data", "docs/data_loading.md"),
    "jaxpar.launch.cli": ("fails", "python -m jaxpar.launch", "docs/startup.md"),
    "jaxpar.metrics.cli": ("fails", "python -m jaxpar.cli train", "docs/metrics.md"),
    "jaxpar.optim.offload": ("fails", "ZeRO-3", "docs/offload.md"),        # host offload: removed
    "jaxpar.nn.stream": ("fails", "ZeRO-3", "docs/offload.md"),
}


def _rows(text: str) -> list[str]:
    """The entries of a frozen list: one a line, a line indented by four spaces continues the last."""
    rows = []
    for line in text.strip("\n").splitlines():
        if line.startswith("    ") and rows:
            rows[-1] += " " + line.strip()
        else:
            rows.append(line.strip())
    return rows


def _quietly(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args)


def _split(name: str) -> tuple[str, str]:
    module, _, attribute = name.rpartition(".")
    return module, attribute


# ------------------------------------------------------------------ the table of former names
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_former_name_warns_naming_its_replacement_or_fails_naming_it(name):
    kind, replacement, *doc = EXPECTED[name]
    module = importlib.import_module(_split(name)[0])
    if kind == "warns":
        with pytest.warns(DeprecationWarning, match=re.escape(f"{name} is deprecated: use {replacement} instead")):
            obj = getattr(module, _split(name)[1])
        new_module, new_name = _split(replacement)
        assert obj is getattr(importlib.import_module(new_module), new_name)
    else:
        with pytest.raises(AttributeError, match=re.escape(name) + ".*" + re.escape(replacement)
                           + ".*" + re.escape(doc[0])):
            getattr(module, _split(name)[1])
        # `from package import name` says the same (not Python's bare "cannot import name")
        with pytest.raises(ImportError, match=re.escape(name) + ".*" + re.escape(replacement)
                           + ".*" + re.escape(doc[0])):
            exec(f"from {_split(name)[0]} import {_split(name)[1]}", {})


@pytest.mark.parametrize("name", sorted(EXPECTED_MODULES))
def test_a_former_module_warns_naming_its_replacement_or_fails_naming_it(name):
    kind, replacement, *doc = EXPECTED_MODULES[name]
    if kind == "warns":
        sys.modules.pop(name, None)                     # imported by an earlier test: import it afresh
        with pytest.warns(DeprecationWarning, match=re.escape(f"module {name} is deprecated: use {replacement}")):
            old = importlib.import_module(name)
        new = importlib.import_module(replacement)
        public = [n for n in dir(new) if not n.startswith("_")]
        assert public and all(_quietly(getattr, old, n) is getattr(new, n) for n in public)
    else:
        with pytest.raises(ModuleNotFoundError, match=re.escape(name) + ".*" + re.escape(replacement)
                           + ".*" + re.escape(doc[0])):
            importlib.import_module(name)


def test_a_former_module_says_which_of_its_names_were_renamed():
    old = _quietly(importlib.import_module, "jaxpar.nn.plan")
    with pytest.warns(DeprecationWarning, match=re.escape("jaxpar.nn.plan.plan_state is deprecated: use "
                                                          "jaxpar.nn.specs.state_specs")):
        assert old.plan_state is jaxpar.nn.state_specs


def test_the_table_is_the_code_s_table():
    """Each entry of jaxpar/deprecation.py is checked above, and nothing more is there."""
    in_code = {f"{m}.{n}" for m, names in dep.FORMER.items() for n in names}
    assert in_code == set(EXPECTED)
    assert set(dep.MODULES) == set(EXPECTED_MODULES)


def test_a_name_that_never_was_public_is_the_usual_attribute_error():
    with pytest.raises(AttributeError, match="module 'jaxpar.nn' has no attribute 'no_such_name'"):
        jaxpar.nn.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="module 'jaxpar.ps' has no attribute 'no_such_name'"):
        jaxpar.ps.no_such_name  # noqa: B018


# ------------------------------------------------------------------ keywords and members
def test_parallel_config_reads_parameter_plan_with_a_warning():
    with pytest.warns(DeprecationWarning, match=re.escape("ParallelConfig(parameter_plan=...) is deprecated: use "
                                                          "ParallelConfig(parameter_strategy=...)")):
        config = jaxpar.ParallelConfig(mesh={"data": 2}, parameter_plan={"*/up/kernel": (1, 2)})
    assert config == jaxpar.ParallelConfig(mesh={"data": 2}, parameter_strategy={"*/up/kernel": (1, 2)})
    with pytest.warns(DeprecationWarning, match=re.escape("ParallelConfig.parameter_plan is deprecated: use "
                                                          "ParallelConfig.parameter_strategy")):
        assert config.parameter_plan == {"*/up/kernel": (1, 2)}
    with pytest.raises(TypeError, match="both parameter_plan= and parameter_strategy= are given"):
        jaxpar.ParallelConfig(parameter_plan={}, parameter_strategy={})


def test_shard_optimizer_reads_plan_as_zero_with_a_warning():
    import optax
    from jax.sharding import PartitionSpec as P

    mesh = jaxpar.make_mesh({"data": -1})
    params = {"w": __import__("numpy").zeros((4, 2), "float32")}
    zero = jaxpar.optim.zero_specs(jaxpar.OptimizerConfig(level=1), mesh, {"w": P()}, params)
    with pytest.warns(DeprecationWarning, match=re.escape("shard_optimizer(plan=...) is deprecated: use "
                                                          "shard_optimizer(zero=...)")):
        tx = jaxpar.optim.shard_optimizer(optax.sgd(0.1), mesh, plan=zero, params=params)
    assert callable(tx.init)


@pytest.mark.parametrize("config", ["jaxpar.models.gpt:GPTConfig", "jaxpar.models.llama:LlamaConfig"])
def test_model_configs_refuse_remat_naming_parallel_config_and_the_page(config):
    cls = dep.resolve(config)
    with pytest.raises(TypeError, match=re.escape(f"{cls.__name__}(remat='full')") + ".*ParallelConfig\\(remat='full'\\)"
                       ".*docs/recompute.md"):
        cls(remat="full")
    with pytest.raises(AttributeError, match="ParallelConfig.remat.*docs/recompute.md"):
        cls.remat  # noqa: B018


def test_former_members_warn_or_fail_naming_the_replacement():
    from jaxpar.auto.job_search import JobSearchResult
    from jaxpar.checkpoint import Checkpointer

    for owner, old, new in [(Checkpointer, "save_state", "save"), (Checkpointer, "restore_state", "restore"),
                            (JobSearchResult, "plan", "strategy")]:
        with pytest.warns(DeprecationWarning, match=re.escape(f"{owner.__name__}.{old} is deprecated: use "
                                                              f"{owner.__name__}.{new}")):
            assert getattr(owner, old) is inspect.getattr_static(owner, new) or old == "plan"
    with pytest.raises(AttributeError, match=r"Trainer.shardings.*state_shardings.*docs/architecture.md"):
        jaxpar.Trainer.shardings  # noqa: B018
    with pytest.raises(AttributeError, match=r"HostEmbedding.gather.*HostRows.*docs/recommendation.md"):
        jaxpar.ps.HostEmbedding.gather  # noqa: B018


def test_an_auto_trainer_without_a_batch_names_the_replacement_and_the_page():
    """0.1.0 searched at the first batch; now the search runs before training, on example_batch."""
    from jaxpar.train import plan_for

    config = jaxpar.ParallelConfig(mesh={"data": 2}, mode="auto")
    with pytest.raises(ValueError, match=r"example_batch=.*plan_for.*no longer searches at its first batch.*"
                                         r"docs/parallel_modes.md"):
        plan_for(object(), None, None, config, None)


def test_jaxpar_deprecation_warnings_reach_the_user_s_line_and_are_not_filtered():
    """Under the suite's warning filters (pyproject's filterwarnings quiet orbax's only) a former
    name's warning is shown, attributed to the line that used it."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    for entry in settings.get("filterwarnings", []):
        action, _, category, module, *_ = (entry.split(":") + ["", "", "", ""])
        if action == "ignore" and category in ("", "Warning", "DeprecationWarning"):
            assert module and not re.match(module, "jaxpar") and not re.match(module, "user_script"), entry
    with warnings.catch_warnings(record=True) as seen:       # the filters in force, not pytest.warns' "always"
        exec(compile("import jaxpar.nn\njaxpar.nn.plan_state\n", "user_script.py", "exec"), {"__name__": "user_script"})
    [warning] = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert "jaxpar.nn.plan_state is deprecated" in str(warning.message)
    assert (warning.filename, warning.lineno) == ("user_script.py", 2)


# ------------------------------------------------------------------ completeness against 0.1.0
# Former keywords: (callable as in OLD_SIGNATURES, parameter) -> how it is answered now.
KEYWORDS = {
    ("jaxpar.ParallelConfig", "parameter_plan"): "warns (test_parallel_config_reads_parameter_plan_with_a_warning)",
    ("jaxpar.config.ParallelConfig", "parameter_plan"): "the same class",
    ("jaxpar.optim.shard_optimizer", "plan"): "warns (test_shard_optimizer_reads_plan_as_zero_with_a_warning)",
    ("jaxpar.models.gpt.GPTConfig", "remat"): "fails (test_model_configs_refuse_remat_naming_parallel_config_...)",
    ("jaxpar.models.llama.LlamaConfig", "remat"): "fails (the same test)",
    ("jaxpar.models.llama_config.LlamaConfig", "remat"): "the same class",
    # Checkpointer methods took a Trainer in 0.1.0 and take (plan, state, mesh) now: a TrainPlan / TrainState
    # check names the fix when they are given; jaxpar.checkpoint.save/restore(trainer, directory) take a Trainer.
    ("jaxpar.checkpoint.Checkpointer.save", "trainer"): "CHANGELOG.md: Checkpointer",
    ("jaxpar.checkpoint.Checkpointer.save", "data_state"): "CHANGELOG.md: Checkpointer",
    ("jaxpar.checkpoint.Checkpointer.restore", "trainer"): "CHANGELOG.md: Checkpointer",
    ("jaxpar.checkpoint.Checkpointer.resume", "trainer"): "CHANGELOG.md: Checkpointer",
    ("jaxpar.checkpoint.Checkpointer.maybe_save", "trainer"): "CHANGELOG.md: Checkpointer",
    # long parameter lists became values; the former call forms warn (tests of each function's module)
    **{(f"jaxpar.pipeline{module}.{fn}", name): "warns (test_the_former_call_form_warns_and_gives_the_same_values)"
       for module in ("", ".executor") for fn in ("pipeline_value_and_grad", "pipeline_forward")
       for name in ("stage_fn", "loss_fn", "schedule", "mesh", "axis", "specs", "embed_fn", "stage_batch",
                    "stage_aux")},
    **{("jaxpar.ops.moe_dispatch", name): "warns (test_moe.py: test_the_former_keywords_warn_and_give_the_same_values)"
       for name in ("expert_axis", "batch_axis", "mlp_axis", "capacity_factor", "bucket_growth", "transport")},
    **{("jaxpar.models.llama_report.llama_report", name): "warns (test_model_report.py: test_the_former_keywords_...)"
       for name in ("batch", "seq_len", "mesh", "tx", "step_time_s", "peak_flops", "device_kind", "backend",
                    "param_dtype", "grad_dtype", "opt_state_dtype", "compute_dtype", "compiled", "compiled_note")},
    **{("jaxpar.ops.context_attention", name): "warns (test_context.py: test_the_former_mask_keywords_...)"
       for name in ("causal", "segment_ids", "q_positions", "kv_positions")},
    # host offload was removed: each is a ValueError naming what to use (test_offload_removed.py)
    **{(owner, "offload"): "fails (test_offload_removed.py)"
       for owner in ("jaxpar.TrainPlan", "jaxpar.plan.TrainPlan", "jaxpar.make_train_plan",
                     "jaxpar.plan.make_train_plan", "jaxpar.auto.plan_training")},
    ("jaxpar.report.MemoryEstimate", "host"): "fails (test_offload_removed.py)",
    **{("jaxpar.data.TokenLoader", name): "warns (test_data_tokens.py: test_the_former_process_keywords_...)"
       for name in ("process_index", "process_count")},
}
# Former members of classes, answered by a RenamedAttribute / RemovedAttribute (test_former_members_...) or
# by the renamed class they belong to.
MEMBERS = {"jaxpar.ParallelConfig.parameter_plan", "jaxpar.config.ParallelConfig.parameter_plan",
           "jaxpar.models.gpt.GPTConfig.remat", "jaxpar.models.llama.LlamaConfig.remat",
           "jaxpar.models.llama_config.LlamaConfig.remat", "jaxpar.Trainer.shardings", "jaxpar.train.Trainer.shardings",
           "jaxpar.checkpoint.Checkpointer.save_state", "jaxpar.checkpoint.Checkpointer.restore_state",
           "jaxpar.auto.JobPlan.plan", "jaxpar.nn.HostEmbedding.gather",
           # host offload was removed (test_offload_removed.py)
           "jaxpar.TrainPlan.offload", "jaxpar.plan.TrainPlan.offload", "jaxpar.Trainer.offload",
           "jaxpar.train.Trainer.offload", "jaxpar.report.MemoryEstimate.host"}


def _answered(module: str, name: str) -> bool:
    return name in dep.FORMER.get(module, {}) or module in dep.MODULES


def test_every_module_of_0_1_0_imports_or_has_an_entry():
    for name in " ".join(_rows(OLD_MODULES)).split():
        if name in dep.MODULES:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            importlib.import_module(name)


def test_every_public_name_of_0_1_0_is_there_or_has_an_entry():
    missing = []
    for row in _rows(OLD_NAMES):
        module, _, names = row.partition(":")
        if module in dep.MODULES:
            continue
        mod = importlib.import_module(module)
        for name in names.split():
            if name in dep.FORMER.get(module, {}):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                if not hasattr(mod, name):
                    missing.append(f"{module}.{name}")
    assert not missing, ("public names of 0.1.0 gone without an entry in jaxpar/deprecation.py (a warning naming "
                         f"the replacement, or an error naming what to use) and CHANGELOG.md: {missing}")


def _current(qualified: str):
    """The object that answers ``qualified`` now (through a former name's replacement), or None."""
    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in dep.MODULES:
            return None                               # a former module: test_a_former_module_...
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for j, part in enumerate(parts[i:]):
            if j == 0 and _answered(module, part):
                entry = dep.FORMER[module][part]
                if isinstance(entry, dep.Removed):
                    return None
                obj = dep.resolve(entry.new)
                continue
            # a module's names may be made on first use (its __getattr__); a class's members are read as they are stored
            found = getattr(obj, part, None) if inspect.ismodule(obj) else inspect.getattr_static(obj, part, None)
            if found is None and dataclasses.is_dataclass(obj) and part in obj.__dataclass_fields__:
                return dataclasses.MISSING
            if isinstance(found, (dep.RenamedAttribute, dep.RemovedAttribute)):
                return found
            if found is None:
                return KeyError(qualified)
            obj = getattr(obj, part)
        return obj
    return KeyError(qualified)


def test_every_parameter_and_member_of_0_1_0_is_there_or_has_an_entry():
    wrong = []
    for row in _rows(OLD_SIGNATURES):
        qualified, _, params = row.partition("(")
        obj = _current(qualified)
        if obj is None:
            continue                                   # a removed name: its error names the replacement
        if isinstance(obj, (dep.RenamedAttribute, dep.RemovedAttribute)):
            if qualified not in MEMBERS:
                wrong.append(f"{qualified}: answered by the code but missing from MEMBERS here")
            continue
        if isinstance(obj, KeyError):
            if qualified not in MEMBERS:
                wrong.append(f"{qualified}: gone")
            continue
        if not params or obj is dataclasses.MISSING:
            continue
        try:
            current = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        for name in params.rstrip(")").split(", "):
            if name and name != "None" and name not in current and (qualified, name) not in KEYWORDS:
                wrong.append(f"{qualified}: parameter {name!r} gone")
    assert not wrong, ("parameters or members of 0.1.0 gone without an entry (jaxpar/deprecation.py, KEYWORDS / "
                       "MEMBERS here and CHANGELOG.md):\n" + "\n".join(wrong))


def test_the_changelog_lists_every_entry():
    text = (ROOT / "CHANGELOG.md").read_text()
    names = [n.rsplit(".", 1)[1] for n in EXPECTED] + list(EXPECTED_MODULES) + ["parameter_plan", "shard_optimizer",
                                                                               "remat", "shardings", "save_state",
                                                                               "restore_state", "gather",
                                                                               "example_batch", "Checkpointer"]
    assert not [n for n in names if n not in text]


# ------------------------------------------------------------------ 0.1.0, frozen (generated from git, 11aa738)
OLD_MODULES = """
jaxpar jaxpar.auto jaxpar.auto.api jaxpar.auto.assign jaxpar.auto.balance jaxpar.auto.comm jaxpar.auto.context
jaxpar.auto.cost jaxpar.auto.experts jaxpar.auto.graph jaxpar.auto.graph_rules jaxpar.auto.job_options
jaxpar.auto.machine jaxpar.auto.plan jaxpar.auto.planner jaxpar.auto.pricing jaxpar.auto.search
jaxpar.checkpoint jaxpar.checkpoint.manager jaxpar.checkpoint.offline jaxpar.checkpoint.state
jaxpar.checkpoint.strategy jaxpar.ckpt_cli jaxpar.cli jaxpar.cli_job jaxpar.config jaxpar.data jaxpar.data.cli
jaxpar.data.clicks jaxpar.data.loader jaxpar.data.sequence jaxpar.data.store jaxpar.data.tokenizer
jaxpar.distributed jaxpar.interop jaxpar.interop.hf jaxpar.interop.hf_files jaxpar.interop.hf_layout
jaxpar.job jaxpar.job.cli jaxpar.job.config jaxpar.job.optim jaxpar.job.run jaxpar.launch jaxpar.launch.cli
jaxpar.launch.cluster jaxpar.launch.deaths jaxpar.launch.k8s jaxpar.launch.k8s_servers jaxpar.launch.launcher
jaxpar.launch.ports jaxpar.launch.ranktable jaxpar.launch.runner jaxpar.launch.servers jaxpar.launch.sources
jaxpar.launch.worker jaxpar.mesh jaxpar.metrics jaxpar.metrics.cli jaxpar.metrics.config jaxpar.metrics.logger
jaxpar.metrics.profile jaxpar.metrics.writers jaxpar.models jaxpar.models.data jaxpar.models.dlrm
jaxpar.models.generate jaxpar.models.gpt jaxpar.models.llama jaxpar.models.llama_config
jaxpar.models.llama_report jaxpar.nn jaxpar.nn.constraint jaxpar.nn.host_embedding jaxpar.nn.host_step
jaxpar.nn.init jaxpar.nn.moe jaxpar.nn.plan jaxpar.nn.row_file jaxpar.ops jaxpar.ops.context
jaxpar.ops.context_kernels jaxpar.ops.context_model jaxpar.ops.context_order jaxpar.ops.conv
jaxpar.ops.head_parallel jaxpar.ops.linear jaxpar.ops.linear_2d jaxpar.ops.moe_dispatch
jaxpar.ops.vocab_parallel jaxpar.optim jaxpar.optim.accumulate jaxpar.optim.fusion jaxpar.optim.offload
jaxpar.optim.zero jaxpar.pipeline jaxpar.pipeline.branches jaxpar.pipeline.drawing jaxpar.pipeline.executor
jaxpar.pipeline.model jaxpar.pipeline.program jaxpar.pipeline.schedules jaxpar.pipeline.stage_layout
jaxpar.pipeline.stages jaxpar.pipeline.vshape jaxpar.plan jaxpar.plan.state jaxpar.plan.train_plan
jaxpar.plan_cli jaxpar.precision jaxpar.ps jaxpar.ps.client jaxpar.ps.server jaxpar.ps.shard jaxpar.ps.store
jaxpar.ps.tables jaxpar.ps.wire jaxpar.ps.worker jaxpar.remat jaxpar.report jaxpar.report.collectives
jaxpar.report.estimate jaxpar.report.flops jaxpar.report.memory jaxpar.report.peaks jaxpar.report.pipeline
jaxpar.report.step jaxpar.report.table jaxpar.report.throughput jaxpar.report_cli jaxpar.shard jaxpar.strategy
jaxpar.strategy.layout jaxpar.strategy.resolve jaxpar.train jaxpar.train.compile jaxpar.train.guards
jaxpar.train.step jaxpar.train.trainer jaxpar.version
"""
OLD_NAMES = """
jaxpar: CommFusionConfig Layout LogicalConstraint OptimizerConfig ParallelConfig PipelineConfig Precision
    TrainPlan TrainState Trainer init make_mesh make_train_plan ops optim remat report shard to_partition_spec
jaxpar.auto: Cost CostParams Graph JobPlan Plan balance_stages build_graph calibrate evaluate hand_plan
    make_plan mesh_sizes module_costs plan_job plan_training search
jaxpar.auto.balance: balance_stages module_costs
jaxpar.checkpoint: CheckpointDamagedError CheckpointMismatchError Checkpointer format_inspect inspect
    latest_step load_strategy merge plan_leaves restore restore_state save save_state strategy_config
    strategy_specs transform
jaxpar.ckpt_cli: USER_ERRORS add_ckpt_parser main run_ckpt
jaxpar.cli: Parser add_job_args check_plan_flags check_writable cmd_plan cmd_report cmd_train config_file
    given jaxpar_raised main make_parser
jaxpar.cli_job: DEFAULT_BATCH DEFAULT_DEVICES JOB_ERRORS Job MEGATRON_RULES UserError build_job config_of
    default_config devices_of model_config refuse resolve_job set_simulated_devices
jaxpar.config: CONTEXT_ORDERS CONTEXT_STRATEGIES CommFusionConfig ContextConfig FUSION_MODES MODES
    OPTIMIZER_LEVELS OptimizerConfig ParallelConfig PipelineConfig REMAT_POLICIES SCHEDULES SEARCHES
    from_plain normalize_mesh to_plain
jaxpar.data: ByteTokenizer HFTokenizer TokenLoader TokenStore batch_axes batch_shardings batch_specs leaf_spec
    load_tokenizer part_shapes place_batch prepare split_rows train_tokenizer
jaxpar.distributed: ClusterSpec initialize is_initialized make_global_batch process_rows shutdown
jaxpar.interop.hf: MODEL_FAMILY export_hf import_hf llama_model place
jaxpar.interop.hf_files: CONFIG INDEX Reader SINGLE file_names nbytes plan_files read_config safetensors
    write_config write_file write_index
jaxpar.interop.hf_layout: ARCHITECTURES DTYPES IGNORED_SUFFIXES Tensor check_architecture hf_config
    llama_config tensors
jaxpar.job: JobConfig make_optimizer
jaxpar.launch: ClusterError ClusterSpec K8sJob LaunchConfig RankTable detect_cluster k8s_manifest launch
    load_rank_table
jaxpar.mesh: make_mesh resolve_axes
jaxpar.metrics: JsonlWriter MetricsConfig MetricsLogger ProfileWindow TensorBoardWriter check_profile_steps
    progress_text read read_jsonl require_tensorboard tensorboard_tag tokens_per_example
jaxpar.models.data: ArithmeticData VOCAB arithmetic_text decode encode
jaxpar.models.dlrm: DLRM DLRMConfig MLP loss_fn
jaxpar.models.generate: greedy
jaxpar.models.gpt: Attention Block GPT GPTConfig LayerNorm MLP loss_fn no_constraint pipeline_loss
jaxpar.models.llama: Llama LlamaConfig RopeScaling SIZES attention attention_implementation describe
    flops_per_token loss_fn param_count pipeline_loss rope_frequencies segment_positions
jaxpar.models.llama_config: ATTENTION DTYPES LlamaConfig RopeScaling SIZES describe flops_per_token
    param_count
jaxpar.models.llama_report: COUNTS DEFAULT_TX FlopsPerToken ModelReport format_model_report
    llama_activation_bytes llama_config llama_flops_per_token llama_report matmul_params
jaxpar.nn: HostEmbedding HostEmbeddingStep MoE MoEAuxLoss MoEConfig MoEMetric RowOptimizer abstract_model
    format_plan init init_program model_constraint moe_aux_loss moe_metrics place plan_rows plan_state route
    to_shardings
jaxpar.ops: ContextParallel attention context_attention context_order conv2d dense describe_balance embedding
    matmul matmul_2d moe_dispatch pad_for_manual_split ragged_all_to_all_supported unpad
jaxpar.optim: ZeroPlan accumulate_grads bucketed_psum compiler_options interleave_loss on_host opt_state_specs
    shard_optimizer split_batch to_device zero_axes zero_plan zero_spec
jaxpar.pipeline: Kind Op PipelineLoss Program SCHEDULES Schedule StagedLoss best_split bubble_fraction build
    dualpipe_v forward_only from_stage_layout gpipe interleaved location lower module_paths one_f_one_b
    peak_activations pipeline_forward pipeline_loss pipeline_value_and_grad pipelined plot_timeline timeline
    to_stage_layout validate virtual_stage zb_h1 zb_v
jaxpar.pipeline.branches: BranchKey make_branches stats_dtype
jaxpar.pipeline.drawing: plot_timeline timeline
jaxpar.pipeline.executor: Program forward_only from_stage_layout lower pipeline_forward pipeline_loss
    pipeline_value_and_grad to_stage_layout
jaxpar.pipeline.program: CHANNELS Program forward_only lower
jaxpar.pipeline.schedules: Kind Op PLACEMENTS SCHEDULES Schedule bubble_fraction build gpipe interleaved
    location one_f_one_b peak_activations plot_timeline timeline validate virtual_stage zb_h1
jaxpar.pipeline.stage_layout: from_stage_layout to_stage_layout
jaxpar.pipeline.stages: StagedLoss assign best_split module_paths named_modules stage_costs staged
jaxpar.pipeline.vshape: dualpipe_v zb_v
jaxpar.plan: TrainPlan TrainState check_data flat_paths init_state make_train_plan state_shardings
jaxpar.plan_cli: DEFAULT_ACCUM DEFAULT_CONTEXT DEFAULT_CONTEXT_STRATEGIES DEFAULT_REMAT DEFAULT_SCHEDULE
    DEFAULT_STAGES DEFAULT_ZERO_LEVELS PLANNED_CONTEXT_STRATEGIES SearchSettings add_plan_search_arguments
    annotation context_strategy_list int_list name_list number remat_list run_plan_search search_settings
jaxpar.precision: FIELDS FLOATS PRESETS Precision as_precision cast_floats cast_like with_precision
jaxpar.ps: Adagrad Adam BUCKETS Client Lookup SGD SparseTrainer TableSpec bucket_size connect init_rows lookup
jaxpar.remat: COLLECTIVES POLICY_NAMES checkpoint_policy remat
jaxpar.report: Collective KINDS MemoryEstimate MemoryReport StepReport Throughput collective_summary
    collectives estimate_memory flops format_bytes format_collectives format_memory format_schedule memory mfu
    param_table peak_flops peak_table schedule_of step_report throughput
jaxpar.report_cli: COMPILE_MAX_PARAMS GPT_SHAPE MODELS add_model_report_arguments check_model_report_flags
    compiled_llama_memory run_llama_report
jaxpar.shard: LogicalConstraint ShardedModule shard
jaxpar.strategy: Layout LayoutSpec check_spec is_integer_strategy logical_axes manual_axes mesh_sizes
    recording_rules shard_count spec_axes to_partition_spec
jaxpar.train: Preempted Trainer compile_step
jaxpar.version:
"""
OLD_SIGNATURES = """
jaxpar.CommFusionConfig(mode, bucket_mb)
jaxpar.CommFusionConfig.bucket_bytes
jaxpar.CommFusionConfig.bucket_mb
jaxpar.CommFusionConfig.mode
jaxpar.Layout(device_matrix, alias_name)
jaxpar.Layout.alias_name
jaxpar.Layout.axis_sizes()
jaxpar.Layout.device_matrix
jaxpar.Layout.mesh(devices)
jaxpar.Layout.size
jaxpar.LogicalConstraint(mesh, rules)
jaxpar.LogicalConstraint.spec(shape, names)
jaxpar.OptimizerConfig(level, threshold_kb, axis, shard_size)
jaxpar.OptimizerConfig.axis
jaxpar.OptimizerConfig.level
jaxpar.OptimizerConfig.shard_size
jaxpar.OptimizerConfig.threshold_kb
jaxpar.ParallelConfig(mesh, mode, rules, parameter_plan, dataset_strategy, optimizer, grad_accum, pipeline,
    remat, search, comm_fusion, interleave, precision, allow_unused_rules, context)
jaxpar.ParallelConfig.allow_unused_rules
jaxpar.ParallelConfig.comm_fusion
jaxpar.ParallelConfig.context
jaxpar.ParallelConfig.dataset_strategy
jaxpar.ParallelConfig.from_dict(d)
jaxpar.ParallelConfig.from_overrides(args, base)
jaxpar.ParallelConfig.from_yaml(path)
jaxpar.ParallelConfig.grad_accum
jaxpar.ParallelConfig.interleave
jaxpar.ParallelConfig.mesh
jaxpar.ParallelConfig.mode
jaxpar.ParallelConfig.optimizer
jaxpar.ParallelConfig.parameter_plan
jaxpar.ParallelConfig.pipeline
jaxpar.ParallelConfig.precision
jaxpar.ParallelConfig.remat
jaxpar.ParallelConfig.rules
jaxpar.ParallelConfig.search
jaxpar.ParallelConfig.to_dict()
jaxpar.PipelineConfig(stages, microbatches, schedule, virtual_stages, axis, embedding)
jaxpar.PipelineConfig.axis
jaxpar.PipelineConfig.embedding
jaxpar.PipelineConfig.microbatches
jaxpar.PipelineConfig.schedule
jaxpar.PipelineConfig.stages
jaxpar.PipelineConfig.virtual_stages
jaxpar.Precision(params, compute, reduce, opt_state)
jaxpar.Precision.compute
jaxpar.Precision.label
jaxpar.Precision.named(name)
jaxpar.Precision.opt_state
jaxpar.Precision.params
jaxpar.Precision.reduce
jaxpar.TrainPlan(config, mesh, source, params, stored, grads, update, opt_state, rest, zero_axes, unsharded,
    offload, shapes)
jaxpar.TrainPlan.batch_axes()
jaxpar.TrainPlan.batch_specs(batch)
jaxpar.TrainPlan.config
jaxpar.TrainPlan.diff(other)
jaxpar.TrainPlan.from_dict(d)
jaxpar.TrainPlan.from_json(path)
jaxpar.TrainPlan.grad_accum
jaxpar.TrainPlan.grads
jaxpar.TrainPlan.interleave
jaxpar.TrainPlan.loss_runs
jaxpar.TrainPlan.mesh
jaxpar.TrainPlan.offload
jaxpar.TrainPlan.opt_state
jaxpar.TrainPlan.params
jaxpar.TrainPlan.pipeline
jaxpar.TrainPlan.precision
jaxpar.TrainPlan.remat
jaxpar.TrainPlan.rest
jaxpar.TrainPlan.rows()
jaxpar.TrainPlan.shapes
jaxpar.TrainPlan.shardings(section, like, mesh)
jaxpar.TrainPlan.source
jaxpar.TrainPlan.specs(section, like)
jaxpar.TrainPlan.stored
jaxpar.TrainPlan.summary()
jaxpar.TrainPlan.table(width)
jaxpar.TrainPlan.to_dict()
jaxpar.TrainPlan.to_json(path)
jaxpar.TrainPlan.unsharded
jaxpar.TrainPlan.update
jaxpar.TrainPlan.zero(params_like)
jaxpar.TrainPlan.zero_axes
jaxpar.TrainPlan.zero_level
jaxpar.TrainState(params, rest, opt_state, step, data)
jaxpar.TrainState.attach(token)
jaxpar.TrainState.data
jaxpar.TrainState.detach()
jaxpar.TrainState.opt_state
jaxpar.TrainState.params
jaxpar.TrainState.replace()
jaxpar.TrainState.rest
jaxpar.TrainState.step
jaxpar.TrainState.tree_flatten_with_keys()
jaxpar.TrainState.tree_unflatten(data, children)
jaxpar.Trainer(model, tx, loss_fn, config, mesh, plan, global_batch, donate, offload, example_batch,
    checkpoint_dir, save_every, keep, nonfinite, resume, preemption, metrics, profile_steps)
jaxpar.Trainer.check_finite()
jaxpar.Trainer.close()
jaxpar.Trainer.compute_specs
jaxpar.Trainer.config
jaxpar.Trainer.data_state
jaxpar.Trainer.evaluate(batches, steps)
jaxpar.Trainer.fit(batches, steps, log_every, progress, callback)
jaxpar.Trainer.lower(batch)
jaxpar.Trainer.lower_eval(batch)
jaxpar.Trainer.lower_grads(batch)
jaxpar.Trainer.model
jaxpar.Trainer.offload
jaxpar.Trainer.opt_state
jaxpar.Trainer.param_specs
jaxpar.Trainer.params
jaxpar.Trainer.place(batch)
jaxpar.Trainer.rest
jaxpar.Trainer.restore(directory, step)
jaxpar.Trainer.save(directory, data_state)
jaxpar.Trainer.shardings
jaxpar.Trainer.state
jaxpar.Trainer.step(batch)
jaxpar.Trainer.step_count
jaxpar.Trainer.zero
jaxpar.auto.Cost(compute_s, comm_s, comm_bytes, comm_by_axes, argument_bytes, temp_bytes, invalid,
    grad_comm_s, temp_parts, comm_count, grad_comm_bytes, grad_comm_count)
jaxpar.auto.Cost.argument_bytes
jaxpar.auto.Cost.comm_by_axes
jaxpar.auto.Cost.comm_bytes
jaxpar.auto.Cost.comm_count
jaxpar.auto.Cost.comm_s
jaxpar.auto.Cost.compute_s
jaxpar.auto.Cost.grad_comm_bytes
jaxpar.auto.Cost.grad_comm_count
jaxpar.auto.Cost.grad_comm_s
jaxpar.auto.Cost.invalid
jaxpar.auto.Cost.memory_bytes
jaxpar.auto.Cost.temp_bytes
jaxpar.auto.Cost.temp_parts
jaxpar.auto.Cost.time_s
jaxpar.auto.Cost.to_dict()
jaxpar.auto.CostParams(flops_per_s, bandwidth, default_bandwidth, latency, latency_per_axis, optimizer_states,
    optimizer_scalar_bytes, temp_activation_factor, combine_threshold_bytes, combine_threshold_count)
jaxpar.auto.CostParams.bandwidth
jaxpar.auto.CostParams.collective_time(kind, axes, nbytes, sizes, combined)
jaxpar.auto.CostParams.combine_threshold_bytes
jaxpar.auto.CostParams.combine_threshold_count
jaxpar.auto.CostParams.default_bandwidth
jaxpar.auto.CostParams.flops_per_s
jaxpar.auto.CostParams.latency
jaxpar.auto.CostParams.latency_of(axes)
jaxpar.auto.CostParams.latency_per_axis
jaxpar.auto.CostParams.optimizer_scalar_bytes
jaxpar.auto.CostParams.optimizer_states
jaxpar.auto.CostParams.temp_activation_factor
jaxpar.auto.CostParams.to_dict()
jaxpar.auto.Graph(tensors, ops, class_sizes, class_names, params, batch, others, param_logical, unsplittable,
    notes, regions)
jaxpar.auto.Graph.batch
jaxpar.auto.Graph.class_names
jaxpar.auto.Graph.class_sizes
jaxpar.auto.Graph.notes
jaxpar.auto.Graph.num_classes
jaxpar.auto.Graph.ops
jaxpar.auto.Graph.others
jaxpar.auto.Graph.param_logical
jaxpar.auto.Graph.param_tensor(path)
jaxpar.auto.Graph.params
jaxpar.auto.Graph.regions
jaxpar.auto.Graph.tensors
jaxpar.auto.Graph.unsplittable
jaxpar.auto.JobPlan(chosen, config, candidates, dry_run, memory_budget)
jaxpar.auto.JobPlan.candidates
jaxpar.auto.JobPlan.chosen
jaxpar.auto.JobPlan.config
jaxpar.auto.JobPlan.dry_run
jaxpar.auto.JobPlan.explain(top)
jaxpar.auto.JobPlan.memory_budget
jaxpar.auto.JobPlan.plan
jaxpar.auto.JobPlan.remat
jaxpar.auto.JobPlan.to_dict()
jaxpar.auto.Plan(search, mesh, params, batch, classes, cost, operators, notes, cost_params, search_time_s)
jaxpar.auto.Plan.batch
jaxpar.auto.Plan.classes
jaxpar.auto.Plan.cost
jaxpar.auto.Plan.cost_params
jaxpar.auto.Plan.dataset_strategy()
jaxpar.auto.Plan.from_dict(d)
jaxpar.auto.Plan.from_json(path)
jaxpar.auto.Plan.mesh
jaxpar.auto.Plan.notes
jaxpar.auto.Plan.operators
jaxpar.auto.Plan.param_specs
jaxpar.auto.Plan.params
jaxpar.auto.Plan.search
jaxpar.auto.Plan.search_time_s
jaxpar.auto.Plan.table(operators, width)
jaxpar.auto.Plan.to_config(config)
jaxpar.auto.Plan.to_dict()
jaxpar.auto.Plan.to_json(path)
jaxpar.auto.balance.balance_stages(model, loss, batch, stages, cost_params, microbatches)
jaxpar.auto.balance.module_costs(model, loss, batch, microbatches, cost_params)
jaxpar.auto.balance_stages(model, loss, batch, stages, cost_params, microbatches)
jaxpar.auto.build_graph(model, loss_fn, batch)
jaxpar.auto.calibrate(mesh, sizes_bytes, repeats)
jaxpar.auto.evaluate(graph, axes, sizes, params, flags)
jaxpar.auto.hand_plan(model, loss_fn, batch, config, mesh, cost_params, graph)
jaxpar.auto.make_plan(graph, axes, sizes, params, algorithm, notes, seconds)
jaxpar.auto.mesh_sizes(mesh)
jaxpar.auto.module_costs(model, loss, batch, microbatches, cost_params)
jaxpar.auto.plan_job(model_fn, loss_fn, batch, devices, memory_budget, base_config, tx, cost_params,
    search_name, dry_run, meshes, zero_levels, grad_accum, remat, pipeline_stages, microbatches, schedule,
    pipeline_loss, progress, context, context_strategy, moe_imbalance)
jaxpar.auto.plan_training(model, loss_fn, batch, config, mesh, tx, offload)
jaxpar.auto.search(model, loss_fn, batch, config, mesh, cost_params, annotate, memory_budget, graph)
jaxpar.checkpoint.CheckpointDamagedError(directory, step, error)
jaxpar.checkpoint.CheckpointMismatchError(directory, step, problems)
jaxpar.checkpoint.Checkpointer(directory, save_every, keep, asynchronous, resume)
jaxpar.checkpoint.Checkpointer.close()
jaxpar.checkpoint.Checkpointer.due(step)
jaxpar.checkpoint.Checkpointer.latest_step()
jaxpar.checkpoint.Checkpointer.maybe_save(trainer)
jaxpar.checkpoint.Checkpointer.restore(trainer, step)
jaxpar.checkpoint.Checkpointer.restore_state(state, mesh, step)
jaxpar.checkpoint.Checkpointer.resume(trainer)
jaxpar.checkpoint.Checkpointer.save(trainer, data_state, force)
jaxpar.checkpoint.Checkpointer.save_state(plan, state, mesh, force, model)
jaxpar.checkpoint.Checkpointer.wait()
jaxpar.checkpoint.format_inspect(report)
jaxpar.checkpoint.inspect(directory, step)
jaxpar.checkpoint.latest_step(directory)
jaxpar.checkpoint.load_strategy(directory, step)
jaxpar.checkpoint.merge(directory, out, step)
jaxpar.checkpoint.plan_leaves(strategy, config, mesh)
jaxpar.checkpoint.restore(trainer, directory, step)
jaxpar.checkpoint.restore_state(directory, state, mesh, step)
jaxpar.checkpoint.save(trainer, directory, data_state, keep, force)
jaxpar.checkpoint.save_state(directory, plan, state, mesh, keep, force, model)
jaxpar.checkpoint.strategy_config(strategy)
jaxpar.checkpoint.strategy_specs(strategy)
jaxpar.checkpoint.transform(directory, out, config, step, devices)
jaxpar.ckpt_cli.add_ckpt_parser(subparsers)
jaxpar.ckpt_cli.main(argv)
jaxpar.ckpt_cli.run_ckpt(args)
jaxpar.cli.Parser(prog, usage, description, epilog, parents, formatter_class, prefix_chars,
    fromfile_prefix_chars, argument_default, conflict_handler, add_help, allow_abbrev, exit_on_error)
jaxpar.cli.Parser.error(message)
jaxpar.cli.add_job_args(p, train)
jaxpar.cli.check_plan_flags(args)
jaxpar.cli.check_writable(flag, path)
jaxpar.cli.cmd_plan(args)
jaxpar.cli.cmd_report(args)
jaxpar.cli.cmd_train(args)
jaxpar.cli.config_file(text)
jaxpar.cli.given(args, dest)
jaxpar.cli.jaxpar_raised(error)
jaxpar.cli.main(argv)
jaxpar.cli.make_parser()
jaxpar.cli_job.Job(config, model, devices, batch, steps, lr, seed)
jaxpar.cli_job.Job.batch
jaxpar.cli_job.Job.config
jaxpar.cli_job.Job.devices
jaxpar.cli_job.Job.lr
jaxpar.cli_job.Job.model
jaxpar.cli_job.Job.seed
jaxpar.cli_job.Job.steps
jaxpar.cli_job.UserError
jaxpar.cli_job.build_job(job, watch)
jaxpar.cli_job.config_of(args, devices)
jaxpar.cli_job.default_config(num_devices)
jaxpar.cli_job.devices_of(args)
jaxpar.cli_job.model_config(args, config)
jaxpar.cli_job.refuse(message)
jaxpar.cli_job.resolve_job(args)
jaxpar.cli_job.set_simulated_devices(n)
jaxpar.config.CommFusionConfig(mode, bucket_mb)
jaxpar.config.CommFusionConfig.bucket_bytes
jaxpar.config.CommFusionConfig.bucket_mb
jaxpar.config.CommFusionConfig.mode
jaxpar.config.ContextConfig(axis, strategy, order)
jaxpar.config.ContextConfig.axes
jaxpar.config.ContextConfig.axis
jaxpar.config.ContextConfig.order
jaxpar.config.ContextConfig.strategy
jaxpar.config.OptimizerConfig(level, threshold_kb, axis, shard_size)
jaxpar.config.OptimizerConfig.axis
jaxpar.config.OptimizerConfig.level
jaxpar.config.OptimizerConfig.shard_size
jaxpar.config.OptimizerConfig.threshold_kb
jaxpar.config.ParallelConfig(mesh, mode, rules, parameter_plan, dataset_strategy, optimizer, grad_accum,
    pipeline, remat, search, comm_fusion, interleave, precision, allow_unused_rules, context)
jaxpar.config.ParallelConfig.allow_unused_rules
jaxpar.config.ParallelConfig.comm_fusion
jaxpar.config.ParallelConfig.context
jaxpar.config.ParallelConfig.dataset_strategy
jaxpar.config.ParallelConfig.from_dict(d)
jaxpar.config.ParallelConfig.from_overrides(args, base)
jaxpar.config.ParallelConfig.from_yaml(path)
jaxpar.config.ParallelConfig.grad_accum
jaxpar.config.ParallelConfig.interleave
jaxpar.config.ParallelConfig.mesh
jaxpar.config.ParallelConfig.mode
jaxpar.config.ParallelConfig.optimizer
jaxpar.config.ParallelConfig.parameter_plan
jaxpar.config.ParallelConfig.pipeline
jaxpar.config.ParallelConfig.precision
jaxpar.config.ParallelConfig.remat
jaxpar.config.ParallelConfig.rules
jaxpar.config.ParallelConfig.search
jaxpar.config.ParallelConfig.to_dict()
jaxpar.config.PipelineConfig(stages, microbatches, schedule, virtual_stages, axis, embedding)
jaxpar.config.PipelineConfig.axis
jaxpar.config.PipelineConfig.embedding
jaxpar.config.PipelineConfig.microbatches
jaxpar.config.PipelineConfig.schedule
jaxpar.config.PipelineConfig.stages
jaxpar.config.PipelineConfig.virtual_stages
jaxpar.config.from_plain(v)
jaxpar.config.normalize_mesh(mesh)
jaxpar.config.to_plain(v)
jaxpar.data.ByteTokenizer()
jaxpar.data.ByteTokenizer.decode(ids)
jaxpar.data.ByteTokenizer.encode(text)
jaxpar.data.ByteTokenizer.encode_lines(lines)
jaxpar.data.ByteTokenizer.eos_id
jaxpar.data.ByteTokenizer.identity()
jaxpar.data.ByteTokenizer.vocab_size
jaxpar.data.HFTokenizer(path, eos)
jaxpar.data.HFTokenizer.decode(ids)
jaxpar.data.HFTokenizer.encode(text)
jaxpar.data.HFTokenizer.encode_lines(lines)
jaxpar.data.HFTokenizer.identity()
jaxpar.data.TokenLoader(store, seq_len, global_batch, seed, packing, shuffle, tokenizer, model_config,
    prefetch, process_index, process_count)
jaxpar.data.TokenLoader.batch(i, rows)
jaxpar.data.TokenLoader.close()
jaxpar.data.TokenLoader.order(epoch)
jaxpar.data.TokenLoader.restore(state)
jaxpar.data.TokenLoader.state()
jaxpar.data.TokenStore(path)
jaxpar.data.TokenStore.check_tokenizer(tokenizer)
jaxpar.data.TokenStore.eos_id
jaxpar.data.TokenStore.fingerprint
jaxpar.data.TokenStore.num_docs
jaxpar.data.TokenStore.num_tokens
jaxpar.data.TokenStore.tokenizer()
jaxpar.data.TokenStore.tokenizer_identity
jaxpar.data.TokenStore.vocab_size
jaxpar.data.batch_axes(config, mesh)
jaxpar.data.batch_shardings(config, mesh, batch)
jaxpar.data.batch_specs(config, mesh, batch)
jaxpar.data.leaf_spec(config, mesh, shape, key)
jaxpar.data.load_tokenizer(spec, eos)
jaxpar.data.part_shapes(batch, k)
jaxpar.data.place_batch(config, mesh, batch, global_batch)
jaxpar.data.prepare(inputs, out, tokenizer, docs, shard_tokens, chunk_bytes, progress)
jaxpar.data.split_rows(x, k)
jaxpar.data.train_tokenizer(files, vocab_size, out)
jaxpar.distributed.ClusterSpec(coordinator_address, num_processes, process_id, local_process_id,
    local_device_ids, source, origins)
jaxpar.distributed.ClusterSpec.coordinator_address
jaxpar.distributed.ClusterSpec.describe()
jaxpar.distributed.ClusterSpec.is_multi_process
jaxpar.distributed.ClusterSpec.local_device_ids
jaxpar.distributed.ClusterSpec.local_process_id
jaxpar.distributed.ClusterSpec.num_processes
jaxpar.distributed.ClusterSpec.origins
jaxpar.distributed.ClusterSpec.process_id
jaxpar.distributed.ClusterSpec.source
jaxpar.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids, source,
    rank_table, simulated_devices, timeout, bind_address)
jaxpar.distributed.is_initialized()
jaxpar.distributed.make_global_batch(batch, sharding, per_process)
jaxpar.distributed.process_rows(global_batch_size, process_index, process_count)
jaxpar.distributed.shutdown()
jaxpar.init(model_fn, config, mesh)
jaxpar.interop.hf.export_hf(source, cfg, out_dir, max_shard_bytes, dtype, step, hf_base)
jaxpar.interop.hf.import_hf(directory, out, config, mesh, devices, dtype, scan_layers)
jaxpar.interop.hf.llama_model(cfg, params, constrain)
jaxpar.interop.hf.place(view, sharding)
jaxpar.interop.hf_files.Reader(directory)
jaxpar.interop.hf_files.Reader.close()
jaxpar.interop.hf_files.Reader.dtype(name)
jaxpar.interop.hf_files.Reader.read(name, shape)
jaxpar.interop.hf_files.Reader.where(name)
jaxpar.interop.hf_files.file_names(count)
jaxpar.interop.hf_files.nbytes(shape, dtype)
jaxpar.interop.hf_files.plan_files(sizes, max_shard_bytes)
jaxpar.interop.hf_files.read_config(directory)
jaxpar.interop.hf_files.safetensors()
jaxpar.interop.hf_files.write_config(directory, config)
jaxpar.interop.hf_files.write_file(path, tensors)
jaxpar.interop.hf_files.write_index(directory, weight_map, total_bytes)
jaxpar.interop.hf_layout.Tensor(hf_name, path, layer, hf_shape, to_jaxpar, to_hf)
jaxpar.interop.hf_layout.Tensor.hf_name
jaxpar.interop.hf_layout.Tensor.hf_shape
jaxpar.interop.hf_layout.Tensor.layer
jaxpar.interop.hf_layout.Tensor.path
jaxpar.interop.hf_layout.Tensor.to_hf
jaxpar.interop.hf_layout.Tensor.to_jaxpar
jaxpar.interop.hf_layout.check_architecture(hf, where)
jaxpar.interop.hf_layout.hf_config(cfg, base, dtype)
jaxpar.interop.hf_layout.llama_config(hf, where, param_dtype, scan_layers)
jaxpar.interop.hf_layout.tensors(cfg)
jaxpar.job.JobConfig(model, data, optimizer, parallel, train, checkpoint, logging, eval)
jaxpar.job.JobConfig.checkpoint
jaxpar.job.JobConfig.data
jaxpar.job.JobConfig.eval
jaxpar.job.JobConfig.from_dict(d, overrides)
jaxpar.job.JobConfig.load(path, overrides)
jaxpar.job.JobConfig.logging
jaxpar.job.JobConfig.model
jaxpar.job.JobConfig.optimizer
jaxpar.job.JobConfig.parallel
jaxpar.job.JobConfig.to_dict()
jaxpar.job.JobConfig.to_yaml()
jaxpar.job.JobConfig.train
jaxpar.job.make_optimizer(section, steps)
jaxpar.launch.ClusterError
jaxpar.launch.ClusterSpec(coordinator_address, num_processes, process_id, local_process_id, local_device_ids,
    source, origins)
jaxpar.launch.ClusterSpec.coordinator_address
jaxpar.launch.ClusterSpec.describe()
jaxpar.launch.ClusterSpec.is_multi_process
jaxpar.launch.ClusterSpec.local_device_ids
jaxpar.launch.ClusterSpec.local_process_id
jaxpar.launch.ClusterSpec.num_processes
jaxpar.launch.ClusterSpec.origins
jaxpar.launch.ClusterSpec.process_id
jaxpar.launch.ClusterSpec.source
jaxpar.launch.K8sJob(workers, image, command, name, kind, port, namespace, gpus_per_worker, simulated_devices,
    cluster_time_out, env, servers, server_port, server_storage, ps_token_secret)
jaxpar.launch.K8sJob.cluster_time_out
jaxpar.launch.K8sJob.command
jaxpar.launch.K8sJob.coordinator_host
jaxpar.launch.K8sJob.env
jaxpar.launch.K8sJob.gpus_per_worker
jaxpar.launch.K8sJob.image
jaxpar.launch.K8sJob.kind
jaxpar.launch.K8sJob.name
jaxpar.launch.K8sJob.namespace
jaxpar.launch.K8sJob.port
jaxpar.launch.K8sJob.ps_token_secret
jaxpar.launch.K8sJob.server_port
jaxpar.launch.K8sJob.server_storage
jaxpar.launch.K8sJob.servers
jaxpar.launch.K8sJob.simulated_devices
jaxpar.launch.K8sJob.workers
jaxpar.launch.LaunchConfig(worker_num, local_worker_num, master_addr, master_port, node_rank, log_dir, join,
    cluster_time_out, simulated_devices, devices_per_worker, kill_time_out, exit_time_out, bind_address,
    servers, server_restarts, server_port, server_time_out, server_checkpoint_dir, server_module,
    server_checkpoint_every, worker_restarts)
jaxpar.launch.LaunchConfig.bind_address
jaxpar.launch.LaunchConfig.cluster_time_out
jaxpar.launch.LaunchConfig.coordinator_address
jaxpar.launch.LaunchConfig.devices_per_worker
jaxpar.launch.LaunchConfig.exit_time_out
jaxpar.launch.LaunchConfig.join
jaxpar.launch.LaunchConfig.kill_time_out
jaxpar.launch.LaunchConfig.local_worker_num
jaxpar.launch.LaunchConfig.log_dir
jaxpar.launch.LaunchConfig.master_addr
jaxpar.launch.LaunchConfig.master_port
jaxpar.launch.LaunchConfig.node_rank
jaxpar.launch.LaunchConfig.ranks
jaxpar.launch.LaunchConfig.server_checkpoint_dir
jaxpar.launch.LaunchConfig.server_checkpoint_every
jaxpar.launch.LaunchConfig.server_module
jaxpar.launch.LaunchConfig.server_port
jaxpar.launch.LaunchConfig.server_restarts
jaxpar.launch.LaunchConfig.server_time_out
jaxpar.launch.LaunchConfig.servers
jaxpar.launch.LaunchConfig.simulated_devices
jaxpar.launch.LaunchConfig.worker_num
jaxpar.launch.LaunchConfig.worker_restarts
jaxpar.launch.RankTable(path, port, ranks)
jaxpar.launch.RankTable.coordinator_address
jaxpar.launch.RankTable.path
jaxpar.launch.RankTable.port
jaxpar.launch.RankTable.ranks
jaxpar.launch.detect_cluster(env, coordinator_address, num_processes, process_id, local_device_ids, source,
    rank_table, hostname)
jaxpar.launch.k8s_manifest(job)
jaxpar.launch.launch(config, script, args, echo)
jaxpar.launch.load_rank_table(path)
jaxpar.make_mesh(config_or_axes, devices)
jaxpar.make_train_plan(config, mesh, model_or_state, tx, offload, source)
jaxpar.mesh.make_mesh(config_or_axes, devices)
jaxpar.mesh.resolve_axes(axes, num_devices)
jaxpar.metrics.JsonlWriter(path, append)
jaxpar.metrics.JsonlWriter.close()
jaxpar.metrics.JsonlWriter.write(step, scalars)
jaxpar.metrics.MetricsConfig(dir, every, tensorboard, learning_rate, peak_flops, tokens_per_example)
jaxpar.metrics.MetricsConfig.dir
jaxpar.metrics.MetricsConfig.every
jaxpar.metrics.MetricsConfig.jsonl_path
jaxpar.metrics.MetricsConfig.learning_rate
jaxpar.metrics.MetricsConfig.peak_flops
jaxpar.metrics.MetricsConfig.profile_dir
jaxpar.metrics.MetricsConfig.tensorboard
jaxpar.metrics.MetricsConfig.tokens_per_example
jaxpar.metrics.MetricsLogger(config, process_index)
jaxpar.metrics.MetricsLogger.close()
jaxpar.metrics.MetricsLogger.learning_rate(step, opt_state)
jaxpar.metrics.MetricsLogger.log(step, records, window_s, opt_state)
jaxpar.metrics.MetricsLogger.log_eval(step, loss)
jaxpar.metrics.MetricsLogger.mfu(step_time_s)
jaxpar.metrics.MetricsLogger.scalars(step, records, window_s, opt_state)
jaxpar.metrics.MetricsLogger.start(compiled, batch, num_devices, resumed)
jaxpar.metrics.MetricsLogger.write(step, values)
jaxpar.metrics.ProfileWindow(directory, steps)
jaxpar.metrics.ProfileWindow.after(step, outputs)
jaxpar.metrics.ProfileWindow.annotate(step)
jaxpar.metrics.ProfileWindow.before(step)
jaxpar.metrics.ProfileWindow.close()
jaxpar.metrics.ProfileWindow.files()
jaxpar.metrics.TensorBoardWriter(logdir)
jaxpar.metrics.TensorBoardWriter.close()
jaxpar.metrics.TensorBoardWriter.write(step, scalars)
jaxpar.metrics.check_profile_steps(steps)
jaxpar.metrics.progress_text(loss, tokens_per_s)
jaxpar.metrics.read(tree)
jaxpar.metrics.read_jsonl(path)
jaxpar.metrics.require_tensorboard(what)
jaxpar.metrics.tensorboard_tag(key)
jaxpar.metrics.tokens_per_example(batch)
jaxpar.models.data.ArithmeticData(seq_len, seed, lines)
jaxpar.models.data.ArithmeticData.batch(batch_size, step)
jaxpar.models.data.ArithmeticData.batches(batch_size, start)
jaxpar.models.data.arithmetic_text(lines, seed)
jaxpar.models.data.decode(ids)
jaxpar.models.data.encode(text)
jaxpar.models.dlrm.DLRM()
jaxpar.models.dlrm.DLRMConfig(field_rows, dense, embed, bottom, top)
jaxpar.models.dlrm.DLRMConfig.bottom
jaxpar.models.dlrm.DLRMConfig.check_ids(ids)
jaxpar.models.dlrm.DLRMConfig.dense
jaxpar.models.dlrm.DLRMConfig.embed
jaxpar.models.dlrm.DLRMConfig.field_rows
jaxpar.models.dlrm.DLRMConfig.offsets
jaxpar.models.dlrm.DLRMConfig.rows
jaxpar.models.dlrm.DLRMConfig.table_ids(ids)
jaxpar.models.dlrm.DLRMConfig.top
jaxpar.models.dlrm.MLP()
jaxpar.models.dlrm.loss_fn(model, batch, rows, inverse)
jaxpar.models.generate.greedy(model, prompt, new_tokens, window)
jaxpar.models.gpt.Attention()
jaxpar.models.gpt.Block()
jaxpar.models.gpt.GPT()
jaxpar.models.gpt.GPT.embed(tokens, positions)
jaxpar.models.gpt.GPT.logits(x)
jaxpar.models.gpt.GPT.run_blocks(x, positions)
jaxpar.models.gpt.GPTConfig(vocab_size, seq_len, embed, heads, mlp, layers, scan_layers, remat, dtype,
    dropout, fused_qkv, moe)
jaxpar.models.gpt.GPTConfig.dropout
jaxpar.models.gpt.GPTConfig.dtype
jaxpar.models.gpt.GPTConfig.embed
jaxpar.models.gpt.GPTConfig.fused_qkv
jaxpar.models.gpt.GPTConfig.head_dim
jaxpar.models.gpt.GPTConfig.heads
jaxpar.models.gpt.GPTConfig.layers
jaxpar.models.gpt.GPTConfig.mlp
jaxpar.models.gpt.GPTConfig.moe
jaxpar.models.gpt.GPTConfig.remat
jaxpar.models.gpt.GPTConfig.scan_layers
jaxpar.models.gpt.GPTConfig.seq_len
jaxpar.models.gpt.GPTConfig.vocab_size
jaxpar.models.gpt.LayerNorm()
jaxpar.models.gpt.MLP()
jaxpar.models.gpt.loss_fn(model, batch)
jaxpar.models.gpt.no_constraint(x, names)
jaxpar.models.gpt.pipeline_loss()
jaxpar.models.llama.Llama()
jaxpar.models.llama.Llama.embed(tokens)
jaxpar.models.llama.Llama.logits(x)
jaxpar.models.llama.Llama.run_blocks(x, segment_ids, positions)
jaxpar.models.llama.LlamaConfig(vocab_size, embed, heads, kv_heads, head_dim, mlp, layers, max_seq_len,
    rope_theta, rope_scaling, norm_eps, tie_embeddings, scan_layers, remat, attention, dtype, param_dtype,
    moe, moe_every)
jaxpar.models.llama.LlamaConfig.attention
jaxpar.models.llama.LlamaConfig.dtype
jaxpar.models.llama.LlamaConfig.embed
jaxpar.models.llama.LlamaConfig.groups
jaxpar.models.llama.LlamaConfig.head_dim
jaxpar.models.llama.LlamaConfig.heads
jaxpar.models.llama.LlamaConfig.is_moe(layer)
jaxpar.models.llama.LlamaConfig.kv_heads
jaxpar.models.llama.LlamaConfig.layers
jaxpar.models.llama.LlamaConfig.max_seq_len
jaxpar.models.llama.LlamaConfig.mlp
jaxpar.models.llama.LlamaConfig.moe
jaxpar.models.llama.LlamaConfig.moe_every
jaxpar.models.llama.LlamaConfig.named(name)
jaxpar.models.llama.LlamaConfig.norm_eps
jaxpar.models.llama.LlamaConfig.param_dtype
jaxpar.models.llama.LlamaConfig.remat
jaxpar.models.llama.LlamaConfig.rope_scaling
jaxpar.models.llama.LlamaConfig.rope_theta
jaxpar.models.llama.LlamaConfig.scan_layers
jaxpar.models.llama.LlamaConfig.tie_embeddings
jaxpar.models.llama.LlamaConfig.vocab_size
jaxpar.models.llama.RopeScaling(factor, low_freq_factor, high_freq_factor, original_max_positions)
jaxpar.models.llama.RopeScaling.factor
jaxpar.models.llama.RopeScaling.high_freq_factor
jaxpar.models.llama.RopeScaling.low_freq_factor
jaxpar.models.llama.RopeScaling.original_max_positions
jaxpar.models.llama.attention(q, k, v, segment_ids, kind)
jaxpar.models.llama.attention_implementation(kind, dtype, backend)
jaxpar.models.llama.describe(cfg)
jaxpar.models.llama.flops_per_token(cfg, seq_len)
jaxpar.models.llama.loss_fn(model, batch)
jaxpar.models.llama.param_count(cfg)
jaxpar.models.llama.pipeline_loss()
jaxpar.models.llama.rope_frequencies(head_dim, theta, scaling)
jaxpar.models.llama.segment_positions(segment_ids)
jaxpar.models.llama_config.LlamaConfig(vocab_size, embed, heads, kv_heads, head_dim, mlp, layers, max_seq_len,
    rope_theta, rope_scaling, norm_eps, tie_embeddings, scan_layers, remat, attention, dtype, param_dtype,
    moe, moe_every)
jaxpar.models.llama_config.LlamaConfig.attention
jaxpar.models.llama_config.LlamaConfig.dtype
jaxpar.models.llama_config.LlamaConfig.embed
jaxpar.models.llama_config.LlamaConfig.groups
jaxpar.models.llama_config.LlamaConfig.head_dim
jaxpar.models.llama_config.LlamaConfig.heads
jaxpar.models.llama_config.LlamaConfig.is_moe(layer)
jaxpar.models.llama_config.LlamaConfig.kv_heads
jaxpar.models.llama_config.LlamaConfig.layers
jaxpar.models.llama_config.LlamaConfig.max_seq_len
jaxpar.models.llama_config.LlamaConfig.mlp
jaxpar.models.llama_config.LlamaConfig.moe
jaxpar.models.llama_config.LlamaConfig.moe_every
jaxpar.models.llama_config.LlamaConfig.named(name)
jaxpar.models.llama_config.LlamaConfig.norm_eps
jaxpar.models.llama_config.LlamaConfig.param_dtype
jaxpar.models.llama_config.LlamaConfig.remat
jaxpar.models.llama_config.LlamaConfig.rope_scaling
jaxpar.models.llama_config.LlamaConfig.rope_theta
jaxpar.models.llama_config.LlamaConfig.scan_layers
jaxpar.models.llama_config.LlamaConfig.tie_embeddings
jaxpar.models.llama_config.LlamaConfig.vocab_size
jaxpar.models.llama_config.RopeScaling(factor, low_freq_factor, high_freq_factor, original_max_positions)
jaxpar.models.llama_config.RopeScaling.factor
jaxpar.models.llama_config.RopeScaling.high_freq_factor
jaxpar.models.llama_config.RopeScaling.low_freq_factor
jaxpar.models.llama_config.RopeScaling.original_max_positions
jaxpar.models.llama_config.describe(cfg)
jaxpar.models.llama_config.flops_per_token(cfg, seq_len)
jaxpar.models.llama_config.param_count(cfg)
jaxpar.models.llama_report.FlopsPerToken(params, count, seq_len, dense, attention)
jaxpar.models.llama_report.FlopsPerToken.attention
jaxpar.models.llama_report.FlopsPerToken.count
jaxpar.models.llama_report.FlopsPerToken.dense
jaxpar.models.llama_report.FlopsPerToken.params
jaxpar.models.llama_report.FlopsPerToken.seq_len
jaxpar.models.llama_report.FlopsPerToken.summary()
jaxpar.models.llama_report.FlopsPerToken.total
jaxpar.models.llama_report.ModelReport(name, description, mesh, zero_level, batch, seq_len, attention,
    attention_setting, backend, remat, flops, memory, compiled, compiled_note, throughput)
jaxpar.models.llama_report.ModelReport.attention
jaxpar.models.llama_report.ModelReport.attention_setting
jaxpar.models.llama_report.ModelReport.backend
jaxpar.models.llama_report.ModelReport.batch
jaxpar.models.llama_report.ModelReport.compiled
jaxpar.models.llama_report.ModelReport.compiled_note
jaxpar.models.llama_report.ModelReport.description
jaxpar.models.llama_report.ModelReport.flops
jaxpar.models.llama_report.ModelReport.flops_per_step
jaxpar.models.llama_report.ModelReport.format()
jaxpar.models.llama_report.ModelReport.memory
jaxpar.models.llama_report.ModelReport.mesh
jaxpar.models.llama_report.ModelReport.name
jaxpar.models.llama_report.ModelReport.num_devices
jaxpar.models.llama_report.ModelReport.remat
jaxpar.models.llama_report.ModelReport.seq_len
jaxpar.models.llama_report.ModelReport.summary()
jaxpar.models.llama_report.ModelReport.throughput
jaxpar.models.llama_report.ModelReport.zero_level
jaxpar.models.llama_report.format_model_report(r)
jaxpar.models.llama_report.llama_activation_bytes(cfg, plan, batch, seq_len, compute_dtype, attention)
jaxpar.models.llama_report.llama_config(model)
jaxpar.models.llama_report.llama_flops_per_token(cfg, seq_len, count)
jaxpar.models.llama_report.llama_report(model, config, batch, seq_len, mesh, tx, step_time_s, peak_flops,
    device_kind, backend, param_dtype, grad_dtype, opt_state_dtype, compute_dtype, compiled, compiled_note)
jaxpar.models.llama_report.matmul_params(cfg)
jaxpar.nn.HostEmbedding(name, num_rows, dim, optimizer, init, init_scale, seed, storage, path, device)
jaxpar.nn.HostEmbedding.apply(prepared, row_grads)
jaxpar.nn.HostEmbedding.block_until_ready()
jaxpar.nn.HostEmbedding.close()
jaxpar.nn.HostEmbedding.gather(unique)
jaxpar.nn.HostEmbedding.numpy()
jaxpar.nn.HostEmbedding.prepare(ids)
jaxpar.nn.HostEmbedding.pull(prepared, sharding)
jaxpar.nn.HostEmbeddingStep(model, tx, loss_fn, table, config, mesh)
jaxpar.nn.HostEmbeddingStep.model
jaxpar.nn.MoE()
jaxpar.nn.MoEAuxLoss()
jaxpar.nn.MoEConfig(experts, top_k, expert_mlp, score, renormalize, shared_experts, aux_loss_weight,
    z_loss_weight, capacity_factor, bucket_growth, transport)
jaxpar.nn.MoEConfig.aux_loss_weight
jaxpar.nn.MoEConfig.bucket_growth
jaxpar.nn.MoEConfig.capacity_factor
jaxpar.nn.MoEConfig.expert_mlp
jaxpar.nn.MoEConfig.experts
jaxpar.nn.MoEConfig.renormalize
jaxpar.nn.MoEConfig.score
jaxpar.nn.MoEConfig.shared_experts
jaxpar.nn.MoEConfig.top_k
jaxpar.nn.MoEConfig.transport
jaxpar.nn.MoEConfig.z_loss_weight
jaxpar.nn.MoEMetric()
jaxpar.nn.RowOptimizer(kind, learning_rate, initial_accumulator_value, eps)
jaxpar.nn.RowOptimizer.eps
jaxpar.nn.RowOptimizer.init_slot(shape, dtype)
jaxpar.nn.RowOptimizer.initial_accumulator_value
jaxpar.nn.RowOptimizer.kind
jaxpar.nn.RowOptimizer.learning_rate
jaxpar.nn.RowOptimizer.update(rows, slot, grads)
jaxpar.nn.abstract_model(model_fn)
jaxpar.nn.format_plan(rows, title)
jaxpar.nn.init(model_fn, config, mesh)
jaxpar.nn.init_program(model_fn, config, mesh)
jaxpar.nn.model_constraint(mesh, config)
jaxpar.nn.moe_aux_loss(model)
jaxpar.nn.moe_metrics(model)
jaxpar.nn.place(model, config, mesh)
jaxpar.nn.plan_rows(state, specs, mesh)
jaxpar.nn.plan_state(config, mesh, state, check_unused)
jaxpar.nn.route(logits, cfg)
jaxpar.nn.to_shardings(specs, mesh)
jaxpar.ops.ContextParallel(constrain, mesh, config, residual)
jaxpar.ops.ContextParallel.attention(q, k, v, segment_ids, positions)
jaxpar.ops.ContextParallel.rules
jaxpar.ops.attention(q, k, v, heads_axis, batch_axis, mesh, causal, scale)
jaxpar.ops.context_attention(q, k, v, axis, strategy, mesh, causal, segment_ids, q_positions, kv_positions,
    batch_axis, heads_axis, scale)
jaxpar.ops.conv2d(x, w, spatial_axes, strategy, mesh, padding, stride, rules, precision)
jaxpar.ops.dense(x, w, b, in_strategy, out_strategy, mesh, rules, precision)
jaxpar.ops.describe_balance(seq_len, cp, block)
jaxpar.ops.embedding(ids, table, vocab_axis, mesh, manual_split, batch_axis)
jaxpar.ops.matmul(x, w, in_strategy, out_strategy, mesh, rules, precision)
jaxpar.ops.matmul_2d(x, w, row_axis, col_axis, mesh, precision)
jaxpar.ops.moe_dispatch(x, expert_ids, weights, gate, up, down, expert_axis, batch_axis, mlp_axis, mesh,
    capacity_factor, bucket_growth, transport)
jaxpar.ops.pad_for_manual_split(table, manual_split)
jaxpar.ops.ragged_all_to_all_supported(backend)
jaxpar.ops.unpad(padded, manual_split)
jaxpar.optim.ZeroPlan(compute, params, grads, state, axes, unsharded)
jaxpar.optim.ZeroPlan.axes
jaxpar.optim.ZeroPlan.compute
jaxpar.optim.ZeroPlan.grads
jaxpar.optim.ZeroPlan.params
jaxpar.optim.ZeroPlan.state
jaxpar.optim.ZeroPlan.unsharded
jaxpar.optim.accumulate_grads(compute_grads, k, constrain_grads, constrain_parts, dtype)
jaxpar.optim.bucketed_psum(grads, axes, bucket, keys)
jaxpar.optim.compiler_options(fusion, platform)
jaxpar.optim.interleave_loss(compute_loss, n, constrain_parts)
jaxpar.optim.on_host(shardings)
jaxpar.optim.opt_state_specs(tx, state_param_specs, params)
jaxpar.optim.shard_optimizer(tx, mesh, plan, params)
jaxpar.optim.split_batch(batch, k, constrain)
jaxpar.optim.to_device(tree, shardings)
jaxpar.optim.zero_axes(config, mesh)
jaxpar.optim.zero_plan(config, mesh, param_specs, params)
jaxpar.optim.zero_spec(spec, shape, itemsize, axes, sizes, threshold_kb)
jaxpar.pipeline.Kind(value, names, module, qualname, type, start, boundary)
jaxpar.pipeline.Kind.B
jaxpar.pipeline.Kind.F
jaxpar.pipeline.Kind.W
jaxpar.pipeline.Op(kind, microbatch, chunk)
jaxpar.pipeline.Op.chunk
jaxpar.pipeline.Op.kind
jaxpar.pipeline.Op.label(virtual_stages)
jaxpar.pipeline.Op.microbatch
jaxpar.pipeline.PipelineLoss(embed, blocks, head, head_loss, embedding, embed_inputs, block_call, aux_loss)
jaxpar.pipeline.PipelineLoss.aux_loss
jaxpar.pipeline.PipelineLoss.block_call
jaxpar.pipeline.PipelineLoss.blocks
jaxpar.pipeline.PipelineLoss.embed
jaxpar.pipeline.PipelineLoss.embed_inputs
jaxpar.pipeline.PipelineLoss.embedding
jaxpar.pipeline.PipelineLoss.head
jaxpar.pipeline.PipelineLoss.head_loss
jaxpar.pipeline.Program(code, x_slots, g_slots, split_backward, sends_x, sends_g, forward_only)
jaxpar.pipeline.Program.code
jaxpar.pipeline.Program.forward_only
jaxpar.pipeline.Program.g_slots
jaxpar.pipeline.Program.sends_g
jaxpar.pipeline.Program.sends_x
jaxpar.pipeline.Program.split_backward
jaxpar.pipeline.Program.steps
jaxpar.pipeline.Program.x_slots
jaxpar.pipeline.Schedule(name, stages, microbatches, virtual_stages, table, placement)
jaxpar.pipeline.Schedule.cost(kind)
jaxpar.pipeline.Schedule.microbatches
jaxpar.pipeline.Schedule.name
jaxpar.pipeline.Schedule.ops(stage)
jaxpar.pipeline.Schedule.placement
jaxpar.pipeline.Schedule.split_backward
jaxpar.pipeline.Schedule.stages
jaxpar.pipeline.Schedule.table
jaxpar.pipeline.Schedule.ticks
jaxpar.pipeline.Schedule.virtual_stages
jaxpar.pipeline.StagedLoss(order, stages, embedding, embed_inputs, head, head_loss)
jaxpar.pipeline.StagedLoss.embed_inputs
jaxpar.pipeline.StagedLoss.embedding
jaxpar.pipeline.StagedLoss.head
jaxpar.pipeline.StagedLoss.head_loss
jaxpar.pipeline.StagedLoss.order
jaxpar.pipeline.StagedLoss.stages
jaxpar.pipeline.best_split(costs, virtual, first, last)
jaxpar.pipeline.branches.BranchKey
jaxpar.pipeline.branches.make_branches(keys, stage_fn, loss_fn, embed_fn, split, m, forward_only, stats)
jaxpar.pipeline.branches.stats_dtype(dtype)
jaxpar.pipeline.bubble_fraction(schedule)
jaxpar.pipeline.build(name, p, m, v)
jaxpar.pipeline.drawing.plot_timeline(schedule, path)
jaxpar.pipeline.drawing.timeline(schedule, wrap)
jaxpar.pipeline.dualpipe_v(p, m)
jaxpar.pipeline.executor.Program(code, x_slots, g_slots, split_backward, sends_x, sends_g, forward_only)
jaxpar.pipeline.executor.Program.code
jaxpar.pipeline.executor.Program.forward_only
jaxpar.pipeline.executor.Program.g_slots
jaxpar.pipeline.executor.Program.sends_g
jaxpar.pipeline.executor.Program.sends_x
jaxpar.pipeline.executor.Program.split_backward
jaxpar.pipeline.executor.Program.steps
jaxpar.pipeline.executor.Program.x_slots
jaxpar.pipeline.executor.forward_only(schedule)
jaxpar.pipeline.executor.from_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.executor.lower(schedule)
jaxpar.pipeline.executor.pipeline_forward(stage_fn, loss_fn, schedule, mesh, stage_params, head_params,
    inputs, targets, axis, specs, consts, embed_fn, embed_params, stage_batch, stage_aux)
jaxpar.pipeline.executor.pipeline_loss(stage_fn, loss_fn, schedule, mesh, axis, specs, with_consts, embed_fn,
    stage_batch, stage_aux)
jaxpar.pipeline.executor.pipeline_value_and_grad(stage_fn, loss_fn, schedule, mesh, stage_params, head_params,
    inputs, targets, axis, specs, consts, embed_fn, embed_params, stage_batch, stage_aux)
jaxpar.pipeline.executor.to_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.forward_only(schedule)
jaxpar.pipeline.from_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.gpipe(p, m)
jaxpar.pipeline.interleaved(p, m, v)
jaxpar.pipeline.location(placement, p, k)
jaxpar.pipeline.lower(schedule)
jaxpar.pipeline.module_paths(model, order)
jaxpar.pipeline.one_f_one_b(p, m)
jaxpar.pipeline.peak_activations(schedule, until)
jaxpar.pipeline.pipeline_forward(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs,
    targets, axis, specs, consts, embed_fn, embed_params, stage_batch, stage_aux)
jaxpar.pipeline.pipeline_loss(stage_fn, loss_fn, schedule, mesh, axis, specs, with_consts, embed_fn,
    stage_batch, stage_aux)
jaxpar.pipeline.pipeline_value_and_grad(stage_fn, loss_fn, schedule, mesh, stage_params, head_params, inputs,
    targets, axis, specs, consts, embed_fn, embed_params, stage_batch, stage_aux)
jaxpar.pipeline.pipelined(loss, config, mesh, specs)
jaxpar.pipeline.plot_timeline(schedule, path)
jaxpar.pipeline.program.Program(code, x_slots, g_slots, split_backward, sends_x, sends_g, forward_only)
jaxpar.pipeline.program.Program.code
jaxpar.pipeline.program.Program.forward_only
jaxpar.pipeline.program.Program.g_slots
jaxpar.pipeline.program.Program.sends_g
jaxpar.pipeline.program.Program.sends_x
jaxpar.pipeline.program.Program.split_backward
jaxpar.pipeline.program.Program.steps
jaxpar.pipeline.program.Program.x_slots
jaxpar.pipeline.program.forward_only(schedule)
jaxpar.pipeline.program.lower(schedule)
jaxpar.pipeline.schedules.Kind(value, names, module, qualname, type, start, boundary)
jaxpar.pipeline.schedules.Kind.B
jaxpar.pipeline.schedules.Kind.F
jaxpar.pipeline.schedules.Kind.W
jaxpar.pipeline.schedules.Op(kind, microbatch, chunk)
jaxpar.pipeline.schedules.Op.chunk
jaxpar.pipeline.schedules.Op.kind
jaxpar.pipeline.schedules.Op.label(virtual_stages)
jaxpar.pipeline.schedules.Op.microbatch
jaxpar.pipeline.schedules.Schedule(name, stages, microbatches, virtual_stages, table, placement)
jaxpar.pipeline.schedules.Schedule.cost(kind)
jaxpar.pipeline.schedules.Schedule.microbatches
jaxpar.pipeline.schedules.Schedule.name
jaxpar.pipeline.schedules.Schedule.ops(stage)
jaxpar.pipeline.schedules.Schedule.placement
jaxpar.pipeline.schedules.Schedule.split_backward
jaxpar.pipeline.schedules.Schedule.stages
jaxpar.pipeline.schedules.Schedule.table
jaxpar.pipeline.schedules.Schedule.ticks
jaxpar.pipeline.schedules.Schedule.virtual_stages
jaxpar.pipeline.schedules.bubble_fraction(schedule)
jaxpar.pipeline.schedules.build(name, p, m, v)
jaxpar.pipeline.schedules.gpipe(p, m)
jaxpar.pipeline.schedules.interleaved(p, m, v)
jaxpar.pipeline.schedules.location(placement, p, k)
jaxpar.pipeline.schedules.one_f_one_b(p, m)
jaxpar.pipeline.schedules.peak_activations(schedule, until)
jaxpar.pipeline.schedules.plot_timeline(schedule, path)
jaxpar.pipeline.schedules.timeline(schedule, wrap)
jaxpar.pipeline.schedules.validate(schedule)
jaxpar.pipeline.schedules.virtual_stage(placement, p, stage, chunk)
jaxpar.pipeline.schedules.zb_h1(p, m)
jaxpar.pipeline.stage_layout.from_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.stage_layout.to_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.stages.StagedLoss(order, stages, embedding, embed_inputs, head, head_loss)
jaxpar.pipeline.stages.StagedLoss.embed_inputs
jaxpar.pipeline.stages.StagedLoss.embedding
jaxpar.pipeline.stages.StagedLoss.head
jaxpar.pipeline.stages.StagedLoss.head_loss
jaxpar.pipeline.stages.StagedLoss.order
jaxpar.pipeline.stages.StagedLoss.stages
jaxpar.pipeline.stages.assign(paths, stages, virtual)
jaxpar.pipeline.stages.best_split(costs, virtual, first, last)
jaxpar.pipeline.stages.module_paths(model, order)
jaxpar.pipeline.stages.named_modules(model, order)
jaxpar.pipeline.stages.stage_costs(costs, where, first, last)
jaxpar.pipeline.stages.staged(loss, config, mesh, specs)
jaxpar.pipeline.timeline(schedule, wrap)
jaxpar.pipeline.to_stage_layout(tree, stages, virtual_stages, placement)
jaxpar.pipeline.validate(schedule)
jaxpar.pipeline.virtual_stage(placement, p, stage, chunk)
jaxpar.pipeline.vshape.dualpipe_v(p, m)
jaxpar.pipeline.vshape.zb_v(p, m)
jaxpar.pipeline.zb_h1(p, m)
jaxpar.pipeline.zb_v(p, m)
jaxpar.plan.TrainPlan(config, mesh, source, params, stored, grads, update, opt_state, rest, zero_axes,
    unsharded, offload, shapes)
jaxpar.plan.TrainPlan.batch_axes()
jaxpar.plan.TrainPlan.batch_specs(batch)
jaxpar.plan.TrainPlan.config
jaxpar.plan.TrainPlan.diff(other)
jaxpar.plan.TrainPlan.from_dict(d)
jaxpar.plan.TrainPlan.from_json(path)
jaxpar.plan.TrainPlan.grad_accum
jaxpar.plan.TrainPlan.grads
jaxpar.plan.TrainPlan.interleave
jaxpar.plan.TrainPlan.loss_runs
jaxpar.plan.TrainPlan.mesh
jaxpar.plan.TrainPlan.offload
jaxpar.plan.TrainPlan.opt_state
jaxpar.plan.TrainPlan.params
jaxpar.plan.TrainPlan.pipeline
jaxpar.plan.TrainPlan.precision
jaxpar.plan.TrainPlan.remat
jaxpar.plan.TrainPlan.rest
jaxpar.plan.TrainPlan.rows()
jaxpar.plan.TrainPlan.shapes
jaxpar.plan.TrainPlan.shardings(section, like, mesh)
jaxpar.plan.TrainPlan.source
jaxpar.plan.TrainPlan.specs(section, like)
jaxpar.plan.TrainPlan.stored
jaxpar.plan.TrainPlan.summary()
jaxpar.plan.TrainPlan.table(width)
jaxpar.plan.TrainPlan.to_dict()
jaxpar.plan.TrainPlan.to_json(path)
jaxpar.plan.TrainPlan.unsharded
jaxpar.plan.TrainPlan.update
jaxpar.plan.TrainPlan.zero(params_like)
jaxpar.plan.TrainPlan.zero_axes
jaxpar.plan.TrainPlan.zero_level
jaxpar.plan.TrainState(params, rest, opt_state, step, data)
jaxpar.plan.TrainState.attach(token)
jaxpar.plan.TrainState.data
jaxpar.plan.TrainState.detach()
jaxpar.plan.TrainState.opt_state
jaxpar.plan.TrainState.params
jaxpar.plan.TrainState.replace()
jaxpar.plan.TrainState.rest
jaxpar.plan.TrainState.step
jaxpar.plan.TrainState.tree_flatten_with_keys()
jaxpar.plan.TrainState.tree_unflatten(data, children)
jaxpar.plan.check_data(data, what)
jaxpar.plan.flat_paths(tree)
jaxpar.plan.init_state(plan, mesh, model, tx, data)
jaxpar.plan.make_train_plan(config, mesh, model_or_state, tx, offload, source)
jaxpar.plan.state_shardings(plan, mesh, state)
jaxpar.plan_cli.SearchSettings(search, config, annotate, memory_budget, zero_levels, accum, remat, stages,
    microbatches, schedule, context, context_strategies, costs, plan_out)
jaxpar.plan_cli.SearchSettings.accum
jaxpar.plan_cli.SearchSettings.annotate
jaxpar.plan_cli.SearchSettings.config
jaxpar.plan_cli.SearchSettings.context
jaxpar.plan_cli.SearchSettings.context_strategies
jaxpar.plan_cli.SearchSettings.costs
jaxpar.plan_cli.SearchSettings.memory_budget
jaxpar.plan_cli.SearchSettings.microbatches
jaxpar.plan_cli.SearchSettings.plan_out
jaxpar.plan_cli.SearchSettings.remat
jaxpar.plan_cli.SearchSettings.schedule
jaxpar.plan_cli.SearchSettings.search
jaxpar.plan_cli.SearchSettings.stages
jaxpar.plan_cli.SearchSettings.zero_levels
jaxpar.plan_cli.add_plan_search_arguments(parser)
jaxpar.plan_cli.annotation(text)
jaxpar.plan_cli.context_strategy_list(text)
jaxpar.plan_cli.int_list(flag, low)
jaxpar.plan_cli.name_list(flag, choices, what)
jaxpar.plan_cli.number(flag, kind, low, above)
jaxpar.plan_cli.remat_list(text)
jaxpar.plan_cli.run_plan_search(s, job, build_job)
jaxpar.plan_cli.search_settings(args, job)
jaxpar.precision.Precision(params, compute, reduce, opt_state)
jaxpar.precision.Precision.compute
jaxpar.precision.Precision.label
jaxpar.precision.Precision.named(name)
jaxpar.precision.Precision.opt_state
jaxpar.precision.Precision.params
jaxpar.precision.Precision.reduce
jaxpar.precision.as_precision(value)
jaxpar.precision.cast_floats(tree, dtype)
jaxpar.precision.cast_like(tree, like)
jaxpar.precision.with_precision(tx, precision)
jaxpar.ps.Adagrad(lr, initial_accumulator, eps)
jaxpar.ps.Adagrad.apply(w, slots, g)
jaxpar.ps.Adagrad.eps
jaxpar.ps.Adagrad.initial_accumulator
jaxpar.ps.Adagrad.lr
jaxpar.ps.Adagrad.slots(rows, dim)
jaxpar.ps.Adam(lr, b1, b2, eps)
jaxpar.ps.Adam.apply(w, slots, g)
jaxpar.ps.Adam.b1
jaxpar.ps.Adam.b2
jaxpar.ps.Adam.eps
jaxpar.ps.Adam.lr
jaxpar.ps.Adam.slots(rows, dim)
jaxpar.ps.Client(tables, mode, staleness, addresses, token, timeout, worker, workers, resend)
jaxpar.ps.Client.close()
jaxpar.ps.Client.next_step()
jaxpar.ps.Client.pull(table, ids, step)
jaxpar.ps.Client.pull_many(ids, step)
jaxpar.ps.Client.push(table, ids, grads, step, pulled_at)
jaxpar.ps.Client.push_many(grads, step, pulled_at)
jaxpar.ps.Client.restore(step)
jaxpar.ps.Client.save(step)
jaxpar.ps.Client.stats()
jaxpar.ps.Lookup(unique, index)
jaxpar.ps.Lookup.index
jaxpar.ps.Lookup.unique
jaxpar.ps.SGD(lr)
jaxpar.ps.SGD.apply(w, slots, g)
jaxpar.ps.SGD.lr
jaxpar.ps.SGD.slots(rows, dim)
jaxpar.ps.SparseTrainer(client, model, tx, loss_fn, fields, mesh, batch_axis, prefetch, buckets)
jaxpar.ps.SparseTrainer.fit(batches, steps)
jaxpar.ps.SparseTrainer.model
jaxpar.ps.SparseTrainer.restore(state)
jaxpar.ps.SparseTrainer.save()
jaxpar.ps.SparseTrainer.step(batch)
jaxpar.ps.TableSpec(name, rows, dim, optimizer, partition, init_scale, seed)
jaxpar.ps.TableSpec.dim
jaxpar.ps.TableSpec.from_json(d)
jaxpar.ps.TableSpec.init_scale
jaxpar.ps.TableSpec.local(ids, count)
jaxpar.ps.TableSpec.name
jaxpar.ps.TableSpec.optimizer
jaxpar.ps.TableSpec.owner(ids, count)
jaxpar.ps.TableSpec.partition
jaxpar.ps.TableSpec.rows
jaxpar.ps.TableSpec.seed
jaxpar.ps.TableSpec.shard_ids(index, count)
jaxpar.ps.TableSpec.to_json()
jaxpar.ps.bucket_size(n, buckets)
jaxpar.ps.connect(tables, mode, staleness, addresses, token, timeout, worker, workers)
jaxpar.ps.init_rows(spec, ids)
jaxpar.ps.lookup(batch, fields)
jaxpar.remat(fn_or_module, policy)
jaxpar.remat.checkpoint_policy(name)
jaxpar.remat.remat(fn_or_module, policy)
jaxpar.report.Collective(name, kind, dtype, shapes, bytes, replica_groups, group_size, num_groups, mesh_axes,
    in_loop, executions, is_async, source_target_pairs, computation)
jaxpar.report.Collective.bytes
jaxpar.report.Collective.computation
jaxpar.report.Collective.dtype
jaxpar.report.Collective.executions
jaxpar.report.Collective.group_size
jaxpar.report.Collective.in_loop
jaxpar.report.Collective.is_async
jaxpar.report.Collective.kind
jaxpar.report.Collective.mesh_axes
jaxpar.report.Collective.name
jaxpar.report.Collective.num_groups
jaxpar.report.Collective.replica_groups
jaxpar.report.Collective.shapes
jaxpar.report.Collective.source_target_pairs
jaxpar.report.MemoryEstimate(params, grads, opt_state, activations, zero_level, dtypes, host)
jaxpar.report.MemoryEstimate.activations
jaxpar.report.MemoryEstimate.dtypes
jaxpar.report.MemoryEstimate.grads
jaxpar.report.MemoryEstimate.host
jaxpar.report.MemoryEstimate.opt_state
jaxpar.report.MemoryEstimate.params
jaxpar.report.MemoryEstimate.summary()
jaxpar.report.MemoryEstimate.total
jaxpar.report.MemoryEstimate.zero_level
jaxpar.report.MemoryReport(argument_bytes, output_bytes, temp_bytes, alias_bytes, generated_code_bytes)
jaxpar.report.MemoryReport.alias_bytes
jaxpar.report.MemoryReport.argument_bytes
jaxpar.report.MemoryReport.generated_code_bytes
jaxpar.report.MemoryReport.output_bytes
jaxpar.report.MemoryReport.temp_bytes
jaxpar.report.MemoryReport.total
jaxpar.report.StepReport(memory, collectives, flops, params)
jaxpar.report.StepReport.collective_lines()
jaxpar.report.StepReport.collectives
jaxpar.report.StepReport.flops
jaxpar.report.StepReport.format(detail)
jaxpar.report.StepReport.memory
jaxpar.report.StepReport.params
jaxpar.report.StepReport.summary()
jaxpar.report.Throughput(step_time_s, tokens_per_step, num_devices, flops_per_token, device_kind, dtype,
    peak_flops, mfu, peak_source)
jaxpar.report.Throughput.device_kind
jaxpar.report.Throughput.dtype
jaxpar.report.Throughput.flops_per_token
jaxpar.report.Throughput.mfu
jaxpar.report.Throughput.mfu_text
jaxpar.report.Throughput.num_devices
jaxpar.report.Throughput.peak_flops
jaxpar.report.Throughput.peak_source
jaxpar.report.Throughput.step_time_s
jaxpar.report.Throughput.summary()
jaxpar.report.Throughput.tokens_per_s_per_device
jaxpar.report.Throughput.tokens_per_step
jaxpar.report.collective_summary(cols)
jaxpar.report.collectives(compiled_or_hlo_text, mesh)
jaxpar.report.estimate_memory(plan, tx, param_dtype, grad_dtype, opt_state_dtype, activations)
jaxpar.report.flops(compiled)
jaxpar.report.format_bytes(n)
jaxpar.report.format_collectives(cols, width)
jaxpar.report.format_memory(m, width)
jaxpar.report.format_schedule(config_or_schedule)
jaxpar.report.memory(compiled)
jaxpar.report.mfu(flops_per_step, step_time_s, peak_flops_per_device, num_devices)
jaxpar.report.param_table(trainer)
jaxpar.report.peak_flops(device_kind, dtype)
jaxpar.report.peak_table()
jaxpar.report.schedule_of(config)
jaxpar.report.step_report(trainer, batch)
jaxpar.report.throughput(flops_per_token, tokens_per_step, step_time_s, num_devices, device_kind, dtype,
    peak_flops)
jaxpar.report_cli.add_model_report_arguments(p)
jaxpar.report_cli.check_model_report_flags(args, refuse)
jaxpar.report_cli.compiled_llama_memory(model, config, batch, seq_len, tx)
jaxpar.report_cli.run_llama_report(args, devices, config, batch, print_text)
jaxpar.shard(target, strategy, in_strategy, out_strategy, mesh, rules)
jaxpar.shard.LogicalConstraint(mesh, rules)
jaxpar.shard.LogicalConstraint.spec(shape, names)
jaxpar.shard.ShardedModule()
jaxpar.shard.shard(target, strategy, in_strategy, out_strategy, mesh, rules)
jaxpar.strategy.Layout(device_matrix, alias_name)
jaxpar.strategy.Layout.alias_name
jaxpar.strategy.Layout.axis_sizes()
jaxpar.strategy.Layout.device_matrix
jaxpar.strategy.Layout.mesh(devices)
jaxpar.strategy.Layout.size
jaxpar.strategy.LayoutSpec(layout, tensor_map)
jaxpar.strategy.LayoutSpec.layout
jaxpar.strategy.LayoutSpec.tensor_map
jaxpar.strategy.LayoutSpec.to_partition_spec()
jaxpar.strategy.check_spec(spec, mesh, shape, strategy)
jaxpar.strategy.is_integer_strategy(strategy)
jaxpar.strategy.logical_axes(entry, sizes, rules)
jaxpar.strategy.manual_axes()
jaxpar.strategy.mesh_sizes(mesh)
jaxpar.strategy.recording_rules()
jaxpar.strategy.shard_count(spec, mesh)
jaxpar.strategy.spec_axes(entry)
jaxpar.strategy.to_partition_spec(strategy, mesh, shape, rules)
jaxpar.to_partition_spec(strategy, mesh, shape, rules)
jaxpar.train.Preempted(step, directory)
jaxpar.train.Trainer(model, tx, loss_fn, config, mesh, plan, global_batch, donate, offload, example_batch,
    checkpoint_dir, save_every, keep, nonfinite, resume, preemption, metrics, profile_steps)
jaxpar.train.Trainer.check_finite()
jaxpar.train.Trainer.close()
jaxpar.train.Trainer.compute_specs
jaxpar.train.Trainer.config
jaxpar.train.Trainer.data_state
jaxpar.train.Trainer.evaluate(batches, steps)
jaxpar.train.Trainer.fit(batches, steps, log_every, progress, callback)
jaxpar.train.Trainer.lower(batch)
jaxpar.train.Trainer.lower_eval(batch)
jaxpar.train.Trainer.lower_grads(batch)
jaxpar.train.Trainer.model
jaxpar.train.Trainer.offload
jaxpar.train.Trainer.opt_state
jaxpar.train.Trainer.param_specs
jaxpar.train.Trainer.params
jaxpar.train.Trainer.place(batch)
jaxpar.train.Trainer.rest
jaxpar.train.Trainer.restore(directory, step)
jaxpar.train.Trainer.save(directory, data_state)
jaxpar.train.Trainer.shardings
jaxpar.train.Trainer.state
jaxpar.train.Trainer.step(batch)
jaxpar.train.Trainer.step_count
jaxpar.train.Trainer.zero
jaxpar.train.compile_step(model_fn, loss_fn, batch, config, tx)
"""
