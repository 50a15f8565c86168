"""Equivalence: every parallel layout trains the example GPT exactly like one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import MEGATRON, TINY, assert_close, assert_losses_close, batches, reference, train_gpt
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn

LAYOUTS = {
    "data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"),
    "data=2,model=4 (Megatron)": jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules=MEGATRON),
    "model=8": jaxpar.ParallelConfig(mesh={"model": 8}, rules={"heads": "model", "mlp": "model", "vocab": "model"}),
    # 2D tensor parallel: weights split over both axes (embed over y, heads/mlp/vocab over x),
    # activations split over both (batch over x, embed over y).
    "2D x=2,y=4": jaxpar.ParallelConfig(
        mesh={"x": 2, "y": 4}, rules={"batch": "x", "embed": "y", "heads": "x", "mlp": "x", "vocab": "x"}),
    "hybrid data=8": jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_one_device(name):
    ref_losses, ref_params = reference()
    losses, params, trainer = train_gpt(LAYOUTS[name])
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, what=name)
    assert losses[-1] < losses[0]


def test_megatron_parameters_are_split_as_planned():
    _, _, trainer = train_gpt(LAYOUTS["data=2,model=4 (Megatron)"], steps=1)
    state = nnx.state(trainer.model, nnx.Param)
    wq = state["blocks"][0]["attn"]["wq"].get_value()
    up = state["blocks"][0]["mlp"]["up"].get_value()
    down = state["blocks"][0]["mlp"]["down"].get_value()
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert down.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert up.addressable_shards[0].data.shape == (TINY.embed, TINY.mlp // 4)


def test_scanned_layers_match_one_device():
    scanned = GPTConfig(**{**TINY.__dict__, "scan_layers": True})
    ref_losses, ref_params = reference(scanned)
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, rules={**MEGATRON, "layers": None})
    losses, params, _ = train_gpt(config, gpt=scanned)
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params, what="scan")
    assert params["blocks"]["mlp"]["up"].shape == (TINY.layers, TINY.embed, TINY.mlp)


def keep_gradients() -> optax.GradientTransformation:
    """An optax transformation whose state is the last gradient and whose update is zero."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def test_gradients_match_one_device():
    """First-step gradients (not only losses) under the Megatron layout equal the one-device ones."""
    batch = batches(1)[0]

    def grads(cfg, n):
        mesh = jaxpar.make_mesh(cfg, devices=jax.devices()[:n])
        model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), cfg, mesh)
        trainer = jaxpar.Trainer(model, keep_gradients(), loss_fn, cfg, mesh)
        trainer.step(batch)
        return jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.opt_state))

    sharded = grads(LAYOUTS["data=2,model=4 (Megatron)"], 8)
    assert_close(sharded, grads(jaxpar.ParallelConfig(mesh={"data": 1}), 1), rtol=1e-5, what="grads")
    assert np.abs(sharded["blocks"][0]["mlp"]["up"]).max() > 0


def test_fit_evaluate_and_lower():
    config = LAYOUTS["data=2,model=4 (Megatron)"]
    _, _, trainer = train_gpt(config, steps=1)
    history = trainer.fit(iter(batches(3)), steps=3, progress=False)
    assert [h["step"] for h in history] == [2, 3, 4]
    assert all(np.isfinite(h["loss"]) for h in history)
    loss = trainer.evaluate(batches(2), steps=2)
    assert np.isfinite(loss)
    compiled = trainer.lower(batches(1)[0]).compile()
    assert isinstance(compiled, jax.stages.Compiled)
    assert trainer.step_count == 4


def test_loss_with_aux_is_returned():
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)

    def loss_with_aux(m, b):
        loss = loss_fn(m, b)
        return loss, {"double": 2 * loss}

    trainer = jaxpar.Trainer(model, optax.sgd(0.1), loss_with_aux, config, mesh)
    out = trainer.step(batches(1)[0])
    np.testing.assert_allclose(float(out["aux"]["double"]), 2 * float(out["loss"]), rtol=1e-6)


def test_per_process_batch_rows_single_process_equals_global():
    """global_batch=False on one process is the same as the global batch (process 0 holds all rows)."""
    config = LAYOUTS["data=8"]
    mesh = jaxpar.make_mesh(config)
    a = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1), loss_fn,
                       config, mesh, global_batch=False)
    b = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.sgd(0.1), loss_fn,
                       config, mesh)
    batch = batches(1)[0]
    assert float(a.step(batch)["loss"]) == float(b.step(batch)["loss"])


class DropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.up(x))))


def test_rng_state_advances_inside_the_step():
    """Dropout draws new masks each step: the RNG count in the non-parameter state advances."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: DropoutMLP(nnx.Rngs(0)), config, mesh), optax.sgd(0.0),
                             lambda m, b: jnp.mean(m(b["x"]) ** 2), config, mesh)
    batch = {"x": np.ones((8, 8), np.float32)}
    losses = [float(trainer.step(batch)["loss"]) for _ in range(3)]
    assert len(set(losses)) == 3          # same parameters (lr 0), different dropout masks
    counts = jax.tree.leaves(nnx.state(trainer.model, nnx.RngCount))
    assert int(counts[0]) == 3


class BatchNormMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.norm(self.up(x))))


def test_hybrid_averages_batch_statistics_over_the_batch_axes():
    """mode='hybrid' with ``nnx.BatchNorm``: each device's running mean comes back averaged over
    the batch axes, which for equal rows per device is the global batch's mean (what mode
    'data' computes); it was returned per device and refused by ``shard_map``."""
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    means = {}
    for mode in ("data", "hybrid"):
        config = jaxpar.ParallelConfig(mesh={"data": 8}, mode=mode)
        mesh = jaxpar.make_mesh(config)
        trainer = jaxpar.Trainer(jaxpar.init(lambda: BatchNormMLP(nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                                 lambda m, b: jnp.mean(m(b["x"]) ** 2), config, mesh)
        trainer.step({"x": x})
        means[mode] = np.asarray(trainer.model.norm.mean.get_value())
    assert np.abs(means["data"]).max() > 1e-3                  # the statistics moved
    np.testing.assert_allclose(means["hybrid"], means["data"], rtol=1e-5, atol=1e-7)


class DropoutBatchNormMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.norm(self.up(x)))))


@pytest.mark.parametrize("mode", ["data", "hybrid"])
def test_evaluate_runs_the_model_in_evaluation_mode(mode):
    """``Trainer.evaluate``: dropout off and batch norm on its running statistics (what
    ``model.eval()`` does), so the same batch gives the same loss each time, equal to the
    model's own evaluation; training still draws masks and updates the statistics."""
    loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode=mode)
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: DropoutBatchNormMLP(nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                             loss, config, mesh)
    trainer.step({"x": x})
    model = nnx.clone(trainer.model)
    model.eval()
    want = float(loss(model, {"x": x}))
    got = [trainer.evaluate([{"x": x}]) for _ in range(2)]
    assert got[0] == got[1]
    np.testing.assert_allclose(got[0], want, rtol=1e-5)
    trained = [float(trainer.step({"x": x})["loss"]) for _ in range(2)]
    assert trained[0] != got[0] and trained[0] != trained[1]       # training mode: masks, batch statistics


def test_hybrid_refuses_a_loss_left_partial_over_a_model_axis():
    """A model written for whole tensors, its matrices split over 'model' in mode='hybrid',
    returns a loss that differs per 'model' shard: a ValueError names the axis and the fixes
    (it was a pytree structure error from inside ``shard_map``'s own message)."""
    config = jaxpar.ParallelConfig(mesh={"data": 2, "model": 4}, mode="hybrid", rules={"batch": "data"},
                                   parameter_strategy={"up/kernel": (1, 4), "up/bias": (4,), "down/kernel": (4, 1)})
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: DropoutMLP(nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                             lambda m, b: jnp.mean(m(b["x"]) ** 2), config, mesh)
    with pytest.raises(ValueError, match=r"mode='hybrid': the loss returned by loss_fn differs across the mesh "
                                         r"axes \('model',\).*jax.lax.psum.*mode='semi_auto'"):
        trainer.step({"x": np.ones((8, 8), np.float32)})


def test_malformed_batches_are_refused_naming_the_leaf():
    """A batch leaf that is a scalar, has another row count, or holds strings is refused with the
    leaf's path before anything is compiled."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: DropoutMLP(nnx.Rngs(0)), config, mesh), optax.sgd(0.1),
                             lambda m, b: jnp.mean(m(b["x"]) ** 2), config, mesh)
    x = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match=r"batch\['scale'\] is a scalar"):
        trainer.step({"x": x, "scale": np.float32(2)})
    with pytest.raises(ValueError, match=r"batch\['y'\] has 16 rows but batch\['x'\] has 8"):
        trainer.step({"x": x, "y": np.ones((16, 8), np.float32)})
    with pytest.raises(TypeError, match=r"batch\['name'\] has dtype <U1: batch leaves must be numeric.*ids"):
        trainer.step({"x": x, "name": np.array(["a"] * 8)})
    with pytest.raises(ValueError, match=r"batch has no arrays"):
        trainer.step({})
    with pytest.raises(TypeError, match=r"batch\['key'\] has dtype key<fry>: batch leaves must be numeric"):
        trainer.step({"x": x, "key": jax.random.split(jax.random.key(0), 8)})
    # bfloat16 and float8 are numbers to JAX, not to NumPy's np.issubdtype: taken as any float
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        assert np.isfinite(float(trainer.step({"x": x, "extra": np.ones((8, 2), dtype)})["loss"]))


def test_hooks_run_at_their_steps_after_the_services(tmp_path):
    """``add_hook(fn, every=N)`` calls ``fn(step, metrics)`` after steps N, 2N, ...; the Trainer's
    own checkpoint service is such a hook and runs first, so a hook at a save step sees it saved."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    model = jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh, checkpoint_dir=str(tmp_path),
                             save_every=2)
    seen = []
    trainer.add_hook(lambda step, m: seen.append(("every", step, float(m["loss"]))))

    def saved(step, metrics):
        trainer.checkpointer.wait()
        seen.append(("saved", step, jaxpar.checkpoint.latest_step(tmp_path)))

    trainer.add_hook(saved, every=2)
    losses = [float(trainer.step(b)["loss"]) for b in batches(4)]
    trainer.close()
    assert [s for s in seen if s[0] == "every"] == [("every", i + 1, loss) for i, loss in enumerate(losses)]
    assert [s for s in seen if s[0] == "saved"] == [("saved", 2, 2), ("saved", 4, 4)]
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4]
    with pytest.raises(ValueError, match=r"add_hook: every=0 must be a positive int"):
        trainer.add_hook(print, every=0)
    with pytest.raises(TypeError, match=r"add_hook: hook must be callable .* got str"):
        trainer.add_hook("print")


def test_the_trainer_module_never_searches():
    """Mode "auto" is searched before the Trainer (`jaxpar.auto.plan_for`); given no plan the
    Trainer calls `make_train_plan` and nothing else (tests/test_architecture.py checks that no
    module of jaxpar/train imports jaxpar/auto)."""
    import ast
    import pathlib

    import jaxpar.train.trainer as module

    names = set()
    for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not {n for n in names if n.startswith("jaxpar.auto")}, names
    assert "jaxpar.plan.make_train_plan" in names


def test_bad_gpt_input_and_evaluate_steps_name_the_fix():
    """A sequence longer than the GPT's position table, float token ids and evaluate(steps=0) are
    refused by jaxpar with the sizes and the fix, not by JAX's broadcasting or indexing."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    mesh = jaxpar.make_mesh(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.adam(1e-3),
                             loss_fn, config, mesh)
    long = batches(1, seq=2 * TINY.seq_len)[0]
    with pytest.raises(ValueError, match=r"sequences of 32 tokens \(shape \(16, 32\)\) but GPTConfig.seq_len=16.*"
                                         r"at most 16 tokens, or build the model with GPTConfig\(seq_len=32\)"):
        trainer.step(long)
    floats = {k: np.asarray(v, np.float32) for k, v in batches(1)[0].items()}
    with pytest.raises(TypeError, match=r"integer token ids \[batch, length\].*got float32 \(16, 16\)"):
        trainer.step(floats)
    for steps in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"Trainer.evaluate: steps={steps!r} must be a positive int"):
            trainer.evaluate(batches(2), steps=steps)
    assert trainer.step_count == 0 and np.isfinite(trainer.evaluate(batches(2), steps=1))
