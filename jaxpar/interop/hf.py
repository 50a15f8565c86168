"""Hugging Face Llama checkpoints in and out of jaxpar.

``import_hf(dir)`` reads an HF ``LlamaForCausalLM`` directory (``config.json`` and
``model.safetensors`` or a sharded ``model.safetensors.index.json``) into a ``LlamaConfig`` and
jaxpar's parameter state, each tensor placed straight into the shards a ``TrainPlan`` gives it
on a mesh, and optionally writes a jaxpar checkpoint in that layout. ``export_hf`` writes the
reverse from a checkpoint directory, a parameter state or a model.

    >>> cfg, params = import_hf("Llama-3.2-1B", "ckpt", config=megatron, mesh=mesh)   # doctest: +SKIP
    >>> model = llama_model(cfg, params)                                              # doctest: +SKIP
    >>> export_hf("ckpt", None, "Llama-3.2-1B-tuned", max_shard_bytes=2**30)          # doctest: +SKIP

Tensors stream through host memory one at a time: each is read from its memory-mapped file,
viewed in jaxpar's layout (transposes and head splits are numpy views, no copy), cut into the
target shards by ``jax.device_put`` per device, and released before the next is read; a dtype
change (bf16 file to fp32 parameters) runs on the devices. Scanned models stack the layers on
the devices, one parameter at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.interop import hf_files as files
from jaxpar.interop.hf_layout import IGNORED_SUFFIXES, Tensor, check_architecture, hf_config, llama_config, tensors
from jaxpar.models.llama import Llama, LlamaConfig, no_constraint
from jaxpar.models.llama_config import for_data
from jaxpar.nn.constraint import model_constraint
from jaxpar.nn.init import abstract_model
from jaxpar.nn.specs import check_rules_used, declared_names, is_variable, path_str
from jaxpar.plan.train_plan import make_train_plan
from jaxpar.strategy import recording_rules

MODEL_FAMILY = "llama"
# LlamaConfig fields a checkpoint's model description may hold from before they were removed:
# "remat" (recompute is ParallelConfig.remat now), which the parameters do not depend on.
FORMER_LLAMA_FIELDS = ("remat",)
_ONE_DEVICE = ParallelConfig(mesh={"data": 1}, mode="data")


# ----------------------------------------------------------------------------- placing

def place(view: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``view`` as a global array laid out by ``sharding``: one ``device_put`` per local shard.

    Each device receives only its slice; the slices are views of ``view``, so the host holds
    no copy beyond ``view`` itself.
    """
    index_map = sharding.addressable_devices_indices_map(view.shape)
    shards = [jax.device_put(view[index], device, may_alias=False) for device, index in index_map.items()]
    return jax.make_array_from_single_device_arrays(view.shape, sharding, shards)


@functools.partial(jax.jit, static_argnums=1)
def _convert(x: jax.Array, dtype) -> jax.Array:
    return jnp.array(x, dtype=dtype, copy=True)     # elementwise: keeps x's sharding; a new buffer


def _owned(array: jax.Array, dtype) -> jax.Array:
    """``array`` in ``dtype``, in buffers of its own.

    On CPU, ``device_put`` of a contiguous numpy slice may keep the slice's memory (and so the
    whole file tensor) as the device buffer, and the next tensor would be read while this one
    is still held; a copy on the devices lets the host tensor go. Accelerators copy anyway.
    """
    on_cpu = next(iter(array.sharding.device_set)).platform == "cpu"
    return _convert(array, dtype) if on_cpu or array.dtype != dtype else array


def _stack_layers(layers: list[jax.Array]) -> jax.Array:
    return jnp.stack(layers)


def _stack(layers: list[jax.Array], sharding: NamedSharding) -> jax.Array:
    # one module-level function, so equal shapes and shardings reuse one compiled program
    return jax.jit(_stack_layers, out_shardings=sharding)(layers)


def _layer_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked parameter (its spec without the ``layers`` entry)."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


# ----------------------------------------------------------------------------- import

def _target(cfg: LlamaConfig, config: ParallelConfig, mesh):
    """``(graphdef, abstract params, abstract rest, plan)`` of ``cfg``'s model under ``config``."""
    graphdef, params, rest = nnx.split(abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    plan = make_train_plan(config, mesh, (params, rest), optax.identity())
    return graphdef, params, rest, plan


def _check_rules(cfg: LlamaConfig, config: ParallelConfig, mesh, state, directory: str) -> None:
    """Refuse rules that nothing of the Llama consults (`check_rules_used`, as training does): a
    typo such as ``mlpp`` would leave the weights it meant to split replicated. The names its
    activation constraints consult are recorded from an abstract forward pass, traced only when
    some rule names no parameter axis."""
    used = declared_names(config, *state)
    if config.allow_unused_rules or set(config.rules) <= used:
        return
    constrain = model_constraint(mesh, config)      # as jaxpar train builds the model
    model = abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain))
    side = int(mesh.devices.size)                   # divides every mesh axis: no constraint is dropped
    tokens = jax.ShapeDtypeStruct((side, side), jnp.int32)
    with recording_rules() as seen:
        nnx.eval_shape(lambda m, x: m(x), model, tokens)
    check_rules_used(config, used | seen, f"the Llama of {directory}")


def _check_names(reader: files.Reader, expected: list[Tensor], cfg: LlamaConfig) -> None:
    known = {t.hf_name for t in expected} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(n for n in reader.files if n not in known and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"{reader.directory} has tensors a {cfg.layers}-layer Llama does not: {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''}; is num_hidden_layers right, or is this another "
                         "architecture?")


def _read_all(reader: files.Reader, cfg: LlamaConfig, shardings: Mapping[str, NamedSharding]) -> dict[str, Any]:
    """``{path: array}``: every tensor read, viewed in jaxpar's layout, placed, cast on device."""
    dtype = jnp.dtype(cfg.param_dtype)
    expected = tensors(cfg)
    _check_names(reader, expected, cfg)
    out: dict[str, Any] = {}
    layers: dict[str, list[jax.Array]] = {}
    # by path: a scanned parameter's layers are stacked (and released) before the next one starts
    for t in sorted(expected, key=lambda t: (t.path, t.layer or 0)):
        sharding = shardings[t.path] if t.layer is None else _layer_sharding(shardings[t.path])
        array = place(t.to_jaxpar(reader.read(t.hf_name, t.hf_shape)), sharding)
        # wait for the copies: until then the transfer holds the host tensor, and the next read would add to it
        array = jax.block_until_ready(_owned(array, dtype))
        # jax's device_put of a numpy view leaves a reference cycle holding the host tensor: free it now
        gc.collect(1)     # the young generations: cheap, and the cycle was just made
        if t.layer is None:
            out[t.path] = array
            continue
        layers.setdefault(t.path, []).append(array)
        if len(layers[t.path]) == cfg.layers:
            out[t.path] = _stack(layers.pop(t.path), shardings[t.path])
    return out


def _install(abstract, values: Mapping[str, Any]):
    """The abstract NNX state with each Variable holding ``values[path]``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_variable)
    return jax.tree_util.tree_unflatten(treedef, [v.replace(values[path_str(p)]) for p, v in flat])


def import_hf(directory: str, out: str | None = None, *, config: ParallelConfig | None = None, mesh=None,
              devices=None, dtype: str | None = None, scan_layers: bool = False,
              force: bool = False) -> tuple[LlamaConfig, Any]:
    """Read an HF Llama directory into ``(LlamaConfig, params)``; with ``out``, also save it there
    as a jaxpar checkpoint (step 0, parameters only) laid out for ``config``.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``.
      out: a checkpoint directory to write (``jaxpar ckpt inspect / transform / export-hf`` read it).
      config: the ``ParallelConfig`` whose ``TrainPlan`` places the parameters (default: one device).
      mesh: the mesh for ``config`` (default: built on ``devices``, or the first devices that fit).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); default the file's.
      scan_layers: stack the blocks on a ``layers`` axis (``LlamaConfig.scan_layers``).
      force: replace the step 0 that ``out`` already holds (refused without it, before anything is read).
        An ``out`` holding any later step (a training run's) is refused with or without it: a
        resume takes the newest step and would ignore the imported one.

    Returns the config and an ``nnx.State`` of ``nnx.Param`` s; ``llama_model(cfg, params)`` is the model.
    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` naming the tensor or the
    config field that does not fit a Llama, or the steps ``out`` already holds after step 0.

    >>> cfg, params = import_hf("tiny-llama", config=jaxpar.ParallelConfig(mesh={"data": 8}, mode="data"))  # doctest: +SKIP
    """
    files.safetensors()
    if out is not None:
        _check_out_steps(os.fspath(out), force)
    hf = files.read_config(directory)
    check_architecture(hf, os.path.join(directory, files.CONFIG))    # before looking for Llama tensors
    config = _ONE_DEVICE if config is None else config
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"import_hf: config must be a jaxpar.ParallelConfig, got {type(config).__name__}; e.g. "
                        "ParallelConfig(mesh={'data': 2, 'model': 4}, rules={'heads': 'model', 'mlp': 'model'})")
    if mesh is None:
        from jaxpar.checkpoint.offline import mesh_for

        mesh = mesh_for(config, devices)
    with files.Reader(directory) as reader:
        file_dtype = reader.dtype("model.embed_tokens.weight")
        cfg = llama_config(hf, where=os.path.join(directory, files.CONFIG), param_dtype=dtype or file_dtype,
                           scan_layers=scan_layers)
        graphdef, abstract, rest, plan = _target(cfg, config, mesh)
        _check_rules(cfg, config, mesh, (abstract, rest), directory)
        shardings = {path: NamedSharding(mesh, spec) for path, spec in plan.stored.items()}
        params = _install(abstract, _read_all(reader, cfg, shardings))
    if out is not None:
        _save(out, plan, params, rest, mesh, cfg, hf, force)
    return cfg, params


def _check_out_steps(out: str, force: bool) -> None:
    """Refuse an ``out`` holding checkpoint steps, before anything is read: any step after 0 (a
    resume takes the newest step, so the imported step 0 would be ignored, or mixed into a run's
    steps; ``force`` does not remove them), and step 0 itself unless ``force`` (replaced)."""
    steps = sorted(int(n) for n in os.listdir(out) if n.isdigit() and os.path.isdir(os.path.join(out, n))) \
        if os.path.isdir(out) else []
    later = [n for n in steps if n > 0]
    if later:
        raise ValueError(f"import_hf: out {out!r} already holds checkpoint steps {steps}: a resume from it takes "
                         f"the newest step, {later[-1]}, and would ignore the imported step 0 (or mix it into "
                         "that run's steps); give an empty or new output directory (--out), or remove the "
                         "steps first. force=True (--force) replaces a step 0 only, never a run's later steps")
    if steps and not force:
        raise FileExistsError(f"import_hf: out {out!r} already holds step 0 ({os.path.join(out, '0')}); give "
                              "another output directory, or pass force=True (--force on the command line) to "
                              "replace it")


def _save(out: str, plan, params, rest, mesh, cfg: LlamaConfig, hf: dict, force: bool) -> None:
    from jaxpar.checkpoint.manager import save_state
    from jaxpar.plan.state import TrainState

    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec()))
    model = {"family": MODEL_FAMILY, "config": dataclasses.asdict(cfg), "hf_config": hf}
    save_state(out, plan, TrainState(params, rest, (), step), mesh, model=model, force=force)


def llama_model(cfg: LlamaConfig, params, *, constrain=no_constraint) -> Llama:
    """The ``Llama`` holding ``params`` (as ``import_hf`` returns them), for a ``Trainer`` or inference.

    >>> model = llama_model(*import_hf("tiny-llama"))            # doctest: +SKIP
    """
    graphdef, _, rest = nnx.split(abstract_model(lambda: Llama(cfg, rngs=nnx.Rngs(0), constrain=constrain)),
                                  nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)


# ----------------------------------------------------------------------------- export

def _checkpoint_params(directory: str, step: int | None) -> tuple[dict[str, jax.Array], dict]:
    """``({path: array on one device}, strategy)``: the parameters of a checkpoint step."""
    import orbax.checkpoint as ocp

    from jaxpar.checkpoint import state as st
    from jaxpar.checkpoint.damage import check_values
    from jaxpar.checkpoint.manager import StateRestore, complete_step, open_manager, saved_leaves
    from jaxpar.checkpoint.offline import damaged_step_advice, read_strategy, reading_step

    one = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("one",)), PartitionSpec())
    with open_manager(directory, read_only=True) as manager:
        step = complete_step(manager, directory, step)
        with reading_step(manager, directory, step):
            strategy = read_strategy(manager, step)
            target = {p: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=one)
                      for p, leaf in saved_leaves(manager, step).items()}
            restored = manager.restore(step, args=ocp.args.Composite(
                state=StateRestore(st.nest(target)), meta=ocp.args.JsonRestore()))
        flat = st.unnest(restored["state"])
        # values that decode without an error but differ from what was saved are refused, as restore does
        check_values(directory, step, flat, dict(restored["meta"]), damaged_step_advice(manager, directory, step))
    return {p.split("/", 1)[1]: x for p, x in flat.items() if p.startswith("params/")}, strategy


def _flat_params(source) -> dict[str, Any]:
    if isinstance(source, nnx.Module):
        source = nnx.state(source, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(source, is_leaf=is_variable)[0]
    return {path_str(p): (v.get_value() if is_variable(v) else v) for p, v in flat}


# LlamaConfig fields the weights and config.json depend on, with their config.json names
COMPARED = {"vocab_size": "vocab_size", "embed": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "mlp": "intermediate_size",
            "layers": "num_hidden_layers", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
            "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}


def _job_llama_config(job_file: str, params: Mapping[str, Any]) -> LlamaConfig | None:
    """The ``LlamaConfig`` a training job built, from the ``job.yaml`` it saved beside its
    checkpoint: its ``model:`` section (``name``, ``size``, ``fields``) and ``data.seq_len``, built
    as the job builds it (`jaxpar.models.llama_config.for_data`, its vocabulary grown to the saved
    table's); None when the job built its model with a factory (jaxpar cannot tell what it is)."""
    import yaml

    from jaxpar.yaml_files import UniqueKeyLoader

    def unreadable(why) -> ValueError:
        return ValueError(f"export_hf: {job_file}, the job saved with the checkpoint, cannot be read ({why}); fix "
                          "or remove it (it gives the model's config), and pass --hf-config FILE (cfg= in Python)")

    try:
        with open(job_file) as f:
            saved = yaml.load(f, Loader=UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader subclass)
    except (OSError, yaml.YAMLError) as e:
        raise unreadable(" ".join(str(getattr(e, "problem", None) or e).split())) from None
    model = saved.get("model") if isinstance(saved, Mapping) else None
    data = saved.get("data") if isinstance(saved, Mapping) else None
    if not isinstance(model, Mapping) or not isinstance(data, Mapping):
        raise unreadable("it has no model: and data: sections, as a job writes them")
    if model.get("factory") is not None:
        return None
    missing = [f"model.{k}" for k in ("name", "size") if k not in model] + \
        [f"data.{k}" for k in ("seq_len",) if k not in data]
    if missing:
        raise unreadable(f"it does not give {', '.join(missing)}")
    if model["name"] != MODEL_FAMILY:
        raise ValueError(f"export_hf: {job_file} says this checkpoint holds a {model['name']!r} model "
                         f"(model.name={model['name']!r}), not a Llama; export_hf writes Hugging Face Llama "
                         "checkpoints only")
    fields = model.get("fields") or {}
    if not isinstance(fields, Mapping):
        raise unreadable(f"model.fields is a {type(fields).__name__}, not a mapping")
    try:
        return for_data(model["size"], dict(fields), seq_len=data["seq_len"],
                        vocab=int(params["embedding"].shape[0]))
    except (TypeError, ValueError) as e:
        raise unreadable(f"model.size={model['size']!r}, model.fields={dict(fields)!r}: {e}") from None


def _recorded_config(directory: str, strategy: dict, params: Mapping[str, Any]) -> tuple[LlamaConfig | None, str]:
    """``(LlamaConfig, where it is recorded)`` of a checkpoint: the model description
    ``import_hf`` keeps in the strategy file, or the ``job.yaml`` a training job saves beside its
    checkpoint; ``(None, "")`` when neither records one."""
    model = strategy.get("model") or {}
    if model.get("family") == MODEL_FAMILY:
        cfg = LlamaConfig(**{k: v for k, v in model["config"].items() if k not in FORMER_LLAMA_FIELDS})
        return cfg, f"the strategy file of checkpoint {directory} (written by import_hf)"
    job_file = os.path.join(directory, "job.yaml")
    if os.path.isfile(job_file):
        return _job_llama_config(job_file, params), job_file
    return None, ""


def _show(value) -> str:
    return "none" if value is None else json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value) \
        else json.dumps(value)


def _check_against(cfg: LlamaConfig, given: str, recorded: LlamaConfig, where: str) -> None:
    """Refuse a ``cfg`` whose weight-defining fields contradict the model the checkpoint recorded."""
    wrong = [(name, hf, getattr(cfg, name), getattr(recorded, name)) for name, hf in COMPARED.items()
             if getattr(cfg, name) != getattr(recorded, name)]
    if wrong:
        listing = "; ".join(f"{hf}: given {_show(mine)}, recorded {_show(theirs)}" for _, hf, mine, theirs in wrong)
        fix = ", ".join(f"{hf}: {_show(theirs)}" for _, hf, _, theirs in wrong)
        raise ValueError(f"export_hf: {given} contradicts the model recorded in {where} ({listing}); the exported "
                         f"config.json would not describe these weights. Set {fix} in the HF config, or leave "
                         "--hf-config out (cfg=None in Python): the recorded config then gives config.json")


def _check_head(params: Mapping[str, Any], cfg: LlamaConfig, source, given: str) -> None:
    """A trained ``head`` must be written (untied), and an untied config needs one."""
    if cfg.tie_embeddings and "head" in params:
        raise ValueError(f"export_hf: {_describe(source)} has its own output head 'head' {tuple(params['head'].shape)} "
                         f"(trained apart from the embedding), but {given} says tie_word_embeddings=true: the "
                         "exported model would use the embedding as its head and drop the trained one. Set "
                         "tie_word_embeddings to false in the HF config (lm_head.weight is then written)")
    if not cfg.tie_embeddings and "head" not in params:
        raise ValueError(f"export_hf: {_describe(source)} has no output head 'head' (its head is the embedding), "
                         f"but {given} says tie_word_embeddings=false, which needs an lm_head.weight; set "
                         "tie_word_embeddings to true in the HF config")


def _resolve(source, cfg: LlamaConfig | None, step: int | None, given: str = "cfg"):
    """``(flat params, LlamaConfig, HF config to start from)`` of any export source; a ``cfg``
    that contradicts the model a checkpoint records (``given`` names where it came from) is refused."""
    base = None
    if cfg is not None and not isinstance(cfg, LlamaConfig):
        raise TypeError(f"export_hf: cfg must be a LlamaConfig, got {type(cfg).__name__}")
    if isinstance(source, (str, os.PathLike)):
        params, strategy = _checkpoint_params(os.fspath(source), step)
        if "embedding" in params:
            recorded, where = _recorded_config(os.fspath(source), strategy, params)
        else:
            recorded, where = None, ""      # not a Llama: refused below, naming what it holds
        if recorded is not None and recorded.moe is not None:
            raise ValueError(f"export_hf: the model recorded in {where} has mixture-of-experts layers (moe="
                             f"{recorded.moe!r}); export_hf writes dense LlamaForCausalLM checkpoints only")
        if cfg is None:
            if recorded is None:
                raise ValueError(f"checkpoint {source} does not record a Llama config (neither import_hf's model "
                                 "description nor a job.yaml beside it); pass cfg=LlamaConfig(...), or --hf-config "
                                 "on the command line")
            cfg = recorded
        elif recorded is not None:
            _check_against(cfg, given, recorded, where)
        base = (strategy.get("model") or {}).get("hf_config")
    else:
        params = _flat_params(source)
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"export_hf: cfg must be a LlamaConfig, got {type(cfg).__name__}")
    if "embedding" not in params:
        raise ValueError(f"export_hf: {_describe(source)} holds no 'embedding' (HF tensor 'model.embed_tokens.weight') "
                         f"but {sorted(params)[:6]}{' ...' if len(params) > 6 else ''}: export_hf writes the "
                         "parameters of a jaxpar.models.llama.Llama; give a checkpoint, state or model of one")
    _check_head(params, cfg, source, given)
    return params, dataclasses.replace(cfg, scan_layers="blocks/attn/wq" in params), base


def _describe(source) -> str:
    return f"checkpoint {os.fspath(source)}" if isinstance(source, (str, os.PathLike)) else \
        f"the {type(source).__name__} given"


def _hf_tensor(t: Tensor, params: Mapping[str, Any], dtype) -> np.ndarray:
    if t.path not in params:
        raise ValueError(f"export_hf: the parameters have no {t.path!r} (for HF tensor {t.hf_name!r}); they hold "
                         f"{sorted(params)[:6]} ...: is cfg the config of this model?")
    x = params[t.path]
    x = np.asarray(x if t.layer is None else x[t.layer])        # one tensor (one layer) on the host
    if x.shape != tuple(t.to_jaxpar(np.empty(t.hf_shape, np.int8)).shape):
        raise ValueError(f"export_hf: parameter {t.path!r} has shape {x.shape}, but cfg implies HF tensor "
                         f"{t.hf_name!r} of shape {t.hf_shape}; pass the LlamaConfig this model was built with")
    return np.ascontiguousarray(t.to_hf(x).astype(dtype or x.dtype, copy=False))


def _check_out_free(out_dir: str, force: bool) -> list[str]:
    """The model files already in ``out_dir``; refused unless ``force`` (nothing is written yet)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"export_hf: out {out_dir!r} is a file, not a folder; give a folder for the HF "
                                 "model (it is created if missing)")
    old = files.model_files(out_dir)
    if old and not force:
        shards = [n for n in old if n not in (files.CONFIG, files.INDEX)]
        listing = ", ".join([n for n in old if n in (files.CONFIG, files.INDEX)]
                            + ([f"{len(shards)} model*.safetensors file(s)"] if shards else []))
        raise FileExistsError(f"export_hf: out {out_dir!r} already holds a Hugging Face model ({listing}); give "
                              "another output directory, or pass force=True (--force on the command line) to "
                              "replace its model files (the old config.json, safetensors and index are removed; "
                              "other files such as the tokenizer's are kept)")
    return old


def export_hf(source, cfg: LlamaConfig | None, out_dir: str, *, max_shard_bytes: int = 5 * 2**30,
              dtype: str | None = None, step: int | None = None, hf_base: dict | None = None,
              force: bool = False) -> list[str]:
    """Write an HF Llama directory (``config.json`` + safetensors, sharded with an index when
    larger than ``max_shard_bytes``) from a checkpoint directory, a parameter state or a model.

    ``cfg``: the model's ``LlamaConfig`` (``None`` for a checkpoint written by ``import_hf``,
    which records it, and its original ``config.json``: the fields jaxpar does not model are
    written back unchanged). ``dtype``: convert the tensors (default: as stored). ``force``:
    replace the model files an ``out_dir`` already holds (refused without it: an old index or
    old shards left beside the new files would be read instead of them). Returns the files
    written.

    >>> export_hf(model, model.cfg, "out-dir", max_shard_bytes=2**30)       # doctest: +SKIP
    ['config.json', 'model.safetensors']
    """
    files.safetensors()
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"export_hf: max_shard_bytes={max_shard_bytes!r} must be a positive int (e.g. 5 * 2**30)")
    out_dir = os.fspath(out_dir)
    old = _check_out_free(out_dir, force)
    params, cfg, base = _resolve(source, cfg, step, "the HF config given (--hf-config / hf_base)"
                                 if hf_base is not None else "cfg")
    dtype = None if dtype is None else jnp.dtype(dtype)
    out_dtype = str(dtype) if dtype is not None else str(jnp.dtype(params["embedding"].dtype))
    order = tensors(cfg)
    sizes = [(t.hf_name, files.nbytes(t.hf_shape, out_dtype)) for t in order]
    groups = files.plan_files(sizes, max_shard_bytes)
    names = files.file_names(len(groups))
    os.makedirs(out_dir, exist_ok=True)
    written = [files.CONFIG, *names, *([files.INDEX] if len(names) > 1 else [])]
    # force: the old index goes first (readers follow it before model.safetensors), old shards last
    for name in old:
        if name == files.INDEX:
            os.remove(os.path.join(out_dir, name))
    by_name = {t.hf_name: t for t in order}
    for group, name in zip(groups, names):
        files.write_file(os.path.join(out_dir, name), {n: _hf_tensor(by_name[n], params, dtype) for n in group})
    if len(names) > 1:
        files.write_index(out_dir, {n: name for group, name in zip(groups, names) for n in group},
                          sum(size for _, size in sizes))
    files.write_config(out_dir, hf_config(cfg, hf_base or base, dtype=out_dtype))
    for name in old:
        if name not in written and os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    return written
