"""A small text corpus the project generates: lines of integer arithmetic, tokenized by character.

The lines (``"37+5=42"``) are learnable, so the loss visibly falls within a few hundred steps.

    >>> ds = ArithmeticData(seq_len=16, seed=0)
    >>> b = ds.batch(4, step=0)
    >>> b["inputs"].shape, b["targets"].shape
    ((4, 16), (4, 16))
"""

from __future__ import annotations

import functools

import numpy as np

VOCAB = "\n0123456789+-*= "   # 16 symbols: divides evenly over 2, 4, 8 or 16 devices


def arithmetic_text(lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        a, b = (int(v) for v in rng.integers(0, 100, size=2))
        op = "+-*"[int(rng.integers(0, 3))]
        val = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(f"{a}{op}{b}={val}")
    return "\n".join(out) + "\n"


def encode(text: str) -> np.ndarray:
    table = {c: i for i, c in enumerate(VOCAB)}
    return np.array([table[c] for c in text], dtype=np.int32)


@functools.lru_cache(maxsize=8)
def corpus_tokens(lines: int, seed: int) -> np.ndarray:
    """The encoded corpus of ``lines`` lines from ``seed``, made once per process (read-only:
    every `ArithmeticData` of the same corpus shares it)."""
    tokens = encode(arithmetic_text(lines, seed))
    tokens.flags.writeable = False
    return tokens


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


class ArithmeticData:
    """Deterministic batches of (inputs, next-token targets) from the generated corpus."""

    def __init__(self, seq_len: int, seed: int = 0, lines: int = 20000):
        self.seq_len = seq_len
        self.seed = seed
        self.tokens = corpus_tokens(lines, seed)

    def batch(self, batch_size: int, step: int) -> dict[str, np.ndarray]:
        """The global batch for ``step`` (same on every process)."""
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = self.tokens[idx]
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def __iter__(self):
        raise TypeError("use ArithmeticData.batches(batch_size) to iterate")

    def batches(self, batch_size: int, start: int = 0):
        step = start
        while True:
            yield self.batch(batch_size, step)
            step += 1
