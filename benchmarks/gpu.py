"""GPU figures in one command: jaxpar against a hand-written ``jax.jit`` loop of the same model.

    python benchmarks/gpu.py            # the accelerator there is: under 8 minutes on one H100
    python benchmarks/gpu.py --quick    # the scaled-down set in seconds (what tests/test_bench_gpu.py runs)
    make bench-gpu

Every case trains one Llama shape, bf16 compute on fp32 master weights, adamw, in one process:
``jaxpar.Trainer`` (``ParallelConfig(precision="bf16")``, data parallel over every device) and a
hand-written step (`HandStep`: ``nnx.split`` parameters as a flat list of arrays, cast to bf16
inside the differentiated function, ``jax.jit`` with donation, the host batch passed straight
in, loss and grad norm returned) take turns, one round of ``steps`` steps each, the order
reversed every other round; a row's ms/step is the median over rounds and its ratio the median
of the per-round ratios to the hand-written step (p10-p90 beside it). The cases (`cases`):

- ``1b`` Llama-3.2-1B shape, unscanned and scanned, without and with recompute
  (``dots_with_no_batch_dims_saveable`` on each block), and at 8k tokens;
- ``125m``, the dense twin of an MoE 125m (8 experts, top-2), and the MoE's ratio of tokens/s
  to it;
- ``tiny`` on one device, host-bound: what the Trainer's per-step host path costs;
- ``jaxpar.init`` against eager Flax init (``Llama(cfg, rngs=...)``) of the 1b model;
- with ``torch`` and ``transformers`` importable, Hugging Face ``LlamaForCausalLM`` of the 1b
  shape (bf16 autocast on fp32 weights, SDPA attention, AdamW, ``torch.compile`` of the whole
  step) against the hand-written step at the batch both fit beside each other.

MFU = model FLOPs per token (`jaxpar.models.llama.flops_per_token`: active experts, causal
attention) x tokens/s / (bf16 peak of the device x devices); on a CPU, which has no peak, n/a.
Memory: the compiled step's bytes per device (arguments + outputs + temporaries - aliased) of
each row, and on a GPU the process's running peak after each case (XLA cannot reset it).
Results: a table, and JSON + a plot named after the device in ``$OUT`` if set, else
``benchmarks/results/``; the JSON is written after every case, so a run stopped by a time limit
keeps what it measured. Without an accelerator it runs a scaled-down set of the same cases.
"""

from __future__ import annotations

import os

# On a GPU JAX would take 75 % of the memory up front, leaving the torch peer too little; it grows
# instead, up to 90 %. Harmless elsewhere. Set before JAX starts its backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig, flops_per_token, loss_fn  # noqa: E402
from jaxpar.report import memory, throughput  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DENSE_TWIN = "125m-shape"       # the MoE case's dense twin (`derive` looks it up by this name)
REMAT = "dots_with_no_batch_dims_saveable"
GIB = 2.0**30


def make_tx() -> optax.GradientTransformation:
    return optax.adamw(3e-4, weight_decay=0.1)      # torch.optim.AdamW's settings for the peer


@dataclasses.dataclass(frozen=True)
class Case:
    """One model shape: a hand-written step and the jaxpar variants, timed in turns."""

    name: str
    cfg: LlamaConfig
    seq: int
    batch: int                       # per device
    remat: str = "none"              # recompute of each block: by hand, and ParallelConfig.remat in jaxpar
    variants: tuple = (("jaxpar", {}),)   # (label, Trainer/ParallelConfig options)
    one_device: bool = False
    hf: bool = False                 # the torch peer instead of the jaxpar variants
    init: bool = False               # jaxpar.init against eager init instead of steps


# ----------------------------------------------------------------------------- the runs

class HandStep:
    """The step written by hand, the lean loop: flat lists of arrays, donated, numpy batch in."""

    label = "hand-written jax.jit"

    def __init__(self, cfg: LlamaConfig, mesh, batch: dict, remat: str = "none"):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        # recompute by hand: each block (the scan body, or each layer) under jax.checkpoint with
        # the policy (jaxpar.remat on the module: nnx.remat around its __call__, kept by the graphdef)
        for block in [model.blocks] if cfg.scan_layers else list(model.blocks):
            jaxpar.remat(block, remat)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = make_tx()
        repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        leaves, p_def = jax.tree.flatten(params)
        opt_leaves, o_def = jax.tree.flatten(tx.init(leaves))
        rest_leaves, r_def = jax.tree.flatten(rest)

        def loss_of(p, r, b):    # the model is rebuilt from leaves here, where its variables may change
            p16 = [x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in p]
            return loss_fn(nnx.merge(graphdef, jax.tree.unflatten(p_def, p16), jax.tree.unflatten(r_def, r)), b)

        def train_step(p, o, r, b):
            loss, grads = jax.value_and_grad(loss_of)(p, r, b)
            updates, o = tx.update(grads, jax.tree.unflatten(o_def, o), p)
            return optax.apply_updates(p, updates), jax.tree.leaves(o), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

        self.jitted = jax.jit(train_step, in_shardings=(repl, repl, repl, rows), donate_argnums=(0, 1))
        self.state = [jax.device_put(leaves, repl), jax.device_put(opt_leaves, repl), jax.device_put(rest_leaves, repl)]

    def step(self, batch):
        self.state[0], self.state[1], metrics = self.jitted(*self.state, batch)
        return metrics

    wait = staticmethod(jax.block_until_ready)

    def compiled_bytes(self, batch) -> int:
        return memory(self.jitted.lower(*self.state, batch).compile()).total     # cached: no new compile


class JaxparStep:
    """``jaxpar.Trainer`` of the same model; ``options``: ``model`` (fields of the model's config
    that differ from the hand-written step's, e.g. ``loss_chunks``) and ParallelConfig fields."""

    def __init__(self, label: str, cfg: LlamaConfig, devices, remat: str, options: dict):
        self.label = label
        options = dict(options)
        cfg = dataclasses.replace(cfg, **options.pop("model", {}))
        config = jaxpar.ParallelConfig(**{"mesh": {"data": -1}, "precision": "bf16", "remat": remat, **options})
        mesh = jaxpar.make_mesh(config, devices)
        # the constraint a model built for the config holds: MoE layers route each device's tokens
        constrain = jaxpar.nn.model_constraint(mesh, config)
        model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain), config, mesh)
        self.trainer = jaxpar.Trainer(model, make_tx(), loss_fn, config, mesh)

    def step(self, batch):
        return self.trainer.step(batch)

    wait = staticmethod(jax.block_until_ready)

    def compiled_bytes(self, batch) -> int:
        return memory(self.trainer.lower(batch).compile()).total

class HFStep:
    """Hugging Face ``LlamaForCausalLM`` of the same shape: fp32 weights, bf16 autocast, SDPA
    attention, fused AdamW, the whole step under ``torch.compile``; random init, no download.
    The loss is HF's (labels = the inputs, shifted inside: ``seq - 1`` predicted tokens)."""

    label = "Hugging Face + torch.compile"

    def __init__(self, cfg: LlamaConfig, seq: int, batch: int):
        import torch
        import transformers

        self.torch = torch
        rope = None if cfg.rope_scaling is None else {
            "rope_type": "llama3", "factor": cfg.rope_scaling.factor, "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_positions}
        hf = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.embed, intermediate_size=cfg.mlp, num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
            max_position_embeddings=max(seq, cfg.max_seq_len), rope_theta=cfg.rope_theta, rope_scaling=rope,
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(hf).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

        def step(x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        self.model, self.opt, self.fn = model, opt, torch.compile(step)
        self.inputs = {}
        torch.cuda.reset_peak_memory_stats()

    def step(self, batch):
        key = id(batch)
        if key not in self.inputs:     # the peer's batch lives on its device once, like a loader's
            self.inputs[key] = self.torch.as_tensor(batch["inputs"], dtype=self.torch.long).cuda()
        return self.fn(self.inputs[key])

    def wait(self, _):
        self.torch.cuda.synchronize()

    def compiled_bytes(self, batch) -> int:
        return self.torch.cuda.max_memory_allocated()

    def close(self):
        del self.model, self.opt, self.fn, self.inputs
        gc.collect()
        self.torch.cuda.empty_cache()


def timed_rounds(runs: list, batches: list, warmup: int, rounds: int, steps: int) -> list[list[float]]:
    """Seconds per step of each run, ``steps`` back to back per round (one wait at the end), runs
    taking turns and the order reversed every other round, so drifts of the machine hit all alike."""
    for run in runs:
        for i in range(warmup):
            run.wait(run.step(batches[i % len(batches)]))
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        order = list(range(len(runs))) if r % 2 == 0 else list(range(len(runs)))[::-1]
        for i in order:
            t0 = time.perf_counter()
            for s in range(steps):
                out = runs[i].step(batches[s % len(batches)])
            runs[i].wait(out)
            times[i].append((time.perf_counter() - t0) / steps)
    return times


# ----------------------------------------------------------------------------- cases

def cases(mode: str) -> list[Case]:
    """The cases, from the most telling to the least (a spent ``--budget-s`` skips the last)."""
    if mode == "gpu":
        big, mid, seq, long_seq = LlamaConfig.named("1b"), LlamaConfig.named("125m"), 2048, 8192
        tiny, tiny_seq, batch = LlamaConfig.named("tiny", max_seq_len=128), 128, 8
        mid_batch = batch                  # the 125m rows: 8 x 2048 tokens
    elif mode == "cpu":    # scaled down: about two minutes on a CPU
        width = dict(embed=128, heads=4, kv_heads=2, mlp=384, vocab_size=256)
        big = LlamaConfig.named("tiny", layers=4, tie_embeddings=True, **width)
        mid = LlamaConfig.named("tiny", layers=2, **width)
        seq, long_seq, batch = 64, 512, 4
        mid_batch = batch * 2
        tiny, tiny_seq = LlamaConfig.named("tiny"), 16
    else:                  # quick: one tiny shape for all (its programs compile in a blink and share)
        big = mid = tiny = LlamaConfig.named("tiny")
        seq, long_seq, batch, tiny_seq = 16, 64, 2, 16
        mid_batch = batch * 2
    moe = {"experts": 8, "top_k": 2}
    chunked = (("jaxpar", {}), ("jaxpar, loss in 8 chunks", {"model": {"loss_chunks": 8}}))
    if mode == "gpu":   # the fp8 preset where the device has fp8 matmuls (refused elsewhere: a row says why)
        chunked += (("jaxpar fp8, loss in 8 chunks", {"model": {"loss_chunks": 8}, "precision": "fp8"}),)
    # XLA's ragged_dot against the default kernel, where they differ (Mosaic GPU on a Hopper GPU);
    # on a CPU "auto" is XLA's already
    kernels = (("jaxpar", {}),) + ((("jaxpar, XLA ragged_dot", {"model": {"moe": {**moe, "kernel": "xla"}}}),)
                                   if mode == "gpu" else ())
    return [
        Case("1b-shape", big, seq, batch, variants=chunked),
        Case(DENSE_TWIN, mid, seq, mid_batch),
        Case("125m-shape MoE 8 x top-2", dataclasses.replace(mid, moe=moe), seq, mid_batch, variants=kernels),
        Case("tiny host-bound, 1 device", tiny, tiny_seq, 8, one_device=True),
        Case("jaxpar.init, 1b-shape", big, seq, batch, init=True),
        Case("1b-shape scanned, recompute", dataclasses.replace(big, scan_layers=True), seq, batch, remat=REMAT),
        Case(f"1b-shape, {long_seq} tokens (scanned, recompute)", dataclasses.replace(big, scan_layers=True),
             long_seq, 1, remat=REMAT),
        Case("1b-shape, recompute", big, seq, batch, remat=REMAT),
        Case("1b-shape scanned", dataclasses.replace(big, scan_layers=True), seq, batch),
        Case("1b-shape vs Hugging Face", big, seq, max(batch // 2, 1), hf=True),
    ]


def make_batches(cfg: LlamaConfig, seq: int, batch: int, n: int = 2) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1), dtype=np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def row_for(case: Case, label: str, **fields) -> dict:
    return {"case": case.name, "entry": label, "status": "measured", **fields}


def skipped(case: Case, label: str, why: str) -> dict:
    print(f"  skipped {case.name} / {label}: {why}", file=sys.stderr)
    return {"case": case.name, "entry": label, "status": "skipped", "reason": why}


def reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {' '.join(text)[:2000]}"


def run_case(case: Case, devices: list, opts) -> list[dict]:
    """The rows of one case: build every run, time them in turns, read memory; a run that
    cannot be built (refused, out of memory, no torch) is a row with the reason."""
    if case.init:
        return init_rows(case, devices, opts)
    batches = make_batches(case.cfg, case.seq, case.batch * len(devices))
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    runs, rows, t0 = [], [], time.perf_counter()
    why_not = hf_unavailable(opts.mode) if case.hf else None
    if why_not is not None:
        return [skipped(case, HFStep.label, why_not)]
    try:
        runs.append(HandStep(case.cfg, mesh, batches[0], case.remat))
    except Exception as e:   # noqa: BLE001  (out of memory on a small device: the row says so)
        return [skipped(case, HandStep.label, reason(e))]
    for label, options in ((HFStep.label, None),) if case.hf else case.variants:
        try:
            if options is not None:
                runs.append(JaxparStep(label, case.cfg, devices, case.remat, options))
            else:
                runs.append(HFStep(case.cfg, case.seq, len(batches[0]["inputs"])))
        except Exception as e:   # noqa: BLE001
            rows.append(skipped(case, label, reason(e)))
    ready = []
    for run in runs:      # the first step compiles: a run that fails there is a row with the reason
        try:
            run.wait(run.step(batches[0]))
            ready.append(run)
        except Exception as e:   # noqa: BLE001
            rows.append(skipped(case, run.label, f"first step: {reason(e)}"))
    if not ready or ready[0] is not runs[0]:
        return rows
    runs = ready
    times = timed_rounds(runs, batches, opts.warmup, opts.rounds_host if case.one_device else opts.rounds,
                         opts.host_steps if case.one_device else 1)
    tokens = len(batches[0]["inputs"]) * case.seq
    measured = [measure(case, run, t, times[0], tokens, len(devices), batches[0], opts.peak_flops)
                for run, t in zip(runs, times)]
    peak = process_peak(devices[0])
    for r in measured:
        r.update(process_peak_gib=peak, case_s=time.perf_counter() - t0)
    for run in runs:
        getattr(run, "close", lambda: None)()
    return measured + rows


def hf_unavailable(mode: str) -> str | None:
    """Why the torch peer cannot run here, or None."""
    if mode == "quick":
        return "not in --quick (torch.compile alone takes about a minute)"
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return f"torch and transformers are not both importable ({e})"
    return None if torch.cuda.is_available() else "torch sees no CUDA device (the peer is a GPU figure)"


def measure(case: Case, run, times: list[float], hand: list[float], tokens: int, n: int, batch, peak) -> dict:
    step_s = float(np.median(times))
    t = throughput(flops_per_token=flops_per_token(case.cfg, case.seq), tokens_per_step=tokens, step_time_s=step_s,
                   num_devices=n, dtype="bfloat16", peak_flops=peak)
    ratios = np.array(times) / np.array(hand)
    return row_for(case, run.label, ms_per_step=1e3 * step_s, tokens_per_s=tokens / step_s,
                   mfu=t.mfu, mfu_text=t.mfu_text, compiled_gib=run.compiled_bytes(batch) / GIB,
                   memory_source="torch.cuda.max_memory_allocated" if isinstance(run, HFStep) else "compiled step",
                   ratio_to_hand=float(np.median(ratios)),
                   ratio_p10_p90=[float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))],
                   rounds=len(times), devices=n, tokens_per_step=tokens, seq_len=case.seq, remat=case.remat,
                   step_times_ms=[round(1e3 * x, 4) for x in times])


def init_rows(case: Case, devices: list, opts) -> list[dict]:
    """``jaxpar.init`` against eager Flax init of the same model, alternating, each waited for;
    the first call of each (with its compilations) is what a user's process pays."""
    config = jaxpar.ParallelConfig(mesh={"data": -1}, precision="bf16")
    mesh = jaxpar.make_mesh(config, devices)
    eager_device = devices[0]
    make = {"jaxpar.init": lambda: jaxpar.init(lambda: Llama(case.cfg, rngs=nnx.Rngs(0)), config, mesh),
            "eager Flax init": lambda: _eager(case.cfg, eager_device)}
    times = {k: [] for k in make}
    for r in range(opts.init_rounds):
        for name in (list(make) if r % 2 == 0 else list(make)[::-1]):
            t0 = time.perf_counter()
            model = make[name]()
            jax.block_until_ready(nnx.state(model))
            times[name].append(time.perf_counter() - t0)
            del model
    return [row_for(case, name, ms_first=1e3 * ts[0], ms_again_median=1e3 * float(np.median(ts[1:] or ts)),
                    ratio_to_eager_first=ts[0] / times["eager Flax init"][0], rounds=len(ts),
                    init_times_ms=[round(1e3 * x, 2) for x in ts])
            for name, ts in times.items()]


def moe_experts(row: dict, dense: dict, case: Case) -> None:
    """The MoE row against its dense twin: tokens/s per active FLOP (= MFU over MFU: both count
    active experts only) and memory against dense + the extra weights with their gradients and
    Adam moments (fp32: 16 bytes a parameter) + 20 %, the issue's bound."""
    def params(cfg):
        state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    extra = params(case.cfg) - params(dataclasses.replace(case.cfg, moe=None))
    row["tokens_per_s_over_dense_twin"] = row["tokens_per_s"] / dense["tokens_per_s"]
    row["active_flops_over_dense"] = flops_per_token(case.cfg, case.seq) / flops_per_token(
        dataclasses.replace(case.cfg, moe=None), case.seq)
    row["efficiency_over_dense"] = row["tokens_per_s_over_dense_twin"] * row["active_flops_over_dense"]
    row["extra_params"] = extra
    row["memory_bound_gib"] = 1.2 * (dense["compiled_gib"] + 16 * extra / GIB)
    row["memory_within_bound"] = row["compiled_gib"] <= row["memory_bound_gib"]


def derive(rows: list[dict], mode: str) -> list[dict]:
    """The figures that compare rows: MoE against its dense twin."""
    measured = [r for r in rows if r["status"] == "measured" and "ms_per_step" in r]
    dense = next((r for r in measured if r["case"] == DENSE_TWIN and r["entry"] == "jaxpar"), None)
    for r in measured:
        if "MoE" in r["case"] and dense is not None:
            moe_experts(r, dense, next(c for c in cases(mode) if c.name == r["case"]))
    return rows


def write(path: str, meta: dict, rows: list[dict], seconds: float) -> None:
    with open(path, "w") as f:
        json.dump({"meta": {**meta, "total_s": seconds}, "rows": rows}, f, indent=1)


def _eager(cfg: LlamaConfig, device):
    with jax.default_device(device):
        return Llama(cfg, rngs=nnx.Rngs(0))


def process_peak(device) -> float | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats or "peak_bytes_in_use" not in stats else stats["peak_bytes_in_use"] / GIB


# ----------------------------------------------------------------------------- output

def fmt(x, spec: str, missing: str = "") -> str:
    return missing if x is None else format(x, spec)


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"jaxpar vs hand-written jax.jit on {meta['devices']} x {meta['device_kind']} "
                        f"(jax {meta['jax']}, {meta['mode']})")
    for c in ("case", "run", "ms/step", "tokens/s", "MFU", "compiled GiB", "process peak GiB", "vs hand-written",
              "against its twin"):
        table.add_column(c, justify="left" if c in ("case", "run", "against its twin") else "right")
    for r in rows:
        if r["status"] == "skipped":
            table.add_row(r["case"], r["entry"], "skipped", r["reason"][:60], "", "", "", "", "")
        elif "ms_first" in r:
            table.add_row(r["case"], r["entry"], f"{r['ms_first']:.0f} first", f"{r['ms_again_median']:.0f} again",
                          "", "", "", f"{r['ratio_to_eager_first']:.2f} (eager = 1)", "")
        else:
            lo, hi = r["ratio_p10_p90"]
            table.add_row(r["case"], r["entry"], f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:,.0f}",
                          r["mfu_text"].replace("n/a (no peak for CPU)", "n/a"), f"{r['compiled_gib']:.3f}",
                          fmt(r["process_peak_gib"], ".1f", "n/a"), f"{r['ratio_to_hand']:.3f} [{lo:.2f}-{hi:.2f}]",
                          twin_text(r))
    Console(width=190).print(table)


def twin_text(r: dict) -> str:
    """The comparison `derive` made for a row: MoE against dense."""
    if "efficiency_over_dense" in r:
        return (f"{r['efficiency_over_dense']:.2f} of dense per active FLOP; memory "
                f"{'within' if r['memory_within_bound'] else 'over'} {r['memory_bound_gib']:.1f} GiB")
    return ""


def plot(rows: list[dict], meta: dict, path: str) -> str | None:
    """Ratio to the hand-written step per row (and tokens/s); returns why not if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[plot]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "measured" and "ratio_to_hand" in r]
    labels = [f"{r['case']}: {r['entry']}" for r in done]
    y = np.arange(len(done))
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(15, 0.35 * len(done) + 2), sharey=True)
    ax_r.barh(y, [r["ratio_to_hand"] for r in done], color="tab:blue")
    ax_r.axvline(1.0, color="k", lw=0.8)
    ax_r.set_xlabel("step time / hand-written jax.jit step (median of rounds)")
    ax_t.barh(y, [r["tokens_per_s"] for r in done], color="tab:green")
    ax_t.set_xscale("log")
    ax_t.set_xlabel("tokens/s")
    ax_r.set_yticks(y, labels, fontsize=8)
    ax_r.invert_yaxis()
    fig.suptitle(f"{meta['devices']} x {meta['device_kind']}: jax {meta['jax']}, jaxlib {meta['jaxlib']}, "
                 f"flax {meta['flax']}, jaxpar {meta['jaxpar']} ({meta['date']}, {meta['mode']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def versions() -> dict:
    import flax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
           "jaxpar": jaxpar.__version__, "python": platform.python_version()}
    for name in ("torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the smallest set (seconds on a CPU): what the test runs")
    p.add_argument("--cpu-set", action="store_true", help="the scaled-down set even on an accelerator")
    p.add_argument("--cases", nargs="*", metavar="TEXT",
                   help="only these cases: a whole case name picks that case, other text the cases containing it")
    p.add_argument("--rounds", type=int, help="timed rounds of one step per run (default 10 on a GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run first")
    p.add_argument("--peak-flops", type=float, help="peak bf16 FLOP/s per device for MFU (default: jaxpar.report)")
    p.add_argument("--budget-s", type=float, help="start no case after this many seconds (default 400 on a GPU)")
    p.add_argument("--out", help="JSON path (default: gpu_<device>.json in $OUT or benchmarks/results/)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    accelerator = jax.devices()[0].platform != "cpu"
    args.mode = "quick" if args.quick else ("gpu" if accelerator and not args.cpu_set else "cpu")
    defaults = {"gpu": (10, 60, 10, 2, 400.0), "cpu": (8, 20, 5, 2, None), "quick": (3, 5, 3, 2, None)}[args.mode]
    args.rounds = args.rounds or defaults[0]
    args.rounds_host, args.host_steps, args.init_rounds = defaults[1:4]
    args.budget_s = args.budget_s if args.budget_s is not None else defaults[4]
    if args.quick:
        args.warmup = min(args.warmup, 1)
    for name in ("rounds", "warmup"):
        if getattr(args, name) < (1 if name == "rounds" else 0):
            p.error(f"--{name} {getattr(args, name)}: give a positive number")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.quick:
        return run(args)
    # --quick checks that every case runs, in seconds: its timings are no figures, so XLA may
    # skip most optimizations (half the compile time); the setting is restored after.
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        return run(args)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def wanted(case: Case, texts: list[str] | None, mode: str) -> bool:
    """``--cases``: a text equal to a case's whole name picks that case alone, any other text
    every case whose name contains it."""
    if not texts:
        return True
    names = {c.name.lower() for c in cases(mode)}
    name = case.name.lower()
    return any(t.lower() == name if t.lower() in names else t.lower() in name for t in texts)


def run(args) -> int:
    start = time.perf_counter()
    device = jax.devices()[0]
    devices = jax.devices() if args.mode == "gpu" else jax.devices()[:1]
    meta = {"device_kind": device.device_kind, "platform": device.platform, "devices": len(devices), "mode": args.mode,
            **versions(), "date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(),
            "command": " ".join(["python", "benchmarks/gpu.py", *(args.argv or [])]),
            "precision": "bf16 compute on fp32 master weights (ParallelConfig(precision='bf16'); the hand-written "
                         "step casts inside the differentiated function)",
            "timing": "runs take turns, the order reversed every other round; ms/step = median over rounds",
            "memory": "compiled GiB: the compiled step per device (arguments + outputs + temp - aliased; the torch "
                      "peer: torch.cuda.max_memory_allocated); process peak GiB: the running peak of the process "
                      "after each case (GPU only; XLA cannot reset it between rows)"}
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    path = args.out or os.path.join(out_dir, f"gpu_{slug(device.device_kind)}{'_quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = []
    for case in cases(args.mode):
        if not wanted(case, args.cases, args.mode):
            continue
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            rows.append(skipped(case, "all", f"time budget of {args.budget_s:.0f} s spent (--budget-s)"))
            continue
        t0 = time.perf_counter()
        rows.extend(run_case(case, devices[:1] if case.one_device else devices, args))
        print(f"case {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        gc.collect()
        # after every case: a run cut short by its time limit keeps the cases it finished
        write(path, meta, derive(rows, args.mode), time.perf_counter() - start)
    rows = derive(rows, args.mode)
    meta["total_s"] = time.perf_counter() - start
    print_table(rows, meta)
    write(path, meta, rows, meta["total_s"])
    why_not = plot(rows, meta, os.path.splitext(path)[0] + ".png")
    print(f"results in {path}" + (f" (no plot: {why_not})" if why_not else " and .png")
          + f"; {meta['total_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
