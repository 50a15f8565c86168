"""V-shape schedules (ZB-V, DualPipeV) and forward-only evaluation under a pipeline."""
import inspect
from fractions import Fraction

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import requires_devices
from helpers import batches
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.gpt_parallel import pipeline_loss
from jaxpar.pipeline import schedules as S
from jaxpar.pipeline import vshape
from jaxpar.pipeline import forward_only, lower
from jaxpar.pipeline.schedules import Kind

# one worker runs this module: its module-scoped fixtures are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("test_pipeline_v")

SIZES = [(p, m) for p in (2, 4, 8) for m in range(1, 4 * p + 1)]


# --------------------------------------------------------------------------- tables


def _zb_v_ticks(p, m):
    return 6 * m + p - 1 + max(0, 2 * p - 2 - m, 3 * (p - m))


def test_zb_v_length_with_fewer_microbatches_than_stages():
    # Read off the tables: with m < p one micro-batch's chain (4p + 2 ticks) sets the length.
    seen = {(2, 1): 10, (4, 1): 18, (4, 2): 21, (8, 1): 34, (8, 2): 37, (8, 3): 40, (8, 4): 43}
    assert {pm: S.build("zb-v", *pm).ticks for pm in seen} == seen
    assert {pm: vshape.zb_v_ticks(*pm) for pm in seen} == seen
    assert all(vshape.zb_v_ticks(p, m) == vshape.zb_v(p, m).ticks for p in (3, 5, 6, 16) for m in range(1, 2 * p + 2))


@pytest.mark.parametrize("p,m", SIZES)
def test_v_schedules_closed_forms_and_memory(p, m):
    one_f = max(S.peak_activations(S.one_f_one_b(p, m)))
    z = S.build("zb-v", p, m)
    S.validate(z)
    assert (z.virtual_stages, z.placement, z.ticks) == (2, "v", _zb_v_ticks(p, m))
    assert S.bubble_fraction(z) == Fraction(_zb_v_ticks(p, m) - 6 * m, _zb_v_ticks(p, m))
    # Chunk activations are half a stage's: 2p chunks = p stages = what 1F1B's first stage holds.
    assert max(S.peak_activations(z, until="W")) <= 2 * one_f
    if m >= 2 * p:
        d = S.build("dualpipe-v", p, m)
        S.validate(d)
        assert S.bubble_fraction(d) == Fraction(p - 1, 6 * m + p - 1)
        assert S.peak_activations(d, until="W") == [2 * p + 1] * p


def test_zb_v_beats_zb_h1_and_1f1b_at_p4_m8():
    bubble = {n: S.bubble_fraction(S.build(n, 4, 8)) for n in ("1f1b", "zb-h1", "zb-v", "dualpipe-v")}
    assert bubble["1f1b"] == Fraction(3, 11) and bubble["zb-h1"] == Fraction(3, 27)
    assert bubble["zb-v"] == Fraction(3, 51) <= Fraction(6, 100)      # 5.9 %
    assert bubble["dualpipe-v"] == bubble["zb-v"]
    one_f = S.peak_activations(S.build("1f1b", 4, 8))
    assert [Fraction(a, 2) for a in S.peak_activations(S.build("zb-v", 4, 8), until="W")] == [max(one_f)] * 4


def test_v_placement_keeps_the_turn_local_and_both_ends_on_stage_0():
    assert [S.location("v", 4, k) for k in (0, 3, 4, 7)] == [(0, 0), (3, 0), (3, 1), (0, 1)]
    program = lower(S.build("zb-v", 4, 8))
    assert set(program.sends_x) == {"next", "prev", "self"} and set(program.sends_g) == {"next", "prev", "self"}
    assert lower(S.build("1f1b", 4, 8)).sends_x == ("next",)   # loop placements move one way, as before


def test_v_schedule_errors():
    with pytest.raises(ValueError, match="dualpipe-v needs microbatches >= 2 \\* stages = 8, got microbatches=5"):
        S.build("dualpipe-v", 4, 5)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        S.build("zb-v", 4, 8, 2)


def test_forward_only_table_keeps_the_forwards():
    f = forward_only(S.build("zb-v", 4, 8))
    S.validate(f)
    assert {op.kind for row in f.table for op in row if op} == {Kind.F}
    # Stage p-1 runs both chunks of every micro-batch: (m + p - 1) full-stage forwards, as 1F1B.
    assert f.ticks == 2 * (8 + 4 - 1) == 2 * forward_only(S.build("1f1b", 4, 8)).ticks
    assert lower(f).forward_only and lower(f).g_slots == 0


# --------------------------------------------------------------------------- the GPT
# tests/test_pipeline_executor.py runs both V schedules at pipe=4 × data=2 against the
# sequential model (5 adamw steps); here the GPT trains through the Trainer at pipe=2 beside
# data=2 and Megatron TP (vocabulary split included), and evaluates without a backward.

GPT4 = GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=4, mlp=64, layers=4, scan_layers=True)
RULES = {"layers": "pipe", "batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}


def _trainer(config):
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    model = jaxpar.init(lambda: GPT(GPT4, rngs=nnx.Rngs(0)), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), pipeline_loss(), config, mesh)


def _train(config):
    trainer = _trainer(config)
    losses = [float(trainer.step(b)["loss"]) for b in batches(5)]
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), trainer


def _config(schedule, mesh=None):
    mesh = mesh or {"pipe": 2, "data": 2, "model": 2}
    return jaxpar.ParallelConfig(mesh=mesh, rules={k: r for k, r in RULES.items() if r in mesh},
                                 pipeline={"stages": mesh["pipe"], "microbatches": 4, "schedule": schedule})


@pytest.fixture(scope="module")
def reference():
    return _train(jaxpar.ParallelConfig(mesh={"data": 1}))[:2]


@pytest.fixture(scope="module")
def trained():
    return {name: _train(_config(name)) for name in ("zb-v", "dualpipe-v")}


@requires_devices(8)
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_v_schedules_train_the_gpt_like_one_device(reference, trained, schedule):
    losses, params, trainer = trained[schedule]
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1])):
        # 2e-5: the vocabulary-split loss sums its parts in another order than one device
        assert np.linalg.norm(a - e) / np.linalg.norm(e) <= 2e-5
    wq = trainer.params["blocks"]["attn"]["wq"].get_value()
    assert wq.addressable_shards[0].data.shape[0] == GPT4.layers // 2   # its two chunks only


def _flops(compiled):
    cost = compiled.cost_analysis()
    return sum(c.get("flops", 0.0) for c in cost) if isinstance(cost, list) else cost.get("flops", 0.0)


@requires_devices(8)
def test_evaluate_under_a_pipeline_runs_no_backward(trained):
    """The compiled pipelined evaluation costs at most the forward share of a device.

    XLA's cost analysis counts a loop body once, so the pipelined program reads low; what it
    cannot do is cost more than the unpipelined forward per device, as an evaluation that
    also ran the backward (three times a forward, and more with the recompute) would."""
    batch = batches(1)[0]
    piped = trained["zb-v"][2]
    plain = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"))
    forward = _flops(plain.lower_eval(batch).compile())
    assert 0.25 * forward < _flops(piped.lower_eval(batch).compile()) <= forward
    # the same number the next training step reports for its loss (taken before its update)
    np.testing.assert_allclose(piped.evaluate([batch]), float(piped.step(batch)["loss"]), rtol=1e-5)


@pytest.mark.parametrize("builder", [vshape.zb_v, vshape.dualpipe_v], ids=lambda b: b.__name__)
def test_v_docstrings_draw_their_real_timeline(builder):
    drawing = [line.strip() for line in inspect.getdoc(builder).split("::", 1)[1].strip().splitlines()]
    assert drawing == [line.strip() for line in S.grid(builder(2, 4))]


def test_job_search_prices_the_v_schedules_and_chooses_one():
    """Offered several schedules, the job search prices each from its lowered table (its steps,
    chunk costs and channels) and picks the fastest: a V schedule at pipe=2, m=4."""
    from helpers import COSTS
    from jaxpar.auto import JobSearchSpace, search_job

    gpt = GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=4, mlp=256, layers=4, scan_layers=True)
    space = JobSearchSpace(devices=8, memory_budget=1e12, zero_levels=(0,), grad_accum=(1,), pipeline_stages=(2,),
                           microbatches=(4,), meshes=[{"data": 8, "model": 1}],
                           schedule=("1f1b", "zb-h1", "zb-v", "dualpipe-v"))
    job = search_job(lambda: GPT(gpt, rngs=nnx.Rngs(0)), pipeline_loss(), batches(1, batch=32, seq=32)[0], space,
                     dry_run=False, cost_params=COSTS, base_config=jaxpar.ParallelConfig(mode="auto"))
    time = {o.pipeline["schedule"]: o.time_s for o in job.candidates if o.pipeline}
    assert set(time) == {"1f1b", "zb-h1", "zb-v", "dualpipe-v"}
    assert time["zb-v"] < time["zb-h1"] < time["1f1b"]
    assert job.config.pipeline.schedule in ("zb-v", "dualpipe-v")


def test_docstring_examples_run():
    import doctest

    from jaxpar.pipeline import drawing, program, stage_layout

    for module in (vshape, program, drawing, stage_layout):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted >= 2, module.__name__
