"""The models' SwiGLU (jaxpar.ops.swiglu): the plain expression's values and gradients, with
fewer bytes kept for the backward in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.ops import swiglu

T, D, F, LAYERS = 4096, 256, 1024, 3


def _plain_swiglu(g, u):
    return jax.nn.silu(g) * u


def test_values_and_gradients_are_the_plain_expressions():
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    np.testing.assert_array_equal(swiglu(x, y), _plain_swiglu(x, y))
    got = jax.grad(lambda *a: jnp.sum(jnp.sin(swiglu(*a))), argnums=(0, 1))(x, y)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(_plain_swiglu(*a))), argnums=(0, 1))(x, y)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _temp_bytes(act) -> int:
    """Temporaries of the gradient of LAYERS bf16 SwiGLU MLP blocks of T tokens using ``act``."""
    def loss(ws, x):
        for w_in, w_gate, w_out in ws:
            h = act(x @ w_gate.astype(jnp.bfloat16), x @ w_in.astype(jnp.bfloat16))
            x = x + h @ w_out.astype(jnp.bfloat16)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    ws = [(jnp.ones((D, F)), jnp.ones((D, F)), jnp.ones((F, D))) for _ in range(LAYERS)]
    compiled = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((T, D), jnp.bfloat16)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_backward_keeps_fewer_tensors():
    """Measured from the compiled program: one ``[T, F]`` bf16 array fewer per layer whose
    activations wait for the backward (all but the last: the backward starts with it)."""
    saved = _temp_bytes(_plain_swiglu) - _temp_bytes(swiglu)
    assert saved >= (LAYERS - 1) * T * F * 2, saved / (T * F * 2)
