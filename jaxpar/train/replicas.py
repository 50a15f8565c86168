"""The Trainer's side of replica groups (``Placement(replicas=group)``; the transport is
`jaxpar.ps.replicas`).

With replica groups the step is two programs with the groups' mean between them (`split_step`):
the gradients (the chain of `jaxpar.train.step.build_grads`, every technique included), their
mean over the live groups on the host, then the update (`jaxpar.train.step.update`, the same
wrapper the one-program step ends with). The non-parameter state's floating-point leaves (batch
statistics) are averaged with the gradients, so every group holds the same state.

`ReplicaPath` is also a hook: at the start it joins the mean (a group that comes back takes a
live group's state, step and data position: `heal`), before each step it names the step, and
after a step whose mean asked for it, it sends this group's state to the groups healing.

A group sends the shards of each array that its process holds, once per distinct shard (in the
order of their offsets), so a group of several processes averages rank by rank, each process
with the same process of every other group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.executables import compiled_program, jit_on_disk
from jaxpar.plan.state import sharded_tx
from jaxpar.train.step import Setting, build_grads, update

WIRE_DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")   # what the wire carries as is


def check_replicas(replicas, rows) -> None:
    """A replica group has the transport's calls; row sources are refused with it, by name."""
    if replicas is None:
        return
    needed = ("join", "average", "send_state", "close")
    if not all(callable(getattr(replicas, m, None)) for m in needed):
        raise TypeError(f"Placement: replicas= must be a replica group with {needed} (jaxpar.ps.replicas.connect()), "
                        f"got {type(replicas).__name__}")
    if rows is not None:
        raise ValueError("Trainer: Placement(replicas=...) with rows=: replica groups average the dense gradients, and "
                         "a row source pushes its rows' gradients to its own tables from every group; train the rows "
                         "in one group, or keep them in the model")


def replica_hooks(replicas) -> list:
    """The Trainer's hook for ``Placement(replicas=...)`` (none without one; `check_replicas` has
    checked it with the Trainer's arguments)."""
    return [] if replicas is None else [ReplicaPath(replicas)]


# ------------------------------------------------------------------ host shards
def _key(index: tuple, shape: tuple) -> tuple:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def _shards(x: jax.Array) -> list[tuple[tuple, jax.Array]]:
    """This process's distinct shards of ``x`` by offset, in offset order."""
    seen: dict[tuple, jax.Array] = {}
    for shard in x.addressable_shards:
        seen.setdefault(_key(shard.index, x.shape), shard.data)
    return sorted(seen.items())


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(leaves: list[jax.Array]) -> list[np.ndarray]:
    """This process's distinct shards of every leaf as host arrays the wire carries (float32 for
    bfloat16 and float16; booleans as int32; a PRNG key as its key data)."""
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in leaves]
    data = jax.device_get([d for x in leaves for _, d in _shards(x)])
    return [a if a.dtype.name in WIRE_DTYPES else
            a.astype(np.float32 if jnp.issubdtype(a.dtype, jnp.floating) else np.int32) for a in map(np.asarray, data)]


def from_host(like: list[jax.Array], arrays: list[np.ndarray]) -> list[jax.Array]:
    """Arrays shaped, typed and placed as ``like`` from the host shards `to_host` gave for it."""
    out, k = [], 0
    for key_like in like:
        x = jax.random.key_data(key_like) if _is_key(key_like) else key_like
        keys = [key for key, _ in _shards(x)]
        got = dict(zip(keys, arrays[k:k + len(keys)]))
        k += len(keys)
        if len(got) != len(keys) or any(got[key].shape != tuple(b - a for a, b in key) for key in keys):
            raise ValueError(f"replica groups: the shards received for an array of shape {x.shape} do not match this "
                             "process's shards of it (another mesh or plan in the other group?)")
        y = jax.make_array_from_callback(x.shape, x.sharding,
                                         lambda index, got=got, x=x: got[_key(index, x.shape)].astype(x.dtype))
        out.append(jax.random.wrap_key_data(y, impl=jax.random.key_impl(key_like)) if _is_key(key_like) else y)
    if k != len(arrays):
        raise ValueError(f"replica groups: received {len(arrays)} shards for {k} expected")
    return out


def layout(tree) -> str:
    """A digest of a state's leaves (paths, shapes, dtypes, shardings) and of the job's processes:
    the groups of one mean must agree on it."""
    parts = [str(jax.process_count()), str(jax.local_device_count())]
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sh = x.sharding
        parts.append(f"{jax.tree_util.keystr(path)}{x.shape}{x.dtype}{getattr(sh, 'spec', '')}"
                     f"{dict(getattr(getattr(sh, 'mesh', None), 'shape', {}))}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def fingerprint(leaves: list[jax.Array]) -> str:
    """A digest of the values of ``leaves`` (the same on every process of a job): the wrapping
    sum of each leaf's bits, computed where the leaf lives, so nothing but one small vector leaves
    the devices. Groups founding a mean compare theirs: one that differs (another seed or
    checkpoint) takes the first group's state."""
    def bits(x):
        x = jax.random.key_data(x) if _is_key(x) else x
        x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]   # (8: two words)
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).sum(dtype=jnp.uint32)

    if not leaves:
        return ""
    mesh = next((x.sharding.mesh for x in leaves if hasattr(x.sharding, "mesh")), None)
    out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sums = jax.jit(lambda xs: jnp.stack([bits(x) for x in xs]), out_shardings=out)(leaves)
    return hashlib.sha256(np.asarray(sums.addressable_data(0)).tobytes()).hexdigest()


# ------------------------------------------------------------------ the step
class SplitStep:
    """``(state leaves, batch leaves) -> (state leaves, metrics)`` as two programs with the
    groups' mean between them (of the loss, the non-parameter state's floats and the gradients;
    ``metrics["loss"]`` is the mean over the live groups, the loss of their rows). ``lower``,
    ``trace`` and ``compiled`` give the gradient program (the one with the model's FLOPs; the
    update is the second, smaller one)."""

    def __init__(self, grads_fn, apply_fn, average: Callable[[list], list]):
        self.grads_fn, self.apply_fn, self.average = grads_fn, apply_fn, average

    def __call__(self, state_leaves, batch_leaves):
        loss, aux, rest, grads = self.grads_fn(state_leaves, batch_leaves)
        rest_leaves, rest_def = jax.tree.flatten(rest)
        grad_leaves, grad_def = jax.tree.flatten(grads)
        floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in rest_leaves]
        # the loss too: every group judges the step finite (and reports its loss) alike
        mean = iter(self.average([loss] + [x for x, f in zip(rest_leaves, floats) if f] + grad_leaves))
        loss = next(mean)
        rest = jax.tree.unflatten(rest_def, [next(mean) if f else x for x, f in zip(rest_leaves, floats)])
        grads = jax.tree.unflatten(grad_def, [next(mean) for _ in grad_leaves])
        return self.apply_fn(state_leaves, (loss, aux, rest, grads))

    def lower(self, *args, **kwargs):
        return self.grads_fn.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.grads_fn.trace(*args, **kwargs)

    def compiled(self, *args):
        return compiled_program(self.grads_fn, *args)


def split_step(setting: Setting, loss_fn: Callable, tx, shapes, defs: tuple, shardings: tuple, options, *,
               wrap: Callable = lambda f: f, compiler_options: dict | None = None) -> SplitStep:
    """The `SplitStep` of ``setting`` for batches of ``shapes``: ``defs`` are the treedefs of the
    state's and the batch's flat leaves, ``shardings`` their shardings; ``options``: the step's
    (`jaxpar.train.programs.StepOptions`: ``exchange`` takes the host-side mean over the groups,
    ``skip_nonfinite``, ``donate``); ``wrap``: applied to the gradient function as it is traced
    (the rules check); ``compiler_options``: XLA's, for both programs (communication fusion's).
    Both programs are kept on disk where the one-program step would be (`jaxpar.executables`)."""
    state_def, batch_def = defs
    s_sh, b_sh = shardings
    grads = wrap(build_grads(setting, loss_fn, shapes))

    def tree_grads(state_leaves, batch_leaves):
        st = jax.tree.unflatten(state_def, state_leaves)
        return grads(st.params, st.rest, jax.tree.unflatten(batch_def, batch_leaves))

    # the update after the mean: the one-program step's last wrapper, given the averaged gradients
    step = update(setting, lambda params, rest, carried: carried,
                  sharded_tx(setting.plan, setting.mesh, tx, setting.params_like), skip_nonfinite=options.skip_nonfinite)

    def flat_apply(state_leaves, carried):
        new, metrics = step(jax.tree.unflatten(state_def, state_leaves), carried)
        return state_def.flatten_up_to(new), metrics

    out = (None, None, setting.shardings(setting.rest_specs), setting.shardings(setting.zero.grads))
    grads_fn = jit_on_disk(tree_grads, in_shardings=(s_sh, b_sh), out_shardings=out, keep_unused=True,
                           compiler_options=compiler_options)
    apply_fn = jit_on_disk(flat_apply, in_shardings=(s_sh, None), out_shardings=(s_sh, None),
                           donate_argnums=(0,) if options.donate else (), keep_unused=True,
                           compiler_options=compiler_options)
    return SplitStep(grads_fn, apply_fn, options.exchange)


# ------------------------------------------------------------------ the hook
class ReplicaPath:
    """A replica group as the Trainer drives it: the mean in the step, join and heal at the
    start, the state sent after a step whose mean asked for it, the group left at the end."""

    service = "replicas"

    def __init__(self, group):
        self.group = group
        self.step = None           # the step being run (set before it)
        self.healed: dict[str, Any] | None = None    # {"step"} when this start took a live group's state

    def average(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """The mean over the live groups of ``leaves`` (this process's shards of them)."""
        return from_host(leaves, self.group.average(self.step, to_host(leaves)))

    def on_start(self, trainer) -> None:
        detached = trainer.state.detach()[0]
        leaves, treedef = jax.tree.flatten(detached)
        healed, step, data, arrays = self.group.join(trainer.step_count, layout(detached), fingerprint(leaves))
        if not healed:
            return
        state = jax.tree.unflatten(treedef, from_host(leaves, arrays))
        trainer.state = state.attach(data if isinstance(data, dict) else {})
        if int(trainer.state.step) != step:
            raise RuntimeError(f"replica groups: the state received from a live group is at step "
                               f"{int(trainer.state.step)}, and the coordinator said {step}")
        self.healed = {"step": step}

    def before_step(self, trainer, step: int) -> None:
        self.step = step

    def after_step(self, trainer, step: int, metrics) -> None:
        if self.group.donate:
            state = trainer.state
            self.group.send_state(step, to_host(jax.tree.leaves(state.detach()[0])), state.data)

    def on_close(self, trainer) -> None:
        self.group.close()


__all__ = ["ReplicaPath", "SplitStep", "check_replicas", "fingerprint", "from_host", "layout", "replica_hooks",
           "split_step", "to_host"]
