"""A synthetic click dataset, deterministic and splittable: example ``e`` is a pure function
of ``(seed, e)``.

Each example has dense features (standard normal), one Zipf-distributed id per categorical
field (id ``k`` is drawn from the continuous density ∝ ``x ** -zipf`` on ``[k + 1, k + 2)``, by
inverse CDF: no table per field, so fields of 10M ids cost nothing), and a label drawn from a planted
model: every id of every field has a hidden weight, and the click probability is
``sigmoid(signal * (sum of the ids' weights + dense · v) / sqrt(F + 1))``. A model that learns
those weights reaches a loss well below ``log 2``.

Step ``s`` of a run with global batch ``B`` holds examples ``s*B .. s*B + B - 1``; process
``p`` of ``P`` takes its contiguous ``B/P`` of them, so processes read disjoint examples, any
process count sees the same global batch, and a run resumes at any step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Random streams: field f draws its ids from stream f, dense feature k from 100 + k (and
# 10100 + k), the labels from 500: more fields or dense features would share a stream, and
# a field sharing the labels' stream would leak them through its ids.
_MAX_FIELDS, _MAX_DENSE = 100, 400


def _whole(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a counter → 64 well-mixed bits."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1), one per ``index``, independent across ``stream``."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(stream))
        bits = _mix(index.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03) ^ key)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickData:
    """The dataset's shape and seed; ``batch(step, size)`` draws a batch.

    Example:
        >>> data = ClickData(field_rows=(100, 50), dense=3)
        >>> b = data.batch(0, 8, process_index=1, process_count=2)
        >>> b["ids"].shape, b["dense"].shape, b["label"].shape
        ((4, 2), (4, 3), (4,))
    """

    field_rows: tuple[int, ...] = (1000, 500, 100)
    dense: int = 4
    zipf: float = 1.1
    """Exponent of the id distribution (larger: a few ids dominate more)."""
    signal: float = 4.0
    """Scale of the planted logit; larger makes labels more predictable."""
    seed: int = 0

    def __post_init__(self):
        if (not isinstance(self.field_rows, tuple) or not self.field_rows
                or any(not _whole(r) or r < 1 for r in self.field_rows)):
            raise ValueError(f"field_rows={self.field_rows!r} must be a tuple of positive row counts, one per "
                             "categorical field, e.g. (1000, 500).")
        if len(self.field_rows) > _MAX_FIELDS:
            raise ValueError(f"field_rows has {len(self.field_rows)} fields; at most {_MAX_FIELDS} have random "
                             "streams of their own (more would share them with the dense features).")
        if not _whole(self.dense) or not 1 <= self.dense <= _MAX_DENSE:
            raise ValueError(f"dense={self.dense!r} must be a whole number from 1 to {_MAX_DENSE}, e.g. 4.")
        if not self.zipf > 0:
            raise ValueError(f"zipf={self.zipf!r} must be > 0 (1.0 .. 1.5 is typical).")
        if not _whole(self.seed) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed={self.seed!r} must be a whole number from 0 to 2**64 - 1, e.g. 0.")

    def zipf_ids(self, field: int, u: np.ndarray) -> np.ndarray:
        """Uniform ``u`` in (0, 1) → ids of ``field``, popular ids first (inverse CDF)."""
        n, a = self.field_rows[field], self.zipf
        if a == 1.0:
            x = np.power(n + 1.0, u)
        else:
            x = np.power(1 + u * ((n + 1.0) ** (1 - a) - 1), 1 / (1 - a))
        return np.clip(np.floor(x) - 1, 0, n - 1).astype(np.int32)

    def id_weight(self, field: int, ids: np.ndarray) -> np.ndarray:
        """The planted weight of ``ids`` of ``field`` (standard normal, fixed by the seed)."""
        return _normal(self.seed, 2 * field + 1000, ids)

    def examples(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The examples with global indices ``index``."""
        fields = len(self.field_rows)
        ids = np.stack([self.zipf_ids(f, _uniform(self.seed, f, index)) for f in range(fields)],
                       axis=1)
        dense = np.stack([_normal(self.seed, 100 + k, index) for k in range(self.dense)], axis=1)
        v = _normal(self.seed, 999, np.arange(self.dense))
        logit = sum(self.id_weight(f, ids[:, f]) for f in range(fields)) + dense @ v
        logit = self.signal * logit / np.sqrt(fields + 1)
        label = _uniform(self.seed, 500, index) < 1 / (1 + np.exp(-logit))
        return {"dense": dense.astype(np.float32), "ids": ids, "label": label.astype(np.float32)}

    def batch(self, step: int, batch_size: int, *, process_index: int = 0,
              process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step`` (``batch_size`` rows in all)."""
        for name, value, low in (("step", step, 0), ("batch_size", batch_size, 1), ("process_count", process_count, 1)):
            if not _whole(value) or value < low:
                raise ValueError(f"{name}={value!r} must be a whole number >= {low}.")
        if batch_size % process_count or not 0 <= process_index < process_count:
            raise ValueError(f"batch_size={batch_size} must split evenly over process_count="
                             f"{process_count}, and process_index={process_index} lie in "
                             f"0..{process_count - 1}; use a batch size that is a multiple of "
                             f"{process_count}.")
        per = batch_size // process_count
        start = step * batch_size + process_index * per
        return self.examples(np.arange(start, start + per, dtype=np.int64))

    def eval_batch(self, size: int) -> dict[str, np.ndarray]:
        """Held-out examples: indices from 2**62 on, past those of any training step."""
        return self.examples(np.arange(size, dtype=np.int64) + (1 << 62))


def _normal(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Standard normal values by Box-Muller from two uniform streams."""
    u1, u2 = _uniform(seed, stream, index), _uniform(seed, stream + 10_000, index)
    return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
