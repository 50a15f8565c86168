"""What the processes of a job agree on before they act on a checkpoint.

Reading is each process's own (its shards), so one process may meet a damage the others do not;
renaming steps aside is process 0's. Before any of them acts, the outcome is exchanged: every
process takes the same step, refuses the same damage, and waits where the others wait.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.checkpoint.damage import CheckpointDamagedError

__all__ = ["agreed", "barrier", "from_first_process"]


def agreed(read, directory, step: int):
    """``read()`` on every process, its outcome agreed: on several processes each process's
    verdict (read back, damaged, failed otherwise) is exchanged before anything else happens,
    and a step one process could not read is damaged on every process (the others' error names
    the processes that saw the damage), so all decide alike which step to take. One process:
    ``read()``."""
    if jax.process_count() == 1:
        return read()
    from jaxpar.distributed import every_process

    error, verdict = None, 0
    try:
        result = read()
    except CheckpointDamagedError as e:
        error, verdict = e, 1
    except Exception as e:    # noqa: BLE001  (raised below, once the others know)
        error, verdict = e, 2
    verdicts = [int(v) for v in every_process([verdict])[:, 0]]
    if error is not None:
        raise error
    if any(verdicts):
        damaged = [i for i, v in enumerate(verdicts) if v == 1]
        failed = [i for i, v in enumerate(verdicts) if v == 2]
        if damaged:
            raise CheckpointDamagedError(str(directory), step, ValueError(
                f"process(es) {damaged} of {len(verdicts)} could not read their part of it back (see their "
                "messages); every process treats the step alike"))
        raise RuntimeError(f"checkpoint step {step} in {directory}: process(es) {failed} of {len(verdicts)} failed "
                           "reading it (see their messages)")
    return result


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (nothing to wait for in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def from_first_process(values: tuple[int, ...]) -> tuple[int, ...]:
    """Process 0's ``values`` (small ints) on every process; a barrier too (one process: as given)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return tuple(int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32)))
