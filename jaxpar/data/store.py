"""A token store on disk: shards of fixed-width token ids, memory-mapped, and a small JSON index.

``prepare`` turns text files into a store (what ``jaxpar data prepare`` runs); `TokenStore`
opens one for reading. A store directory holds::

    index.json              format, token dtype, tokenizer identity, inputs, shards, progress
    tokens_00000.bin        the token ids of shard 0, raw (uint16 when the vocabulary fits, else uint32)
    docs_00000.npy          where each document starts in shard 0 (int64 offsets; the first is 0)
    tokenizer.json          a copy of the Hugging Face tokenizer, when one was used

Every document is followed by the tokenizer's end-of-document token. ``prepare`` writes a
shard, then the index that names it (each by an atomic rename), so an interrupted run resumes
after its last shard and produces exactly the files an uninterrupted run would.

    >>> import tempfile, pathlib
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "a.txt").write_text("hello\\nworld\\n")
    >>> store = prepare([str(tmp / "a.txt")], str(tmp / "store"), docs="line", progress=False)
    >>> store.num_tokens, store.num_docs, store.tokenizer_identity["kind"]
    (12, 2, 'byte')
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

FORMAT = "jaxpar-token-store"
VERSION = 1
INDEX = "index.json"
CHUNK_BYTES = 1 << 22          # text read and tokenized at once (whole lines)
SHARD_TOKENS = 1 << 24         # a shard is written once this many tokens are buffered


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id of the vocabulary.

    >>> token_dtype(257), token_dtype(128256)
    (dtype('uint16'), dtype('uint32'))
    """
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenStore:
    """A prepared store, opened for reading: ``shards`` of ``(tokens, doc_starts)``, tokens memory-mapped.

    A missing or unfinished index, or a shard file that is not there, is a ``ValueError``
    naming the file.

        >>> store = TokenStore("data/tokens")                 # doctest: +SKIP
        >>> store.num_tokens, store.fingerprint[:8]           # doctest: +SKIP
    """

    def __init__(self, path: str):
        self.path = path
        self.index_path = os.path.join(path, INDEX)
        self.index = read_index(path)
        if not self.index.get("complete"):
            raise ValueError(f"token store {self.index_path!r} is unfinished (jaxpar data prepare was interrupted "
                             f"after {len(self.index['shards'])} shards); run the same command again to finish it")
        self.dtype = np.dtype(self.index["dtype"])
        self.shards = [self._open(s) for s in self.index["shards"]]

    def _open(self, entry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        files = [os.path.join(self.path, entry[k]) for k in ("tokens", "docs")]
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"token store {self.index_path!r} names shard file {f!r}, which does not exist; "
                                 "prepare the store again")
        tokens = np.memmap(files[0], dtype=self.dtype, mode="r") if entry["num_tokens"] else np.zeros(0, self.dtype)
        if len(tokens) != entry["num_tokens"]:
            raise ValueError(f"shard file {files[0]!r} holds {len(tokens)} tokens but {self.index_path!r} says "
                             f"{entry['num_tokens']}; the store is damaged: prepare it again")
        return tokens, np.load(files[1])

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        return dict(self.index["tokenizer"])

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.index["shards"])

    @property
    def num_docs(self) -> int:
        return sum(s["num_docs"] for s in self.index["shards"])

    @property
    def vocab_size(self) -> int:
        return int(self.index["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.index["tokenizer"]["eos_id"])

    @property
    def fingerprint(self) -> str:
        """A hash of the tokenizer, dtype and shards: two stores with it hold the same tokens."""
        meta = {k: self.index[k] for k in ("tokenizer", "dtype", "shards")}
        return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """A ``ValueError`` unless ``tokenizer`` is the one the store was built with."""
        theirs = tokenizer.identity()
        if theirs != self.tokenizer_identity:
            raise ValueError(f"token store {self.index_path!r} was built with tokenizer {self.tokenizer_identity}, "
                             f"not {theirs}; train with the store's tokenizer (TokenStore.tokenizer()) or prepare "
                             "the data again with this one")

    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        """The tokenizer the store was built with (a Hugging Face one is kept in the store)."""
        meta = self.index["tokenizer"]
        if meta["kind"] == "byte":
            return ByteTokenizer()
        return HFTokenizer(os.path.join(self.path, meta["file"]), eos=meta["eos_token"])


def read_index(path: str) -> dict[str, Any]:
    """The index of the store at ``path``; ``ValueError`` naming the file when it is missing or not one."""
    index_path = os.path.join(path, INDEX)
    if not os.path.isfile(index_path):
        raise ValueError(f"no token store index at {index_path!r}; build the store with "
                         f"'jaxpar data prepare FILES... --out {path}' or give the directory that holds {INDEX}")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"token store index {index_path!r} cannot be read ({e}); prepare the store again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_path!r} is not a {FORMAT} index of version {VERSION}; prepare the store again")
    return index


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)      # readers see the old index or the new one, never half of one


def _inputs(files: Sequence[str]) -> list[dict[str, Any]]:
    if not files:
        raise ValueError("prepare: no input files given; pass one or more text files")
    out = []
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"input {f!r} is not a file; give text files to tokenize")
        out.append({"path": os.path.abspath(f), "bytes": os.path.getsize(f)})
    return out


def _fresh_index(inputs, tokenizer: Tokenizer, docs: str, shard_tokens: int, chunk_bytes: int) -> dict[str, Any]:
    meta = dict(tokenizer.identity())
    if isinstance(tokenizer, HFTokenizer):
        meta.update(file="tokenizer.json", eos_token=tokenizer.eos)
    return {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tokenizer.vocab_size).name,
            "tokenizer": meta, "docs": docs, "shard_tokens": shard_tokens, "chunk_bytes": chunk_bytes, "inputs": inputs,
            "shards": [], "next": {"input": 0, "offset": 0}, "complete": False}


def _resume_index(out: str, fresh: dict[str, Any]) -> dict[str, Any]:
    """The index to continue from: the one in ``out`` if it is the same job, else ``fresh``."""
    if not os.path.exists(os.path.join(out, INDEX)):
        return fresh
    old = read_index(out)
    for key in ("tokenizer", "docs", "shard_tokens", "chunk_bytes", "inputs", "dtype"):
        if old[key] != fresh[key]:
            raise ValueError(f"--out {out!r} already holds a token store with {key} {old[key]} (this run: "
                             f"{fresh[key]}); choose another --out, or delete {out!r} to rebuild it")
    return old


def prepare(inputs: Sequence[str], out: str, tokenizer: Tokenizer | None = None, *, docs: str = "file",
            shard_tokens: int = SHARD_TOKENS, chunk_bytes: int = CHUNK_BYTES, progress: bool = True) -> TokenStore:
    """Tokenize text files ``inputs`` into a token store at ``out``; resumes an interrupted run.

    ``docs``: ``"file"`` (each file is one document) or ``"line"`` (each non-empty line is one).
    ``tokenizer``: default the built-in `ByteTokenizer`. ``shard_tokens``: a shard is written
    once this many tokens are buffered; ``chunk_bytes``: text tokenized at once (whole lines).
    Returns the finished `TokenStore`.
    """
    if docs not in ("file", "line"):
        raise ValueError(f"docs={docs!r}: choose 'file' (a document per file) or 'line' (a document per line)")
    for name, value, default in (("shard_tokens", shard_tokens, SHARD_TOKENS), ("chunk_bytes", chunk_bytes, CHUNK_BYTES)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (default {default})")
    tokenizer = tokenizer or ByteTokenizer()
    os.makedirs(out, exist_ok=True)
    index = _resume_index(out, _fresh_index(_inputs(inputs), tokenizer, docs, shard_tokens, chunk_bytes))
    if not index["complete"]:
        if isinstance(tokenizer, HFTokenizer) and os.path.abspath(tokenizer.path) != os.path.abspath(
                os.path.join(out, "tokenizer.json")):
            shutil.copyfile(tokenizer.path, os.path.join(out, "tokenizer.json"))
        _Writer(out, index, tokenizer).run(progress)
    return TokenStore(out)


class _Writer:
    """Reads the inputs from ``index["next"]`` on, buffers tokens, writes shards and the index."""

    def __init__(self, out: str, index: dict[str, Any], tokenizer: Tokenizer):
        self.out, self.index, self.tokenizer = out, index, tokenizer
        self.dtype = np.dtype(index["dtype"])
        self.pieces: list[np.ndarray] = []
        self.starts: list[int] = []
        self.buffered = 0

    def run(self, progress: bool) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        inputs, nxt = self.index["inputs"], self.index["next"]
        done = sum(i["bytes"] for i in inputs[:nxt["input"]]) + nxt["offset"]
        columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("prepare", total=sum(i["bytes"] for i in inputs), completed=done)
            for k in range(nxt["input"], len(inputs)):
                self._one_input(k, nxt["offset"] if k == nxt["input"] else 0, lambda n: bar.advance(task, n))
            self._flush(len(inputs), 0)
        self.index["complete"] = True
        _write_json(os.path.join(self.out, INDEX), self.index)

    def _one_input(self, k: int, offset: int, advance) -> None:
        entry = self.index["inputs"][k]
        with open(entry["path"], "rb") as f:
            f.seek(offset)
            while offset < entry["bytes"]:
                lines = f.readlines(self.index["chunk_bytes"])
                if not lines:
                    break
                size = sum(len(line) for line in lines)
                self._add(lines, first=offset == 0, last=offset + size >= entry["bytes"])
                offset += size
                advance(size)
                if self.buffered >= self.index["shard_tokens"]:
                    # a shard ends only after a whole chunk: the resume point is a byte offset
                    self._flush(k + (offset >= entry["bytes"]), 0 if offset >= entry["bytes"] else offset)

    def _add(self, lines: list[bytes], *, first: bool, last: bool) -> None:
        text = [line.decode("utf-8", errors="replace") for line in lines]
        if self.index["docs"] == "line":
            kept = [t.rstrip("\r\n") for t in text]
            tokens, lengths = self.tokenizer.encode_lines([t for t in kept if t])
            self.starts.extend((self.buffered + np.concatenate([[0], np.cumsum(lengths)[:-1]])).tolist()
                               if len(lengths) else [])
        else:
            if first:
                self.starts.append(self.buffered)
            tokens = self.tokenizer.encode("".join(text))
            if last:
                tokens = np.append(tokens, self.tokenizer.eos_id)
        self.pieces.append(np.asarray(tokens))
        self.buffered += len(tokens)

    def _flush(self, next_input: int, next_offset: int) -> None:
        if self.buffered:
            n = len(self.index["shards"])
            names = {"tokens": f"tokens_{n:05d}.bin", "docs": f"docs_{n:05d}.npy"}
            # a document carried over from the previous shard starts this one
            starts = np.asarray(self.starts if self.starts[:1] == [0] else [0, *self.starts], np.int64)
            tokens = np.concatenate(self.pieces).astype(self.dtype)
            for key, write in (("tokens", tokens.tofile), ("docs", lambda f: np.save(f, starts))):
                tmp = os.path.join(self.out, names[key] + ".tmp")
                with open(tmp, "wb") as f:
                    write(f)
                os.replace(tmp, os.path.join(self.out, names[key]))
            self.index["shards"].append({**names, "num_tokens": len(tokens), "num_docs": len(starts)})
        self.pieces, self.starts, self.buffered = [], [], 0
        self.index["next"] = {"input": next_input, "offset": next_offset}
        _write_json(os.path.join(self.out, INDEX), self.index)
