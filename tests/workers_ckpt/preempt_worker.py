"""Worker for the preemption tests: trains the tiny GPT under data=8 with a checkpoint
directory until ``STEPS``, resuming from the directory; a SIGTERM makes it save at the next
step boundary and exit 0.

    python preempt_worker.py DIR OUT COORDINATOR|- PROCESS_ID STEPS

Appends ``{"step", "loss"}`` lines to ``OUT/rank_I.jsonl`` and touches ``OUT/rank_I.ready``
after its first step.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402


def main(directory, out, coordinator, process_id, steps):
    two = coordinator != "-"
    jax.config.update("jax_num_cpu_devices", 4 if two else 8)
    if two:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id),
                                   initialization_timeout=60)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    trainer = common.gpt_trainer(common.DATA8, global_batch=True, checkpoint_dir=directory)
    log = os.path.join(out, f"rank_{process_id}.jsonl")
    data = common.batches(int(steps))
    while trainer.step_count < int(steps):
        step = trainer.step_count
        loss = float(trainer.step(data[step])["loss"])
        with open(log, "a") as f:
            f.write(json.dumps({"step": step + 1, "loss": loss}) + "\n")
        open(os.path.join(out, f"rank_{process_id}.ready"), "w").close()
        time.sleep(0.3)     # room for the signal to land between steps
    trainer.close()
    if two:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
