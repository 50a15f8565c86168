"""Every ```python block of README.md and docs/*.md runs.

The blocks of one page run in order in one shared namespace (a later block may use names an
earlier one defined), in this process, on the 8 simulated CPU devices of ``conftest.py``.
A block fenced as ```python no-run is skipped; the page must say next to it why it cannot
run. A failure names the page, the block number and the block's first line in the page, and
the traceback points into the markdown file itself.
"""

from __future__ import annotations

import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)

# Blocks that fail because of a known jaxpar bug: (page, block number) -> the bug. The test
# is an expected failure while the block fails, and fails once the block passes, so that
# the entry is removed together with the fix.
KNOWN_BUGS: dict[tuple[str, int], str] = {}


def python_blocks(text: str) -> list[tuple[int, int, str, bool]]:
    """``(block number from 1, line of its first code line, code, runs)`` for each python block."""
    blocks = []
    for number, m in enumerate(FENCE.finditer(text), start=1):
        line = text.count("\n", 0, m.start("code")) + 1
        runs = "no-run" not in m.group("info").split()
        blocks.append((number, line, m.group("code"), runs))
    return blocks


def _pages_with_code() -> list[pathlib.Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if any(runs for *_, runs in python_blocks(p.read_text()))]


PAGES = _pages_with_code()


def test_every_technique_page_has_runnable_code():
    """Only the index may be prose alone; every other page shows its feature running."""
    names = {p.name for p in PAGES}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} - names <= {"index.md"}


def test_fence_parser():
    text = "intro\n```python\na = 1\n```\n\n```python no-run\nboom()\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(1, 3, "a = 1\n", True), (2, 7, "boom()\n", False)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: pathlib.Path):
    name = str(page.relative_to(ROOT))
    blocks = python_blocks(page.read_text())
    namespace: dict = {"__name__": f"docs:{name}"}
    known_failures = []
    for number, line, code, runs in blocks:
        if not runs:
            continue
        # Padding with blank lines makes traceback line numbers those of the markdown file.
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")
        try:
            exec(compiled, namespace)
            error = None
        except Exception as e:  # noqa: BLE001 (report any failure with its place)
            error = f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}"
        known = KNOWN_BUGS.get((name, number))
        if error is not None and known is None:
            pytest.fail(f"{name}: python block {number} (line {line}) raised {error}", pytrace=False)
        if error is not None:
            known_failures.append(f"block {number} ({known}): {error.splitlines()[0]}")
        elif known is not None:
            pytest.fail(f"{name}: python block {number} (line {line}) now runs; the bug {known!r} "
                        "looks fixed: remove it from KNOWN_BUGS")
    if known_failures:
        pytest.xfail(f"{name}: known jaxpar bugs: " + "; ".join(known_failures))
