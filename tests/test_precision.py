"""Mixed precision (``ParallelConfig.precision``): dtypes in the program and the state,
convergence against fp32, activation memory, fp32 identical to no setting, bad input.

Composition with the other strategies (ZeRO 1/3, pipelines, TP, hybrid, accumulation,
recompute, checkpoints) is checked by the combination matrix (tests/matrix.py, feature
``precision``)."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models.data import ArithmeticData
from jaxpar.models.llama import Llama, loss_fn
from jaxpar.models.llama_config import LlamaConfig
from jaxpar.plan import TrainPlan
from jaxpar.precision import FLOATS, PRESETS, Precision
from jaxpar.train.step import Setting, cast, merge

CFG = LlamaConfig.named("tiny")
DATA = ArithmeticData(CFG.max_seq_len)
BATCHES = [DATA.batch(16, i) for i in range(8)]   # the fixed synthetic batch set


def _trainer(precision, mesh_axes, cfg=CFG):
    config = jaxpar.ParallelConfig(mesh=mesh_axes, mode="data", precision=precision)
    n = int(np.prod(list(mesh_axes.values())))
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), loss_fn, config, mesh)


def _dtypes(tree) -> dict[str, str]:
    return {jax.tree_util.keystr(p): str(x.dtype) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _fp32_dots(lowered) -> tuple[int, list[str]]:
    """(number of matmuls / convolutions, the operand types of those computing in fp32: both
    operands fp32; attention's backward mixes its fp32 softmax with bf16 values at bf16
    precision, which jax.nn.dot_product_attention chooses).

    Read from the program jaxpar hands to XLA: XLA:CPU has no bf16 matmul and converts every
    bf16 dot to f32 when it compiles, so the compiled CPU program shows f32 dots whatever
    the setting."""
    ops = re.findall(r"stablehlo\.(?:dot_general|convolution).*?: \((.*?)\) ->", lowered.as_text())
    return len(ops), [op for op in ops if all(t.endswith("f32>") for t in op.split(", "))]


def test_bf16_program_computes_in_bf16_and_keeps_fp32_state():
    trainer = _trainer("bf16", {"data": 8})
    n, fp32 = _fp32_dots(trainer.lower(BATCHES[0]))
    # No fp32 matmul at all: the Llama's fp32 logits hand their gradient matmuls a cotangent
    # cast back to bf16 (jaxpar.nn.logits), where a plain einsum would leave two fp32 GEMMs.
    assert n > 20 and fp32 == [], (n, fp32)
    rest_before = _dtypes(trainer.state.rest)
    trainer.step(BATCHES[0])
    params, opt = _dtypes(trainer.state.params), _dtypes(trainer.state.opt_state)
    assert set(params.values()) == {"float32"}, params
    floats = {k: v for k, v in opt.items() if not v.startswith("int")}
    assert floats and set(floats.values()) == {"float32"}, opt
    assert {v for k, v in opt.items() if k not in floats} == {"int32"}      # Adam's count, untouched
    assert _dtypes(trainer.state.rest) == rest_before            # RNG keys and counts as they were


def test_bf16_pure_stores_bf16_and_the_plan_shows_precision(tmp_path):
    trainer = _trainer("bf16-pure", {"data": 8})
    params, opt = _dtypes(trainer.state.params), _dtypes(trainer.state.opt_state)
    assert set(params.values()) == {"bfloat16"}, params
    assert {v for v in opt.values() if not v.startswith("int")} == {"bfloat16"}, opt
    plan = trainer.plan
    assert "precision bf16-pure" in str(plan)
    assert {dtype for _, (_, dtype) in plan.shapes.items()} == {"bfloat16"}   # bytes of the stored dtype
    plan.to_json(tmp_path / "plan.json")
    loaded = TrainPlan.from_json(tmp_path / "plan.json")
    assert loaded == plan and loaded.precision == PRESETS["bf16-pure"]
    other = jaxpar.make_train_plan(jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", precision="bf16"),
                                   trainer.mesh, trainer.model, optax.adamw(1e-3))
    changes = "\n".join(plan.diff(other))
    assert "precision bf16-pure -> " in changes and "precision bf16" in changes, changes


def _train(precision, steps):
    trainer = _trainer(precision, {"data": 1})
    losses = [trainer.step(BATCHES[i % len(BATCHES)])["loss"] for i in range(steps)]
    return np.asarray(jax.device_get(losses)), jax.device_get(trainer.state.params)


def test_bf16_converges_like_fp32_and_fp32_preset_is_no_setting():
    plain, plain_params = _train(None, 200)
    fp32, fp32_params = _train("fp32", 200)
    bf16, _ = _train("bf16", 200)
    np.testing.assert_array_equal(fp32, plain)            # bit-identical, every step
    for a, b in zip(jax.tree.leaves(fp32_params), jax.tree.leaves(plain_params)):
        np.testing.assert_array_equal(a, b)
    assert plain[-1] < 0.7 * plain[0], f"fp32 did not train: {plain[0]:.3f} -> {plain[-1]:.3f}"
    final = lambda x: x[-len(BATCHES):].mean()   # noqa: E731 (one pass over the batch set)
    assert abs(final(bf16) - final(plain)) <= 0.02 * final(plain), (final(bf16), final(plain))


def test_bf16_halves_the_activations_kept_for_the_backward():
    """Activation-heavy shape (wide MLP, 1024 tokens, tiny parameters). The compiled temp bytes
    are compared where the backend computes in bf16; XLA:CPU keeps an fp32 copy of every bf16
    matmul operand (it has no bf16 matmul), so there the activations the backward keeps — the
    residuals of the differentiated step loss — are what bf16 shrinks."""
    cfg = LlamaConfig.named("tiny", embed=64, mlp=1024, max_seq_len=16)
    batch = {"inputs": np.zeros((64, 16), np.int32), "targets": np.zeros((64, 16), np.int32)}
    kept = {}
    for precision in ("fp32", "bf16"):
        if jax.default_backend() != "cpu":
            trainer = _trainer(precision, {"data": 1}, cfg)
            kept[precision] = trainer.lower(batch).compile().memory_analysis().temp_size_in_bytes
            continue
        config = jaxpar.ParallelConfig(mesh={"data": 1}, precision=precision)
        mesh = jaxpar.make_mesh(config, devices=jax.devices()[:1])
        graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
        plan = jaxpar.make_train_plan(config, mesh, (params, rest), optax.adamw(1e-3))
        s = Setting(plan, mesh, graphdef, params, rest)
        loss = cast(s, merge(s, loss_fn, batch))          # the step's loss, as differentiate gets it
        residuals = jax.eval_shape(lambda p: jax.vjp(lambda q: loss(q, rest, batch)[0], p)[1], params)
        kept[precision] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))
    drop = 1 - kept["bf16"] / kept["fp32"]
    assert drop >= 0.4, f"bf16 keeps {kept['bf16']:,} bytes, fp32 {kept['fp32']:,}: {drop:.0%} less (want >= 40%)"


@pytest.mark.parametrize("precision, field, value", [
    ("bf17", "precision", "'bf17'"),
    ({"compute": "int8"}, "compute", "'int8'"),
    ({"compute": "float8_e4m3fn"}, "compute", "'float8_e4m3fn'"),
])
def test_bad_precision_names_value_and_valid_ones(precision, field, value):
    with pytest.raises(ValueError) as err:
        jaxpar.ParallelConfig(precision=precision)
    msg = str(err.value)
    assert f"{field}={value}" in msg and all(p in msg for p in PRESETS), msg
    if field == "compute":
        assert all(d in msg for d in FLOATS), msg


def test_precision_forms_agree_and_round_trip():
    forms = ["bf16", {"compute": "bfloat16"}, Precision(compute="bfloat16")]
    configs = [jaxpar.ParallelConfig(precision=f) for f in forms]
    assert all(c.precision == PRESETS["bf16"] for c in configs)
    assert jaxpar.ParallelConfig.from_dict(configs[0].to_dict()) == configs[0]
    assert jaxpar.ParallelConfig.from_overrides(["--precision", "bf16-pure"]).precision.params == "bfloat16"
    assert jaxpar.ParallelConfig().precision is None
    with pytest.raises(TypeError, match="precision=3"):
        jaxpar.ParallelConfig(precision=3)


def test_the_example_gpt_refuses_a_compute_dtype_it_would_ignore():
    """GPTConfig.dtype was accepted and ignored (the model computes in its parameters' dtype):
    a bf16 request now names the setting that does it."""
    from jaxpar.models.gpt import GPTConfig

    assert GPTConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match=r"GPTConfig.dtype='bfloat16'.*ParallelConfig\(precision='bf16'\)"):
        GPTConfig(dtype="bfloat16")
