#!/bin/bash
# Runs once per node under srun (examples/slurm/train.sbatch): starts this node's jaxpar
# workers with `jaxpar launch`, taking the node's rank, the job's size and the coordinator
# (the step's first node) from the variables srun sets.
#
#   srun --ntasks-per-node=1 bash examples/slurm/launch_node.sh SCRIPT [ARGS...]
#
# WORKERS_PER_NODE, MASTER_PORT, LOG_DIR and LAUNCH_OPTIONS: see train.sbatch.
set -euo pipefail

me=launch_node.sh
for name in SLURM_JOB_ID SLURM_NODEID SLURM_STEP_NODELIST SLURM_STEP_NUM_NODES SLURM_STEP_NUM_TASKS; do
    if [ -z "${!name:-}" ]; then
        echo "$me: $name is not set: run this under srun, one task per node" \
             "(srun --ntasks-per-node=1 bash $0 SCRIPT ARGS), e.g. from train.sbatch." >&2
        exit 2
    fi
done
if [ "$SLURM_STEP_NUM_TASKS" != "$SLURM_STEP_NUM_NODES" ]; then
    echo "$me: SLURM_STEP_NUM_TASKS=$SLURM_STEP_NUM_TASKS tasks on" \
         "SLURM_STEP_NUM_NODES=$SLURM_STEP_NUM_NODES nodes: run one task per node" \
         "(srun --ntasks-per-node=1); jaxpar launch starts the node's processes itself" \
         "(WORKERS_PER_NODE)." >&2
    exit 2
fi
if [ $# -eq 0 ]; then
    echo "$me: no training script given: srun ... bash $0 SCRIPT [ARGS...]" >&2
    exit 2
fi

per_node=${WORKERS_PER_NODE:-1}
# The coordinator runs on node 0 of the step: the first host of the node list, read by the
# parser jaxpar's own SLURM detection uses (scontrol is not needed on the compute nodes).
master=$(python -c 'import os, sys
from jaxpar.launch.sources import first_host
try:
    print(first_host(os.environ["SLURM_STEP_NODELIST"]))
except ValueError as err:
    sys.exit(f"launch_node.sh: {err}")')
port=${MASTER_PORT:-$((SLURM_JOB_ID % 4096 + 61440))}

# LAUNCH_OPTIONS is split into words on purpose (several options in one variable).
# shellcheck disable=SC2086
exec jaxpar launch \
    --worker-num $((SLURM_STEP_NUM_NODES * per_node)) --local-worker-num "$per_node" \
    --node-rank "$SLURM_NODEID" --master-addr "$master" --master-port "$port" \
    --log-dir "${LOG_DIR:-jaxpar_logs/$SLURM_JOB_ID}" ${LAUNCH_OPTIONS:-} "$@"
