"""Reading the inputs of ``jaxpar data prepare``: text files, plain or gzip-compressed, as UTF-8.

A file whose first bytes are gzip's magic number is decompressed as it is read (whatever its
name). Text must be UTF-8 without NUL bytes: anything else is refused with a ``ValueError``
naming the file and the byte, unless ``errors="replace"`` turns undecodable bytes into U+FFFD.
Lines are split on ``b"\\n"``, which never occurs inside a multi-byte UTF-8 character, so a
chunk of whole lines always decodes on its own.

    >>> import tempfile, gzip, pathlib
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> with gzip.open(tmp / "a.txt.gz", "wt") as f:
    ...     _ = f.write("hello\\nworld\\n")
    >>> list(read_lines(str(tmp / "a.txt.gz")))
    ['hello\\n', 'world\\n']
    >>> _ = (tmp / "b.bin").write_bytes(bytes(range(256)))
    >>> check_text(str(tmp / "b.bin"))                       # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: input '.../b.bin' is not text: a NUL byte at byte 0; give UTF-8 text files ...
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import zlib
from collections.abc import Iterator

GZIP_MAGIC = b"\x1f\x8b"
SNIFF_BYTES = 1 << 13          # what check_text reads of each input before any work starts
ERRORS = ("strict", "replace")


def check_errors(errors: str) -> None:
    if errors not in ERRORS:
        raise ValueError(f"errors={errors!r}: choose 'strict' (refuse input that is not UTF-8 text) or 'replace' "
                         "(undecodable bytes become U+FFFD)")


@contextlib.contextmanager
def open_input(path: str):
    """``(stream, raw)``: ``stream`` yields the file's text bytes (decompressed when it is gzip),
    ``raw.tell()`` is how far into the file on disk reading has come."""
    with open(path, "rb") as raw:
        compressed = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        if not compressed:
            yield raw, raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            try:
                yield stream, raw
            except (gzip.BadGzipFile, EOFError, zlib.error) as e:
                raise ValueError(f"input {path!r} is a damaged gzip file ({e}); decompress it with gunzip to "
                                 "see where, or give the text uncompressed") from None


def decode_lines(lines: list[bytes], path: str, offset: int, errors: str = "strict", *,
                 compressed: bool = False) -> list[str]:
    """``lines`` (bytes read from ``path`` at text offset ``offset``; ``compressed``: of a gzip
    file) as ``str``; under ``errors="strict"`` a ``ValueError`` naming the file and the byte
    when they are not UTF-8 text."""
    if errors == "replace":
        return [line.decode("utf-8", errors="replace") for line in lines]
    out = []
    for line in lines:
        try:
            if b"\0" in line:
                raise UnicodeError
            out.append(line.decode("utf-8"))
        except UnicodeError:
            _strict(line, path, offset, final=True, compressed=compressed)    # raises, naming the byte
        offset += len(line)
    return out


def check_text(path: str, errors: str = "strict") -> None:
    """Read the first few KiB of ``path`` (decompressed) and refuse it, naming the byte, unless it
    is UTF-8 text; a binary file or a damaged gzip file fails here, before any work starts."""
    if errors == "replace":
        return
    with open_input(path) as (stream, raw):
        head = stream.read(SNIFF_BYTES)
    # a head cut at SNIFF_BYTES may end inside a character: not final
    _strict(head, path, 0, final=len(head) < SNIFF_BYTES, compressed=stream is not raw)


def read_lines(path: str, errors: str = "strict", chunk_bytes: int = 1 << 22) -> Iterator[str]:
    """Every line of ``path`` with its line ending, decoded (see `decode_lines`)."""
    with open_input(path) as (stream, raw):
        offset = 0
        while lines := stream.readlines(chunk_bytes):
            yield from decode_lines(lines, path, offset, errors, compressed=stream is not raw)
            offset += sum(len(line) for line in lines)


def _strict(data: bytes, path: str, offset: int, *, final: bool, compressed: bool) -> str:
    nul = data.find(b"\0")
    if nul >= 0:
        _refuse(path, offset + nul, "a NUL byte", compressed)
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as e:
        _refuse(path, offset + e.start, f"byte 0x{data[e.start]:02x}, not UTF-8,", compressed)


def _refuse(path: str, at: int, what: str, compressed: bool):
    where = " of its decompressed text" if compressed else ""
    raise ValueError(f"input {path!r} is not text: {what} at byte {at}{where}; "
                     "give UTF-8 text files (gzip-compressed ones are read as such), or pass --errors replace "
                     "(errors='replace') to turn undecodable bytes into U+FFFD") from None
