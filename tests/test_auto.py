"""Strategy search without compiling: graph classes, the three searches, propagation, strategies."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import COSTS, TINY, no_unclosed_files
from jaxpar.auto import Strategy, build_graph, hand_strategy, search
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

MESH = {"data": 2, "model": 4}
# a slow-ish machine so that compute matters for the tiny GPT (the defaults are GPU-like)
BATCH = {"inputs": np.zeros((16, TINY.seq_len), np.int32), "targets": np.zeros((16, TINY.seq_len), np.int32)}
BOTH = ("data", "model")
HANDS = {   # the hand strategies, on the same 2 x 4 mesh (a tuple of axes = their product)
    "data=8": jaxpar.ParallelConfig(mesh=MESH, rules={"batch": BOTH}),
    "data=2,model=4": jaxpar.ParallelConfig(mesh=MESH, rules={"batch": "data", "heads": "model", "mlp": "model",
                                                              "vocab": "model"}),
    "model=8": jaxpar.ParallelConfig(mesh=MESH, rules={"batch": None, "heads": BOTH, "mlp": BOTH, "vocab": BOTH}),
}
FIRST_MATMULS = {"blocks/*/attn/wq": (None, "model", None), "blocks/*/mlp/up": (None, "model")}


@pytest.fixture(scope="module")
def model():
    return GPT(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def graph(model):
    return build_graph(model, loss_fn, BATCH)


def classes(plan):
    return {name: axes for name, _, axes in plan.classes}


def test_graph_finds_the_logical_axes(graph):
    specs = dict(graph.params)
    cls = lambda path, d: graph.tensors[specs[path]].classes[d]  # noqa: E731
    assert cls("blocks/0/attn/wq", 1) == cls("blocks/0/attn/wo", 0) == cls("blocks/0/attn/wk", 1)   # heads
    assert cls("blocks/0/mlp/up", 1) == cls("blocks/0/mlp/down", 0) == cls("blocks/0/mlp/up_bias", 0)
    assert cls("blocks/0/mlp/up", 1) != cls("blocks/1/mlp/up", 1)        # each layer its own MLP width
    assert cls("blocks/0/mlp/up", 0) == cls("head", 0) == cls("wte", 1)  # the residual width
    seq = graph.tensors[dict(graph.batch)["['inputs']"]].classes[1]
    assert seq in graph.unsplittable                                      # attention scores: seq x seq


class Experts(nnx.Module):
    """Grouped matmuls as an MoE layer runs them: rows [m, k] x expert weights [g, k, n]."""

    def __init__(self, g=4, k=8, n=8):
        self.w = nnx.Param(jnp.ones((g, k, n)))


def test_ragged_dot_ties_rows_widths_and_experts_and_counts_its_products():
    """jax.lax.ragged_dot [m, k] x [g, k, n] -> [m, n]: rows to rows, k to the weights' k, n to
    n, the experts to group_sizes, and k kept apart from n (equal widths here: read as
    elementwise, the product tied them). FLOPs 2·m·k·n, not g times that; the ragged-k form
    (the weights' gradient, [m, k] x [m, n] -> [g, k, n]) too."""
    from jax.lax import RaggedDotDimensionNumbers

    from jaxpar.auto.cost import analyse, op_terms

    m, g, k, n = 32, 4, 8, 8
    ragged_k = RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=())

    def loss(model, batch):
        y = jax.lax.ragged_dot(batch["x"], model.w[...], batch["sizes"])
        dw = jax.lax.ragged_dot_general(batch["x"], y, batch["sizes"], ragged_k)
        return y.sum() + dw.sum()

    batch = {"x": jnp.ones((m, k)), "sizes": jnp.full((g,), m // g, jnp.int32)}
    graph = build_graph(Experts(g, k, n), loss, batch)
    dot, grad = [op for op in graph.ops if op.prim == "ragged_dot_general"]
    x, w, sizes, y = (graph.tensors[t].classes for t in (*dot.ins, *dot.outs))
    assert x[0] == y[0] and w[2] == y[1] and x[1] == w[1] and w[0] == sizes[0]
    assert x[1] != y[1] and len({x[0], x[1], y[1], w[0]}) == 4
    assert graph.tensors[grad.outs[0]].classes == (w[0], x[1], y[1])      # [g, k, n]: the weights' classes

    flags, free = analyse(graph), [()] * graph.num_classes
    assert [op_terms(graph, op, free, {}, flags)[0] for op in (dot, grad)] == [3 * 2 * m * k * n] * 2
    # experts split, rows whole: each device runs a quarter of the rows, its partial output is summed
    split = [("model",) if c == w[0] else () for c in range(graph.num_classes)]
    flops, comms, _, invalid = op_terms(graph, dot, split, {"model": 4}, flags)
    assert flops == 3 * 2 * m * k * n / 4 and not invalid
    assert comms[0].kind == "all-reduce" and comms[0].axes == ("model",) and comms[0].nbytes == m * n * 4


@pytest.mark.parametrize("algorithm", ["dynamic_programming", "recursive_programming", "sharding_propagation"])
def test_search_no_worse_than_hand_strategies(model, graph, algorithm):
    # propagation keeps its annotations: here only the batch's split is given (annotating the
    # Megatron matmuls gives exactly Megatron, see below, which data=8 beats on this tiny model)
    batch = P(BOTH) if algorithm == "sharding_propagation" else None
    cfg = jaxpar.ParallelConfig(mesh=MESH, mode="auto", search=algorithm, dataset_strategy=batch)
    plan = search(model, loss_fn, BATCH, cfg, MESH, cost_params=COSTS, graph=graph)
    hands = {k: hand_strategy(model, loss_fn, BATCH, c, MESH, cost_params=COSTS, graph=graph).cost["time_s"]
             for k, c in HANDS.items()}
    assert plan.cost["time_s"] <= min(hands.values()) * (1 + 1e-9), (plan.cost["time_s"], hands)


def test_dynamic_programming_is_the_optimum_of_the_model(model, graph):
    """Exhaustive check on a small mesh: no assignment beats the DP's."""
    import itertools

    from jaxpar.auto.assign import domains
    from jaxpar.auto.search import Problem, dynamic_programming

    mesh = {"data": 2, "model": 2}
    problem = Problem.make(graph, mesh, COSTS)
    best = problem.total(dynamic_programming(problem))
    doms = domains(graph, mesh)
    free = [c for c, d in enumerate(doms) if len(d) > 1]
    rng = np.random.default_rng(0)
    for _ in range(300):   # random assignments (the full space is 4^12)
        axes = [d[0] for d in doms]
        for c in free:
            axes[c] = doms[c][rng.integers(len(doms[c]))]
        assert problem.total(axes) >= best - 1e-12
    for combo in itertools.product(*(doms[c] for c in free[:4])):   # and one exhaustive corner
        axes = [d[0] for d in doms]
        for c, a in zip(free, combo):
            axes[c] = a
        assert problem.total(axes) >= best - 1e-12


def test_propagation_from_first_matmuls_recovers_megatron(model, graph):
    cfg = jaxpar.ParallelConfig(mesh=MESH, mode="auto", search="sharding_propagation", parameter_strategy=FIRST_MATMULS)
    plan = search(model, loss_fn, BATCH, cfg, MESH, cost_params=COSTS, graph=graph)
    megatron = hand_strategy(model, loss_fn, BATCH, HANDS["data=2,model=4"], MESH, cost_params=COSTS, graph=graph)
    # every block and the head as Megatron splits them; the embedding table stays whole: a lookup
    # reads one row per token, so splitting the table over vocab saves memory alone and costs an
    # all-reduce of the embeddings (a gather is priced by its bytes, not as a one-hot matmul)
    assert {k: v for k, v in plan.param_specs.items() if k != "wte"} == \
        {k: v for k, v in megatron.param_specs.items() if k != "wte"}
    assert plan.param_specs["blocks/1/attn/wo"] == P("model")
    assert plan.param_specs["blocks/0/mlp/down"] == P("model")
    assert plan.param_specs["wte"] == P() and plan.param_specs["head"] == P(None, "model")
    assert dict(plan.batch)["['inputs']"] == P("data")


def test_conflicting_annotations_are_resolved_and_reported(model, graph):
    cfg = jaxpar.ParallelConfig(mesh=MESH, mode="auto", search="sharding_propagation",
                                parameter_strategy={"blocks/0/mlp/up": (None, "model"), "blocks/0/mlp/down": ("data", None)})
    plan = search(model, loss_fn, BATCH, cfg, MESH, cost_params=COSTS, graph=graph)
    notes = [n for n in plan.notes if n.startswith("conflict")]
    assert len(notes) == 1 and "blocks/0/mlp/up" in notes[0] and "blocks/0/mlp/down" in notes[0]
    assert plan.param_specs["blocks/0/mlp/up"][1] == plan.param_specs["blocks/0/mlp/down"][0]


def test_strategy_is_a_value_saved_and_loaded(model, graph, tmp_path):
    cfg = jaxpar.ParallelConfig(mesh=MESH, mode="auto", search="dynamic_programming")
    a = search(model, loss_fn, BATCH, cfg, MESH, cost_params=COSTS, graph=graph)
    b = search(model, loss_fn, BATCH, cfg, MESH, cost_params=COSTS, graph=graph)
    assert a.param_specs == b.param_specs and a.classes == b.classes     # pure function
    a.to_json(tmp_path / "strategy.json")
    loaded = Strategy.from_json(tmp_path / "strategy.json")
    assert loaded == a and loaded.param_specs == a.param_specs and loaded.batch == a.batch
    saved = json.loads((tmp_path / "strategy.json").read_text())
    assert saved["format"] == "jaxpar.strategy/1"
    # a file saved while the class was jaxpar.auto.Plan holds the same fields under the old tag
    (tmp_path / "plan.json").write_text(json.dumps(dict(saved, format="jaxpar.plan/1")))
    assert Strategy.from_json(tmp_path / "plan.json") == a
    (tmp_path / "other.json").write_text(json.dumps(dict(saved, format="jaxpar.layout/1")))
    with pytest.raises(ValueError, match="'jaxpar.layout/1'.*expected 'jaxpar.strategy/1', or 'jaxpar.plan/1'"):
        Strategy.from_json(tmp_path / "other.json")
    with no_unclosed_files():
        text = a.table()
    assert "blocks/0/mlp/up" in text and "predicted per device" in text
    semi = loaded.to_config(cfg)
    assert semi.mode == "semi_auto" and set(semi.parameter_strategy) == {p for p, *_ in a.params}
    # a saved strategy starts a semi_auto run: its layouts are what the Trainer's TrainPlan gives
    from jaxpar.auto.assign import config_specs

    specs = config_specs(graph, semi, MESH)
    assert all(specs[p] == s for p, s in a.param_specs.items())


def test_recursive_on_a_large_simulated_mesh_is_fast(model):
    import time

    big = GPTConfig(vocab_size=64, seq_len=16, embed=256, heads=16, mlp=1024, layers=4)
    m = nnx.eval_shape(lambda: GPT(big, rngs=nnx.Rngs(0)))
    batch = {"inputs": np.zeros((512, 16), np.int32), "targets": np.zeros((512, 16), np.int32)}
    mesh = {f"l{i}": 2 for i in range(7)}          # 128 devices as seven halvings
    cfg = jaxpar.ParallelConfig(mesh=mesh, mode="auto", search="recursive_programming")
    t0 = time.perf_counter()
    plan = search(m, loss_fn, batch, cfg, mesh)
    assert time.perf_counter() - t0 < 10
    assert plan.cost["invalid"] == 0 and np.isfinite(plan.cost["time_s"])
    used = {a for _, _, axes in plan.classes for a in axes}
    assert used, "a 128-device plan splits something"


def test_calibrate_measures_flops_and_each_axis():
    """`calibrate` on the 8 simulated devices: positive FLOP/s, a bandwidth and latency per
    mesh axis of size > 1, and a CostParams the searches accept."""
    import math

    from jaxpar.auto import calibrate

    mesh = jaxpar.make_mesh(jaxpar.ParallelConfig(mesh={"data": 2, "model": 4, "one": 1}))
    params = calibrate(mesh, sizes_bytes=(1 << 10, 1 << 20), repeats=2)
    assert params.flops_per_s > 1e6 and math.isfinite(params.flops_per_s)
    assert set(params.bandwidth) == {"data", "model"} and set(params.latency_per_axis) == {"data", "model"}
    assert all(0 < b < math.inf for b in params.bandwidth.values())
    assert all(0 <= t < 1 for t in params.latency_per_axis.values())
    small = params.collective_time("all-reduce", ("model",), 1 << 10, {"model": 4})
    big = params.collective_time("all-reduce", ("model",), 1 << 20, {"model": 4})
    assert big > small > 0
    plan = search(GPT(TINY, rngs=nnx.Rngs(0)), loss_fn, BATCH, jaxpar.ParallelConfig(mesh=MESH, mode="auto"),
                  MESH, cost_params=params)
    assert plan.cost["time_s"] > 0
