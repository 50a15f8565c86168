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
import math
from typing import Any

import numpy as np

# Only plain numeric dtypes cross the wire; 'object' or structured dtypes are refused.
DTYPES = ("float32", "float64", "int32", "int64", "uint32", "uint64")
TOKEN_ENV = "JAXPAR_PS_TOKEN"
ADDRESSES_ENV = "JAXPAR_PS_ADDRESSES"
READY = "jaxpar-ps-server ready"
# A header holds an operation, a few fields and one small dict per array: 64 KiB is plenty, and
# bounding it bounds what json.loads may be asked to parse (nesting depth included).
MAX_HEADER_BYTES = 64 * 1024
# The largest frame a server accepts (ZeroMQ drops the peer past it): a push or pull of 8M rows of
# 32 float32s; raise it for wider rows.
MAX_FRAME_BYTES = 1 << 30
# A request id a server echoes back: a string of at most this many characters, or an integer.
MAX_RID_CHARS = 128


class WireError(ValueError):
    """A message that does not follow the wire format."""


def show(value: Any, limit: int = 60) -> str:
    """A received value for an error message or a log line: a scalar's ``repr`` cut to ``limit``
    characters, a container only by its type (a ``repr`` of client data nested a thousand deep
    raises ``RecursionError``, and a 64 KiB one is no message)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
    if isinstance(value, list) and len(value) <= 8 and all(
            x is None or isinstance(x, (bool, int, float, str)) for x in value):
        return f"[{', '.join(show(x, 20) for x in value)}]"
    if isinstance(value, list):
        return f"<a JSON array of {len(value)} item{'' if len(value) == 1 else 's'}>"
    return f"<a JSON {'object' if isinstance(value, dict) else type(value).__name__}>"


def reply_rid(header: dict[str, Any]) -> str | int | None:
    """The request id a reply may echo: a string of at most ``MAX_RID_CHARS`` characters or an
    integer of at most 64 bits; anything else (a nested array, a long string) echoes as ``None``."""
    rid = header.get("rid")
    if isinstance(rid, str) and len(rid) <= MAX_RID_CHARS:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and -(1 << 63) <= rid < (1 << 63):
        return rid
    return None


def encode(header: dict[str, Any], arrays: tuple[np.ndarray, ...] = ()) -> list[bytes]:
    """``[header, *arrays]`` as frames; the header gains the arrays' dtypes and shapes."""
    # (np.ascontiguousarray makes a 0-d array 1-d: the shape is kept as given)
    arrays = tuple(np.ascontiguousarray(a).reshape(np.shape(a)) for a in arrays)
    for a in arrays:
        if a.dtype.name not in DTYPES:
            raise TypeError(f"cannot send an array of dtype {a.dtype}; allowed: {DTYPES}")
    header = {**header, "arrays": [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]}
    return [json.dumps(header).encode(), *(a.tobytes() for a in arrays)]


def decode(frames: list[bytes]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and the arrays of a received message; a malformed one raises ``WireError``."""
    if not frames:
        raise WireError("empty message")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frames[0])} bytes is over the {MAX_HEADER_BYTES} allowed")
    try:
        header = json.loads(bytes(frames[0]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
        raise WireError(f"header is not UTF-8 JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    metas = header.get("arrays", [])
    if not isinstance(metas, list) or len(metas) != len(frames) - 1:
        raise WireError(f"header announces {len(metas) if isinstance(metas, list) else show(metas)} "
                        f"arrays but {len(frames) - 1} frames follow")
    return header, [_array(meta, frame) for meta, frame in zip(metas, frames[1:])]


def _array(meta: Any, frame: bytes) -> np.ndarray:
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES:
        raise WireError(f"array dtype {show(meta.get('dtype') if isinstance(meta, dict) else meta)} "
                        f"not allowed; allowed: {DTYPES}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise WireError(f"array shape {show(shape)} is not a list of at most 8 sizes")
    dtype = np.dtype(meta["dtype"])
    need = math.prod(shape) * dtype.itemsize      # Python ints: no overflow to a size that matches
    if need != len(frame):
        raise WireError(f"array {dtype}{shape} needs {need} bytes, frame has {len(frame)}")
    # A copy: the frame's buffer belongs to ZeroMQ, and servers write into received rows.
    return np.frombuffer(frame, dtype=dtype).reshape(shape).copy()


def token_ok(header: dict[str, Any], token: str) -> bool:
    """Constant-time comparison of the request's token with the job's."""
    given = header.get("token")
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), token.encode())
