"""Two networks in the cost model and the job search: links inside a host and a slower network
between hosts, priced separately; the search keeps the tensor axis inside a host."""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.auto import CostParams, JobSearchSpace, search_job
from jaxpar.auto.job_search import host_count, host_layouts
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn

INSIDE, BETWEEN = 1e10, 1e9         # bytes/s: the network between hosts 10x slower
TWO_HOSTS = CostParams(flops_per_s=1e9, default_bandwidth=INSIDE, latency=1e-6, inter_host_bandwidth=BETWEEN,
                       inter_host_latency=1e-5, devices_per_host=4)


def test_a_group_across_hosts_is_priced_hierarchically():
    sizes = {"data": 4, "model": 2}
    p = TWO_HOSTS.placed({"data": 2}, sizes)
    b = 1e6
    # 'model' stays inside a host: one network, as before
    assert p.collective_time("all-reduce", ("model",), b, sizes) == pytest.approx(1e-6 + 1.0 * b / INSIDE)
    # 'data' = 2 hosts x 2 inside: 2(a-1)/a b inside, then 2(h-1)/h (b/a) between; the slower latency
    assert p.collective_time("all-reduce", ("data",), b, sizes) == pytest.approx(1e-5 + b / INSIDE + (b / 2) / BETWEEN)
    # both axes: 4 per host, each device's quarter crosses
    assert p.collective_time("all-gather", ("data", "model"), b, sizes) == pytest.approx(
        1e-5 + 0.75 * b / INSIDE + 0.5 * (b / 4) / BETWEEN)
    # the one-axis figure `placed` writes gives the same time (what context / experts pricing reads)
    assert p.bandwidth["data"] == pytest.approx(1.5 / (1.0 / INSIDE + 0.5 / BETWEEN))
    assert p.latency_of(("data",)) == p.latency_per_axis["data"] == 1e-5 and p.latency_of(("model",)) == 1e-6
    # another layout drops the first's figures; without inter_host_bandwidth nothing changes
    q = p.placed({"model": 2}, sizes)
    assert set(q.bandwidth) == {"model"} and q.hosts == {"model": 2} and q.bandwidth["model"] == pytest.approx(BETWEEN)
    one = CostParams(flops_per_s=1e9, default_bandwidth=INSIDE, latency=1e-6).placed({"data": 2}, sizes)
    assert one.collective_time("all-reduce", ("data",), b, sizes) == pytest.approx(1e-6 + 1.5 * b / INSIDE)


def test_two_network_fields_are_checked_and_layouts_enumerated():
    for field, value in (("inter_host_bandwidth", 0), ("devices_per_host", 0), ("hosts", {"data": 0}),
                         ("inter_host_latency", -1.0)):
        with pytest.raises(ValueError, match=f"CostParams.{field}="):
            CostParams(**{field: value})
    with pytest.raises(ValueError, match="puts axis 'data' on 3 hosts, but the mesh .* gives it 4"):
        TWO_HOSTS.placed({"data": 3}, {"data": 4, "model": 2})
    assert host_layouts({"data": 4, "model": 2}, 2) == [{"data": 2}, {"model": 2}]
    assert host_layouts({"pipe": 2, "data": 2, "model": 2}, 4) == [{"pipe": 2, "data": 2}, {"pipe": 2, "model": 2},
                                                                   {"data": 2, "model": 2}]
    assert host_layouts({"data": 8}, 1) == [{}] and host_layouts({"data": 3}, 2) == []
    assert host_count(8, TWO_HOSTS) == 2 and host_count(4, TWO_HOSTS) == 1
    assert host_count(8, dataclasses.replace(TWO_HOSTS, inter_host_bandwidth=None)) == 1
    with pytest.raises(ValueError, match="devices=6 do not fill hosts of CostParams.devices_per_host=4"):
        host_count(6, TWO_HOSTS)


def llama():
    return Llama(LlamaConfig.named("tiny", embed=256, mlp=1024, max_seq_len=128), rngs=nnx.Rngs(0))


def tokens(rows, seq):
    t = np.arange(rows * seq, dtype=np.int32).reshape(rows, seq) % 64
    return {"inputs": t, "targets": t}


def weight_axes(strategy) -> set[str]:
    return {a for _, _, spec, _ in strategy.params for e in spec for a in ((e,) if isinstance(e, str) else e or ())}


def test_the_search_keeps_the_tensor_axis_inside_a_host():
    """8 devices on 2 hosts of 4, the network between them 10x slower, a Llama whose weights
    must be split to fit the budget: the axis the search splits the weights over (the tensor
    axis) stays inside a host and the other axis spans the hosts; the same mesh with the
    tensor axis across the hosts is predicted 2x slower."""
    base = jaxpar.ParallelConfig(mode="auto", optimizer=jaxpar.OptimizerConfig(threshold_kb=0))
    space = JobSearchSpace(devices=8, memory_budget=58e6, zero_levels=(0,), grad_accum=(1,),
                           meshes=[{"data": 2, "model": 4}])
    machine = dataclasses.replace(TWO_HOSTS, flops_per_s=1e12)
    job = search_job(llama, loss_fn, tokens(32, 128), space, base_config=base, cost_params=machine, dry_run=False)
    tensor = weight_axes(job.strategy)
    assert len(tensor) == 1 and not tensor & set(job.chosen.hosts)      # weights split inside a host
    assert job.config.hosts == job.chosen.hosts and math.prod(job.config.hosts.values()) == 2
    assert "hosts " in job.explain() and job.to_dict()["chosen"]["hosts"] == job.chosen.hosts
    # in mode auto an axis's name does not say what it carries: the label says what spans the hosts
    (spanning,) = job.chosen.hosts
    assert f"hosts {spanning}=2 (batch)" in job.chosen.label(), job.chosen.label()
    fitting = [o for o in job.candidates if o.memory_bytes <= 58e6]
    across = [o for o in fitting if weight_axes(o.strategy) & set(o.hosts)]
    assert across and min(o.time_s for o in across) > 1.5 * job.chosen.time_s
    assert all("weights" in o.label() for o in across)
    # one network: no layouts, the options of before
    flat = search_job(llama, loss_fn, tokens(32, 128), space, base_config=base,
                      cost_params=dataclasses.replace(machine, inter_host_bandwidth=None), dry_run=False)
    assert all(o.hosts is None for o in flat.candidates) and flat.config.hosts == {}


def test_an_option_label_says_what_each_axis_spanning_hosts_carries():
    """In mode auto an axis's name says nothing of what it carries: the label names it for each
    axis that spans hosts -- the batch, weights, ZeRO's shards, pipeline stages, the sequence,
    activations only, or nothing (its devices then repeat the same work)."""
    import types

    from jax.sharding import PartitionSpec as P

    from jaxpar.auto.job_search import JobOption

    def label(mesh, hosts, batch=P(), weights=P(), classes=(), **kw):
        strategy = types.SimpleNamespace(mesh=mesh, batch=(("x", batch),), params=(("w", (8, 8), weights, 64),),
                                         classes=classes)
        return JobOption(mesh=mesh, grad_accum=1, strategy=strategy, time_s=1.0, argument_bytes=0, temp_bytes=0,
                         hosts=hosts, **{"zero": 0, **kw}).label()

    two = {"data": 4, "model": 2}
    assert "hosts data=2 (batch)" in label(two, {"data": 2}, batch=P("data"))
    assert "hosts model=2 (weights)" in label(two, {"model": 2}, batch=P("data"), weights=P(None, "model"))
    assert "hosts data=2 (batch, ZeRO-3 shards)" in label(two, {"data": 2}, batch=P("data"), zero=3)
    assert "hosts pipe=2 (stages)" in label({"pipe": 2, "data": 4}, {"pipe": 2}, batch=P("data"),
                                            pipeline={"schedule": "1f1b", "microbatches": 4})
    assert "hosts model=2 (activations only)" in label(two, {"model": 2}, batch=P("data"),
                                                       classes=(("c1", 8, ("model",)),))
    assert "hosts model=2 (nothing: its devices repeat the same work)" in label(two, {"model": 2}, batch=P("data"))
