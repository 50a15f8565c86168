"""Per-leaf checksums of a saved state, checked when it is read back.

orbax stores each array in an OCDBT database: small values inside its B-tree nodes, which carry
checksums, larger ones as raw byte ranges of data files, which carry none. A flipped or zeroed
byte inside such a range reads back as another value, without an error. So every save records,
in its ``meta`` item, two 32-bit checksums of each leaf's bits, computed on the devices; a
restore computes them again on the arrays it read and names every leaf whose checksums differ.

The checksums depend only on the values, not on the layout: the sums wrap modulo 2**32, so
any order of reduction (any mesh, any sharding) gives the same numbers, and a step saved under
one layout is checked when restored under another.

A row source's tables (the ``rows`` item: NumPy arrays that live on the host because they need
not fit on a device) get one CRC-32 each, computed on the host (`host_checksums`), under the
``meta`` entry ``row_checksums``.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.executables import OnDisk

KEY = "checksums"       # the entry of the ``meta`` item that holds them
ROWS_KEY = "row_checksums"   # ... and the one that holds the row tables' (host arrays)

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words (one per element; two for 8-byte elements, on a last axis)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: every input bit changes about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _leaf(x: jax.Array) -> jax.Array:
    """``[a, b]`` (uint32): ``a`` = sum of word * (2 * index + 1), which changes whenever any one
    word does (an odd factor), and ``b`` = sum of mix(word ^ mix(index)), for changes of several."""
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):        # the row-major position, without a reshape that
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= w.shape[axis]                  # would move shards between devices
    a = jnp.sum(w * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    b = jnp.sum(_mix(w ^ _mix(index)), dtype=jnp.uint32)
    return jnp.stack([a, b])


def _unusable(x: jax.Array, nan_only: bool) -> jax.Array:
    """Whether ``x`` holds a value no saved state may hold: a NaN, or with ``nan_only=False`` (the
    parameters) also an infinity. Other state may keep an infinity on purpose (a sentinel such as
    ``optax.contrib.reduce_on_plateau``'s best value)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.asarray(False)
    return jnp.any(jnp.isnan(x)) if nan_only else ~jnp.all(jnp.isfinite(x))


# One small program per (shape, dtype, sharding), shared by every leaf and every model that has
# it, rather than one for the whole state, which would compile again for each model and layout.
# The job's processes share them on disk (jaxpar.executables), so a restarted process compiles none.
_leaf_jit = OnDisk(jax.jit(_leaf))
_saved_jit = {nan_only: OnDisk(jax.jit(lambda x, nan_only=nan_only: (_leaf(x), _unusable(x, nan_only))))
              for nan_only in (False, True)}


def _on_device(x) -> jax.Array:
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def checksums(flat: dict[str, Any]) -> dict[str, list[int]]:
    """``{path: [a, b]}`` of a flat map of arrays (as saved: key arrays as their key data)."""
    out = {}
    for path, x in flat.items():
        # one program at a time: on CPU, two in flight whose all-reduces span other devices can
        # each hold half the threads the other waits for (XLA aborts after 40 s), and on several
        # processes they may run their collectives in another order on each
        pair = jax.device_get(_leaf_jit(_on_device(x)))
        out[path] = [int(v) for v in np.asarray(pair)]
    return out


class NonFiniteStateError(ValueError, FloatingPointError):
    """A state about to be saved holds a value no checkpoint may hold. A ``ValueError`` (a
    state given to ``save``) and a ``FloatingPointError`` (what ``nonfinite="stop"`` raises for a
    step that made it)."""


def checksums_to_save(flat: dict[str, Any], step: int | None = None) -> dict[str, list[int]]:
    """`checksums` of a state about to be saved, in the same pass refusing one that holds a value
    no checkpoint may hold (a non-finite parameter, a NaN elsewhere): `NonFiniteStateError`
    naming the leaves (and ``step``, the state's), before anything is written."""
    out, bad = {}, []
    for path, x in flat.items():       # one program at a time (see `checksums`)
        pair, unusable = jax.device_get(_saved_jit[not path.startswith("params/")](_on_device(x)))
        out[path] = [int(v) for v in np.asarray(pair)]
        if unusable:
            bad.append(path)
    if bad:
        listing = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        of = "" if step is None else f" of step {step}"
        raise NonFiniteStateError(
            f"checkpoint save{of}: the state holds non-finite values ({len(bad)} leaf(s): {listing}: a "
            "parameter not finite, or a NaN in other state), so nothing was saved: a checkpoint holds finite "
            "values only and a restart never resumes such a state. A finite loss and gradient with a non-finite "
            "update points at the optimizer (a NaN learning rate, an overflow); Services(nonfinite='skip') keeps "
            "the previous state for such a step instead")
    return out


def _word(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32


def record_damage(saved: Any, paths, *, rows: bool = False) -> str | None:
    """What is wrong with a checksum record read back (``saved``: the ``meta`` entry ``KEY``, or
    ``ROWS_KEY`` with ``rows``) for the leaves ``paths`` read with it, or None when it covers
    exactly those leaves, each with its numbers. A record that misses a leaf (a damaged byte in
    its key) would leave that leaf unchecked, so it is damage, as are unknown keys and values
    that are no checksums."""
    what = "row checksum record" if rows else "checksum record"
    if not isinstance(saved, dict):
        return f"its {what} is a {type(saved).__name__}, not a mapping of leaf to checksums"
    paths = set(paths)
    missing, unknown = sorted(paths - set(saved)), sorted(set(saved) - paths)
    malformed = sorted(p for p, v in saved.items() if p in paths and not (
        _word(v) if rows else isinstance(v, list) and len(v) == 2 and all(_word(w) for w in v)))
    problems = ([f"no checksums for {missing}"] if missing else []) + (
        [f"checksums of unknown {'tables' if rows else 'leaves'} {unknown}"] if unknown else []) + (
        [f"values that are not {'a 32-bit number' if rows else 'two 32-bit numbers'}: {malformed}"]
        if malformed else [])
    return f"its {what} is damaged: " + "; ".join(problems) if problems else None


def differing(flat: dict[str, Any], saved: dict[str, list[int]]) -> list[str]:
    """The paths of ``flat`` whose checksums differ from ``saved`` (a record `record_damage`
    found whole: one pair per path of ``flat``)."""
    now = checksums(flat)
    return sorted(path for path, pair in now.items() if pair != list(saved[path]))


def host_checksums(tables: Any) -> dict[str, int]:
    """``{path: crc32}`` of a tree of host arrays (a row source's tables), on the host.

    >>> host_checksums({"table": np.zeros((2, 2), np.float32)})
    {"['table']": 3971697493}
    """
    return {jax.tree_util.keystr(path): zlib.crc32(np.ascontiguousarray(x))
            for path, x in jax.tree_util.tree_flatten_with_path(tables)[0]}


def host_paths(tables: Any) -> list[str]:
    """The paths `host_checksums` names the tables by."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tables)[0]]


def host_differing(tables: Any, saved: dict[str, int]) -> list[str]:
    """The paths of ``tables`` whose CRC-32 differs from ``saved`` (a record `record_damage`
    found whole: one number per table)."""
    return sorted(path for path, crc in host_checksums(tables).items() if crc != saved[path])
