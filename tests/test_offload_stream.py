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
from jaxpar.nn.stream import stream_blocks
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


def test_each_layer_comes_in_inside_the_layer_loop():
    """What a GPU compiles: before the layer loops only the unstacked parameters (embedding, final
    norm, head) go to device memory; inside them each layer's slice of every stacked parameter
    is moved to the device, in the forward and again in the backward, whose gradients go back to
    host memory layer by layer; after them the stacked gradients and parameters come in for the
    update."""
    trainer = _trainer(("params",))
    text = trainer.lower(_batches(1)[0], platform="cuda").as_text()
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
    # after the loops: the stacked gradients straight from the backward loop, and each stacked
    # parameter from an optimization barrier with its gradient (`arrive_streamed`)
    loop = re.findall(r"(%\d+):\d+ = stablehlo\.while", main)[-1]
    barriers = set(re.findall(r"(%\d+):2 = stablehlo\.optimization_barrier", main))
    behind = {v for v, b in re.findall(r"(%\d+) = sdy\.sharding_constraint (%\d+)#1 ", main) if b in barriers}
    moved = re.findall(r'annotate_device_placement\((%[\d#]+)\) \{[^}]*"device"\}[^\n]*-> tensor<([^>]*)>', main)
    assert sorted(s for v, s in moved if v.startswith(loop + "#") and s in stacked) == stacked
    assert sorted(s for v, s in moved if v in behind and s in stacked) == stacked


def test_a_streamed_block_keeps_no_copy_of_its_weights():
    """The backward fetches a layer again instead of keeping the device copy (or a reshape of it):
    no residual has the shape of a layer's parameter."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    params["blocks"] = jax.device_put(params["blocks"], host)
    tokens = jnp.zeros((2, 16), jnp.int32)

    def loss(p):
        return loss_fn(stream_blocks(nnx.merge(graph, p, rest), ("blocks",)), {"inputs": tokens, "targets": tokens})

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    saved = [line for line in out.getvalue().splitlines() if "from the argument" not in line]
    weights = {str(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])} | {
        str(x.shape) for x in jax.tree.leaves(params["blocks"])}
    shapes = {"(" + ", ".join(re.match(r"\w+\[([\d,]*)\]", line).group(1).split(",")) + ")" for line in saved}
    assert saved and not shapes & weights, sorted(shapes & weights)


@pytest.mark.parametrize("config", [
    {"optimizer": {"level": 3, "threshold_kb": 0}},
    {"mode": "hybrid"},
])
def test_layers_are_not_streamed_where_the_loss_does_not_run_on_the_stored_layout(config):
    """ZeRO-3 gathers the stored shards inside the loss, and hybrid runs it per device: there the
    parameters come in where the step starts (the trainer still matches training without offload)."""
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
        return jaxpar.Trainer(model, optax.adamw(1e-2), loss_fn, cfg, mesh, offload=offload,
                              checkpoint_dir=directory, save_every=2)

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
