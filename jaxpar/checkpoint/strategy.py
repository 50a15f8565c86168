"""Strategy files: the layout a checkpoint was saved under, as JSON beside it.

MindSpore writes a *strategy checkpoint* (``strategy_ckpt_save_file``) so that per-rank
checkpoints can later be transformed to another layout. jaxpar writes the same information —
for every stored leaf its shape, dtype, logical axis names and ``PartitionSpec``, plus the mesh
axes and sizes, the ``ParallelConfig`` and the jaxpar version — into each checkpoint step
(item ``strategy``). ``load_strategy`` reads it back; ``strategy_config`` turns it into a
``ParallelConfig`` that reproduces the saved parameter layout on another run of the same model.

    >>> strategy = load_strategy("ckpt")            # the newest complete step
    >>> strategy["mesh"]["axes"], strategy["leaves"]["params/head"]["spec"]
    ({'data': 2, 'model': 4}, [None, 'model'])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.checkpoint.state import sections, flat_state, is_key
from jaxpar.config import ParallelConfig
from jaxpar.mesh import mesh_sizes
from jaxpar.nn.specs import logical_names, path_str
from jaxpar.version import __version__

FORMAT = 1


def spec_to_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries: list) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _logical(state) -> dict[str, list | None]:
    """Logical axis names of every param / rest variable, by stored path."""
    out = {}
    trees = sections(state)
    for section in ("params", "rest"):
        flat = jax.tree_util.tree_flatten_with_path(trees[section], is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        for path, var in flat:
            if isinstance(var, nnx.Variable):
                names = logical_names(var)
                out[f"{section}/{path_str(path)}"] = list(names) if names else None
    return out


def build_strategy(plan, state, mesh) -> dict[str, Any]:
    """The strategy file of a state laid out by ``plan`` on ``mesh`` (a JSON-able dict)."""
    logical = _logical(state)
    leaves = {}
    for path, leaf in flat_state(state).items():
        spec = getattr(getattr(leaf, "sharding", None), "spec", PartitionSpec())
        entry = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "spec": spec_to_json(spec)}
        if is_key(leaf):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
        if path in logical:
            entry["logical"] = logical[path]
        leaves[path] = entry
    return strategy_file(leaves, mesh, plan.config)


def strategy_file(leaves: dict[str, dict], mesh, config: ParallelConfig) -> dict[str, Any]:
    """The JSON document: format, version, mesh axes and sizes, config, one entry per leaf."""
    return {
        "format": FORMAT,
        "jaxpar_version": __version__,
        "mesh": {"axes": mesh_sizes(mesh), "devices": int(mesh.devices.size), "processes": jax.process_count()},
        "config": config.to_dict(),
        "leaves": leaves,
    }


def strategy_specs(strategy: dict[str, Any]) -> dict[str, PartitionSpec]:
    """``{path: PartitionSpec}`` recorded in a strategy file."""
    return {path: spec_from_json(e["spec"]) for path, e in strategy["leaves"].items()}


def strategy_config(strategy: dict[str, Any]) -> ParallelConfig:
    """A ``ParallelConfig`` that lays parameters out exactly as recorded.

    The saved config, with every parameter's recorded ``PartitionSpec`` pinned in
    ``parameter_strategy`` (exact paths), so the layout no longer depends on the model's
    annotations or the rules.

    >>> config = strategy_config(load_strategy("ckpt"))
    >>> mesh = jaxpar.make_mesh(config)
    """
    saved = ParallelConfig.from_saved(strategy["config"])   # files saved earlier: "parameter_plan"
    if saved.mode == "data":
        return saved
    pinned = {path.split("/", 1)[1]: spec_from_json(e["spec"])
              for path, e in strategy["leaves"].items() if path.startswith(("params/", "rest/"))
              and not any(ch in path for ch in "*?[")}
    return dataclasses.replace(saved, parameter_strategy=pinned)
