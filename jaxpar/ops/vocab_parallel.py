"""Vocab-parallel embedding (MindSpore ``VocabParallelEmbedding`` / ``Gather`` with ``manual_split``).

The table ``[V, E]`` is split by rows over ``vocab_axis`` (``n`` devices). Every device sees
all ids, looks up those in its own row range, writes zeros for the rest, and one ``psum``
over ``vocab_axis`` adds the ``n`` partial results: each id is found on exactly one device.
Per device that is one all-reduce of the output, ``2 · (n - 1) / n · |ids| · E`` elements
(ring), and ``V · E / n`` table rows in memory instead of ``V · E``.

**manual_split** ``(r_0, ..., r_{n-1})`` gives device ``i`` the ``r_i`` rows starting at
``r_0 + ... + r_{i-1}`` (MindSpore's non-uniform split, e.g. to balance a vocabulary sorted by
frequency). Arrays are split evenly, so such a table is stored *padded*: ``n`` blocks of
``R = max(manual_split)`` rows, block ``i`` holding device ``i``'s ``r_i`` rows followed by
``R - r_i`` zero rows::

    manual_split = (3, 1)          table rows a b c d       padded rows  a b c | d 0 0
                                                               (R = 3)   dev 0 | dev 1

``pad_for_manual_split`` builds it and ``unpad`` undoes it (for checkpoints or gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.ops._common import AnyMesh, axes_of, axes_size, resolve_mesh
from jaxpar.strategy import mesh_sizes, spec_entry


def embedding(
    ids: jax.Array,
    table: jax.Array,
    *,
    vocab_axis: str | tuple[str, ...],
    mesh: AnyMesh | None = None,
    manual_split: Sequence[int] | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``table[ids]`` with the table's rows split over ``vocab_axis``.

    Args:
      ids: integer ids ``[...]`` in ``[0, V)``; an id outside gives a zero vector.
      table: ``[V, E]``, or with ``manual_split`` the padded ``[n · max(manual_split), E]``
        (a ``[V, E]`` table is padded here, which under jit moves rows between devices:
        store it padded instead).
      vocab_axis: the mesh axis (or axes) that split the rows.
      mesh: the mesh; default the one set with ``jax.set_mesh``.
      manual_split: rows per device along ``vocab_axis``; must sum to V, have one entry per
        device and all be > 0. None: an even split (V divisible by the axis size).
      batch_axis: mesh axes that split the first dimension of ``ids`` (and of the output).

    Returns ``[..., E]``, split like ``ids`` on its first dimension.

    Example:
      >>> mesh = jaxpar.make_mesh({"x": 2, "y": 4})
      >>> table, ids = jnp.arange(40.0).reshape(10, 4), jnp.array([[0, 9], [3, 4]])
      >>> padded = pad_for_manual_split(table, (4, 2, 2, 2))
      >>> out = embedding(ids, padded, vocab_axis="y", manual_split=(4, 2, 2, 2), mesh=mesh)
      >>> bool((out == table[ids]).all())
      True
    """
    mesh = resolve_mesh(mesh, "embedding")
    vocab = axes_of("embedding", "vocab_axis", vocab_axis, mesh)
    batch = axes_of("embedding", "batch_axis", batch_axis, mesh)
    n = axes_size(mesh, vocab)
    _check_ids(ids, batch, vocab, mesh)
    if manual_split is None:
        manual_split = _even_split(jnp.shape(table), n, vocab, mesh)
    else:
        manual_split = _check_split(manual_split, n, vocab, mesh)
        table = _as_padded(table, manual_split)
    return _lookup(ids, table, manual_split, vocab, batch, mesh)


def pad_for_manual_split(table: jax.Array, manual_split: Sequence[int]) -> jax.Array:
    """The padded layout of a ``[V, E]`` table: ``n`` blocks of ``max(manual_split)`` rows.

    Example:
      >>> pad_for_manual_split(jnp.arange(4.0)[:, None], (3, 1))[:, 0]
      Array([0., 1., 2., 3., 0., 0.], dtype=float32)
    """
    split = _check_split(manual_split, None, None, None)
    shape = jnp.shape(table)
    if len(shape) < 1 or shape[0] != sum(split):
        raise ValueError(
            f"pad_for_manual_split: manual_split {split} sums to {sum(split)} rows but the table "
            f"has shape {shape}; the row counts must add up to the vocabulary size {shape[:1]}"
        )
    rows, starts = max(split), _starts(split)
    blocks = [
        jnp.pad(table[s : s + r], [(0, rows - r)] + [(0, 0)] * (len(shape) - 1))
        for s, r in zip(starts, split)
    ]
    return jnp.concatenate(blocks, axis=0)


def unpad(padded: jax.Array, manual_split: Sequence[int]) -> jax.Array:
    """Undo ``pad_for_manual_split``: the ``[V, E]`` table (or its gradient) back.

    Example:
      >>> padded = jnp.array([0.0, 1.0, 2.0, 3.0, 0.0, 0.0])[:, None]
      >>> unpad(padded, (3, 1))[:, 0]
      Array([0., 1., 2., 3.], dtype=float32)
    """
    split = _check_split(manual_split, None, None, None)
    rows, shape = max(split), jnp.shape(padded)
    if len(shape) < 1 or shape[0] != rows * len(split):
        raise ValueError(
            f"unpad: a table padded for manual_split {split} has {len(split)} x {rows} = "
            f"{rows * len(split)} rows, got shape {shape}"
        )
    return jnp.concatenate([padded[i * rows : i * rows + r] for i, r in enumerate(split)], axis=0)


def _lookup(ids, table, split, vocab, batch, mesh):
    starts = jnp.asarray(_starts(split), dtype=jnp.int32)
    counts = jnp.asarray(split, dtype=jnp.int32)
    vocab_name = vocab if len(vocab) > 1 else vocab[0]

    def local(ids_b, rows_b):
        me = jax.lax.axis_index(vocab_name)
        offset = ids_b.astype(jnp.int32) - starts[me]
        hit = (offset >= 0) & (offset < counts[me])
        found = jnp.take(rows_b, jnp.where(hit, offset, 0), axis=0)
        found = jnp.where(hit[..., None], found, jnp.zeros((), found.dtype))
        return jax.lax.psum(found, vocab_name)

    ids_spec = PartitionSpec(spec_entry(batch)) if jnp.ndim(ids) else PartitionSpec()
    specs = dict(in_specs=(ids_spec, PartitionSpec(spec_entry(vocab), None)), out_specs=ids_spec)
    return jax.shard_map(local, mesh=mesh, **specs)(ids, table)


def _starts(split: Sequence[int]) -> list[int]:
    return [sum(split[:i]) for i in range(len(split))]


def _even_split(shape, n, vocab, mesh) -> tuple[int, ...]:
    if len(shape) != 2:
        raise ValueError(f"embedding: table must be [V, E], got shape {shape}")
    if shape[0] % n:
        raise ValueError(
            f"embedding: the vocabulary of {shape[0]} rows (table shape {shape}) is not divisible "
            f"by {n}, the size of vocab_axis {vocab} of mesh {mesh_sizes(mesh)}; pad the vocabulary to "
            f"a multiple of {n} or give manual_split=(...) with {n} row counts summing to {shape[0]}"
        )
    return (shape[0] // n,) * n


def _check_split(split, n, vocab, mesh) -> tuple[int, ...]:
    if not isinstance(split, (tuple, list)) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in split
    ):
        raise TypeError(f"manual_split must be a tuple of ints (rows per device), got {split!r}")
    split = tuple(split)
    if not split or any(r <= 0 for r in split):
        raise ValueError(f"manual_split {split}: every device needs at least one row (all entries > 0)")
    if n is not None and len(split) != n:
        raise ValueError(
            f"embedding: manual_split {split} has {len(split)} entries but vocab_axis {vocab} of "
            f"mesh {mesh_sizes(mesh)} has {n} devices; give one row count per device"
        )
    return split


def _as_padded(table, split) -> jax.Array:
    shape, n, rows = jnp.shape(table), len(split), max(split)
    if len(shape) == 2 and shape[0] == n * rows:
        return table
    if len(shape) == 2 and shape[0] == sum(split):
        return pad_for_manual_split(table, split)
    raise ValueError(
        f"embedding: table shape {shape} fits manual_split {split} neither as the [V, E] table "
        f"(V = sum = {sum(split)}) nor padded ({n} x max = {n * rows} rows); fix manual_split so "
        "it sums to the vocabulary size, or pass pad_for_manual_split(table, manual_split)"
    )


def _check_ids(ids, batch, vocab, mesh) -> None:
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"embedding: ids must be integers, got dtype {jnp.result_type(ids)}")
    if set(batch) & set(vocab):
        raise ValueError(f"embedding: batch_axis {batch} and vocab_axis {vocab} must be different mesh axes")
    if batch:
        shape = jnp.shape(ids)
        if not shape or shape[0] % axes_size(mesh, batch):
            raise ValueError(
                f"embedding: ids of shape {shape} cannot be split over batch_axis {batch} of mesh "
                f"{mesh_sizes(mesh)} (size {axes_size(mesh, batch)}); use a batch divisible by it"
            )
