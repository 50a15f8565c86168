"""The per-step ops of the executor: one function per (op, first virtual stage, last virtual stage).

Each branch maps ``(chunk, head, emb, x, g, target, inp, const)`` to
``(y, dx, dθ, dhead, demb, loss, stats)``: ``x`` is the activation read from the stage's buffer,
``g`` the gradient of its output, ``inp`` the micro-batch's raw inputs and ``emb`` the
embedding's parameters. When the executor runs the embedding (``embed_fn``), the first
virtual stage computes its input as ``embed_fn(emb, inp)`` instead of reading ``x``, so its
backward yields the embedding's gradient and no input gradient; the last virtual stage
applies ``loss_fn`` to its output. Every other stage touches neither.

The stage function returns ``(y, aux_loss, stats)`` (see ``executor._canonical``): the
auxiliary loss joins the loss (scaled by ``1/m``, as the loss is) and is differentiated with
it; it and the stats (floats averaged, integers summed) are recorded once per micro-batch and
chunk, by the op whose forward counts: F on every virtual stage but the last, whose training
F does nothing and whose B computes the forward, the loss and the aux loss together.

B and W recompute the stage forward from its input under ``jax.vjp`` (the executor keeps
inputs only). In a split backward (ZB schedules) B differentiates the input alone and W the
weights (and the head and the embedding, which are weights too).
"""
from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = ["BranchKey", "branch_label", "make_branches", "parse_branch_label", "scoped", "stats_dtype"]

BranchKey = tuple[str, bool, bool]   # (op "I" / "F" / "B" / "W", first virtual stage, last virtual stage)


def make_branches(keys: list[BranchKey], stage_fn: Callable, loss_fn: Callable, embed_fn: Callable | None,
                  split: bool, m: int, forward_only: bool, stats: Any = ()) -> list[Callable]:
    """One branch per key, in the order of ``keys`` (the index ``lax.switch`` is given);
    ``stats``: the shapes of the stage function's stats."""
    return [_branch(kind, first and embed_fn is not None, last, stage_fn, loss_fn, embed_fn, split, m,
                    forward_only, stats) for kind, first, last in keys]


def _wrt(kind: str, first: bool, last: bool, split: bool) -> tuple[str, ...]:
    """What the op differentiates."""
    weights = ("chunk",) + (("head",) if last else ()) + (("emb",) if first else ())
    inputs = () if first else ("x",)
    if kind == "B":
        return inputs if split else weights + inputs
    return weights if kind == "W" else ()


def _branch(kind: str, first: bool, last: bool, stage_fn, loss_fn, embed_fn, split: bool, m: int,
            forward_only: bool, stats: Any) -> Callable:
    scale = 1.0 / m   # the loss is the mean over micro-batches

    def run(chunk, head, emb, x, g, t, inp, k):
        args = dict(chunk=chunk, head=head, emb=emb, x=x)

        def forward(**given):
            """``((y, aux) or loss + aux, stats)``: what is differentiated, and what is only recorded."""
            a = {**args, **given}
            h = embed_fn(a["emb"], inp) if first else a["x"]
            y, aux, st = stage_fn(a["chunk"], h, k, t)
            aux, st = _recorded(aux, y, scale), jax.tree.map(lambda s: _recorded(s, y, scale), st)
            return (loss_fn(a["head"], y, t).astype(jnp.float32) * scale + aux if last else (y, aux)), st

        out = _Out(args, forward_only, stats)
        if kind == "I" or (kind == "F" and last and not forward_only):
            return out()   # the last F of training: its B recomputes the forward and the loss anyway
        if kind == "F":
            value, st = forward()
            return out(loss=value, stats=st) if last else out(y=value[0], loss=value[1], stats=st)
        wrt = _wrt(kind, first, last, split)
        if not wrt:   # B of the first stage in a split backward: no input gradient to send
            return out()
        value, vjp, st = jax.vjp(lambda *vals: forward(**dict(zip(wrt, vals))), *(args[n] for n in wrt),
                                 has_aux=True)
        grads = dict(zip(wrt, vjp(jnp.ones_like(value) if last else (g, jnp.ones_like(value[1])))))
        counted = last and kind == "B"   # the other stages counted theirs in F
        return out(dx=grads.get("x"), chunk=grads.get("chunk"), head=grads.get("head"), emb=grads.get("emb"),
                   loss=value if counted else None, stats=st if counted else None)

    return run


def _recorded(value, like, scale: float):
    """What an op records of a value: floats as their share of the mean over micro-batches (in
    float32), integers (counts) whole, to be summed. Plus a zero varying over the pipe axis
    like ``like``: every branch of the switch must return the same types."""
    if jnp.issubdtype(value.dtype, jnp.integer):
        return value + jnp.zeros_like(like, value.dtype, shape=value.shape)
    return value.astype(jnp.float32) * scale + jnp.zeros_like(like, jnp.float32, shape=value.shape)


def stats_dtype(dtype) -> Any:
    """The dtype a stat is accumulated in (see ``_recorded``)."""
    return dtype if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


class _Out:
    """Fills what an op did not compute with zeros of the right type (varying over the pipe axis)."""

    def __init__(self, args: dict[str, Any], forward_only: bool, stats: Any):
        self.args, self.forward_only, self.stats = args, forward_only, stats

    def __call__(self, y=None, dx=None, chunk=None, head=None, emb=None, loss=None, stats=None):
        a = self.args
        zero = lambda like, value: jax.tree.map(jnp.zeros_like, like) if value is None else value  # noqa: E731
        scalar = jnp.zeros_like(a["x"], jnp.float32, shape=()) if loss is None else loss
        if stats is None:   # zeros varying like x (over the pipe axis), in the dtype recorded
            stats = jax.tree.map(lambda s: jnp.zeros_like(a["x"], stats_dtype(s.dtype), shape=s.shape), self.stats)
        if self.forward_only:   # forward-only programs keep no gradients
            return zero(a["x"], y), zero(a["x"], dx), (), (), (), scalar, stats
        return (zero(a["x"], y), zero(a["x"], dx), zero(a["chunk"], chunk), zero(a["head"], head),
                zero(a["emb"], emb), scalar, stats)


def branch_label(key: BranchKey, stages: tuple[int, ...], virtual: tuple[int, ...]) -> str:
    """The name scope of a branch's ops: ``pipeline_op(B+loss;stages=1;virtual=1)`` (what
    `parse_branch_label` reads back from the compiled program's ``op_name`` metadata)."""
    kind, first, last = key
    what = kind + ("+embed" if first else "") + ("+loss" if last else "")
    return (f"pipeline_op({what};stages={'+'.join(map(str, stages))};"
            f"virtual={'+'.join(map(str, virtual))})")


_LABEL = re.compile(r"pipeline_op\((?P<kind>[IFBW])(?P<more>[+a-z]*);stages=(?P<stages>[\d+]*);"
                    r"virtual=(?P<virtual>[\d+]*)\)")


def parse_branch_label(op_name: str) -> dict | None:
    """``{"op": "B", "embed": bool, "loss": bool, "stages": (1,), "virtual": (1,)}`` of the
    innermost branch label in an ``op_name``, or None."""
    found = list(_LABEL.finditer(op_name))
    if not found:
        return None
    m = found[-1]
    ints = lambda text: tuple(int(x) for x in text.split("+") if x)  # noqa: E731
    return {"op": m["kind"], "embed": "+embed" in m["more"], "loss": "+loss" in m["more"],
            "stages": ints(m["stages"]), "virtual": ints(m["virtual"])}


def scoped(branch: Callable, label: str) -> Callable:
    """``branch`` with its ops under the name scope ``label`` (see `branch_label`)."""

    def run(*args):
        with jax.named_scope(label):
            return branch(*args)

    return run
