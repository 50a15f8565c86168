"""MindSpore-style ``Layout``: a device matrix with named axes, called per tensor.

    >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    >>> spec = layout("dp", ("sp", "mp"))      # dim 0 over dp, dim 1 over sp x mp
    >>> spec.to_partition_spec()
    PartitionSpec('dp', ('sp', 'mp'))

The aliases are mesh axis names: a ``Layout`` is used with a mesh that has those axes with
those sizes (``layout.mesh()`` builds one). ``"None"`` (or ``None``) leaves a dimension whole.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True)
class Layout:
    """A device matrix ``device_matrix`` whose axes are named by ``alias_name``."""

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]

    def __post_init__(self):
        dm, names = tuple(self.device_matrix), tuple(self.alias_name)
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "alias_name", names)
        if len(dm) != len(names):
            raise ValueError(
                f"Layout: device_matrix {dm} has {len(dm)} axes but alias_name {names} has "
                f"{len(names)}; give one alias per axis"
            )
        if any(not isinstance(s, int) or s < 1 for s in dm):
            raise ValueError(f"Layout: device_matrix {dm} must hold positive ints")
        if len(set(names)) != len(names) or "None" in names:
            raise ValueError(f"Layout: alias_name {names} must be distinct and not 'None'")

    @property
    def size(self) -> int:
        return math.prod(self.device_matrix)

    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.alias_name, self.device_matrix))

    def __call__(self, *tensor_map: Any) -> "LayoutSpec":
        entries = []
        used: list[str] = []
        for i, entry in enumerate(tensor_map):
            axes = _entry_axes(entry)
            for a in axes:
                if a not in self.alias_name:
                    raise ValueError(
                        f"Layout{tensor_map}: dimension {i} names {a!r}, which is not an alias of "
                        f"this layout {self.alias_name}; use one of them or 'None'"
                    )
                if a in used:
                    raise ValueError(
                        f"Layout{tensor_map}: alias {a!r} is used on two dimensions; one device "
                        "axis can split only one dimension of a tensor"
                    )
                used.append(a)
            entries.append(axes)
        return LayoutSpec(self, tuple(entries))

    def mesh(self, devices=None):
        """A mesh with this layout's axes (needs exactly ``size`` devices)."""
        import jax
        from jax.sharding import AxisType

        devices = jax.devices()[: self.size] if devices is None else devices
        return jax.make_mesh(self.device_matrix, self.alias_name, axis_types=(AxisType.Auto,) * len(self.alias_name),
                             devices=devices)


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry == "None":
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return tuple(a for a in entry if a != "None")
    raise TypeError(
        f"Layout entry {entry!r} must be an alias string, 'None', or a tuple of aliases"
    )


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """One tensor's layout: for each dimension, the aliases that split it."""

    layout: Layout
    tensor_map: tuple[tuple[str, ...], ...]

    def to_partition_spec(self) -> PartitionSpec:
        return PartitionSpec(*(_spec_entry(axes) for axes in self.tensor_map))


def _spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)
