"""A `TrainState` as one flat ``{path: array}`` map, and the restore target.

Every leaf gets a path ``section/...`` (``params/blocks/0/attn/wq``, ``opt_state/0/mu/...``,
``rest/rngs/dropout/key``): the same paths the parameter specs print. Checkpoints store the
leaves as a nested dict of these path parts, so a checkpoint is independent of optax's and
NNX's container classes and two trainers whose states have the same paths (other mesh, other
ZeRO level, other tensor layout) read each other's checkpoints.

PRNG key arrays (``nnx.RngKey`` in ``trainer.rest``) are stored as their raw ``uint32`` key data
and wrapped again with the target's key implementation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.nn.specs import path_str

SECTIONS = ("params", "opt_state", "rest")


def is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def as_state(state_or_trainer):
    """A `TrainState`, or the ``.state`` of an object that holds one (a Trainer)."""
    return getattr(state_or_trainer, "state", state_or_trainer)


def sections(state) -> dict[str, Any]:
    state = as_state(state)
    return {"params": state.params, "opt_state": state.opt_state, "rest": state.rest}


def flat_state(state) -> dict[str, Any]:
    """``{path: leaf}`` of a state's params, optimizer state and other NNX state."""
    out = {}
    for section, tree in sections(state).items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[f"{section}/{path_str(path)}"] = leaf
    return out


def savable(flat: dict[str, Any]) -> dict[str, Any]:
    """Key arrays → their ``uint32`` key data; Python scalars → numpy."""
    out = {}
    for path, leaf in flat.items():
        if is_key(leaf):
            leaf = jax.random.key_data(leaf)
        elif not isinstance(leaf, (jax.Array, np.ndarray)):
            leaf = np.asarray(leaf)
        out[path] = leaf
    return out


class Leaf(NamedTuple):
    """What a checkpoint records about one stored leaf (and what a trainer expects)."""

    shape: tuple[int, ...]
    dtype: str


def leaf_info(x) -> Leaf:
    return Leaf(tuple(int(d) for d in x.shape), str(np.dtype(x.dtype)))


def _sharding_of(leaf, mesh) -> jax.sharding.Sharding:
    sharding = getattr(leaf, "sharding", None)
    return sharding if sharding is not None else NamedSharding(mesh, PartitionSpec())


def target(state, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """``{path: ShapeDtypeStruct(shape, dtype, sharding)}``: where each stored leaf must land.

    Shapes and shardings come from the target state's own (already planned) arrays, so a
    restore reads every array straight into the shards its layout wants.
    """
    out = {}
    for path, leaf in flat_state(state).items():
        sharding = _sharding_of(leaf, mesh)
        if is_key(leaf):
            data = jax.eval_shape(jax.random.key_data, leaf)
            spec = getattr(sharding, "spec", PartitionSpec())
            sharding = NamedSharding(mesh, PartitionSpec(*spec))
            out[path] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        else:
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            out[path] = jax.ShapeDtypeStruct(np.shape(leaf), dtype, sharding=sharding)
    return out


def install(state, restored: dict[str, Any]):
    """A copy of ``state`` holding the restored leaves (by path)."""
    state = as_state(state)
    trees = {}
    for section, tree in sections(state).items():
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = []
        for path, old in flat:
            new = restored[f"{section}/{path_str(path)}"]
            if is_key(old):
                new = jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
            leaves.append(new)
        trees[section] = jax.tree_util.tree_unflatten(treedef, leaves)
    return state.replace(**trees)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b/c": x}`` → ``{"a": {"b": {"c": x}}}`` (how orbax stores the tree)."""
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        *parents, name = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaf
    return out


def unnest(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The inverse of ``nest`` (also for orbax's metadata trees)."""
    if isinstance(tree, dict) or (hasattr(tree, "keys") and hasattr(tree, "__getitem__")):
        out = {}
        for k in tree.keys():
            out.update(unnest(tree[k], f"{prefix}{k}/"))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(unnest(v, f"{prefix}{i}/"))
        return out
    return {prefix[:-1]: tree}


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: each difference listed by parameter path."""

    def __init__(self, directory: str, step: int, problems: list[str], *, params_only: bool = False):
        self.problems = problems
        self.params_only = params_only
        if params_only:     # no optimizer state at all: what `import_hf` writes, not a training run's save
            others = [p for p in problems if not p.startswith("missing opt_state/")]
            listing = "".join(f"\n  {p}" for p in others)
            super().__init__(
                f"checkpoint {directory} step {step} holds parameters only (no optimizer state, as "
                f"`jaxpar ckpt import-hf` / jaxpar.interop.hf.import_hf writes, or a trainer whose optimizer keeps "
                f"none saved), so this trainer cannot resume from it "
                f"(nothing was restored){f'; its parameters differ too ({len(others)}):' if others else ''}"
                f"{listing}\nTo fine-tune these weights, start a new run from them: in Python, "
                "cfg, params = import_hf(HF_DIR, config=parallel_config) and build the Trainer from "
                "llama_model(cfg, params, constrain=...) with that ParallelConfig (docs/interop.md, \"Training "
                "from imported weights\"); give the run's checkpoint.dir another directory, where it saves its "
                "own steps."
            )
            return
        listing = "\n  ".join(problems)
        super().__init__(
            f"checkpoint {directory} step {step} does not fit this trainer ({len(problems)} "
            f"difference(s); nothing was restored):\n  {listing}\n"
            "Build the trainer from the same model and optimizer that were saved (the layout "
            "may differ), or convert the checkpoint first."
        )


def differences(saved: dict[str, Leaf], wanted: dict[str, Leaf]) -> list[str]:
    """One line per missing, extra, reshaped or retyped leaf (sorted by path)."""
    problems = []
    for path in sorted(set(saved) | set(wanted)):
        if path not in saved:
            problems.append(f"missing {path}: the trainer has {wanted[path].shape} {wanted[path].dtype}, "
                            "the checkpoint has no such entry")
        elif path not in wanted:
            problems.append(f"extra   {path}: the checkpoint has {saved[path].shape} {saved[path].dtype}, "
                            "the trainer has no such entry")
        else:
            s, w = saved[path], wanted[path]
            if s.shape != w.shape:
                problems.append(f"shape   {path}: checkpoint {s.shape}, trainer {w.shape}")
            if s.dtype != w.dtype:
                problems.append(f"dtype   {path}: checkpoint {s.dtype}, trainer {w.dtype}")
    return problems
