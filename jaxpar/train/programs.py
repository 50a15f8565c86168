"""The compiled programs of a Trainer: one per batch shape (and kind), with the batch shardings
found when it was built, how a batch is placed for it, and the lowerings read for reports.

Everything that depends only on a batch's shapes is found once per shape here, so the loop's
per-step host path is a dictionary lookup, one ``device_put`` and the dispatch.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.data import check_processes_agree, check_processes_same, place_batch, process_view
from jaxpar.data.sequence import reorder_batch
from jaxpar.executables import compiled_program, jit_on_disk
from jaxpar.nn.specs import check_rules_used
from jaxpar.optim import fusion
from jaxpar.plan import IdleAxisWarning, TrainPlan, state_shardings
from jaxpar.report.stage_collectives import checked_step
from jaxpar.strategy import recording_axes, recording_rules, spec_axes
from jaxpar.train.replicas import split_step
from jaxpar.train.step import Setting, build_eval, build_grads, build_step

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")   # what Trainer.lower(platform=) may lower for


class Program:
    """A compiled step (or evaluation) for one batch shape, and what placing such a batch needs."""

    __slots__ = ("fn", "shardings", "batch_def", "fast", "row_shardings")

    def __init__(self, fn, shardings: list, batch_def, fast: bool, row_shardings=None):
        self.fn, self.shardings, self.batch_def, self.fast = fn, shardings, batch_def, fast
        self.row_shardings = row_shardings      # where the step takes pulled rows (None: no row source)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a Trainer's compiled step runs: ``donate`` the state's buffers to the step;
    ``global_batch``: every process passes the whole global batch (False: its own rows);
    ``skip_nonfinite``: a step whose loss or gradients are not finite leaves the state as it was;
    ``rule_names``: the logical names the model declares, and ``model_name`` its class's name,
    for the check that every rule of the config names one of them; ``exchange``: the mean over
    replica groups between the gradients and the update (`jaxpar.train.replicas`), or None."""

    donate: bool = True
    global_batch: bool = True
    skip_nonfinite: bool = False
    rule_names: frozenset = frozenset()
    model_name: str = "model"
    exchange: Callable | None = None


class Programs:
    """The cache of compiled programs of one plan on one mesh.

    ``state()`` gives ``(TrainState, treedef of its flat leaves)`` when a program is built (only
    then: a step never rebuilds the state's pytree). ``rows``: the row source's path or None;
    ``options``: how the step runs (`StepOptions`).

    >>> programs = Programs(plan, mesh, graphdef, loss_fn, tx, state=lambda: (state, treedef))  # doctest: +SKIP
    >>> program, leaves = programs.get(batch)                                                  # doctest: +SKIP
    """

    def __init__(self, plan: TrainPlan, mesh, graphdef, loss_fn: Callable, tx, *, state: Callable[[], tuple],
                 leaves: Callable[[], list], rows=None, options: StepOptions = StepOptions()):
        self.plan, self.mesh, self.graphdef, self.loss_fn, self.tx = plan, mesh, graphdef, loss_fn, tx
        self.state, self.leaves, self.rows, self.options = state, leaves, rows, options
        self.cache: dict = {}
        self.unagreed: set = set()    # keys built by lowering alone, before any run checked the processes agree
        self.idle_checked = False     # idle mesh axes: warned of once, at the first traced train step

    def setting(self, rows=None, row_specs=None) -> Setting:
        s, _ = self.state()
        return Setting(self.plan, self.mesh, self.graphdef, s.params, s.rest, rows, row_specs)

    def get(self, batch, kind: str = "train", rows=None, *, agree: bool = True) -> tuple[Program, list]:
        """``(program, the batch's leaves)``: the compiled step (or evaluation) for batches shaped
        like ``batch`` (and pulled ``rows`` shaped like these). The batch is flattened once, here.
        On several processes, the first run (``agree``) of each batch shape checks, by one
        all-gather, that every process feeds alike (`agree`); lowering does not (one process may
        lower alone). A step of a shape it has run costs one dictionary lookup, as before."""
        leaves, treedef = jax.tree.flatten(batch)
        key = (kind, treedef, tuple((np.shape(x), dtype_of(x)) for x in leaves))
        if rows is not None:
            key += self.rows.key(rows)
        program = self.cache.get(key)
        if program is not None and not (agree and self.unagreed and key in self.unagreed):
            return program, leaves
        several = jax.process_count() > 1
        if agree and several:
            self.agree(batch)       # before any check one process could fail alone
            self.unagreed.discard(key)
        if program is None:
            check_batch(batch)
            program = self.cache[key] = self._build(batch, kind, treedef, rows)
            if several and not agree:
                self.unagreed.add(key)
        return program, leaves

    def agree(self, batch) -> None:
        """Every process feeds alike, or every process raises the same ``ValueError`` (before any
        check one process could fail alone): per-process rows, the same row count on each
        (`jaxpar.data.check_processes_agree`); the whole global batch, the same values on each
        (`jaxpar.data.check_processes_same`)."""
        if self.options.global_batch:
            check_processes_same(batch, "Trainer")
        else:
            check_processes_agree(batch, "Trainer")

    def _build(self, batch, kind: str, batch_def, rows=None) -> Program:
        fast = jax.process_count() == 1 and self.plan.config.context is None
        if not fast:    # context parallel reorders the sequence and adds its positions: the step sees that batch
            batch = reorder_batch(self.plan.config, self.mesh, batch)
            batch_def = jax.tree.structure(batch)
        shapes = self.global_view(batch, training=kind == "train")
        specs = self.plan.batch_specs(shapes, training=kind == "train")
        b_sh = jax.tree.leaves(jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                                            is_leaf=lambda x: isinstance(x, PartitionSpec)))
        state, state_def = self.state()
        s_sh = jax.tree.leaves(state_shardings(self.plan, self.mesh, state.detach()[0]),
                               is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        # Pulled rows (a row source): one more input, and their gradients one more output.
        r_sh = () if rows is None else (self.rows.shardings(rows),)
        setting = self.setting(*(self.rows.abstract(rows, r_sh[0]) if r_sh else ()))
        options = fusion.compiler_options(self.plan.config.comm_fusion, self.mesh.devices.flat[0].platform)
        if kind == "train" and self.options.exchange is not None:     # replica groups: two programs, the mean between
            fn = split_step(setting, self.loss_fn, self.tx, shapes, (state_def, batch_def), (s_sh, b_sh),
                            self.options, wrap=lambda f: self._checking_rules(f), compiler_options=options)
        elif kind == "train":
            step = self._checking_rules(build_step(setting, self.loss_fn, self.tx, shapes,
                                                   skip_nonfinite=self.options.skip_nonfinite), r_sh)

            def flat_step(state_leaves, batch_leaves, *rows):
                state, metrics, *row_grads = step(jax.tree.unflatten(state_def, state_leaves),
                                                  jax.tree.unflatten(batch_def, batch_leaves), *rows)
                return state_def.flatten_up_to(state), metrics, *row_grads

            # keep_unused: a state leaf the step only overwrites (a counter of the model's) would be
            # pruned from the program's inputs, and donation would then alias the next input of the
            # same shape and dtype to its output instead of its own
            fn = jit_on_disk(flat_step, in_shardings=(s_sh, b_sh, *r_sh), out_shardings=(s_sh, None, *r_sh),
                             donate_argnums=(0,) if self.options.donate else (), keep_unused=True,
                             compiler_options=options)
        else:
            evaluate = build_eval(setting, self.loss_fn, shapes)

            def flat_eval(state_leaves, batch_leaves, *rows):
                return evaluate(jax.tree.unflatten(state_def, state_leaves),
                                jax.tree.unflatten(batch_def, batch_leaves), *rows)

            fn = jit_on_disk(flat_eval, in_shardings=(s_sh, b_sh, *r_sh))
        if self.plan.pipeline.stages > 1:   # compiled and checked before it runs (a stage's op must hold
            fn = checked_step(fn, self.mesh, self.plan.config.pipeline.axis)   # no cross-stage collective)
        return Program(fn, b_sh, batch_def, fast, r_sh[0] if r_sh else None)

    def placed(self, program: Program, batch, leaves: list) -> list:
        """The batch's leaves for the compiled step. In one process: host (numpy) leaves as they
        are — the step's ``in_shardings`` place them on the way in — and device arrays with one
        batched ``device_put`` to the shardings found when the program was built. Otherwise
        `place_batch` (process-local rows, context-parallel reordering)."""
        if program.fast:    # host arrays go straight into the compiled step, which places them itself
            if all(type(x) is np.ndarray for x in leaves):
                return leaves
            return jax.device_put(leaves, program.shardings)
        return jax.tree.leaves(place_batch(self.plan.config, self.mesh, batch,
                                           global_batch=self.options.global_batch))

    def place(self, batch, *, agree: bool = True):
        """A host batch on the mesh by ``dataset_strategy`` (with rows: the batch the step gets,
        its rows pulled; nothing is pushed); ``agree``: see `get`."""
        rows = None
        if self.rows is not None:
            batch, rows, _ = self.rows.pull(batch)
        program, leaves = self.get(batch, rows=rows, agree=agree)
        if program.fast:
            leaves = jax.device_put(leaves, program.shardings)
        else:
            leaves = self.placed(program, batch, leaves)
        return jax.tree.unflatten(program.batch_def, leaves)

    def last_step(self, batch) -> tuple[Program, Any, Callable[[], jax.stages.Compiled]]:
        """``(program, placed batch, compiled)`` of the step a host ``batch`` ran, for the metrics'
        first read (memory, FLOPs, tokens): ``compiled()`` gives the program the step runs, not a
        second compile of it. With rows: of the batch and rows the last step pulled (pulling again
        would read the rows anew)."""
        if self.rows is not None:
            batch, rows = self.rows.pulled
            program, leaves = self.get(batch, rows=rows)
            batch_leaves = jax.device_put(self.placed(program, batch, leaves), program.shardings)
            placed = jax.tree.unflatten(program.batch_def, batch_leaves)
            return program, placed, lambda: compiled_program(program.fn, self.leaves(), batch_leaves,
                                                             self.rows.placed(program.row_shardings, rows))
        program, _ = self.get(batch)
        placed = self.place(batch)   # global arrays: a process's host batch may hold only its rows
        return program, placed, lambda: compiled_program(program.fn, self.leaves(), jax.tree.leaves(placed))

    def _checking_rules(self, step: Callable, row_shardings: tuple = ()) -> Callable:
        """``step`` that, while it is traced, records the rules its activation constraints consult
        and refuses rules nothing uses (`check_rules_used`) before anything runs; at the first
        trace, it warns of mesh axes that neither the plan nor the traced step's strategies (the
        model's jaxpar.shard / jaxpar.ops / LogicalConstraint) nor the pulled rows split over."""
        def traced(*args):
            with recording_rules() as seen, recording_axes() as used:
                out = step(*args)
            check_rules_used(self.plan.config, self.options.rule_names | seen, self.options.model_name)
            if not self.idle_checked:
                self.idle_checked = True
                used.update(a for sh in jax.tree.leaves(row_shardings) for e in sh.spec for a in spec_axes(e))
                if note := self.plan.idle_axes_note(used):
                    warnings.warn(f"Trainer: {note}", IdleAxisWarning, stacklevel=caller_level())
            return out
        return traced

    def global_view(self, batch, *, training: bool | None = None):
        """Shapes of the global batch (for compile keys and shardings). In a run of several
        processes fed per process (``global_batch=False``), a leaf holds this process's own rows:
        the global batch has those rows times the process count, and they are checked against
        the batch shards this process's devices hold, not against the whole mesh
        (`jaxpar.data.process_view`; ``training``: cut into the step's parts)."""
        if jax.process_count() > 1 and not self.options.global_batch:
            return process_view(self.plan.config, self.mesh, batch, training=training)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)), batch)

    def lowered(self, state_leaves: list, batch, kind: str, platform: str | None = None) -> jax.stages.Lowered:
        """The lowered step (``kind="train"``) or evaluation for ``batch``, for ``platform`` (None:
        the mesh's; another backend's StableHLO is readable here and compiles only there)."""
        if platform is not None and platform not in LOWERING_PLATFORMS:
            raise ValueError(f"Trainer.lower: platform={platform!r} is not one of {LOWERING_PLATFORMS}; "
                             "e.g. platform='cuda' for the program an NVIDIA GPU would compile")
        rows = ()
        if self.rows is not None:
            batch, pulled, _ = self.rows.pull(batch)
            rows = (pulled,)
        program, leaves = self.get(batch, kind, *rows, agree=False)
        args = (state_leaves, self.placed(program, batch, leaves),
                *(self.rows.placed(program.row_shardings, r) for r in rows))
        if platform is None:
            return program.fn.lower(*args)
        return program.fn.trace(*args).lower(lowering_platforms=(platform,))

    def evaluate(self, state_leaves: list, batch) -> jax.Array:
        """The loss of the model in evaluation mode on ``batch`` (rows pulled, nothing pushed)."""
        rows = ()
        if self.rows is not None:
            batch, pulled, _ = self.rows.pull(batch)
            rows = (pulled,)
        program, leaves = self.get(batch, "eval", *rows)
        return program.fn(state_leaves, self.placed(program, batch, leaves),
                          *(self.rows.placed(program.row_shardings, r) for r in rows))

    def lower_grads(self, batch) -> jax.stages.Lowered:
        """The step up to the update for ``batch``: its outputs are the gradients as the update
        receives them (ZeRO gradient specs)."""
        if self.rows is not None:
            raise ValueError("Trainer.lower_grads: a Trainer with rows= differentiates the pulled rows too; "
                             "lower the whole step with Trainer.lower(batch) instead")
        placed = self.place(batch, agree=False)
        s = self.setting()
        state, _ = self.state()
        grads = build_grads(s, self.loss_fn, self.global_view(placed))
        sh = state_shardings(self.plan, self.mesh, state)
        b_sh = jax.tree.map(lambda x: x.sharding, placed)
        fn = jax.jit(lambda p, r, b: grads(p, r, b)[3], in_shardings=(sh.params, sh.rest, b_sh),
                     out_shardings=s.shardings(s.zero.grads))
        return fn.lower(state.params, state.rest, placed)


def caller_level() -> int:
    """The ``stacklevel`` that points a warning given while the step is traced at the first caller
    outside jaxpar and JAX (the line calling ``step`` / ``fit`` / ``lower``)."""
    frame, level = sys._getframe(1), 1     # 1: the function that warns
    while frame.f_back is not None and (frame.f_globals.get("__name__") or "").split(".")[0] in _INNER:
        frame, level = frame.f_back, level + 1
    return level


_INNER = {"jaxpar", "jax", "jaxlib", "flax", "contextlib", "functools"}


def check_batch(batch) -> None:
    """A batch is a pytree of arrays with one leading (batch) dimension shared by every leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch has no arrays; pass a pytree of arrays whose leading dimension is the batch")
    rows = None
    for path, x in leaves:
        shape = np.shape(x)
        where = f"batch{jax.tree_util.keystr(path)}"
        if not shape:
            raise ValueError(f"{where} is a scalar; every batch leaf needs a leading batch dimension "
                             "(broadcast it to [batch, ...] or close over it in loss_fn)")
        dtype = dtype_of(x)      # jnp: NumPy counts bfloat16 and the float8 types as no numbers
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
            raise TypeError(f"{where} has dtype {dtype}: batch leaves must be numeric or boolean arrays (they "
                            "are placed on the devices); encode strings as ids, or keep them out of the batch")
        if shape[0] == 0:
            raise ValueError(f"{where} has 0 rows (shape {tuple(shape)}); a batch needs at least one row: its mean "
                             "loss over no rows is NaN. Drop the empty batch or feed it rows")
        if rows is None:
            rows, first = shape[0], where
        elif shape[0] != rows:
            raise ValueError(f"{where} has {shape[0]} rows but {first} has {rows}; every batch leaf must have "
                             "the same leading (batch) dimension")


def dtype_of(x) -> Any:
    """An array's dtype, or the one NumPy gives a Python value (``np.result_type`` of an array
    object itself is deprecated); a JAX key array's ``key<...>`` dtype as it is (NumPy reads
    no such dtype)."""
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)
