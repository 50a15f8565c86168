"""The strategy search reads loops and branches: scanned layers cost what unrolled ones do."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import COSTS, MEGATRON, TINY, assert_losses_close, batches, mesh_for, reference, train_gpt
from jaxpar.auto import build_graph, hand_strategy, search
from jaxpar.auto.cost import evaluate
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.report import collectives

SCANNED = dataclasses.replace(TINY, scan_layers=True)
BATCH = batches(1)[0]
STRATEGIES = {
    "data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"),
    "megatron": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON),
}


@pytest.fixture(scope="module")
def scanned():
    return build_graph(GPT(SCANNED, rngs=nnx.Rngs(0)), loss_fn, BATCH)


@pytest.fixture(scope="module")
def unrolled():
    return build_graph(GPT(TINY, rngs=nnx.Rngs(0)), loss_fn, BATCH)


def test_scanned_gpt_builds_with_the_body_repeated(scanned, unrolled):
    dots = [op for op in scanned.ops if op.prim == "dot_general"]
    in_body = [op for op in dots if op.repeat != 1]
    # 4 attention projections, 2 attention products, 2 MLP matmuls per layer; the head outside
    assert len(in_body) == 8 and all(op.repeat == SCANNED.layers for op in in_body)
    assert [op.repeat for op in dots if op.repeat == 1] == [1]
    assert sum(op.prim == "dot_general" for op in unrolled.ops) == 8 * TINY.layers + 1
    assert {op.repeat for op in scanned.ops} <= {0, 1, SCANNED.layers}
    assert scanned.notes == ()
    # every stacked parameter's leading dim is one class, the layers, kept whole
    stacked = [scanned.param_tensor(p) for p, _ in scanned.params if p.startswith("blocks/")]
    layers = {t.classes[0] for t in stacked}
    assert len(stacked) == 12 and len(layers) == 1 and layers <= scanned.unsplittable
    assert scanned.class_sizes[layers.pop()] == SCANNED.layers
    # a slice of a stacked parameter carries its other dims' classes (one "heads", one "mlp")
    wq, up = scanned.param_tensor("blocks/attn/wq"), scanned.param_tensor("blocks/mlp/up")
    assert wq.classes[1] == up.classes[1]        # both read the residual width
    assert wq.classes[2] != up.classes[2]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_scanned_and_unrolled_cost_the_same(scanned, unrolled, name):
    config = STRATEGIES[name]
    hs = hand_strategy(None, loss_fn, BATCH, config, config.mesh, graph=scanned)
    hu = hand_strategy(None, loss_fn, BATCH, config, config.mesh, graph=unrolled)
    s, u = hs.cost, hu.cost
    assert abs(s["compute_s"] - u["compute_s"]) <= 1e-6 * u["compute_s"]
    # the matmuls alone: the same FLOPs (a layer's operator counted `layers` times)
    matmul = lambda plan: sum(f for op, _, f, _ in plan.operators if op.startswith("dot_general"))  # noqa: E731
    assert abs(matmul(hs) - matmul(hu)) <= 1e-9 * matmul(hu)
    # the optimizer's gradient norm costs one 4-byte all-reduce per *split* parameter: the
    # scanned model has one stacked parameter where the unrolled one has `layers`
    split = lambda plan: sum(1 for _, _, spec, _ in plan.params if tuple(spec))  # noqa: E731
    assert u["comm_bytes"] - s["comm_bytes"] == 4 * (split(hu) - split(hs))
    assert s["comm_by_axes"].keys() == u["comm_by_axes"].keys()
    assert s["argument_bytes"] == u["argument_bytes"]
    # (temp bytes are not compared: the liveness of a loop's buffers differs from straight-line code)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_scanned_bytes_match_the_compiled_step(scanned, name):
    config = STRATEGIES[name]
    mesh = mesh_for(config)
    plan = hand_strategy(None, loss_fn, BATCH, config, mesh, graph=scanned)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(SCANNED, rngs=nnx.Rngs(0)), config, mesh),
                             optax.adamw(1e-3), loss_fn, config, mesh)
    cols = collectives(trainer.lower(BATCH).compile(), mesh)
    assert any(c.in_loop for c in cols)
    # a collective in the scan's while loop runs once per layer: count its executions
    hlo_bytes = sum(c.bytes * c.executions for c in cols)
    assert abs(plan.cost["comm_bytes"] - hlo_bytes) <= 0.10 * hlo_bytes, (plan.cost["comm_bytes"], hlo_bytes)


@pytest.mark.parametrize("algorithm", ["dynamic_programming", "sharding_propagation"])
def test_search_on_the_scanned_model_trains_like_one_device(scanned, algorithm):
    sizes = {"data": 2, "model": 4}
    # sharding propagation from Megatron-like annotations: stacked parameters split on heads / mlp
    annotate = {"blocks/attn/wq": (None, None, "model", None), "blocks/mlp/up": (None, None, "model")} \
        if algorithm == "sharding_propagation" else {}
    config = jaxpar.ParallelConfig(mesh=sizes, mode="auto", search=algorithm, parameter_strategy=annotate)
    plan = search(None, loss_fn, BATCH, config, sizes, cost_params=COSTS, graph=scanned)
    stacked = {path: tuple(spec) for path, _, spec, _ in plan.params if path.startswith("blocks/")}
    assert all(spec[:1] in ((), (None,)) for spec in stacked.values()), stacked     # the layers stay whole
    if annotate:
        assert stacked["blocks/attn/wq"] == (None, None, "model") and stacked["blocks/mlp/down"][:2] == (None, "model")
    ref_losses, _ = reference(SCANNED, 3)
    losses, _, _ = train_gpt(plan.to_config(config), gpt=SCANNED, steps=3)
    assert_losses_close(losses, ref_losses)


# --------------------------------------------------------------------------- small loops

class Net(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(8, 8, rngs=nnx.Rngs(0))


X = {"x": jnp.ones((16, 8))}


def _dots(graph):
    return [op for op in graph.ops if op.prim == "dot_general"]


def test_cond_inlines_every_branch():
    def loss(model, batch):
        x = batch["x"]
        y = jax.lax.cond(x.sum() > 0, lambda h: jnp.tanh(model.lin(h)), lambda h: model.lin(h) * 2, x)
        return (y ** 2).mean()

    g = build_graph(Net(), loss, X)
    assert len(_dots(g)) == 2 and g.notes == ()
    merge = [op for op in g.ops if op.get("cond") == "merge"]
    assert len(merge) == 1 and len(merge[0].ins) == 2
    out = g.tensors[merge[0].outs[0]]
    assert out.classes == g.tensors[_dots(g)[0].outs[0]].classes == g.tensors[_dots(g)[1].outs[0]].classes
    cost = evaluate(g, [("data",) if c == out.classes[0] else () for c in range(g.num_classes)], {"data": 8})
    assert cost.comm_bytes > 0 and not cost.invalid     # the kernel's gradient is all-reduced


def test_while_loop_is_costed_once_with_a_note():
    def loss(model, batch):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(model.lin(h))
        _, h = jax.lax.while_loop(lambda c: c[0] < batch["n"], body, (0, batch["x"]))
        return h.mean()

    g = build_graph(Net(), loss, {**X, "n": jnp.int32(3)})
    assert len(_dots(g)) == 1 and _dots(g)[0].repeat == 1
    assert len(g.notes) == 1 and "while_loop" in g.notes[0] and "trip count unknown" in g.notes[0]
    # the carry keeps its classes through the loop: the batch class reaches the loss
    x = g.tensors[dict(g.batch)["['x']"]]
    assert x.classes[0] in g.tensors[_dots(g)[0].outs[0]].classes


def test_nested_scans_multiply_and_ys_are_stacked():
    def loss(model, batch):
        def outer(h, _):
            h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(model.lin(h)), None), h, None, length=4)
            return h, h.sum(-1)
        h, ys = jax.lax.scan(outer, batch["x"], None, length=3)
        return h.mean() + ys.mean()

    g = build_graph(Net(), loss, X)
    (dot,) = _dots(g)
    assert dot.repeat == 12
    (stack,) = [op for op in g.ops if op.get("scan") == "ys"]
    ys, y = g.tensors[stack.outs[0]], g.tensors[stack.ins[0]]
    assert ys.shape == (3, 16) and ys.classes[1:] == y.classes and ys.classes[0] in g.unsplittable
    assert y.classes[0] == g.tensors[dict(g.batch)["['x']"]].classes[0] not in g.unsplittable


def test_other_sub_programs_are_refused():
    mesh = jax.make_mesh((8,), ("d",))

    def loss(model, batch):
        f = jax.shard_map(lambda h: model.lin(h), mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
        return f(batch["x"]).mean()

    with pytest.raises(NotImplementedError, match="shard_map"):
        build_graph(Net(), loss, X)
