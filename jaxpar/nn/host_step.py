"""A training step for a Flax NNX model whose embedding rows come from a `HostEmbedding`.

The dense part (every ``nnx.Param`` of the model) is trained by an optax optimizer inside one
jitted step; the table's rows enter the step as an input (pulled, or fetched by a host
callback), their gradient leaves it, and the table's row optimizer applies it on the host.
``loss_fn(model, batch, rows, inverse)`` looks the embeddings up as ``rows[inverse]``.

With ``config`` and ``mesh`` the dense part is an SPMD step over the mesh: the model comes
from ``jaxpar.init`` (its parameters placed by their logical names), the batch and the
inverse indices are split like any jaxpar batch, and the pulled rows are replicated (a step
uses a few thousand rows; every device needs any of them). Without them it runs on the
table's device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ParallelConfig
from jaxpar.data import leaf_spec, place_batch
from jaxpar.nn.host_embedding import HostEmbedding


class HostEmbeddingStep:
    """Trains ``model`` (dense, on the device) and ``table`` (rows, on the host) together.

    Example:
        >>> from jaxpar.nn.host_embedding import RowOptimizer
        >>> class Tiny(nnx.Module):
        ...     def __init__(self):
        ...         self.w = nnx.Param(jax.numpy.ones((4,)))
        >>> def loss_fn(model, batch, rows, inverse):
        ...     return ((rows[inverse] @ model.w - batch["y"]) ** 2).mean()
        >>> table = HostEmbedding("t", 10, 4, RowOptimizer(kind="sgd", learning_rate=0.1))
        >>> step = HostEmbeddingStep(Tiny(), optax.sgd(0.1), loss_fn, table)
        >>> loss = step({"y": np.ones(2, np.float32)}, np.array([1, 2]))
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
                 loss_fn: Callable, table: HostEmbedding, *,
                 config: ParallelConfig | None = None, mesh: jax.sharding.Mesh | None = None):
        if (config is None) != (mesh is None):
            raise ValueError(f"HostEmbeddingStep takes config and mesh together (got config="
                             f"{config!r}, mesh={mesh!r}); pass both for a step over a mesh, "
                             "neither for one device.")
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.tx, self.table, self.config, self.mesh = tx, table, config, mesh
        # Under jit the optimizer state takes the parameters' placement.
        self.opt_state = jax.jit(tx.init)(self.params)
        self._step = jax.jit(self._make(loss_fn))

    def _make(self, loss_fn):
        graphdef, tx, table = self.graphdef, self.tx, self.table

        def step(params, rest, opt_state, unique, inverse, pulled, batch):
            rows = table.gather(unique) if pulled is None else pulled

            def loss(params, rows):
                return loss_fn(nnx.merge(graphdef, params, rest), batch, rows, inverse)

            value, (grads, row_grads) = jax.value_and_grad(loss, argnums=(0, 1))(params, rows)
            updates, opt_state = tx.update(grads, opt_state, params)
            return value, optax.apply_updates(params, updates), opt_state, row_grads

        return step

    def __call__(self, batch, ids) -> jax.Array:
        """One step on ``batch`` whose categorical ids are ``ids``; returns the loss."""
        prepared = self.table.prepare(ids)
        inverse = prepared.inverse
        if self.mesh is not None:  # rows pulled and replicated, batch split over the mesh
            pulled = self.table.pull(prepared, NamedSharding(self.mesh, PartitionSpec()))
            spec = leaf_spec(self.config, self.mesh, inverse.shape)
            inverse = jax.device_put(inverse, NamedSharding(self.mesh, spec))
            batch = place_batch(self.config, self.mesh, batch)
        elif self.table.storage == "pinned_host":
            pulled = self.table.pull(prepared)
        else:
            pulled = None  # fetched inside the step by the host callback
        loss, self.params, self.opt_state, row_grads = self._step(
            self.params, self.rest, self.opt_state, prepared.unique, inverse, pulled, batch)
        self.table.apply(prepared, row_grads)
        return loss

    @property
    def model(self) -> nnx.Module:
        """The model with the current dense parameters."""
        return nnx.merge(self.graphdef, self.params, self.rest)


def rows_as_inputs(ids: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, inverse)`` of ``ids`` from a whole numpy ``table`` (a one-process reference).

    Example:
        >>> rows, inverse = rows_as_inputs(np.array([2, 2, 5]), np.eye(6))
        >>> rows[inverse].argmax(-1).tolist()
        [2, 2, 5]
    """
    unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
    return table[unique], inverse.reshape(ids.shape)
