"""Parameter servers across processes: a SIGKILLed server restarts from its shard checkpoint and
write-ahead log and sync training goes on equal to the run without the kill; a worker group
resumed from its Trainer checkpoint of step s brings the servers back to s; two worker processes
of one jax.distributed job train equal to one device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar import ps
from workers.ps_model import ITEMS, TOKEN, USERS, make_batches, reference, trainer_for
from workers.ps_servers import ROOT, Servers, free_port

WORKER = os.path.join(ROOT, "tests", "workers", "ps_worker.py")


def _trainer(servers, checkpoints, seed=0):
    client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=60,
                        worker=0, workers=1)
    return client, trainer_for(client, seed=seed, checkpoint_dir=str(checkpoints))[1]


def test_server_sigkill_and_worker_restore_keep_sync_training_exact(tmp_path, tag):
    servers = Servers(tmp_path, tag, count=2, token=TOKEN, every=3)
    try:
        batches = make_batches(20)
        client, trainer = _trainer(servers, tmp_path / "worker")

        def feed():
            for i, batch in enumerate(batches[:10]):
                if i == 5:  # mid-training: step 4's push and step 5's pull go to a dead server
                    servers.kill(1)
                    servers.start(1)
                yield batch

        losses = [h["loss"] for h in trainer.fit(feed(), 10, progress=False)]
        assert client.stats()["server_restarts"] == 1
        # The worker's checkpoint of step 10, with the servers' snapshot of step 10.
        assert trainer.save() == 10
        trainer.fit(batches[10:14], 4, progress=False)  # progress the worker group loses when it is killed
        trainer.close()
        client.close()

        client, restarted = _trainer(servers, tmp_path / "worker", seed=1)  # another init: the resume replaces it
        assert restarted.step_count == 10
        losses += [h["loss"] for h in restarted.fit(batches[10:], 10, progress=False)]
        want_losses, want = reference(20)
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-6)
        rows = client.pull("items", np.arange(ITEMS.rows), step=20)
        np.testing.assert_allclose(rows, want["items"], rtol=0, atol=1e-6)
        restarted.close()
        client.close()
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
