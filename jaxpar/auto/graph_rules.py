"""How each primitive ties the dimensions of its operands and results into classes.

A rule ``rule(builder, ins, outs, params)`` links dimensions with ``builder.link(t1, d1, t2, d2)``
(tensors are ids, ``-1`` for literals; ``builder.shapes[t]`` is a tensor's shape) and may return
info the cost model reads (``("contract", ...)``, ``("reduce", axes)``, ...). Primitives
without a rule are elementwise: same-rank operands link dimension by dimension.
"""

from __future__ import annotations

from typing import Any

def elementwise(b: Any, ins, outs, params):
    for o in outs:
        for i in ins:
            if i >= 0 and len(b.shapes[i]) == len(b.shapes[o]):
                for d in range(len(b.shapes[o])):
                    b.link(i, d, o, d)


def _broadcast(b: Any, ins, outs, params):
    for d, od in enumerate(params["broadcast_dimensions"]):
        b.link(ins[0], d, outs[0], od)
    return (("new", tuple(d for d in range(len(b.shapes[outs[0]])) if d not in params["broadcast_dimensions"])),)


def _reduce(b: Any, ins, outs, params):
    axes = tuple(params["axes"])
    kept = [d for d in range(len(b.shapes[ins[0]])) if d not in axes]
    for od, d in enumerate(kept):
        b.link(ins[0], d, outs[0], od)
    return (("reduce", axes),)


def _transpose(b: Any, ins, outs, params):
    for od, d in enumerate(params["permutation"]):
        b.link(ins[0], d, outs[0], od)


def _dot(b: Any, ins, outs, params):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs, out = ins[0], ins[1], outs[0]
    for x, y in zip(lc, rc):
        b.link(lhs, x, rhs, y)
    for k, (x, y) in enumerate(zip(lb, rb)):
        b.link(lhs, x, rhs, y)
        b.link(lhs, x, out, k)
    lf = [d for d in range(len(b.shapes[lhs])) if d not in lc and d not in lb]
    rf = [d for d in range(len(b.shapes[rhs])) if d not in rc and d not in rb]
    for k, d in enumerate(lf):
        b.link(lhs, d, out, len(lb) + k)
    for k, d in enumerate(rf):
        b.link(rhs, d, out, len(lb) + len(lf) + k)
    return (("contract", (tuple(lc), tuple(rc))), ("free", (tuple(lf), tuple(rf))))


def _ragged_dot(b: Any, ins, outs, params):
    # jax.lax.ragged_dot_general: a dot_general whose lhs has one ragged dimension cut into
    # groups by group_sizes' sizes. Its three modes (lax.ragged_dot_general's docstring):
    #   ragged m (plain ragged_dot): [b, m, k] x [g, b, k, n] -> [b, m, n], the rhs group dim dropped
    #   ragged k: [b, m, k] x [b, k, n] -> [g, b, m, n], one partial product per group
    #   ragged b: [b, m, k] x [b, k, n] -> [b, m, n], no group dim anywhere
    # group_sizes is [g] or [prefix..., g], its prefix being lhs dims (`_ragged_prefix`)
    dn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    (ragged,) = dn.lhs_ragged_dimensions
    rg = tuple(dn.rhs_group_dimensions)
    lhs, rhs, sizes, out = ins[0], ins[1], ins[2], outs[0]
    lf = [d for d in range(len(b.shapes[lhs])) if d not in lc and d not in lb]
    rf = [d for d in range(len(b.shapes[rhs])) if d not in rc and d not in rb and d not in rg]
    lead = 1 if ragged in lc else 0          # the ragged-k mode's output leads with the groups
    for x, y in zip(lc, rc):
        b.link(lhs, x, rhs, y)
    for k, (x, y) in enumerate(zip(lb, rb)):
        b.link(lhs, x, rhs, y)
        b.link(lhs, x, out, lead + k)
    for k, d in enumerate(lf):
        b.link(lhs, d, out, lead + len(lb) + k)
    for k, d in enumerate(rf):
        b.link(rhs, d, out, lead + len(lb) + len(lf) + k)
    if sizes >= 0:
        g = len(b.shapes[sizes]) - 1
        for k, d in enumerate(_ragged_prefix(ragged, lc, lb, lf)[:g]):
            b.link(lhs, d, sizes, k)
        for d in rg:
            b.link(rhs, d, sizes, g)
        if lead:
            b.link(out, 0, sizes, g)
    # the group dims index which rows a product reads, not more products: FLOPs 2·m·k·n
    return (("contract", (tuple(lc), tuple(rc))), ("free", (tuple(lf), tuple(rf))),
            ("group", (rg, (0,) if lead else ())))


def _ragged_prefix(ragged: int, lc, lb, lf) -> list[int]:
    """The lhs dims a ``[prefix..., g]`` group_sizes leads with: the batch dims and the dims of
    the ragged one's kind (free or contracting) before it; for a ragged batch dim, the batch
    dims before it."""
    if ragged in lb:
        return list(lb[: list(lb).index(ragged)])
    kind = list(lc) if ragged in lc else lf
    return [*lb, *kind[: kind.index(ragged)]]


def _gather(b: Any, ins, outs, params):
    dn = params["dimension_numbers"]
    operand, indices, out = ins[0], ins[1], outs[0]
    out_rank, idx_rank = len(b.shapes[out]), len(b.shapes[indices])
    offset = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset]
    for k, od in enumerate(batch_out[: idx_rank - 1]):
        b.link(indices, k, out, od)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    for x, y in zip(op_batch, getattr(dn, "start_indices_batching_dims", ())):
        b.link(operand, x, indices, y)
    kept = [d for d in range(len(b.shapes[operand])) if d not in dn.collapsed_slice_dims and d not in op_batch]
    sizes = params["slice_sizes"]
    for od, d in zip(offset, kept):
        if sizes[d] == b.shapes[operand][d]:
            b.link(operand, d, out, od)
    indexed = tuple(d for d in dn.start_index_map if sizes[d] != b.shapes[operand][d])
    return (("contract", (indexed, ())), ("free", (tuple(kept), tuple(range(idx_rank - 1)))))


def _reshape(b: Any, ins, outs, params):
    src, dst = b.shapes[ins[0]], b.shapes[outs[0]]
    i = j = 0
    minor: list[int] = []
    while i < len(src) and j < len(dst):
        if src[i] == dst[j]:
            b.link(ins[0], i, outs[0], j)
            i, j = i + 1, j + 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                gj.append(j)
                pj *= dst[j]
        big_i = [d for d in gi if src[d] > 1]
        big_j = [d for d in gj if dst[d] > 1]
        if big_i and big_j and src[big_i[0]] % dst[big_j[0]] == 0 or big_i and big_j and dst[big_j[0]] % src[big_i[0]] == 0:
            # the major dims keep their split when the minor ones are whole
            _link_major(b, ins[0], big_i[0], outs[0], big_j[0])
        minor += big_i[1:]
        i, j = gi[-1] + 1, gj[-1] + 1
    return (("minor", tuple(minor)),)


def _link_major(b: Any, t1, d1, t2, d2):
    # sizes differ: unify only if the class is later split by a divisor of both (checked by the
    # cost model through the class size); record the pair as linked via a shared slot
    a, c = b.find(b.slot(t1, d1)), b.find(b.slot(t2, d2))
    if a != c and min(b.shapes[t1][d1], b.shapes[t2][d2]) > 1:
        b.parent[max(a, c)] = min(a, c)


def _concat(b: Any, ins, outs, params):
    dim = params["dimension"]
    for i in ins:
        for d in range(len(b.shapes[outs[0]])):
            if d != dim:
                b.link(i, d, outs[0], d)
    return (("minor", (dim,)),)


def _same_size(b: Any, ins, outs, params):
    for d in range(len(b.shapes[outs[0]])):
        b.link(ins[0], d, outs[0], d)
    return (("minor", tuple(d for d in range(len(b.shapes[ins[0]]))
                            if b.shapes[ins[0]][d] != b.shapes[outs[0]][d])),)


def _squeeze(b: Any, ins, outs, params):
    kept = [d for d in range(len(b.shapes[ins[0]])) if d not in params["dimensions"]]
    for od, d in enumerate(kept):
        b.link(ins[0], d, outs[0], od)


def _expand(b: Any, ins, outs, params):
    kept = [d for d in range(len(b.shapes[outs[0]])) if d not in params["dimensions"]]
    for d, od in enumerate(kept):
        b.link(ins[0], d, outs[0], od)


def _nothing(b: Any, ins, outs, params):
    return None


def _conv(b: Any, ins, outs, params):
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs, out = ins[0], ins[1], outs[0]
    b.link(lhs, lhs_spec[0], out, out_spec[0])
    b.link(rhs, rhs_spec[0], out, out_spec[1])
    b.link(lhs, lhs_spec[1], rhs, rhs_spec[1])
    spatial = tuple(lhs_spec[2:])
    return (("contract", ((lhs_spec[1], *spatial), (rhs_spec[1], *rhs_spec[2:]))),
            ("free", ((lhs_spec[0],), (rhs_spec[0],))), ("minor", spatial))


RULES = {
    "broadcast_in_dim": _broadcast, "reduce_sum": _reduce, "reduce_max": _reduce, "reduce_min": _reduce,
    "reduce_prod": _reduce, "argmax": _reduce, "argmin": _reduce, "reduce_and": _reduce, "reduce_or": _reduce,
    "transpose": _transpose, "dot_general": _dot, "ragged_dot_general": _ragged_dot,
    "gather": _gather, "reshape": _reshape,
    "concatenate": _concat, "slice": _same_size, "dynamic_slice": _same_size, "pad": _same_size,
    "squeeze": _squeeze, "expand_dims": _expand, "iota": _nothing, "rng_bit_generator": _nothing,
    "conv_general_dilated": _conv, "random_bits": _nothing, "random_wrap": _nothing,
    "random_unwrap": _nothing, "random_seed": _nothing,
}
