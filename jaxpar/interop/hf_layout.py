"""The Hugging Face Llama layout next to jaxpar's: configs, tensor names, and array views.

Pure functions of numpy arrays and dicts (no files, no devices), so the mapping is tested on
its own and read in one place.

HF ``LlamaForCausalLM`` stores ``torch.nn.Linear`` weights as ``[out, in]``; jaxpar's Llama
keeps ``[in, out]`` with the head axes split out (``wq`` is ``[embed, heads, head_dim]``).
Every conversion here returns a numpy *view* (a reshape of the contiguous file tensor, then a
transpose), so converting costs no host memory: the copy happens once, into device buffers.

    >>> cfg = llama_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    ...     "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2})
    >>> cfg.heads, cfg.kv_heads, cfg.head_dim
    (4, 2, 8)
    >>> [t.hf_name for t in tensors(cfg)][:2]
    ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar.models.llama_config import LlamaConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM",)
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

# Rotary embeddings. Meta's original Llama checkpoints rotate *interleaved* pairs (dims 2i,
# 2i+1) and HF's conversion script permutes the rows of q_proj / k_proj so that HF's
# ``rotate_half`` (pairs i, i + head_dim/2) computes the same thing. jaxpar's Llama rotates
# halves too (``jaxpar.models.llama._rotate``), so HF's rows are already in jaxpar's order:
# no permutation either way. A checkpoint in Meta's layout would need HF's permute first.


def _require(hf: dict, key: str, where: str) -> Any:
    if key not in hf:
        raise ValueError(f"{where}: config.json has no {key!r}, which a Llama config must give; "
                         f"found keys {sorted(hf)}")
    return hf[key]


def _number(value: Any, field: str, where: str, kind: type, minimum: float | None = None) -> Any:
    """``value`` as ``kind`` (int or float), or a ValueError naming the file, the field and the value."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if ok and kind is float and not math.isfinite(value):
        ok = False
    if not ok or (minimum is not None and value < minimum):
        what = "a whole number" if kind is int else "a finite number"
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{where}: {field}={value!r} is not {what}{bound}; fix {field} in config.json")
    return kind(value)


def _flag(hf: dict, key: str, where: str) -> bool:
    value = hf.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} is not true or false; fix {key} in config.json")
    return value


def _rope_source(hf: dict, where: str) -> tuple[dict, str]:
    """The dict that holds the RoPE settings and its name: transformers 5 writes ``rope_parameters``
    (``rope_theta`` and ``rope_type`` with the scaling fields inside), earlier versions a top-level
    ``rope_theta`` and ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if params is None:
        return {}, ""
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters={params!r} is not a mapping; transformers writes "
                         "{\"rope_type\": \"default\", \"rope_theta\": ...}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: rope_parameters gives one set of RoPE settings per attention type "
                         f"({sorted(params)}); jaxpar's Llama has one")
    return params, "rope_parameters"


def _rope_theta(hf: dict, where: str) -> float:
    params, _ = _rope_source(hf, where)
    top, inner = hf.get("rope_theta"), params.get("rope_theta")
    if top is not None and inner is not None and float(_number(top, "rope_theta", where, float)) != \
            float(_number(inner, "rope_parameters.rope_theta", where, float)):
        raise ValueError(f"{where}: rope_theta={top!r} but rope_parameters.rope_theta={inner!r}; the two say "
                         "different things: keep one")
    field, value = ("rope_parameters.rope_theta", inner) if inner is not None else ("rope_theta", top)
    theta = _number(10000.0 if value is None else value, field, where, float, minimum=0)
    if theta == 0:      # the RoPE frequencies divide by powers of it
        raise ValueError(f"{where}: {field}={value!r} is not a number > 0 (RoPE's base, e.g. 500000.0 for "
                         f"Llama 3); fix {field} in config.json")
    return theta


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling(hf: dict, where: str) -> RopeScaling | None:
    params, source = _rope_source(hf, where)
    legacy = hf.get("rope_scaling")
    if legacy and not isinstance(legacy, dict):
        raise ValueError(f"{where}: rope_scaling={legacy!r} is not a mapping; write e.g. {{\"rope_type\": "
                         f"\"llama3\", {', '.join(f'{chr(34)}{k}{chr(34)}: ...' for k in _LLAMA3_FIELDS)}}} or drop it")
    if params and legacy:
        if legacy.get("rope_type", legacy.get("type")) != params.get("rope_type", params.get("type")) or any(
                legacy.get(k) != params.get(k) for k in _LLAMA3_FIELDS):
            raise ValueError(f"{where}: rope_scaling={legacy!r} and rope_parameters={params!r} disagree; keep one")
    scaling, field = (params, source) if params else (legacy, "rope_scaling")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {field}={scaling!r} is not a mapping; write e.g. {{\"rope_type\": \"llama3\", "
                         f"{', '.join(f'{chr(34)}{k}{chr(34)}: ...' for k in _LLAMA3_FIELDS)}}}")
    kind = scaling.get("rope_type", scaling.get("type", "default" if params else None))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{where}: {field} type {kind!r} is not supported (jaxpar's Llama implements "
                         f"'llama3' scaling and plain RoPE); convert the model to one of those")
    missing = [k for k in _LLAMA3_FIELDS if k not in scaling]
    if missing:
        raise ValueError(f"{where}: {field} of type 'llama3' has no {', '.join(missing)}; llama3 scaling needs "
                         f"{', '.join(_LLAMA3_FIELDS)}")
    num = lambda k, kind=float: _number(scaling[k], f"{field}.{k}", where, kind)  # noqa: E731
    return RopeScaling(factor=num("factor"), low_freq_factor=num("low_freq_factor"),
                       high_freq_factor=num("high_freq_factor"),
                       original_max_positions=num("original_max_position_embeddings", int))


def check_architecture(hf: dict, where: str = "config.json") -> None:
    """``ValueError`` naming the file and the field when ``hf`` is not a Llama jaxpar can load."""
    archs = hf.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs) or hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: architectures={archs} model_type={hf.get('model_type')!r} is not a Llama "
                         f"model; jaxpar imports {list(ARCHITECTURES)} (model_type 'llama') only")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r}; jaxpar's Llama uses SwiGLU with 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{where}: {flag}=true; jaxpar's Llama has no bias terms, so this model cannot be "
                             "imported without changing its outputs")


def llama_config(hf: dict, *, where: str = "config.json", param_dtype: str | None = None,
                 scan_layers: bool = False, **overrides: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of an HF ``config.json`` dict (``ValueError`` naming the field if not Llama).

    ``param_dtype``: default the file's ``torch_dtype``; the compute dtype follows it.
    """
    check_architecture(hf, where)
    count = lambda key, low=1: _number(_require(hf, key, where), key, where, int, low)  # noqa: E731
    optional = lambda key, kind, default, low=None: default if hf.get(key) is None else \
        _number(hf[key], key, where, kind, low)  # noqa: E731
    embed, heads = count("hidden_size"), count("num_attention_heads")
    dtype = param_dtype or DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "float32"))), "float32")
    return LlamaConfig(
        vocab_size=count("vocab_size"), embed=embed, heads=heads,
        kv_heads=optional("num_key_value_heads", int, heads, 1), head_dim=optional("head_dim", int, embed // heads, 1),
        mlp=count("intermediate_size"), layers=count("num_hidden_layers"),
        max_seq_len=optional("max_position_embeddings", int, 2048, 1), rope_theta=_rope_theta(hf, where),
        rope_scaling=_rope_scaling(hf, where), norm_eps=optional("rms_norm_eps", float, 1e-6, 0),
        tie_embeddings=_flag(hf, "tie_word_embeddings", where), scan_layers=scan_layers,
        dtype=dtype, param_dtype=dtype, **overrides)


def hf_config(cfg: LlamaConfig, base: dict | None = None, *, dtype: str | None = None) -> dict:
    """An HF ``config.json`` dict for ``cfg``: ``base`` (the imported file, kept field for field)
    with every field ``cfg`` decides written from ``cfg``."""
    out = dict(base or {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02})
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        given = out.get("rope_scaling") or {}
        kind = "type" if "type" in given and "rope_type" not in given else "rope_type"
        scaling = {**given, kind: "llama3", "factor": s.factor,
                   "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_positions}
    elif out.get("rope_scaling"):
        scaling = out["rope_scaling"]      # a "default" entry read as no scaling: keep it as written
    dtype_key = "dtype" if "dtype" in out and "torch_dtype" not in out else "torch_dtype"
    new = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.embed, "num_attention_heads": cfg.heads,
           "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp,
           "num_hidden_layers": cfg.layers, "max_position_embeddings": cfg.max_seq_len,
           "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rms_norm_eps": cfg.norm_eps,
           "tie_word_embeddings": cfg.tie_embeddings, dtype_key: dtype or cfg.param_dtype}
    # what `llama_config` reads when a field is absent: leave those out, so a file round-trips as written
    absent = {"num_key_value_heads": cfg.heads, "head_dim": cfg.embed // cfg.heads, "rope_scaling": None,
              "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}
    if isinstance(out.get("rope_parameters"), dict):   # transformers 5 keeps them inside rope_parameters
        new = {k: v for k, v in new.items() if k not in ("rope_theta", "rope_scaling") or k in out}
    for key, value in new.items():
        if key in out:
            if out[key] != value:      # equal values keep the file's own spelling (500000 vs 500000.0)
                out[key] = value
        elif base is None or key not in absent or absent[key] != value:
            out[key] = value
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = _rope_parameters(cfg, out["rope_parameters"], base or {})
    return out


def _rope_parameters(cfg: LlamaConfig, given: dict, base: dict) -> dict:
    """transformers 5's ``rope_parameters`` for ``cfg``, kept as written where it agrees: the RoPE
    settings go there (written back to ``rope_theta`` / ``rope_scaling`` only where ``base`` had those too)."""
    out = dict(given)
    if out.get("rope_theta") != cfg.rope_theta:
        out["rope_theta"] = cfg.rope_theta
    s = cfg.rope_scaling
    if s is None:
        if out.get("rope_type", "default") != "default":
            out = {k: v for k, v in out.items() if k not in _LLAMA3_FIELDS}
            out["rope_type"] = "default"
    else:
        kind = "type" if "type" in out and "rope_type" not in out else "rope_type"
        fields = dict(zip(_LLAMA3_FIELDS, (s.factor, s.low_freq_factor, s.high_freq_factor,
                                           s.original_max_positions)))
        out.update({kind: "llama3", **{k: v for k, v in fields.items() if out.get(k) != v}})
    return out


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor and where it lives in jaxpar.

    ``path``: the jaxpar parameter path (``blocks/attn/wq`` when scanned); ``layer``: its index
    on the stacked ``layers`` axis (``None`` for unstacked); ``hf_shape``: its shape in the file;
    ``to_jaxpar`` / ``to_hf``: views between the two layouts.
    """

    hf_name: str
    path: str
    layer: int | None
    hf_shape: tuple[int, ...]
    to_jaxpar: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _linear(x: np.ndarray) -> np.ndarray:
    return x.T      # [out, in] <-> [in, out]: its own inverse


def _block_tensors(cfg: LlamaConfig, i: int) -> list[Tensor]:
    e, n, k, d, m = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp
    prefix = f"model.layers.{i}."
    base, layer = ("blocks/", i) if cfg.scan_layers else (f"blocks/{i}/", None)

    def heads_in(h: int):   # q/k/v_proj [h*d, e] <-> w [e, h, d]: split rows into heads, then transpose
        return (lambda x: x.reshape(h, d, e).transpose(2, 0, 1),
                lambda w: w.transpose(1, 2, 0).reshape(h * d, e))

    def t(name, path, shape, convert):
        return Tensor(prefix + name, base + path, layer, shape, *convert)

    return [
        t("self_attn.q_proj.weight", "attn/wq", (n * d, e), heads_in(n)),
        t("self_attn.k_proj.weight", "attn/wk", (k * d, e), heads_in(k)),
        t("self_attn.v_proj.weight", "attn/wv", (k * d, e), heads_in(k)),
        # o_proj [e, n*d] <-> wo [n, d, e]
        t("self_attn.o_proj.weight", "attn/wo", (e, n * d),
          (lambda x: x.reshape(e, n, d).transpose(1, 2, 0), lambda w: w.transpose(2, 0, 1).reshape(e, n * d))),
        t("mlp.gate_proj.weight", "mlp/gate", (m, e), (_linear, _linear)),
        t("mlp.up_proj.weight", "mlp/up", (m, e), (_linear, _linear)),
        t("mlp.down_proj.weight", "mlp/down", (e, m), (_linear, _linear)),
        t("input_layernorm.weight", "attn_norm/scale", (e,), (_same, _same)),
        t("post_attention_layernorm.weight", "mlp_norm/scale", (e,), (_same, _same)),
    ]


def tensors(cfg: LlamaConfig) -> list[Tensor]:
    """Every HF tensor of ``cfg``'s model, in the order HF writes them (no ``lm_head`` when tied)."""
    out = [Tensor("model.embed_tokens.weight", "embedding", None, (cfg.vocab_size, cfg.embed), _same, _same)]
    for i in range(cfg.layers):
        out += _block_tensors(cfg, i)
    out.append(Tensor("model.norm.weight", "norm/scale", None, (cfg.embed,), _same, _same))
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head.weight", "head", None, (cfg.vocab_size, cfg.embed), _linear, _linear))
    return out


# Tensors HF checkpoints may carry that hold nothing to load (older ones saved the RoPE table).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
