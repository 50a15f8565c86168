"""Token stores of the Python standard library's own source, for the demo job.

The corpus exists on every machine with Python and is read where it is (nothing is copied into
the repository). Top-level modules, sorted by name; every tenth one is held out for evaluation.

    python examples/stdlib_corpus.py --out runs/data       # runs/data/stdlib-{train,eval}
"""

from __future__ import annotations

import argparse
import os
import sysconfig

from jaxpar.data import prepare


def stdlib_files(limit_bytes: int) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` paths: top-level ``*.py`` modules up to ``limit_bytes`` in all."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    train, held_out, total = [], [], 0
    for i, name in enumerate(names):
        path = os.path.join(root, name)
        total += os.path.getsize(path)
        if total > limit_bytes:
            break
        (held_out if i % 10 == 9 else train).append(path)
    return train, held_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/data", help="folder of the two token stores (default %(default)s)")
    p.add_argument("--limit-mb", type=float, default=4.0, help="source bytes read, in MB (default %(default)s)")
    args = p.parse_args()
    train, held_out = stdlib_files(int(args.limit_mb * 2**20))
    for name, files in (("stdlib-train", train), ("stdlib-eval", held_out)):
        store = prepare(files, os.path.join(args.out, name))    # resumes, or returns a finished store
        print(f"{name}: {len(files)} files, {store.num_tokens:,} tokens in {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
