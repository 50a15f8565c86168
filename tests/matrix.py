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

FEATURES = {
    "layout": ("data", "megatron", "fused", "2d"),
    "pipeline": ("none", "gpipe", "1f1b", "interleaved", "zb-h1"),
    "zero": (0, 1, 3),
    "accum": (1, 2),
    "interleave": (1, 2),
    "remat": ("none", "full"),
    "mode": ("given", "hybrid", "auto"),
    "ckpt": ("no", "restore"),
    "precision": ("none", "bf16"),
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
    ("mode", "auto", "pipeline"): "the strategy search does not place stages; plan_job(pipeline_stages=...) does",
    ("precision", "bf16", "pipeline"): "on CPU only: XLA:CPU aborts widening the pipeline's bf16 collectives",
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
    if cell["mode"] != "given" and cell["layout"] != "data":
        return True
    if cell["pipeline"] != "none" and cell["layout"] == "data" and cell["accum"] * cell["interleave"] > 2:
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
    for (f, v, g) in REFUSED:
        if probe.get(f) == v and g in probe and probe[g] != "none":
            return True
    for (f, v, g) in NOT_APPLICABLE:
        if probe.get(f) == v and g in probe and probe[g] != "data":
            return True
    return False


def all_pairs() -> set:
    cells = [dict(zip(FEATURES, values)) for values in itertools.product(*FEATURES.values())]
    return {p for c in cells for p in _pairs(c) if not uncoverable(p)}


BASE = {"layout": "data", "pipeline": "none", "zero": 0, "accum": 1, "interleave": 1, "remat": "none",
        "mode": "given", "ckpt": "no", "precision": "none"}
PRODUCT = [dict(BASE, layout="megatron", pipeline=p, zero=z)
           for p in ("none", "gpipe", "1f1b", "interleaved", "zb-h1") for z in (0, 1)]


def _cover() -> list[dict]:
    """Greedy pairwise cover, seeded with the full product of Megatron × pipeline × ZeRO-1."""
    cells = list(PRODUCT)
    todo = all_pairs() - {p for c in cells for p in _pairs(c)}
    feasible = _feasible()
    while todo:
        best = max(feasible, key=lambda c: len(_pairs(c) & todo))
        cells.append(best)
        todo -= _pairs(best)
    return cells


CELLS = _cover()


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
    mode = {"given": "semi_auto", "hybrid": "hybrid", "auto": "auto"}[cell["mode"]]
    if mode == "hybrid":
        rules = {}
    pipeline = {"stages": 2, "microbatches": 4, "schedule": cell["pipeline"],
                "virtual_stages": 2 if cell["pipeline"] == "interleaved" else 1} if piped else {}
    return jaxpar.ParallelConfig(
        mesh=mesh, mode=mode, rules=rules if mode != "auto" else {},
        optimizer={"level": cell["zero"], "threshold_kb": 0}, grad_accum=cell["accum"],
        interleave=cell["interleave"], remat=cell["remat"], pipeline=pipeline,
        search="dynamic_programming" if mode == "auto" else None,
        precision=None if cell["precision"] == "none" else cell["precision"])


def gpt_config(cell: dict | None = None):
    from jaxpar.models.gpt import GPTConfig

    return GPTConfig(vocab_size=16, seq_len=16, embed=32, heads=8, mlp=64, layers=4, scan_layers=True,
                     dropout=0.0, fused_qkv=bool(cell and cell["layout"] == "fused"))


def _trainer(config, gpt, devices):
    import jax
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models.gpt import GPT, pipeline_loss

    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:devices])
    constrain = jaxpar.LogicalConstraint(mesh, config.rules) if config.mode == "semi_auto" else None
    kw = {"constrain": constrain} if constrain is not None else {}
    model = jaxpar.init(lambda: GPT(gpt, rngs=nnx.Rngs(0), **kw), config, mesh)
    return jaxpar.Trainer(model, optax.adamw(1e-3), pipeline_loss(), config, mesh,
                          example_batch=_batches()[0] if config.mode == "auto" else None)


def _batches():
    from jaxpar.models.data import ArithmeticData

    data = ArithmeticData(16)
    return [data.batch(BATCH, i) for i in range(STEPS)]


def _params(trainer):
    import jax
    import numpy as np
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


def run_cell(cell: dict, tmp_dir: str | None = None):
    """``(losses, params)`` of ``STEPS`` steps under ``cell`` (``ckpt="restore"``: the first
    `SAVE_AT` steps under the cell, saved, the rest in a plain ``data=8`` trainer restored
    from that checkpoint)."""
    import jaxpar

    gpt = gpt_config(cell)
    trainer = _trainer(config_for(cell), gpt, 8)
    batches = _batches()
    if cell["ckpt"] == "no":
        return [float(trainer.step(b)["loss"]) for b in batches], _params(trainer)
    losses = [float(trainer.step(b)["loss"]) for b in batches[:SAVE_AT]]
    trainer.save(tmp_dir)
    plain = _trainer(jaxpar.ParallelConfig(mesh={"data": 8}, rules={"batch": "data"},
                                           precision=config_for(cell).precision), gpt, 8)
    plain.restore(tmp_dir)
    losses += [float(plain.step(b)["loss"]) for b in batches[SAVE_AT:]]
    return losses, _params(plain)


def reference(fused: bool, precision: str = "none"):
    """The same training on one device (with the same precision setting)."""
    import jaxpar

    cell = dict(BASE, layout="fused" if fused else "data")
    config = jaxpar.ParallelConfig(mesh={"data": 1}, precision=None if precision == "none" else precision)
    trainer = _trainer(config, gpt_config(cell), 1)
    return [float(trainer.step(b)["loss"]) for b in _batches()], _params(trainer)


def reference_key(fused: bool, precision: str) -> str:
    """The name of a one-device reference in the references file."""
    return f"{int(fused)}-{precision}"


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


__all__ = ["CELLS", "FEATURES", "REFUSED", "TOLERANCE", "all_pairs", "reference_key", "config_for", "errors", "flat_params", "name", "reference",
           "run_cell"]
