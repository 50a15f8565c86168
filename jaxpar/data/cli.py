"""The ``jaxpar data`` subcommand: ``jaxpar data prepare FILES... --out DIR`` builds a token store.

    jaxpar data prepare corpus/*.txt --out data/tokens                       # built-in byte tokenizer
    jaxpar data prepare corpus/*.txt --out data/tokens --tokenizer tokenizer.json
    jaxpar data prepare corpus/*.txt --out data/tokens --train-tokenizer 4096 --docs line

Running the same command again after an interruption continues after the last shard written.
"""

from __future__ import annotations

import argparse
import os

_EPILOG = """\
examples:
  jaxpar data prepare corpus/*.txt --out data/tokens
  jaxpar data prepare corpus/*.txt --out data/tokens --tokenizer path/to/tokenizer.json
  jaxpar data prepare corpus/*.txt --out data/tokens --train-tokenizer 4096 --docs line
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


def add_data_parser(sub) -> None:
    """Register ``jaxpar data prepare`` on the ``jaxpar`` command's subparsers."""
    data = sub.add_parser("data", help="prepare token datasets (jaxpar data prepare FILES --out DIR)")
    inner = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    p = inner.add_parser("prepare", help="tokenize text files into a memory-mapped token store",
                         epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files to tokenize")
    p.add_argument("--out", required=True, help="directory of the token store (created; resumed if it exists)")
    p.add_argument("--tokenizer", default="byte", help="'byte' (built in, default) or a Hugging Face tokenizer.json")
    p.add_argument("--train-tokenizer", type=_positive("--train-tokenizer"), metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the inputs first (kept as OUT/tokenizer.json)")
    p.add_argument("--eos", help="end-of-document token of a tokenizer.json (default: <|endoftext|>, </s>, ...)")
    p.add_argument("--docs", choices=("file", "line"), default="file",
                   help="what one document is: a whole file (default) or one line")
    p.add_argument("--shard-tokens", type=_positive("--shard-tokens"), default=None,
                   help="tokens per shard file (default 16777216)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data_prepare)


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
        return train_tokenizer(args.inputs, args.train_tokenizer, path)
    except ImportError as e:     # the optional 'tokenizers' package: a setup mistake, one paragraph
        raise ValueError(str(e)) from None


def cmd_data_prepare(args) -> int:
    """``jaxpar data prepare``: build (or finish) the token store and print what it holds."""
    from jaxpar.data.store import SHARD_TOKENS, prepare

    missing = [f for f in args.inputs if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"input {missing[0]!r} is not a file" + (f" (nor {len(missing) - 1} more)" if missing[1:] else "")
               + "; give text files to tokenize")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; give a directory for the token store, e.g. --out data/tokens")
    tokenizer = _tokenizer(args)
    store = prepare(args.inputs, args.out, tokenizer, docs=args.docs, shard_tokens=args.shard_tokens or SHARD_TOKENS,
                    progress=not args.quiet)
    kind = store.tokenizer_identity["kind"]
    print(f"{args.out}: {store.num_tokens:,} tokens in {store.num_docs:,} documents, {len(store.shards)} shard(s) of "
          f"{store.dtype.name}; tokenizer {kind} (vocabulary {store.vocab_size}); fingerprint {store.fingerprint}")
    return 0
