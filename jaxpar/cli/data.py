"""The ``jaxpar data`` subcommand: ``jaxpar data prepare FILES... --out DIR`` builds a token store,
``jaxpar data verify DIR`` checks one.

    jaxpar data prepare corpus/*.txt --out data/tokens                       # built-in byte tokenizer
    jaxpar data prepare corpus/*.txt.gz --out data/tokens --tokenizer tokenizer.json
    jaxpar data prepare corpus/*.txt --out data/tokens --train-tokenizer 4096 --docs line
    jaxpar data verify data/tokens          # exit 0 intact, 2 and one line per damaged shard

Running the same command again after an interruption continues after the last shard written.
"""

from __future__ import annotations

import argparse
import os
import sys

_EPILOG = """\
examples:
  jaxpar data prepare corpus/*.txt --out data/tokens
  jaxpar data prepare corpus/*.txt --out data/tokens --tokenizer path/to/tokenizer.json
  jaxpar data prepare corpus/*.txt --out data/tokens --train-tokenizer 4096 --docs line
  jaxpar data prepare corpus/*.txt.gz --out data/tokens          # gzip files are decompressed
Run the same command again to resume an interrupted run.
"""


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not valid: expected an integer >= 1")
        return value
    return parse


def add_parser(sub) -> None:
    """Register ``jaxpar data prepare`` and ``jaxpar data verify`` on the ``jaxpar`` command's subparsers."""
    data = sub.add_parser("data", help="prepare and verify token datasets (jaxpar data prepare FILES --out DIR)")
    inner = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    p = inner.add_parser("prepare", help="tokenize text files into a memory-mapped token store",
                         epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="UTF-8 text files to tokenize (gzip-compressed ones are decompressed)")
    p.add_argument("--out", required=True, help="directory of the token store (created; resumed if it exists)")
    p.add_argument("--tokenizer", default="byte", help="'byte' (built in, default) or a Hugging Face tokenizer.json")
    p.add_argument("--train-tokenizer", type=_positive("--train-tokenizer"), metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the inputs first (kept as OUT/tokenizer.json)")
    p.add_argument("--eos", help="end-of-document token of a tokenizer.json (default: <|endoftext|>, </s>, ...)")
    p.add_argument("--docs", choices=("file", "line"), default="file",
                   help="what one document is: a whole file (default) or one line")
    p.add_argument("--shard-tokens", type=_positive("--shard-tokens"), default=None,
                   help="tokens per shard file (default 16777216)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="input that is not UTF-8 text: refused naming the byte (strict, default), or its "
                   "undecodable bytes become U+FFFD (replace)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data_prepare, cli_name="data")
    v = inner.add_parser("verify", help="check every shard of a token store against its index.json (SHA-256, sizes, "
                         "document starts, token ids); exit 0 when intact, 2 and one line per damaged shard")
    v.add_argument("store", metavar="STORE", help="directory of the token store")
    v.set_defaults(func=cmd_data_verify, cli_name="data")


def _tokenizer(args):
    from jaxpar.data.tokenizer import load_tokenizer, train_tokenizer

    try:
        if args.train_tokenizer is None:
            return load_tokenizer(args.tokenizer, eos=args.eos)
        if args.tokenizer != "byte" or args.eos is not None:
            raise ValueError("--train-tokenizer trains a new tokenizer; drop --tokenizer / --eos, or drop --train-tokenizer "
                   "to use the given tokenizer")
        path = os.path.join(args.out, "tokenizer.json")
        if os.path.isfile(path):     # resuming: the tokenizer trained by the interrupted run
            return load_tokenizer(path)
        os.makedirs(args.out, exist_ok=True)
        return train_tokenizer(args.inputs, args.train_tokenizer, path, errors=args.errors)
    except ImportError as e:     # the optional 'tokenizers' package: a setup mistake, one paragraph
        raise ValueError(str(e)) from None


def _check_out(out: str) -> None:
    """``--out`` must be a directory or a path that can become one."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file; give a directory for the token store, e.g. --out data/tokens")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out!r} is inside {parent!r}, which is a file; give a directory for the token "
                         "store, e.g. --out data/tokens")


def cmd_data_prepare(args) -> int:
    """``jaxpar data prepare``: build (or finish) the token store and print what it holds."""
    from jaxpar.data.store import SHARD_TOKENS, prepare
    from jaxpar.data.text import check_text

    missing = [f for f in args.inputs if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"input {missing[0]!r} is not a file" + (f" (nor {len(missing) - 1} more)" if missing[1:] else "")
               + "; give text files to tokenize")
    _check_out(args.out)
    try:
        for f in args.inputs:       # before a tokenizer is trained on them
            check_text(f, args.errors)
        tokenizer = _tokenizer(args)
        store = prepare(args.inputs, args.out, tokenizer, docs=args.docs,
                        shard_tokens=args.shard_tokens or SHARD_TOKENS, errors=args.errors, progress=not args.quiet)
    except OSError as e:      # a full disk, a file it may not read: the machine's answer, in one line
        if e.errno is None:   # jaxpar's own FileNotFoundError, already one paragraph
            raise
        where = f" ({e.filename!r})" if e.filename else ""
        raise ValueError(f"stopped by the system: {e.strerror or e}{where}; fix that (e.g. free disk space) and run "
                         "the same command again: it continues after the last shard written") from None
    kind = store.tokenizer_identity["kind"]
    print(f"{args.out}: {store.num_tokens:,} tokens in {store.num_docs:,} documents, {len(store.shards)} shard(s) of "
          f"{store.dtype.name}; tokenizer {kind} (vocabulary {store.vocab_size}); fingerprint {store.fingerprint}")
    return 0


def cmd_data_verify(args) -> int:
    """``jaxpar data verify STORE``: every shard hashed and checked; exit 2 with one line per damaged one."""
    from jaxpar.data.store import read_index, verify_store

    try:
        damaged = verify_store(args.store)
    except OSError as e:
        raise ValueError(f"cannot read the token store {args.store!r}: {e.strerror or e} ({e.filename!r})") from None
    for d in damaged:
        print(f"jaxpar data: error: shard {d.shard}: {d.file!r} {d.what}; restore it from a copy or prepare the "
              "store again", file=sys.stderr)
    if damaged:
        return 2
    shards = read_index(args.store)["shards"]
    old = sum("tokens_sha256" not in s for s in shards)
    tokens = sum(s["num_tokens"] for s in shards)
    if old:
        print(f"{args.store}: {len(shards)} shard(s), {tokens:,} tokens: sizes, document starts and token ids are "
              f"sound, but {old} shard(s) have no checksum in index.json (prepared before jaxpar recorded them), so "
              "an edited token there goes unnoticed; prepare the store again to add checksums")
    else:
        print(f"{args.store}: intact: {len(shards)} shard(s), {tokens:,} tokens; the SHA-256 of every file matches "
              "index.json and every token id is in the vocabulary")
    return 0
