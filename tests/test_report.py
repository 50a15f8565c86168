"""Tests for jaxpar.report: the HLO collective parser on hand-written HLO, then real programs
compiled for 8 simulated CPU devices on a ("data"=2, "model"=4) mesh."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.report import (
    Collective,
    MemoryReport,
    collective_summary,
    collectives,
    flops,
    format_bytes,
    format_collectives,
    format_memory,
    memory,
    mfu,
)
from conftest import requires_devices

AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))


def _by_name(cols):
    return {c.name: c for c in cols}


def _module(body: str, *, computations: str = "", partitions: int = 8) -> str:
    """A minimal optimized-HLO module with an add reducer, as compiled.as_text() prints."""
    return f"""HloModule jit_f, is_scheduled=true, num_partitions={partitions}

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}}
{computations}
ENTRY %main.0_spmd (p0: f32[8,8]) -> f32[8,8] {{
  %p0 = f32[8,8]{{1,0}} parameter(0), sharding={{devices=[2,4]<=[8]}}
{body}
}}
"""


# ----------------------------------------------------------------------------- parser units

GROUP_SYNTAXES = _module("""\
  %ar.explicit = f32[8,8]{1,0} all-reduce(%p0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ag.iota = bf16[4,64]{1,0} all-gather(%p1), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true
  %rs.iota_t = s32[1,3]{1,0} reduce-scatter(%p2), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, to_apply=%add
  %ar.empty = f32[8,8]{1,0} all-reduce(%p0), channel_id=4, replica_groups={}, use_global_device_ids=true, to_apply=%add
  ROOT %ar.tuple = (f32[8]{0}, f32[8,32]{1,0}, bf16[4]{0}) all-reduce(%a, %b, %c), channel_id=5, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add""")


def test_explicit_and_iota_groups_map_to_mesh_axes(mesh):
    cols = _by_name(collectives(GROUP_SYNTAXES, mesh))
    assert list(cols) == ["ar.explicit", "ag.iota", "rs.iota_t", "ar.empty", "ar.tuple"]
    rows = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cols["ar.explicit"].replica_groups == rows
    assert cols["ag.iota"].replica_groups == rows
    # [4,2]<=[2,4]T(1,0): arange(8).reshape(2, 4).T -> the columns of the mesh.
    assert cols["rs.iota_t"].replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert cols["ar.empty"].replica_groups == (tuple(range(8)),)
    assert {n: c.mesh_axes for n, c in cols.items()} == {
        "ar.explicit": ("model",), "ag.iota": ("model",), "rs.iota_t": ("data",),
        "ar.empty": ("data", "model"), "ar.tuple": ("data",)}
    assert [(c.group_size, c.num_groups) for c in cols.values()] == [
        (4, 2), (4, 2), (2, 4), (8, 1), (2, 4)]


def test_bytes_follow_the_documented_convention_per_kind_and_dtype(mesh):
    cols = _by_name(collectives(GROUP_SYNTAXES, mesh))
    assert cols["ar.explicit"].bytes == 8 * 8 * 4                 # f32 result
    assert cols["ag.iota"].bytes == 4 * 64 * 2                    # bf16 gathered result
    assert cols["rs.iota_t"].bytes == 1 * 3 * 4 * 2               # s32 result x group of 2
    tup = cols["ar.tuple"]                                        # summed tuple buffers
    assert tup.bytes == 8 * 4 + 8 * 32 * 4 + 4 * 2
    assert tup.shapes == ((8,), (8, 32), (4,))
    assert (tup.dtype, cols["rs.iota_t"].dtype, cols["ag.iota"].dtype) == ("f32,bf16", "s32", "bf16")


def test_without_a_mesh_axes_are_unknown_but_groups_are_parsed():
    cols = collectives(GROUP_SYNTAXES)
    assert all(c.mesh_axes is None for c in cols)
    assert cols[0].replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_mesh_axes_replica_group_syntax(mesh):
    text = _module("""\
  %ag.mesh = f32[8,32]{0,1} all-gather(%p0), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
  %ar.flat = (f32[8]{0}, f32[8,32]{1,0}) all-reduce(%a, %b), channel_id=2, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %ag.sub = f32[16]{0} all-gather(%q), channel_id=3, replica_groups=mesh['a'=8] {'a':(2)2}, dimensions={0}
  %ag.iota_ids = f32[16]{0} all-gather(%q), channel_id=4, replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}, dimensions={0}
  ROOT %ag.list_ids = f32[16]{0} all-gather(%q), channel_id=5, replica_groups=mesh['x'=2,'y'=4], device_ids=(0,2,4,6,1,3,5,7) {'y'}, dimensions={0}""")
    cols = _by_name(collectives(text, mesh))
    assert cols["ag.mesh"].replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cols["ag.mesh"].mesh_axes == ("model",)
    assert cols["ar.flat"].replica_groups == (tuple(range(8)),)
    assert cols["ar.flat"].mesh_axes == ("data", "model")
    assert cols["ar.flat"].bytes == 8 * 4 + 8 * 32 * 4
    # 'a':(2)2 is the middle factor of a = 2 x 2 x 2: devices 2 apart.
    assert cols["ag.sub"].replica_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert cols["ag.sub"].mesh_axes is None        # half of "model": no whole mesh axis
    # device_ids [[0,2,4,6],[1,3,5,7]]: along x (columns), then along y (rows).
    assert cols["ag.iota_ids"].replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert cols["ag.list_ids"].replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


ASYNC = _module(computations="""
%wrapped_all_to_all (param: f32[8,8]) -> f32[8,8] {
  %param = f32[8,8]{1,0} parameter(0)
  ROOT %all-to-all.1 = f32[8,8]{1,0} all-to-all(%param), channel_id=9, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}, execution_thread="main"
""", body="""\
  %ars = f32[8,8]{1,0} all-reduce-start(%p0), channel_id=5, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[8,8]{1,0} all-reduce-done(%ars)
  %ags = (f32[8,8]{1,0}, f32[8,32]{1,0}) all-gather-start(f32[8,8]{1,0} %p0), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true
  %agd = f32[8,32]{1,0} all-gather-done(%ags)
  %cps = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%p0), channel_id=7, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[8,8]{1,0} collective-permute-done(%cps)
  %rss = ((f32[8,8]{1,0}), f32[2,8]{1,0}) reduce-scatter-start(%p0), channel_id=8, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add, use_global_device_ids=true
  %rsu = ((f32[8,8]{1,0}), f32[2,8]{1,0}) reduce-scatter-update(%rss)
  %rsd = f32[2,8]{1,0} reduce-scatter-done(%rsu)
  %a2as = ((f32[8,8]{1,0}), f32[8,8]{1,0}) async-start(%p0), calls=%wrapped_all_to_all
  ROOT %a2ad = f32[8,8]{1,0} async-done(%a2as)""")


def test_async_start_counted_once_and_done_ignored(mesh):
    cols = _by_name(collectives(ASYNC, mesh))
    assert sorted(cols) == ["ags", "all-to-all.1", "ars", "cps", "rss"]
    assert all(c.is_async for c in cols.values())
    assert {n: c.kind for n, c in cols.items()} == {
        "all-to-all.1": "all-to-all", "ars": "all-reduce", "ags": "all-gather",
        "cps": "collective-permute", "rss": "reduce-scatter"}
    assert {n: c.bytes for n, c in cols.items()} == {
        "all-to-all.1": 256, "ars": 256, "ags": 8 * 32 * 4,    # gathered result, not operand
        "cps": 256, "rss": 2 * 8 * 4 * 4}                       # result x group of 4
    assert cols["ags"].shapes == ((8, 32),)
    assert cols["all-to-all.1"].computation == "wrapped_all_to_all"


def test_async_start_wrapping_a_computation_is_not_counted_twice(mesh):
    text = _module(computations="""
%wrapped_rs (param: f32[8,8]) -> f32[2,8] {
  %param = f32[8,8]{1,0} parameter(0)
  ROOT %rs.inner = f32[2,8]{1,0} reduce-scatter(%param), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}
""", body="""\
  %rs.start = ((f32[8,8]{1,0}), f32[2,8]{1,0}) reduce-scatter-start(%p0), calls=%wrapped_rs
  ROOT %rs.done = f32[2,8]{1,0} reduce-scatter-done(%rs.start)""")
    (c,) = collectives(text, mesh)
    assert (c.name, c.kind, c.is_async, c.bytes, c.mesh_axes) == (
        "rs.inner", "reduce-scatter", True, 256, ("model",))


def test_size_one_axes_and_abstract_meshes():
    flat = _module("  ROOT %ar = f32[8]{0} all-reduce(%p0), replica_groups=mesh['axis_0'=8,"
                   "'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add")
    abstract = jax.sharding.AbstractMesh((1, 8, 1), ("pipe", "data", "model"))
    assert collectives(flat, abstract)[0].mesh_axes == ("data",)
    single = _module("  ROOT %ar = f32[8]{0} all-reduce(%p0), replica_groups={{0},{1},{2},{3},"
                     "{4},{5},{6},{7}}, to_apply=%add")
    assert collectives(single, abstract)[0].mesh_axes == ()


def test_collective_permute_pairs_become_groups(mesh):
    cols = _by_name(collectives(ASYNC, mesh))
    cp = cols["cps"]
    assert cp.source_target_pairs[:2] == ((0, 4), (4, 0))
    assert cp.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert cp.mesh_axes == ("data",)
    ring = _module("  ROOT %cp = f32[8,8]{1,0} collective-permute(%p0), channel_id=1, "
                   "source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}")
    (c,) = collectives(ring, mesh)
    assert (c.kind, c.mesh_axes, c.group_size, c.bytes) == ("collective-permute", ("model",), 4, 256)
    partial = _module("  ROOT %cp = f32[8,8]{1,0} collective-permute(%p0), source_target_pairs={{0,1}}")
    assert collectives(partial, mesh)[0].mesh_axes is None


LOOPS = _module(computations="""
%called (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar.called = f32[4]{0} all-reduce(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %ar.inner = f32[4]{0} all-reduce(%v), channel_id=6, replica_groups={}, use_global_device_ids=true, to_apply=%add
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %ar.inner)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %ar.body = f32[4]{0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %c = f32[4]{0} call(%ar.body), to_apply=%called
  %w.inner = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
}

%body_unknown (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %ar.unknown = f32[4]{0} all-reduce(%v), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %ar.unknown)
}
""", body="""\
  %ar.entry = f32[4]{0} all-reduce(%p), channel_id=3, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"dynamic_variables":[],"known_trip_count":{"n":"5"}}
  ROOT %w2 = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body_unknown""")


def test_collectives_inside_while_bodies_are_marked_in_loop(mesh):
    cols = _by_name(collectives(LOOPS, mesh))
    assert {n: (c.in_loop, c.executions) for n, c in cols.items()} == {
        "ar.called": (True, 5),      # reached through a call inside the loop body
        "ar.inner": (True, 10),      # nested loop: 5 x 2
        "ar.body": (True, 5),
        "ar.unknown": (True, None),  # no known_trip_count
        "ar.entry": (False, 1),
    }


def test_summary_totals_per_kind_axes_and_loop(mesh):
    cols = collectives(LOOPS, mesh)
    summary = collective_summary(cols)
    assert summary["count"] == 5 and summary["bytes"] == 5 * 16
    assert summary["executed_bytes"] is None              # one trip count unknown
    assert summary["in_loop"] == {"count": 4, "bytes": 64}
    assert summary["by_kind"] == {"all-reduce": {"count": 5, "bytes": 80}}
    assert summary["by_mesh_axes"] == {("data",): {"count": 1, "bytes": 16},
                                       ("data", "model"): {"count": 2, "bytes": 32},
                                       ("model",): {"count": 2, "bytes": 32}}
    known = [c for c in cols if c.executions is not None]
    assert collective_summary(known)["executed_bytes"] == 16 * (5 + 10 + 5 + 1)


def test_format_collectives_lists_every_instruction(mesh):
    cols = collectives(ASYNC, mesh)
    text = format_collectives(cols)
    for c in cols:
        assert c.name in text
    assert "reduce-scatter" in text and "f32[8,32]" in text and "2x4" in text
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(256) == "256 B"
    assert "loop x5" in format_collectives(collectives(LOOPS, mesh))


# ----------------------------------------------------------------------------- bad input

def test_rejects_non_program_input_with_type_name(mesh):
    with pytest.raises(TypeError, match="got int"):
        collectives(42)
    with pytest.raises(TypeError, match="jax.sharding.Mesh.*got str"):
        collectives(GROUP_SYNTAXES, mesh="data")
    with pytest.raises(TypeError, match="got dict"):
        memory({})
    with pytest.raises(TypeError, match="got str"):
        flops("HloModule")
    with pytest.raises(TypeError, match="Collective objects.*got int"):
        collective_summary([1])
    with pytest.raises(TypeError, match="MemoryReport.*got int"):
        format_memory(1)


def test_rejects_mesh_of_another_size_and_stablehlo(mesh):
    with pytest.raises(ValueError, match="runs on 4 devices but the mesh"):
        collectives(_module("", partitions=4), mesh)
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(4))
    with pytest.raises(TypeError, match=r"\.compile\(\)"):
        collectives(lowered)
    with pytest.raises(ValueError, match="StableHLO"):
        collectives(lowered.as_text())


def test_mfu_value_and_validation():
    assert mfu(4e15, 1.0, 1e15, 8) == pytest.approx(0.5)
    assert mfu(0, 2.0, 1e12, 1) == 0.0
    for kwargs, error in (({"num_devices": 0}, ValueError), ({"num_devices": True}, TypeError),
                          ({"num_devices": 2.0}, TypeError), ({"step_time_s": 0.0}, ValueError),
                          ({"peak_flops_per_device": math.nan}, ValueError),
                          ({"flops_per_step": -1.0}, ValueError), ({"step_time_s": "1"}, TypeError)):
        args = {"flops_per_step": 1e12, "step_time_s": 1.0, "peak_flops_per_device": 1e12,
                "num_devices": 1, **kwargs}
        name = next(iter(kwargs))
        with pytest.raises(error, match=name):
            mfu(**args)


# ----------------------------------------------------------------------------- compiled programs

def _compile(fn, mesh, in_specs, out_spec, *args):
    s = lambda spec: NamedSharding(mesh, spec)
    jitted = jax.jit(fn, in_shardings=tuple(s(p) for p in in_specs), out_shardings=s(out_spec))
    return jitted.lower(*args).compile()


B, K, N = 16, 32, 8
X = jax.ShapeDtypeStruct((B, K), jnp.float32)
W = jax.ShapeDtypeStruct((K, N), jnp.float32)


@requires_devices(8)
def test_tensor_parallel_matmul_all_reduces_over_model(mesh):
    compiled = _compile(jnp.matmul, mesh, (P("data", "model"), P("model", None)),
                        P("data", None), X, W)
    (ar,) = collectives(compiled, mesh)
    # Each device multiplies its [B/2, K/4] x [K/4, N] blocks; the partial [B/2, N] sums
    # are added over the 4 "model" devices of its row.
    assert (ar.kind, ar.mesh_axes, ar.group_size, ar.num_groups) == ("all-reduce", ("model",), 4, 2)
    assert ar.shapes == ((B // 2, N),) and ar.dtype == "f32"
    assert ar.bytes == (B // 2) * N * 4 == 256
    assert not ar.in_loop and ar.executions == 1
    # XLA counts one device's part (the [8, 8] x [8, 8] block product, plus the sums of the
    # all-reduce), not the 8x larger whole.
    block = 2 * (B // 2) * (K // 4) * N
    assert block <= flops(compiled) < 2 * block


@requires_devices(8)
def test_groups_are_mesh_positions_not_device_ids():
    devices = np.array(jax.devices())[::-1].reshape(2, 4)
    reversed_mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AUTO, AUTO))
    compiled = _compile(jnp.matmul, reversed_mesh, (P("data", "model"), P("model", None)),
                        P("data", None), X, W)
    (ar,) = collectives(compiled, reversed_mesh)
    assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ar.mesh_axes == ("model",)


@requires_devices(8)
def test_data_parallel_gradient_all_reduce_moves_the_parameter_bytes(mesh):
    params = {"w": jax.ShapeDtypeStruct((K, N), jnp.float32),
              "b": jax.ShapeDtypeStruct((N,), jnp.float32)}

    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    compiled = _compile(jax.grad(loss), mesh, (P(), P(("data", "model"))), P(), params, X)
    cols = collectives(compiled, mesh)
    assert cols and {c.kind for c in cols} == {"all-reduce"}
    assert {c.mesh_axes for c in cols} == {("data", "model")}
    param_bytes = sum(math.prod(p.shape) * p.dtype.itemsize for p in params.values())
    assert sum(c.bytes for c in cols) == param_bytes == (K * N + N) * 4


@requires_devices(8)
def test_splitting_a_contracted_result_reduces_the_block_over_model(mesh):
    compiled = _compile(jnp.matmul, mesh, (P("data", "model"), P("model", None)),
                        P("data", "model"), X, W)
    (c,) = collectives(compiled, mesh)
    # XLA may emit a reduce-scatter, or (the CPU compiler does) an all-reduce followed by a
    # slice; by the bytes convention both reduce the same [B/2, N] block over "model".
    assert c.kind in ("reduce-scatter", "all-reduce")
    assert c.mesh_axes == ("model",) and c.bytes == (B // 2) * N * 4


@requires_devices(8)
def test_resharding_all_gathers_over_model(mesh):
    compiled = _compile(lambda x: x * 2, mesh, (P("data", "model"),), P("data", None), X)
    (ag,) = collectives(compiled, mesh)
    assert (ag.kind, ag.mesh_axes, ag.shapes) == ("all-gather", ("model",), ((B // 2, K),))
    assert ag.bytes == (B // 2) * K * 4


@requires_devices(8)
def test_shard_map_collectives_each_kind_and_scan(mesh):
    def per_device(x):                                               # x: f32[8, 8]
        x = jax.lax.psum_scatter(x, "model", scatter_dimension=1, tiled=True)   # [8, 2]
        x = jax.lax.all_gather(x, "data", axis=0, tiled=True)                   # [16, 2]
        x = jax.lax.all_to_all(x, "model", 0, 0, tiled=True)                    # [16, 2]
        x = jax.lax.ppermute(x, "model", perm=[(i, (i + 1) % 4) for i in range(4)])

        def body(h, _):
            return jax.lax.pcast(jax.lax.psum(h, "data"), "data", to="varying"), None

        return jax.lax.scan(body, x, None, length=3)[0]

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=P("data", "model"),
                       out_specs=P("data", "model"))
    cols = collectives(jax.jit(fn).lower(X).compile(), mesh)
    got = {(c.kind, c.mesh_axes, c.bytes, c.in_loop, c.executions) for c in cols}
    assert got == {
        ("reduce-scatter", ("model",), 8 * 8 * 4, False, 1),   # operand = [8,2] result x 4
        ("all-gather", ("data",), 16 * 2 * 4, False, 1),
        ("all-to-all", ("model",), 16 * 2 * 4, False, 1),
        ("collective-permute", ("model",), 16 * 2 * 4, False, 1),
        ("all-reduce", ("data",), 16 * 2 * 4, True, 3),         # inside the scan's while body
    }
    assert len(cols) == 5


@requires_devices(8)
def test_memory_argument_bytes_of_an_array_split_over_all_devices(mesh):
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    spec = P(("data", "model"))
    m = memory(_compile(lambda x: x * 2, mesh, (spec,), spec, x))
    assert isinstance(m, MemoryReport)
    assert m.argument_bytes == 1024 * 1024 * 4 // 8
    assert m.output_bytes == 1024 * 1024 * 4 // 8
    assert m.total == m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
    assert "arguments" in format_memory(m) and "512.00 KiB" in format_memory(m)


def test_memory_and_flops_when_the_backend_reports_nothing(monkeypatch):
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 4)), jnp.ones((4, 4))).compile()
    monkeypatch.setattr(compiled, "memory_analysis", lambda: None)
    with pytest.raises(ValueError, match="memory_analysis"):
        memory(compiled)
    monkeypatch.setattr(compiled, "cost_analysis", lambda: [{"flops": 3.0}, {"flops": 4.0}])
    assert flops(compiled) == 7.0
    monkeypatch.setattr(compiled, "cost_analysis", lambda: {})
    with pytest.raises(ValueError, match="flops"):
        flops(compiled)


def test_collective_is_a_frozen_value():
    (c,) = collectives(_module("  ROOT %ar = f32[8,8]{1,0} all-reduce(%p0), to_apply=%add"))
    assert isinstance(c, Collective) and c.replica_groups == (tuple(range(8)),)
    with pytest.raises(AttributeError):
        c.bytes = 0


# ----------------------------------------------------------------------------- two networks

def test_hosts_of_groups_and_bytes_on_each_network(mesh):
    """Positions 0-3 on host 0, 4-7 on host 1: ('data'=2, 'model'=4) puts 'model' inside a host
    and 'data' across the two; a group over both is hierarchical (4 per host: 1/4 crosses)."""
    cols = _by_name(collectives(GROUP_SYNTAXES, mesh, hosts=[0] * 4 + [1] * 4))
    inside, across, both = cols["ar.explicit"], cols["ar.tuple"], cols["ar.empty"]
    assert (inside.mesh_axes, inside.crosses_hosts, inside.hosts_spanned) == (("model",), False, 1)
    assert (inside.intra_host_bytes, inside.inter_host_bytes) == (inside.bytes, 0)
    assert (across.mesh_axes, across.crosses_hosts) == (("data",), True)
    assert (across.intra_host_bytes, across.inter_host_bytes) == (0, across.bytes)    # one device per host
    assert (both.hosts_spanned, both.intra_host_bytes, both.inter_host_bytes) == (2, 256, 64)
    assert cols["rs.iota_t"].crosses_hosts and cols["ag.iota"].crosses_hosts is False
    summary = collective_summary(cols.values())
    assert summary["crossing_hosts"]["count"] == 3
    assert summary["inter_host_bytes"] == sum(c.inter_host_bytes for c in cols.values())
    text = format_collectives(cols.values())
    assert "inter-host" in text and "3 cross hosts" in text
    # the same groups on hosts interleaved (0,1,0,1,...): 'model' now crosses, 'data' does not
    flipped = _by_name(collectives(GROUP_SYNTAXES, mesh, hosts=[0, 1] * 4))
    assert flipped["ar.explicit"].crosses_hosts and not flipped["ar.tuple"].crosses_hosts


def test_host_map_defaults_to_the_mesh_processes_and_is_checked(mesh):
    one = collectives(GROUP_SYNTAXES, mesh)                   # one process: nothing crosses
    assert all(c.hosts_spanned == 1 and c.inter_host_bytes == 0 and c.num_hosts == 1 for c in one)
    assert "inter-host" not in format_collectives(one)        # one host: the table as before
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert all(c.crosses_hosts is None for c in collectives(GROUP_SYNTAXES, abstract))
    assert collective_summary(collectives(GROUP_SYNTAXES, abstract))["crossing_hosts"] is None
    with pytest.raises(ValueError, match="hosts has 4 entries but the program runs on 8 devices"):
        collectives(GROUP_SYNTAXES, mesh, hosts=[0, 0, 1, 1])


def test_permute_pairs_cross_hosts_by_pair(mesh):
    text = _module("""\
  ROOT %cp.ring = f32[8,8]{1,0} collective-permute(%p0), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}""")
    (inside,) = collectives(text, mesh, hosts=[0] * 4 + [1] * 4)
    assert (inside.crosses_hosts, inside.intra_host_bytes, inside.inter_host_bytes) == (False, 256, 0)
    (mixed,) = collectives(text, mesh, hosts=[0, 0, 1, 1, 0, 0, 1, 1])
    assert (mixed.crosses_hosts, mixed.intra_host_bytes, mixed.inter_host_bytes) == (True, 256, 256)
