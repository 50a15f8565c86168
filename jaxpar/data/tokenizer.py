"""Tokenizers that need no download: a built-in byte-level one, or a Hugging Face ``tokenizer.json``.

Every tokenizer has an ``identity()`` (a small JSON-able dict) that a token store records in its
index, so that training with another tokenizer is refused; ``vocab_size``; ``eos_id``, the token
appended after every document; ``encode(text)`` and ``encode_lines(lines)``.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi").tolist(), tok.vocab_size, tok.eos_id
    ([104, 105], 257, 256)
    >>> tokens, lengths = tok.encode_lines(["ab", "c"])
    >>> tokens.tolist(), lengths.tolist()
    ([97, 98, 256, 99, 256], [3, 2])
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jaxpar.data.text import check_errors, read_lines

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
TRAINED_EOS = "<|endoftext|>"


class Tokenizer(Protocol):
    """What ``prepare`` and the loader need of a tokenizer."""

    vocab_size: int
    eos_id: int

    def identity(self) -> dict[str, Any]: ...

    def encode(self, text: str) -> np.ndarray: ...

    def encode_lines(self, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...


class _Same:
    """Tokenizers are equal when their identities are (the same ids for the same text)."""

    def __eq__(self, other) -> bool:
        return callable(getattr(other, "identity", None)) and self.identity() == other.identity()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.identity().items())))


class ByteTokenizer(_Same):
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document token (vocabulary 257).

    >>> ByteTokenizer().decode([104, 105, 256])
    'hi'
    """

    vocab_size = 257
    eos_id = 256

    def identity(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)

    def encode_lines(self, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each line's bytes followed by ``eos_id`` (one C pass over the joined text, no loop)."""
        if not lines:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        tokens = np.frombuffer(("\n".join(lines) + "\n").encode("utf-8"), np.uint8).astype(np.int64)
        ends = np.flatnonzero(tokens == 10)          # the joining newlines become end-of-document
        tokens[ends] = self.eos_id
        return tokens, np.diff(ends, prepend=-1)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(_Same):
    """A Hugging Face ``tokenizer.json`` read from a local file (needs ``pip install jaxpar[data]``).

    ``eos``: the end-of-document token; default the first of ``EOS_CANDIDATES`` the vocabulary has.

        >>> tok = HFTokenizer("tokenizer.json")          # doctest: +SKIP
        >>> tok.identity()["kind"]                       # doctest: +SKIP
        'huggingface'
    """

    def __init__(self, path: str, eos: str | None = None):
        tokenizers = _import_tokenizers(f"reading the tokenizer file {path!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer {path!r} does not exist; give a Hugging Face tokenizer.json file, "
                                    "'byte' for the built-in byte-level tokenizer, or train one (--train-tokenizer)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:   # the Rust parser raises its own Exception type
            raise ValueError(f"tokenizer {path!r} is not a Hugging Face tokenizer.json ({e}); give such a "
                             "file or 'byte'") from None
        self.path = path
        with open(path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos, self.eos_id = self._find_eos(eos)

    def _find_eos(self, eos: str | None) -> tuple[str, int]:
        names = (eos,) if eos is not None else EOS_CANDIDATES
        for name in names:
            found = self._tok.token_to_id(name)
            if found is not None:
                return name, int(found)
        raise ValueError(f"tokenizer {self.path!r} has no end-of-document token {' / '.join(names)}; name one "
                         "of its tokens with --eos TOKEN (eos='...')")

    def identity(self) -> dict[str, Any]:
        return {"kind": "huggingface", "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int64)

    def encode_lines(self, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = self._tok.encode_batch(list(lines), add_special_tokens=False)   # parallel, in Rust
        pieces = [np.append(np.asarray(e.ids, np.int64), self.eos_id) for e in encoded]
        if not pieces:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(pieces), np.array([len(p) for p in pieces], np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def train_tokenizer(files: Sequence[str], vocab_size: int, out: str, *, errors: str = "strict") -> HFTokenizer:
    """Train a byte-level BPE tokenizer on ``files`` locally and save it as ``out`` (a tokenizer.json).

    Its end-of-document token is ``<|endoftext|>``. The files are read as ``prepare`` reads
    them (`jaxpar.data.text`: UTF-8, gzip decompressed, ``errors`` for undecodable bytes).

        >>> tok = train_tokenizer(["corpus.txt"], 512, "tokenizer.json")   # doctest: +SKIP
    """
    tokenizers = _import_tokenizers("training a tokenizer")
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size!r}: a byte-level BPE needs at least 257 tokens (256 bytes and "
                         "<|endoftext|>); use e.g. 512 or more")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    check_errors(errors)
    # line by line with the line endings, as the Rust file reader of tok.train(files) feeds them
    tok.train_from_iterator((line for f in files for line in read_lines(f, errors)), trainer)
    tok.save(out)
    return HFTokenizer(out, eos=TRAINED_EOS)


def load_tokenizer(spec: str = "byte", eos: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` → `ByteTokenizer`; a path → `HFTokenizer` of that tokenizer.json.

    >>> load_tokenizer("byte").identity()["kind"]
    'byte'
    """
    if spec == "byte":
        if eos is not None:
            raise ValueError(f"eos={eos!r} is for a tokenizer.json; the byte tokenizer's end-of-document is 256")
        return ByteTokenizer()
    return HFTokenizer(spec, eos=eos)


def _import_tokenizers(why: str):
    try:
        import tokenizers
    except ImportError:
        raise ImportError(f"{why} needs the 'tokenizers' package: pip install 'jaxpar[data]' (or use the "
                          "built-in byte tokenizer, --tokenizer byte)") from None
    return tokenizers
