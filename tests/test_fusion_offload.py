"""Communication fusion and host offload: collective counts from the HLO, placements, numerics."""

import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, assert_close, assert_losses_close, batches, mesh_for, reference, train_gpt
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.optim import compiler_options
from jaxpar.report import collectives
from jaxpar.train.step import waiting_for


def _all_reduce_buffers(config):
    mesh = mesh_for(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    cols = [c for c in collectives(trainer.lower(batches(1)[0]).compile(), mesh) if c.kind == "all-reduce"]
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.params))
    # XLA's CPU combiner packs everything into tuple all-reduces afterwards (and cannot be
    # tuned on CPU), so count the buffers the all-reduces carry, not the instructions.
    return sum(len(c.shapes) for c in cols), len(jax.tree.leaves(trainer.params)), grad_bytes


def test_hybrid_fusion_buckets_gradients():
    bucket_mb = 0.004
    fused, n_params, grad_bytes = _all_reduce_buffers(
        jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", comm_fusion={"mode": "size", "bucket_mb": bucket_mb}))
    plain, _, _ = _all_reduce_buffers(jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid"))
    bound = math.ceil(grad_bytes / (bucket_mb * 2**20)) + 1          # + the loss
    print(f"all-reduce buffers: fused {fused} (bound {bound}), unfused {plain} ({n_params} parameters + loss)")
    assert fused <= bound
    assert plain == n_params + 1


@pytest.mark.slow  # hybrid fusion numerics are also covered by test_zero (zero2 + fusion)
def test_hybrid_fusion_matches_one_device():
    ref_losses, ref_params = reference(TINY, 2)
    losses, params, _ = train_gpt(jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", comm_fusion="auto"), steps=2)
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params)


def test_jit_fusion_sets_combiner_thresholds_per_backend():
    fusion = jaxpar.CommFusionConfig(mode="size", bucket_mb=4)
    gpu = compiler_options(fusion, "gpu")
    assert gpu["xla_gpu_all_reduce_combine_threshold_bytes"] == 4 * 2**20
    assert gpu["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 4 * 2**20
    assert compiler_options(fusion, "cpu") == {}             # CPU's combiner has no such option
    assert compiler_options(jaxpar.CommFusionConfig(mode="auto"), "gpu") == {}
    assert compiler_options(None, "gpu") == {}


def test_comm_fusion_config_loads_and_validates():
    cfg = jaxpar.ParallelConfig.from_dict({"comm_fusion": {"mode": "size", "bucket_mb": 2}, "interleave": 2})
    assert cfg.comm_fusion.bucket_bytes == 2 * 2**20 and cfg.interleave == 2
    assert jaxpar.ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert jaxpar.ParallelConfig(comm_fusion="auto").comm_fusion.mode == "auto"
    with pytest.raises(ValueError, match="comm_fusion.bucket_mb"):
        jaxpar.ParallelConfig(comm_fusion={"bucket_mb": 0})
    with pytest.raises(ValueError, match="interleave"):
        jaxpar.ParallelConfig(interleave=0)


def test_offload_places_state_on_host_and_matches():
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", optimizer={"level": 1, "threshold_kb": 0})
    mesh = mesh_for(cfg)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh), optax.adamw(1e-3),
                             loss_fn, cfg, mesh, offload=("opt_state", "params"))
    losses = [float(trainer.step(b)["loss"]) for b in batches()]
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.params)} == {"pinned_host"}
    ref_losses, ref_params = reference()
    assert_losses_close(losses, ref_losses)
    assert_close(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), ref_params)


class Counted(nnx.Module):
    """A small MLP that overwrites an int32 counter each call (as an MoE layer's dropped count)."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)
        self.positive = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        y = self.down(jax.nn.gelu(self.up(x)))
        self.positive.set_value(jnp.sum(y > 0).astype(jnp.int32))
        return y


def test_offloaded_state_beside_a_counter_the_step_overwrites():
    """The counter's input is unused, so the program would prune it, and donation aliased Adam's
    count (pinned_host) to the counter's output (device): 'Memory kind mismatch' on step 1."""
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)   # noqa: E731
    rng = np.random.default_rng(0)
    data = [{"x": (x := rng.normal(size=(16, 16)).astype(np.float32)), "y": np.tanh(x)} for _ in range(2)]
    runs = []
    for offload in ((), ("opt_state",)):
        cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
        trainer = jaxpar.Trainer(Counted(), optax.adam(1e-2), loss, cfg, mesh_for(cfg), offload=offload)
        runs.append([float(trainer.step(b)["loss"]) for b in data] + [int(trainer.model.positive[...])])
    assert runs[1] == runs[0]


def test_offload_rejects_unknown_targets():
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = mesh_for(cfg)
    with pytest.raises(ValueError, match="unknown targets"):
        jaxpar.Trainer(GPT(TINY, rngs=nnx.Rngs(0)), optax.sgd(0.1), loss_fn, cfg, mesh, offload=("grads",))


def test_offloaded_state_moves_to_the_device_as_the_gradients_come():
    """What a GPU compiles (lowered for "cuda" here): each host-resident moment is moved to
    device memory from an optimization barrier with its parameter's gradient (Adam's two
    moments per parameter), so no copy can start before the backward has produced what it waits
    for (with grad_accum: the sum); the step counter, a scalar every update reads, is not held back."""
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", optimizer={"level": 1, "threshold_kb": 0},
                                grad_accum=2)
    mesh = mesh_for(cfg)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh), optax.adamw(1e-3),
                             loss_fn, cfg, mesh, offload=("opt_state",))
    text = trainer.lower(batches(1)[0], platform="cuda").as_text()
    n_grads, n_state = len(jax.tree.leaves(trainer.params)), len(jax.tree.leaves(trainer.opt_state))
    # operands per barrier (the model may have barriers of its own: recompute lowers to them on a GPU)
    barriers = dict(re.findall(r"(%\d+):(\d+) = stablehlo\.optimization_barrier", text))
    # a barrier's state output -> sharding constraint -> annotate_device_placement(... "device")
    constrained = {v: name for v, name in re.findall(r"(%\d+) = sdy\.sharding_constraint (%\d+)#1 ", text)
                   if name in barriers}
    moved = [constrained[v] for v in re.findall(r"annotate_device_placement\((%\d+)\) \{[^}]*"
                                                r"_xla_buffer_placement = \"device\"", text) if v in constrained]
    # every moment behind a barrier with one gradient; the count (a scalar) not held back
    assert sorted(int(barriers[b]) for b in moved) == [2] * (n_state - 1) == [2] * (2 * n_grads), moved
    with pytest.raises(ValueError, match="platform='gpu' is not one of"):
        trainer.lower(batches(1)[0], platform="gpu")


def test_each_moment_waits_for_its_own_parameters_gradient():
    """Each moment behind a barrier with its own parameter's gradient; a leaf that mirrors no
    parameter behind every gradient, except a scalar (the count): every update reads it, so
    behind every gradient it would hold each parameter's update back until the backward ends."""
    params = {"a": {"w": jnp.ones((3, 2))}, "b": {"w": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
    tx = optax.adamw(1e-3)
    state = (tx.init(params), {"stats": jnp.zeros(4)})      # a leaf of no parameter's shape or path
    state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    grad_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    jaxpr = jax.make_jaxpr(waiting_for)(state, params).jaxpr
    name = {v: jax.tree_util.keystr(p) for v, (p, _) in zip(jaxpr.invars, state_leaves + grad_leaves)}
    pairs = sorted(tuple(name[v] for v in e.invars) for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                   and len(e.invars) == 2)
    expected = sorted((jax.tree_util.keystr(g), jax.tree_util.keystr(p)) for p, _ in state_leaves
                      for g, _ in grad_leaves if jax.tree_util.keystr(p).endswith(jax.tree_util.keystr(g)))
    assert pairs == expected and len(pairs) == 2 * len(grad_leaves)       # mu and nu of each parameter
    others = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier" and len(e.invars) != 2]
    assert [len(e.invars) for e in others] == [len(grad_leaves) + 1]      # "stats" waits for every gradient
    assert [name[v] for e in others for v in e.invars[-1:]] == ["[1]['stats']"]

    # so each parameter's update depends on its own gradient alone (Adam's count included)
    def update(state, grads):
        return tx.update(grads, waiting_for(state, grads), params)[0]

    step = jax.make_jaxpr(update)(state[0], params).jaxpr
    n = len(jax.tree.leaves(state[0]))
    reads = {v: {i} for i, v in enumerate(step.invars)}
    for e in step.eqns:
        read = set().union(*(reads.get(v, set()) for v in e.invars if not isinstance(v, jax.extend.core.Literal)))
        reads.update((o, read) for o in e.outvars)
    grads_read = [sorted(i - n for i in reads[v] if i >= n) for v in step.outvars]
    assert grads_read == [[0], [1], [2]], grads_read
