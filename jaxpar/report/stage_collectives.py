"""Collectives a pipeline stage's op would run on the devices of some stages only.

The pipeline executor (`jaxpar.pipeline.executor`) runs each tick's op with a ``lax.switch``:
at one tick the devices of stage 0 take the forward's branch, those of stage 1 the backward's.
A collective that XLA places inside such a branch must be one that only the devices taking the
branch join. A collective-permute never is on XLA:CPU (its rendezvous waits for every device of
the program), nor is a collective whose device groups span stages: the program would hang, or
abort when the rendezvous times out. XLA adds such collectives when a stage's computation needs a
resharding inside the branch, e.g. a fused QKV projection split over a tensor axis whose q, k, v
thirds do not fall on shard boundaries: slicing a third out moves columns between devices.

XLA decides this only when it compiles, so the check reads the optimized HLO: `stage_collectives`
lists the offending instructions with the branch holding them (its op, stages, virtual stages:
the name scope each branch's ops carry) and the Python lines they come from (the module's stack
frames); `check_stage_collectives` turns them into a ``ValueError`` naming the stage, the
parameter (found in the traced program at that line, walking back to the stage's parameters) and
the mesh axis; `checked_step` wraps a jitted step so that its first call compiles, checks, and
only then runs it (no second compile: the call reuses the compiled program).
"""
from __future__ import annotations

import dataclasses
import re
from collections import deque
import jax
import numpy as np

from jaxpar.executables import compiled_program
from jaxpar.pipeline.branches import parse_branch_label
from jaxpar.report.collectives import Collective, module_collectives
from jaxpar.report.hlo import INSTRUCTION, field, hlo_text, parse_module, stack_frames

__all__ = ["StageCollective", "StageCollectiveError", "stage_collectives", "check_stage_collectives", "checked_step"]

_MARK = "pipeline_op("


@dataclasses.dataclass(frozen=True)
class StageCollective:
    """One collective inside a pipeline op's branch that devices of other stages do not join.

    Attributes:
      collective: the instruction (`jaxpar.report.Collective`).
      branch: the branch's label (`jaxpar.pipeline.branches.parse_branch_label`): ``op`` ("F", "B",
        "W"), ``embed`` / ``loss`` (it runs the embedding / the loss), the ``stages`` and
        ``virtual`` stages running it; None if the program carries no label for it.
      frames: the Python stack it comes from, innermost first, ``(file, line, function)``.
      op_name: its ``op_name`` metadata.
      reason: why no branch may hold it.
    """

    collective: Collective
    branch: dict | None
    frames: tuple[tuple[str, int, str], ...]
    op_name: str
    reason: str


class StageCollectiveError(ValueError):
    """What `check_stage_collectives` raises: the program holds a collective that a pipeline stage's
    op must not (a ``ValueError``; the job search rules out a candidate whose dry run raises it)."""


def stage_collectives(compiled_or_hlo_text, mesh, axis: str = "pipe") -> list[StageCollective]:
    """The collectives of a compiled pipelined program that a stage's op must not hold.

    Every collective-permute inside a branch of the executor's per-tick ``lax.switch`` (XLA:CPU's
    waits for every device of the program), and every other collective there whose device groups
    hold devices of more than one stage (along mesh axis ``axis``): only the devices of the stages
    running the op take its branch, the others never arrive.

    Example:
      >>> found = stage_collectives(trainer.lower(batch).compile(), trainer.mesh)  # doctest: +SKIP
      >>> [(f.collective.kind, f.collective.mesh_axes, f.branch["stages"]) for f in found]  # doctest: +SKIP
      [('collective-permute', ('model',), (0,))]
    """
    text = hlo_text(compiled_or_hlo_text, "stage_collectives()")
    module = parse_module(text)
    inside = _branch_computations(module)
    if not inside:
        return []
    where = list(mesh.axis_names).index(axis)
    coords = np.indices(mesh.devices.shape)[where].reshape(-1)   # position in the mesh -> stage
    found = []
    for c in module_collectives(module, mesh, computations=inside):
        if c.kind == "collective-permute":
            reason = "a collective-permute waits for every device of the program (XLA:CPU)"
        elif any(len({int(coords[d]) for d in group}) > 1 for group in c.replica_groups):
            reason = "its device groups hold devices of more than one pipeline stage"
        else:
            continue
        found.append((c, reason))
    if not found:
        return []
    names = {c.name.lstrip("%") for c, _ in found}
    lines = {instr["name"].lstrip("%"): line for _, line in module.lines
             if (instr := INSTRUCTION.match(line)) and instr["name"].lstrip("%") in names}
    frames = stack_frames(text)
    out = []
    for c, reason in found:
        line = lines.get(c.name.lstrip("%"), "")
        op_name = field(line, "op_name") or ""
        branch = parse_branch_label(op_name) or inside[c.computation]
        out.append(StageCollective(c, branch, _frames_of(line, frames), op_name, reason))
    return out


def check_stage_collectives(compiled_or_hlo_text, mesh, axis: str = "pipe", jaxpr=None) -> None:
    """Raises ``ValueError`` when `stage_collectives` finds any: naming the stage and op, the mesh
    axis, the line of the model and, given the traced program's ``jaxpr`` (``jit(f).trace(...).jaxpr``),
    the stage parameter(s) that computation reads; with the fixes.

    Example:
      >>> traced = jax.jit(step).trace(state, batch)  # doctest: +SKIP
      >>> check_stage_collectives(traced.lower().compile(), mesh, jaxpr=traced.jaxpr)  # doctest: +SKIP
    """
    found = stage_collectives(compiled_or_hlo_text, mesh, axis)
    if not found:
        return
    # the most telling first: a permute (a resharding inside the stage) traced to a line of the model
    first = min(found, key=lambda f: (f.collective.kind != "collective-permute", not f.frames))
    c = first.collective
    axes = tuple(a for a in (c.mesh_axes or _axes_of(c, mesh)) if a != axis) or c.mesh_axes or ()
    params = _stage_parameters(jaxpr, first.frames) if jaxpr is not None else []
    where = _user_frame(first.frames)
    stage = _stage_text(first.branch)
    on = " and ".join(f"'{a}'" for a in axes) or "the mesh"
    also = f" ({len(found) - 1} more such collective{'s' if len(found) > 2 else ''} in the program)" if found[1:] else ""
    param = (f" on the stage parameter{'s' if len(params) > 1 else ''} {', '.join(params)}"
             if params else "")
    line = f" at {where[0]}:{where[1]} ({where[2]})" if where else ""
    a = "an" if c.kind.startswith("all") else "a"
    if axes == (axis,) or not axes:      # only the pipe axis: a value crosses stages inside the op
        raise StageCollectiveError(
            f"pipeline: {stage} holds {a} {c.kind} between pipeline stages (mesh axis '{axis}'){line}{param}, "
            f"which XLA placed inside that op's branch of the pipeline{also}. Only the devices of the stages "
            f"running the op take the branch and {first.reason}: the program would hang or abort, so it was "
            f"not run. It is a cross-stage collective inside a stage's op: the stage's computation reads or "
            f"writes a value held by another stage. Fix one of: keep values that cross stages out of the stage "
            f"function (pass them in the micro-batch, or as parameters of the stage's own layers); do not split "
            f"activations or non-layer parameters over '{axis}' (only the stacked layers' \"layers\" axis "
            f"goes to '{axis}' in the rules); or compute what needs the other stage's value in the embedding "
            f"or the loss, outside the stages.")
    raise StageCollectiveError(
        f"pipeline: {stage} holds {a} {c.kind} over mesh axis {on}{line}{param}, which XLA placed inside that op's "
        f"branch of the pipeline{also}. Only the devices of the stages running the op take the branch and "
        f"{first.reason}: the program would hang or abort, so it was not run. XLA adds it because that "
        f"computation needs a resharding inside the stage: e.g. a jnp.split or slice of a dimension split "
        f"over {on} whose pieces do not fall on shard boundaries (a fused QKV kernel of width 3*D split "
        f"over {on}: q, k, v are not whole shards). Fix one of: use separate q/k/v projections (or lay a "
        f"fused one out so that each piece splits evenly over {on}); use widths whose split falls on shard "
        f"boundaries; or keep the logical axis that splits {params[0] if params else 'that parameter'} off "
        f"{on} in the rules (map it to None).")


def checked_step(fn, mesh, axis: str = "pipe") -> "CheckedStep":
    """``fn`` (a ``jax.jit`` function) whose first call traces, compiles and checks the program with
    `check_stage_collectives` before running it; later calls go straight to ``fn``, which reuses that
    compiled program. ``lower`` and ``trace`` are ``fn``'s."""
    return CheckedStep(fn, mesh, axis)


class CheckedStep:
    """See `checked_step`."""

    __slots__ = ("_fn", "_mesh", "_axis", "_checked")

    def __init__(self, fn, mesh, axis: str):
        self._fn, self._mesh, self._axis, self._checked = fn, mesh, axis, False

    def __call__(self, *args):
        if not self._checked:
            # the program the call runs (one kept on disk by jaxpar.executables is checked as read);
            # the trace is JAX's cached one
            check_stage_collectives(compiled_program(self._fn, *args), self._mesh, self._axis,
                                    jaxpr=self._fn.trace(*args).jaxpr)
            self._checked = True
        return self._fn(*args)

    def lower(self, *args, **kwargs):
        return self._fn.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._fn.trace(*args, **kwargs)

    def compiled(self, *args) -> jax.stages.Compiled:
        """The program a call with ``args`` runs (`jaxpar.executables.compiled_program`)."""
        return compiled_program(self._fn, *args)


# --------------------------------------------------------------------------- the HLO side

def _branch_computations(module) -> dict[str, dict | None]:
    """``{computation: the label of the branch it runs in}`` for every computation a branch of a
    pipeline op's conditional reaches (the conditionals whose branches hold labelled ops)."""
    calls = {comp: [callee for callee, _, _ in edges] for comp, edges in module.calls.items()}
    body: dict[str, list[str]] = {}
    for comp, line in module.lines:
        body.setdefault(comp, []).append(line)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            comp = todo.pop()
            if comp not in seen:
                seen.add(comp)
                todo += calls.get(comp, [])
        return seen

    inside: dict[str, dict | None] = {}
    for comp, line in module.lines:
        if " conditional(" not in line:
            continue
        instr = INSTRUCTION.match(line)
        if instr is None or instr["op"] != "conditional":
            continue
        m = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = [n.strip().lstrip("%") for n in m[1].split(",")] if m else [
            n for n in re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)]
        for name in names:
            comps = reach(name)
            label = next((x for c in comps for ln in body.get(c, ())
                          if _MARK in ln and (x := parse_branch_label(field(ln, "op_name") or ""))), None)
            if label:
                for c in comps:
                    inside.setdefault(c, label)
    return inside


def _frames_of(line: str, frames: dict) -> tuple[tuple[str, int, str], ...]:
    if (m := re.search(r"stack_frame_id=(\d+)", line)) and int(m[1]) in frames:
        return frames[int(m[1])]
    file, num = field(line, "source_file"), re.search(r"source_line=(\d+)", line)
    return ((file, int(num[1]), "?"),) if file and num else ()


_OWN = ("/jaxpar/pipeline/", "/jaxpar/train/", "/jax/", "/jaxlib/")


def _user_frame(frames) -> tuple[str, int, str] | None:
    """The innermost frame of the model's code (not jaxpar's pipeline or trainer, not JAX)."""
    return next((f for f in frames if not any(own in f[0] for own in _OWN)), frames[0] if frames else None)


def _axes_of(c: Collective, mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of a collective's groups differ."""
    coords = np.indices(mesh.devices.shape).reshape(len(mesh.devices.shape), -1)
    return tuple(name for i, name in enumerate(mesh.axis_names)
                 if any(len({int(coords[i][d]) for d in g}) > 1 for g in c.replica_groups))


def _stage_text(branch: dict | None) -> str:
    if branch is None:
        return "a stage's op"
    op = {"F": "forward", "B": "backward", "W": "weight-gradient", "I": "idle"}[branch["op"]]
    extra = " with the embedding" if branch["embed"] else ""
    extra += " with the loss" if branch["loss"] else ""
    stages = ", ".join(map(str, branch["stages"]))
    virtual = ", ".join(map(str, branch["virtual"]))
    return (f"the {op} op ({branch['op']}{extra}) of pipeline stage{'s' if len(branch['stages']) > 1 else ''} "
            f"{stages}" + (f" (virtual stage{'s' if len(branch['virtual']) > 1 else ''} {virtual})"
                           if virtual else ""))


# --------------------------------------------------------------------------- the jaxpr side

def _stage_parameters(closed_jaxpr, frames) -> list[str]:
    """The stage parameters nearest (fewest operations back) to the traced operations at the
    collective's line, as the executor's ``shard_map`` names its arguments (``['qkv']['kernel']``)."""
    from jax.extend import core as jcore
    from jax.extend import source_info_util

    if not frames:
        return []
    target = {(f, n) for f, n, _ in frames[:1]}
    graph = _Graph(jcore)
    bodies = []
    graph.add(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), bodies)
    starts = []
    for eqn in graph.eqns:
        text = source_info_util.summarize(eqn.source_info)
        m = re.match(r"^(.*?):(\d+)(?::\d+)? \(", text)
        if m and (m[1], int(m[2])) in target:
            starts += [v for v in eqn.invars if isinstance(v, jcore.Var)]
    names = {}
    for inner in bodies:
        for var, name in zip(inner.invars, inner.debug_info.arg_names if inner.debug_info else ()):
            if name.startswith("params"):
                names[var] = name[len("params"):].removesuffix(".value")
    return _nearest(graph, starts, names)


def _nearest(graph: "_Graph", starts: list, names: dict) -> list[str]:
    """0-1 breadth-first walk back from ``starts``: an operation costs 1, a boundary into or out of
    a nested program 0; the names reached at the smallest cost."""
    best, seen, todo = None, {}, deque((v, 0) for v in starts)
    found: list[str] = []
    while todo:
        var, cost = todo.popleft()
        if var in seen and seen[var] <= cost or (best is not None and cost > best):
            continue
        seen[var] = cost
        if var in names:
            if best is None or cost < best:
                best, found = cost, []
            if names[var] not in found:
                found.append(names[var])
            continue
        for prev, step in graph.preds.get(var, ()):
            (todo.appendleft if step == 0 else todo.append)((prev, cost + step))
    return found


class _Graph:
    """Where each variable of a program (nested programs included) comes from: ``preds[var]`` lists
    ``(var, cost)``: an operation's operands (cost 1), the outer operand of a nested program's
    argument, the inner result behind an outer result, a loop's carried value (cost 0)."""

    def __init__(self, jcore):
        self.jcore, self.preds, self.eqns = jcore, {}, []

    def _link(self, dst, src, cost: int) -> None:
        if isinstance(dst, self.jcore.Var) and isinstance(src, self.jcore.Var):
            self.preds.setdefault(dst, []).append((src, cost))

    def add(self, jaxpr, bodies: list) -> None:
        for eqn in jaxpr.eqns:
            self.eqns.append(eqn)
            subs = [(k, s) for k, v in eqn.params.items() for s in (v if isinstance(v, (tuple, list)) else (v,))
                    if isinstance(s, (self.jcore.Jaxpr, self.jcore.ClosedJaxpr))]
            if not subs:
                for out in eqn.outvars:
                    for v in eqn.invars:
                        self._link(out, v, 1)
                continue
            for key, sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if eqn.primitive.name == "shard_map":
                    bodies.append(inner)
                self.add(inner, bodies)
                self._boundary(eqn, key, inner)

    def _boundary(self, eqn, key: str, inner) -> None:
        outer_in, outer_out = list(eqn.invars), list(eqn.outvars)
        name = eqn.primitive.name
        if name == "cond":
            outer_in = outer_in[1:]
        elif name == "while":
            nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            carry = outer_in[nc + nb:]
            outer_in = outer_in[:nc] + carry if key == "cond_jaxpr" else outer_in[nc:nc + nb] + carry
            if key == "body_jaxpr":
                for i, out in enumerate(inner.outvars):     # the carry goes round
                    self._link(inner.invars[nb + i], out, 0)
        elif name == "scan":
            nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
            for i in range(ncarry):
                self._link(inner.invars[nc + i], inner.outvars[i], 0)
        if len(outer_in) == len(inner.invars):
            for a, b in zip(inner.invars, outer_in):
                self._link(a, b, 0)
        else:      # a layout this walk does not know: every argument may come from every operand
            for a in inner.invars:
                for b in eqn.invars:
                    self._link(a, b, 1)
        if key != "cond_jaxpr" and len(outer_out) == len(inner.outvars):
            for a, b in zip(outer_out, inner.outvars):
                self._link(a, b, 0)
        elif key != "cond_jaxpr":
            for a in outer_out:
                for b in inner.outvars:
                    self._link(a, b, 1)

