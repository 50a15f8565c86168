"""One short GPU probe: kernel rates behind issue #30's rows, and where a 1B step spends its time.

    PYTHONPATH=. python benchmarks/gpu_probe.py --out $OUT/probe.json

Sections (each guarded: one failing prints its error and the rest run):
- grouped matmul (experts): 32768 x 768 x 2048 bf16 in 8 groups — one dense matmul of the same
  FLOPs, ``jax.lax.ragged_dot``, JAX's Mosaic GPU ``ragged_dot`` / ``transposed_ragged_dot``
  kernels (jax.experimental.pallas.ops.gpu), and a balanced padded batched matmul;
- fp8: an 8192^3 e4m3 x e4m3 -> bf16 product against bf16, and the same with per-tensor scaling
  (quantise inside the jitted function) to see whether XLA keeps the fp8 GEMM;
- LM head + cross-entropy (16,384 tokens x 128,256 vocab x 2048) materialised: time, temp bytes;
- shapes (``--only shapes``): the rates the cost model's GPU calibration assumes one of for every
  shape (benchmarks/published.py ``gpu_calibration``), measured by shape: one transformer
  layer's bf16 GEMMs forward and backward (QKV, output, MLP up and down) at the Llama-1B
  profile's 16,384 tokens (its GQA and SwiGLU widths) and at Megatron's small runs' 4,096-token
  micro-batch in the GPT they are priced with (1.7B: h 2048; 7.1B under TP 2: h 4096, the heads
  and MLP halved), and the fused causal attention kernel
  (``jax.nn.dot_product_attention``, cuDNN) forward and backward at both, its FLOPs counted as
  the cost model counts them (full ``S²``, 3x the forward); a CPU runs it 16x smaller;
- a Llama-1B step through jaxpar.Trainer (batch 8 x 2048, ``--precision`` (bf16), adamw, ``--loss-chunks``): ms,
  MFU, peak memory,
  and the top device ops by time from a ``jax.profiler`` trace of three steps.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RESULTS: dict = {}


def timeit(fn, *args, iters=20, warm=3):
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def section(name):
    def wrap(f):
        @functools.wraps(f)
        def run(*a, **k):
            t = time.perf_counter()
            print(f"\n== {name}", flush=True)
            try:
                RESULTS[name] = f(*a, **k)
            except Exception as e:  # a probe: report and go on
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
        return run
    return wrap


@section("grouped matmul")
def grouped():
    m, k, n, g = 32768, 768, 2048, 8
    flops = 2 * m * k * n
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (g, k, n), jnp.bfloat16) * 0.03
    dy = jax.random.normal(kg, (m, n), jnp.bfloat16)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(m, rng.dirichlet(np.ones(g) * 4))
    gs = jnp.asarray(counts, jnp.int32)
    out = {"shape": [m, k, n, g], "group_sizes": counts.tolist()}

    def rate(name, fn, *args, fl=flops):
        s = timeit(jax.jit(fn), *args)
        out[name] = {"ms": s * 1e3, "tflops": fl / s / 1e12}
        print(f"   {name:44s} {s * 1e3:8.3f} ms  {fl / s / 1e12:7.1f} TFLOP/s", flush=True)

    rate("dense matmul", lambda a, b: a @ b, x, w[0])
    rate("lax.ragged_dot", lambda a, b: jax.lax.ragged_dot(a, b, gs), x, w)
    rate("lax.ragged_dot grad (dx, dw)",
         jax.grad(lambda a, b: jnp.vdot(jax.lax.ragged_dot(a, b, gs).astype(jnp.float32), dy.astype(jnp.float32)),
                  argnums=(0, 1)), x, w, fl=2 * flops)
    c = m // g
    xb = x.reshape(g, c, k)
    rate("padded bmm (balanced)", lambda a, b: jnp.einsum("gck,gkn->gcn", a, b), xb, w)
    rate("dense grad (dx, dw)",
         jax.grad(lambda a, b: jnp.vdot((a @ b).astype(jnp.float32), dy.astype(jnp.float32)), argnums=(0, 1)),
         x, w[0], fl=2 * flops)

    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    ref = jax.jit(lambda a, b: jax.lax.ragged_dot(a, b, gs))(x, w).astype(jnp.float32)
    best = None
    for bm, bn, bk, steps, gbn in [(128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (128, 128, 64, 4, 4),
                                   (64, 128, 64, 4, 2), (128, 192, 64, 5, 1), (192, 128, 64, 4, 2),
                                   (128, 256, 64, 3, 2)]:
        if n % (bn * gbn):
            continue
        name = f"mgpu ragged_dot bm{bm} bn{bn} bk{bk} s{steps} g{gbn}"
        try:
            f = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk,
                                  max_concurrent_steps=steps, grid_block_n=gbn)
            got = jax.jit(f)(x, w).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9))
            rate(name, f, x, w)
            out[name]["rel_err"] = err
            if best is None or out[name]["ms"] < out[best]["ms"]:
                best = name
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"   {name}: {out[name]['error']}", flush=True)
    out["mgpu best"] = best
    # dx = dy @ w^T per group: the forward kernel with transpose_rhs
    for bm, bn, bk, steps, gbn in [(128, 128, 64, 4, 1), (128, 64, 64, 4, 2), (64, 128, 64, 4, 1)]:
        name = f"mgpu ragged_dot^T (dx) bm{bm} bn{bn} s{steps} g{gbn}"
        if k % (bn * gbn):
            continue
        try:
            f = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk,
                                  max_concurrent_steps=steps, grid_block_n=gbn, transpose_rhs=True)
            rate(name, f, dy, w)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"   {name}: {out[name]['error']}", flush=True)
    for bm, bn, bk, steps, gbn in [(128, 128, 64, 4, 1), (128, 256, 64, 3, 1), (64, 128, 64, 4, 1)]:
        name = f"mgpu transposed_ragged_dot (dw) bm{bm} bn{bn} bk{bk} s{steps}"
        try:
            f = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, group_sizes=gs, block_m=bm,
                                  block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)
            rate(name, f, x, dy)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"   {name}: {out[name]['error']}", flush=True)
    return out


@section("fp8")
def fp8():
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    out = {}
    fl = 2 * n ** 3

    def rate(name, fn, *args):
        s = timeit(jax.jit(fn), *args)
        out[name] = {"ms": s * 1e3, "tflops": fl / s / 1e12}
        print(f"   {name:44s} {s * 1e3:8.3f} ms  {fl / s / 1e12:7.1f} TFLOP/s", flush=True)

    rate("bf16", lambda x, y: x @ y, a, b)
    e4 = jnp.float8_e4m3fn
    a8, b8 = a.astype(e4), b.astype(e4)
    rate("fp8 e4m3 x e4m3 -> bf16", lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.bfloat16), a8, b8)

    def scaled(x, y):
        sx = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448.0
        sy = jnp.max(jnp.abs(y)).astype(jnp.float32) / 448.0
        qx = (x.astype(jnp.float32) / sx).astype(e4)
        qy = (y.astype(jnp.float32) / sy).astype(e4)
        d = jax.lax.dot(qx.astype(jnp.bfloat16), qy.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return (d * (sx * sy)).astype(jnp.bfloat16)
    rate("current-scaled fp8 (quantise inside)", scaled, a, b)
    hlo = jax.jit(scaled).lower(a, b).compile().as_text()
    out["scaled uses f8 gemm"] = ("f8e4m3" in hlo and ("cublas$lt$matmul$f8" in hlo or "__cublas$lt$matmul$f8" in hlo))
    out["scaled custom calls"] = sorted(set(s.split('"')[1] for s in hlo.split("custom_call_target=")[1:]))[:10]
    print("   custom calls:", out["scaled custom calls"], flush=True)
    return out


@section("lm head + cross-entropy")
def head_ce():
    import optax
    t, d, v = 16384, 2048, 128256
    x = jax.random.normal(jax.random.key(3), (t, d), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(4), (d, v), jnp.float32) * 0.02)
    y = jax.random.randint(jax.random.key(5), (t,), 0, v)

    def loss(x, w):
        logits = (x @ w.astype(jnp.bfloat16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    mem = g.lower(x, w).compile().memory_analysis()
    s = timeit(g, x, w, iters=10)
    fl = 6 * t * d * v
    out = {"ms": s * 1e3, "temp_gib": mem.temp_size_in_bytes / 2**30, "floor_ms": fl / 989e12 * 1e3}
    print(f"   materialised: {s * 1e3:.2f} ms, temp {out['temp_gib']:.2f} GiB", flush=True)
    return out


@section("shapes")
def shapes(out_path=None):
    """GEMM and fused-attention rates by shape (module docstring). Each case is written to
    ``out_path`` as it ends, so a run cut short keeps the cases it measured."""
    gpu = jax.default_backend() == "gpu"
    cut = 1 if gpu else 16
    # (name, tokens, the layer's GEMMs {name: (K, N)}, attention (batch, seq, heads, head dim)):
    # the Llama-1B profile's layer (32 query heads, 8 K/V heads of 64; SwiGLU 8192) and the
    # GPT's the Megatron rows are priced with (fused QKV; GELU MLP 4h), 7.1B's halved by TP 2
    cases = [("megatron 1.7b micro-batch", 4096,
              {"qkv": (2048, 3 * 2048), "out": (2048, 2048), "mlp up": (2048, 8192), "mlp down": (8192, 2048)},
              (1, 4096, 16, 128)),
             ("megatron 7.1b tp2 micro-batch", 4096,
              {"qkv": (4096, 3 * 2048), "out": (2048, 4096), "mlp up": (4096, 8192), "mlp down": (8192, 4096)},
              (1, 4096, 16, 128)),
             ("llama 1b profile", 16384,
              {"qkv": (2048, 2048 + 2 * 512), "out": (2048, 2048), "mlp up": (2048, 2 * 8192),
               "mlp down": (8192, 2048)},
              (8, 2048, 32, 64))]
    out = {"backend": jax.default_backend(), "scale": 1 / cut}
    for name, t, gemms, (b, seq, nh, d) in cases:
        t, seq, nh = t // cut, seq // (cut // 4 or 1), nh // (cut // 4 or 1) or 1
        try:
            row = {}
            key = iter(jax.random.split(jax.random.key(7), 4 * len(gemms) + 4))
            total_fl = total_s = 0.0
            for g, (k, n) in gemms.items():
                k, n = k // cut, n // cut
                x = jax.random.normal(next(key), (t, k), jnp.bfloat16)
                w = jax.random.normal(next(key), (k, n), jnp.bfloat16) * 0.02
                dy = jax.random.normal(next(key), (t, n), jnp.bfloat16)
                # the pullback of a product needs neither its output nor runs it: dx and dw only
                fwd_bwd = jax.jit(lambda p, q, c: jax.vjp(lambda u, v: u @ v, p, q)[1](c))
                sec = timeit(jax.jit(lambda p, q: p @ q), x, w) + timeit(fwd_bwd, x, w, dy)
                fl = 3 * 2 * t * k * n
                row[g] = {"shape": [t, k, n], "ms": sec * 1e3, "tflops": fl / sec / 1e12}
                total_fl, total_s = total_fl + fl, total_s + sec
            row["gemms"] = {"tflops": total_fl / total_s / 1e12, "ms": total_s * 1e3}
            q, kk, v, do = (jax.random.normal(next(key), (b, seq, nh, d), jnp.bfloat16) for _ in range(4))
            impl = "cudnn" if gpu else None

            def attn(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            fwd_bwd = jax.jit(lambda q, k, v, c: jax.vjp(attn, q, k, v)[1](c))
            sec = timeit(fwd_bwd, q, kk, v, do)         # the backward needs the forward's output: both run
            fl = 3 * 4 * b * seq * seq * nh * d        # as the cost model counts: full S^2, 3x the forward
            row["attention"] = {"shape": [b, seq, nh, d], "ms": sec * 1e3, "tflops_as_counted": fl / sec / 1e12}
            print(f"   {name:32s} GEMMs {row['gemms']['tflops']:7.1f} TFLOP/s   attention "
                  f"{row['attention']['tflops_as_counted']:7.1f} TFLOP/s (full S^2 counted)", flush=True)
        except Exception as e:  # a probe: report and go on
            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        out[name] = row
        if out_path:
            RESULTS["shapes"] = out
            with open(out_path, "w") as fh:
                json.dump(RESULTS, fh, indent=1, default=str)
    return out


@section("1b step")
def step_1b(trace_dir, loss_chunks=0, precision="bf16"):
    import optax
    from flax import nnx
    import jaxpar
    from jaxpar.models.llama import Llama, LlamaConfig, flops_per_token, loss_fn
    out = {}
    cfg = LlamaConfig.named("1b", loss_chunks=loss_chunks)
    out["loss_chunks"], out["precision"] = loss_chunks, precision
    seq, batch = 2048, 8
    config = jaxpar.ParallelConfig(mesh={"data": -1}, precision=precision)
    mesh = jaxpar.make_mesh(config)
    t0 = time.perf_counter()
    model = jaxpar.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), config, mesh)
    out["init_s"] = time.perf_counter() - t0
    trainer = jaxpar.Trainer(model, optax.adamw(3e-4, weight_decay=0.1), loss_fn, config, mesh)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    b = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.step(b))
    out["first_step_s"] = time.perf_counter() - t0
    for _ in range(3):
        m = trainer.step(b)
    jax.block_until_ready(m)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(trainer.step(b))
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    fpt = flops_per_token(cfg, seq)
    out.update(ms=s * 1e3, tokens_per_s=batch * seq / s, mfu_989=fpt * batch * seq / s / 989e12)
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    print(f"   1b: {s * 1e3:.1f} ms, MFU(989) {out['mfu_989']:.3f}, peak {out['peak_gib']:.1f} GiB", flush=True)
    jax.profiler.start_trace(trace_dir)
    for _ in range(3):
        m = trainer.step(b)
    jax.block_until_ready(m)
    jax.profiler.stop_trace()
    out["top_ops"] = top_ops(trace_dir)
    return out


def top_ops(trace_dir, n=40):
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    from jax.profiler import ProfileData
    prof = ProfileData.from_file(paths[-1])
    total = collections.Counter()
    count = collections.Counter()
    for plane in prof.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name == "XLA Ops"] or \
            [ln for ln in plane.lines if ln.name.startswith("Stream")]
        for line in lines:
            for ev in line.events:
                total[ev.name] += ev.duration_ns
                count[ev.name] += 1
    rows = [{"op": k, "ms_per_step": v / 3e6, "count": count[k] // 3} for k, v in total.most_common(n)]
    allms = sum(total.values()) / 3e6
    for r in rows[:25]:
        print(f"   {r['ms_per_step']:8.2f} ms  x{r['count']:<4d} {r['op'][:100]}", flush=True)
    print(f"   all ops: {allms:.1f} ms/step", flush=True)
    return {"rows": rows, "all_ms_per_step": allms,
            "lines": sorted({ln.name for p in prof.planes if p.name.startswith('/device:GPU') for ln in p.lines})}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe.json")
    p.add_argument("--only", nargs="*")
    p.add_argument("--loss-chunks", type=int, default=0, help="the 1b step's LlamaConfig.loss_chunks")
    p.add_argument("--precision", default="bf16", help="the 1b step's ParallelConfig.precision (e.g. fp8: its "
                                                        "top ops show what the fp8 casts and scales cost)")
    a = p.parse_args()
    RESULTS["devices"] = [str(d) for d in jax.devices()]
    RESULTS["jax"] = jax.__version__
    todo = {"grouped": grouped, "fp8": fp8, "ce": head_ce, "shapes": lambda: shapes(a.out),
            "1b": lambda: step_1b("/tmp/jaxpar_trace", a.loss_chunks, a.precision)}
    for k, f in todo.items():
        if not a.only or k in a.only:
            f()
            with open(a.out, "w") as fh:
                json.dump(RESULTS, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
