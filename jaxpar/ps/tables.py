"""Embedding tables of the parameter server: their spec, partition, initial rows and row optimizers.

Everything here is numpy on the host: a server holds its shard of each table as a
``float32 [local_rows, dim]`` array and applies the row optimizer itself. A row's initial
value depends only on ``(seed, global row id)``, so any partition over any server count (and
an in-process copy built by :func:`init_rows`) holds the same table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _check_positive(kind: str, name: str, value: float) -> None:
    if not (_number(value) and 0 < value < math.inf):
        raise ValueError(f"{kind}: {name}={value!r} must be a positive finite number")


def _check_eps(kind: str, value: float) -> None:
    if not (_number(value) and 0 <= value < math.inf):
        raise ValueError(f"{kind}: eps={value!r} must be a finite number >= 0")


def _check_unit(kind: str, name: str, value: float) -> None:
    if not (_number(value) and 0 <= value < 1):
        raise ValueError(f"{kind}: {name}={value!r} must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class SGD:
    """Row SGD: ``w -= lr * g`` for the rows that got a gradient.

    Example:
        >>> jaxpar.ps.SGD(0.1)
        SGD(lr=0.1)
    """

    lr: float

    def __post_init__(self):
        _check_positive("SGD", "lr", self.lr)

    def slots(self, rows: int, dim: int) -> dict[str, np.ndarray]:
        return {}

    def apply(self, w: np.ndarray, slots: dict, g: np.ndarray) -> np.ndarray:
        return w - np.float32(self.lr) * g


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """Row Adagrad, as ``optax.adagrad``: ``acc += g²; w -= lr * g / sqrt(acc + eps)``.

    Rows without a gradient do not move (their accumulator does not change either), so lazy
    Adagrad equals dense ``optax.adagrad`` over the whole table.

    Example:
        >>> jaxpar.ps.Adagrad(0.1).initial_accumulator
        0.1
    """

    lr: float
    initial_accumulator: float = 0.1
    eps: float = 1e-10

    def __post_init__(self):
        _check_positive("Adagrad", "lr", self.lr)
        if not (_number(self.initial_accumulator) and 0 <= self.initial_accumulator < math.inf):
            raise ValueError(f"Adagrad: initial_accumulator={self.initial_accumulator!r} must be a finite number >= 0")
        _check_eps("Adagrad", self.eps)

    def slots(self, rows: int, dim: int) -> dict[str, np.ndarray]:
        return {"acc": np.full((rows, dim), self.initial_accumulator, np.float32)}

    def apply(self, w: np.ndarray, slots: dict, g: np.ndarray) -> np.ndarray:
        acc = slots["acc"] + g * g
        slots["acc"] = acc
        scale = np.where(acc > 0, 1.0 / np.sqrt(acc + np.float32(self.eps)), 0.0).astype(np.float32)
        return w - np.float32(self.lr) * (g * scale)


@dataclasses.dataclass(frozen=True)
class Adam:
    """Lazy row Adam: moments and the bias-correction step count are kept per row.

    A row moves only at steps where it gets a gradient, and its step count counts those steps
    alone (``torch.optim.SparseAdam``'s semantics); it therefore differs from dense Adam, whose
    moments decay at every step.

    Example:
        >>> jaxpar.ps.Adam(1e-3).b2
        0.999
    """

    lr: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        _check_positive("Adam", "lr", self.lr)
        _check_unit("Adam", "b1", self.b1)
        _check_unit("Adam", "b2", self.b2)
        _check_eps("Adam", self.eps)

    def slots(self, rows: int, dim: int) -> dict[str, np.ndarray]:
        return {"m": np.zeros((rows, dim), np.float32), "v": np.zeros((rows, dim), np.float32),
                "count": np.zeros((rows, 1), np.float32)}

    def apply(self, w: np.ndarray, slots: dict, g: np.ndarray) -> np.ndarray:
        b1, b2 = np.float32(self.b1), np.float32(self.b2)
        m = b1 * slots["m"] + (1 - b1) * g
        v = b2 * slots["v"] + (1 - b2) * g * g
        t = slots["count"] + 1
        slots.update(m=m, v=v, count=t)
        m_hat = m / (1 - b1 ** t)
        v_hat = v / (1 - b2 ** t)
        return w - np.float32(self.lr) * m_hat / (np.sqrt(v_hat) + np.float32(self.eps))


OPTIMIZERS = {"SGD": SGD, "Adagrad": Adagrad, "Adam": Adam}
Optimizer = SGD | Adagrad | Adam


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table served by the parameter servers.

    Args:
        name: the table's name (what workers pull and push by).
        rows, dim: the table's shape.
        optimizer: the row optimizer the servers apply (``SGD``, ``Adagrad``, ``Adam``).
        partition: ``"hash"`` (row ``i`` on server ``i % count``) or ``"range"`` (contiguous
            blocks of ``ceil(rows / count)`` rows).
        init_scale: initial rows are uniform in ``[-init_scale, init_scale]``.
        seed: with the global row id, fixes every initial value.

    Example:
        >>> spec = jaxpar.ps.TableSpec("users", 1000, 8, jaxpar.ps.SGD(0.1))
        >>> spec.owner(np.array([0, 1, 2]), count=2).tolist()
        [0, 1, 0]
    """

    name: str
    rows: int
    dim: int
    optimizer: Optimizer
    partition: str = "hash"
    init_scale: float = 0.01
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec: name={self.name!r} must be a non-empty string")
        for field in ("rows", "dim"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TableSpec {self.name!r}: {field}={value!r} must be an integer >= 1")
        if self.partition not in ("hash", "range"):
            raise ValueError(f"TableSpec {self.name!r}: partition={self.partition!r}; "
                             "use 'hash' (id % servers) or 'range' (contiguous blocks)")
        if not (_number(self.init_scale) and 0 <= self.init_scale < math.inf):
            raise ValueError(f"TableSpec {self.name!r}: init_scale={self.init_scale!r} must be a finite number >= 0 "
                             "(initial rows are uniform in [-init_scale, init_scale])")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"TableSpec {self.name!r}: seed={self.seed!r} must be an int in [0, 2**64)")
        if not isinstance(self.optimizer, (SGD, Adagrad, Adam)):
            raise TypeError(f"TableSpec {self.name!r}: optimizer={self.optimizer!r}; use "
                            "jaxpar.ps.SGD, jaxpar.ps.Adagrad or jaxpar.ps.Adam")

    def owner(self, ids: np.ndarray, count: int) -> np.ndarray:
        """The server index owning each global row id."""
        if self.partition == "hash":
            return ids % count
        return ids // math.ceil(self.rows / count)

    def local(self, ids: np.ndarray, count: int) -> np.ndarray:
        """Each id's row index inside its owner's shard."""
        if self.partition == "hash":
            return ids // count
        return ids % math.ceil(self.rows / count)

    def shard_ids(self, index: int, count: int) -> np.ndarray:
        """The global ids server ``index`` of ``count`` owns, in local order."""
        if self.partition == "hash":
            return np.arange(index, self.rows, count, dtype=np.int64)
        block = math.ceil(self.rows / count)
        return np.arange(index * block, min(self.rows, (index + 1) * block), dtype=np.int64)

    def to_json(self) -> dict[str, Any]:
        opt = self.optimizer
        return {"name": self.name, "rows": int(self.rows), "dim": int(self.dim),
                "partition": self.partition, "init_scale": float(self.init_scale),
                "seed": int(self.seed),
                "optimizer": {"kind": type(opt).__name__, **{k: float(v) for k, v in dataclasses.asdict(opt).items()}}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TableSpec":
        opt = dict(d["optimizer"])
        kind = opt.pop("kind")
        if kind not in OPTIMIZERS:
            raise ValueError(f"table {d.get('name')!r}: unknown optimizer {kind!r}; known: {sorted(OPTIMIZERS)}")
        return cls(d["name"], int(d["rows"]), int(d["dim"]), OPTIMIZERS[kind](**opt),
                   partition=d["partition"], init_scale=d["init_scale"], seed=d["seed"])


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # A counter-based hash: each value depends on its counter alone, so rows can be made in any
    # order, on any server, with no generator state to carry.
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def init_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The initial rows of ``spec`` for the global ``ids``: ``float32 [len(ids), dim]``.

    Example:
        >>> spec = jaxpar.ps.TableSpec("t", 10, 4, jaxpar.ps.SGD(0.1), seed=3)
        >>> bool((jaxpar.ps.init_rows(spec, np.arange(10))[2] == jaxpar.ps.init_rows(spec, np.array([2]))[0]).all())
        True
    """
    ids = np.asarray(ids, dtype=np.uint64)
    counter = (ids[:, None] * np.uint64(spec.dim) + np.arange(spec.dim, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        counter = counter + _splitmix64(np.array([spec.seed], dtype=np.uint64))
    bits = _splitmix64(counter) >> np.uint64(40)  # 24 bits: exact in float32
    u = bits.astype(np.float32) / np.float32(1 << 24)
    return ((2 * u - 1) * np.float32(spec.init_scale)).astype(np.float32)
