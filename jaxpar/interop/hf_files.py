"""Reading and writing the files of a Hugging Face model directory.

``config.json`` plus either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``). Tensors are read one at a
time with safetensors' ``safe_open`` (memory-mapped: a tensor costs host memory only while it is
being read) and written in groups no larger than ``max_shard_bytes``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def safetensors():
    """The ``safetensors`` module, or an ``ImportError`` naming the extra that installs it."""
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise ImportError("Hugging Face checkpoints need the 'safetensors' package: pip install 'jaxpar[hf]' "
                          "(or pip install safetensors)") from None
    import safetensors as module

    return module


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a Hugging Face model directory holds {what}")
    with open(path, "rb") as f:
        try:
            return json.loads(f.read())
        except ValueError as e:        # not JSON, or not UTF-8 text
            raise ValueError(f"{path} is not valid JSON ({e}); fetch {os.path.basename(path)} again") from None
        except RecursionError:
            raise ValueError(f"{path} nests its JSON too deep to read (more than Python's "
                             f"{sys.getrecursionlimit()} levels); it is not {what}: fetch it again") from None


def read_config(directory: str) -> dict:
    """The ``config.json`` of an HF model directory (or that file itself) as a dict."""
    path = directory if os.path.isfile(directory) else os.path.join(directory, CONFIG)
    if not os.path.isdir(directory) and path != directory:
        raise FileNotFoundError(f"{directory} is not a directory; give the folder holding config.json and "
                                "model.safetensors (or model.safetensors.index.json)")
    config = _read_json(path, "config.json with the model's shape")
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}, not a JSON object")
    return config


@contextlib.contextmanager
def _damage_named(path: str, tensor: str | None = None) -> Iterator[None]:
    """safetensors' own error (a ``SafetensorError``: header too small or too large, file shorter
    than its header says, invalid JSON) as a ``ValueError`` naming the file and the damage."""
    try:
        yield
    except safetensors().SafetensorError as e:
        what = f"tensor {tensor!r} in {path}" if tensor else path
        raise ValueError(f"{what} is damaged ({e}): not a complete safetensors file, e.g. an interrupted "
                         "download or copy; fetch the file again") from None


class Reader:
    """The tensors of an HF model directory, by name, one at a time.

    >>> with Reader("llama-dir") as r:                          # doctest: +SKIP
    ...     x = r.read("model.norm.weight", (4096,))
    """

    def __init__(self, directory: str):
        self.directory = directory
        index, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.isfile(index):
            weight_map = _read_json(index, "the shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object mapping tensor names to files")
            self.files = dict(weight_map)
        elif os.path.isfile(single):
            self.files = {name: SINGLE for name in self._keys(single)}
        else:
            raise FileNotFoundError(f"{directory} holds neither {SINGLE} nor {INDEX}; export the model with "
                                    "safe_serialization=True (PyTorch .bin files are not read)")
        self._open: dict[str, Any] = {}

    @staticmethod
    def _keys(path: str) -> list[str]:
        with _damage_named(path), safetensors().safe_open(path, framework="numpy") as f:
            return list(f.keys())

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._open:
            path = os.path.join(self.directory, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found: {INDEX} lists tensor {name!r} in it")
            with _damage_named(path):
                self._open[file] = safetensors().safe_open(path, framework="numpy").__enter__()
        return self._open[file]

    def where(self, name: str) -> str:
        return os.path.join(self.directory, self.files.get(name, SINGLE))

    def dtype(self, name: str) -> str:
        """The numpy dtype name of tensor ``name`` (read from the header only)."""
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {self.where(name)} has dtype {code}; jaxpar reads "
                             f"{sorted(_DTYPES)} weights")
        return _DTYPES[code]

    def _slice(self, name: str):
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is missing from {self.directory} (files: "
                             f"{sorted(set(self.files.values()))}); the config.json describes a model that has it")
        handle = self._handle(name)
        if name not in handle.keys():        # the index names a file that does not hold it
            raise ValueError(f"tensor {name!r} is not in {self.where(name)}, the file {INDEX} names for it; the "
                             "index and the files do not belong together: fetch them again")
        return handle.get_slice(name)

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name``, after checking from the header that its shape is ``shape`` and its dtype
        a floating one, and then that every value is finite."""
        found = tuple(self._slice(name).get_shape())
        if found != tuple(shape):
            raise ValueError(f"tensor {name!r} in {self.where(name)} has shape {found}, but config.json implies "
                             f"{tuple(shape)}; the weights and the config do not belong together")
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:      # e.g. I32: an integer array would be cast silently to a float parameter
            raise ValueError(f"tensor {name!r} in {self.where(name)} has dtype {code}, not a floating dtype, but it "
                             f"is a float parameter; jaxpar reads {sorted(_DTYPES)} weights: export the model in "
                             "one of them")
        handle = self._handle(name)
        with _damage_named(self.where(name), name):
            x = handle.get_tensor(name)
        bad, first = _non_finite(x)
        if bad:
            at = tuple(int(i) for i in np.unravel_index(first, x.shape))
            raise ValueError(f"tensor {name!r} in {self.where(name)} holds {bad} non-finite value(s) (NaN or "
                             f"infinity; the first, {float(x[at])}, at index {at}): a model trained or saved wrong, or "
                             "a damaged file; fetch it again or fix the source model")
        return x

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _non_finite(x: np.ndarray, block: int = 1 << 16) -> tuple[int, int]:
    """``(count, first flat index)`` of the NaNs and infinities of ``x``, checked a block at a time
    (a mask of the whole tensor would add a quarter of a float32 tensor to the host memory an
    import holds)."""
    flat, count, first = x.reshape(-1), 0, -1
    for at in range(0, flat.size, block):
        finite = np.isfinite(flat[at:at + block])
        if not finite.all():
            count += int(finite.size - finite.sum())
            first = first if first >= 0 else at + int(np.argmin(finite))
    return count, first


def plan_files(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into files of at most ``max_shard_bytes`` (one tensor per
    file when a tensor alone is larger, as HF does).

    >>> plan_files([("a", 6), ("b", 6), ("c", 3)], 10)
    [['a'], ['b', 'c']]
    """
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if groups[-1] and used + size > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def file_names(count: int) -> list[str]:
    """HF's names: ``model.safetensors`` alone, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def model_files(directory: str) -> list[str]:
    """The files of an HF model already in ``directory`` (``config.json``, ``model*.safetensors``,
    the index), sorted; tokenizer and other files are not among them."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory)
                  if n in (CONFIG, INDEX) or (n.startswith("model") and n.endswith(".safetensors")))


def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
    safetensors()
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata={"format": "pt"})   # what transformers writes and checks for


def write_index(directory: str, weight_map: dict[str, str], total_bytes: int) -> None:
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=2)


def write_config(directory: str, config: dict) -> None:
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    import jax.numpy as jnp   # knows bfloat16

    return math.prod(shape) * jnp.dtype(dtype).itemsize
