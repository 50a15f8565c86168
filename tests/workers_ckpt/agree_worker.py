"""Worker of the two-process agreement checks, run under ``jaxpar launch`` (4 CPU devices per
process): every process reaches the same outcome when only one of them meets the fault.

    jaxpar launch --worker-num 2 ... agree_worker.py --out OUT --tag TAG

1. ``rename``: moving checkpoint steps aside fails on process 0 only (its ``os.rename`` refuses):
   every process raises the same error, none waits at a barrier for it.
2. ``damage``: the newest step's files that process 1 wrote (its shards) are garbage: only
   process 1's read fails; ``resume="newest_intact"`` takes the step before on every process.
3. ``evaluate``: a script that only evaluates, with a checkpoint directory; the test sends
   SIGTERM to process 1 alone (after ``OUT/rank_1.ready`` holds its pid): every process saves the
   step and stops before the same batch (``Preempted``, exit 0).

Each process writes what it saw to ``OUT/rank_I.json`` (also when it leaves by ``Preempted``).
"""

import errno
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(out):
    import jaxpar.distributed as dist

    dist.initialize()
    import jax
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    import jaxpar.checkpoint as ckpt

    rank = jax.process_index()
    result = {"processes": jax.process_count()}
    path = os.path.join(out, f"rank_{rank}.json")
    split = {"mesh": {"model": 8}, "rules": {"mlp": "model"}}      # each process holds its own shards
    trainer = common.mlp_trainer(split, global_batch=True)

    # 1. a rename that fails on process 0 only
    renames = os.path.join(out, "rename")
    with ckpt.Checkpointer(renames, keep=None) as saver:
        for _ in range(3):
            common.run(trainer, 1)
            saver.save(trainer.plan, trainer.state, trainer.mesh)
        saver.wait()
        real = os.rename

        def refused(source, target):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), source, None, target)

        if rank == 0:
            os.rename = refused
        try:
            saver.retire_after(1)
            result["rename"] = "no error"
        except OSError as e:
            result["rename"] = str(e)
        finally:
            os.rename = real
    multihost_utils.sync_global_devices("rename checked")

    # 2. the newest step damaged in the files of process 1 only
    damaged = os.path.join(out, "damage")
    with ckpt.Checkpointer(damaged, keep=None) as saver:
        for _ in range(2):
            common.run(trainer, 1)
            saver.save(trainer.plan, trainer.state, trainer.mesh)
    newest = trainer.step_count
    multihost_utils.sync_global_devices("damage saved")
    if rank == 1:      # the chunks of the shards process 1 holds (columns 4..7 of 8) no longer decode
        import tensorstore as ts

        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{damaged}/{newest}/state/"}).result()
        for k in range(4, 8):
            store.write(f"params.up/0.{k}", b"\x28\xb5\x2f\xfd not a zstd frame").result()
    multihost_utils.sync_global_devices("damage done")
    with ckpt.Checkpointer(damaged, resume="newest_intact") as reader:
        try:
            import warnings

            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                _, meta = reader.resume(trainer.state, trainer.mesh)
            result["resumed"] = int(meta["step"])
            result["damage_warnings"] = [str(w.message) for w in seen if "is damaged" in str(w.message)]
        except Exception as e:    # noqa: BLE001  (recorded for the test to show)
            result["resumed"] = f"{type(e).__name__}: {e}"
    result["newest"] = newest
    result["damage_entries"] = sorted(os.listdir(damaged))
    multihost_utils.sync_global_devices("damage checked")

    # 3. evaluation only; SIGTERM to process 1 alone
    evaluator = common.mlp_trainer(split, global_batch=True, checkpoint_dir=os.path.join(out, "evaluate"))
    common.run(evaluator, 2)                # step 2, not saved yet (no save_every)
    batch = common.batches(1)[0]
    result["evaluated"] = 0

    def held_out():
        for i in range(400):
            if i == 3:
                with open(os.path.join(out, f"rank_{rank}.ready"), "w") as f:
                    f.write(str(os.getpid()))
            result["evaluated"] = i
            time.sleep(0.02)
            yield batch

    try:
        evaluator.evaluate(held_out())
        result["evaluate"] = "ended without a stop"
    except SystemExit as stop:
        result["evaluate"] = f"{type(stop).__name__} step {getattr(stop, 'step', None)}"
        raise
    finally:
        with open(path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="")        # marks the test's processes (ps)
    main(parser.parse_args().out)
