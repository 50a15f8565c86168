"""Checks of a token store's ``index.json`` before any of it is used: its fields and their types
(`check_index`), and each shard record's own checksum (`record_sha256`), which tells an edited
record from an edited shard file.

    >>> check_index({"dtype": "int8"}, "data/tokens/index.json")
    Traceback (most recent call last):
    ...
    ValueError: token store index 'data/tokens/index.json' is malformed: dtype is 'int8', expected 'uint16' or 'uint32'; ...
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def check_index(index: dict[str, Any], index_path: str) -> None:
    """A ``ValueError`` naming the field of a malformed index (a JSON file edited by hand or
    cut short by something other than ``prepare``), before any of it is used."""
    def bad(field: str, value: Any, want: str) -> ValueError:
        return ValueError(f"token store index {index_path!r} is malformed: {field} is {value!r}, expected {want}; "
                          "restore index.json from a copy, or delete the store and run 'jaxpar data prepare' again")

    def count(field: str, value: Any, low: int = 0) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise bad(field, value, f"an int >= {low}")

    if index.get("dtype") not in ("uint16", "uint32"):
        raise bad("dtype", index.get("dtype"), "'uint16' or 'uint32'")
    tok = index.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("kind"), str):
        raise bad("tokenizer", tok, "an object with kind, vocab_size and eos_id")
    count("tokenizer.vocab_size", tok.get("vocab_size"), 1)
    count("tokenizer.eos_id", tok.get("eos_id"))
    if not isinstance(index.get("complete"), bool):
        raise bad("complete", index.get("complete"), "true or false")
    nxt = index.get("next")
    if not isinstance(nxt, dict):
        raise bad("next", nxt, "an object with input and offset")
    count("next.input", nxt.get("input"))
    count("next.offset", nxt.get("offset"))
    if not isinstance(index.get("inputs"), list):
        raise bad("inputs", index.get("inputs"), "a list of input files")
    if not isinstance(index.get("shards"), list):
        raise bad("shards", index.get("shards"), "a list of shard records")
    for k, entry in enumerate(index["shards"]):
        if not isinstance(entry, dict):
            raise bad(f"shards[{k}]", entry, "an object")
        for key in ("tokens", "docs"):      # a file of the store's own directory, nothing elsewhere
            name = entry.get(key)
            if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
                raise bad(f"shards[{k}].{key}", name, "a file name in the store's directory")
        count(f"shards[{k}].num_tokens", entry.get("num_tokens"))
        count(f"shards[{k}].num_docs", entry.get("num_docs"))
        for key in ("tokens_sha256", "tokens_sample", "docs_sha256", "record_sha256"):
            if key in entry and not (isinstance(entry[key], str) and len(entry[key]) == 64):
                raise bad(f"shards[{k}].{key}", entry[key], "a SHA-256 as 64 hex digits")


def record_sha256(entry: dict[str, Any]) -> str:
    """The SHA-256 of a shard's record in the index (all but this checksum itself): tells an
    edited record from an edited shard file."""
    rest = {k: v for k, v in entry.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
