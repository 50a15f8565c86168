"""A DLRM-style click model: dense features through a bottom MLP, one embedding row per
categorical field, pairwise dot products between all of them, a top MLP, a logistic loss.

The model knows nothing about where its embedding rows live. ``model(dense, ids)`` looks
them up in its own table (the one-device reference); ``model(dense, rows=rows,
inverse=inverse)`` takes rows pulled from outside (a `HostEmbedding`, parameter servers) with
``rows[inverse]`` the embedding of each id; build it with ``table=False`` then.

All fields share one table: field ``f``'s local id ``i`` is row ``config.offsets[f] + i``
(``config.table_ids``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """Sizes of the model.

    Example:
        >>> DLRMConfig(field_rows=(10, 20)).offsets, DLRMConfig(field_rows=(10, 20)).rows
        ((0, 10), 30)
    """

    field_rows: tuple[int, ...] = (1000, 500, 100)
    """Rows of each categorical field."""
    dense: int = 4
    """Dense features per example."""
    embed: int = 16
    """Width of an embedding row (and of the bottom MLP's output)."""
    bottom: tuple[int, ...] = (32,)
    """Hidden widths of the bottom MLP."""
    top: tuple[int, ...] = (32,)
    """Hidden widths of the top MLP."""

    def __post_init__(self):
        if not isinstance(self.field_rows, tuple) or not self.field_rows or not all(map(_positive, self.field_rows)):
            raise ValueError(f"field_rows={self.field_rows!r} must be a tuple of positive row counts, one "
                             "per categorical field, e.g. (1000, 500).")
        for name in ("dense", "embed"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"DLRMConfig: {name}={getattr(self, name)!r} must be a positive whole number, e.g. 16.")
        for name in ("bottom", "top"):
            widths = getattr(self, name)
            if not isinstance(widths, tuple) or not all(map(_positive, widths)):
                raise ValueError(f"DLRMConfig: {name}={widths!r} must be a tuple of positive hidden widths "
                                 "(() for none), e.g. (32,).")

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.field_rows[:-1]))

    @property
    def rows(self) -> int:
        """Rows of the shared table."""
        return int(sum(self.field_rows))

    def table_ids(self, ids):
        """Per-field local ids ``[B, F]`` → rows of the shared table.

        Concrete ids are checked: an id past its field's rows would read another field's row.

        >>> DLRMConfig(field_rows=(10, 20)).table_ids(np.array([[9, 0]])).tolist()
        [[9, 10]]
        """
        self.check_ids(ids)
        return ids + np.asarray(self.offsets, np.int32)

    def check_ids(self, ids) -> None:
        """A ``ValueError`` unless ``ids`` is ``[..., F]`` with field ``f``'s ids in ``0..field_rows[f] - 1``
        (traced ids, inside ``jit``, are only checked for their shape)."""
        fields = len(self.field_rows)
        dtype = np.dtype(ids.dtype if hasattr(ids, "dtype") else np.asarray(ids).dtype)   # a tracer's too
        if dtype.kind not in "iu":
            raise TypeError(f"DLRM: ids of dtype {dtype} (shape {np.shape(ids)}); ids must be integers: cast them "
                            "with ids.astype(np.int32) (a float id is a bug upstream)")
        if not np.ndim(ids) or np.shape(ids)[-1] != fields:
            raise ValueError(f"DLRM: ids of shape {np.shape(ids)} must be [batch, {fields}] (one local id per "
                             f"field of field_rows={self.field_rows}); pass ClickData(...).batch(...)['ids']")
        try:
            values = np.asarray(ids)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return
        bad = (values < 0) | (values >= np.asarray(self.field_rows))
        if bad.any():
            f = int(np.argwhere(bad)[0][-1])
            raise ValueError(f"DLRM: field {f} has rows 0..{self.field_rows[f] - 1}, but the ids (shape "
                             f"{values.shape}) hold {int(values[bad.nonzero()][0])} there; give each field's "
                             f"local ids (the shared table's rows come from table_ids)")


def _positive(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and x >= 1


def _param(rngs: nnx.Rngs, shape, names, scale: float) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(scale), names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class MLP(nnx.Module):
    """ReLU layers of the given widths; the last one stays linear. Its input dimension is
    named ``names[0]``, its output ``names[1]``, every hidden one ``"mlp"``."""

    def __init__(self, widths: tuple[int, ...], names: tuple[str, str], *, rngs: nnx.Rngs):
        dims = [names[0], *["mlp"] * (len(widths) - 2), names[1]]
        layers = list(zip(widths[:-1], widths[1:], dims[:-1], dims[1:]))
        self.weights = nnx.List([_param(rngs, (a, b), (na, nb), a ** -0.5)
                                 for a, b, na, nb in layers])
        self.biases = nnx.List([_param(rngs, (b,), (nb,), 0.0) for _, b, _, nb in layers])

    def __call__(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = x @ w[...] + b[...]
            x = jax.nn.relu(x) if i < len(self.weights) - 1 else x
        return x


class DLRM(nnx.Module):
    """The click model; ``__call__`` returns one logit per example.

    Example:
        >>> model = DLRM(DLRMConfig(field_rows=(10, 5)), rngs=nnx.Rngs(0))
        >>> model(np.zeros((2, 4), np.float32), np.array([[1, 2], [3, 4]])).shape
        (2,)
    """

    def __init__(self, config: DLRMConfig, *, rngs: nnx.Rngs, table: bool = True):
        self.config = config
        e, fields = config.embed, len(config.field_rows)
        self.bottom = MLP((config.dense, *config.bottom, e), ("dense", "embed"), rngs=rngs)
        pairs = (fields + 1) * fields // 2
        self.top = MLP((e + pairs, *config.top, 1), ("interaction", "logit"), rngs=rngs)
        self.table = _param(rngs, (config.rows, e), ("rows", "embed"), 0.1) if table else None

    def __call__(self, dense, ids=None, *, rows=None, inverse=None):
        if np.ndim(dense) != 2 or np.shape(dense)[1] != self.config.dense:
            raise ValueError(f"DLRM: dense of shape {np.shape(dense)} must be [batch, {self.config.dense}] "
                             f"(DLRMConfig.dense={self.config.dense}); match the data's dense features")
        if rows is None:
            if ids is None or self.table is None:
                raise ValueError("DLRM: give ids (a model built with table=True looks them up) or rows= and "
                                 f"inverse= (rows pulled from outside); got ids={'None' if ids is None else 'given'}"
                                 f", rows=None, and this model was built with table={self.table is not None}")
            emb = self.table[...][self.config.table_ids(ids)]  # [B, F, E]
        else:
            if inverse is None or np.shape(inverse) != (np.shape(dense)[0], len(self.config.field_rows)):
                raise ValueError(f"DLRM: rows= needs inverse= of shape [batch, fields] = "
                                 f"{(np.shape(dense)[0], len(self.config.field_rows))} (the row of each id), got "
                                 f"{None if inverse is None else np.shape(inverse)}")
            emb = rows[inverse]
        x = self.bottom(dense)                                      # [B, E]
        z = jnp.concatenate([x[:, None], emb], axis=1)              # [B, F + 1, E]
        dots = jnp.einsum("bie,bje->bij", z, z)
        i, j = np.triu_indices(z.shape[1], k=1)                     # each pair once
        return self.top(jnp.concatenate([x, dots[:, i, j]], axis=1))[:, 0]


def loss_fn(model: DLRM, batch, rows=None, inverse=None):
    """Mean logistic loss of ``batch`` (``dense``, ``ids``, ``label``)."""
    logits = model(batch["dense"], batch.get("ids"), rows=rows, inverse=inverse)
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()
