"""Former public names: kept working for one release with a ``DeprecationWarning`` that names
the replacement, or refused with an error that names what to use and the page that shows it.

One table, `FORMER`, lists every public name of the 0.1.0 surface that was renamed, moved or
removed since (``CHANGELOG.md`` lists the same with their migrations):

* `Renamed` — a faithful replacement exists: the former name still works and warns once per
  use site (``DeprecationWarning``, shown by default in ``__main__`` and under pytest);
* `Removed` — nothing behaves as the former name did: using it raises ``AttributeError``
  (a module attribute), ``ModuleNotFoundError`` (a module) or ``TypeError`` (a keyword; a
  ``ValueError`` for the removed host offload, `OFFLOAD`, whose settings were values),
  naming the replacement and the doc page.

A package or module hands its unknown attribute names to `former_attribute` (its module
``__getattr__``, `module_getattr`); former module paths are found by `FormerModuleFinder`,
installed by `install_module_finder` at the end of ``sys.meta_path`` (consulted only for a
module that no longer exists). Keyword arguments and class attributes use `renamed_keywords`,
`removed_keywords`, `RenamedAttribute` and `RemovedAttribute`. Replacements are imported by
name, and only when a former name is asked for, so the current names' imports are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

CHANGELOG = "CHANGELOG.md"
SINCE = "0.1.0"
UNTIL = "through the next release"


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A former name that still works for one release. ``new``: ``"module:attribute"``, or a
    module path for a former module (``renames``: its former attribute names → current ones).
    ``note``: what else changed, said after the replacement."""

    new: str
    note: str = ""
    renames: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def display(self) -> str:
        """The replacement as a user writes it: ``jaxpar.auto.Strategy``."""
        return self.new.replace(":", ".")


@dataclasses.dataclass(frozen=True)
class Removed:
    """A former name with no faithful replacement: ``instead`` says what to use, ``doc`` is
    the page (``docs/x.md``) that shows it."""

    instead: str
    doc: str


def renamed_message(old: str, entry: Renamed) -> str:
    note = f" ({entry.note})" if entry.note else ""
    return (f"{old} is deprecated: use {entry.display} instead{note}; the former name works {UNTIL} "
            f"(see {CHANGELOG})")


def removed_message(old: str, entry: Removed) -> str:
    return f"{old} was removed after jaxpar {SINCE}: {entry.instead} (see {entry.doc} and {CHANGELOG})"


def refusal(what: str, entry: Removed) -> str:
    """A removed setting refused where it is given: ``what`` (``"Placement(offload='params')"``),
    then what to use instead and the page."""
    return f"{what}: {entry.instead} (see {entry.doc} and {CHANGELOG})"


# ------------------------------------------------------------------ host offload (removed)
# Issue #42: a mode stays when it lowers the peak by >= 80 % of the bytes it moves at <= 1.25x the
# step. Measured on one H200 (jax 0.11.2; benchmarks/results/gpu_nvidia_h200*.json) none did.
OFFLOAD = Removed(
    "host offload was removed in this release because it did not pay on a GPU (one H200, Llama-1B shape, "
    "8 x 2048 tokens: offload='opt_state' made the step 2.17x slower, offload='params' 1.42x with no lower "
    "peak, remat='offload_dots' 1.88x); to lower device memory use ZeRO-3 parameter sharding "
    "(ParallelConfig(optimizer={'level': 3})), recompute (ParallelConfig(remat='full') or "
    "remat='dots_with_no_batch_dims_saveable'), gradient accumulation (ParallelConfig(grad_accum=4)) or "
    "the model's chunked loss (LlamaConfig(loss_chunks=8), GPTConfig(loss_chunks=8))",
    "docs/offload.md")
# recompute policies that offloaded: ParallelConfig.remat, jaxpar.remat and the job search refuse them
REMOVED_POLICIES: dict[str, Removed] = {"offload_dots": OFFLOAD}


def offload_removed(what: str) -> ValueError:
    """The ``ValueError`` that refuses a host-offload setting ``what`` (``"Placement(offload='params')"``)."""
    return ValueError(refusal(what, OFFLOAD))


def check_policy(name: Any, what: str) -> None:
    """Refuse a recompute policy ``name`` that was removed (`REMOVED_POLICIES`); ``what`` says
    where it was given (``"ParallelConfig(remat='offload_dots')"``)."""
    if isinstance(name, str) and name in REMOVED_POLICIES:
        raise ValueError(refusal(what, REMOVED_POLICIES[name]))


def warn_renamed(old: str, entry: Renamed, stacklevel: int = 2) -> None:
    """The ``DeprecationWarning`` of a former name, pointed at ``stacklevel`` frames up."""
    warnings.warn(renamed_message(old, entry), DeprecationWarning, stacklevel=stacklevel + 1)


def resolve(target: str) -> Any:
    """``"module:attribute"`` → the object; ``"module"`` → the module."""
    module, _, attribute = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attribute) if attribute else obj


# ------------------------------------------------------------------ module attributes
# module -> {former attribute: entry}. A former module is listed under its own path in MODULES.
FORMER: dict[str, dict[str, Renamed | Removed]] = {
    "jaxpar.auto": {
        "Plan": Renamed("jaxpar.auto:Strategy"),
        "make_plan": Renamed("jaxpar.auto:make_strategy"),
        "hand_plan": Renamed("jaxpar.auto:hand_strategy"),
        "JobPlan": Renamed("jaxpar.auto:JobSearchResult", "its .plan is .strategy"),
        "plan_job": Removed("use jaxpar.auto.search_job(model_fn, loss_fn, batch, jaxpar.auto.JobSearchSpace(...)); "
                            "the search choices moved into the JobSearchSpace, model_fn takes no remat= (the "
                            "policy is searched as ParallelConfig.remat) and it returns a JobSearchResult",
                            "docs/auto_parallel.md"),
    },
    "jaxpar.checkpoint": {
        "plan_leaves": Renamed("jaxpar.checkpoint:leaf_specs"),
    },
    "jaxpar.train": {
        "plan_for": Renamed("jaxpar.auto:plan_for", "mode 'auto' is planned before the Trainer; other modes' plan "
                                                   "is jaxpar.make_train_plan's, which the Trainer makes itself"),
    },
    "jaxpar.nn": {
        "HostEmbedding": Renamed("jaxpar.ps:HostEmbedding", "train it with Trainer(rows=jaxpar.ps.HostRows(table))"),
        "RowOptimizer": Renamed("jaxpar.ps:RowOptimizer"),
        "HostEmbeddingStep": Removed("train the model and the table with jaxpar.Trainer(..., "
                                     "rows=jaxpar.ps.HostRows(table)) (one training loop for host tables)",
                                     "docs/recommendation.md"),
        "format_plan": Renamed("jaxpar.nn:format_specs"),
        "plan_rows": Renamed("jaxpar.nn:spec_rows"),
        "plan_state": Renamed("jaxpar.nn:state_specs"),
    },
    "jaxpar.optim": {
        "ZeroPlan": Renamed("jaxpar.optim:ZeroSpecs"),
        "zero_plan": Renamed("jaxpar.optim:zero_specs"),
        "on_host": OFFLOAD,
        "to_device": OFFLOAD,
    },
    "jaxpar.ps": {
        "SparseTrainer": Removed("train with jaxpar.Trainer(..., rows=jaxpar.ps.ServerRows(client, fields)) (one "
                                 "training loop for parameter servers)", "docs/parameter_server.md"),
    },
    "jaxpar.cli": {      # 0.1.0's one-module command: its functions, internal now, behind jaxpar.cli.main
        name: Removed("the jaxpar command's steps are internal to jaxpar.cli now; run the command: "
                      "jaxpar.cli.main(['train', ...]) or python -m jaxpar.cli train ...", "docs/jobs.md")
        for name in ("add_job_args", "check_plan_flags", "check_writable", "cmd_plan", "cmd_report", "cmd_train",
                     "config_file", "given")
    },
    "jaxpar.models.gpt": {
        "pipeline_loss": Renamed("jaxpar.models.gpt_parallel:pipeline_loss"),
    },
    "jaxpar.models.llama": {
        "pipeline_loss": Renamed("jaxpar.models.llama_parallel:pipeline_loss"),
    },
}

_CLI = "run the jaxpar command (python -m jaxpar.cli {0} ...); its modules are internal"
# former module path -> entry
MODULES: dict[str, Renamed | Removed] = {
    "jaxpar.auto.plan": Renamed("jaxpar.auto.strategy", renames={"Plan": "Strategy"}),
    "jaxpar.auto.planner": Removed("the job search is jaxpar.auto.search_job with a jaxpar.auto.JobSearchSpace "
                                   "(module jaxpar.auto.job_search)", "docs/auto_parallel.md"),
    "jaxpar.nn.plan": Renamed("jaxpar.nn.specs", renames={"plan_state": "state_specs", "plan_rows": "spec_rows",
                                                          "format_plan": "format_specs", "PlanRow": "SpecRow",
                                                          "check_plan_covers": "check_strategy_covers"}),
    "jaxpar.nn.host_embedding": Renamed("jaxpar.ps.host_embedding"),
    "jaxpar.nn.row_file": Renamed("jaxpar.ps.row_file"),
    "jaxpar.nn.host_step": Removed("train the model and the table with jaxpar.Trainer(..., "
                                   "rows=jaxpar.ps.HostRows(table))", "docs/recommendation.md"),
    "jaxpar.train.guards": Removed("its checks run inside jaxpar.Trainer; Preempted is jaxpar.train.Preempted "
                                   "(module jaxpar.train.hooks)", "docs/reliability.md"),
    "jaxpar.ckpt_cli": Removed(_CLI.format("ckpt"), "docs/checkpoint.md"),
    "jaxpar.plan_cli": Removed(_CLI.format("plan"), "docs/auto_parallel.md"),
    "jaxpar.report_cli": Removed(_CLI.format("report") + "; compiled_llama_memory is "
                                 "jaxpar.job.reports.compiled_llama_memory", "docs/report.md"),
    "jaxpar.cli_job": Removed(_CLI.format("train"), "docs/jobs.md"),
    "jaxpar.job.cli": Removed(_CLI.format("train --config job.yaml"), "docs/jobs.md"),
    "jaxpar.data.cli": Removed(_CLI.format("data"), "docs/data_loading.md"),
    "jaxpar.launch.cli": Removed(_CLI.format("launch") + " or python -m jaxpar.launch", "docs/startup.md"),
    "jaxpar.metrics.cli": Removed(_CLI.format("train --metrics-dir DIR"), "docs/metrics.md"),
    "jaxpar.optim.offload": OFFLOAD,
    "jaxpar.nn.stream": OFFLOAD,      # parameters streamed layer by layer (offload="params"), never released
}


# Former keywords of a callable: owner -> {keyword: entry}. The Trainer's services, placement and
# example batch were flat keywords of 0.1.0; they fold into one value each (jaxpar.train.services).
_SERVICE = "Trainer(services=jaxpar.Services({}))"
_CHECKPOINT = _SERVICE.format("checkpoint=jaxpar.CheckpointConfig({}=...)")
_PLACEMENT = "Trainer(placement=jaxpar.Placement({}=...))"
KEYWORDS: dict[str, dict[str, Renamed | Removed]] = {
    "Trainer": {
        "checkpoint_dir": Renamed(_CHECKPOINT.format("dir")),
        "save_every": Renamed(_CHECKPOINT.format("save_every")),
        "keep": Renamed(_CHECKPOINT.format("keep")),
        "resume": Renamed(_CHECKPOINT.format("resume")),
        "preemption": Renamed(_CHECKPOINT.format("preemption"), "it saves into the checkpoint directory"),
        "nonfinite": Renamed(_SERVICE.format("nonfinite=...")),
        "metrics": Renamed(_SERVICE.format("metrics=jaxpar.metrics.MetricsConfig(...)"),
                           "a loop over Trainer.step logs them too"),
        "profile_steps": Renamed(_SERVICE.format("metrics=..., profile=..."), "the window needs metrics"),
        "offload": OFFLOAD,          # refused with a ValueError, as Placement(offload=...) was
        "donate": Renamed(_PLACEMENT.format("donate")),
        "global_batch": Renamed(_PLACEMENT.format("global_batch")),
        "example_batch": Renamed("Trainer(plan=jaxpar.auto.plan_for(model, tx, loss_fn, config, mesh, "
                                 "example_batch=batch))", "mode 'auto' is searched before the Trainer is built"),
    },
}


def former_attribute(module: str, name: str, stacklevel: int = 2) -> Any:
    """``module.name`` for a former public name: the replacement (after the warning) or the
    refusal; a name that never was public is the usual ``AttributeError``."""
    entry = FORMER.get(module, {}).get(name)
    if isinstance(entry, Renamed):
        warn_renamed(f"{module}.{name}", entry, stacklevel + 1)
        return resolve(entry.new)
    if isinstance(entry, Removed):
        raise AttributeError(removed_message(f"{module}.{name}", entry), name=name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)


def module_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers ``module``'s former names (`FORMER`)."""
    def __getattr__(name: str) -> Any:
        return former_attribute(module, name, stacklevel=2)
    return __getattr__


# ------------------------------------------------------------------ former modules
class _FormerModule(types.ModuleType):
    """A former module path: every attribute is read from the module that replaced it."""

    def __init__(self, name: str, entry: Renamed):
        super().__init__(name, f"Former name of {entry.new} (deprecated).")
        self._entry = entry

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = resolve(self._entry.new)
        if name in self._entry.renames:
            new = self._entry.renames[name]
            warn_renamed(f"{self.__name__}.{name}", Renamed(f"{self._entry.new}:{new}"))
            return getattr(target, new)
        return getattr(target, name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(resolve(self._entry.new))) | set(self._entry.renames))


class FormerModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the former module paths of `MODULES` (last on ``sys.meta_path``: only a path that
    no longer exists reaches it): a renamed one imports with a warning and reads the new
    module; a removed one raises ``ModuleNotFoundError`` naming what to use, as ``from package
    import name`` of a removed name of `FORMER` raises ``ImportError`` (Python looks for it as a
    submodule once the package's ``__getattr__`` refuses it)."""

    def find_spec(self, fullname, path=None, target=None):
        entry = MODULES.get(fullname)
        if entry is None:
            # `from package import name` of a removed name: Python, not finding the attribute,
            # looks for a submodule of that name; the refusal names what to use (not "cannot import")
            package, _, name = fullname.rpartition(".")
            removed = FORMER.get(package, {}).get(name)
            if isinstance(removed, Removed):
                raise ImportError(removed_message(f"{package}.{name}", removed), name=fullname)
            return None
        if isinstance(entry, Removed):
            raise ModuleNotFoundError(removed_message(f"module {fullname}", entry), name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return _FormerModule(spec.name, MODULES[spec.name])

    def exec_module(self, module) -> None:
        entry = MODULES[module.__name__]
        # warnings passes over the import machinery's frames: level 2 is the user's import
        warnings.warn(renamed_message(f"module {module.__name__}", entry), DeprecationWarning, stacklevel=2)


def install_module_finder() -> None:
    """Put `FormerModuleFinder` at the end of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, FormerModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(FormerModuleFinder())


# ------------------------------------------------------------------ keywords and attributes
def renamed_keywords(owner: str, renames: Mapping[str, str]) -> Callable:
    """Decorator for a function or class: each former keyword in ``renames`` (former → current)
    is accepted with a ``DeprecationWarning`` and passed as the current one; both given is a
    ``TypeError`` naming both. ``owner``: the name the messages use (``"ParallelConfig"``)."""
    def fix(kwargs):
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{owner}: both {old}= and {new}= are given ({old} is the former name of "
                                    f"{new}); keep only {new}=")
                warn_renamed(f"{owner}({old}=...)", Renamed(f"{owner}({new}=...)"), stacklevel=3)
                kwargs[new] = kwargs.pop(old)
        return kwargs

    return lambda obj: _fixing_keywords(obj, fix)


def removed_keywords(owner: str, removed: Mapping[str, Callable[[Any], Removed]], *,
                     error: type[Exception] = TypeError) -> Callable:
    """Decorator for a function or class: a keyword of ``removed`` raises ``error`` naming what
    to use (``removed[keyword](value)`` gives the `Removed` entry, so the fix can quote the
    value). A removed setting (``error=ValueError``) given its empty value (``()``, ``[]``,
    ``None``: 0.1.0's default, which asked for nothing) is dropped with a ``DeprecationWarning``
    instead, through the next release. The signature shown stays the current one."""
    def fix(kwargs):
        for name, entry in removed.items():
            if name not in kwargs:
                continue
            value = kwargs[name]
            if error is ValueError and (value is None or (isinstance(value, (tuple, list)) and not value)):
                warnings.warn(refusal(f"{owner}({name}={value!r}) asks for nothing and is ignored", entry(value))
                              + f"; delete the keyword (ignored {UNTIL}, then refused)",
                              DeprecationWarning, stacklevel=3)
                kwargs = {k: v for k, v in kwargs.items() if k != name}
                continue
            raise error(refusal(f"{owner}({name}={value!r})", entry(value)))
        return kwargs

    return lambda obj: _fixing_keywords(obj, fix)


def _fixing_keywords(obj, fix: Callable[[dict], dict]):
    """``obj`` (a function, or a class: its ``__init__``) passing its keywords through ``fix``
    first; warnings ``fix`` gives with ``stacklevel=3`` point at the caller."""
    fn = obj.__init__ if isinstance(obj, type) else obj

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **fix(kwargs))

    if isinstance(obj, type):
        obj.__init__ = wrapper
        return obj
    return wrapper


def former_signature(positional: str, keywords: Mapping[str, Any]) -> inspect.Signature:
    """A former call form as a signature to bind against: ``positional`` names the required
    positional parameters (space separated; ``name: default`` pairs in ``keywords`` before ``"*"``
    follow them, the rest are keyword-only; a default of ``dataclasses.MISSING`` means required)."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in positional.split()]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, default in keywords.items():
        if name == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        # a dataclass field without a default (dataclasses.MISSING) is a required parameter
        params.append(inspect.Parameter(name, kind, default=inspect.Parameter.empty
                                        if default is dataclasses.MISSING else default))
    return inspect.Signature(params)


@dataclasses.dataclass(frozen=True)
class FormerForm:
    """How a public function was called before its parameters became values: ``signature`` (see
    `former_signature`), ``is_former(args, kwargs)`` tells a former call from a current one,
    ``convert(arguments)`` turns the bound former arguments (a dict, defaults applied) into the
    current ``(args, kwargs)``, and ``instead`` shows the current spelling in the warning."""

    owner: str
    signature: inspect.Signature
    is_former: Callable[[tuple, dict], bool]
    convert: Callable[[dict], tuple[tuple, dict]]
    instead: str


def former_form_message(form: FormerForm) -> str:
    return (f"{form.owner}{form.signature} is deprecated: call {form.instead}; the former form works {UNTIL} "
            f"(see {CHANGELOG})")


def accepts_former_form(form: FormerForm) -> Callable:
    """Decorator: a call in ``form``'s former spelling still works, with a ``DeprecationWarning``
    naming the current one, and is passed on converted; a current call goes straight through.
    A former call that does not bind is a ``TypeError`` naming both spellings."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if form.is_former(args, kwargs):
                try:
                    bound = form.signature.bind(*args, **kwargs)
                except TypeError as e:
                    raise TypeError(f"{form.owner}: {e} (in the former form {form.owner}{form.signature}; "
                                    f"call {form.instead})") from None
                bound.apply_defaults()
                warnings.warn(former_form_message(form), DeprecationWarning, stacklevel=2)
                args, kwargs = form.convert(dict(bound.arguments))
            return fn(*args, **kwargs)
        return wrapper
    return decorate


class RenamedAttribute:
    """A class attribute under its former name: reads the current one with a warning."""

    def __init__(self, new: str, note: str = ""):
        self.new, self.note = new, note

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __get__(self, obj, owner=None):
        warn_renamed(f"{self.owner}.{self.old}", Renamed(f"{self.owner}.{self.new}", self.note))
        return getattr(owner if obj is None else obj, self.new)


class RemovedAttribute:
    """A class attribute that is gone: reading it is an ``AttributeError`` naming what to use."""

    def __init__(self, entry: Removed):
        self.entry = entry

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __get__(self, obj, owner=None):
        raise AttributeError(removed_message(f"{self.owner}.{self.old}", self.entry), name=self.old)
