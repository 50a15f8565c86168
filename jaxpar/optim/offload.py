"""Host offload: keep optimizer state and/or parameters in host memory between steps.

The arrays live in the ``pinned_host`` memory kind (page-locked host RAM the accelerator
reads by DMA). The compiled step moves them into device memory where it starts, uses them,
and its ``out_shardings`` write the new values back to the host. On a GPU this frees their
device memory between steps (the step still holds them while it runs, unless XLA streams
them in piece by piece); on CPU, ``pinned_host`` and ``device`` are the same RAM: the
placement is exact and checkable, but nothing is saved.

Activation offload is a recompute policy instead: ``remat="offload_dots"`` (see
``jaxpar.remat``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

HOST = "pinned_host"
TARGETS = ("opt_state", "params")


def check_targets(offload) -> tuple[str, ...]:
    offload = (offload,) if isinstance(offload, str) else tuple(offload or ())
    bad = [t for t in offload if t not in TARGETS]
    if bad:
        raise ValueError(f"offload={offload!r}: unknown targets {bad}; choose from {TARGETS}")
    return offload


def host_memory_available(mesh) -> bool:
    """Whether the mesh's devices have a ``pinned_host`` memory space."""
    dev = mesh.devices.flat[0]
    return any(m.kind == HOST for m in dev.addressable_memories())


def on_host(shardings):
    """The same shardings in ``pinned_host`` memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def to_device(tree, shardings):
    """Inside ``jit``: move ``tree`` (placed by ``shardings``) into device memory."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)
