"""The structure of an optimized HLO module's text (``compiled.as_text()``).

What the readers of compiled programs share (`jaxpar.report.collectives`, which lists the
collectives; `jaxpar.report.stage_collectives`, which finds those a pipeline stage's branch must
not hold): the computations and their instruction lines, which computation calls which (and
how often a loop runs it), the device count, and the module's stack-frame table. A compiled
step's text is megabytes long (a pipelined step's tens of thousands of lines, each with its
metadata), so a line is read with substring tests first and regular expressions only where
they can match.
"""
from __future__ import annotations

import dataclasses
import re

import jax

__all__ = ["HloModule", "INSTRUCTION", "hlo_text", "parse_module", "loop_context", "stack_frames", "field"]

_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
# one instruction: ``[ROOT] %name = shape op(rest``
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s"
                         r"(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
# every attribute _CALLEE and _CALLEE_LIST read ends so: a line without any calls nothing
_CALLS = ("calls=", "body=", "condition=", "to_apply=", "_computation=", "_computations=")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass
class HloModule:
    """A parsed module: its instruction lines, call edges, entry and device count."""
    lines: list[tuple[str, str]]                  # (computation, instruction line)
    calls: dict[str, list[tuple[str, str, int | None]]]  # caller -> (callee, op, trips)
    entry: str | None
    num_devices: int | None
    async_wrapped: set[str]                       # computations an async ``-start`` wraps


def hlo_text(obj, who: str = "collectives()") -> str:
    """The optimized HLO text of a ``jax.stages.Compiled`` (or the text itself); ``who`` names
    the caller in the errors."""
    if isinstance(obj, jax.stages.Compiled):
        text = obj.as_text()
        if not text:
            raise ValueError(f"{who}: compiled.as_text() returned no HLO text for this "
                             "program; pass the optimized HLO text yourself.")
        return text
    if isinstance(obj, jax.stages.Lowered):
        raise TypeError(f"{who} got a jax.stages.Lowered: XLA chooses the collectives "
                        "when it compiles, so call .compile() on it and pass the result.")
    if not isinstance(obj, str):
        raise TypeError(f"{who} expects a jax.stages.Compiled or its HLO text "
                        f"(compiled.as_text()), got {type(obj).__name__}.")
    if "stablehlo." in obj or obj.lstrip().startswith("module"):
        raise ValueError(f"{who} got StableHLO/MLIR text (from Lowered.as_text()); "
                         "it needs the optimized HLO: pass lowered.compile().as_text().")
    return obj


def parse_module(text: str) -> HloModule:
    """The computations, instruction lines and call edges of an HLO module's text."""
    module = HloModule([], {}, None, _num_devices(text), set())
    comp = None
    for line in text.splitlines():
        header = _COMP.match(line) if line.rstrip().endswith("{") and " = " not in line else None
        if header:
            comp = header["name"]
            module.entry = comp if header["entry"] else module.entry
        elif line.startswith("}"):
            comp = None
        elif comp is not None and "=" in line:
            module.lines.append((comp, line))
            if any(attr in line for attr in _CALLS):
                _add_calls(module, comp, line)
    return module


def _num_devices(text: str) -> int | None:
    header = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    if not (partitions or replicas):
        return None
    return int(partitions[1] if partitions else 1) * int(replicas[1] if replicas else 1)


def _add_calls(module: HloModule, comp: str, line: str) -> None:
    instr = INSTRUCTION.match(line)
    op = instr["op"] if instr else ""
    trips = _TRIPS.search(line) if "known_trip_count" in line else None
    edges = [(name, op if attr in ("body", "condition") else "call")
             for attr, name in _CALLEE.findall(line)]
    if "_computations=" in line:
        for names in _CALLEE_LIST.findall(line):
            edges += [(n.strip().lstrip("%"), "call") for n in names.split(",") if n.strip()]
    for callee, kind in edges:
        module.calls.setdefault(comp, []).append((callee, kind, int(trips[1]) if trips else None))
        if op.endswith("-start"):
            module.async_wrapped.add(callee)


def loop_context(module: HloModule) -> dict[str, tuple[bool, int | None]]:
    """(in_loop, executions) per computation, propagated from the entry along calls."""
    callees = {c for edges in module.calls.values() for c, _, _ in edges}
    roots = [module.entry] if module.entry else [c for c, _ in module.lines if c not in callees]
    context = {root: (False, 1) for root in roots}
    stack = list(context)
    while stack:
        comp = stack.pop()
        in_loop, runs = context[comp]
        for callee, kind, trips in module.calls.get(comp, ()):
            loop = kind == "while"
            new = (in_loop or loop, runs if not loop else (
                runs * trips if runs is not None and trips is not None else None))
            old = context.get(callee, new)
            merged = (old[0] or new[0], old[1] if old[1] == new[1] else None)
            if callee not in context or merged != old:
                context[callee] = merged
                stack.append(callee)
    return context


_FIELD = r'{}="((?:[^"\\]|\\.)*)"'


def field(line: str, name: str) -> str | None:
    """The value of an instruction's quoted metadata field ``name="..."`` (``op_name``, ...)."""
    if f'{name}="' not in line:
        return None
    m = re.search(_FIELD.format(name), line)
    return m[1] if m else None


def stack_frames(text: str) -> dict[int, tuple[tuple[str, int, str], ...]]:
    """The module's stack frame table: ``{frame id: ((file, line, function), ...)}`` innermost first."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif section and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[section][int(m[1])] = m[2]
        elif section and line.strip():
            section = None
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in tables.get("FileLocations", {}).items():
        get = lambda f: int(m[1]) if (m := re.search(rf"\b{f}=(\d+)", v)) else 0  # noqa: E731
        locs[k] = (files.get(get("file_name_id"), "?"), get("line"), funcs.get(get("function_name_id"), "?"))
    parent = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        up = re.search(r"parent_frame_id=(\d+)", v)
        parent[k] = (int(loc[1]) if loc else 0, int(up[1]) - 1 if up else 0)   # parent ids count from 1

    def chain(k: int) -> tuple:
        out, seen = [], set()
        while k in parent and k not in seen:
            seen.add(k)
            loc, k = parent[k]
            if loc in locs:
                out.append(locs[loc])
        return tuple(out)

    return {k: chain(k) for k in parent}
