"""What the launched slice of the combination matrix runs after its cells, in the same
``jaxpar launch`` (tests/workers/matrix_launch_worker.py; the test: tests/test_matrix.py): the
entries of a job that are not a `matrix` cell, each on every process, each process feeding only
its own rows. Each function returns one JSON-able line ``{"name", ...}`` for process 0 to write;
the test holds it against one process.

- `loader`: a `TokenLoader` per process (each reads only its rows) trains and evaluates;
- `server_rows`: `jaxpar.ps.ServerRows` with one parameter-server worker per process;
- `host_rows`: `jaxpar.ps.HostRows` refused by name (one table per process would diverge);
- `preempt`: a SIGTERM to the last process only, after its first step: every process stops at one
  agreed step (step 3: the last process waits 3 s after the signal, the others wait for it in their
  second step) and saves it (the test restores it on one process and trains on).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

PREEMPT_AFTER = 1     # the last process sends itself SIGTERM after this step (the agreed one comes later)


def run(name: str, fn, *args) -> dict:
    """``fn(*args)``'s line, or ``{"name", "error"}`` (the test names it)."""
    try:
        return {"name": name, **fn(*args)}
    except Exception as e:  # reported by the test with the entry's name
        return {"name": name, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"}


def loader(store: str) -> dict:
    from workers.loader_worker import train

    losses, evaluated = train(store, 3)       # a TokenLoader of this process's rows
    return {"losses": losses, "evaluated": evaluated}


def server_rows(addresses: str) -> dict:
    import jax

    import jaxpar
    from jaxpar import ps
    from jaxpar.distributed import process_rows
    from workers.ps_model import ITEMS, TOKEN, USERS, make_batches, mesh_trainer

    client = ps.connect([USERS, ITEMS], addresses=addresses.split(","), token=TOKEN, timeout=60)
    try:
        if (client.worker, client.workers) != (jax.process_index(), jax.process_count()):
            raise AssertionError(f"worker {client.worker} of {client.workers}, process "
                                 f"{jax.process_index()} of {jax.process_count()}")
        source, trainer = mesh_trainer(client, jaxpar.ParallelConfig(mesh={"data": 8}))
        rows = process_rows(32)           # this process's rows of each batch of 32
        local = [{k: v[rows] for k, v in b.items()} for b in make_batches(STEPS_PS)]
        losses = [h["loss"] for h in trainer.fit(source.prefetching(local, STEPS_PS), STEPS_PS, progress=False)]
        trainer.close()
    finally:
        client.close()
    return {"losses": losses}


STEPS_PS = 10


def host_rows() -> dict:
    from jaxpar.ps import HostEmbedding, HostRows, RowOptimizer

    try:
        HostRows(HostEmbedding("clicks", 16, 4, RowOptimizer(), storage="callback"))
    except ValueError as e:
        return {"refused": str(e)}
    return {"error": "HostRows was not refused in a job of several processes"}


def preempt(directory: str) -> dict:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxpar
    import matrix
    from jaxpar.train import Preempted
    from jaxpar.distributed import process_rows

    cell = matrix.BASE
    services = jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=directory, preemption=True))
    trainer = matrix._trainer(matrix.config_for(cell), matrix.gpt_config(cell), 8, services=services)
    rows, last = process_rows(matrix.BATCH), jax.process_count() - 1
    losses, stopped = [], None
    try:
        for b in matrix._batches():
            losses.append(float(trainer.step({k: v[rows] for k, v in b.items()})["loss"]))
            if jax.process_index() == last and trainer.step_count == PREEMPT_AFTER:
                os.kill(os.getpid(), signal.SIGTERM)       # as a node's agent would, to this process alone
                # JAX's notifier looks for the signal once a second; meanwhile the others wait for this
                # process in their next step's collectives, so the step they agree on is the next but one
                time.sleep(3)
    except Preempted as e:      # raised after the agreed step ran: its loss comes with it
        stopped = e.step
        losses.append(float(e.metrics["loss"]))
    finally:
        trainer.close()
    every = np.asarray(multihost_utils.process_allgather(np.asarray([-1 if stopped is None else stopped], np.int32)))
    return {"stopped": [int(s) for s in every.ravel()], "losses": losses}
