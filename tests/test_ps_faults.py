"""Parameter servers across processes: a SIGKILLed server restarts from its shard checkpoint and
write-ahead log and sync training goes on equal to the run without the kill; a worker group
restored from its orbax checkpoint of step s brings the servers back to s; two worker processes
of one jax.distributed job train equal to one device."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxpar import ps
from workers.ps_model import FIELDS, ITEMS, TOKEN, USERS, Tower, loss_fn, make_batches, reference
from workers.ps_servers import ROOT, Servers, free_port

WORKER = os.path.join(ROOT, "tests", "workers", "ps_worker.py")


def _trainer(servers, seed=0):
    client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=60,
                        worker=0, workers=1)
    return ps.SparseTrainer(client, Tower(nnx.Rngs(seed)), optax.sgd(0.05), loss_fn, FIELDS)


def test_server_sigkill_and_worker_restore_keep_sync_training_exact(tmp_path, tag):
    servers = Servers(tmp_path, tag, count=2, token=TOKEN, every=3)
    try:
        batches = make_batches(20)
        trainer = _trainer(servers)

        def feed():
            for i, batch in enumerate(batches[:10]):
                if i == 5:  # mid-training: step 4's push and step 5's pull go to a dead server
                    servers.kill(1)
                    servers.start(1)
                yield batch

        losses = [h["loss"] for h in trainer.fit(feed())]
        assert trainer.client.stats()["server_restarts"] == 1
        # The workers' orbax checkpoint of step 10, aligned with the servers' snapshot of step 10.
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "worker" / "10", trainer.save())
        checkpointer.wait_until_finished()
        trainer.fit(batches[10:14])  # progress the worker group loses when it is killed
        trainer.client.close()

        restarted = _trainer(servers, seed=1)  # another init: the restore must replace it
        target = jax.tree.map(np.asarray, restarted.save() | {"step": 0})
        restarted.restore(checkpointer.restore(tmp_path / "worker" / "10", target))
        losses += [h["loss"] for h in restarted.fit(batches[10:])]
        want_losses, want = reference(20)
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-6)
        rows = restarted.client.pull("items", np.arange(ITEMS.rows), step=20)
        np.testing.assert_allclose(rows, want["items"], rtol=0, atol=1e-6)
        restarted.client.close()
    finally:
        codes = servers.stop()
    assert codes == [0, 0]


@pytest.mark.multiprocess
def test_two_worker_processes_sync_equal_in_process(tmp_path, tag):
    """A 2-process jax.distributed job (2 CPU devices each): dense parameters data parallel over
    the 4 devices, each process pulling and pushing the rows of its half of the batch."""
    servers = Servers(tmp_path, tag, count=2, token=TOKEN)
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAXPAR_PS_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, WORKER, "--process", str(i), "--coordinator", coordinator,
                               "--addresses", ",".join(servers.addresses), "--out", str(tmp_path / f"w{i}.json"),
                               "--tag", tag], env=env, start_new_session=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stopped = servers.stop()
    assert codes == [0, 0] and stopped == [0, 0]
    want_losses, _ = reference(20)
    for i in range(2):
        got = json.loads((tmp_path / f"w{i}.json").read_text())["losses"]
        np.testing.assert_allclose(got, want_losses, rtol=0, atol=1e-6)
