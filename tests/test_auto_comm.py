"""Gradient communication in the cost model: combined as XLA combines it, checked on compiled HLO."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from helpers import COSTS, MEGATRON, TINY, batches, mesh_for
from jaxpar.auto import CostParams, build_graph, evaluate, hand_strategy, search
from jaxpar.auto.comm import GRAD, NORM, TAIL, Comm, buckets, combined_time, comm_share
from jaxpar.auto.cost import analyse
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.report import collectives

# 24 rows: no activation's per-device shape equals a parameter's (the test tells gradient
# collectives from the others by their buffers' shapes)
BATCH = batches(1, batch=24)[0]
LAYOUTS = {
    "data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"),
    "Megatron": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON),
    "2D (embed on model)": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4},
                                                 rules={"batch": "data", "embed": "model"}),
}
SLOW = {"2D (embed on model)"}      # ~20 s to compile
SIZES = {"data": 8}


# --------------------------------------------------------------------------- pure pricing

def test_gradients_pay_one_latency_per_group_and_bucket():
    params = CostParams(latency=1e-3, default_bandwidth=1e12, combine_threshold_bytes=math.inf)
    grads = [Comm("all-reduce", ("data",), 1024.0, GRAD, 1, t) for t in range(10)]
    one = combined_time(grads, SIZES, params)
    assert one.count == one.grad_count == 1 and one.grad_bytes == 10 * 1024
    assert one.seconds == pytest.approx(1e-3 + 10 * 2 * 7 / 8 * 1024 / 1e12)
    # a byte threshold splits the group into buckets, and so does the count limit
    assert combined_time(grads, SIZES, CostParams(combine_threshold_bytes=3000)).count == 4
    assert combined_time(grads, SIZES, CostParams(combine_threshold_count=4)).count == 3
    # other mesh axes, other groups; the loss's own all-reduce rides with the gradients;
    # the norm's partial sums (they read the reduced gradients) are a group of their own
    mixed = grads + [Comm("all-reduce", ("model",), 64.0, GRAD), Comm("all-reduce", ("data",), 4.0, TAIL),
                     Comm("all-reduce", ("data",), 4.0, NORM)]
    priced = combined_time(mixed, {"data": 8, "model": 2}, params)
    assert priced.count == priced.grad_count == 3 and priced.grad_bytes == 10 * 1024 + 72
    # in a loop the combiner works per iteration: one group per iteration
    looped = combined_time([Comm("all-reduce", ("data",), 3 * 512.0, GRAD, 3, t) for t in range(4)], SIZES, params)
    assert looped.count == 3


def test_serial_collectives_combine_only_at_one_level():
    params = CostParams(latency=1e-3)
    chain = [Comm("all-reduce", ("data",), 64.0, tensor=t, level=t) for t in range(3)]
    siblings = [Comm("all-reduce", ("data",), 64.0, tensor=t, level=0) for t in range(3)]
    alone = [Comm("all-reduce", ("data",), 64.0) for _ in range(3)]     # no level: each its own
    assert combined_time(chain, SIZES, params).count == 3
    assert combined_time(siblings, SIZES, params).count == 1
    assert combined_time(alone, SIZES, params).count == 3
    assert combined_time(siblings, SIZES, params).grad_count == 0


def test_search_share_and_buckets():
    params = CostParams(latency=1e-3, combine_threshold_bytes=1e6, combine_threshold_count=256)
    c = Comm("all-reduce", ("data",), 1e5, GRAD)
    own = Comm("all-reduce", ("data",), 1e5)
    bandwidth = params.collective_time("all-reduce", ("data",), 1e5, SIZES, True)
    assert comm_share(own, SIZES, params) == pytest.approx(bandwidth + 1e-3)
    assert comm_share(c, SIZES, params) == pytest.approx(bandwidth + 1e-3 * (0.1 + 1 / 256))
    assert buckets(0, 0, params) == 0 and buckets(2.5e6, 3, params) == 3
    with pytest.raises(ValueError, match="combine_threshold_bytes"):
        CostParams(combine_threshold_bytes=0)


def test_calibrate_on_cpu_combines_without_a_byte_limit():
    from jaxpar.auto import calibrate

    machine = calibrate(jaxpar.make_mesh({"data": 8}), sizes_bytes=(1 << 10, 1 << 14), repeats=1)
    assert machine.combine_threshold_bytes == math.inf and machine.combine_threshold_count == 256


# --------------------------------------------------------------------------- the graph's flags

@pytest.fixture(scope="module")
def graph():
    return build_graph(GPT(TINY, rngs=nnx.Rngs(0)), loss_fn, BATCH)


def test_values_of_parameters_alone_and_the_loss_tail(graph):
    flags = analyse(graph)
    params = {t for _, t in graph.params}
    # a broadcast / reshape / cast of a parameter is traced back to it
    derived = [t for op in graph.ops for t in op.outs if flags.source[t] in params]
    assert derived and all(flags.source[t] >= 0 for t in derived)
    for _, t in graph.batch:
        assert flags.source[t] == -1
    # the loss (the last value) is a tail; a matmul's result the backward pass reads is not
    assert flags.tail[graph.ops[-1].outs[0]]
    dot = next(op for op in graph.ops if op.prim == "dot_general")
    assert not any(flags.tail[t] for t in dot.ins)


# --------------------------------------------------------------------------- against compiled HLO

def _local_shapes(plan, mesh) -> set:
    out = set()
    for _, shape, spec, _ in plan.params:
        entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
        out.add(tuple(n // math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else (e or ())))
                      for n, e in zip(shape, entries)))
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_gradient_bytes_and_collective_counts_match_the_compiled_step(graph, name):
    config = LAYOUTS[name]
    mesh = mesh_for(config)
    plan = hand_strategy(None, loss_fn, BATCH, config, mesh, graph=graph)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    cols = collectives(trainer.lower(BATCH).compile(), mesh)
    local = _local_shapes(plan, mesh)
    # gradient collectives: every buffer a parameter's gradient or a scalar (the loss, the norm)
    grads = [c for c in cols if all(s in local or s == () for s in c.shapes)]
    hlo_bytes = sum(c.bytes * c.executions for c in grads)
    cost = plan.cost
    assert abs(cost["grad_comm_bytes"] - hlo_bytes) <= 0.10 * hlo_bytes, (cost["grad_comm_bytes"], hlo_bytes)
    assert cost["grad_comm_count"] == sum(c.executions for c in grads)
    assert cost["comm_count"] == sum(c.executions for c in cols)
    assert cost["comm_bytes"] == sum(c.bytes * c.executions for c in cols)


def test_a_parameter_read_twice_is_reduced_once_per_reader():
    """XLA keeps one buffer per use in the combined all-reduce (it does not sum them first)."""
    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((16, 16), 0.1))

    def loss(model, batch):
        w = model.w[...]
        return jnp.mean((jnp.tanh(batch["x"] @ w) @ w.reshape(256).reshape(16, 16).T) ** 2)

    batch = {"x": np.ones((64, 16), np.float32)}
    g = build_graph(Net(), loss, batch)
    rows = g.tensors[g.batch[0][1]].classes[0]
    cost = evaluate(g, [("data",) if c == rows else () for c in range(g.num_classes)], SIZES, CostParams())
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    graphdef, state = nnx.split(Net())
    step = jax.jit(lambda s, b: jax.value_and_grad(lambda s: loss(nnx.merge(graphdef, s), b))(s),
                   in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
    cols = collectives(step.lower(state, batch).compile(), mesh)
    assert len(cols) == 1 and cols[0].shapes.count((16, 16)) == 2
    assert cost.grad_comm_count == cost.comm_count == 1
    assert cost.grad_comm_bytes == cols[0].bytes == 2 * 16 * 16 * 4 + 4


# --------------------------------------------------------------------------- the search

@pytest.mark.parametrize("costs", [COSTS, CostParams()], ids=["test machine", "GPU-like defaults"])
def test_search_splits_a_large_batch_over_data(costs):
    rows = 4096
    batch = {"inputs": np.zeros((rows, TINY.seq_len), np.int32), "targets": np.zeros((rows, TINY.seq_len), np.int32)}
    config = jaxpar.ParallelConfig(mesh=SIZES, mode="auto", search="dynamic_programming")
    big = build_graph(GPT(TINY, rngs=nnx.Rngs(0)), loss_fn, batch)
    plan = search(None, loss_fn, batch, config, SIZES, cost_params=costs, graph=big)
    assert dict(plan.batch)["['inputs']"] == P("data")
    whole = hand_strategy(None, loss_fn, batch, jaxpar.ParallelConfig(mesh=SIZES, rules={"batch": None}), SIZES,
                      cost_params=costs, graph=big)
    assert plan.cost["time_s"] < whole.cost["time_s"]
    assert plan.cost["comm_count"] == 1        # the gradients and the loss: one combined all-reduce
