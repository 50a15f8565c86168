"""The row-source side of a `Trainer` (``Trainer(rows=...)``; the protocol is `jaxpar.ps.rows`).

A `RowPath` is what the Trainer's step, evaluation and checkpoints call when a source supplies
embedding rows the model does not hold: it pulls, says where the compiled step takes the rows
(and what compiles anew for them), hands their gradients back, and keeps the source's tables
with the Trainer's checkpoints. The Trainer stays the loop; nothing here runs without a source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.plan.checks import check_rows_pipeline
from jaxpar.train.replicas import check_replicas


def check_rows(rows, config: ParallelConfig, plan, replicas=None) -> None:
    """A row source has ``pull`` and ``push``; the combinations it cannot run are refused by name
    (``replicas``: the placement's replica group, `jaxpar.train.replicas.check_replicas`)."""
    check_replicas(replicas, rows)
    if rows is None:
        return
    if not (callable(getattr(rows, "pull", None)) and callable(getattr(rows, "push", None))):
        raise TypeError(f"Trainer: rows must be a row source with pull(batch) and push(handle, row_grads, step) "
                        f"(e.g. jaxpar.ps.HostRows(table)), got {type(rows).__name__}")
    check_rows_pipeline(config, "Trainer")      # as make_train_plan(rows=...) refuses it
    if config.mode == "auto" and plan is None:
        raise ValueError("Trainer: rows= with mode='auto': the strategy search runs loss_fn(model, batch) without "
                         "the pulled rows; plan first for the dense model, or use mode='semi_auto'")


class RowPath:
    """A row source as the Trainer drives it, on the Trainer's ``mesh``.

    >>> path = RowPath(source, mesh)                      # doctest: +SKIP
    >>> batch, rows, handle = path.pull(batch)            # before the step (host)
    >>> path.push(handle, row_grads, finite, step, batch, rows)   # after it
    """

    def __init__(self, source, mesh: jax.sharding.Mesh):
        self.source, self.mesh = source, mesh
        self.pulled = None      # (step batch, rows) of the last step, for the metrics' first read

    def pull(self, batch) -> tuple[Any, Any, Any]:
        """``(step batch, rows, handle)`` from the source (nothing is pushed for them)."""
        return self.source.pull(batch)

    def push(self, handle, row_grads, finite, step: int, batch, rows) -> None:
        """Hand the step's row gradients back. A non-finite step updates no row (skipped, or
        about to stop): the source is told so (``None``) and applies nothing, keeping its count
        of steps; reading ``finite`` waits for the step, as the gradients' transfer would."""
        self.source.push(handle, row_grads if bool(finite) else None, step)
        self.pulled = (batch, rows)

    @staticmethod
    def key(rows) -> tuple:
        """What a compiled step depends on in pulled ``rows``: their tree and shapes."""
        return (jax.tree.structure(rows), tuple((x.shape, x.dtype) for x in jax.tree.leaves(rows)))

    def shardings(self, rows):
        """Where the step takes pulled rows: replicated; in a job of several processes, as the
        source placed them (global arrays on the mesh, e.g. each process's block)."""
        if jax.process_count() == 1:
            return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), rows)

        def placed(x):
            if not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh):
                raise ValueError(f"Trainer: in a job of {jax.process_count()} processes the row source must pull "
                                 f"its rows as global jax.Arrays on the Trainer's mesh (got {type(x).__name__} of "
                                 f"shape {np.shape(x)}); e.g. jaxpar.ps.ServerRows(client, fields, mesh=mesh)")
            return x.sharding

        return jax.tree.map(placed, rows)

    @staticmethod
    def abstract(rows, shardings) -> tuple[Any, Any]:
        """``(rows_like, row_specs)`` for the step's `Setting`: the rows' shapes and specs."""
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), rows)
        return like, jax.tree.map(lambda sh: sh.spec, shardings)

    @staticmethod
    def placed(shardings, rows):
        """Pulled rows for the compiled step: host arrays as they are (the step places them),
        device arrays put on the mesh as the step takes them (``shardings``; global arrays
        placed by the source pass as they are)."""
        leaves = jax.tree.leaves(rows)
        if all(type(x) is np.ndarray for x in leaves) or jax.process_count() > 1:
            return rows
        return jax.device_put(rows, shardings)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Any:
        """Called just before the Trainer saves ``step``: a source's own ``save(step)`` (e.g.
        servers snapshot their tables), and the tables to write into the Trainer's checkpoint
        (``snapshot()``: a dict of numpy arrays, copied now), or None."""
        own = getattr(self.source, "save", None)
        if own is not None:
            own(step)
        return self.snapshot_tables()

    def snapshot_tables(self) -> Any:
        """The tables the source keeps in the Trainer's checkpoints (``snapshot()``, a copy
        taken now), or None; without the source's own ``save`` (the local checkpoint tier)."""
        snapshot = getattr(self.source, "snapshot", None)
        if snapshot is None:
            return None
        tables = snapshot()
        check_snapshot(tables, type(self.source).__name__)
        return tables

    def restore(self, step: int, read: Callable[[], Any], directory: str) -> None:
        """Called when the Trainer restores (or resumes from) step ``step`` of ``directory``,
        before it takes the state: the tables that checkpoint holds (``read()``: None when it
        has none) go back into the source (``load_snapshot``), and a source's own
        ``restore(step)`` goes back to that step. A checkpoint without tables refuses a
        source that keeps them, naming the way to start them afresh."""
        load = getattr(self.source, "load_snapshot", None)
        if load is not None:
            tables = read()
            if tables is None:
                raise ValueError(
                    f"Trainer: checkpoint {directory} step {step} holds no row tables, but the row source "
                    f"{type(self.source).__name__} keeps its tables in the Trainer's checkpoints (it was saved "
                    "without them: by a Trainer without rows=, or by a jaxpar that did not save them). To go on "
                    "from its dense state with the source's tables as they are now, restore the state alone on a "
                    "Trainer made without services=Services(checkpoint=...): trainer.state = "
                    f"jaxpar.checkpoint.restore_state({directory!r}, trainer.state, trainer.mesh, step={step})[0]; "
                    "its next save holds the tables")
            load(tables)
        own = getattr(self.source, "restore", None)
        if own is not None:
            own(step)


def check_snapshot(tables, who: str) -> None:
    """A source's ``snapshot()`` is a (nested) dict of numpy arrays, which the checkpoint writes."""
    bad = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(tables)[0]
           if type(x) is not np.ndarray]
    if not isinstance(tables, dict) or bad:
        raise TypeError(f"Trainer: {who}.snapshot() must return a dict of numpy arrays (copies taken now), got "
                        f"{type(tables).__name__}" + (f" with other leaves at {bad[:3]}" if bad else ""))
