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

A step that is not finite (skipped with ``Services(nonfinite="skip")``, or the one a run stops
at) pushes ``None``: the source applies nothing and counts the step. The logged ``grad_norm``
counts the rows' gradients with the parameters'; an optax clipping in ``tx`` sees the
parameters' alone (the rows' optimizer is the source's).

Sources hold their tables themselves; the Trainer's checkpoints keep them in one of two ways,
each optional (a source with neither: checkpoints hold the dense state only):

- ``snapshot() -> dict`` and ``load_snapshot(tables)`` (`jaxpar.ps.HostRows`): tables the
  Trainer's own checkpoint holds. When the Trainer saves step ``s`` it takes ``snapshot()``
  (a dict of numpy arrays, copies of this moment: later pushes must not change them) and
  writes it as item ``rows`` of the same step directory, in the same commit as the state, so a
  complete step always has its tables, also when the files are written in the background.
  Restoring or resuming step ``s`` gives its ``rows`` item to ``load_snapshot`` before the
  Trainer takes the state. A step saved without that item (by a Trainer without ``rows=``,
  or by an older jaxpar) is refused with a ``ValueError`` naming the directory and the step,
  and how to take its dense state alone (`jaxpar.checkpoint.restore_state`). Such tables are
  one process's (``HostRows`` runs in one process);
- ``save(step)`` and ``restore(step)`` (`jaxpar.ps.ServerRows`): tables kept elsewhere (on
  servers), snapshotted there just before each of the Trainer's checkpoints, and put back to
  the step the Trainer resumes or restores.

In one process the rows are replicated over the mesh; in a job of several processes the source pulls
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

    # Optional (not part of the runtime check): ``snapshot() -> dict`` / ``load_snapshot(tables)``,
    # or ``save(step)`` / ``restore(step)``; see the module's docstring.

