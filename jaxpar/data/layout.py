"""``BatchLayout``: how a training job's batches lie on the mesh, as one value.

``dataset_strategy`` (in ``ParallelConfig``) decides the split of every batch leaf:

* ``None`` (default): dimension 0 over the *batch axes* — the mesh axes of the ``"batch"``
  rule if there is one, else the ``"data"`` axis, else (mode ``"data"``) every mesh axis;
* ``"full_batch"``: every device sees the whole batch (replicated);
* one strategy in any form, e.g. ``(2, 2, 2, 1)`` for NHWC images split over batch, H, W;
* a dict, top-level batch key → one of the above (MindSpore's one strategy per dataset
  column), e.g. ``{"image": (2, 2, 2, 1), "label": (2,)}``.

A context axis splits dimension 1 of ``[B, S, ...]`` leaves too, after the sequence is
reordered once on the host. A training step cuts its global batch into ``grad_accum`` x
``interleave`` parts, a pipeline each part into ``pipeline.microbatches``, always with
`split_rows`, so no row moves between devices. `BatchLayout.of(config, mesh)` reads all of
that once; a ``TrainPlan`` holds it (``plan.batch_layout``), and the step and the pipeline take
it from there::

    >>> layout = BatchLayout.of(ParallelConfig(mesh={"data": 4, "model": 2}, rules={"batch": "data"},
    ...                                        grad_accum=2), {"data": 4, "model": 2})
    >>> print(layout)
    batch over ('data',); a training step cuts it into grad_accum=2
    >>> layout.specs({"x": np.zeros((16, 3))}, training=True)
    {'x': P('data',)}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.data.processes import ProcessShards, check_process_rows, mesh_process_shards
from jaxpar.data.sequence import reorder_sequence
from jaxpar.strategy import check_spec, logical_axes, mesh_sizes, spec_axes, to_partition_spec


def batch_axes(config: ParallelConfig, mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over by default (``mesh``: a ``Mesh``,
    ``AbstractMesh`` or ``{axis: size}``)."""
    sizes = mesh_sizes(mesh)
    if "batch" in config.rules:
        return logical_axes("batch", sizes, config.rules)
    if config.mode == "data":
        skip = (config.pipeline.axis, *_context_axes(config))   # these split stages / the sequence
        return tuple(a for a in sizes if a not in skip)
    return ("data",) if "data" in sizes else ()


def _context_axes(config: ParallelConfig) -> tuple[str, ...]:
    return () if config.context is None else config.context.axes


def step_parts(config: ParallelConfig) -> dict[str, int]:
    """The parts a training step cuts its global batch into (`split_rows`), by the field that
    asks for them: ``grad_accum`` and ``interleave``, those above 1.

    >>> step_parts(ParallelConfig(grad_accum=4))
    {'grad_accum': 4}
    """
    return {name: v for name, v in (("grad_accum", config.grad_accum), ("interleave", config.interleave)) if v > 1}


def check_rows(what: str, rows: int, axes: tuple[str, ...], sizes: Mapping[str, int], parts: Mapping[str, int],
               *, known: bool = True) -> None:
    """The one rule for the rows of a batch leaf: a training step cuts its global batch into
    ``parts`` (`step_parts`; ``{}`` for a batch split whole: an evaluation, a placement) and
    splits each part over the batch ``axes``, so the rows must be a multiple of the devices of
    ``axes`` times the parts. ``known=False``: whether the parts apply is not known (the leaf
    may be a training batch, one part of one, or an evaluation batch): only the devices are
    required, and the refusal names both. A ``ValueError`` names ``what``, the sizes and the fix.

    >>> check_rows("batch['x']", 16, ("data",), {"data": 8}, {"grad_accum": 4})
    Traceback (most recent call last):
    ValueError: batch['x'] has 16 rows: grad_accum=4 cuts it into 4 parts of 4 rows, and each part is split \
over the batch axes ('data',) (8 devices), so the global batch must be a multiple of 32 = 8 x 4; use a global \
batch of 32, or a smaller grad_accum
    """
    devices = math.prod(sizes[a] for a in axes)
    k = math.prod(parts.values())
    need = devices * k if known else devices
    if rows % need == 0:
        return
    cut = " x ".join(f"{name}={v}" for name, v in parts.items())
    smaller = " or ".join(parts)
    if known and parts:
        raise ValueError(
            f"{what} has {rows} rows: {cut} cuts it into {k} parts of {rows / k:g} rows, and each part is split over "
            f"the batch axes {axes} ({devices} devices), so the global batch must be a multiple of {need} = "
            f"{devices} x {k}; use a global batch of {_near(rows, need)}, or a smaller {smaller}")
    head = (f"{what}: the batch dimension {rows} is not divisible by {devices}, the size of the batch axes {axes} "
            f"of mesh {dict(sizes)}; ")
    if not parts:
        raise ValueError(head + f"use a batch that is a multiple of {devices} (e.g. {_near(rows, devices)})")
    raise ValueError(head + f"use a training batch that is a multiple of {devices * k} = {devices} x {k} (a training "
                     f"step cuts it into {k} parts, {cut}, and splits each over those devices; or use a smaller "
                     f"{smaller}) and an evaluation batch that is a multiple of {devices}")


def _near(rows: int, need: int) -> str:
    """The batch sizes nearest ``rows`` that are multiples of ``need``."""
    return " or ".join(str(b) for b in (rows // need * need, (rows // need + 1) * need) if b)


def part_shapes(batch, k: int) -> Any:
    """Abstract shapes of one of ``k`` equal parts of ``batch`` (see `split_rows`).

    >>> part_shapes({"x": np.zeros((8, 3))}, 4)["x"].shape
    (2, 3)
    """
    def one(x):
        shape = _shape(x)
        if not shape or shape[0] % k:
            raise ValueError(
                f"batch leaf of shape {tuple(shape)}: its batch dimension is not divisible into {k} "
                f"equal parts (grad_accum × interleave, or pipeline micro-batches); use a global batch "
                f"that is a multiple of {k}")
        return jax.ShapeDtypeStruct((shape[0] // k, *shape[1:]), x.dtype)

    return jax.tree.map(one, batch)


def split_rows(x, k: int):
    """``[B, ...]`` → ``[k, B/k, ...]`` where part ``j`` holds rows ``j, j+k, j+2k, ...``.

    The one way jaxpar cuts a batch into parts (gradient accumulation, multi-copy, pipeline
    micro-batches): with the batch split over the data axes in contiguous blocks, every
    device holds ``1/k`` of its own rows in each part, so no row moves between devices.

    >>> split_rows(np.arange(6), 3).tolist()
    [[0, 3], [1, 4], [2, 5]]
    """
    if not np.shape(x) or x.shape[0] % k:
        raise ValueError(f"batch leaf of shape {tuple(np.shape(x))}: the batch dimension is not divisible "
                         f"into {k} equal parts; use a batch that is a multiple of {k}")
    return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where the rows (and, with a context axis, the tokens) of every batch leaf go, read once
    from a config and a mesh (`of`); printable, comparable, the same for the same inputs.

    Attributes:
      mesh: mesh axis name -> size.
      axes: the batch axes, which the default split puts dimension 0 over.
      strategy: ``dataset_strategy`` (``None``: the default split over ``axes``).
      rules: the config's rules (a strategy in logical names resolves through them).
      context: the context axes dimension 1 of ``[B, S, ...]`` leaves is split over.
      context_config: the ``ContextConfig`` (the order the sequence is reordered in), or None.
      parts: the parts a training step cuts its batch into (`step_parts`).
      microbatches: the micro-batches a pipeline cuts each part into (1 without a pipeline).
      pipe_axis: the pipeline's stage axis, or None without a pipeline.
    """

    mesh: Mapping[str, int]
    axes: tuple[str, ...]
    strategy: Any = None
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    context: tuple[str, ...] = ()
    context_config: Any = None
    parts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    microbatches: int = 1
    pipe_axis: str | None = None

    @classmethod
    def of(cls, config: ParallelConfig, mesh) -> "BatchLayout":
        """The layout of ``config``'s batches on ``mesh`` (a ``Mesh``, ``AbstractMesh`` or
        ``{axis: size}``)."""
        piped = config.pipeline.stages > 1
        return cls(mesh=dict(mesh_sizes(mesh)), axes=batch_axes(config, mesh), strategy=config.dataset_strategy,
                   rules=dict(config.rules), context=_context_axes(config), context_config=config.context,
                   parts=step_parts(config), microbatches=config.pipeline.microbatches if piped else 1,
                   pipe_axis=config.pipeline.axis if piped else None)

    def __hash__(self) -> int:
        return hash(repr(self))

    def __str__(self) -> str:
        return "; ".join([self.describe(), *self._cuts()])

    def _cuts(self) -> list[str]:
        out = []
        if self.parts:
            out.append("a training step cuts it into " + " x ".join(f"{n}={v}" for n, v in self.parts.items()))
        if self.pipe_axis is not None:
            out.append(f"the pipeline cuts each part into {self.microbatches} micro-batches")
        if self.context:
            out.append(f"the sequence over {self.context} ({self.context_config.order} order)")
        return out

    # ----------------------------------------------------------------- specs
    def leaf_spec(self, shape, key: str | None = None, *, training: bool | None = None,
                  name: str | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` of one batch leaf of global ``shape`` (under top-level ``key``;
        ``name``: the leaf as a refusal names it, e.g. ``batch['inputs']``, by default its shape).

        ``training`` says what the batch is for, which decides the rows it must have
        (`check_rows`): ``True``, a training step's global batch (cut into `parts`); ``False``,
        a batch split whole (an evaluation, a placement); ``None``, not known (the leaf may be a
        training batch, one of its parts or an evaluation batch): its rows must split over the
        batch axes, and a refusal names what a training and an evaluation batch need."""
        strategy = self._strategy(key)
        if strategy == "full_batch" or not shape:
            return PartitionSpec()
        if strategy is not None:
            return to_partition_spec(strategy, self.mesh, shape, rules=self.rules)
        axes = self.axes
        spec = PartitionSpec(axes if len(axes) > 1 else axes[0] if axes else None)
        if self.context and len(shape) >= 2:    # context parallel: [B, S, ...] leaves split over S too
            spec = PartitionSpec(spec[0], self.context if len(self.context) > 1 else self.context[0])
        check_rows(name or f"batch leaf of shape {tuple(shape)}", shape[0], axes, self.mesh,
                   {} if training is False else self.parts, known=training is not None)
        check_spec(spec, self.mesh, shape)
        return spec

    def _strategy(self, key):
        strategy = self.strategy
        if isinstance(strategy, dict):
            if key not in strategy:
                raise ValueError(
                    f"dataset_strategy is a dict with keys {sorted(strategy)} but the batch has a leaf "
                    f"under {key!r}; give a strategy (or None) for every top-level batch key")
            strategy = strategy[key]
        return strategy

    def specs(self, batch, *, training: bool | None = None) -> Any:
        """``PartitionSpec`` for every leaf of ``batch`` (arrays or shapes of the global batch, by
        its global shape and top-level key); ``training``: what the batch is for (`leaf_spec`)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.leaf_spec(_shape(x), _top_key(path), training=training,
                                           name=f"batch{jax.tree_util.keystr(path)}"), batch)

    def shardings(self, mesh, batch, *, training: bool | None = None) -> Any:
        """``NamedSharding`` on ``mesh`` for every leaf of ``batch``."""
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs(batch, training=training),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def row_axes(self, shape, key: str | None = None) -> tuple[str, ...]:
        """The mesh axes the rows of a leaf of ``shape`` under top-level ``key`` are split over
        (the first entry of its spec; its rows are not checked here)."""
        strategy = self._strategy(key)
        if strategy == "full_batch":
            return ()
        if strategy is None:
            return self.axes
        spec = to_partition_spec(strategy, self.mesh, None, rules=self.rules)
        return spec_axes(spec[0]) if len(spec) else ()

    def split_axes(self) -> set[str]:
        """The mesh axes some batch leaf is split over (by `leaf_spec`'s rules)."""
        strategy = self.strategy
        out = set()
        for s in strategy.values() if isinstance(strategy, dict) else (strategy,):
            if s is None:
                out.update(self.axes)
            elif s != "full_batch":
                out.update(a for e in to_partition_spec(s, self.mesh, rules=self.rules) for a in spec_axes(e))
        return out

    def describe(self) -> str:
        """How batches are split: the default batch axes only where ``dataset_strategy`` leaves
        the split to them."""
        def one(s) -> str:
            if s == "full_batch":
                return "replicated (full_batch)"
            if s is None:
                return f"over {self.axes}" if self.axes else "replicated (no batch axes)"
            return f"by strategy {self._strategy_text(s)}"

        strategy = self.strategy
        if isinstance(strategy, dict):
            return "batch per key: " + ", ".join(f"{k} {one(v)}" for k, v in strategy.items())
        if strategy == "full_batch":
            return "batch replicated (dataset_strategy='full_batch')"
        return f"batch {one(strategy)}" if strategy is None else \
            f"batch by dataset_strategy {self._strategy_text(strategy)}"

    def _strategy_text(self, s) -> str:
        if isinstance(s, (tuple, list)):
            return str(tuple(s))
        return str(to_partition_spec(s, self.mesh, rules=self.rules))

    # ----------------------------------------------------------------- a training step's parts
    def check_parts(self, batch) -> None:
        """Every part of a training step (`parts`) keeps each leaf split over the devices its
        rows are split over (a ``dataset_strategy``'s too): the global batch is a multiple of
        their count times the parts."""
        if not self.parts:
            return
        specs = jax.tree.leaves(self.specs(batch), is_leaf=lambda v: isinstance(v, PartitionSpec))
        for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(batch), specs):
            axes = spec_axes(spec[0]) if len(spec) else ()
            check_rows(f"batch{jax.tree_util.keystr(path)}", x.shape[0] if x.shape else 0, axes, self.mesh,
                       self.parts)

    def micro(self, batch) -> Any:
        """``batch`` cut into the pipeline's micro-batches (`split_rows`): ``[m, B/m, ...]`` leaves."""
        return jax.tree.map(lambda x: split_rows(x, self.microbatches), batch)

    # ----------------------------------------------------------------- several processes
    def process_view(self, mesh, batch, *, training: bool | None = None) -> Any:
        """Shapes (``jax.ShapeDtypeStruct``) of the global batch that ``batch``, this process's own
        rows in a run of several processes, makes on ``mesh`` (a live ``Mesh``): each leaf's rows
        times the process count, once they pass `check_process_rows` against the batch shards
        this process's devices hold (``training``: a training batch is cut into `parts`). A leaf
        that is a global ``jax.Array`` already keeps its shape."""
        procs = jax.process_count()
        parts = dict(self.parts) if training else {}
        found: dict[tuple[str, ...], ProcessShards] = {}

        def one(path, x):
            shape = _shape(x)
            dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
            if _is_global(x) or not shape:
                return jax.ShapeDtypeStruct(shape, dtype)
            axes = self.row_axes(shape, _top_key(path))
            if axes not in found:
                found[axes] = mesh_process_shards(mesh, axes)
            check_process_rows(f"batch{jax.tree_util.keystr(path)}", shape[0], found[axes], parts)
            return jax.ShapeDtypeStruct((shape[0] * procs, *shape[1:]), dtype)

        return jax.tree_util.tree_map_with_path(one, batch)

    def place(self, mesh, batch, *, global_batch: bool = True) -> Any:
        """``batch`` on ``mesh``; see `jaxpar.data.place_batch`."""
        batch = reorder_sequence(self.context_config, self.mesh, batch)   # causal load-balancing order
        if jax.process_count() == 1 or global_batch:
            def put(x, sharding):
                if isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding):
                    return x   # already placed (a batch placed once and stepped on again costs nothing)
                if jax.process_count() == 1:
                    return jax.device_put(x, sharding)
                x = np.asarray(x)
                return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

            return jax.tree.map(put, batch, self.shardings(mesh, batch, training=False))

        from jaxpar.distributed import make_global_batch

        shapes = self.process_view(mesh, batch, training=False)     # this process's rows, checked

        def put_local(path, x, shape):
            spec = self.leaf_spec(shape.shape, _top_key(path), training=False,
                                  name=f"batch{jax.tree_util.keystr(path)}")
            sharding = NamedSharding(mesh, spec)
            if _is_global(x):
                return x if x.sharding == sharding else jax.jit(lambda a: a, out_shardings=sharding)(x)
            # Handles meshes whose batch axes do not follow process boundaries (e.g. data=2 on 4 processes).
            return make_global_batch(np.asarray(x), sharding)

        return jax.tree_util.tree_map_with_path(put_local, batch, shapes)


def _is_global(x) -> bool:
    """A ``jax.Array`` over several processes' devices: its shape is the global one already."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _top_key(path) -> str | None:
    return getattr(path[0], "key", getattr(path[0], "name", None)) if path else None


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


# The functional forms, each the layout of (config, mesh) asked once.

def leaf_spec(config: ParallelConfig, mesh, shape, key: str | None = None, *,
              training: bool | None = None, name: str | None = None) -> PartitionSpec:
    """`BatchLayout.leaf_spec` of ``config`` on ``mesh``.

    >>> leaf_spec(ParallelConfig(mesh={"data": 8}, grad_accum=2), {"data": 8}, (12, 4), training=False)
    Traceback (most recent call last):
    ValueError: batch leaf of shape (12, 4): the batch dimension 12 is not divisible by 8, the size of the batch \
axes ('data',) of mesh {'data': 8}; use a batch that is a multiple of 8 (e.g. 8 or 16)
    """
    return BatchLayout.of(config, mesh).leaf_spec(shape, key, training=training, name=name)


def batch_specs(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """``PartitionSpec`` for every leaf of ``batch`` (`BatchLayout.specs`)."""
    return BatchLayout.of(config, mesh).specs(batch, training=training)


def batch_shardings(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """``NamedSharding`` for every leaf of ``batch``."""
    return BatchLayout.of(config, mesh).shardings(mesh, batch, training=training)


def process_view(config: ParallelConfig, mesh, batch, *, training: bool | None = None) -> Any:
    """`BatchLayout.process_view` of ``config`` on ``mesh``."""
    return BatchLayout.of(config, mesh).process_view(mesh, batch, training=training)


def place_batch(config: ParallelConfig, mesh, batch, *, global_batch: bool = True) -> Any:
    """Put a batch on the mesh.

    ``global_batch=True``: every leaf holds the global batch (single process: always).
    ``global_batch=False`` in a multi-process run: each process holds its contiguous block of
    rows; the global array is assembled with ``make_array_from_process_local_data``, its rows
    this block's times the process count, and the block is checked against the batch shards
    this process's devices hold (`check_process_rows`); a leaf that is a global ``jax.Array``
    already is kept (moved to the batch's sharding if it has another).
    Placing splits the batch whole over the batch axes (a training step's ``grad_accum`` parts
    are checked by the step): its rows must be a multiple of their devices. With a context axis
    the sequence is reordered first (`jaxpar.data.sequence.reorder_batch`).
    """
    return BatchLayout.of(config, mesh).place(mesh, batch, global_batch=global_batch)
