"""A mixture-of-experts feed-forward layer for Flax NNX models, expert parallel by rules.

``MoE`` routes every token to ``top_k`` of ``experts`` SwiGLU experts (stacked weights with
the logical axes ``("expert", "embed", "mlp")``), optionally adds shared experts every token
goes through, and records its auxiliary losses on itself. Like the rest of a model it names
no mesh axis: given a ``constrain`` that carries a mesh and rules (``jaxpar.LogicalConstraint``),
the ``"expert"`` rule decides the expert-parallel axis, ``"batch"`` the data axes and
``"mlp"`` tensor parallel inside the experts; without one every expert runs here.

    >>> layer = MoE(16, 32, MoEConfig(experts=4, top_k=2), rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((2, 8, 16)))
    >>> y.shape, float(moe_aux_loss(layer)) > 0
    ((2, 8, 16), True)

Add ``moe_aux_loss(model)`` (the weighted load-balancing and z-losses of every MoE layer of
the last forward pass) to the training loss; ``moe_metrics(model)`` reads the unweighted
values and the dropped assignments for logging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.ops.activations import swiglu
from jaxpar.ops.grouped_matmul import KERNELS
from jaxpar.ops.moe_dispatch import TRANSPORTS, ExpertDispatch, moe_dispatch
from jaxpar.strategy import logical_axes, manual_axes, mesh_sizes

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The router and experts of an ``MoE`` layer.

    >>> MoEConfig(experts=8, top_k=2).capacity_factor is None     # dropless by default
    True
    """

    experts: int                          # routed experts (a multiple of the expert-parallel axis)
    top_k: int = 2                        # experts per token
    expert_mlp: int | None = None         # hidden width of one expert; None = the host model's mlp
    score: str = "softmax"                # "softmax" (Mixtral, Switch) or "sigmoid" (DeepSeek-V3) router scores
    renormalize: bool | None = None       # top-k weights scaled to sum to 1; None: when top_k > 1 (top-1 keeps
                                          # the router probability, else the loss never reaches the router)
    shared_experts: int = 0               # experts every token goes through (one SwiGLU this many times wider)
    aux_loss_weight: float = 0.01         # load-balancing loss weight (Switch Transformer)
    z_loss_weight: float = 0.001          # router z-loss weight (ST-MoE)
    capacity_factor: float | None = None  # None = dropless; else slots per (device, expert) = cf * tokens * k / E
    bucket_growth: float = 1.25           # dropless buffer ladder ratio: bounds the exchange padding
    transport: str = "auto"               # "auto" | "all_to_all" | "ragged"
    kernel: str = "auto"                  # experts' grouped matmul: "auto" (Mosaic GPU on Hopper, else XLA) |
                                          # "xla" | "mosaic" (jaxpar.ops.grouped_matmul)

    def __post_init__(self):
        for name in ("experts", "top_k", "shared_experts"):
            value = getattr(self, name)
            least = 0 if name == "shared_experts" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"MoEConfig.{name}={value!r} must be an int >= {least}")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} is larger than experts={self.experts}; a token "
                             f"picks distinct experts, so use top_k <= {self.experts} or more experts")
        if self.expert_mlp is not None and (not isinstance(self.expert_mlp, int) or self.expert_mlp < 1):
            raise ValueError(f"MoEConfig.expert_mlp={self.expert_mlp!r} must be a positive int or None")
        if self.score not in SCORES:
            raise ValueError(f"MoEConfig.score={self.score!r} is not one of {SCORES}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25: slots "
                             f"for 25% more than a balanced load), or None for dropless routing")
        if not self.bucket_growth > 1:
            raise ValueError(f"MoEConfig.bucket_growth={self.bucket_growth} must be > 1 (e.g. 1.25)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"MoEConfig.transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.kernel not in KERNELS:
            raise ValueError(f"MoEConfig.kernel={self.kernel!r} is not one of {KERNELS}: 'auto' picks JAX's Mosaic "
                             f"GPU grouped matmul on a Hopper GPU and jax.lax.ragged_dot elsewhere")
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise ValueError(f"MoEConfig: aux_loss_weight={self.aux_loss_weight} and z_loss_weight="
                             f"{self.z_loss_weight} must be >= 0")


class MoEAuxLoss(nnx.Variable):
    """The weighted auxiliary loss of one MoE layer's last call (read by ``moe_aux_loss``)."""


class MoEMetric(nnx.Variable):
    """A routing statistic of one MoE layer's last call (read by ``moe_metrics``)."""


def route(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Router logits ``[T, E]`` → ``(expert_ids [T, k], weights [T, k], load_balance, z_loss)``.

    ``load_balance = E · Σ_e f_e · p_e`` (``f_e`` the share of assignments to expert ``e``,
    ``p_e`` its mean router probability; 1 when perfectly balanced) and
    ``z_loss = mean(logsumexp(logits)²)``, both over every token given.

    >>> ids, w, lb, z = route(jnp.array([[2.0, 0.0, 1.0]]), MoEConfig(experts=3, top_k=2))
    >>> ids.tolist(), round(float(w.sum()), 6)
    ([[0, 2]], 1.0)
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, -1) if cfg.score == "softmax" else jax.nn.sigmoid(logits)
    weights, ids = jax.lax.top_k(scores, cfg.top_k)
    if cfg.top_k > 1 if cfg.renormalize is None else cfg.renormalize:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    probs = scores if cfg.score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    share = jnp.mean(jax.nn.one_hot(ids, cfg.experts, dtype=jnp.float32).sum(1), 0) / cfg.top_k
    load_balance = cfg.experts * jnp.sum(jax.lax.stop_gradient(share) * jnp.mean(probs, 0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return ids.astype(jnp.int32), weights, load_balance, z_loss


def _no_constraint(x, names):
    return x


def _param(rngs, init, shape, names, dtype):
    init = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)))


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (plus optional shared experts) on ``[..., embed]`` inputs.

    Parameters: ``router [embed, E]``, ``gate`` and ``up [E, embed, mlp]``, ``down [E, mlp, embed]``
    (logical axes ``"expert"``, ``"embed"``, ``"mlp"``), and ``shared_gate/up/down`` when
    ``cfg.shared_experts > 0``.

    >>> moe = MoE(8, 16, MoEConfig(experts=4, top_k=1, shared_experts=1), rngs=nnx.Rngs(0))
    >>> moe(jnp.ones((3, 8))).shape
    (3, 8)
    """

    def __init__(self, embed: int, mlp: int, cfg: MoEConfig, *, rngs: nnx.Rngs, param_dtype: str = "float32",
                 init: Callable = nnx.initializers.normal(0.02)):
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoE(cfg) takes a MoEConfig, got {type(cfg).__name__}; e.g. MoEConfig(experts=8)")
        self.cfg = cfg
        f, e = cfg.expert_mlp or mlp, cfg.experts
        self.router = _param(rngs, init, (embed, e), ("embed", None), param_dtype)   # small: replicated
        self.gate = _param(rngs, init, (e, embed, f), ("expert", "embed", "mlp"), param_dtype)
        self.up = _param(rngs, init, (e, embed, f), ("expert", "embed", "mlp"), param_dtype)
        self.down = _param(rngs, init, (e, f, embed), ("expert", "mlp", "embed"), param_dtype)
        if cfg.shared_experts:
            s = cfg.shared_experts * f
            self.shared_gate = _param(rngs, init, (embed, s), ("embed", "mlp"), param_dtype)
            self.shared_up = _param(rngs, init, (embed, s), ("embed", "mlp"), param_dtype)
            self.shared_down = _param(rngs, init, (s, embed), ("mlp", "embed"), param_dtype)
        self.aux_loss = MoEAuxLoss(jnp.zeros((), jnp.float32))
        self.load_balance = MoEMetric(jnp.zeros((), jnp.float32))
        self.z_loss = MoEMetric(jnp.zeros((), jnp.float32))
        self.dropped = MoEMetric(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array, constrain: Callable = _no_constraint) -> jax.Array:
        _check_width(jnp.shape(x), self.router.shape[0])
        cfg, shape, dtype = self.cfg, x.shape, x.dtype
        axes = _axes(constrain)
        tokens, restore = _token_order(x, axes)
        # router logits accumulated in fp32 even from bf16 activations: near-ties decide the experts
        logits = jnp.dot(tokens, self.router[...].astype(dtype), preferred_element_type=jnp.float32)
        ids, weights, load_balance, z_loss = route(logits, cfg)
        dispatch = ExpertDispatch(expert_axis=axes.get("expert_axis"), batch_axis=axes.get("batch_axis"),
                                  mlp_axis=axes.get("mlp_axis"), capacity_factor=cfg.capacity_factor,
                                  bucket_growth=cfg.bucket_growth, transport=cfg.transport, kernel=cfg.kernel)
        y, stats = moe_dispatch(tokens, ids, weights, self.gate[...], self.up[...], self.down[...], dispatch,
                                mesh=axes.get("mesh"))
        y = restore(y)
        if cfg.shared_experts:
            h = swiglu(x @ self.shared_gate[...].astype(dtype), x @ self.shared_up[...].astype(dtype))
            y = y + h @ self.shared_down[...].astype(dtype)
        self.aux_loss.set_value(cfg.aux_loss_weight * load_balance + cfg.z_loss_weight * z_loss)
        self.load_balance.set_value(load_balance)
        self.z_loss.set_value(z_loss)
        self.dropped.set_value(stats["dropped"].astype(jnp.int32))
        return y


def _check_width(shape: tuple, embed: int) -> None:
    """The activations' last dimension is the layer's embed width (else the router's matmul
    would fail with XLA's shape error, naming neither)."""
    if not shape:
        raise ValueError(f"MoE: x is a scalar (shape ()); pass activations shaped [..., {embed}] (tokens by the "
                         f"layer's embed width {embed})")
    width = shape[-1]
    if width != embed:
        raise ValueError(f"MoE: x has shape {tuple(shape)}: its last dimension ({width}) must be the layer's embed "
                         f"width {embed}; pass activations shaped [..., {embed}], or build the layer for inputs of "
                         f"width {width} (MoE({width}, ...))")


def _axes(constrain) -> dict:
    """The dispatch's mesh axes, from the rules a ``LogicalConstraint`` carries (none without one)."""
    mesh = getattr(constrain, "mesh", None)
    if mesh is None:
        return {}   # no mesh: every expert runs where the tokens are
    rules, sizes = dict(getattr(constrain, "rules", ())), mesh_sizes(mesh)
    axes = {name: logical_axes(name, sizes, rules) or None for name in ("expert", "batch", "mlp")}
    # a sequence split over a context axis ("length" / "seq" rule) splits the tokens too
    seq = tuple(a for name in ("length", "seq") if name in rules for a in logical_axes(name, sizes, rules))
    used = {a for v in axes.values() for a in (v or ())} | set(seq)
    manual = set(manual_axes())
    if manual and (not used or used <= manual):
        return {}   # per-device code over the dispatch's axes: every expert runs where the tokens are
    # inside a shard_map manual over other axes only (the pipeline's, over "pipe") the dispatch runs as
    # usual; axes partly manual are refused by the dispatch (ops._common.inner_shard_map)
    return {"mesh": mesh, "expert_axis": axes["expert"], "batch_axis": axes["batch"], "mlp_axis": axes["mlp"],
            "seq_axis": tuple(dict.fromkeys(a for a in seq if a not in (axes["batch"] or ())))}


def _token_order(x: jax.Array, axes: dict) -> tuple[jax.Array, Callable]:
    """Tokens ``[T, D]`` and the inverse map back to ``x``'s shape.

    Under a context axis the ``[B, L, D]`` activations are split over the batch axes (rows) and
    the sequence axes (columns); plain flattening would interleave the two splits, so the
    tokens are ordered device-major (``(batch shard, sequence shard, row, column)``) and the
    dispatch splits them over both: every device routes only the tokens it holds (a local
    reshape), instead of the whole sequence once per context shard. The layer is token-wise,
    so the order changes nothing else. ``axes["seq_axis"]`` is consumed here."""
    seq = axes.pop("seq_axis", ())
    shape = x.shape
    if not seq or x.ndim != 3:
        return x.reshape(-1, shape[-1]), lambda y: y.reshape(shape)
    sizes = mesh_sizes(axes["mesh"])
    batch = tuple(axes["batch_axis"] or ())
    nb, nc = _product(sizes, batch), _product(sizes, seq)
    (b, length, d) = shape
    if b % nb or length % nc:
        raise ValueError(f"MoE: activations {shape} do not split over the batch axes {batch} (size {nb}) and "
                         f"the sequence axes {seq} (size {nc}); make the batch a multiple of {nb} and the "
                         f"sequence a multiple of {nc}")
    split = (nb, b // nb, nc, length // nc, d)
    tokens = x.reshape(split).transpose(0, 2, 1, 3, 4).reshape(-1, d)
    axes["batch_axis"] = batch + seq
    return tokens, lambda y: y.reshape(nb, nc, b // nb, length // nc, d).transpose(0, 2, 1, 3, 4).reshape(shape)


def _product(sizes: dict, names: tuple) -> int:
    out = 1
    for a in names:
        out *= sizes[a]
    return out


def moe_aux_loss(model: nnx.Module) -> jax.Array:
    """The sum of the weighted auxiliary losses every ``MoE`` layer of ``model`` recorded in its
    last call (0 without MoE layers). Add it to the loss inside the ``loss_fn``, after the
    forward pass.

    >>> float(moe_aux_loss(nnx.Linear(2, 2, rngs=nnx.Rngs(0))))
    0.0
    """
    leaves = jax.tree.leaves(nnx.state(model, MoEAuxLoss))
    return sum((jnp.sum(v) for v in leaves), jnp.zeros((), jnp.float32))


def moe_metrics(model: nnx.Module) -> dict[str, jax.Array]:
    """Mean load-balancing and z-losses over the MoE layers, and the assignments they dropped.

    >>> sorted(moe_metrics(MoE(4, 8, MoEConfig(experts=2, top_k=1), rngs=nnx.Rngs(0))))
    ['moe_dropped', 'moe_load_balance', 'moe_z_loss']
    """
    state = nnx.to_pure_dict(nnx.state(model, MoEMetric))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]

    def pick(name):
        return [v for path, v in flat if jax.tree_util.keystr(path).endswith(f"['{name}']")]

    mean = lambda vs: jnp.mean(jnp.concatenate([jnp.ravel(v) for v in vs])) if vs else jnp.zeros(())  # noqa: E731
    dropped = sum((jnp.sum(v) for v in pick("dropped")), jnp.zeros((), jnp.int32))
    return {"moe_load_balance": mean(pick("load_balance")), "moe_z_loss": mean(pick("z_loss")),
            "moe_dropped": dropped}
