"""Per-device memory of a compiled program, from XLA's buffer assignment."""
from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes one device needs to run a compiled program (``compiled.memory_analysis()``).

    Attributes:
      argument_bytes: the program's inputs on one device (its shard of each argument).
      output_bytes: the program's outputs on one device.
      temp_bytes: scratch buffers XLA allocates while the program runs (activations,
        gradients in flight, collective buffers).
      alias_bytes: output bytes that reuse an input's buffer (donated arguments); counted in
        both ``argument_bytes`` and ``output_bytes``.
      generated_code_bytes: size of the compiled code.

    ``total`` is argument + output + temp − alias: what the device holds at once in the
    worst case. XLA's own ``peak_memory_in_bytes`` leaves out temp on CPU, so it is not
    reported here.

    Example:
      >>> m = memory(compiled)                                     # doctest: +SKIP
      >>> m.argument_bytes, m.total                                # doctest: +SKIP
      (524288, 1048576)
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int

    @property
    def total(self) -> int:
        """Argument + output + temp − alias bytes (aliased outputs counted once)."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def memory(compiled: jax.stages.Compiled) -> MemoryReport:
    """Reads the per-device memory of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled``, from ``jax.jit(f).lower(...).compile()``.

    Returns:
      A `MemoryReport` of bytes on one device. On CPU, XLA's ``peak_memory_in_bytes`` leaves
      out temp buffers; use ``MemoryReport.total`` instead.

    Raises:
      TypeError: ``compiled`` is not a ``jax.stages.Compiled``.
      ValueError: the backend reports no memory statistics for this program.

    Example:
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> s = jax.sharding.NamedSharding(mesh, jax.P("data"))
      >>> x = jax.ShapeDtypeStruct((1024, 1024), "float32")
      >>> compiled = jax.jit(lambda x: x * 2, in_shardings=s, out_shardings=s).lower(x).compile()
      >>> memory(compiled).argument_bytes      # 1024 * 1024 * 4 bytes / 8 devices
      524288
    """
    if not isinstance(compiled, jax.stages.Compiled):
        hint = " (call .compile() on it first)" if isinstance(compiled, jax.stages.Lowered) else ""
        raise TypeError(f"memory() expects a jax.stages.Compiled, got "
                        f"{type(compiled).__name__}{hint}.")
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("memory(): compiled.memory_analysis() returned None: this backend "
                         "reports no memory statistics for the program. Compile it for a "
                         "backend that does (CPU, GPU and TPU do) or estimate from the "
                         "argument shapes and shardings.")
    return MemoryReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
    )
