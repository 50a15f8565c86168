"""The planner against published multi-node runs (Megatron-LM, MaxText, gpu-recipes).

For each run in ``benchmarks/published_runs.json`` (figures, sources, quotes, status), on a
machine built from datasheet figures (`machine`: H100 / H200 nodes of 8 GPUs on NVLink and
8 x 400 Gb/s InfiniBand, a TPU v5p slice on ICI):

1. **the published layout**: TP on ``model``, DP (and FSDP) on the batch, PP as pipeline stages,
   the published global batch, sequence length, bf16 compute and recompute policy (``remat`` in
   the runs file: MaxText's ``minimal_flash`` is jaxpar's ``dots_saveable`` under fused
   attention; the 70B runs' MLP-recomputing policies are jaxpar's ``dots_except_mlp`` and
   ``dots_except_mlp_in``); jaxpar predicts the step time
   (`jaxpar.auto.pricing.price` / `price_pipeline` on the hand-written strategy), the memory per
   device and the MFU. MFU is counted as the publisher counts it (`publisher_flops`: Megatron's
   and MaxText's formulas, both with full, non-causal attention), so predicted / published MFU
   is published / predicted step time.
2. **the planner's own choice**: `jaxpar.auto.search_job` over ``data x model`` meshes (model
   1, 2, 4, 8: inside a node) and, where the device count has an odd factor, ``replica x data x
   model`` meshes with that factor on ``replica`` (ZeRO shards over ``data`` alone, a power of
   two that divides the weights), else ``replica x data`` with ``data`` one host (ZeRO inside a
   host, data parallel across), ZeRO 0/1/3, micro-batches and recompute (none, full, and the
   four matmul-saving policies), within the device's memory, and its predicted step time.

Models are abstract (`nnx.eval_shape`): the graph is traced at full size with scanned layers
(shapes only; nothing is allocated). The machine is calibrated by measurement, not by the
published runs (`gpu_calibration`: jaxpar's Llama-1B step profiled on an H200): the sustained
FLOP/s is the datasheet peak times the fraction that step's matmul and attention kernels
reached (of the cost model's FLOPs, attention's products counted whole), and the operators that are not matmuls are priced by the bytes they move
(`CostParams.memory_bandwidth`) at each device's datasheet memory rate times the factor that
step's other kernels reached. No TPU was measured: the v5p row is priced at the GPU's fraction.
One run is fitted (``FIT``), every other run is held out: the A3 network's collectives are
priced exposed (``collective_overlap: false`` in the runs file), a choice made on
``maxtext_llama2_7b_16gpu``. Every GPU run uses fused attention (`CostParams.fused_attention`:
Transformer Engine / cuDNN flash attention, TPU Splash) and the Megatron rows its distributed
optimizer's bf16 parameter gather (``MEGATRON_GATHER``).

    python benchmarks/published.py            # ~17 min on 2 CPU cores: table, JSON, plot
    python benchmarks/published.py --quick    # two small rows, no search, no plot (the test)
    python benchmarks/published.py --runs megatron_70b --no-search --out /tmp/p.json   # a subset
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.auto import CostParams, JobSearchSpace, build_graph, search_job  # noqa: E402
from jaxpar.auto.cost import evaluate, flags_for, op_terms  # noqa: E402
from jaxpar.auto.assign import hand_axes  # noqa: E402
from jaxpar.auto.pricing import PipelineShape, price, price_pipeline  # noqa: E402
from jaxpar.models.gpt import GPT, GPTConfig  # noqa: E402
from jaxpar.models.gpt import loss_fn as gpt_loss  # noqa: E402
from jaxpar.models.gpt_parallel import pipeline_loss as gpt_pipeline  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig  # noqa: E402
from jaxpar.models.llama import loss_fn as llama_loss  # noqa: E402
from jaxpar.models.llama_report import llama_flops_per_token  # noqa: E402
from jaxpar.nn.blocks import remat_loss  # noqa: E402

HERE = pathlib.Path(__file__).parent
RUNS = HERE / "published_runs.json"
PROFILE = HERE / "results" / "gpu_probe_h200_1b.json"    # the one GPU profile: `gpu_calibration`
FIT = ("maxtext_llama2_7b_16gpu",)   # the one fitted run: the A3 network's collective overlap is chosen on it
QUICK = ("megatron_1.7b", "maxtext_llama2_7b_8gpu")
# the recompute policies the planner chooses from
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "dots_except_mlp", "dots_except_mlp_in")
# Megatron's distributed optimizer keeps the fp32 main weights in its shards and all-gathers the
# bf16 model weights after the step (its gradients are reduced in fp32: --accumulate-allreduce-
# grads-in-fp32 is forced for bf16 unless --grad-reduce-in-bf16)
MEGATRON_GATHER = 2


def machine(hw: dict, fraction: float, memory_factor: float) -> CostParams:
    """`CostParams` of one device kind from its datasheet figures: bytes/s one way on the fast
    links (NVLink / ICI: half the bidirectional figure), the slower network per device,
    ``fraction`` of the peak FLOP/s sustained, and the memory's datasheet rate times
    ``memory_factor`` for the operators that are not matmuls (`gpu_calibration`)."""
    peak = hw["peak_flops"]["value"]
    overlap = hw.get("collective_overlap", True)     # False: every collective exposed (A3: fitted, see FIT)
    memory = hw["hbm_bytes_per_s"]["value"] * memory_factor
    if "ici_bytes_per_s" in hw:      # TPU v5p: one slice is the fast domain
        return CostParams(flops_per_s=peak * fraction, default_bandwidth=hw["ici_bytes_per_s"]["value"] / 2,
                          inter_host_bandwidth=hw["dcn_bits_per_s_per_chip"]["value"] / 8, overlap=True,
                          matmul_overlap=True, fused_attention=True, memory_bandwidth=memory)
    return CostParams(flops_per_s=peak * fraction, default_bandwidth=hw["nvlink_bytes_per_s"]["value"] / 2,
                      inter_host_bandwidth=hw["inter_host_bits_per_s_per_gpu"]["value"] / 8,
                      devices_per_host=hw["devices_per_host"], overlap=overlap, matmul_overlap=overlap,
                      fused_attention=True, memory_bandwidth=memory)


def _kernel_kind(name: str) -> str:
    """A profiled GPU kernel's kind: cuBLAS / Triton matmuls, cuDNN's fused attention, or the rest
    (XLA's elementwise and reduction fusions, copies, the optimizer)."""
    if name.startswith(("nvjet", "sm90_xmma", "cutlass")) or "gemm" in name:
        return "matmul"
    if "cudnn" in name or "sdpa" in name or "fmha" in name or "flash" in name:
        return "attention"
    return "other"


def gpu_calibration() -> dict:
    """The rates a GPU reaches, from the one measured profile (``PROFILE``: jaxpar's
    Llama-3.2-1B-shape step on one H200, bf16, 8 x 2048 tokens, the loss in 8 chunks; its top
    kernels by time).

    - **Matmuls** (``matmul_fraction``): the cost model's matmul FLOPs of that step (attention's
      score and value products included, as the model prices them) over the time of its matmul
      and fused-attention kernels, as a fraction of the H200's datasheet peak: the sustained
      fraction every row is priced with (the TPU's too: no TPU was measured).
    - **The other operators** (``factor``): the step's time less its matmul and attention
      kernels is what they took; the cost model's bytes for them (`CostParams.memory_bandwidth`:
      each one's largest operand, three times) over that time is the rate they reached, and that
      rate over the H200's datasheet memory bandwidth is the factor applied to every device's
      datasheet figure. The factor is an effective one, not a memory rate: the bytes are a proxy
      (fused chains not merged), and the time includes the optimizer's update, which the step's
      price has no term of its own for.

    Kernels below the top 40 are counted as "other" (every matmul and attention kernel of the
    step is in the top 40)."""
    prof = json.loads(PROFILE.read_text())["1b step"]
    top = prof["top_ops"]
    kinds = {"matmul": 0.0, "attention": 0.0}
    for row in top["rows"]:
        kind = _kernel_kind(row["op"])
        if kind in kinds:
            kinds[kind] += row["ms_per_step"] / 1e3
    other_s = top["all_ms_per_step"] / 1e3 - kinds["matmul"] - kinds["attention"]
    cfg = dataclasses.replace(LlamaConfig.named("1b", loss_chunks=prof["loss_chunks"]), dtype="bfloat16")
    graph = build_graph(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), llama_loss, tokens(8, 2048))
    axes = [()] * graph.num_classes
    flops_only = evaluate(graph, axes, {}, CostParams(fused_attention=True)).compute_s
    per_byte = evaluate(graph, axes, {}, CostParams(fused_attention=True, memory_bandwidth=1.0)).compute_s
    moved = per_byte - flops_only        # seconds at 1 B/s: the operators' bytes
    flags = flags_for(graph, CostParams(fused_attention=True))
    matmul_flops = sum(op_terms(graph, op, axes, {}, flags)[0] for op in graph.ops if op.prim == "dot_general")
    peak = HARDWARE["h200"]["peak_flops"]["value"]
    datasheet = HARDWARE["h200"]["hbm_bytes_per_s"]["value"]
    return {"profile": str(PROFILE.relative_to(HERE.parent)), "device": "NVIDIA H200", "step_s": top["all_ms_per_step"] / 1e3,
            "matmul_s": kinds["matmul"], "attention_s": kinds["attention"], "other_s": other_s,
            "matmul_flops": matmul_flops, "matmul_fraction": matmul_flops / (kinds["matmul"] + kinds["attention"]) / peak,
            "modelled_bytes": moved, "effective_bytes_per_s": moved / other_s, "datasheet_bytes_per_s": datasheet,
            "factor": moved / other_s / datasheet}


def abstract_model(run: dict):
    s = run["shape"]
    if run["model"] == "gpt":
        cfg = GPTConfig(vocab_size=s["vocab"], seq_len=run["seq_len"], embed=s["embed"], heads=s["heads"],
                        mlp=s["mlp"], layers=s["layers"], scan_layers=True)
        return (lambda: GPT(cfg, rngs=nnx.Rngs(0))), gpt_loss, cfg
    cfg = LlamaConfig(vocab_size=s["vocab"], embed=s["embed"], heads=s["heads"], kv_heads=s["kv_heads"],
                      mlp=s["mlp"], layers=s["layers"], max_seq_len=run["seq_len"], scan_layers=True,
                      dtype="bfloat16")
    return (lambda: Llama(cfg, rngs=nnx.Rngs(0))), llama_loss, cfg


def publisher_flops(run: dict, cfg) -> float:
    """Model FLOPs of one step as the publisher counts them (full attention, not halved)."""
    b, s = run["global_batch"], run["seq_len"]
    if run["flop_count"] == "megatron":     # 72 B s L h^2 (1 + s / 6h + V / 12 h L)
        h, L, V = cfg.embed, cfg.layers, cfg.vocab_size
        return 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    f = llama_flops_per_token(cfg, s)        # MaxText before its causal halving: attention twice
    return (f.dense + 2 * f.attention) * b * s


def tokens(rows: int, seq: int) -> dict:
    x = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    return {"inputs": x, "targets": x}


def layout(run: dict) -> tuple[dict, dict, str, int]:
    """(mesh sizes, hosts each axis spans, batch rule axes, micro-batches) of the published layout."""
    lay, n = run["layout"], run["devices"]
    if lay["fsdp"] > 1:      # MaxText: FSDP inside a node (or over fsdp_hosts), DP across
        sizes = {"dp": lay["dp"], "fsdp": lay["fsdp"]}
        hosts = {"dp": lay["dp"], "fsdp": lay.get("fsdp_hosts", 1)} if "ici_bytes_per_s" not in HARDWARE.get(
            run["hardware"], {}) else {}
        return sizes, hosts, ("dp", "fsdp"), 1
    sizes = {"data": lay["dp"], "model": lay["tp"]}
    nodes = n // 8
    hosts = {"data": nodes // lay["pp"]} if nodes > 1 else {}
    if lay["pp"] > 1:
        hosts = {"pipe": lay["pp"], "data": lay["dp"]}
    return sizes, hosts, "data", run["global_batch"] // lay["dp"]     # one sequence per rank per micro-batch


def predict(run: dict, params: CostParams) -> dict:
    """Step time, memory per device and MFU jaxpar predicts for the published layout."""
    model_fn, loss_fn, cfg = abstract_model(run)
    model = nnx.eval_shape(model_fn)
    sizes, hosts, batch_axes, k = layout(run)
    lay = run["layout"]
    rules = {"batch": batch_axes}
    if lay["tp"] > 1:
        rules |= {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    config = jaxpar.ParallelConfig(mesh=sizes, rules=rules)
    if run.get("sequence_parallel", {}).get("value") and SEQUENCE_PARALLEL[0]:   # see the runs file's "why"
        params = dataclasses.replace(params, sequence_parallel=("model",))
    rows = run["global_batch"] // k
    parts: dict = {}
    if lay["pp"] > 1:
        graph = build_graph(model, gpt_pipeline(), tokens(rows, run["seq_len"]), compute_dtype=compute(run))
        full = {"pipe": lay["pp"], **sizes}
        placed = dataclasses.replace(params.placed(hosts, full), gather_itemsize=MEGATRON_GATHER)
        shape = PipelineShape(stages=lay["pp"], microbatches=k, layers=cfg.layers,
                              activation_bytes=rows * run["seq_len"] * cfg.embed * 2, executor="async")
        # Megatron's distributed optimizer (ZeRO 1 over data: --overlap-param-gather needs it);
        # its 1F1B stages run as their inputs arrive, without recompute (none is stated)
        step, args, temp = price_pipeline(graph, hand_axes(graph, config, sizes), sizes, placed, shape,
                                          zero=1, breakdown=parts)
    else:
        graph = build_graph(model, remat_loss(model, loss_fn, run["remat"]["value"]), tokens(rows, run["seq_len"]),
                            compute_dtype=compute(run))
        zero, axis = (3, "fsdp") if lay["fsdp"] > 1 else (1, "data")   # Megatron's distributed optimizer
        placed = dataclasses.replace(params.placed(hosts, sizes), gather_itemsize=None if zero == 3 else MEGATRON_GATHER)
        step, args, temp = price(graph, hand_axes(graph, config, sizes), sizes, placed, zero=zero, zero_axis=axis,
                                 grad_accum=k, breakdown=parts)
    peak = params.flops_per_s / params_fraction(params, run)
    flops = publisher_flops(run, cfg)
    return {"step_s": step, "argument_bytes": args, "temp_bytes": temp, "memory_bytes": args + temp,
            "mfu": flops / (step * run["devices"] * peak), "publisher_flops_per_step": flops,
            "mesh": {**({"pipe": lay["pp"]} if lay["pp"] > 1 else {}), **sizes}, "hosts": hosts,
            "micro_batches": k, "remat": run["remat"]["value"], "breakdown": parts}


def params_fraction(params: CostParams, run: dict) -> float:
    return params.flops_per_s / PEAKS[run["hardware"]]


PEAKS: dict[str, float] = {}
# Every run trains in bf16 with fp32 master weights. The Llama rows' model computes in bf16
# itself (LlamaConfig.dtype), casting each layer's weights where it uses them, as MaxText does;
# the GPT rows' model computes in its parameters' dtype, so those are priced under jaxpar's
# "bf16" precision, whose step casts the parameters to bf16 inside the loss (before, they were
# priced with fp32 activations)
PRECISION = "bf16"


def compute(run: dict) -> str | None:
    """The compute dtype the graph of ``run`` is traced with (`build_graph`'s ``compute_dtype``)."""
    return jaxpar.Precision.named(PRECISION).compute if run["model"] == "gpt" else None
# "at least as fast": within a millionth of the published layout's predicted step (the planner
# taking the published layout under its own recompute policy is priced a few nanoseconds apart)
TIE = 1e-6
SEQUENCE_PARALLEL = [True]     # --no-sequence-parallel: the Megatron TP rows priced without it
HARDWARE: dict[str, dict] = {}


def published_step(run: dict, cfg) -> float:
    """The step time the published figures give: stated, or the publisher's FLOPs over its
    TFLOP/s (or MFU x peak) on all devices."""
    pub = run["published"]
    if "step_time_s" in pub:
        return pub["step_time_s"]["value"]
    rate = pub["tflops_per_device"]["value"] * 1e12 if "tflops_per_device" in pub else \
        pub["mfu"]["value"] * PEAKS[run["hardware"]]
    return publisher_flops(run, cfg) / (rate * run["devices"])


def planner(run: dict, params: CostParams, budget: float) -> dict:
    """`search_job`'s own choice (data x model meshes with model inside a node, and replica x data
    x model ones) and its time. It prices jaxpar's own program: without sequence parallel, which
    the published layouts of the Megatron TP rows are priced with (`predict`)."""
    model_fn, loss_fn, _ = abstract_model(run)
    n = run["devices"]
    per = params.devices_per_host or n
    meshes = tuple({"data": n // m, "model": m} for m in (1, 2, 4, 8) if n % m == 0 and m <= per)
    # ZeRO shards a dimension its axis divides: where the device count has an odd factor (768 =
    # 3 x 256), a replica axis of that factor keeps the data axis a power of two (ZeRO inside it,
    # data parallel across the replicas: the search places each on the hosts)
    odd = n // (n & -n)
    if odd > 1:
        meshes += tuple({"replica": odd, "data": n // odd // m, "model": m} for m in (1, 2, 4, 8)
                        if (n // odd) % m == 0 and m <= per)
    elif n > per:       # ZeRO inside a host, data parallel across the hosts
        meshes += ({"replica": n // per, "data": per},)
    rows = run["global_batch"]
    accum = tuple(a for a in (1, 2, 4) if rows % a == 0 and (rows // a) % (n // 8) == 0) or (1,)
    space = JobSearchSpace(devices=n, memory_budget=budget, meshes=meshes, zero_levels=(0, 1, 3),
                           grad_accum=accum, remat=REMAT)
    t0 = time.perf_counter()
    try:
        job = search_job(model_fn, loss_fn, tokens(rows, run["seq_len"]), space, cost_params=params,
                         base_config=jaxpar.ParallelConfig(mode="auto", precision=PRECISION if compute(run) else None))
    except ValueError as e:
        return {"chosen": None, "why": str(e).split(";")[0], "search_s": time.perf_counter() - t0}
    c = job.chosen
    return {"chosen": c.label(), "step_s": c.time_s, "memory_bytes": c.memory_bytes,
            "search_s": time.perf_counter() - t0, "candidates": len(job.candidates)}


def table(rows: list[dict]) -> str:
    head = (f"{'run':<32} {'dev':>5} {'layout':<40} {'pub MFU':>8} {'pred MFU':>8} {'err':>7} {'use':<9} "
            f"{'mem GB':>7} {'pub s':>8} {'pred s':>8} {'planner s':>9}  planner choice")
    out = [head, "-" * len(head)]
    for r in rows:
        pl = r["planner"]
        ps = f"{pl['step_s']:.3g}" if pl.get("step_s") else "—"
        out.append(f"{r['id']:<32} {r['devices']:>5} {r['layout_text']:<40} {r['published_mfu']:>8.1%} "
                   f"{r['predicted']['mfu']:>8.1%} {r['error']:>+7.1%} {r['use']:<9} "
                   f"{r['predicted']['memory_bytes'] / 1e9:>7.1f} {r['published_step_s']:>8.3g} "
                   f"{r['predicted']['step_s']:>8.3g} {ps:>9}  {pl.get('chosen') or pl.get('why', 'not run')}")
    return "\n".join(out)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for use, marker in (("fitted", "*"), ("held out", "o")):
        sel = [r for r in rows if r["use"] == use]
        ax.scatter([r["published_mfu"] for r in sel], [r["predicted"]["mfu"] for r in sel], marker=marker,
                   s=90 if use == "fitted" else 40, label=use)
        for r in sel:
            ax.annotate(r["id"].replace("megatron_", "M ").replace("maxtext_", "MT "), (r["published_mfu"],
                        r["predicted"]["mfu"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    lo, hi = 0.2, 1.0
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15, label="±15 %")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="published MFU", ylabel="jaxpar predicted MFU (published layout)",
           title="Predicted vs published MFU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def default_out(args: argparse.Namespace) -> pathlib.Path:
    """Where a run writes its JSON without ``--out``: the committed results for the whole run
    only; a partial one (``--quick``, ``--runs``, ``--no-search``, ``--no-sequence-parallel``)
    writes a file git ignores."""
    partial = args.quick or args.runs or args.no_search or args.no_sequence_parallel
    return HERE / "results" / ("tmp_published.json" if partial else "published.json")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small rows, no search, no plot")
    ap.add_argument("--out", default=None, help="the JSON (default: results/published.json for the whole run; "
                    "results/tmp_published.json, which git ignores, for --quick, --runs, --no-search or "
                    "--no-sequence-parallel, so that a partial run never overwrites the committed results)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--runs", nargs="+", metavar="ID", help="only these runs; no plot")
    ap.add_argument("--no-search", action="store_true", help="skip the planner's search (fast)")
    ap.add_argument("--no-sequence-parallel", action="store_true",
                    help="price the Megatron TP rows without sequence parallel (the runs file's INFERRED setting)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(default_out(args))
    SEQUENCE_PARALLEL[0] = not args.no_sequence_parallel
    data = json.loads(RUNS.read_text())
    hardware, runs = data["hardware"], data["runs"]
    PEAKS.update({k: v["peak_flops"]["value"] for k, v in hardware.items()})
    HARDWARE.update(hardware)
    t0 = time.perf_counter()
    calibration = gpu_calibration()
    factor, fraction = calibration["factor"], calibration["matmul_fraction"]
    print(f"memory: the non-matmul operators reached {calibration['effective_bytes_per_s'] / 1e12:.2f} TB/s of modelled "
          f"bytes on the H200 profile ({calibration['other_s'] * 1e3:.1f} of {calibration['step_s'] * 1e3:.1f} ms): "
          f"{factor:.3f} x each device's datasheet rate", flush=True)
    print(f"matmuls: the step's matmul FLOPs over its matmul and attention kernels' time on the H200 profile: "
          f"{fraction:.3f} of the datasheet peak", flush=True)
    if args.quick or args.runs:
        runs = [r for r in runs if r["id"] in (QUICK if args.quick else args.runs)]
    rows = []
    for run in runs:
        params = machine(hardware[run["hardware"]], fraction, factor)
        cfg = abstract_model(run)[2]
        pred = predict(run, params)
        pub_mfu = run["published"]["mfu"]["value"]
        lay = run["layout"]
        text = " ".join(f"{k.upper()}{v}" for k, v in lay.items() if k in ("tp", "pp", "dp", "fsdp") and v > 1) \
            + ("" if run["remat"]["value"] == "none" else f" {run['remat']['published']}")
        budget = hardware[run["hardware"]]["memory_bytes"]["value"]
        pl = {"chosen": None, "why": "not run (--quick / --no-search)"} if args.quick or args.no_search \
            else planner(run, params, budget)
        if pl.get("step_s"):
            pl["faster_or_equal"] = pl["step_s"] <= pred["step_s"] * (1 + TIE)
        rows.append({"id": run["id"], "source": run["source"], "devices": run["devices"], "layout_text": text,
                     "use": "fitted" if run["id"] in FIT else "held out", "published_mfu": pub_mfu,
                     "published_mfu_status": run["published"]["mfu"]["status"],
                     "published_step_s": published_step(run, cfg), "predicted": pred,
                     "error": pred["mfu"] / pub_mfu - 1, "planner": pl})
        print(f"  {run['id']}: predicted MFU {pred['mfu']:.1%} (published {pub_mfu:.1%}); step "
              f"{pred['step_s']:.3g} s: " + ", ".join(f"{k} {v:.3g}" for k, v in pred["breakdown"].items()
                                                      if k.endswith("_s")), flush=True)
    held = [abs(r["error"]) for r in rows if r["use"] == "held out"]
    summary = {"sustained_fraction_of_peak": fraction, "gpu_calibration": calibration, "fitted_on": list(FIT),
               "held_out_mean_abs_error": sum(held) / len(held) if held else None,
               "held_out_max_abs_error": max(held) if held else None,
               "held_out_within_15pct": sum(e <= 0.15 for e in held), "held_out_count": len(held),
               "planner_at_least_as_fast": sum(bool(r["planner"].get("faster_or_equal")) for r in rows),
               "seconds": time.perf_counter() - t0}
    print(table(rows))
    print(json.dumps(summary, indent=1))
    command = sys.argv[1:] if argv is None else list(argv)
    result = {"meta": {"command": " ".join(["python benchmarks/published.py", *command]),
                       "jax": jax.__version__, "runs_file": str(RUNS.relative_to(HERE.parent))},
              "machines": {k: machine(v, fraction, factor).to_dict() for k, v in hardware.items()},
              "summary": summary, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"written to {out}")
    if not (args.quick or args.runs):
        plot(rows, pathlib.Path(args.plot) if args.plot else out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
