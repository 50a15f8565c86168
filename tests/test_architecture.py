"""The data flow of docs/architecture.md, checked on the source: what may import what.

Every import between jaxpar's parts (top-level imports and function-local ones alike) must
point down the rank table, no part imports a ``_private`` name of another, and only the
command-line modules import the package face ``jaxpar``.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"

# Lower ranks come first in the data flow; a part may import parts of lower rank only.
RANKS = {
    "strategy": 0, "launch": 0, "version": 0, "precision": 0,
    "config": 1, "distributed": 1,
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
    "plan_cli": 13, "ckpt_cli": 13, "report_cli": 14, "cli_job": 14, "cli": 15,
}


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
        src, dst = _part(module), _part(target)
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
            assert _part(target) not in ("train", "", "cli", "plan_cli"), f"{path}: {module} imports {target}"
