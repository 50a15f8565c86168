"""Communication fusion: fewer, larger gradient collectives (MindSpore ``comm_fusion``).

* jit modes (``"data"``, ``"semi_auto"``): XLA inserts the collectives and its combiner
  passes fuse them up to a byte threshold. `compiler_options` sets those thresholds for
  the one compiled step (``jax.jit(..., compiler_options=...)``), not process-wide. XLA
  exposes them only for GPU (``xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_
  threshold_bytes``); the CPU compiler accepts the option but its combiner ignores it, so
  on CPU this setting changes nothing and jaxpar passes the flags only on GPU.
* ``mode="hybrid"``: the gradients are reduced explicitly. `bucketed_psum` concatenates
  the local gradients (per dtype and per set of varying mesh axes) into one flat buffer,
  cuts it into buckets of ``bucket_bytes`` and issues one ``psum`` per bucket, then cuts
  the result back into gradients: ``ceil(bytes / bucket)`` all-reduces per group.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.config import CommFusionConfig

AUTO_BUCKET_BYTES = 64 * 2**20
_GPU_FLAGS = ("xla_gpu_all_reduce_combine_threshold_bytes", "xla_gpu_all_gather_combine_threshold_bytes",
              "xla_gpu_reduce_scatter_combine_threshold_bytes")


def compiler_options(fusion: CommFusionConfig | None, platform: str) -> dict[str, int]:
    """XLA options that set the collective combiners' thresholds for one compile.

    ``{}`` when fusion is off, ``"auto"`` (XLA's own thresholds) or the backend has no such
    option (CPU, TPU).

    >>> compiler_options(CommFusionConfig(bucket_mb=4), "gpu")["xla_gpu_all_reduce_combine_threshold_bytes"]
    4194304
    """
    if fusion is None or fusion.mode == "auto" or platform not in ("gpu", "cuda", "rocm"):
        return {}
    return {flag: fusion.bucket_bytes for flag in _GPU_FLAGS}


def bucket_bytes(fusion: CommFusionConfig) -> int:
    return AUTO_BUCKET_BYTES if fusion.mode == "auto" else fusion.bucket_bytes


def bucketed_psum(grads, axes: tuple[str, ...], bucket: int, keys=None):
    """``psum`` of every leaf of ``grads`` over ``axes``, as one all-reduce per ``bucket`` bytes.

    For use inside ``jax.shard_map``. Leaves are grouped by dtype and by ``keys`` (one
    hashable per leaf, e.g. the mesh axes it varies over: one flat buffer must have one
    type); each group is one flat buffer."""
    leaves, treedef = jax.tree.flatten(grads)
    keys = [None] * len(leaves) if keys is None else list(keys)
    out: list = [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault((str(x.dtype), keys[i]), []).append(i)
    for idx in groups.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
        per = max(1, bucket // flat.dtype.itemsize)
        chunks = [jax.lax.psum(flat[s:s + per], axes) for s in range(0, flat.size, per)]
        flat = jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        offset = 0
        for i in idx:
            n = math.prod(leaves[i].shape)
            out[i] = flat[offset:offset + n].reshape(leaves[i].shape)
            offset += n
    return jax.tree.unflatten(treedef, out)
