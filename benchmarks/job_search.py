"""The job search's recompute and pipeline prices against the compiled step.

For the scanned example GPT on 8 devices:

1. recompute policies x layer counts (data=8): predicted temp (the liveness walk with
   checkpoint regions and loop residuals) over ``memory_analysis`` temp;
2. pipeline stages x micro-batches (1F1B, data over the rest): `price_pipeline`'s
   arguments, temp and total over the compiled pipelined step's.

Needs 8 devices: it runs on 8 simulated CPU devices on any machine (``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here if unset); with
``JAX_PLATFORMS=cuda`` on 8 GPUs it reads their compiled programs instead.

    python benchmarks/job_search.py       # prints both tables, writes results/job_search_cpu.json
"""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")     # compiled programs, not timings: any machine
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.auto import CostParams, JobSearchSpace, build_graph, search_job  # noqa: E402
from jaxpar.auto.assign import hand_axes  # noqa: E402
from jaxpar.auto.cost import evaluate  # noqa: E402
from jaxpar.auto.job_search import _pipeline_config  # noqa: E402
from jaxpar.auto.pricing import stacked_params  # noqa: E402
from jaxpar.models.data import ArithmeticData  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from jaxpar.models.gpt_parallel import pipeline_loss  # noqa: E402
from jaxpar.nn.blocks import remat_loss  # noqa: E402
from jaxpar.report import memory  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COSTS = CostParams(flops_per_s=1e9, default_bandwidth=1e9, latency=1e-6)


def gpt(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=16, seq_len=32, embed=64, heads=4, mlp=256, layers=layers, scan_layers=True)


def compiled(model_fn, loss, config, batch):
    n = 1
    for v in config.mesh.values():
        n *= v
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:n])
    trainer = jaxpar.Trainer(jaxpar.init(model_fn, config, mesh), optax.adamw(1e-3), loss, config, mesh)
    return memory(trainer.lower(batch).compile())


def main():
    batch = ArithmeticData(32).batch(32, 0)
    rows = []
    print("recompute, scanned GPT (embed 64, seq 32, batch 32), data=8: predicted / compiled temp")
    print(f"{'layers':>6} {'remat':<16} {'pred temp':>12} {'compiled':>12} {'ratio':>7} {'pred step ms':>13}")
    for layers in (2, 4, 8):
        model_fn = lambda: GPT(gpt(layers), rngs=nnx.Rngs(0))  # noqa: E731
        for remat in ("none", "full", "dots_saveable"):
            # the policy on each block, as the job search prices it and the Trainer applies it
            config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", remat=remat)
            graph = build_graph(nnx.eval_shape(model_fn), remat_loss(nnx.eval_shape(model_fn), loss_fn, remat), batch)
            cost = evaluate(graph, hand_axes(graph, config, {"data": 8}), {"data": 8}, COSTS)
            mem = compiled(model_fn, loss_fn, config, batch)
            rows.append({"kind": "recompute", "layers": layers, "remat": remat, "temp_pred": cost.temp_bytes,
                         "temp_hlo": mem.temp_bytes, "time_s": cost.time_s})
            print(f"{layers:>6} {remat:<16} {cost.temp_bytes:>12,} {mem.temp_bytes:>12,} "
                  f"{cost.temp_bytes / mem.temp_bytes:>7.3f} {cost.time_s * 1e3:>13.4g}", flush=True)

    print("\npipeline, scanned GPT (4 layers), 1F1B, ZeRO 0: predicted / compiled")
    print(f"{'option':<40} {'args':>7} {'temp':>7} {'total':>7} {'pred step ms':>13}")
    model_fn = lambda: GPT(gpt(4), rngs=nnx.Rngs(0))  # noqa: E731
    base = jaxpar.ParallelConfig(mode="auto", optimizer=jaxpar.OptimizerConfig(threshold_kb=0))
    space = JobSearchSpace(devices=8, memory_budget=1e12, pipeline_stages=(2, 4), grad_accum=(1,), zero_levels=(0,))
    job = search_job(model_fn, pipeline_loss(), batch, space, base_config=base, cost_params=COSTS, dry_run=False)
    graph = build_graph(nnx.eval_shape(model_fn), pipeline_loss(), batch)
    blocks = {p for p, t in graph.params if t in stacked_params(graph, 4)}
    seen = set()
    for o in sorted(job.candidates, key=lambda o: (o.mesh["pipe"], o.pipeline["microbatches"])):
        key = (o.mesh["pipe"], o.pipeline["microbatches"])
        if key in seen or o.mesh.get("model", 1) > 1:
            continue
        seen.add(key)
        cfg = dataclasses.replace(_pipeline_config(o, base, blocks), optimizer=jaxpar.OptimizerConfig(level=0))
        mem = compiled(model_fn, pipeline_loss(), cfg, batch)
        rows.append({"kind": "pipeline", "option": o.label(), "args_pred": o.argument_bytes,
                     "args_hlo": mem.argument_bytes, "temp_pred": o.temp_bytes, "temp_hlo": mem.temp_bytes,
                     "total_pred": o.memory_bytes, "total_hlo": mem.total, "time_s": o.time_s})
        print(f"{o.label():<40} {o.argument_bytes / mem.argument_bytes:>7.3f} {o.temp_bytes / mem.temp_bytes:>7.3f} "
              f"{o.memory_bytes / mem.total:>7.3f} {o.time_s * 1e3:>13.4g}", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "job_search_cpu.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if len(jax.devices()) < 8:
        raise SystemExit(f"{os.path.basename(__file__)} compiles 8-device strategies; there are "
                         f"{len(jax.devices())} {jax.devices()[0].platform} devices: run it on 8 simulated "
                         "CPU devices (JAX_PLATFORMS=cpu, the default)")
    main()
