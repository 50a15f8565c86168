"""Test worker for ``--worker-restarts``: records (rank, restart) in ``--out``; rank 1 fails with
status 3 in the first ``--fail`` runs of the group, while rank 0 waits to be stopped; a run
past them ends with status 0 on every rank. Standard library only: no JAX to start."""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--fail", type=int, required=True)
p.add_argument("--tag", default="")
args = p.parse_args()
rank, restart = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_WORKER_RESTART"])
with open(os.path.join(args.out, f"{rank}.{restart}"), "w") as f:
    f.write(str(restart))
if restart < args.fail:
    if rank == 1:
        sys.exit(3)
    time.sleep(60)  # the launcher stops it when rank 1 fails
