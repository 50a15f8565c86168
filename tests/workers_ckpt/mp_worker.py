"""Worker for the two-process checkpoint test (4 CPU devices per process, gloo collectives).

Trains the tiny GPT 2 steps under data=2 x model=4 (the mesh spans both processes), saves
(each process writes its own shards, one commit), restores into a data=8 trainer in the same
two processes, and writes checksums of the saved and the restored state to ``OUT/rank_I.json``.

    python mp_worker.py DIR OUT COORDINATOR PROCESS_ID
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402


def main(directory, out, coordinator, process_id):
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id),
                               initialization_timeout=60)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    import jaxpar.checkpoint as ckpt

    trainer = common.gpt_trainer(common.MEGATRON_2x4, global_batch=True)
    losses = common.run(trainer, 2)
    with ckpt.Checkpointer(directory) as saver:
        trainer.data_state = {"epoch": 0}
        saver.save(trainer.plan, trainer.state, trainer.mesh)
        saver.wait()
    saved = common.sums(trainer)
    other = common.gpt_trainer(common.DATA8, global_batch=True)
    meta = ckpt.restore(other, directory)
    result = {"losses": losses, "saved": saved, "restored": common.sums(other), "meta": meta,
              "processes": jax.process_count(), "devices": jax.device_count()}
    with open(os.path.join(out, f"rank_{process_id}.json"), "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
