"""The parameter server's wire format: one JSON header frame, then one raw frame per array.

A message is a ZeroMQ multipart message ``[header, array_0, array_1, ...]``. The header is a
UTF-8 JSON object with the operation (``op``), its fields (``table``, ``step``, ...), the job
token, a request id (``rid``) and ``arrays``: one ``{"dtype", "shape"}`` per following frame.
Arrays travel as their raw C-order bytes and are rebuilt with ``np.frombuffer`` from an
allowed dtype and a checked size: nothing received is ever unpickled.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import numpy as np

# Only plain numeric dtypes cross the wire; 'object' or structured dtypes are refused.
DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")
TOKEN_ENV = "JAXPAR_PS_TOKEN"
ADDRESSES_ENV = "JAXPAR_PS_ADDRESSES"
READY = "jaxpar-ps-server ready"


class WireError(ValueError):
    """A message that does not follow the wire format."""


def encode(header: dict[str, Any], arrays: tuple[np.ndarray, ...] = ()) -> list[bytes]:
    """``[header, *arrays]`` as frames; the header gains the arrays' dtypes and shapes."""
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    for a in arrays:
        if a.dtype.name not in DTYPES:
            raise TypeError(f"cannot send an array of dtype {a.dtype}; allowed: {DTYPES}")
    header = {**header, "arrays": [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]}
    return [json.dumps(header).encode(), *(a.tobytes() for a in arrays)]


def decode(frames: list[bytes]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and the arrays of a received message; a malformed one raises ``WireError``."""
    if not frames:
        raise WireError("empty message")
    try:
        header = json.loads(bytes(frames[0]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    metas = header.get("arrays", [])
    if not isinstance(metas, list) or len(metas) != len(frames) - 1:
        raise WireError(f"header announces {metas!r} arrays but {len(frames) - 1} frames follow")
    return header, [_array(meta, frame) for meta, frame in zip(metas, frames[1:])]


def _array(meta: Any, frame: bytes) -> np.ndarray:
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES:
        raise WireError(f"array dtype {meta!r} not allowed; allowed: {DTYPES}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(f"array shape {shape!r} is not a list of sizes")
    dtype = np.dtype(meta["dtype"])
    if int(np.prod(shape)) * dtype.itemsize != len(frame):
        raise WireError(f"array {dtype}{shape} needs {int(np.prod(shape)) * dtype.itemsize} bytes, "
                        f"frame has {len(frame)}")
    # A copy: the frame's buffer belongs to ZeroMQ, and servers write into received rows.
    return np.frombuffer(frame, dtype=dtype).reshape(shape).copy()


def token_ok(header: dict[str, Any], token: str) -> bool:
    """Constant-time comparison of the request's token with the job's."""
    given = header.get("token")
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), token.encode())
