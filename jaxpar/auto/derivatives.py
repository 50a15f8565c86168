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
# collectives that are linear maps of their operand: their derivative is another collective of
# the cotangent and reads neither their operands nor their results
LINEAR_COLLECTIVES = ("psum", "psum_invariant", "all_gather", "all_gather_invariant", "all_to_all",
                      "ragged_all_to_all", "ppermute", "reduce_scatter")
# scatters whose derivative reads their indices alone (linear in the operand and the updates)
INDEX_READS = ("scatter", "scatter-add", "scatter_add")


def saved_reads(op: Op) -> tuple[int, ...]:
    """The operands and results of a materialised operator that the cost model keeps for the
    backward pass: none for a linear one (`LINEAR`: a running sum, an in-place update;
    `LINEAR_COLLECTIVES`), the indices of a scatter that sets or adds (`INDEX_READS`), all of
    them for the rest. A sum (``reduce_sum``) keeps its operand though its own derivative
    reads nothing: outside loops the model does not follow elementwise operators, and a sum's
    operand stands for what the softmax or norm around it reads (the exponentials, the
    centred values).

    >>> from jaxpar.auto.graph import Op
    >>> saved_reads(Op("ppermute", (0,), (1,))), saved_reads(Op("scatter-add", (0, 1, 2), (3,)))
    ((), (1,))
    >>> saved_reads(Op("dot_general", (0, 1), (2,))), saved_reads(Op("reduce_sum", (0,), (1,)))
    ((0, 1, 2), (0, 1))
    """
    if (op.prim in LINEAR and op.prim != "reduce_sum") or op.prim in LINEAR_COLLECTIVES:
        return ()
    if op.prim in INDEX_READS:
        return op.ins[1:2]
    return (*op.ins, *op.outs)


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
