"""Mixed precision as a setting: which dtype parameters are stored in, computed in, reduced
in, and which the optimizer state is kept in.

A ``Precision`` is four dtype names and the kind of the model's matmuls; four presets cover
the usual choices::

    >>> Precision.named("bf16")
    Precision(params='float32', compute='bfloat16', reduce='float32', opt_state='float32')
    >>> as_precision("bf16-pure").params
    'bfloat16'

The step applies it (see ``jaxpar.train.step``): parameters are stored in ``params`` (fp32
master weights by default) and cast to ``compute`` where the loss uses them, inside the
differentiated function, so the update lands on the stored weights; float batch leaves are
cast to ``compute`` (integer tokens are not); the loss comes back in fp32; gradients are
kept and summed in ``reduce`` and reach the optimizer in ``params``; the optimizer runs in
fp32 and its state is stored in ``opt_state`` (`with_precision`). Only floating-point leaves
are ever cast: RNG keys, counters and other integer state keep their dtypes, and the
non-parameter state (e.g. batch statistics) keeps the dtype it had.

``matmuls="fp8"`` (the ``"fp8"`` preset) runs the model's projections as fp8 matmuls with
per-tensor current scaling, e4m3 forward and e5m2 gradients (`jaxpar.nn.fp8`); the LM head,
attention and norms stay in ``compute``. It needs fp8 matmuls (NVIDIA compute capability 8.9
or newer) and is refused elsewhere by the plan's checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

FLOATS = ("float32", "bfloat16", "float16")
FIELDS = ("params", "compute", "reduce", "opt_state")
MATMULS = ("compute", "fp8")


def _check_dtype(field: str, value: Any) -> str:
    if value not in FLOATS:
        why = ""
        if isinstance(value, str) and value.startswith("float8"):
            why = " (fp8 needs per-tensor scaling, which a plain cast does not give)"
        raise ValueError(f"Precision.{field}={value!r} is not a dtype jaxpar trains in{why}; choose one of "
                         f"{FLOATS}, or a preset {tuple(PRESETS)} for the whole setting")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """The dtypes of one training job (every field one of ``FLOATS``).

    Attributes:
      params: dtype the parameters are stored in between steps (the master weights) and
        the optimizer's update is applied to.
      compute: dtype the parameters and float batch leaves are cast to where the loss
        uses them (matmuls, activations, the activations kept for the backward).
      reduce: dtype gradients are kept in from the backward to the optimizer: summed over
        micro-batches (``grad_accum``) and, in ``mode="hybrid"``, all-reduced /
        reduce-scattered over the batch axes in it.
      opt_state: dtype the optimizer state is stored in (its arithmetic runs in fp32).
      matmuls: ``"compute"`` (the model's matmuls in ``compute``) or ``"fp8"`` (its
        projections as scaled fp8 matmuls; needs ``compute`` bfloat16 or float16).

    >>> Precision(compute="bfloat16").compute
    'bfloat16'
    """

    params: str = "float32"
    compute: str = "float32"
    reduce: str = "float32"
    opt_state: str = "float32"
    matmuls: str = "compute"

    def __post_init__(self):
        for field in FIELDS:
            _check_dtype(field, getattr(self, field))
        if self.matmuls not in MATMULS:
            raise ValueError(f"Precision.matmuls={self.matmuls!r} is not one of {MATMULS}")
        if self.matmuls == "fp8" and self.compute == "float32":
            raise ValueError("Precision.matmuls='fp8' with compute='float32': fp8 matmuls take half-precision "
                             "activations; use compute='bfloat16' (the 'fp8' preset) or matmuls='compute'")

    @classmethod
    def named(cls, name: str) -> "Precision":
        """The preset ``name``: ``"fp32"``, ``"bf16"``, ``"bf16-pure"`` or ``"fp8"`` (see ``PRESETS``)."""
        if name not in PRESETS:
            raise ValueError(f"precision={name!r} is not a preset; choose one of {tuple(PRESETS)}, or give "
                             f"the dtypes, e.g. {{'compute': 'bfloat16'}} (dtypes: {FLOATS})")
        return PRESETS[name]

    @property
    def label(self) -> str:
        """The preset name, or the four dtypes."""
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        extra = [] if self.matmuls == "compute" else [f"matmuls={self.matmuls}"]
        return " ".join([f"{f}={getattr(self, f)}" for f in FIELDS] + extra)


PRESETS = {
    "fp32": Precision(),
    # bf16 matmuls and activations; fp32 master weights, gradient sums and Adam moments.
    "bf16": Precision(compute="bfloat16"),
    # everything in bf16: half the parameter and optimizer-state memory, coarser updates.
    "bf16-pure": Precision(params="bfloat16", compute="bfloat16", reduce="bfloat16", opt_state="bfloat16"),
    # "bf16" with the model's projections as scaled fp8 matmuls (Hopper / Ada GPUs).
    "fp8": Precision(compute="bfloat16", matmuls="fp8"),
}


def as_precision(value: Any) -> Precision | None:
    """``None`` (no setting), a preset name, a dict of dtypes or a ``Precision`` → ``Precision | None``.

    >>> as_precision({"compute": "bfloat16"}) == Precision.named("bf16")
    True
    """
    if value is None or isinstance(value, Precision):
        return value
    if isinstance(value, str):
        return Precision.named(value)
    if isinstance(value, Mapping):
        extra = set(value) - set(FIELDS) - {"matmuls"}
        if extra:
            raise ValueError(f"precision={dict(value)!r}: unknown keys {sorted(extra)}; known: "
                             f"{list(FIELDS) + ['matmuls']}")
        return Precision(**value)
    raise TypeError(f"precision={value!r} ({type(value).__name__}): give a preset name {tuple(PRESETS)}, "
                    "a dict of dtypes or a jaxpar.Precision")


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floats(tree, dtype):
    """``tree`` with every floating-point leaf cast to ``dtype`` (other leaves as they are).

    >>> cast_floats({"w": jnp.ones(2), "n": jnp.zeros((), jnp.int32)}, "bfloat16")["w"].dtype
    dtype(bfloat16)
    """
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: _astype(x, dtype) if _is_float(x) else x, tree)


def _astype(x, dtype):
    if isinstance(x, jax.ShapeDtypeStruct):     # abstract state (plans, eval_shape)
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)


def cast_like(tree, like):
    """``tree`` with each floating-point leaf cast to the dtype of the matching leaf of ``like``."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype) if _is_float(x) and _is_float(y) else x, tree, like)


def with_precision(tx: optax.GradientTransformation, precision: Precision | None) -> optax.GradientTransformation:
    """``tx`` whose state is stored in ``precision.opt_state``; its arithmetic runs in fp32
    (gradients, state and parameters cast up on the way in) and the updates come back in the
    gradients' dtype. ``tx`` itself when ``precision`` is ``None``.

    >>> tx = with_precision(optax.adam(1e-3), Precision.named("bf16-pure"))
    >>> tx.init({"w": jnp.ones(2)})[0].mu["w"].dtype
    dtype(bfloat16)
    """
    if precision is None:
        return tx
    up = lambda t: cast_floats(t, jnp.float32)  # noqa: E731

    def init(params):
        return cast_floats(tx.init(params), precision.opt_state)

    def update(updates, state, params=None):
        new, state = tx.update(up(updates), up(state), None if params is None else up(params))
        return cast_like(new, updates), cast_floats(state, precision.opt_state)

    return optax.GradientTransformation(init, update)
