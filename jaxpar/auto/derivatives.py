"""What an operator's derivative reads, per primitive: shared by the cost model's liveness
(`jaxpar.auto.cost`: what a loop stacks for its backward) and the collectives' grouping
(`jaxpar.auto.comm.derivations`: which values the backward pass never reads).

    >>> "reshape" in FREE and "reshape" in LINEAR and "mul" not in LINEAR
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.auto.graph import Op

# operators that move or relabel their operand without computing anything
FREE = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "convert_element_type",
        "stop_gradient", "iota", "copy", "copy_p", "name")
# operators whose derivative needs none of their operands (the rest save their inputs in a loop)
LINEAR = ("add", "add_any", "sub", "neg", "reduce_sum", "select_n", "concatenate", "pad", "slice",
          "dynamic_slice", "dynamic_update_slice", "cumsum", *FREE)


def derivative_reads(op: Op, grad: Sequence[bool]) -> list[int]:
    """The operands a nonlinear operator's derivative reads: ``x · y`` needs ``y`` where ``x``
    has a gradient and ``x`` where ``y`` does; ``x / y`` needs ``y`` (and ``x`` where ``y`` has
    a gradient); any other operator, its operands that have one (``grad``: per tensor, whether
    it has a gradient)."""
    if op.prim == "mul" and len(op.ins) == 2:
        a, b = op.ins
        return [t for t, other in ((a, b), (b, a)) if t >= 0 and other >= 0 and grad[other]]
    if op.prim == "div" and len(op.ins) == 2:
        x, y = op.ins
        if not any(t >= 0 and grad[t] for t in (x, y)):
            return []
        return [t for t in (y, x if y >= 0 and grad[y] else -1) if t >= 0]
    return [t for t in op.ins if t >= 0 and grad[t]]
