"""The combination matrix: which features every cell turns on, and how one cell trains.

A cell is a dict ``{feature: value}``. `CELLS` covers every pair of feature values that can
meet (pairwise, generated greedily from the full product), plus the full product of the
three most used features (Megatron TP × each pipeline schedule × ZeRO 0/1). Pairs that cannot
meet are listed in `REFUSED` (jaxpar raises a ``ValueError`` naming both features when the
Trainer is built) or `NOT_APPLICABLE` (the example model is written for global arrays, so
per-device code with tensor parallel is not a thing it can do).

`run_cell` trains one cell for `STEPS` adamw steps on a tiny scanned GPT with dropout modules
(rate 0: the RNG state is there and threads through every technique, the numbers stay those
of one device), and returns its losses and parameters. A ``precision="bf16"`` cell is compared
with one device under the same precision, within `TOLERANCE` (bf16 sums in another order
round differently).
"""

from __future__ import annotations

import itertools
import re

FEATURES = {
    "layout": ("data", "megatron", "fused", "2d"),
    "pipeline": ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"),
    "zero": (0, 1, 3),
    "accum": (1, 2),
    "interleave": (1, 2),
    "remat": ("none", "full"),
    "mode": ("given", "hybrid", "auto"),
    "ckpt": ("no", "restore"),
    "precision": ("none", "bf16"),
    "context": ("none", "ring", "ulysses"),
    "moe": ("none", "ep"),
    "embedding": ("outside", "first"),   # where a pipeline runs the embedding (only with a pipeline)
    "loss": ("full", "chunked"),         # GPTConfig.loss_chunks: 0, or 4 (jaxpar.ops.chunked_cross_entropy)
}
STEPS = 5
# (loss, parameter) relative tolerances against one device, by precision. bf16 runs that sum in
# another order differ by ~0.3 % in loss and up to ~8 % in the smallest parameters (biases)
# after STEPS steps; bf16 against fp32 differs by as much, so a bf16 cell catches broken
# gradients and crashes, not a subtly wrong dtype (tests/test_precision.py checks those).
TOLERANCE = {"none": (1e-5, 5e-5), "bf16": (1e-2, 1e-1)}
SAVE_AT = 2
BATCH = 32

# (feature, value, feature, value) pairs jaxpar refuses up front, with the reason.
REFUSED = {
    ("mode", "hybrid", "pipeline"): "the pipeline is itself a shard_map over the pipe axis",
    ("mode", "auto", "pipeline"): "the strategy search does not place stages; search_job(JobSearchSpace(pipeline_stages=...)) does",
    ("precision", "bf16", "pipeline"): "on CPU only: XLA:CPU aborts widening the pipeline's bf16 collectives",
    ("mode", "hybrid", "context"): "per-device code sees one shard of the sequence and no context attention",
    ("mode", "auto", "context"): "the strategy search does not place the sequence over a context axis",
    ("mode", "hybrid", "moe"): "per-device code would run every expert on every device",
    ("mode", "auto", "moe"): "the strategy search does not read the dispatch's scatters",
}
# Pairs the example model cannot express: per-device (hybrid) code that is written for global arrays.
NOT_APPLICABLE = {("mode", "hybrid", "layout"), ("mode", "auto", "layout")}


def _blocked(cell: dict) -> bool:
    """Cells that are refused or not applicable (see the module docstring), or whose batch of
    `BATCH` rows does not divide into accumulation × interleave × pipeline micro-batches × the
    data axis."""
    if cell["mode"] != "given" and cell["pipeline"] != "none":
        return True
    if cell["precision"] != "none" and cell["pipeline"] != "none":
        return True
    if cell["context"] != "none" and cell["mode"] != "given":
        return True
    if cell["moe"] != "none" and cell["mode"] != "given":
        return True
    if cell["mode"] != "given" and cell["layout"] != "data":
        return True
    if cell["pipeline"] != "none" and cell["layout"] == "data" and cell["accum"] * cell["interleave"] > 2:
        return True
    if cell["embedding"] == "first" and cell["pipeline"] == "none":
        return True
    return False


def _pairs(cell: dict) -> set:
    items = sorted(cell.items())
    return {(a, va, b, vb) for (a, va), (b, vb) in itertools.combinations(items, 2)}


def _feasible() -> list[dict]:
    names = list(FEATURES)
    out = []
    for values in itertools.product(*FEATURES.values()):
        cell = dict(zip(names, values))
        if not _blocked(cell):
            out.append(cell)
    return out


def uncoverable(pair) -> bool:
    a, va, b, vb = pair
    probe = {a: va, b: vb}
    if probe.get("embedding") == "first":   # a pipeline setting: no cell without a pipeline has it
        other = b if a == "embedding" else a
        if probe[other] == "none" and other == "pipeline":
            return True
        if any(f == other and probe[other] == v and g == "pipeline" for f, v, g in REFUSED):
            return True
    for (f, v, g) in REFUSED:
        if probe.get(f) == v and g in probe and probe[g] != "none":
            return True
    for (f, v, g) in NOT_APPLICABLE:
        if probe.get(f) == v and g in probe and probe[g] != "data":
            return True
    return False


def all_pairs() -> set:
    """Every (feature, value, feature, value) pair that can meet (the names in sorted order, as
    `_pairs` gives them)."""
    names = sorted(FEATURES)
    return {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
            for va in FEATURES[a] for vb in FEATURES[b] if not uncoverable((a, va, b, vb))}


BASE = {"layout": "data", "pipeline": "none", "zero": 0, "accum": 1, "interleave": 1, "remat": "none",
        "mode": "given", "ckpt": "no", "precision": "none", "context": "none",
        "moe": "none", "embedding": "outside", "loss": "full"}
PRODUCT = [dict(BASE, layout="megatron", pipeline=p, zero=z)
           for p in FEATURES["pipeline"] for z in (0, 1)]


# Cells run under `jaxpar launch` (tests/workers/matrix_launch_worker.py: 2 processes x 4 devices
# and 4 x 2, each process feeding its own rows of every global batch): the features whose
# collectives or layouts meet process boundaries there. Pipelined cells put the pipe axis first,
# so that stages sit on different processes.
LAUNCHED = [
    dict(BASE, layout="megatron", zero=1),                         # Megatron, the vocabulary split
    dict(BASE, zero=3, accum=2),                                   # ZeRO-3 x accumulation
    dict(BASE, precision="bf16", zero=1),
    dict(BASE, layout="megatron", pipeline="1f1b", pipe_outer=True),
    dict(BASE, pipeline="zb-v", pipe_outer=True),
    dict(BASE, context="ring"),
    dict(BASE, moe="ep"),                                          # the expert axis over every process
]


# Cells beside the cover, whose model is not the matrix's GPT: the job of issue #29, a Llama
# (RMSNorm, rotary positions, grouped-query attention whose kv heads stay whole, SwiGLU, untied
# head) under Megatron with the vocabulary split, exactly as reported: the pipe axis first in the
# mesh, "embed" mapped to None, m = p = 2 micro-batches, interleaved with one chunk per stage.
# `stray_collectives` checks their compiled step too.
EXTRA = [dict(BASE, layout="megatron", pipeline=schedule, model="llama", microbatches=2)
         for schedule in ("1f1b", "interleaved")]


# Cells whose model cuts a tensor-parallel dimension off its shard boundaries inside a pipeline
# stage (tests/workers/fused_qkv_worker.py's small LM, heads over model=2): a fused QKV kernel cut
# into thirds with jnp.split (a resharding inside the stage's op: refused when the step compiles,
# naming the stage, the parameter and the axis), 3 heads of separate q/k/v projections (a head
# straddles two shards; XLA reshards within the stage: trains equal to one device), and 3 heads
# as a kernel dimension (refused when the model is built, naming the parameter and the axis).
MISALIGNED = [dict(BASE, layout="megatron", pipeline="1f1b", model=m, microbatches=2)
              for m in ("fused_split", "odd_heads", "odd_heads_dim")]
# What each refused one's message must hold (regular expressions), by model.
MISALIGNED_REFUSAL = {
    "fused_split": (r"pipeline stage \d", r"\['qkv'\]\['kernel'\]", r"mesh axis 'model'"),
    "odd_heads_dim": (r"parameter 'blocks/w[qkv]'", r"dimension 2 of size 3 is not divisible by 2", r"'model'"),
}


def misaligned_shape(model: str):
    """The `fused_qkv_worker.Shape` of a `MISALIGNED` cell's model."""
    from workers.fused_qkv_worker import Shape

    return {"fused_split": Shape(qkv="fused"), "odd_heads": Shape(qkv="separate", heads=3, head_dim=4),
            "odd_heads_dim": Shape(qkv="headed", heads=3, head_dim=4)}[model]


# What a cell costs to run, in CPU seconds on a 2-core machine (XLA:CPU; almost all of it tracing
# and compiling): a base times one factor for each feature value other than the first. Fitted
# (least squares on the log of each cell's time) to every cell of the previous cover, timed alone
# with `python tests/workers/matrix_costs.py`; factors below 1.03 are held at 1.03 (a feature
# switched on adds work), except for layouts and modes, which change the program instead of adding to it.
CELL_COST_BASE = 5.95
CELL_COST = {
    ("layout", "megatron"): 0.98, ("layout", "fused"): 0.96, ("layout", "2d"): 0.90,
    ("pipeline", "gpipe"): 1.13, ("pipeline", "1f1b"): 1.16, ("pipeline", "interleaved"): 1.06,
    ("pipeline", "zb-h1"): 1.61, ("pipeline", "zb-v"): 1.17, ("pipeline", "dualpipe-v"): 1.22,
    ("zero", 1): 1.03, ("zero", 3): 1.03, ("accum", 2): 1.06, ("interleave", 2): 1.31, ("remat", "full"): 1.13,
    ("mode", "hybrid"): 0.68, ("mode", "auto"): 0.82, ("ckpt", "restore"): 1.50, ("precision", "bf16"): 1.18,
    ("context", "ring"): 1.34, ("context", "ulysses"): 1.03, ("moe", "ep"): 1.44, ("embedding", "first"): 1.19,
    ("loss", "chunked"): 1.03,
}


def cell_cost(cell: dict) -> float:
    """The estimated CPU seconds of a cell (`CELL_COST`)."""
    cost = CELL_COST_BASE
    for feature, value in cell.items():
        cost *= CELL_COST.get((feature, value), 1.0)
    return cost


# The greedy cover breaks ties at random, with this seed.
COVER_SEED = 0


def _cover(seed: int = COVER_SEED) -> list[dict]:
    """Greedy pairwise cover, priced: first one cell for each (Megatron, schedule, ZeRO 0/1) of
    `PRODUCT`, its other features chosen for the most pairs per second of `cell_cost`, then the
    cell covering the most pairs left per second until none is left (ties broken by a random
    generator seeded with ``seed``); last, cells whose every pair another cell covers are dropped,
    the dearest first (never a `PRODUCT` cell). Pair sets are bit masks (one bit a pair), so a
    score is one ``&`` and a popcount.

    Pricing the cells cut the cover's time by 38 % against taking the most pairs alone: 42 cells,
    411 estimated and 406 measured CPU seconds, against 41 cells, 693 estimated and 650 measured
    (`tests/workers/matrix_costs.py`, 2 cores). Every pair is still covered, with fewer costly
    features stacked in one cell (triples of feature values covered: 3,774 against 4,096)."""
    import random

    rng = random.Random(seed)
    feasible = _feasible()
    wanted = sorted(all_pairs(), key=repr)
    bit = {p: 1 << i for i, p in enumerate(wanted)}
    masks = [sum(bit.get(p, 0) for p in _pairs(c)) for c in feasible]
    costs = [cell_cost(c) for c in feasible]
    todo, taken = (1 << len(wanted)) - 1, []

    def take(candidates):
        nonlocal todo
        scores = [(masks[i] & todo).bit_count() / costs[i] for i in candidates]
        best = max(scores)
        i = rng.choice([i for i, s in zip(candidates, scores) if s >= best * (1 - 1e-9)])
        taken.append(i)
        todo &= ~masks[i]

    for seed_cell in PRODUCT:
        keys = ("layout", "pipeline", "zero")
        take([i for i, c in enumerate(feasible) if all(c[k] == seed_cell[k] for k in keys)])
    while todo:
        take(range(len(feasible)))
    while True:     # drop a redundant cell, the dearest first, until none is redundant
        for j in sorted(range(len(PRODUCT), len(taken)), key=lambda j: -costs[taken[j]]):
            others = 0
            for k, i in enumerate(taken):
                if k != j:
                    others |= masks[i]
            if masks[taken[j]] & ~others == 0:
                del taken[j]
                break
        else:
            break
    return [feasible[i] for i in taken]


def __getattr__(name: str):
    # CELLS is computed on first use (~2 s), not by the worker processes that are handed their cells
    if name == "CELLS":
        globals()["CELLS"] = _cover()
        return globals()["CELLS"]
    raise AttributeError(name)


def name(cell: dict) -> str:
    return "-".join(f"{v}" for v in cell.values())


def config_for(cell: dict):
    """The ``ParallelConfig`` of a cell (8 devices)."""
    import jaxpar

    piped = cell["pipeline"] != "none"
    rules = {"batch": "data"}
    if cell["layout"] in ("megatron", "fused"):
        rules |= {"heads": "model", "mlp": "model", "vocab": "model"}
        mesh = {"data": 2, "model": 2, "pipe": 2} if piped else {"data": 2, "model": 4}
    elif cell["layout"] == "2d":
        rules |= {"embed": "model", "heads": "data", "mlp": "data", "vocab": "data"}
        mesh = {"data": 2, "model": 2, "pipe": 2} if piped else {"data": 2, "model": 4}
    else:
        mesh = {"data": 4, "pipe": 2} if piped else {"data": 8}
    if piped:
        rules["layers"] = "pipe"
        if cell.get("pipe_outer"):      # the pipe axis first: on several processes, stages on other processes
            mesh = {"pipe": mesh.pop("pipe"), **mesh}
    if cell.get("model") == "llama":   # the reported job (see EXTRA): pipe first, embed named and unsplit
        mesh = {"pipe": 2, "data": 2, "model": 2} if piped else mesh
        rules |= {"embed": None}
    context = None
    if cell["context"] != "none":   # half the data axis splits the sequence instead
        mesh = {"data": 4, "context": 2} if cell["layout"] == "data" else {"data": 2, "context": 2, "model": 2}
        if piped:   # each stage's blocks get their micro-batch's positions (PipelineLoss.block_call)
            mesh = {"data": 2, "context": 2, "pipe": 2} if cell["layout"] == "data" else {
                "data": 1, "context": 2, "model": 2, "pipe": 2}
        rules["length"] = "context"     # sequence parallel: the residual stream runs on sequence shards
        context = {"strategy": cell["context"], "order": "zigzag" if cell["context"] == "ring" else "striped"}
    mode = {"given": "semi_auto", "hybrid": "hybrid", "auto": "auto"}[cell["mode"]]
    if cell["moe"] != "none" and cell["layout"] != "2d":
        rules["expert"] = "data"     # expert parallel inside data parallel; TP layouts split each expert's mlp
    # (2D: mlp is on the data axis already, so each expert is split 2D over data x model instead)
    if mode == "hybrid":
        rules = {}
    llama = cell.get("model") == "llama"
    pipeline = {"stages": 2, "microbatches": cell.get("microbatches", 4), "schedule": cell["pipeline"],
                "embedding": cell["embedding"],
                "virtual_stages": 2 if cell["pipeline"] == "interleaved" and not llama else 1} if piped else {}
    return jaxpar.ParallelConfig(
        mesh=mesh, mode=mode, rules=rules if mode != "auto" else {},
        optimizer={"level": cell["zero"], "threshold_kb": 0}, grad_accum=cell["accum"],
        interleave=cell["interleave"], remat=cell["remat"], pipeline=pipeline,
        search="dynamic_programming" if mode == "auto" else None,
        precision=None if cell["precision"] == "none" else cell["precision"], context=context)


def gpt_config(cell: dict | None = None):
    from jaxpar.models.gpt import GPTConfig
    from jaxpar.nn import MoEConfig

    # MoE: 8 experts (one per device at EP=8), top-2; a coarse buffer ladder keeps compiles few. No
    # load-balancing loss: it is a product of two means over the tokens of a micro-batch, so
    # accumulation and multi-copy (which split the batch) change it; the z-loss, a plain mean, stays.
    moe = (MoEConfig(experts=8, top_k=2, expert_mlp=16, bucket_growth=2.0, aux_loss_weight=0.0)
           if cell and cell["moe"] != "none" else None)
    return GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=4, scan_layers=True,
                     dropout=0.0, fused_qkv=bool(cell and cell["layout"] == "fused"), moe=moe,
                     loss_chunks=4 if cell and cell.get("loss") == "chunked" else 0)


def model_config(cell: dict | None = None):
    """The cell's model config: the matrix's GPT (`gpt_config`), or the tiny scanned Llama of `EXTRA`."""
    if cell and cell.get("model") == "llama":
        from jaxpar.models.llama import LlamaConfig

        return LlamaConfig.named("tiny", scan_layers=True)
    if cell and cell.get("model", "gpt") != "gpt":
        return misaligned_shape(cell["model"])
    return gpt_config(cell)


def _trainer(config, gpt, devices, services=None):
    import jax
    import optax
    from flax import nnx

    import jaxpar
    import jaxpar.auto
    from jaxpar.models import gpt as gpt_module
    from jaxpar.models import gpt_parallel, llama_parallel
    from jaxpar.models import llama as llama_module
    from jaxpar.ops import ContextParallel

    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:devices])
    if not isinstance(gpt, (gpt_module.GPTConfig, llama_module.LlamaConfig)):   # a MISALIGNED cell's LM
        from workers.fused_qkv_worker import LM, pipeline_loss

        return jaxpar.Trainer(jaxpar.init(lambda: LM(gpt, nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                              pipeline_loss(), config, mesh)
    llama = isinstance(gpt, llama_module.LlamaConfig)
    Model = llama_module.Llama if llama else gpt_module.GPT
    loss_fn = (llama_module if llama else gpt_module).loss_fn
    pipeline_loss = (llama_parallel if llama else gpt_parallel).pipeline_loss

    constrain = jaxpar.LogicalConstraint(mesh, config.rules) if config.mode == "semi_auto" else None
    if config.context is not None:   # attention across the context axis, masked by original positions
        constrain = ContextParallel(constrain, mesh, config)
    kw = {"constrain": constrain} if constrain is not None else {}
    model = jaxpar.init(lambda: Model(gpt, rngs=nnx.Rngs(0), **kw), config, mesh)
    # unpipelined context / MoE cells run the plain loss; pipelined ones the pipeline's parts, whose
    # blocks get the micro-batch (positions) and whose MoE auxiliary losses join the loss
    whole = (config.context is not None or gpt.moe is not None) and config.pipeline.stages == 1
    loss = loss_fn if whole else pipeline_loss()
    tx = optax.adamw(1e-3)
    # mode "auto" is searched before the Trainer is built; the Trainer plans the other modes itself
    plan = jaxpar.auto.plan_for(model, tx, loss, config, mesh, example_batch=_batches()[0]) \
        if config.mode == "auto" else None
    return jaxpar.Trainer(model, tx, loss, config, mesh, plan=plan, services=services)


def _batches():
    from jaxpar.models.data import ArithmeticData

    data = ArithmeticData(16)
    return [data.batch(BATCH, i) for i in range(STEPS)]


def _params(trainer):
    import jax
    import numpy as np
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))
    if jax.process_count() > 1:     # every process gets the whole of each parameter: one program for all
        whole = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(
            trainer.mesh, jax.sharding.PartitionSpec()))(params)
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), whole)
    return jax.tree.map(np.asarray, params)


def run_cell(cell: dict, tmp_dir: str | None = None, inspect=None, rows=None):
    """``(losses, params)`` of ``STEPS`` steps under ``cell`` (``ckpt="restore"``: the first
    `SAVE_AT` steps under the cell, saved, the rest in a plain ``data=8`` trainer restored
    from that checkpoint). ``inspect(trainer, batch)`` runs before the first step. ``rows``:
    on several processes, the slice of each global batch's rows this process feeds."""
    import jaxpar

    gpt = model_config(cell)
    trainer = _trainer(config_for(cell), gpt, 8)
    batches = _batches()
    if rows is not None:
        batches = [{k: v[rows] for k, v in b.items()} for b in batches]
    if inspect is not None:
        inspect(trainer, batches[0])
    if cell["ckpt"] == "no":
        return [float(trainer.step(b)["loss"]) for b in batches], _params(trainer)
    losses = [float(trainer.step(b)["loss"]) for b in batches[:SAVE_AT]]
    trainer.save(tmp_dir)
    plain = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"},
                                           precision=config_for(cell).precision), gpt, 8)
    plain.restore(tmp_dir)
    losses += [float(plain.step(b)["loss"]) for b in batches[SAVE_AT:]]
    return losses, _params(plain)


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?\S+ = .*? (collective-permute|all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(")


def stray_collectives(trainer, batch) -> list[str]:
    """The collectives of the compiled step that a pipeline stage's branch must not hold: any
    collective-permute (XLA:CPU makes one wait for every device of the program, and the other
    stages run other branches: the process aborts in the rendezvous) and any collective whose
    groups span pipeline stages. Collectives within a stage's devices are fine."""
    import numpy as np

    mesh = trainer.mesh
    pipe = list(mesh.axis_names).index(trainer.config.pipeline.axis)
    stage = {d.id: index[pipe] for index, d in np.ndenumerate(mesh.devices)}
    return strays(trainer.lower(batch).compile().as_text(), stage)


def strays(hlo: str, stage: dict[int, int]) -> list[str]:
    """`stray_collectives` of an optimized HLO text, ``stage``: device id -> pipeline stage."""
    return [line.strip()[:300] for line in _branch_lines(hlo) if (m := _COLLECTIVE.search(line))
            and (m.group(1) == "collective-permute"
                 or any(len({stage[d] for d in group}) > 1 for group in _groups(line)))]


def _branch_lines(hlo: str) -> list[str]:
    """The instructions of every computation a conditional's branch runs (transitively)."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    called = lambda line: {c.strip().lstrip("%") for m in re.finditer(  # noqa: E731
        r"(?:to_apply|calls|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?", line)
        for c in m.group(1).split(",")}
    todo = [c for lines in bodies.values() for line in lines if " conditional(" in line
            for m in re.finditer(r"branch_computations=\{([^}]*)\}", line) for c in
            (x.strip().lstrip("%") for x in m.group(1).split(","))]
    seen: set = set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += [d for line in bodies.get(c, []) for d in called(line)]
    return [line for c in seen for line in bodies.get(c, [])]


def _groups(line: str) -> list[list[int]]:
    """The device groups of a collective: ``replica_groups={{0,1},...}`` or the iota form
    ``[4,2]<=[2,2,2]T(1,0,2)``."""
    import numpy as np

    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape([int(x) for x in m.group(1).split(",")]).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))] if m else []


def reference(key: tuple):
    """The same training on one device, for a `reference_key` (same model and precision setting)."""
    import jaxpar

    fused, precision, moe, model = key
    cell = dict(BASE, layout="fused" if fused else "data", moe=moe, model=model)
    config = jaxpar.ParallelConfig(mesh={"data": 1}, precision=None if precision == "none" else precision)
    trainer = _trainer(config, model_config(cell), 1)
    return [float(trainer.step(b)["loss"]) for b in _batches()], _params(trainer)


def reference_key(cell: dict) -> tuple:
    """Which one-device reference a cell is compared with: (fused qkv, precision, moe, model)."""
    return (cell["layout"] == "fused", cell["precision"], cell["moe"], cell.get("model", "gpt"))


def reference_name(key: tuple) -> str:
    """The name of a reference in the references file."""
    return "-".join(str(k) for k in key)


def load_references(path: str, timeout: float = 600.0) -> dict:
    """``{name: (losses, [params in sorted path order])}`` from a references file, waiting up to
    ``timeout`` seconds for it to appear (another pytest worker may still be computing it)."""
    import os
    import time

    import numpy as np

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the matrix references {path} did not appear within {timeout:.0f} s")
        time.sleep(0.5)
    refs = {}
    with np.load(path, allow_pickle=False) as z:
        for name in {k.split("/")[0] for k in z.files}:
            keys = sorted(k for k in z.files if k.startswith(f"{name}/p/"))
            refs[name] = (z[f"{name}/losses"], [z[k] for k in keys])
    return refs


def flat_params(params) -> dict:
    """``{path: array}`` of a parameter tree (sorted paths give a stable order)."""
    import jax

    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def errors(result, expected) -> tuple[float, float]:
    """(max relative loss error, max relative parameter error in norm); parameters as lists
    in the order of their sorted paths."""
    import numpy as np

    losses, params = result
    loss_err = float(np.max(np.abs(np.array(losses) - expected[0]) / np.abs(expected[0])))
    if len(params) != len(expected[1]):
        raise ValueError(f"{len(params)} parameters, the reference has {len(expected[1])}")
    param_err = max(float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))
                    for a, e in zip(params, expected[1]))
    return loss_err, param_err


class References:
    """The one-device references file at ``path``, read when a cell first needs it (another
    process may still be writing it: the cell's process trains meanwhile)."""

    def __init__(self, path: str):
        self.path, self._refs = path, None

    def errors(self, cell: dict, losses, params) -> tuple[float, float]:
        """`errors` of a cell's losses and parameters against its reference."""
        import numpy as np

        flat = [np.asarray(p, np.float32) for _, p in sorted(flat_params(params).items())]
        self._refs = self._refs or load_references(self.path)
        return errors((losses, flat), self._refs[reference_name(reference_key(cell))])


def cell_line(cell: dict, references: References, tmp_dir: str, rows=None) -> dict:
    """One cell's result as a JSON-able line: ``{"name", "loss_err", "param_err", "tolerance"}``
    (a Llama cell also its stage branches' ``"stray"`` collectives), ``{"name", "refused", "where"}``
    (a ``ValueError``: jaxpar refused the cell; where it was raised) or ``{"name", "error"}``;
    ``rows`` as `run_cell`'s."""
    import traceback

    line = {"name": name(cell)}
    try:
        inspect = None
        if cell.get("model") == "llama":     # the cells beside the cover also report their branches' collectives
            def inspect(trainer, batch):
                line["stray"] = stray_collectives(trainer, batch)
        losses, params = run_cell(cell, tmp_dir, inspect, rows=rows)
        line["loss_err"], line["param_err"] = references.errors(cell, losses, params)
        line["tolerance"] = TOLERANCE[cell["precision"]]
    except ValueError as e:     # the test checks that the cell expects a refusal, and its words
        line["refused"], line["where"] = str(e), traceback.format_exc(limit=-12)
    except Exception as e:  # reported by the test with the cell's name
        line["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    return line


__all__ = ["CELLS", "EXTRA", "FEATURES", "MISALIGNED", "MISALIGNED_REFUSAL", "REFUSED", "TOLERANCE", "all_pairs", "reference_key", "reference_name", "config_for", "errors", "flat_params", "name", "reference",
           "run_cell", "stray_collectives", "References", "cell_line"]
