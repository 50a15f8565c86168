"""offload="params" on stacked (scanned) layers: each layer's parameters come into device memory
inside the layer loop, in the forward and again in the backward, and its gradient goes back to
host memory there (`jaxpar.nn.stream`). On CPU host and device memory are the same RAM, so the
tests check the numbers against training without offload and the order of the copies in the
program a GPU compiles (lowered for "cuda")."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import assert_close, assert_losses_close
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn
from jaxpar.nn.blocks import recomputed_loss
from jaxpar.nn.stream import streamed_loss
from jaxpar.remat import POLICY_NAMES
from jaxpar.train.step import _streamed_blocks

CFG = LlamaConfig.named("tiny", scan_layers=True, layers=3)


def _batches(n=2, rows=8):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, CFG.vocab_size, (rows, 16)).astype(np.int32)
        out.append({"inputs": t, "targets": np.roll(t, -1, 1)})
    return out


def _trainer(offload=(), **config):
    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", **config)
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: Llama(CFG, rngs=nnx.Rngs(0)), cfg, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-2), loss_fn, cfg, mesh, offload=offload)


def _params(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


@pytest.mark.parametrize("remat,precision", [("none", None), ("full", None), ("dots_saveable", "bf16")])
def test_streamed_layers_train_as_without_offload(remat, precision):
    """fp32: equal to 1e-6. bf16: the layer is cast where it is fetched instead of before the
    loss, the same values, but XLA fuses the casts into other ops: equal to bf16 rounding."""
    data = _batches()
    ref = _trainer(remat=remat, precision=precision)
    streamed = _trainer(("params", "opt_state"), remat=remat, precision=precision)
    assert_losses_close([float(streamed.step(b)["loss"]) for b in data], [float(ref.step(b)["loss"]) for b in data],
                        rtol=1e-6 if precision is None else 1e-3)
    if precision is None:
        assert_close(_params(streamed), _params(ref))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(streamed.params)} == {"pinned_host"}
    assert float(streamed.evaluate(data[:1])) == pytest.approx(float(ref.evaluate(data[:1])),
                                                                rel=1e-6 if precision is None else 1e-3)


def _placements(body: str) -> list[tuple[str, str]]:
    """(memory, shape) of each annotate_device_placement in ``body``."""
    return re.findall(r'annotate_device_placement\([^)]*\) \{[^}]*_xla_buffer_placement = "(\w+)"\}[^\n]*'
                      r'-> tensor<([^>]*)>', body)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_each_layer_comes_in_inside_the_layer_loop(grad_accum):
    """What a GPU compiles: before the layer loops only the unstacked parameters (embedding, final
    norm, head) go to device memory; inside them each layer's slice of every stacked parameter
    is moved to the device, in the forward and again in the backward, whose gradients go back to
    host memory layer by layer; after them the stacked gradients and parameters come in for the
    update. With grad_accum the layer loops run inside the micro-batch loop, the same way."""
    trainer = _trainer(("params",), grad_accum=grad_accum)
    text = trainer.lower(_batches(1, rows=8 * grad_accum)[0], platform="cuda").as_text()
    blocks = nnx.state(trainer.model.blocks, nnx.Param)
    layer = sorted("x".join(map(str, x.shape[1:])) + "xf32" for x in jax.tree.leaves(blocks))
    stacked = sorted("x".join(map(str, x.shape)) + "xf32" for x in jax.tree.leaves(blocks))
    n_other = len(jax.tree.leaves(trainer.params)) - len(layer)
    main = re.search(r"func\.func public @main.*?\n  \}", text, re.S).group(0)
    before_loops = main[:main.index("stablehlo.while")]
    assert [m for m, _ in _placements(before_loops)] == ["device"] * n_other      # no stacked array
    assert not {s for _, s in _placements(before_loops)} & set(stacked)
    functions = re.findall(r"func\.func private @(\S+)\((.*?)\n  \}", text, re.S)
    fetched = [name for name, body in functions
               if sorted(s for m, s in _placements(body) if m == "device") == layer]
    returned = [name for name, body in functions
                if sorted(s for m, s in _placements(body) if m == "pinned_host") == layer]
    assert len(fetched) == 2 and len(returned) == 1 and returned[0] in fetched, (fetched, returned)
    # after the loops: the stacked gradients straight from the backward loop (with grad_accum,
    # each micro-batch's come in inside the micro-batch loop), and each stacked parameter from an
    # optimization barrier with its gradient (`arrive_streamed`)
    barriers = set(re.findall(r"(%\d+):2 = stablehlo\.optimization_barrier", main))
    behind = {v for v, b in re.findall(r"(%\d+) = sdy\.sharding_constraint (%\d+)#1 ", main) if b in barriers}
    moved = re.findall(r'annotate_device_placement\((%[\d#]+)\) \{[^}]*"device"\}[^\n]*-> tensor<([^>]*)>', main)
    assert sorted(s for v, s in moved if v in behind and s in stacked) == stacked
    if grad_accum == 1:
        loop = re.findall(r"(%\d+):\d+ = stablehlo\.while", main)[-1]
        assert sorted(s for v, s in moved if v.startswith(loop + "#") and s in stacked) == stacked


def _residuals(loss, params) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


def _shape(line: str) -> str:
    return "(" + ", ".join(re.match(r"\w+(?:<\w+>)?\[([\d,]*)\]", line).group(1).split(",")) + ")"


@pytest.mark.parametrize("policy,owner", [(p, "config") for p in POLICY_NAMES] + [("full", "model")])
def test_a_streamed_block_keeps_no_copy_of_its_weights(policy, owner):
    """The backward fetches a layer again instead of keeping the device copy (or a reshape of it):
    no residual has the shape of a layer's parameter, under every recompute policy, put on the
    blocks by the step (``ParallelConfig.remat``, composed as `build_grads` does: the recompute
    swap first, then the streaming one) or by the model (``jaxpar.remat(model.blocks, ...)``); and
    the recompute policy still decides what else is kept (the same residuals as without streaming)."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    if owner == "model":
        jaxpar.remat(model.blocks, policy)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    on_host = dict(params, blocks=jax.device_put(params["blocks"], host))
    tokens = jnp.zeros((2, 16), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    stepped = policy != "none" and owner == "config"

    def loss_of(streaming):
        lf = streamed_loss(loss_fn, ("blocks",)) if streaming else loss_fn
        return recomputed_loss(lf, ("blocks",), policy) if stepped else lf

    streamed = _residuals(lambda p: loss_of(True)(nnx.merge(graph, p, rest), batch), on_host)
    weights = {str(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])} | {
        str(x.shape) for x in jax.tree.leaves(params["blocks"])}
    assert streamed and not {_shape(line) for line in streamed} & weights, streamed
    if policy in ("full", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        plain = _residuals(lambda p: loss_of(False)(nnx.merge(graph, p, rest), batch), params)
        assert sorted(map(_shape, streamed)) == sorted(map(_shape, plain))


@pytest.mark.parametrize("config", [
    {"optimizer": {"level": 3, "threshold_kb": 0}},
    {"mode": "hybrid"},
])
def test_layers_are_not_streamed_where_the_loss_does_not_run_on_the_stored_layout(config):
    """ZeRO-3 gathers the stored shards inside the loss, and hybrid runs it per device: there the
    parameters come in where the step starts; unrolled layers are not streamed either."""
    cfg = jaxpar.ParallelConfig(**{"mesh": {"data": 8}, "mode": "data", **config})
    mesh = jaxpar.make_mesh(cfg)
    model = nnx.eval_shape(lambda: Llama(CFG, rngs=nnx.Rngs(0)))
    plan = jaxpar.plan.make_train_plan(cfg, mesh, model, optax.adamw(1e-2), offload=("params",))
    assert _streamed_blocks(plan, model) == ()
    plain = jaxpar.plan.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"), mesh, model,
                                        optax.adamw(1e-2), offload=("params",))
    assert _streamed_blocks(plain, model) == ("blocks",)
    unrolled = nnx.eval_shape(lambda: Llama(LlamaConfig.named("tiny", layers=2), rngs=nnx.Rngs(0)))
    assert _streamed_blocks(plain, unrolled) == ()


def test_an_offloaded_trainer_saves_resumes_and_hands_back_a_model_on_the_device(tmp_path):
    """Checkpoints of host-memory state save and restore (their checksums run on a device copy),
    resuming with or without offload continues as the uninterrupted run; ``trainer.model`` is in
    device memory, so it runs outside the step (generation)."""
    from jaxpar.models.generate import greedy

    data = _batches(4)

    def trainer(offload, directory=None):
        cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
        mesh = jaxpar.make_mesh(cfg)
        model = jaxpar.init(lambda: Llama(CFG, rngs=nnx.Rngs(0)), cfg, mesh)
        saves = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=str(directory), save_every=2)) if directory \
            else None
        return jaxpar.Trainer(model, optax.adamw(1e-2), loss_fn, cfg, mesh, services=saves,
                              placement=jaxpar.Placement(offload=offload))

    plain = trainer(())
    losses = [float(plain.step(b)["loss"]) for b in data]
    first = trainer(("params", "opt_state"), tmp_path / "a")
    assert [float(first.step(b)["loss"]) for b in data[:2]] == pytest.approx(losses[:2], rel=1e-6)
    first.close()
    import shutil
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for offload, directory in ((("params", "opt_state"), "a"), ((), "b")):
        again = trainer(offload, tmp_path / directory)
        assert again.step_count == 2                      # resumed at the saved step
        assert [float(again.step(b)["loss"]) for b in data[2:]] == pytest.approx(losses[2:], rel=1e-6)
        again.close()
    model = first.model
    assert {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(first.params)} == {"pinned_host"}
    assert greedy(model, [1, 2, 3], 4, window=16)[:3] == [1, 2, 3]


def test_a_block_split_over_layers_is_not_streamed():
    """A rule splitting "layers" over a mesh axis: the scan does not slice one layer per device,
    so the parameters come in where the step starts."""
    model = nnx.eval_shape(lambda: Llama(LlamaConfig.named("tiny", scan_layers=True, layers=4), rngs=nnx.Rngs(0)))
    for rules, streamed in (({"batch": "data", "layers": "model"}, ()), ({"batch": "data"}, ("blocks",))):
        config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="semi_auto", rules=rules)
        plan = jaxpar.plan.make_train_plan(config, {"data": 2, "model": 4}, model, optax.adamw(1e-2),
                                           offload=("params",))
        assert _streamed_blocks(plan, model) == streamed


def test_a_loss_reading_a_streamed_parameter_outside_its_block_is_refused():
    """A penalty on the weights reads the stacked parameters in host memory: refused, naming the
    blocks and the fixes, where it failed deep in JAX's transpose."""
    def penalised(model, batch):
        reg = sum(jnp.sum(p[...] ** 2) for p in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))
        return loss_fn(model, batch) + 1e-4 * reg

    cfg = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(cfg)
    model = jaxpar.init(lambda: Llama(CFG, rngs=nnx.Rngs(0)), cfg, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-2), penalised, cfg, mesh, offload=("params",))
    with pytest.raises(ValueError, match=r"offload='params' keeps the parameters of the scanned blocks \['blocks'\] "
                                         r"in host memory .* most likely because the loss reads a streamed "
                                         r"parameter outside its block's __call__ .* offload only the optimizer "
                                         r"state \(offload=\('opt_state',\)\)"):
        trainer.step(_batches(1)[0])
