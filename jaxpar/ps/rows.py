"""Embedding rows kept outside the model, trained by the one `jaxpar.Trainer` loop.

A *row source* (``Trainer(..., rows=source)``) owns tables the device never holds whole: a
`jaxpar.ps.HostEmbedding` in host memory, or parameter servers. Around each compiled step
the Trainer calls

1. ``source.pull(batch) -> (step_batch, rows, handle)`` on the host, before the step: the
   batch the compiled step gets (its ids replaced by indices into ``rows``), the rows that
   batch reads (a pytree of ``[n, dim]`` arrays; one shape per batch shape, so one compile),
   and whatever ``push`` needs to put their gradients back;
2. the compiled step, which differentiates with respect to the parameters *and* the rows
   (``loss_fn(model, batch, rows)``) and returns the rows' gradients next to its metrics;
   the rows pass through every wrapper of `jaxpar.train.step` like parameters that are
   replicated: cast to the compute dtype by ``precision``, summed over the micro-batches by
   ``grad_accum``, averaged over the batch axes with the parameters' gradients;
3. ``source.push(handle, row_grads, step)`` on the host, after the step: the rows' optimizer
   (a host row optimizer, a server's) applies them.

A step that is not finite (skipped with ``Trainer(nonfinite="skip")``, or the one a run stops
at) pushes ``None``: the source applies nothing and counts the step. The logged ``grad_norm``
counts the rows' gradients with the parameters'; an optax clipping in ``tx`` sees the
parameters' alone (the rows' optimizer is the source's). Sources hold their
tables themselves; a source with ``save(step)`` / ``restore(step)`` (`jaxpar.ps.ServerRows`)
saves them just before each of the Trainer's checkpoints and goes back to the step the
Trainer resumes or restores (without them, checkpoints hold the dense state only). In one
process the rows are replicated over the mesh; in a job of several processes the source pulls
them as global ``jax.Array``s on the Trainer's mesh, placed as the step takes them (e.g. each
process's block split over the batch axis).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RowSource(Protocol):
    """What ``Trainer(rows=...)`` calls around each step (see the module's docstring).

    Example:
        >>> import numpy as np
        >>> class Table:            # a whole numpy table, trained by SGD on the host
        ...     def __init__(self): self.rows = np.zeros((10, 4), np.float32)
        ...     def pull(self, batch):
        ...         unique, inverse = np.unique(batch["ids"], return_inverse=True)
        ...         return {**batch, "ids": inverse}, self.rows[unique], unique
        ...     def push(self, unique, grads, step): self.rows[unique] -= 0.1 * np.asarray(grads)
        >>> isinstance(Table(), RowSource)
        True
    """

    def pull(self, batch: Any) -> tuple[Any, Any, Any]:
        """``(step_batch, rows, handle)`` for ``batch`` (on the host, before the step)."""

    def push(self, handle: Any, row_grads: Any, step: int) -> None:
        """Applies the gradients of the rows ``pull`` gave with ``handle`` (after step ``step``).
        ``row_grads`` is None when the step was not finite (its update skipped, or the run about
        to stop): apply nothing, but count the step as done."""

