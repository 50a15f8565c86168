"""A token store on disk: shards of fixed-width token ids and a small JSON index.

``prepare`` turns text files into a store (what ``jaxpar data prepare`` runs); `TokenStore`
opens one for reading. A store directory holds::

    index.json              format, token dtype, tokenizer identity, inputs, progress, and per shard
                            its counts and the SHA-256 of its files (and of a sample of its tokens)
    tokens_00000.bin        the token ids of shard 0, raw (uint16 when the vocabulary fits, else uint32)
    docs_00000.npy          where each document starts in shard 0 (int64 offsets; the first is 0)
    tokenizer.json          a copy of the Hugging Face tokenizer, when one was used

Every document is followed by the tokenizer's end-of-document token. ``prepare`` writes a
shard, then the index that names it (each by an atomic rename), so an interrupted run resumes
after its last shard and produces exactly the files an uninterrupted run would. Inputs are
UTF-8 text, plain or gzip-compressed (`jaxpar.data.text`).

Opening a store checks every shard cheaply against the index (file sizes, the document starts
and their SHA-256, a sampled SHA-256 of the tokens); `verify_store` hashes everything and
checks every token id. A damaged shard is a `ShardDamage` (a ``ValueError``) naming its file.
Token files are read with ``os.preadv`` on an open file, never memory-mapped
(`jaxpar.data.shard_read`): a shard truncated or rewritten while it is read is a `ShardDamage`
naming the shard, the offset and the bytes expected, never a SIGBUS.

    >>> import tempfile, pathlib
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "a.txt").write_text("hello\\nworld\\n")
    >>> store = prepare([str(tmp / "a.txt")], str(tmp / "store"), docs="line", progress=False)
    >>> store.num_tokens, store.num_docs, store.tokenizer_identity["kind"]
    (12, 2, 'byte')
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar.data.index_check import check_index, record_sha256
from jaxpar.data.shard_read import ShardDamage, ShardTokens, identity
from jaxpar.data.text import check_errors, check_text, decode_lines, open_input
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

FORMAT = "jaxpar-token-store"
VERSION = 1
INDEX = "index.json"
CHUNK_BYTES = 1 << 22          # text read and tokenized at once (whole lines)
SHARD_TOKENS = 1 << 24         # a shard is written once this many tokens are buffered
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096   # what opening a store hashes of each shard's tokens


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id of the vocabulary.

    >>> token_dtype(257), token_dtype(128256)
    (dtype('uint16'), dtype('uint32'))
    """
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenStore:
    """A prepared store, opened for reading: ``shards`` of ``(tokens, doc_starts)``; ``tokens`` is a
    `ShardTokens` that reads the shard's file on demand (``tokens[a:b]``, ``read_rows``,
    ``np.asarray(tokens)``), ``doc_starts`` an int64 array.

    A missing or unfinished index is a ``ValueError`` naming the file; a shard file that is
    missing or does not match the index (size, document starts, checksums) a `ShardDamage`.
    `check_unchanged` tells whether a shard file changed since the store was opened.

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
        opened = [_open_shard(path, self.index, k) for k in range(len(self.index["shards"]))]
        self.shards = [(tokens, starts) for tokens, starts in opened]
        self._files = [os.path.join(path, entry["tokens"]) for entry in self.index["shards"]]

    def shard_file(self, shard: int) -> str:
        """The path of the token file of ``shard``."""
        return self._files[shard]

    def check_unchanged(self, shard: int) -> None:
        """A `ShardDamage` if the token file of ``shard`` changed (size, modification time, inode)
        since the store was opened (every read of `ShardTokens` checks this itself)."""
        shard = int(shard)
        file = self._files[shard]
        try:
            now = identity(os.stat(file))
        except OSError as e:
            raise ShardDamage(self.path, shard, file, f"is gone while it was being read ({e.strerror})") from None
        opened = self.shards[shard][0].opened
        if now != opened:
            raise ShardDamage(self.path, shard, file, f"changed while it was being read ({opened[0]} "
                              f"bytes when opened, {now[0]} now): a store must not be rewritten while a job reads it")

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
    except (OSError, ValueError, RecursionError) as e:     # JSON, UTF-8, or nesting too deep
        raise ValueError(f"token store index {index_path!r} cannot be read ({type(e).__name__}: {e}); prepare the "
                         "store again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_path!r} is not a {FORMAT} index of version {VERSION}; prepare the store again")
    check_index(index, index_path)
    return index


def verify_store(path: str) -> list[ShardDamage]:
    """Check every shard of the store at ``path`` fully: what opening it checks, the SHA-256 of
    every token file and every token id against the vocabulary. Returns one `ShardDamage` per
    damaged shard (empty when intact); a missing or unfinished index is a ``ValueError``.
    Shards of a store prepared before checksums were recorded (no ``tokens_sha256`` in the
    index) are checked for size, document starts and token ids only.

        >>> verify_store("data/tokens")                       # doctest: +SKIP
        []
    """
    index = read_index(path)
    if not index.get("complete"):
        raise ValueError(f"token store {os.path.join(path, INDEX)!r} is unfinished (jaxpar data prepare was "
                         "interrupted); run the same command again to finish it")
    found = []
    for k in range(len(index["shards"])):
        try:
            _open_shard(path, index, k, full=True)
        except ShardDamage as e:
            found.append(e)
    return found


def _open_shard(path: str, index: dict[str, Any], k: int, *, full: bool = False):
    """``(tokens, doc_starts)`` of shard ``k``, checked against the index; ``full``: hash every
    token and check every id too. A `ShardDamage` naming the file otherwise."""
    entry, dtype = index["shards"][k], np.dtype(index["dtype"])
    n = entry["num_tokens"]
    tokens_file, docs_file = (os.path.join(path, entry[key]) for key in ("tokens", "docs"))
    for f in (tokens_file, docs_file):
        if not os.path.isfile(f):
            raise ShardDamage(path, k, f, "does not exist")
    st = os.stat(tokens_file)
    if st.st_size != n * dtype.itemsize:
        raise ShardDamage(path, k, tokens_file, f"is {st.st_size} bytes but the index says {n} {dtype.name} tokens "
                          f"({n * dtype.itemsize} bytes): it was truncated, extended or overwritten")
    tokens = ShardTokens(path, k, tokens_file, dtype, n, identity(st))
    if "record_sha256" in entry and record_sha256(entry) != entry["record_sha256"]:
        raise _edited_record(path, k, entry, tokens, full)
    starts = _read_starts(path, k, docs_file, entry)
    if full:
        _check_all_tokens(path, k, tokens, entry, int(index["tokenizer"]["vocab_size"]))
    elif "tokens_sample" in entry and _sample_sha256(tokens) != entry["tokens_sample"]:
        raise ShardDamage(path, k, tokens_file, "holds other tokens than the index records (its sampled SHA-256 "
                          "differs): it was edited or overwritten")
    return tokens, starts


def _check_all_tokens(path: str, k: int, tokens: ShardTokens, entry: dict[str, Any], vocab: int) -> None:
    """Every token id of shard ``k`` in the vocabulary, and the SHA-256 of all its bytes (when
    recorded), read in pieces of ``CHUNK_BYTES``."""
    digest = _all_sha256(tokens, vocab)
    if "tokens_sha256" in entry and digest != entry["tokens_sha256"]:
        raise ShardDamage(path, k, tokens.file, f"holds other tokens than the index records: its SHA-256 is {digest}, "
                          f"index.json records {entry['tokens_sha256']}; the file was edited or overwritten, or "
                          "index.json's record was changed")


def _all_sha256(tokens: ShardTokens, vocab: int | None = None) -> str:
    """The SHA-256 of every token of a shard, read in pieces of ``CHUNK_BYTES``; with ``vocab``,
    a `ShardDamage` for the first token id outside it."""
    path, k = tokens.store, tokens.shard
    h = hashlib.sha256()
    for at, chunk in tokens.chunks(max(1, CHUNK_BYTES // tokens.dtype.itemsize)):
        if vocab is not None and len(chunk) and int(chunk.max()) >= vocab:
            bad = int(np.argmax(chunk >= vocab))
            raise ShardDamage(path, k, tokens.file, f"holds token id {int(chunk[bad])} at token {at + bad}, outside "
                              f"the vocabulary of {vocab}: it was edited or overwritten")
        h.update(chunk)
    return h.hexdigest()


def _edited_record(path: str, k: int, entry: dict[str, Any], tokens: ShardTokens, full: bool) -> ShardDamage:
    """Shard ``k``'s record in index.json no longer matches its own checksum: the index was
    edited, and the shard's files are not to blame. ``full``: name both token hashes."""
    what = (f"holds a record of shard {k} that does not match its own checksum (record_sha256): index.json's "
            "record was changed, not necessarily the shard's files")
    if full and "tokens_sha256" in entry:
        digest = _all_sha256(tokens)
        same = "the same" if digest == entry["tokens_sha256"] else "another"
        what += (f"; the record says tokens SHA-256 {entry['tokens_sha256']}, the file {tokens.file!r} has "
                 f"{digest} ({same} hash)")
    return ShardDamage(path, k, os.path.join(path, INDEX), what)


def _read_starts(path: str, k: int, docs_file: str, entry: dict[str, Any]) -> np.ndarray:
    """The document starts of shard ``k``: their SHA-256 (when recorded), count and order checked."""
    with open(docs_file, "rb") as f:
        raw = f.read()
    if "docs_sha256" in entry and hashlib.sha256(raw).hexdigest() != entry["docs_sha256"]:
        raise ShardDamage(path, k, docs_file, "holds other document starts than the index records (its SHA-256 "
                          "differs): it was edited or overwritten")
    try:
        starts = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise ShardDamage(path, k, docs_file, f"is not a readable .npy file ({e})") from None
    n, want = entry["num_tokens"], entry["num_docs"]
    if starts.dtype != np.int64 or starts.shape != (want,):
        raise ShardDamage(path, k, docs_file, f"holds {starts.dtype.name} {starts.shape} but the index says {want} "
                          "int64 document starts")
    if want and (starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] >= n):
        raise ShardDamage(path, k, docs_file, f"does not hold document starts sorted from 0 to below {n} (the "
                          "shard's tokens)")
    return starts


def _sample_sha256(tokens: np.ndarray | ShardTokens) -> str:
    """SHA-256 of ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` spread evenly over the tokens' bytes
    (all of them when they are few): a few pages read per shard when a store is opened."""
    item = np.dtype(tokens.dtype).itemsize
    size = len(tokens) * item
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        blocks = [(0, size)]
    else:
        blocks = [(b * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1), SAMPLE_BYTES) for b in range(SAMPLE_BLOCKS)]
    # whole tokens around each byte block, then the block's bytes out of them
    first = [at // item for at, _ in blocks]
    count = [-(-(at + n) // item) - f for (at, n), f in zip(blocks, first)]
    if isinstance(tokens, ShardTokens):
        pieces = tokens.read_rows(first, count)
    else:
        pieces = [tokens[f:f + c] for f, c in zip(first, count)]
    h = hashlib.sha256()
    for (at, n), f, piece in zip(blocks, first, pieces):
        skip = at - f * item
        h.update(np.ascontiguousarray(piece).view(np.uint8)[skip:skip + n])
    return h.hexdigest()


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)      # readers see the old index or the new one, never half of one


def _inputs(files: Sequence[str], errors: str) -> list[dict[str, Any]]:
    if isinstance(files, (str, bytes, os.PathLike)):   # its characters would be taken as paths
        raise TypeError(f"prepare: inputs={files!r} is one path; pass a list of paths, e.g. [{files!r}]")
    if not files:
        raise ValueError("prepare: no input files given; pass one or more text files")
    out = []
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"input {f!r} is not a file; give text files to tokenize")
        check_text(f, errors)         # a binary file is refused here, before anything is written
        out.append({"path": os.path.abspath(f), "bytes": os.path.getsize(f)})
    return out


def _make_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out={out!r} is a file; give a directory for the token store, e.g. data/tokens")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out={out!r}: the directory cannot be made ({e.strerror}: {e.filename!r}); give a "
                         "directory path you can write") from None


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
            shard_tokens: int = SHARD_TOKENS, chunk_bytes: int = CHUNK_BYTES, errors: str = "strict",
            progress: bool = True) -> TokenStore:
    """Tokenize text files ``inputs`` into a token store at ``out``; resumes an interrupted run.

    ``docs``: ``"file"`` (each file is one document) or ``"line"`` (each non-empty line is one).
    ``tokenizer``: default the built-in `ByteTokenizer`. ``shard_tokens``: a shard is written
    once this many tokens are buffered; ``chunk_bytes``: text tokenized at once (whole lines).
    Inputs are UTF-8 text, gzip-compressed ones decompressed; anything else (a binary file) is a
    ``ValueError`` naming the file and byte, unless ``errors="replace"`` turns undecodable bytes
    into U+FFFD. An ``OSError`` while writing (a full disk) leaves a store that the same call
    resumes. Returns the finished `TokenStore`.
    """
    if docs not in ("file", "line"):
        raise ValueError(f"docs={docs!r}: choose 'file' (a document per file) or 'line' (a document per line)")
    for name, value, default in (("shard_tokens", shard_tokens, SHARD_TOKENS), ("chunk_bytes", chunk_bytes, CHUNK_BYTES)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (default {default})")
    check_errors(errors)
    tokenizer = tokenizer or ByteTokenizer()
    fresh = _fresh_index(_inputs(inputs, errors), tokenizer, docs, shard_tokens, chunk_bytes)
    _make_out(out)
    index = _resume_index(out, fresh)
    if not index["complete"]:
        if isinstance(tokenizer, HFTokenizer) and os.path.abspath(tokenizer.path) != os.path.abspath(
                os.path.join(out, "tokenizer.json")):
            shutil.copyfile(tokenizer.path, os.path.join(out, "tokenizer.json"))
        _Writer(out, index, tokenizer, errors).run(progress)
    return TokenStore(out)


class _Writer:
    """Reads the inputs from ``index["next"]`` on, buffers tokens, writes shards and the index."""

    def __init__(self, out: str, index: dict[str, Any], tokenizer: Tokenizer, errors: str):
        self.out, self.index, self.tokenizer, self.errors = out, index, tokenizer, errors
        self.dtype = np.dtype(index["dtype"])
        self.pieces: list[np.ndarray] = []
        self.starts: list[int] = []
        self.buffered = 0

    def run(self, progress: bool) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        inputs, nxt = self.index["inputs"], self.index["next"]
        done = sum(i["bytes"] for i in inputs[:nxt["input"]])
        columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("prepare", total=sum(i["bytes"] for i in inputs), completed=done)
            for k in range(nxt["input"], len(inputs)):
                self._one_input(k, nxt["offset"] if k == nxt["input"] else 0, lambda n: bar.advance(task, n))
            self._flush(len(inputs), 0)
        self.index["complete"] = True
        _write_json(os.path.join(self.out, INDEX), self.index)

    def _one_input(self, k: int, offset: int, advance) -> None:
        """Input ``k`` from text offset ``offset`` (of the decompressed text for a gzip file)."""
        path, chunk = self.index["inputs"][k]["path"], self.index["chunk_bytes"]
        with open_input(path) as (stream, raw):
            stream.seek(offset)
            seen = raw.tell()       # bytes of the file on disk, for the progress bar
            advance(seen)
            lines = stream.readlines(chunk)
            while lines:
                ahead = stream.readlines(chunk)    # none: ``lines`` end the file
                text = decode_lines(lines, path, offset, self.errors, compressed=stream is not raw)
                self._add(text, first=offset == 0, last=not ahead)
                offset += sum(len(line) for line in lines)
                advance(raw.tell() - seen)
                seen = raw.tell()
                if self.buffered >= self.index["shard_tokens"]:
                    # a shard ends only after a whole chunk: the resume point is a text offset
                    self._flush(k, offset) if ahead else self._flush(k + 1, 0)
                lines = ahead

    def _add(self, text: list[str], *, first: bool, last: bool) -> None:
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
            docs = io.BytesIO()
            np.save(docs, starts)
            for key, data in (("tokens", tokens), ("docs", docs.getbuffer())):
                tmp = os.path.join(self.out, names[key] + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.out, names[key]))
            self.index["shards"].append({
                **names, "num_tokens": len(tokens), "num_docs": len(starts),
                "tokens_sha256": hashlib.sha256(tokens).hexdigest(), "tokens_sample": _sample_sha256(tokens),
                "docs_sha256": hashlib.sha256(docs.getbuffer()).hexdigest()})
            self.index["shards"][-1]["record_sha256"] = record_sha256(self.index["shards"][-1])
        self.pieces, self.starts, self.buffered = [], [], 0
        self.index["next"] = {"input": next_input, "offset": next_offset}
        _write_json(os.path.join(self.out, INDEX), self.index)
