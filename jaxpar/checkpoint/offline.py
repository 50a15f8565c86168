"""Offline tools on checkpoint directories: inspect, transform (reshard), merge.

These need no model code: the strategy file of each step records every leaf's shape, dtype,
logical axis names and ``PartitionSpec``. ``transform`` plans the leaves under another
``ParallelConfig`` (``parameter_strategy`` patterns, then logical names through ``rules``; optimizer
moments follow their parameter) and rewrites the checkpoint in that layout — MindSpore's
``transform_checkpoints``. ``merge`` is a transform to one device with everything replicated:
one unsharded checkpoint that plain orbax / Flax code loads.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.checkpoint import state as st
from jaxpar.checkpoint.checksum import KEY as CHECKSUMS, ROWS_KEY as ROW_CHECKSUMS
from jaxpar.checkpoint.damage import check_values, reading, writing
from jaxpar.checkpoint.manager import (StateRestore, StateSave, complete_step, complete_steps, open_manager, read_rows,
                                      saved_leaves)
from jaxpar.checkpoint.strategy import spec_from_json, spec_to_json, strategy_file
from jaxpar.config import ParallelConfig
from jaxpar.mesh import make_mesh
from jaxpar.nn.specs import check_rules_used, declared_names, variable_spec


def damaged_step_advice(manager: ocp.CheckpointManager, directory, step: int) -> str:
    """For the offline tools, a damaged step's way out: the other complete steps to read instead."""
    where = os.path.join(os.path.abspath(os.fspath(directory)), str(step))
    others = sorted(s for s in manager.all_steps() if s != step)
    return (f"Read another complete step {others} (step=N, `--step N`), or delete {where}" if others else
            f"It is the only complete step; delete {where} and save it again")


def reading_step(manager: ocp.CheckpointManager, directory, step: int):
    """``manager.reading`` for the offline tools: a damaged step is named with the other complete
    steps to read instead (``step=`` / ``--step``)."""
    return reading(directory, step, damaged_step_advice(manager, directory, step))


def read_strategy(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The strategy file of ``step`` (call inside ``reading_step``: a malformed file is damage)."""
    strategy = manager.restore(step, args=ocp.args.Composite(strategy=ocp.args.JsonRestore()))["strategy"]
    if not isinstance(strategy, dict) or not isinstance(strategy.get("leaves"), dict) \
            or not isinstance(strategy.get("mesh"), dict) or "axes" not in strategy["mesh"]:
        raise ValueError("its strategy file is not a jaxpar strategy (no 'leaves' and 'mesh' entries)")
    return dict(strategy)


def load_strategy(directory, *, step: int | None = None) -> dict[str, Any]:
    """The strategy file of the newest complete step (or ``step``) of ``directory``."""
    with open_manager(directory, read_only=True) as manager:
        step = complete_step(manager, directory, step)
        with reading_step(manager, directory, step):
            return read_strategy(manager, step)


def _shards(spec: PartitionSpec, axes: dict[str, int]) -> int:
    names = [n for e in spec if e is not None for n in ((e,) if isinstance(e, str) else e)]
    return math.prod(axes.get(n, 1) for n in names)


def inspect(directory, *, step: int | None = None) -> dict[str, Any]:
    """Steps, meta and one row per stored leaf (shape, dtype, strategy, bytes) of a checkpoint."""
    with open_manager(directory, read_only=True) as manager:
        steps = sorted(complete_steps(manager))
        step = complete_step(manager, directory, step)
        with reading_step(manager, directory, step):
            strategy = read_strategy(manager, step)
            meta = dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
            meta.pop(CHECKSUMS, None)       # two numbers per leaf: checked by restore, not shown
            meta.pop(ROW_CHECKSUMS, None)   # one per row table: the same
            stored = saved_leaves(manager, step)
    axes = strategy["mesh"]["axes"]
    rows = {}
    for path, leaf in stored.items():
        entry = strategy["leaves"].get(path, {})
        spec = spec_from_json(entry.get("spec", []))
        nbytes = math.prod(leaf.shape) * jax.numpy.dtype(leaf.dtype).itemsize
        rows[path] = {"shape": list(leaf.shape), "dtype": leaf.dtype, "spec": spec_to_json(spec),
                      "logical": entry.get("logical"), "bytes": nbytes, "bytes_per_device": nbytes // _shards(spec, axes)}
    return {"directory": os.path.abspath(os.fspath(directory)), "steps": steps, "step": step,
            "meta": meta, "mesh": strategy["mesh"], "config": strategy["config"],
            "jaxpar_version": strategy["jaxpar_version"], "leaves": rows,
            "total_bytes": sum(r["bytes"] for r in rows.values())}


def format_inspect(report: dict[str, Any]) -> str:
    """``inspect``'s result as a table (the ``jaxpar ckpt inspect`` output)."""
    from rich.console import Console
    from rich.table import Table

    meta = report["meta"]
    title = (f"{report['directory']} step {report['step']} (steps {report['steps']}), mesh "
             f"{report['mesh']['axes']}, jaxpar {report['jaxpar_version']}, data_state {meta.get('data_state')}")
    table = Table(title=title)
    for col in ("leaf", "shape", "dtype", "logical axes", "PartitionSpec", "bytes", "bytes/device"):
        table.add_column(col, justify="right" if "bytes" in col else "left")
    for path, r in report["leaves"].items():
        table.add_row(path, str(tuple(r["shape"])), r["dtype"], str(r["logical"] or "-"),
                      str(tuple(spec_from_json(r["spec"]))), f"{r['bytes']:,}", f"{r['bytes_per_device']:,}")
    table.add_row("total", "", "", "", "", f"{report['total_bytes']:,}",
                  f"{sum(r['bytes_per_device'] for r in report['leaves'].values()):,}", style="bold")
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(table)
    return console.export_text()


class _StoredVariable:
    """What ``jaxpar.nn.specs.variable_spec`` reads of a variable, rebuilt from a strategy entry."""

    def __init__(self, entry: dict):
        self._value = jax.ShapeDtypeStruct(tuple(entry["shape"]), jax.numpy.float32)
        self._meta = {"sharding_names": tuple(entry["logical"])} if entry.get("logical") else {}

    def get_value(self):
        return self._value

    def get_metadata(self) -> dict:
        return self._meta


def _plan_leaf(config: ParallelConfig, mesh, path: str, entry: dict) -> PartitionSpec:
    """The spec of one stored param / rest leaf under ``config``, as ``jaxpar.nn.specs`` gives it."""
    return variable_spec(config, mesh, path.split("/", 1)[1], _StoredVariable(entry))


def leaf_specs(strategy: dict[str, Any], config: ParallelConfig, mesh) -> dict[str, PartitionSpec]:
    """``{path: PartitionSpec}`` for every stored leaf under another config.

    Parameters and other NNX state are planned from their logical names; an optimizer leaf
    whose path ends with a parameter's path and has its shape follows that parameter; other
    optimizer leaves (counts) are replicated.
    """
    leaves = strategy["leaves"]
    specs = {p: _plan_leaf(config, mesh, p, e) for p, e in leaves.items() if p.startswith(("params/", "rest/"))}
    params = {p.split("/", 1)[1]: p for p in specs if p.startswith("params/")}
    for path, entry in leaves.items():
        if path.startswith("opt_state/"):
            owner = next((full for short, full in params.items() if path.endswith("/" + short)
                          and leaves[full]["shape"] == entry["shape"]), None)
            specs[path] = specs[owner] if owner else PartitionSpec()
    return specs


def _check_rules(config: ParallelConfig, strategy: dict[str, Any], directory) -> None:
    """Target rules must name a logical axis of a stored leaf, or one the training job's own
    rules used (activations, the batch): a typo would otherwise leave leaves replicated."""
    used = {name for e in strategy["leaves"].values() for entry in (e.get("logical") or ())
            for name in ((entry,) if isinstance(entry, str) else (entry or ()))}
    used |= set(strategy.get("config", {}).get("rules", {}))
    check_rules_used(config, used | declared_names(config), f"checkpoint {str(directory)!r}")


def mesh_for(config: ParallelConfig, devices=None):
    """The mesh of ``config`` on ``devices`` (default: the first devices that fit it)."""
    sizes = config.mesh.values()
    if devices is None and -1 not in sizes:
        devices = jax.devices()[: math.prod(sizes)]
    return make_mesh(config, devices=devices)


def _check_free(out, step: int) -> None:
    """Refuse, before anything is read, an ``out`` that already holds ``step``."""
    where = os.path.join(os.path.abspath(os.fspath(out)), str(step))
    if os.path.exists(where):
        raise ValueError(f"out {os.fspath(out)!r} already holds step {step} ({where}); give another output "
                         f"directory, or delete {where} to write it again")


def transform(directory, out, config: ParallelConfig, *, step: int | None = None, devices=None) -> int:
    """Rewrite step ``step`` (default newest) of ``directory`` into ``out`` laid out for ``config``.

    Every array is read straight into its new shards on the mesh of ``config`` (built from
    ``devices``, default the first devices that fit) and saved again with a new strategy file.
    Returns the step. MindSpore: ``transform_checkpoints`` / ``load_distributed_checkpoint``.
    """
    mesh = mesh_for(config, devices)
    with open_manager(directory, read_only=True) as manager:
        step = complete_step(manager, directory, step)
        _check_free(out, step)
        with reading_step(manager, directory, step):
            strategy = read_strategy(manager, step)
            stored = saved_leaves(manager, step)
        _check_rules(config, strategy, directory)
        specs = leaf_specs(strategy, config, mesh)
        target = {p: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, specs[p]))
                  for p, leaf in stored.items()}
        with reading_step(manager, directory, step):
            restored = manager.restore(step, args=ocp.args.Composite(
                state=StateRestore(st.nest(target)), meta=ocp.args.JsonRestore()))
            meta = dict(restored["meta"])
        # the checksums are kept in the new step's meta: they hold in any layout
        check_values(directory, step, st.unnest(restored["state"]), meta, damaged_step_advice(manager, directory, step))
        rows = read_rows(manager, step, directory)      # a row source's tables travel as they are
    leaves = {p: {**e, "spec": spec_to_json(specs[p])} for p, e in strategy["leaves"].items()}
    new_strategy = strategy_file(leaves, mesh, config)
    if "model" in strategy:
        new_strategy["model"] = strategy["model"]      # the model description travels with the arrays
    items = {"state": StateSave(restored["state"]), "meta": ocp.args.JsonSave(meta),
             "strategy": ocp.args.JsonSave(new_strategy)}
    if rows is not None:
        items["rows"] = ocp.args.StandardSave(rows)
    with open_manager(out, asynchronous=False) as writer, writing(writer, out, step):
        writer.save(step, force=True, args=ocp.args.Composite(**items))
    return step


MERGED = ParallelConfig(mesh={"data": 1}, mode="data")


def merge(directory, out, *, step: int | None = None) -> int:
    """One unsharded checkpoint of step ``step`` (default newest) in ``out``; returns the step.

    Every array is whole on one device. Plain orbax / Flax code reads it without jaxpar::

        tree = ocp.StandardCheckpointer().restore(f"{out}/{step}/state")
        params = tree["params"]          # nested dicts of arrays, keys = parameter path parts

    jaxpar restores it into any layout like any other checkpoint.
    """
    return transform(directory, out, MERGED, step=step, devices=jax.devices()[:1])
