"""Run a model's init as one small jitted program per kind of variable, or as one program
when that compiles sooner.

XLA compiles one program holding every initializer of a large unrolled model for a minute
(a Llama 1B: 60 s, eager Flax init 5 s), while tracing it takes a fraction of a second. So
``SlicedInit`` takes the constructor's jaxpr (``jax.make_jaxpr(make, return_shape=True)()``)
and splits it:

1. the bookkeeping runs eagerly, in order: equations whose inputs are known and whose outputs
   are small (at most ``SMALL`` elements) PRNG keys or integers and not variables — the key
   derivations (``random_seed``, ``fold_in``, ``split``) and RNG counters. Floating-point work,
   however small, is left to the programs, so no initializer is compiled twice;
2. every output (one variable's value) runs its backward slice of the other equations as
   ``jax.jit(slice, out_shardings=its sharding)(*small known inputs)``: XLA partitions the
   initializer, so each device computes only its own shards, as in one whole-model program;
3. slices with the same structure (primitives, parameters, shapes, the output's sharding) share
   one jitted program: the ``wq`` of every unrolled layer differs only in its key input, so
   a model compiles one program per kind of variable.

A small model whose variables are of many kinds is the other way round: each program costs
about as much to lower and compile as ``WHOLE_EQNS_PER_PROGRAM`` equations of one program
holding them all. When the model has no more such equations than that many per distinct program,
``split="auto"`` runs one program with every variable's ``out_shardings`` instead (the same
values, bit for bit, and still no device holding a whole replica of a sharded variable).

Jitted programs are kept (``_PROGRAMS``, the newest ``PROGRAM_CACHE`` of them) by what they
compute, so building the same model again in a process — a second trainer, a restart, a
benchmark round — runs the programs it compiled the first time instead of tracing them again.

A variable whose value is a literal or an array ``model_fn`` closed over has no program: it is
placed with ``jax.device_put(value, sharding)``, which sends each device its shards only. (A
closed-over array that a variable is computed from is an argument of its program, whole on
each device, as it was in one whole-model program.)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var

from jaxpar.distributed import place_leaf

SMALL = 4096  # elements: an eagerly computed value (keys, counters) is at most this large
# One more program costs about as much to lower and compile as this many more equations (those
# left to the programs, not the eager bookkeeping) in one program holding every variable.
# Measured with XLA:CPU on 8 devices, each alone with the cache off: about 0.2 s per distinct
# program split by variable, 0.045 s per equation whole. The matrix's GPT (34 equations, 14
# programs): 2.7 s split, 1.5 s whole; a tiny Llama (37, 6): 1.2 s split, 1.5 s whole; Llama
# 125m (197, 8): 1.7 s, 7.3 s; Llama 1B (259, 7): 1.5 s, 12.7 s.
WHOLE_EQNS_PER_PROGRAM = 4
PROGRAM_CACHE = 256  # jitted init programs kept per process (_PROGRAMS), the least recently used dropped
SPLITS = ("auto", "variables", "whole")
_PROGRAMS: OrderedDict = OrderedDict()


def _program(key, make):
    """The jitted program cached under ``key`` (equal keys compute equal values), else ``make()``."""
    fn = _PROGRAMS.get(key)
    if fn is None:
        fn = _PROGRAMS[key] = make()
        while len(_PROGRAMS) > PROGRAM_CACHE:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    return fn


class _Identity:
    """A cache-key part that equals only itself (arrays, unhashable parameters)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


class _Slice(NamedTuple):
    eqns: tuple      # the equations that compute the output, in jaxpr order
    free: tuple      # their inputs known before any slice runs (eager results, consts)
    out: Any         # the output atom (Var or Literal)
    sharding: Any
    fn: Any          # the jitted program (shared between slices of the same key), None to device_put


class SlicedInit:
    """``program()`` → ``(params, rest)``, each variable computed already sharded.

    ``program.programs()`` lists ``(path, jitted, args)`` per variable computed by a program
    (one entry, path ``"(whole model)"``, when ``program.whole``): ``jitted.lower(*args).compile()``
    is what runs; ``program.program_count`` counts the distinct programs of the split by variable.
    """

    def __init__(self, traced, shardings, split: str = "auto"):
        """``traced``: ``jax.make_jaxpr(make, return_shape=True)()`` of a function with no
        arguments; ``shardings``: a tree of shardings matching ``make()``'s outputs; ``split``:
        ``"variables"`` (a program per kind of variable), ``"whole"`` (one program) or ``"auto"``
        (whichever compiles sooner, by ``WHOLE_EQNS_PER_PROGRAM``)."""
        if split not in SPLITS:
            raise ValueError(f"init_program: split={split!r} is not one of {SPLITS}; use 'auto' unless "
                             "comparing the two ways")
        closed, out_shape = traced
        self._closed = closed
        self._out_tree = jax.tree.structure(out_shape)
        self._paths = [jax.tree_util.keystr(p, simple=True, separator="/")
                       for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
        flat_shardings = self._out_tree.flatten_up_to(shardings)
        jaxpr = closed.jaxpr
        known = set(jaxpr.constvars) | set(jaxpr.invars)
        outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
        self._eager, deferred = [], []
        for eqn in jaxpr.eqns:
            if (all(isinstance(v, Literal) or v in known for v in eqn.invars)
                    and all(_bookkeeping(v.aval) for v in eqn.outvars) and not outputs & set(eqn.outvars)):
                self._eager.append(eqn)
                known.update(eqn.outvars)
            else:
                _check_no_effects(eqn)
                deferred.append(eqn)
        producer = {v: eqn for eqn in deferred for v in eqn.outvars}
        order = {id(eqn): i for i, eqn in enumerate(deferred)}
        programs: set = set()
        self._slices = [_plan_slice(producer, order, known, out, sharding, programs)
                        for out, sharding in zip(jaxpr.outvars, flat_shardings)]
        self.program_count = len(programs)
        computed = [s for s in self._slices if s.fn is not None]
        self.whole = bool(computed) and (split == "whole" or (
            split == "auto" and len(deferred) <= WHOLE_EQNS_PER_PROGRAM * self.program_count))
        self._whole = _plan_whole(computed, order) if self.whole else None

    def _known_values(self) -> dict:
        env = dict(zip(self._closed.jaxpr.constvars, self._closed.consts))
        _eval(self._eager, env)
        return env

    def __call__(self):
        env = self._known_values()
        if self._whole is not None:     # one program computes every slice, in order
            free, fn = self._whole
            done = iter(fn(*(env[v] for v in free)))
            compute = lambda s: next(done)  # noqa: E731
        else:
            compute = lambda s: s.fn(*(env[v] for v in s.free))  # noqa: E731
        # a slice without a program is a literal, a closed-over array or a key: placed as it is,
        # also where its sharding spans several processes
        leaves = [compute(s) if s.fn is not None else place_leaf(_read(env, s.out), s.sharding)
                  for s in self._slices]
        return jax.tree.unflatten(self._out_tree, leaves)

    def programs(self) -> list[tuple[str, Any, tuple]]:
        env = self._known_values()
        if self._whole is not None:
            free, fn = self._whole
            return [("(whole model)", fn, tuple(env[v] for v in free))]
        return [(path, s.fn, tuple(env[v] for v in s.free))
                for path, s in zip(self._paths, self._slices) if s.fn is not None]


def _bookkeeping(aval) -> bool:
    """A small PRNG key array or integer array: what deriving keys and counting calls makes."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None or math.prod(shape) > SMALL:
        return False
    return (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or jax.dtypes.issubdtype(dtype, np.integer)
            or jax.dtypes.issubdtype(dtype, np.bool_))


def _check_no_effects(eqn) -> None:
    # A program runs only what its variable needs, and shared work once per variable: a side
    # effect (a print, a callback) on initializer values would run many times or never.
    if eqn.effects:
        raise ValueError(f"jaxpar.init: model_fn runs {eqn.primitive.name!r}, which has side effects "
                         f"({', '.join(sorted(map(str, eqn.effects)))}), on values that initializers compute; "
                         "jaxpar.init may build each variable in a program of its own and cannot run it there. "
                         "Remove it from the model's constructor, or build the model eagerly and place it "
                         "with jaxpar.nn.place(model, config, mesh)")


def _plan_whole(computed: list, order: dict) -> tuple:
    """``(free, jitted)``: one program computing every slice of ``computed``, each output with its
    sharding."""
    eqns = tuple(sorted({id(e): e for s in computed for e in s.eqns}.values(), key=lambda e: order[id(e)]))
    free = tuple(dict.fromkeys(v for s in computed for v in s.free))
    outs, shardings = tuple(s.out for s in computed), tuple(s.sharding for s in computed)
    names = {v: i for i, v in enumerate(free)}
    key = ("whole", tuple(v.aval for v in free), _eqns_key(eqns, names), tuple(_atom_key(o, names) for o in outs),
           shardings)
    return free, _program(key, lambda: jax.jit(_interpreter(eqns, free, outs), out_shardings=shardings))


def _plan_slice(producer: dict, order: dict, known, out, sharding, programs: set) -> _Slice:
    if isinstance(out, Literal) or out in known:
        return _Slice((), (), out, sharding, None)
    needed, stack = {}, [out]
    while stack:
        v = stack.pop()
        if isinstance(v, Literal) or v in known:
            continue
        eqn = producer[v]
        if id(eqn) not in needed:
            needed[id(eqn)] = eqn
            stack.extend(eqn.invars)
    eqns = tuple(sorted(needed.values(), key=lambda eqn: order[id(eqn)]))
    free = tuple(dict.fromkeys(v for eqn in eqns for v in eqn.invars
                               if not isinstance(v, Literal) and v in known))
    key = _slice_key(eqns, free, out, sharding)
    programs.add(key)
    return _Slice(eqns, free, out, sharding,
                  _program(key, lambda: jax.jit(_interpreter(eqns, free, out), out_shardings=sharding)))


def _interpreter(eqns, free, out):
    """The function of ``free``'s values that runs ``eqns`` and returns ``out`` (an atom, or a
    tuple of them)."""
    def run(*values):
        env = dict(zip(free, values))
        _eval(eqns, env)
        return tuple(_read(env, o) for o in out) if isinstance(out, tuple) else _read(env, out)

    return run


def _eval(eqns, env: dict) -> None:
    for eqn in eqns:
        for v, value in zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])):
            if not isinstance(v, DropVar):
                env[v] = value


def _bind(eqn, args) -> list:
    # the standard interpreter step (jax.core.eval_jaxpr); get_bind_params returns the
    # parameters bind takes (since JAX 0.9.2; jaxpar needs 0.10), ctx the equation's context
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict, v):
    return v.val if isinstance(v, Literal) else env[v]


# --- cache keys: equal keys compute equal values -------------------------------------------

def _slice_key(eqns, free, out, sharding) -> tuple:
    names = {v: i for i, v in enumerate(free)}
    return (tuple(v.aval for v in free), _eqns_key(eqns, names), _atom_key(out, names), sharding)


def _eqns_key(eqns, names: dict) -> tuple:
    rows = []
    for eqn in eqns:
        ins = tuple(_atom_key(v, names) for v in eqn.invars)
        for v in eqn.outvars:
            names[v] = len(names)
        rows.append((eqn.primitive, ins, tuple(v.aval for v in eqn.outvars), _param_key(eqn.params), eqn.ctx))
    return tuple(rows)


def _atom_key(v, names: dict):
    if isinstance(v, Literal):
        value = np.asarray(v.val)
        return ("literal", v.aval, value.dtype.str, value.shape, value.tobytes())
    return names[v]


def _jaxpr_key(jaxpr: Jaxpr) -> tuple:
    names = {v: i for i, v in enumerate((*jaxpr.constvars, *jaxpr.invars))}
    return (tuple(v.aval for v in (*jaxpr.constvars, *jaxpr.invars)), _eqns_key(jaxpr.eqns, names),
            tuple(_atom_key(v, names) for v in jaxpr.outvars), frozenset(map(str, jaxpr.effects)))


def _param_key(x):
    if isinstance(x, ClosedJaxpr):
        return ("closed_jaxpr", _jaxpr_key(x.jaxpr), tuple(_Identity(c) for c in x.consts))
    if isinstance(x, Jaxpr):
        return ("jaxpr", _jaxpr_key(x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _param_key(v)) for k, v in x.items())))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_param_key(v) for v in x))
    if isinstance(x, (np.ndarray, jax.Array)):
        return _Identity(x)
    try:
        hash(x)
    except TypeError:
        return _Identity(x)
    return x  # compared with its own __eq__: value equality, or identity for functions and plain objects
