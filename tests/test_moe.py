"""Mixture of experts: the layer against a dense reference at every expert-parallel size, dropless
routing under skew, the all-to-alls in the HLO, bad input, and a MoE Llama trained in parallel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from helpers import assert_close, assert_losses_close, batches
from jaxpar.models.llama import Llama, LlamaConfig, flops_per_token, loss_fn, param_count
from jaxpar.nn import MoE, MoEConfig, moe_aux_loss, moe_metrics, route
from jaxpar.ops import ExpertDispatch, moe_dispatch, ragged_all_to_all_supported

D, F = 8, 8


def zipf_layer(experts: int, top_k: int, seed: int = 0, **kw) -> MoE:
    """A layer whose router prefers expert e with odds ∝ 1 / (e + 1) (Zipf): input feature 0 is a
    constant 1 (see ``tokens``) and router row 0 holds -log(e + 1)."""
    layer = MoE(D, F, MoEConfig(experts=experts, top_k=top_k, **kw), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    router = rng.normal(size=(D, experts)) * 0.3
    router[0] = -np.log(np.arange(1, experts + 1))
    layer.router.set_value(jnp.asarray(router, jnp.float32))
    for name in ("gate", "up", "down"):
        getattr(layer, name).set_value(jnp.asarray(rng.normal(size=getattr(layer, name).shape) / 3, jnp.float32))
    return layer


def tokens(n: int, seed: int = 1) -> jax.Array:
    x = np.random.default_rng(seed).normal(size=(n, D))
    x[:, 0] = 1.0
    return jnp.asarray(x, jnp.float32)


def dense_reference(p: dict, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Every token through every expert, kept only for its top-k (no sorting, no exchange)."""
    logits = x @ p["router"]
    scores = jax.nn.softmax(logits, -1)
    top, ids = jax.lax.top_k(scores, cfg.top_k)
    if cfg.top_k > 1:   # top-1 keeps the router probability (renormalize=None)
        top = top / top.sum(-1, keepdims=True)
    combine = jnp.einsum("tk,tke->te", top, jax.nn.one_hot(ids, cfg.experts))
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, p["gate"])) * jnp.einsum("td,edf->tef", x, p["up"])
    return jnp.einsum("tef,efd,te->td", h, p["down"], combine)


def ep_constraint(n: int):
    mesh = jaxpar.make_mesh({"data": n}, devices=jax.devices()[:n])
    return jaxpar.LogicalConstraint(mesh, {"batch": "data", "expert": "data"})


def value_and_grads(layer, x, fn):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        y = fn(nnx.merge(graphdef, params, jax.tree.map(lambda v: v, rest)), x)   # rest: new in this trace
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), params


@pytest.mark.parametrize("n, top_k", [(1, 1), (2, 2), (4, 1), (8, 2)])
def test_output_and_gradients_equal_dense_reference(n, top_k):
    layer, x = zipf_layer(8, top_k, bucket_growth=2.0), tokens(64)   # a short ladder: fewer branches to compile
    constrain = ep_constraint(n)
    step, params = value_and_grads(layer, x, lambda m, x: m(x, constrain))
    ref_step, _ = value_and_grads(layer, x, lambda m, x: dense_reference(
        {k: m.__getattribute__(k)[...] for k in ("router", "gate", "up", "down")}, x, m.cfg))
    compiled = step.lower(params, x).compile()
    (_, y), grads = compiled(params, x)
    (_, y_ref), ref_grads = ref_step(params, x)
    counts = np.bincount(np.asarray(jax.lax.top_k(x @ params["router"][...], top_k)[1]).ravel(), minlength=8)
    assert counts[0] > 3 * counts[-1]                         # the routing is skewed
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if n == 8:                                                # one compile, read twice
        assert_two_all_to_alls_per_pass(compiled.as_text())


def test_tokens_split_over_a_context_axis_are_routed_once():
    """Under a ``length -> context`` rule each device routes only the tokens of its sequence
    shard: the layer equals the dense reference, and its compiled work is about half of the same
    layer whose tokens are not split over the context axis (each context shard routing all)."""
    mesh = jaxpar.make_mesh({"data": 2, "context": 2, "expert": 2})
    layer, x = zipf_layer(8, 2, bucket_growth=2.0), tokens(64).reshape(4, 16, D)
    rules = {"batch": "data", "expert": "expert"}
    flops = []
    for extra in ({}, {"length": "context"}):
        constrain = jaxpar.LogicalConstraint(mesh, {**rules, **extra})
        step, params = value_and_grads(layer, x, lambda m, x, c=constrain: m(x, c))
        compiled = step.lower(params, x).compile()
        (_, y), _ = compiled(params, x)
        flops.append(compiled.cost_analysis()["flops"])
    ref = dense_reference({k: getattr(layer, k)[...] for k in ("router", "gate", "up", "down")},
                          x.reshape(-1, D), layer.cfg)
    np.testing.assert_allclose(y.reshape(-1, D), ref, rtol=1e-5, atol=1e-5)
    assert flops[1] < 0.7 * flops[0], flops


def computations(hlo: str) -> dict[str, str]:
    """The HLO text split into its computations, by name."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name, out[head.group(1)] = head.group(1), ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def all_to_alls(text: str) -> int:
    return len(re.findall(r"= .*? all-to-all\(", text))


def assert_two_all_to_alls_per_pass(hlo: str) -> None:
    """One conditional picks the dropless buffer size in the forward and one in the backward;
    each of their branches holds exactly two all-to-alls (out to the experts and back), and there
    is no other all-to-all in the program."""
    comps = computations(hlo)
    branches = [re.findall(r"%?([\w.\-]+)", b) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)]
    passes = [b for b in branches if any(all_to_alls(comps[c]) for c in b)]
    assert len(passes) == 2, f"{len(passes)} conditionals with all-to-alls, want forward + backward"
    assert all(all_to_alls(comps[c]) == 2 for b in passes for c in b)
    assert all_to_alls(hlo) == 2 * sum(len(b) for b in passes)


def test_dropless_under_zipf_with_bounded_padding():
    """64 experts, top-8, 8-way expert parallel, Zipf routing: nothing dropped, and the exchange
    buffer that ran is at most 1.25x the static buffer an ideal ragged exchange would need (the
    rows the fullest device receives), read from the all-to-all shapes in the compiled HLO."""
    n, experts, k, t = 8, 64, 8, 1024
    layer, x, mesh = zipf_layer(experts, k), tokens(t), ep_constraint(n).mesh
    ids, weights, _, _ = jax.jit(route, static_argnums=1)(x @ layer.router[...], layer.cfg)
    owner = np.asarray(ids).reshape(n, t // n * k) // (experts // n)   # [source device, assignment] -> peer
    pair = np.stack([np.bincount(row, minlength=n) for row in owner])   # rows source -> peer
    assert pair.sum(0).max() > 2 * pair.sum(0).min()             # skewed: one device receives far more
    dispatch = jax.jit(lambda *a: moe_dispatch(*a, ExpertDispatch(expert_axis="data"), mesh=mesh))   # growth 1.25
    args = (x, ids, weights, layer.gate[...], layer.up[...], layer.down[...])
    compiled = dispatch.lower(*args).compile()
    _, stats = compiled(*args)
    assert int(stats["dropped"]) == 0 and int(stats["needed"]) == pair.max()
    hlo = compiled.as_text()
    sizes = {int(m) for m in re.findall(r"f32\[(\d+),%d\]\{1,0\}\) all-to-all\(" % D, hlo)}
    sizes |= {n * int(m) for m in re.findall(r"\(f32\[(\d+),%d\]\{1,0\}, [^)]*\) all-to-all\(" % D, hlo)}
    ran = n * int(stats["capacity"])                              # rows of the buffer that ran
    assert ran in sizes, (ran, sorted(sizes))
    ideal = pair.sum(0).max()                                     # fullest device's received rows
    ratio = ran / ideal
    print(f"padding: {ran} rows exchanged per device vs {ideal} ideal ragged ({ratio:.3f}x); "
          f"vs the mean load {pair.sum() / n:.0f}: {ran * n / pair.sum():.2f}x")
    assert 1.0 <= ratio <= 1.25


def test_dropping_mode_counts_and_skips_what_overflows():
    """capacity_factor: each (device, expert) keeps its first ceil(cf * tokens * k / E) assignments
    in token order; the rest add nothing and are counted."""
    n, experts, k, t, cf = 4, 8, 2, 64, 1.0
    layer, x, mesh = zipf_layer(experts, k), tokens(t), ep_constraint(n).mesh
    ids, weights, _, _ = route(x @ layer.router[...], layer.cfg)
    p = {name: getattr(layer, name)[...] for name in ("gate", "up", "down")}
    y, stats = jax.jit(lambda *a: moe_dispatch(*a, ExpertDispatch(expert_axis="data", capacity_factor=cf), mesh=mesh))(
        x, ids, weights, p["gate"], p["up"], p["down"])
    slots = int(np.ceil(cf * (t // n) * k / experts))
    flat = np.asarray(ids).reshape(n, -1)                       # per device, assignments in token order
    keep = np.stack([[np.sum(row[:i] == e) < slots for i, e in enumerate(row)] for row in flat]).reshape(t, k)
    kept = jnp.asarray(np.asarray(weights) * keep)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, p["gate"])) * jnp.einsum("td,edf->tef", x, p["up"])
    expected = jnp.einsum("tef,efd,tke,tk->td", h, p["down"], jax.nn.one_hot(ids, experts), kept)
    assert int(stats["dropped"]) == int((~keep).sum()) > 0
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Mixtral-style Llama

MOE_LLAMA = LlamaConfig.named("tiny", heads=8, kv_heads=4, scan_layers=True,
                              moe=MoEConfig(experts=8, top_k=2, bucket_growth=4.0))   # 2 rungs: less to compile
EP = {
    "one device": jaxpar.ParallelConfig(mesh={"data": 1}),
    "EP=8": jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data", "expert": "data"}),
    "EP=4 x model=2": jaxpar.ParallelConfig(mesh={"data": 4, "model": 2}, rules={
        "batch": "data", "expert": "data", "mlp": "model", "heads": "model", "kv_heads": "model", "vocab": "model"}),
}


def train_moe(config, steps=5):
    import optax

    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    constrain = jaxpar.LogicalConstraint(mesh, config.rules)
    model = Llama(MOE_LLAMA, rngs=nnx.Rngs(0), constrain=constrain)     # built here, placed by the Trainer
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)
    losses = [float(trainer.step(b)["loss"]) for b in batches(steps, seq=16)]
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), trainer


@pytest.mark.slow
def test_dropless_stays_exact_when_a_token_names_one_expert_twice():
    """The ladder's top rung holds every row for one peer, so even ids the layer's top-k never
    gives (a token naming one expert twice: 2 experts on 2 devices, 8 rows for one peer) are
    exchanged without a drop and equal the one-device path."""
    mesh = ep_constraint(2).mesh
    layer, x = zipf_layer(2, 2), tokens(8)
    p = [getattr(layer, name)[...] for name in ("gate", "up", "down")]
    dispatch = jax.jit(lambda *a: moe_dispatch(*a, ExpertDispatch(expert_axis="data"), mesh=mesh))
    weights = jnp.full((8, 2), 0.5)
    for ids in (jnp.tile(jnp.array([[0, 1]], jnp.int32), (8, 1)), jnp.zeros((8, 2), jnp.int32)):
        y, stats = dispatch(x, ids, weights, *p)
        local, _ = moe_dispatch(x, ids, weights, *p)
        np.testing.assert_allclose(y, local, rtol=1e-5, atol=1e-5)
        assert int(stats["dropped"]) == 0 and int(stats["capacity"]) >= int(stats["needed"])


def test_moe_llama_trains_like_one_device():
    """5 adamw steps, auxiliary losses in the loss: expert parallel 8 and 4 x tensor parallel 2."""
    ref_losses, ref_params, ref = train_moe(EP["one device"])
    assert ref_losses[-1] < ref_losses[0]
    assert float(moe_aux_loss(ref.model)) > 0
    for name in ("EP=8", "EP=4 x model=2"):
        losses, params, trainer = train_moe(EP[name])
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_close(params, ref_params, rtol=5e-5, what=name)
        spec = trainer.model.blocks.mlp.gate.get_value().sharding.spec
        assert spec[1] == "data" and (name == "EP=8" or spec[3] == "model"), spec    # [layers, expert, embed, mlp]


def test_moe_llama_layers_and_parameters():
    cfg = LlamaConfig.named("tiny", moe={"experts": 4, "top_k": 1, "shared_experts": 1}, moe_every=2)
    model = jaxpar.nn.abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoE"]
    assert model.blocks[1].mlp.shared_gate.shape == (32, 64)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == param_count(cfg)
    dense = LlamaConfig.named("tiny", moe_every=2)              # top-1 of 4 experts + 1 shared = 2 dense MLPs
    router = 32 * 4
    assert flops_per_token(cfg) - flops_per_token(dense) == 6 * (router + 3 * 32 * 64)


def test_checkpoint_saved_at_ep4_restores_at_ep2(tmp_path):
    """Experts (and the rest of the state) saved split 4 ways come back split 2 ways, unchanged."""
    import optax

    import jaxpar.checkpoint

    def trainer(n):
        config = jaxpar.ParallelConfig(mesh={"data": n}, rules={"batch": "data", "expert": "data"})
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
        model = Llama(MOE_LLAMA, rngs=nnx.Rngs(n), constrain=jaxpar.LogicalConstraint(mesh, config.rules))
        return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)

    ep4, ep2 = trainer(4), trainer(2)                 # different seeds: the restore must overwrite
    jaxpar.checkpoint.save(ep4, tmp_path / "ckpt")
    jaxpar.checkpoint.restore(ep2, tmp_path / "ckpt")
    saved, restored = (nnx.to_pure_dict(nnx.state(t.model, nnx.Param)) for t in (ep4, ep2))
    assert_close(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, saved), rtol=0, what="params")
    gate = ep2.model.blocks.mlp.gate.get_value()
    assert gate.sharding.spec[1] == "data" and gate.sharding.shard_shape(gate.shape)[1] == 4   # 8 experts / 2


class RoutedLayer(nnx.Module):
    """One dropping MoE layer (Zipf router, 4 experts, top-2, capacity factor 0.5): a model for the Trainer."""

    def __init__(self):
        self.moe = zipf_layer(4, 2, capacity_factor=0.5)

    def __call__(self, x):
        return self.moe(x)


def routed_loss(model, batch):
    return jnp.mean(model(batch["x"]) ** 2) + moe_aux_loss(model)


def test_step_metrics_and_metrics_jsonl_carry_the_routing(tmp_path):
    """An MoE model's step returns its routing, computed in the step: with grad_accum=2 the mean
    over the two micro-batches (moe_metrics(trainer.model) keeps only the last one's) and the
    dropped assignments of both; fit writes them to its history and metrics.jsonl."""
    import optax

    from jaxpar.metrics import MetricsConfig, read_jsonl

    x = np.stack([np.asarray(tokens(16, seed)) for seed in range(8)])          # [8, 16, D]
    layer = RoutedLayer().moe
    expected = []
    for part in (x[0::2], x[1::2]):                                            # the micro-batches (split_rows)
        ids, _, balance, z = route(jnp.asarray(part.reshape(-1, D)) @ layer.router[...], layer.cfg)
        slots = int(np.ceil(0.5 * ids.size / 4))                               # ceil(cf * tokens * k / E)
        dropped = np.maximum(np.bincount(np.asarray(ids).ravel(), minlength=4) - slots, 0).sum()
        expected.append((float(balance), float(z), int(dropped)))
    (balance, z, _), dropped = np.mean(expected, 0), sum(e[2] for e in expected)
    assert dropped > 0 and expected[0][0] != pytest.approx(expected[1][0], rel=1e-3)
    config = jaxpar.ParallelConfig(mesh={"data": 1}, grad_accum=2)
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    with jaxpar.Trainer(RoutedLayer(), optax.sgd(0.0), routed_loss, config, mesh,
                        metrics=MetricsConfig(dir=str(tmp_path))) as trainer:
        step = trainer.step({"x": x})
        assert int(step["moe_dropped"]) == dropped
        assert float(step["moe_load_balance"]) == pytest.approx(balance, rel=1e-5)
        assert float(step["moe_z_loss"]) == pytest.approx(z, rel=1e-5)
        assert float(moe_metrics(trainer.model)["moe_load_balance"]) == pytest.approx(expected[1][0], rel=1e-5)
        history = trainer.fit(iter([{"x": x}] * 2), steps=2, log_every=1, progress=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]     # the loop over step logs its first step too
    for record, row in zip(records[1:], history):      # lr 0: every step routes as the first did
        assert record["moe_dropped"] == row["moe_dropped"] == dropped
        assert record["moe_load_balance"] == pytest.approx(balance, rel=1e-5)
        assert record["moe_z_loss"] == pytest.approx(z, rel=1e-5)


def test_dropped_assignments_stay_an_exact_integer_from_the_step_to_tensorboard(tmp_path, monkeypatch):
    """moe_dropped is an int32 sum over the grad_accum x interleave parts, not a float32 mean:
    each of the 4 parts here reports 2**26 + 1 more dropped assignments than it routed (more
    than a float32 holds exactly), and the step, the history, metrics.jsonl (summed over the
    steps since the last log) and TensorBoard (an int64 scalar) all keep every digit."""
    import optax
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    import jaxpar.train.step as step_module
    from jaxpar.metrics import MetricsConfig, read_jsonl

    big = 2 ** 26 + 1
    x = np.stack([np.asarray(tokens(16, seed)) for seed in range(8)])
    config = jaxpar.ParallelConfig(mesh={"data": 1}, grad_accum=2, interleave=2)
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
    routed = int(jaxpar.Trainer(RoutedLayer(), optax.sgd(0.0), routed_loss, config, mesh).step({"x": x})["moe_dropped"])
    assert routed > 0
    monkeypatch.setattr(step_module, "moe_metrics",
                        lambda model: (m := moe_metrics(model)) | {"moe_dropped": m["moe_dropped"] + big})
    with jaxpar.Trainer(RoutedLayer(), optax.sgd(0.0), routed_loss, config, mesh,
                        metrics=MetricsConfig(dir=str(tmp_path), tensorboard=True)) as trainer:
        step = trainer.step({"x": x})                                       # lr 0: every step routes alike
        assert step["moe_dropped"].dtype == jnp.int32 and int(step["moe_dropped"]) == 4 * big + routed
        history = trainer.fit(iter([{"x": x}] * 4), steps=4, log_every=2, progress=False)
    assert [r["moe_dropped"] for r in history] == [4 * big + routed] * 4
    assert all(type(r["moe_dropped"]) is int for r in history)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    dropped = 4 * big + routed
    # the step before fit logs its first step too; fit logs its first (2), then every 2: 3, 5
    assert [(r["step"], r["moe_dropped"]) for r in records] == [(1, dropped), (2, dropped), (3, dropped),
                                                                (5, 2 * dropped)]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors("moe/dropped")] == \
        [(1, dropped), (2, dropped), (3, dropped), (5, 2 * dropped)]


class DroplessLayer(nnx.Module):
    """One dropless MoE layer holding the constraint a model built for ``config`` holds."""

    def __init__(self, constrain=None):
        self.moe, self.constrain = zipf_layer(4, 2), constrain

    def __call__(self, x):
        return self.moe(x) if self.constrain is None else self.moe(x, self.constrain)


def test_model_constraint_routes_the_tokens_each_device_holds():
    """The default ParallelConfig (semi_auto) and mode="data" have no "batch" rule: the
    constraint of jaxpar.nn.model_constraint says where the step puts the batch. With
    LogicalConstraint(mesh, config.rules) the layer routed the global batch as one set, and
    each of 8 devices ran the whole batch's experts (compiled temp as on one device); with
    model_constraint each routes its own tokens, and the step equals one device's."""
    import optax

    from jaxpar.nn import model_constraint
    from jaxpar.report import memory

    batch = {"x": np.stack([np.asarray(tokens(16, seed)) for seed in range(8)])}      # [8, 16, D]
    runs = {}
    for n, mode in ((1, "semi_auto"), (8, "semi_auto"), (8, "data")):
        config = jaxpar.ParallelConfig(mesh={"data": n}, mode=mode)
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
        trainer = jaxpar.Trainer(DroplessLayer(model_constraint(mesh, config)), optax.adam(1e-2), routed_loss,
                                 config, mesh)
        temp = memory(trainer.lower(batch).compile()).temp_bytes
        runs[n, mode] = temp, [float(trainer.step(batch)["loss"]) for _ in range(2)]
    for key in ((8, "semi_auto"), (8, "data")):
        assert_losses_close(runs[key][1], runs[1, "semi_auto"][1], rtol=1e-5)
        assert runs[key][0] * 4 < runs[1, "semi_auto"][0], runs


# ----------------------------------------------------------------------------- bad input

def test_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match=r"top_k=9 is larger than experts=8.*top_k <= 8"):
        MoEConfig(experts=8, top_k=9)
    for cf in (0, -1.0):
        with pytest.raises(ValueError, match=rf"capacity_factor={cf} must be > 0.*None for dropless"):
            MoEConfig(experts=8, capacity_factor=cf)
    with pytest.raises(ValueError, match=r"moe_every=2 with scan_layers=True.*moe_every=1"):
        LlamaConfig.named("tiny", scan_layers=True, moe={"experts": 4}, moe_every=2)
    layer = MoE(D, F, MoEConfig(experts=12, top_k=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MoE: x has shape \(3, 5\): its last dimension \(5\) must be the layer's "
                                         r"embed width 8; pass activations shaped \[\.\.\., 8\].*MoE\(5, \.\.\.\)"):
        layer(jnp.ones((3, 5)))                                # not XLA's dot_general shape error
    with pytest.raises(ValueError, match=r"MoE: x is a scalar \(shape \(\)\); pass activations shaped \[\.\.\., 8\]"):
        layer(jnp.ones(()))
    with pytest.raises(ValueError, match=r"12 experts are not divisible by 8, the size of expert_axis \('data',\).*"
                                         r"multiple of 8"):
        nnx.eval_shape(lambda m, x: m(x, ep_constraint(8)), layer, tokens(64))   # refused while tracing
    assert not ragged_all_to_all_supported("cpu")      # XLA:CPU: the padded all-to-all is used
    with pytest.raises(ValueError, match=r"transport='ragged' but the cpu backend cannot compile"):
        moe_dispatch(tokens(8), jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1)), *(layer.gate[...], layer.up[...],
                     layer.down[...]), ExpertDispatch(transport="ragged", expert_axis="data"), mesh=ep_constraint(2).mesh)


def test_the_former_keywords_warn_and_give_the_same_values():
    """0.1.0's ``moe_dispatch(..., expert_axis=, capacity_factor=, ...)`` still runs, warning with
    the ``ExpertDispatch`` spelling; a bad former keyword names both spellings."""
    mesh = ep_constraint(2).mesh
    layer, x = zipf_layer(4, 2), tokens(8)
    p = [getattr(layer, name)[...] for name in ("gate", "up", "down")]
    ids, weights = jnp.tile(jnp.array([[0, 3]], jnp.int32), (8, 1)), jnp.full((8, 2), 0.5)
    want = moe_dispatch(x, ids, weights, *p, ExpertDispatch(expert_axis="data", capacity_factor=2.0), mesh=mesh)
    with pytest.warns(DeprecationWarning, match=r"jaxpar.ops.ExpertDispatch\(expert_axis=..., capacity_factor"):
        got = moe_dispatch(x, ids, weights, *p, expert_axis="data", capacity_factor=2.0, mesh=mesh)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert int(got[1]["capacity"]) == int(want[1]["capacity"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'expert_axes'.*ExpertDispatch"):
        moe_dispatch(x, ids, weights, *p, expert_axes="data", capacity_factor=2.0)
    with pytest.raises(TypeError, match="dispatch must be a jaxpar.ops.ExpertDispatch, got str"):
        moe_dispatch(x, ids, weights, *p, "data")
