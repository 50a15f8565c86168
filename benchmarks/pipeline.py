"""Pipeline schedules compared: bubble, activations held, compiled memory, step time, timelines.

For each schedule (GPipe, 1F1B, interleaved, ZB-H1) at ``--stages`` × ``--microbatches`` it
reports what the table says (ticks, bubble fraction against its closed form, peak
micro-batch activations per stage) and what the compiled program costs when the example
GPT's blocks run under ``jaxpar.pipeline``'s executor: lock-step executor steps, buffer
slots, per-device argument / output / temp bytes from ``memory_analysis`` and the median
step time (forward + backward). A non-pipelined row (the same model, one ``jax.jit``,
the batch split over the pipe devices) gives the baseline. The timelines are drawn into
``--plot``.

    python benchmarks/pipeline.py                       # CPU: 8 simulated devices, pipe=4
    python benchmarks/pipeline.py --stages 2 --microbatches 8 --out /tmp/pipe.json
    python benchmarks/pipeline.py --embedding            # where the embedding and head live

``--embedding`` compares instead, through the ``Trainer`` (adamw), the embedding run before
the pipeline on every stage with the embedding run on the first virtual stage, the
vocabulary (embedding table and head) replicated over the pipe axis or split over it:
per-device argument and temp bytes of the compiled step and the bytes entering the pipeline.

On a CPU the step times only compare schedules with each other on this machine (the
simulated devices share its cores, so a bubble costs nothing there); memory and bubble are
exact wherever it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

if __name__ == "__main__":  # before JAX starts its backend; harmless on GPU/TPU
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_BENCH_DEVICES", "8")))

import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
from jaxpar.pipeline import (SCHEDULES, bubble_fraction, build, lower, peak_activations,
                             pipeline_loss, plot_timeline, timeline, to_stage_layout)
from jaxpar.pipeline.vshape import zb_v_ticks

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "pipeline_cpu.json")
CLOSED_FORMS = {"gpipe": lambda p, m, v: (p - 1, m + p - 1),
                "1f1b": lambda p, m, v: (p - 1, m + p - 1),
                "interleaved": lambda p, m, v: (p - 1, v * m + p - 1),
                "zb-h1": lambda p, m, v: (p - 1, 3 * m + p - 1),
                "zb-v": lambda p, m, v: (zb_v_ticks(p, m) - 6 * m, zb_v_ticks(p, m)),
                "dualpipe-v": lambda p, m, v: (p - 1, 6 * m + p - 1)}


# --------------------------------------------------------------------------- the GPT, piped


def gpt_pipeline_loss(model: GPT, schedule, mesh):
    """``loss(model, batch)`` for the example GPT with its blocks run as ``schedule``.

    Embedding outside the pipeline, stacked blocks inside (one chunk = a slice of the
    "layers" axis, run with ``lax.scan``), final norm + head + cross-entropy on the last stage.
    """
    blocks_def, ln_def = nnx.graphdef(model.blocks), nnx.graphdef(model.ln_f)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages

    def stage_fn(chunk, x):
        return jax.lax.scan(lambda h, layer: (nnx.merge(blocks_def, layer)(h), None), x, chunk)[0]

    def head_loss(head, y, targets):
        ln_state, w = head
        logits = nnx.merge(ln_def, ln_state)(y) @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    run = pipeline_loss(stage_fn, head_loss, schedule, mesh)

    def loss(model, batch):
        def micro(a):
            return a.reshape(m, -1, *a.shape[1:])

        blocks = to_stage_layout(nnx.state(model.blocks), p, v, schedule.placement)
        head = (nnx.state(model.ln_f), model.head[...])
        return run(blocks, head, micro(model.embed(batch["inputs"])), micro(batch["targets"]))

    return loss


# --------------------------------------------------------------------------- measuring


def compile_step(loss, model, batch):
    step = nnx.jit(nnx.value_and_grad(loss))
    start = time.perf_counter()
    compiled = step.lower(model, batch).compile()
    return step, compiled, time.perf_counter() - start


def time_step(step, model, batch, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(step(model, batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(model, batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, loss, model, batch, args) -> dict:
    step, compiled, compile_s = compile_step(loss, model, batch)
    mem = compiled.memory_analysis()
    row = {"schedule": name, "compile_s": compile_s,
           "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
           "temp_bytes": mem.temp_size_in_bytes,
           "step_s": time_step(step, model, batch, args.warmup, args.steps)}
    print(f"  {name}: compiled in {compile_s:.1f}s", file=sys.stderr)
    return row


def schedule_row(schedule) -> dict:
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    num, den = CLOSED_FORMS[schedule.name](p, m, v)
    program = lower(schedule)
    return {"stages": p, "microbatches": m, "virtual_stages": v, "ticks": schedule.ticks,
            "bubble": str(bubble_fraction(schedule)),
            "bubble_float": float(bubble_fraction(schedule)), "closed_form": f"{num}/{den}",
            "closed_form_holds": bubble_fraction(schedule) * den == num,
            "peak_activations": peak_activations(schedule),
            "peak_activations_until_w": peak_activations(schedule, until="W"),
            "executor_steps": program.steps, "x_slots": program.x_slots,
            "g_slots": program.g_slots}


# --------------------------------------------------------------------------- output


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["schedule", "ticks", "bubble", "closed form", "peak act. (stage 0..p-1)", "steps",
            "buffers x/g", "arg KiB", "temp KiB", "compile s", "step ms"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("schedule", "peak act. (stage 0..p-1)")
                         else "right")
    for r in rows:
        piped = "ticks" in r
        table.add_row(
            r["schedule"], str(r.get("ticks", "")),
            f"{r['bubble']} = {r['bubble_float']:.3f}" if piped else "",
            (r["closed_form"] + (" ok" if r["closed_form_holds"] else " NO")) if piped else "",
            str(r.get("peak_activations", "")), str(r.get("executor_steps", "")),
            f"{r['x_slots']}/{r['g_slots']}" if piped else "",
            f"{r['argument_bytes'] / 1024:,.0f}", f"{r['temp_bytes'] / 1024:,.0f}",
            f"{r['compile_s']:.1f}", f"{r['step_s'] * 1e3:.1f}")
    Console(width=160).print(table)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages p (default 4)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches m (default 8)")
    ap.add_argument("--virtual-stages", type=int, default=2, help="v for 'interleaved'")
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES), metavar="NAME",
                    help=f"subset of {list(SCHEDULES)}")
    ap.add_argument("--embed", type=int, default=64, help="GPT width")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="global batch (split in micro-batches)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--embedding", action="store_true",
                    help="compare where the embedding and head live instead of the schedules")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary for --embedding")
    ap.add_argument("--plot", default=None, help="timelines PNG (default: --out with .png)")
    args = ap.parse_args(argv)
    unknown = set(args.schedules) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; choose from {list(SCHEDULES)}")
    if args.stages > len(jax.devices()):
        ap.error(f"--stages {args.stages} needs that many devices; there are {len(jax.devices())} "
                 f"{jax.devices()[0].platform} devices: use --stages {len(jax.devices())} or fewer (2 at least), "
                 f"or run on simulated CPU devices (JAX_PLATFORMS=cpu, JAXPAR_BENCH_DEVICES={args.stages})")
    return args


def embedding_rows(args) -> list[dict]:
    """Per-device bytes of the compiled training step for each embedding placement."""
    import jaxpar
    from jaxpar.models.gpt_parallel import pipeline_loss as gpt_pipeline

    p, m = args.stages, args.microbatches
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, embed=args.embed, heads=4,
                    mlp=4 * args.embed, layers=2 * p, scan_layers=True)
    rows_ = jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, args.vocab)
    batch = {"inputs": rows_[:, :-1], "targets": rows_[:, 1:]}
    table = 2 * args.vocab * args.embed * 4        # embedding table + head, fp32
    rows = []
    for schedule in ("1f1b", "zb-v"):
        for embedding, vocab in (("outside", None), ("first", None), ("first", "pipe")):
            config = jaxpar.ParallelConfig(
                mesh={"pipe": p}, rules={"layers": "pipe", "vocab": vocab} if vocab else {"layers": "pipe"},
                pipeline={"stages": p, "microbatches": m, "schedule": schedule, "embedding": embedding})
            mesh = jaxpar.make_mesh(config, devices=jax.devices()[:p])
            model = jaxpar.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config, mesh)
            trainer = jaxpar.Trainer(model, optax.adamw(1e-3), gpt_pipeline(), config, mesh)
            mem = trainer.lower(batch).compile().memory_analysis()
            boundary = (args.batch * args.seq_len * args.embed * 4 if embedding == "outside"
                        else 2 * args.batch * args.seq_len * 4)   # activations, or token ids + targets
            rows.append({"schedule": schedule, "embedding": embedding, "vocab over pipe": bool(vocab),
                         "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
                         "pipeline_input_bytes": boundary, "embedding_and_head_bytes": table})
            print(f"  {schedule} embedding={embedding} vocab={vocab}: compiled", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.embedding:
        rows = embedding_rows(args)
        keys = list(rows[0])
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(str(r[k]) for k in keys))
        out = args.out if args.out != DEFAULT_OUT else os.path.join(HERE, "results", "pipeline_embedding_cpu.json")
        with open(out, "w") as f:
            json.dump({"meta": {"jax": jax.__version__, "platform": jax.devices()[0].platform,
                                "date": time.strftime("%Y-%m-%d")}, "results": rows}, f, indent=2)
        print(f"results written to {out}", file=sys.stderr)
        return 0
    p, m = args.stages, args.microbatches
    schedules = [build(n, p, m, args.virtual_stages if n == "interleaved" else 1)
                 for n in args.schedules]
    layers = p * max(s.virtual_stages for s in schedules)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, embed=args.embed, heads=4,
                    mlp=4 * args.embed, layers=layers, scan_layers=True)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    rows_ = jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, 64)
    batch = {"inputs": rows_[:, :-1], "targets": rows_[:, 1:]}
    mesh = jax.make_mesh((p,), ("pipe",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])
    rows = []
    for schedule in schedules:
        print(timeline(schedule), file=sys.stderr)
        loss = gpt_pipeline_loss(model, schedule, mesh)
        rows.append(schedule_row(schedule) | measure(schedule.name, loss, model, batch, args))
    # Baseline: no pipeline, the batch split over the same devices (data parallel).
    put = jax.device_put(batch, NamedSharding(mesh, P("pipe")))
    rows.append(measure("no pipeline (data=p)", loss_fn, model, put, args))
    title = (f"GPT ({layers} layers, embed {args.embed}, batch {args.batch}×{args.seq_len}) "
             f"on {p} {jax.devices()[0].platform} devices, p={p} m={m}")
    print_table(rows, title)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {"jax": jax.__version__, "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "title": title,
            "date": time.strftime("%Y-%m-%d"), "steps": args.steps}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    plot_timeline(schedules, png)
    print(f"results written to {args.out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
