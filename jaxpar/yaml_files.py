"""The YAML jaxpar reads: PyYAML's safe loader, refusing a key given twice in one mapping.

PyYAML keeps the last of two equal keys without a word, so ``train: {steps: 1}`` followed later
by ``train: {steps: 500}`` would train 500 steps from a file whose first section says 1.
`UniqueKeyLoader` refuses that, naming the key and both lines; merge keys (``<<: *base``)
still let a mapping override what it merges, as YAML means them to. Every YAML file jaxpar
loads (job files, ``ParallelConfig.from_yaml``, ``--to`` files) goes through it.

    >>> load_yaml("mesh: {data: 2}\\nmesh: {data: 4}\\n", "a.yaml")
    Traceback (most recent call last):
    ...
    ValueError: a.yaml: key 'mesh' is given twice, at line 1 and at line 2 ...
    >>> load_yaml("base: &b {data: 2}\\nmesh: {<<: *b, data: 4}\\n", "a.yaml")["mesh"]
    {'data': 4}
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that gives one key twice: ``key``, and the 1-based ``first`` and ``second`` lines."""

    def __init__(self, key: Any, first: yaml.Mark, second: yaml.Mark):
        self.key, self.first, self.second = key, first.line + 1, second.line + 1
        super().__init__(None, None, f"key {key!r} is given twice, at line {self.first} and at line {self.second}",
                         second)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises `DuplicateKeyError` for a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:          # an unhashable key: the base class names it
                    continue
                if first is not None:
                    raise DuplicateKeyError(key, first, key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, where: str, loader: type[yaml.SafeLoader] = UniqueKeyLoader) -> Any:
    """``text`` parsed with ``loader`` (a `UniqueKeyLoader`); a YAML error is a ``ValueError``
    naming ``where``, the line and column, and the problem."""
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKeyError as e:
        raise ValueError(f"{where}: key {e.key!r} is given twice, at line {e.first} and at line {e.second} (YAML "
                         "would keep the second silently); keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"{where}: not valid YAML{at} ({problem}); fix the file") from None
    except RecursionError:
        raise ValueError(f"{where}: nests its YAML too deep to read; fix the file") from None


def read_yaml(path: str, loader: type[yaml.SafeLoader] = UniqueKeyLoader) -> Any:
    """The YAML file at ``path`` (see `load_yaml`); a file that is not UTF-8 text is a ``ValueError``."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8)") \
            from None
    return load_yaml(text, path, loader)
