"""Host offload: keep optimizer state and/or parameters in host memory between steps.

The arrays live in the ``pinned_host`` memory kind (page-locked host RAM the accelerator
reads by DMA). The compiled step moves them into device memory where it starts, uses them,
and its ``out_shardings`` write the new values back to the host. On CPU, ``pinned_host`` and
``device`` are the same RAM: the placement is exact and checkable (the tests), but nothing is
saved.

The optimizer state comes into device memory as the gradients come (`arrive_after` in the step:
each moment behind an optimization barrier with its parameter's gradient), so the device does
not hold it through the forward and backward, where the peak is; the update runs on the device
and the new state leaves through the step's ``out_shardings``. ``Trainer.lower(batch, platform="cuda")`` shows the order in
the program a GPU compiles (tested on CPU).

On a GPU the three modes are refused (`unpaid_on`) with what to use instead, because none paid
when measured on one H200 (jax 0.11.2, Llama 125m shape, 8 x 2048 tokens, bf16 on fp32 master
weights, adamw; ``python benchmarks/gpu.py --cases "125m-shape: offload modes"``,
``benchmarks/results/gpu_nvidia_h200.json``), against the same step without offload
(32.99 ms, 9.67 GiB compiled):

- ``offload="opt_state"``: 65.36 ms (1.99x) and 9.64 GiB: the state's copies had no order
  against the backward, and the device held the state while the step ran;
- ``offload="params"``: 44.83 ms (1.36x), 9.67 GiB;
- ``remat="offload_dots"``: 87.84 ms (2.67x), 7.69 GiB.

Since then the state's copies wait for their gradients, and stacked (scanned) layers' parameters
stream into device memory one layer at a time inside the layer loop (`jaxpar.nn.stream`; the
step's ``enter``, ``land_grads`` and ``arrive_streamed``); neither is measured on a GPU yet.
The same command measures them, with the refusal lifted in the benchmark, plus the case
``"125m-shape scanned: parameters streamed"`` and ``grad_accum=4`` (the state's round trip paid
once per four micro-batches). A mode pays when the peak falls by at least 80 % of the bytes
moved at no more than 1.25x the step (1.3x for activations). Until a measurement shows one paying, ZeRO over more devices, bf16 optimizer state
or a chunked loss free memory without the transfers.
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


def unpaid_on(platform: str, offload: tuple[str, ...] = (), remat: str | None = None) -> str | None:
    """Why the offload asked for cannot pay on ``platform`` (measured, see the module), or None."""
    if platform != "gpu":
        return None
    if offload:
        return (f"offload={tuple(offload)} cannot pay on a GPU: measured on an H200 the peak was not lower and "
                f"the copies made the step 1.36x (params) to 1.99x (opt_state) slower (docs/offload.md; the state "
                f"arriving as the gradients come and parameters streamed layer by layer are not measured on a "
                f"GPU yet: benchmarks/gpu_pending.sh measures them); to free "
                f"device memory use "
                f"ZeRO over more devices (ParallelConfig(optimizer={{'level': 1}}) or 3), precision='bf16-pure' "
                f"(bf16 optimizer state) or a chunked loss (LlamaConfig(loss_chunks=8)), and drop offload")
    if remat == "offload_dots":
        return ("remat='offload_dots' cannot pay on a GPU: measured on an H200 the step is 2.67x slower than "
                "without recompute (docs/offload.md); recompute instead (remat='dots_with_no_batch_dims_saveable' "
                "or 'full'), which frees more for less time")
    return None


def host_memory_available(mesh) -> bool:
    """Whether the mesh's devices have a ``pinned_host`` memory space."""
    dev = mesh.devices.flat[0]
    return any(m.kind == HOST for m in dev.addressable_memories())


def on_host(shardings):
    """The same shardings in ``pinned_host`` memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def in_host_memory(x) -> bool:
    """Whether ``x`` (an array, or a traced value inside ``jit``) is in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def land(tree):
    """Inside ``jit``: each leaf of ``tree`` in host memory moved into device memory; the rest
    as they are (e.g. the gradients of streamed layers, which the backward leaves on the host)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x, tree)


def to_device(tree, shardings):
    """Inside ``jit``: move ``tree`` (placed by ``shardings``) into device memory."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)
