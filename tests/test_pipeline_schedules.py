"""Pipeline schedules as plain data: closed forms, dependencies, memory, errors (no devices)."""
import ast
import dataclasses
import doctest
import inspect
from fractions import Fraction

import pytest

from jaxpar.pipeline import drawing, table, vshape
from jaxpar.pipeline import schedules as S
from jaxpar.pipeline.schedules import Kind, Op

SIZES = [(p, m) for p in (2, 4, 8) for m in range(p, 4 * p + 1)]


def _closed_form(name, p, m, v=1):
    return Fraction(p - 1, {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m}[name]
                    + p - 1)


def _cases():
    for p, m in SIZES:
        for name in ("gpipe", "1f1b", "zb-h1"):
            yield name, p, m, 1
        if m % p == 0:
            for v in (2, 3):
                yield "interleaved", p, m, v


CASES = list(_cases())


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_bubble_equals_closed_form_and_schedule_is_valid(name, p, m, v):
    s = S.build(name, p, m, v)
    S.validate(s)
    assert S.bubble_fraction(s) == _closed_form(name, p, m, v)
    assert (s.stages, s.microbatches, s.virtual_stages) == (p, m, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_microbatch_runs_f_then_b_then_w_on_every_stage(name, p, m, v):
    s = S.build(name, p, m, v)
    for stage in range(p):
        first = {}
        for t, op in s.ops(stage):
            assert (op.kind, op.microbatch, op.chunk) not in first, "an op runs twice"
            first[(op.kind, op.microbatch, op.chunk)] = t
        for i in range(m):
            for c in range(v):
                f, b = first[(Kind.F, i, c)], first[(Kind.B, i, c)]
                assert f + s.cost(Kind.F) <= b
                if name == "zb-h1":
                    assert b + s.cost(Kind.B) <= first[(Kind.W, i, c)]
                else:
                    assert (Kind.W, i, c) not in first


@pytest.mark.parametrize("p,m", SIZES)
def test_peak_activations(p, m):
    assert S.peak_activations(S.gpipe(p, m)) == [m] * p
    one_f = S.peak_activations(S.one_f_one_b(p, m))
    assert one_f[0] <= p and one_f == [p - s for s in range(p)]
    zb = S.zb_h1(p, m)
    assert S.peak_activations(zb) == one_f
    assert max(S.peak_activations(zb, until="W")) <= p  # W-pending inputs stay bounded too


def test_interleaved_trades_memory_for_bubble():
    il, one_f = S.interleaved(4, 8, 2), S.one_f_one_b(4, 8)
    assert S.bubble_fraction(il) < S.bubble_fraction(one_f)
    # Units are chunk activations (half a stage's each): 11 chunks = 5.5 stages' worth.
    assert S.peak_activations(il) == [11, 9, 7, 5]


def test_fewer_microbatches_than_stages_is_allowed():
    for name in ("gpipe", "1f1b", "zb-h1"):
        s = S.build(name, 4, 2)
        S.validate(s)
    assert S.bubble_fraction(S.one_f_one_b(4, 2)) == Fraction(3, 5)


def test_single_stage_has_no_bubble():
    for name in S.SCHEDULES:
        assert S.bubble_fraction(S.build(name, 1, 3)) == 0


@pytest.mark.parametrize("call,words", [
    (lambda: S.build("gpipe", 0, 4), ["stages", "0", ">= 1"]),
    (lambda: S.build("1f1b", 4, 0), ["microbatches", "0"]),
    (lambda: S.build("1f1b", 4, 2.5), ["microbatches", "2.5"]),
    (lambda: S.build("interleaved", 4, 8, 0), ["virtual_stages", "0"]),
    (lambda: S.build("pipedream", 4, 8), ["'pipedream'", "gpipe", "1f1b", "interleaved",
                                          "zb-h1"]),
    (lambda: S.build("1f1b", 4, 8, 2), ["virtual_stages=2", "interleaved"]),
    (lambda: S.build("interleaved", 4, 6, 2), ["microbatches=6", "multiple", "p=4",
                                               "4 or 8"]),
    (lambda: S.build("interleaved", 4, 3, 2), ["microbatches=3", "microbatches=4"]),
    (lambda: S.peak_activations(S.gpipe(2, 2), until="X"), ["'X'", "'B'", "'W'"]),
])
def test_bad_inputs_raise_value_error_naming_value_and_fix(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def _replace_table(s, table):
    return dataclasses.replace(s, table=tuple(tuple(row) for row in table))


def test_validate_catches_broken_tables():
    good = S.gpipe(2, 2)  # stage0: F0 F1 . . . B0 B0 B1 B1 / stage1: . F0 F1 B0 B0 B1 B1 . .
    rows = [list(r) for r in good.table]
    # F1 on stage 0 delayed by a tick: stage 1 would use it before it exists.
    late = [list(r) for r in rows]
    late[1][0], late[2][0] = None, Op(Kind.F, 1)
    with pytest.raises(ValueError, match="F1 on stage 1 starts at tick 2 before F1 on stage 0 "
                                         r"ends \(tick 3\)"):
        S.validate(_replace_table(good, late))
    # A missing op.
    missing = [[None if op == Op(Kind.B, 1) else op for op in r] for r in rows]
    with pytest.raises(ValueError, match="never runs"):
        S.validate(_replace_table(good, missing))
    # A backward that fills one tick instead of two.
    t_b = next(t for t, r in enumerate(rows) if r[0] == Op(Kind.B, 0))
    short = [list(r) for r in rows]
    short[t_b + 1][0] = None
    with pytest.raises(ValueError, match="must fill 2 consecutive ticks"):
        S.validate(_replace_table(good, short))


def test_validate_catches_w_before_b():
    good = S.zb_h1(2, 2)
    rows = [list(r) for r in good.table]
    t_b = next(t for t, r in enumerate(rows) if r[1] == Op(Kind.B, 0))
    t_w = next(t for t, r in enumerate(rows) if r[1] == Op(Kind.W, 0))
    rows[t_b][1], rows[t_w][1] = rows[t_w][1], rows[t_b][1]
    with pytest.raises(ValueError, match="W0 on stage 1 starts"):
        S.validate(_replace_table(good, rows))


def test_timeline_text():
    text = S.timeline(S.zb_h1(2, 2))
    lines = text.splitlines()
    assert lines[0].startswith("zb-h1  p=2 m=2 v=1  ticks=7  bubble=1/7")
    assert lines[2].split() == ["stage0", "F0", "F1", ".", "B0", "W0", "B1", "W1"]
    wrapped = S.timeline(S.interleaved(2, 2, 2), wrap=5).splitlines()
    assert sum(line.startswith("tick") for line in wrapped) == -(-S.interleaved(2, 2, 2).ticks // 5)
    assert "F0b" in S.timeline(S.interleaved(2, 2, 2))


BUILDER_DRAWINGS = {
    S.gpipe: ((4, 4), None), S.one_f_one_b: ((4, 6), None), S.interleaved: ((4, 8, 2), 19),
    S.zb_h1: ((4, 8), None),
}


@pytest.mark.parametrize("builder", list(BUILDER_DRAWINGS), ids=lambda b: b.__name__)
def test_builder_docstrings_draw_their_real_timeline(builder):
    args, wrap = BUILDER_DRAWINGS[builder]
    doc = inspect.getdoc(builder)
    drawing = [line.strip() for line in doc.split("::", 1)[1].strip().splitlines()]
    assert drawing == [line.strip() for line in S.grid(builder(*args), wrap)]


@pytest.mark.parametrize("module", [S, table], ids=["schedules", "table"])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 3


@pytest.mark.parametrize("module", [S, table, vshape, drawing], ids=["schedules", "table", "vshape", "drawing"])
def test_schedules_module_does_not_import_jax(module):
    tree = ast.parse(inspect.getsource(module))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("jax", "jaxlib", "numpy")]


def test_plot_timeline_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "pipe.png"
    S.plot_timeline([S.one_f_one_b(4, 8), S.interleaved(4, 8, 2), S.zb_h1(4, 8)], str(path))
    assert path.stat().st_size > 1000
