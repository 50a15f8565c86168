"""The data flow of docs/architecture.md, checked on the source: what may import what.

Every import between jaxpar's parts (top-level imports and function-local ones alike) must
point down the rank table, no part imports a ``_private`` name or module of another, the
modules of one folder import one another without a cycle, only the command-line modules
import the package face ``jaxpar``, and only they (``jaxpar/cli/``) parse command lines.
A model file imports nothing parallel: that lives beside it in ``models/<name>_parallel.py``.
"""

import ast
import collections
import fnmatch
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"

# Lower ranks come first in the data flow; a part may import parts of lower rank only.
RANKS = {
    "strategy": 0, "launch": 0, "version": 0, "precision": 0, "deprecation": 0, "yaml_files": 0,
    "config": 1, "distributed": 1, "executables": 1,
    "mesh": 2, "shard": 2, "ops": 2, "remat": 2,
    "data": 3,
    "optim": 4,
    "nn": 5,
    "pipeline": 6,
    "plan": 7,
    "report": 8,
    "auto": 9, "checkpoint": 9, "metrics": 9,
    "train": 10, "models": 10, "ps": 10,  # ps: parameter servers and their training glue
    "": 11,                       # the package face, jaxpar/__init__.py
    "interop": 12, "job": 12,     # Hugging Face files <-> models; a job file -> models, data, Trainer
    "cli": 13,                    # the jaxpar command: every subcommand's flags, one job system
}
# Entry points run with ``python -m`` (``jaxpar/launch/__main__.py`` is ``jaxpar launch``) rank as
# the command they start, whatever folder holds them.
ENTRY = "__main__"


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxpar":
                for alias in node.names:
                    # `from jaxpar import checkpoint` names a part; `from jaxpar import init` the face
                    sub = node.module == "jaxpar" and alias.name in RANKS
                    yield path, module, f"jaxpar.{alias.name}" if sub else node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "jaxpar":
                        yield path, module, alias.name, None


def test_every_part_has_a_rank():
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    parts = {"" if p == "__init__" else p for p in parts} - {"__main__", "py"}
    assert parts <= set(RANKS), f"parts without a rank in this test and docs/architecture.md: {parts - set(RANKS)}"


def test_imports_follow_the_data_flow():
    wrong = []
    for path, module, target, _ in _imports():
        src, dst = "cli" if module.split(".")[-1] == ENTRY else _part(module), _part(target)
        if src == dst:
            continue
        if RANKS[dst] >= RANKS[src]:
            wrong.append(f"{path.relative_to(ROOT.parent)}: {module} imports {target} "
                         f"(rank {RANKS[src]} -> {RANKS[dst]})")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_no_private_names_across_parts():
    wrong = [f"{path.relative_to(ROOT.parent)}: {target}" for path, module, target, name in _imports()
             if name and name.startswith("_") and not name.startswith("__") and _part(module) != _part(target)]
    assert not wrong, "private names imported across parts:\n" + "\n".join(wrong)


@pytest.mark.parametrize("part", ["auto", "plan", "checkpoint", "report"])
def test_planning_parts_never_import_training(part):
    for path, module, target, _ in _imports():
        if _part(module) == part:
            assert _part(target) not in ("train", "", "cli"), f"{path}: {module} imports {target}"


def module_paths(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """``{module name: its file}`` for every module of the package at ``root``."""
    return {".".join(p for p in path.relative_to(root.parent).with_suffix("").parts if p != "__init__"): path
            for path in sorted(root.rglob("*.py"))}


def _runtime_imports(tree: ast.AST):
    """Every import statement that can run: at module level or in a function body, but not
    under ``if TYPE_CHECKING:`` (annotations only; it never runs)."""
    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (x for n in child.orelse for x in walk_one(n))
                continue
            yield from walk_one(child)

    def walk_one(node):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from walk(node)

    yield from walk(tree)


def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules of jaxpar it imports}``, e.g. ``jaxpar.pipeline.schedules ->
    {jaxpar.pipeline.table, ...}``; ``from jaxpar.x import y`` is module ``jaxpar.x.y`` when
    there is one, else the package ``jaxpar.x`` (its ``__init__``)."""
    paths = module_paths(root)
    graph = {}
    for module, path in paths.items():
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a ``_private`` module (a file named ``_x.py``) from outside its folder."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            parts = target.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")]
            if private and not (module + ".").startswith(".".join(parts[:private[0]]) + "."):   # a package's __init__ is in its folder
                wrong.append(f"{module} imports {target}")
    return wrong


def folder_cycles(graph: dict[str, set[str]], root: pathlib.Path = ROOT) -> list[list[str]]:
    """The import cycles among the modules of each folder (its ``__init__`` included): the
    strongly connected components of more than one module, found with Tarjan's algorithm."""
    folder = {m: path.parent for m, path in module_paths(root).items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if folder[w] != folder[v]:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_private_module_imported_from_another_folder():
    """A ``_private`` module is its folder's own: what another folder needs gets a public home."""
    wrong = private_imports(module_graph())
    assert not wrong, "private modules imported from another folder:\n" + "\n".join(wrong)


def test_no_import_cycles_within_a_folder():
    """The modules of a folder (jaxpar/pipeline, jaxpar/auto, ...) import one another without a cycle.

    Function-local imports count: a late import only hides a cycle (it works by the order the
    modules load in, and breaks when that order changes), so ``schedules -> vshape`` inside
    ``build`` and ``comm -> cost`` inside ``derivations`` were both cycles. Imports under
    ``if TYPE_CHECKING:`` do not: they never run (launch's ``servers`` names ``LaunchConfig``
    of ``launcher`` that way). The shared piece of a cycle moves down into a module both sides
    import (``pipeline.table``, ``auto.derivatives``).
    """
    cycles = folder_cycles(module_graph())
    assert not cycles, "import cycles within a folder:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_late_imports_and_skip_type_checking_ones(tmp_path):
    """The two checks above on a package made for them: a cycle through a function-local import
    is caught, one through ``if TYPE_CHECKING:`` is not, and so is a private module used next door."""
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/_p.py": "",
        "a/x.py": "import pkg.a._p\ndef f():\n    from pkg.a import y\n",
        "a/y.py": "from pkg.a.x import f\n",
        "b/__init__.py": "",
        "b/u.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b.v import V\n",
        "b/v.py": "from pkg.a._p import thing\nfrom pkg.b import u\n",
    }
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = module_graph(root)
    assert folder_cycles(graph, root) == [["pkg.a.x", "pkg.a.y"]]
    assert private_imports(graph) == ["pkg.b.v imports pkg.a._p"]


def mesh_size_copies(root: pathlib.Path = ROOT) -> list[str]:
    """Places other than `jaxpar.strategy.mesh_sizes` that turn a mesh into ``{axis: size}``:
    a ``zip(mesh.axis_names, mesh.axis_sizes)`` (or ``..., mesh.devices.shape``)."""
    found = []
    for module, path in module_paths(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zip" \
                    and len(node.args) == 2 and all(isinstance(a, ast.Attribute) for a in node.args) \
                    and node.args[0].attr == "axis_names" and ast.unparse(node.args[1]).endswith(("axis_sizes",
                                                                                                  "devices.shape")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_one_function_turns_a_mesh_into_sizes():
    """`jaxpar.strategy.mesh_sizes` (a Mesh, an AbstractMesh or a mapping -> ``{axis: size}``) is
    the one copy; ops, shard and the MoE layer each had their own."""
    copies = mesh_size_copies()
    assert not copies, "call jaxpar.strategy.mesh_sizes instead:\n" + "\n".join(copies)


# Processes that are no `jaxpar` subcommand but parse their own command line: a parameter
# server the launcher starts with `python -m jaxpar.ps.server --index I ...`, and the replica
# groups' coordinator (`python -m jaxpar.ps.replica_server --groups N`).
OWN_COMMAND_LINE = {"jaxpar/ps/server.py", "jaxpar/ps/replica_server.py"}


def argparse_users(root: pathlib.Path = ROOT) -> list[str]:
    """The modules outside ``jaxpar/cli/`` that import argparse (``import argparse`` or
    ``from argparse import ...``, function-local ones included)."""
    found = []
    for module, path in module_paths(root).items():
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(f"{root.name}/cli/") or rel in OWN_COMMAND_LINE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                found.append(f"{rel}:{node.lineno}")
    return found


def test_only_the_command_parses_command_lines():
    """Every subcommand's flags live in ``jaxpar/cli/`` (one module per command group), so the
    ``jaxpar`` command has one door and one way to answer a mistake; the flag parsing that had
    spread to ``data/cli.py``, ``launch/cli.py``, ``job/cli.py`` and ``metrics/cli.py`` moved there."""
    users = argparse_users()
    assert not users, "argparse outside jaxpar/cli/:\n" + "\n".join(users)


def test_the_argparse_check_sees_every_import_form(tmp_path):
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "cli/__init__.py": "import argparse\n",
                       "a/__init__.py": "", "a/x.py": "def f():\n    from argparse import ArgumentParser\n",
                       "a/y.py": "import argparse as ap\n", "a/z.py": "import json\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert argparse_users(root) == ["pkg/a/x.py:2", "pkg/a/y.py:1"]


# What runs a model in parallel lives beside it, in ``models/<name>_parallel.py`` (torchtitan's
# ``model.py`` / ``parallelize.py``); a model's report under a plan is ``models/<name>_report.py``.
# Every other file of ``jaxpar/models/`` imports none of these (patterns of module names):
PARALLEL = (
    "jaxpar",                                   # the face: it imports every part
    "jaxpar.auto*", "jaxpar.checkpoint*", "jaxpar.cli*", "jaxpar.config", "jaxpar.distributed",
    "jaxpar.job*", "jaxpar.launch*", "jaxpar.mesh", "jaxpar.optim*", "jaxpar.pipeline*", "jaxpar.plan*",
    "jaxpar.ps*", "jaxpar.remat", "jaxpar.shard", "jaxpar.strategy*", "jaxpar.train*",
    "jaxpar.ops", "jaxpar.ops._common", "jaxpar.ops.context*", "jaxpar.ops.conv", "jaxpar.ops.head_parallel",
    "jaxpar.ops.linear*", "jaxpar.ops.moe_dispatch", "jaxpar.ops.vocab_parallel",
    "jaxpar.nn", "jaxpar.nn.blocks", "jaxpar.nn.constraint", "jaxpar.nn.init",
    "jaxpar.nn.sliced_init", "jaxpar.nn.specs",
)
# Recompute included: ``ParallelConfig.remat`` alone sets it, and the step (and the job search)
# applies it to the model's blocks from outside, so a model file imports nothing of jaxpar.remat.
MODEL_SIDE_FILES = ("_parallel.py", "_report.py")


def parallel_imports(root: pathlib.Path = ROOT) -> list[str]:
    """The imports of parallel modules (``PARALLEL``) in ``root/models/``'s model files: every
    file there but ``*_parallel.py`` and ``*_report.py``; function-local imports count."""
    paths = module_paths(root)
    wrong = []
    for path in sorted((root / "models").glob("*.py")):
        if path.name.endswith(MODEL_SIDE_FILES):
            continue
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module, a.name)
                         for a in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            else:
                continue
            for target, name in pairs:
                root_name = target.split(".")[0]
                pattern_target = "jaxpar" + target[len(root_name):] if root_name == root.name else None
                if pattern_target is None:
                    continue
                if any(fnmatch.fnmatchcase(pattern_target, p) for p in PARALLEL):
                    wrong.append((path.relative_to(root.parent).as_posix(), node.lineno,
                                  target + (f" ({name})" if name else "")))
    return [f"{file}:{line}: {what}" for file, line, what in sorted(wrong)]


def test_model_files_import_nothing_parallel():
    """``models/llama.py``, ``models/gpt.py``, ... hold the modules, the config, the plain
    ``loss_fn``, FLOPs and parameter counts; the pipeline's parts (``pipeline_loss``) moved to
    ``models/llama_parallel.py`` and ``models/gpt_parallel.py``. A model speaks to a runner only
    through the ``constrain(x, names)`` hook it is given."""
    wrong = parallel_imports()
    assert not wrong, ("model files import parallel modules (move that code to models/<name>_parallel.py):\n"
                       + "\n".join(wrong))
    names = module_paths()
    stale = [p for p in PARALLEL if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    assert not stale, f"PARALLEL names modules that no longer exist (renamed? update the list): {stale}"


def test_the_model_check_sees_every_import_form(tmp_path):
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "", "remat.py": "", "nn/__init__.py": "", "nn/fp8.py": "", "nn/init.py": "",
        "ops/__init__.py": "", "ops/context.py": "", "ops/cross_entropy.py": "", "pipeline/__init__.py": "",
        "models/__init__.py": "",
        "models/a.py": ("from pkg.nn import fp8\nfrom pkg.ops.cross_entropy import x\n"
                        "from pkg.remat import checkpoint_policy\n"
                        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.pipeline\n"),
        "models/b.py": ("def f():\n    from pkg.pipeline import PipelineLoss\nimport pkg.ops.context\n"
                        "from pkg.nn import init\nfrom pkg.ops import ContextParallel\nfrom pkg.remat import remat\n"
                        "from pkg import shard\n"),
        "models/b_parallel.py": "from pkg.pipeline import PipelineLoss\n",
        "models/b_report.py": "import pkg.plan\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert parallel_imports(root) == [
        "pkg/models/a.py:3: pkg.remat (checkpoint_policy)", "pkg/models/b.py:2: pkg.pipeline (PipelineLoss)", "pkg/models/b.py:3: pkg.ops.context",
        "pkg/models/b.py:4: pkg.nn.init (init)", "pkg/models/b.py:5: pkg.ops (ContextParallel)",
        "pkg/models/b.py:6: pkg.remat (remat)", "pkg/models/b.py:7: pkg (shard)"]


# "plan" names one thing: the TrainPlan a Trainer runs. Its own files, and the names that are it
# or make one; a searched strategy is a `Strategy`, a model's layouts are specs (`nn/specs.py`,
# `ZeroSpecs`), a search over whole jobs is `search_job` over a `JobSearchSpace`.
PLAN_FILES = ("plan/", "train/planning.py", "cli/plan.py")      # the TrainPlan's package, plan_for, `jaxpar plan`
PLAN_NAMES = {"TrainPlan", "make_train_plan", "plan_for", "plan_training"}


def _exported(tree: ast.Module) -> list[str]:
    """The string entries of a module's ``__all__`` list or tuple."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) \
                and isinstance(node.value, (ast.List, ast.Tuple)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def plan_names(root: pathlib.Path = ROOT) -> list[str]:
    """Module files, public classes and exported names that say "plan" without being the
    TrainPlan's (``PLAN_FILES``, ``PLAN_NAMES``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        where = f"{root.name}/{rel}"
        if "plan" in rel.lower() and not rel.startswith(PLAN_FILES):
            found.append(f"{where}: module")
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and "plan" in node.name.lower() \
                    and node.name not in PLAN_NAMES:
                found.append(f"{where}:{node.lineno}: class {node.name}")
        found += [f"{where}: exports {name}" for name in _exported(tree)
                  if "plan" in name.lower() and name not in PLAN_NAMES]
    return found


def test_plan_names_the_train_plan_only():
    """Five things were called plan (``TrainPlan``, ``auto.Plan``, ``nn/plan.py``, ``auto/planner.py``'s
    ``plan_job``/``JobPlan``, ``optim.ZeroPlan``); each other one is named for what it is."""
    wrong = plan_names()
    assert not wrong, ('"plan" names the TrainPlan only; name these for what they are (a Strategy, specs, '
                       "a job search, ...):\n" + "\n".join(wrong))


def test_the_plan_name_check_sees_modules_classes_and_exports(tmp_path):
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "__all__ = ['TrainPlan', 'make_train_plan', 'plan_job']\n",
        "plan/__init__.py": "class TrainPlan: ...\n", "plan/train_plan.py": "", "cli/plan.py": "",
        "auto/planner.py": "class JobPlan: ...\nclass _Plan: ...\nclass Strategy: ...\n",
        "nn/specs.py": "__all__ = ('format_plan', 'spec_rows')\nclass PlanRow: ...\n",
        "ops/linear.py": "def plan_files(): ...\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert plan_names(root) == ["pkg/__init__.py: exports plan_job", "pkg/auto/planner.py: module",
                                "pkg/auto/planner.py:1: class JobPlan", "pkg/nn/specs.py:2: class PlanRow",
                                "pkg/nn/specs.py: exports format_plan"]


# Parts that may not import one another although the ranks would allow it: the Trainer runs a
# plan made before it, so the strategy search (auto/) is called before a Trainer exists (the job
# runner, `jaxpar.auto.plan_for`), never from train/.
FORBIDDEN = {("train", "auto"): "mode 'auto' is planned before the Trainer (jaxpar.auto.plan_for)"}


def forbidden_imports(root: pathlib.Path = ROOT) -> list[str]:
    """Imports (function-local ones included) from one part into another that `FORBIDDEN` rules out."""
    wrong = []
    for module, targets in sorted(module_graph(root).items()):
        for target in sorted(targets):
            pair = (_part(module), _part(target))
            if pair in FORBIDDEN:
                wrong.append(f"{module} imports {target}: {FORBIDDEN[pair]}")
    return wrong


def test_training_never_imports_the_search():
    wrong = forbidden_imports()
    assert not wrong, "\n".join(wrong)


def test_the_forbidden_import_check_sees_the_former_planner(tmp_path):
    """The train/planning.py of before (a function-local ``from jaxpar.auto import plan_training``
    in ``plan_for``) is caught; a string naming auto is not an import."""
    root = tmp_path / "jaxpar"
    for name, text in {"__init__.py": "", "auto/__init__.py": "", "auto/api.py": "", "plan/__init__.py": "",
                       "train/__init__.py": "", "train/trainer.py": "from jaxpar.plan import x\nNOTE = 'jaxpar.auto'\n",
                       "train/planning.py": "def plan_for():\n    from jaxpar.auto import plan_training\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert forbidden_imports(root) == ["jaxpar.train.planning imports jaxpar.auto: " + FORBIDDEN[("train", "auto")]]


# The Trainer is a loop and its views: the compile cache and placement (train/programs.py), the
# services (train/services.py, hooks.py, checkpointing.py, watch.py) and the argument checks
# (train/arguments.py) live beside it.
TRAINER_LINES, TRAINER_PARAMETERS = 400, 9


def trainer_size(path: pathlib.Path = ROOT / "train" / "trainer.py") -> tuple[int, int]:
    """``(lines of the file, parameters of Trainer.__init__ less self, * and ** included)``."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            a = init.args
            count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg) - 1
            return len(text.splitlines()), count
    raise AssertionError(f"{path} defines no class Trainer")


def test_the_trainer_is_a_loop():
    lines, parameters = trainer_size()
    assert lines <= TRAINER_LINES, (f"jaxpar/train/trainer.py has {lines} lines (at most {TRAINER_LINES}): move what is "
                                    "not the loop or its views into the modules beside it")
    assert parameters <= TRAINER_PARAMETERS, (f"Trainer.__init__ takes {parameters} parameters (at most "
                                              f"{TRAINER_PARAMETERS}): a service goes in jaxpar.Services, placement in "
                                              "jaxpar.Placement")


def test_the_trainer_size_check_counts_every_parameter(tmp_path):
    path = tmp_path / "trainer.py"
    path.write_text("class Trainer:\n    def __init__(self, a, b, /, c, *args, d=1, **kw):\n        pass\n")
    assert trainer_size(path) == (3, 6)


MAX_PARAMETERS = 10
# Functions still over the limit while they are reduced to values (each entry must still be over:
# an entry that no longer is fails below, so the list only shrinks).
LONG_PARAMETER_LISTS: set[str] = set()


def long_parameter_lists(root: pathlib.Path = ROOT) -> dict[str, int]:
    """``{"file:Class.function": parameters}`` for every def taking more than ``MAX_PARAMETERS``
    positional and keyword parameters (``self`` / ``cls`` not counted; ``*args`` / ``**kwargs`` neither)."""
    found = {}

    def visit(node, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                names = names[1:] if names[:1] in (["self"], ["cls"]) else names
                if len(names) > MAX_PARAMETERS:
                    found[f"{path}:{prefix}{child.name}"] = len(names)
                visit(child, path, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.")
            else:
                visit(child, path, prefix)

    for file in sorted(root.rglob("*.py")):
        visit(ast.parse(file.read_text()), file.relative_to(root).as_posix(), "")
    return found


def test_no_function_takes_more_than_ten_parameters():
    """A long parameter list becomes values that mean something (a ``PipelineCall``, an
    ``ExpertDispatch``, a ``ReportRequest``), not ``**kwargs``."""
    found = long_parameter_lists()
    new = {name: n for name, n in found.items() if name not in LONG_PARAMETER_LISTS}
    assert not new, (f"functions taking more than {MAX_PARAMETERS} parameters; group the ones that belong "
                     f"together into a frozen value: {new}")
    assert not LONG_PARAMETER_LISTS - set(found), ("no longer over the limit: drop from LONG_PARAMETER_LISTS "
                                                   f"{sorted(LONG_PARAMETER_LISTS - set(found))}")


def test_the_parameter_count_sees_methods_nested_functions_and_keyword_only_ones(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "m.py").write_text(
        "def ok(a, b, c, d, e, f, g, h, i, j, *args, **kwargs): ...\n"
        "def wide(a, b, c, d, e, f, g, h, i, j, *, k): ...\n"
        "class C:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j): ...\n"
        "    def m(self, a, b, c, d, e, f, g, h, i, j, k=1): ...\n"
        "def outer():\n    def inner(a, b, c, d, e, f, g, h, i, j, /, k): ...\n")
    assert long_parameter_lists(root) == {"m.py:wide": 11, "m.py:C.m": 11, "m.py:outer.inner": 11}
