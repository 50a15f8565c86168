"""The shard_map pipeline executor against the same model run sequentially on one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar.pipeline import executor as E
from jaxpar.pipeline import schedules as S
from jaxpar.pipeline.schedules import SCHEDULES, build
from conftest import requires_devices

LAYERS, WIDTH, OUT, M, MB = 8, 16, 3, 8, 4
STEPS = 5


# --------------------------------------------------------------------------- the model


def block(w, h):
    return jnp.tanh(h @ w["w"] + w["b"])


def stage_fn(chunk, x):
    """A chunk is a stack of blocks ``[n, ...]`` (a Python loop: half the compile time of a
    scan nested in the executor's vjp, switch and scan)."""
    for i in range(chunk["w"].shape[0]):
        x = block(jax.tree.map(lambda a: a[i], chunk), x)
    return x


def head_loss(head, y, target):
    return jnp.mean((y @ head["w"] - target) ** 2)


def init_params():
    k = jax.random.split(jax.random.key(0), 3)
    layers = {"w": jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) / 4,
              "b": jax.random.normal(k[1], (LAYERS, WIDTH)) * 0.1}
    return {"layers": layers, "head": {"w": jax.random.normal(k[2], (WIDTH, OUT))}}


def batches():
    """``STEPS`` batches of ``M`` micro-batches, stacked: ``[STEPS, M, MB, ...]``."""
    kx, kt = jax.random.split(jax.random.key(1))
    return (jax.random.normal(kx, (STEPS, M, MB, WIDTH)),
            jax.random.normal(kt, (STEPS, M, MB, OUT)))


def reference_loss(params, x, t):
    def layers(h):
        return jax.lax.scan(lambda h, w: (block(w, h), None), h, params["layers"])[0]

    return jnp.mean(jax.vmap(lambda xi, ti: head_loss(params["head"], layers(xi), ti))(x, t))


TX = optax.adamw(1e-2)


def train(value_and_grad, params, xs, ts):
    """``STEPS`` adamw steps in one scan: losses, first-step gradients, final parameters."""
    def step(carry, batch):
        params, opt = carry
        loss, grads, extra = value_and_grad(params, *batch)
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), (loss, (grads, extra))

    (params, _), (losses, grads) = jax.lax.scan(step, (params, TX.init(params)), (xs, ts))
    return losses, jax.tree.map(lambda g: g[0], grads), params


@functools.cache
def reference_run():
    """The model on one device, not pipelined: losses, first gradients, final parameters."""
    def value_and_grad(params, x, t):
        loss, (grads, g_x) = jax.value_and_grad(reference_loss, argnums=(0, 1))(params, x, t)
        return loss, grads, g_x

    return jax.jit(functools.partial(train, value_and_grad))(init_params(), *batches())


def pipeline_run(schedule, mesh, constrain=lambda tree, batch=False: tree):
    """The same steps with parameters kept in stage layout and the pipeline executor."""
    p, v, where = schedule.stages, schedule.virtual_stages, schedule.placement

    def value_and_grad(params, x, t):
        call = E.PipelineCall(stage_fn=stage_fn, loss_fn=head_loss, schedule=schedule, mesh=mesh)
        loss, (g_stage, g_head, g_x) = E.pipeline_value_and_grad(
            call, params["stages"], params["head"], *constrain((x, t), batch=True))
        return loss, {"stages": g_stage, "head": g_head}, g_x

    @jax.jit
    def run(init, xs, ts):
        staged = constrain({"stages": E.to_stage_layout(init["layers"], p, v, where),
                            "head": init["head"]})
        losses, (grads, g_x), params = train(value_and_grad, staged, xs, ts)

        def to_layers(tree):
            return {"layers": E.from_stage_layout(tree["stages"], p, v, where), "head": tree["head"]}

        return losses, (to_layers(grads), g_x), to_layers(params)

    return run(init_params(), *batches())


def assert_close(got, want, rtol=1e-5):
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(np.abs(b).max(), 1e-30)
        assert np.abs(a - b).max() <= rtol * scale, (path[0], np.abs(a - b).max() / scale)


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


def schedule_cases(p):
    return [build(name, p, M, 2 if name == "interleaved" else 1) for name in SCHEDULES]


# --------------------------------------------------------------------------- exactness


@requires_devices(8)
@pytest.mark.parametrize("name,p", [(n, p) for n in SCHEDULES for p in (2, 4)
                                    if not (n in ("zb-v", "dualpipe-v") and p == 2)])   # p=2: tests/test_pipeline_v.py
def test_every_schedule_matches_the_sequential_model(name, p):
    schedule = build(name, p, M, 2 if name == "interleaved" else 1)
    if schedule.placement == "v":   # pipe=4 with data parallel beside: the batch split over "data"
        mesh = mesh_of((p, 2), ("pipe", "data"))
        constrain = lambda tree, batch=False: (  # noqa: E731
            jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P(None, "data"))) if batch else tree)
        losses, (grads, g_x), params = pipeline_run(schedule, mesh, constrain)
    else:
        losses, (grads, g_x), params = pipeline_run(schedule, mesh_of((p,), ("pipe",)))
    ref_losses, ref_grads, ref_params = reference_run()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(grads, ref_grads[0])
    assert_close(g_x, ref_grads[1])  # the input gradient, for an embedding upstream
    assert_close(params, ref_params)


def _sharded_3d(mesh):
    def constrain(tree, batch=False):
        if batch:  # micro-batches [m, mb, ...]: the batch axis over "data"
            return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P(None, "data")))
        specs = {"stages": {"w": P("pipe", None, None, "model"), "b": P("pipe", None, "model")},
                 "head": {"w": P("model")}}
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        return jax.lax.with_sharding_constraint(tree, shardings)

    return constrain


@requires_devices(8)
@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in ("zb-v", "dualpipe-v")])  # tests/test_pipeline_v.py
def test_pipe_data_model_mesh_matches_the_sequential_model(name):
    mesh = mesh_of((2, 2, 2), ("pipe", "data", "model"))
    schedule = build(name, 2, M, 2 if name == "interleaved" else 1)
    losses, (grads, g_x), params = pipeline_run(schedule, mesh, _sharded_3d(mesh))
    ref_losses, ref_grads, ref_params = reference_run()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(grads, ref_grads[0])
    assert_close(g_x, ref_grads[1])
    assert_close(params, ref_params)


@requires_devices(4)
def test_pipeline_loss_is_differentiable_through_an_embedding():
    vocab, p, m = 11, 4, 4
    k = jax.random.split(jax.random.key(2), 3)
    params = {**init_params(), "emb": jax.random.normal(k[0], (vocab, WIDTH))}
    tokens = jax.random.randint(k[1], (m * 2, 5), 0, vocab)
    targets = jax.random.normal(k[2], (m * 2, 5, OUT))

    def loss(params, run):
        return run(params["layers"], params["head"], params["emb"][tokens], targets)

    def reference(layers, head, x, t):
        return reference_loss({"layers": layers, "head": head}, x[None], t[None])

    def piped(layers, head, x, t):
        f = E.pipeline_loss(stage_fn, head_loss, build("zb-h1", p, m), mesh_of((p,), ("pipe",)))
        return f(E.to_stage_layout(layers, p), head, x.reshape(m, -1, *x.shape[1:]),
                 t.reshape(m, -1, *t.shape[1:]))

    want = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, reference)
    got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, piped)
    assert_close(got, want)


# --------------------------------------------------------------------------- memory


@requires_devices(4)
def test_1f1b_holds_less_temp_memory_than_gpipe():
    p, m, mb, width = 4, 8, 512, 32  # activations (64 KiB each) dominate the parameters
    mesh = mesh_of((p,), ("pipe",))
    stages = jax.ShapeDtypeStruct((p, 2, width, width), jnp.float32)
    stages = {"w": stages, "b": jax.ShapeDtypeStruct((p, 2, width), jnp.float32)}
    head = {"w": jax.ShapeDtypeStruct((width, OUT), jnp.float32)}
    x = jax.ShapeDtypeStruct((m, mb, width), jnp.float32)
    t = jax.ShapeDtypeStruct((m, mb, OUT), jnp.float32)

    def temp_bytes(name):
        run = functools.partial(E.pipeline_value_and_grad, E.PipelineCall(
            stage_fn=stage_fn, loss_fn=head_loss, schedule=build(name, p, m), mesh=mesh))
        return jax.jit(run).lower(stages, head, x, t).compile().memory_analysis().temp_size_in_bytes

    gpipe, one_f = temp_bytes("gpipe"), temp_bytes("1f1b")
    activation = mb * width * 4
    # GPipe buffers all m=8 inputs per stage, 1F1B at most p=4: 4 activations fewer at least.
    assert one_f <= gpipe - 4 * activation, (one_f, gpipe)


# --------------------------------------------------------------------------- lowering


def _simulate(schedule, program):
    """Run a Program with labels instead of arrays; every read must find the right item."""
    p, where = schedule.stages, schedule.placement
    shift = {"next": 1, "prev": -1, "self": 0}
    xbuf = [[None] * (program.x_slots + 1) for _ in range(p)]
    gbuf = [[None] * (program.g_slots + 1) for _ in range(p)]
    fmsg, bmsg, ran = {}, {}, []
    for k in range(program.steps):
        new_f, new_b = {}, {}
        for s in range(p):
            row = program.code[k, s]
            for c in E.CHANNELS:   # a message travels on every channel the placement uses
                xbuf[s][row[E.RECV_X[c]]] = fmsg.get(((s - shift[c]) % p, c))
                gbuf[s][row[E.RECV_G[c]]] = bmsg.get(((s - shift[c]) % p, c))
            op, i, c = int(row[E.OP]), int(row[E.MB]), int(row[E.CHUNK])
            if op == E.IDLE:
                continue
            vs = S.virtual_stage(where, p, s, c)
            ran.append((s, op, i, c))
            want = ("in", i) if vs == 0 else ("act", i, vs - 1)
            assert (("in", i) if row[E.FROM_INPUT] else xbuf[s][row[E.X_SLOT]]) == want
            if op in (E.B, E.W):
                assert gbuf[s][row[E.G_SLOT]] == ("grad", i, vs + 1)
            for ch in program.sends_x:
                new_f[(s, ch)] = ("act", i, vs) if op == E.F else None
            for ch in program.sends_g:
                new_b[(s, ch)] = ("grad", i, vs) if op in (E.B, E.B_LAST) else None
            if op in (E.B, E.B_LAST):
                assert row[E.DX_MB] == (i if vs == 0 else schedule.microbatches)
        fmsg, bmsg = new_f, new_b
    return ran


@pytest.mark.parametrize("name,p,m,v", [(n, p, m, 2 if n == "interleaved" else 1)
                                        for n in SCHEDULES for p in (1, 2, 4) for m in (4, 8)
                                        if not (n == "dualpipe-v" and m < 2 * p)])
def test_lowered_program_delivers_every_input_and_gradient(name, p, m, v):
    schedule = build(name, p, m, v)
    program = E.lower(schedule)
    ran = _simulate(schedule, program)
    kinds = 3 if schedule.split_backward else 2
    assert len(ran) == len(set(ran)) == p * m * schedule.virtual_stages * kinds
    assert program.steps <= schedule.ticks


def test_buffers_follow_the_schedule_memory():
    gpipe, one_f = E.lower(build("gpipe", 4, 8)), E.lower(build("1f1b", 4, 8))
    assert gpipe.x_slots == 8 and one_f.x_slots == 4


def test_stage_layout_round_trip_and_order():
    layers = jnp.arange(24).reshape(12, 2)
    staged = E.to_stage_layout(layers, 2, 3)
    assert staged.shape == (6, 2, 2)
    # Stage 0 holds chunks 0, 2, 4 (layers 0-1, 4-5, 8-9), stage 1 chunks 1, 3, 5.
    assert staged[:3, :, 0].tolist() == [[0, 2], [8, 10], [16, 18]]
    np.testing.assert_array_equal(E.from_stage_layout(staged, 2, 3), layers)
    with pytest.raises(ValueError, match="size 12 .* stages\\*virtual_stages=8"):
        E.to_stage_layout(layers, 4, 2)


# --------------------------------------------------------------------------- errors


@requires_devices(4)
def test_bad_arguments_raise_value_errors():
    mesh = mesh_of((4,), ("pipe",))
    params = init_params()
    x, t = (a[0] for a in batches())
    call = functools.partial(E.PipelineCall, stage_fn=stage_fn, loss_fn=head_loss, mesh=mesh)
    staged = E.to_stage_layout(params["layers"], 4)
    with pytest.raises(ValueError, match="stages=2 but mesh axis 'pipe' has size 4"):
        call(schedule=build("1f1b", 2, M))
    with pytest.raises(ValueError, match="'stage' is not in the mesh axes"):
        call(schedule=build("1f1b", 4, M), axis="stage")
    with pytest.raises(TypeError, match=r"PipelineCall\(schedule=...\) must be a jaxpar.pipeline.Schedule"):
        call(schedule="1f1b")
    run = functools.partial(E.pipeline_value_and_grad, call(schedule=build("1f1b", 4, M)))
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(8, 16\).*stages\*virtual"):
        run(params["layers"], params["head"], x, t)
    with pytest.raises(ValueError, match="inputs has shape .* 8 micro-batches"):
        run(staged, params["head"], x[:3], t)
    with pytest.raises(ValueError, match="same shape and dtype"):
        E.pipeline_value_and_grad(call(stage_fn=lambda c, h: h[:, :2], schedule=build("1f1b", 4, M)),
                                  staged, params["head"], x, t)


@requires_devices(2)
def test_head_and_targets_are_optional():
    mesh, params = mesh_of((2,), ("pipe",)), init_params()
    x = batches()[0][0]

    def loss(y):
        return jnp.mean(y ** 2)

    call = E.PipelineCall(stage_fn=stage_fn, loss_fn=lambda head, y, target: loss(y), schedule=build("zb-h1", 2, M),
                          mesh=mesh)
    got = jax.jit(lambda st, x: E.pipeline_value_and_grad(call, st, None, x))(
            E.to_stage_layout(params["layers"], 2), x)
    want = jax.value_and_grad(lambda layers, x: jnp.mean(jax.vmap(
        lambda xi: loss(stage_fn(layers, xi)))(x)), argnums=(0, 1))(params["layers"], x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1][1] is None
    assert_close((E.from_stage_layout(got[1][0], 2), got[1][2]), want[1])


def test_docstring_examples_run():
    import doctest

    import jaxpar.pipeline
    import jaxpar.pipeline.call
    import jaxpar.pipeline.stage_layout
    import jaxpar.pipeline.vshape

    for module in (jaxpar.pipeline.stage_layout, jaxpar.pipeline.vshape, jaxpar.pipeline, jaxpar.pipeline.call):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0


@requires_devices(2)
def test_the_former_call_form_warns_and_gives_the_same_values():
    """0.1.0's ``pipeline_value_and_grad(stage_fn, loss_fn, schedule, mesh, ...)`` and
    ``pipeline_forward(...)`` still run, warning with the ``PipelineCall`` spelling."""
    mesh, params = mesh_of((2,), ("pipe",)), init_params()
    x, t = (a[0] for a in batches())
    staged, schedule = E.to_stage_layout(params["layers"], 2), build("1f1b", 2, M)
    call = E.PipelineCall(stage_fn=stage_fn, loss_fn=head_loss, schedule=schedule, mesh=mesh, axis="pipe")
    want = E.pipeline_value_and_grad(call, staged, params["head"], x, t)
    with pytest.warns(DeprecationWarning, match=r"call jaxpar.pipeline.pipeline_value_and_grad\(PipelineCall\("):
        got = E.pipeline_value_and_grad(stage_fn, head_loss, schedule, mesh, staged, params["head"], x, targets=t,
                                        axis="pipe")
    assert_close(got, want)
    with pytest.warns(DeprecationWarning, match=r"jaxpar.pipeline.pipeline_forward\(stage_fn, loss_fn"):
        forward = E.pipeline_forward(stage_fn, head_loss, schedule, mesh, staged, params["head"], x, t)
    np.testing.assert_allclose(forward, E.pipeline_forward(call, staged, params["head"], x, t), rtol=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'axes' .*call jaxpar.pipeline.pipeline_forward"):
        E.pipeline_forward(stage_fn, head_loss, schedule, mesh, staged, params["head"], x, t, axes="pipe")
