#!/usr/bin/env bash
# The GPU figures issue #30 still lacks, most telling first, in one device call of under ten
# minutes (each step under its own time limit, 520 s in all; every script writes its JSON as it goes):
#
#   PYTHONPATH=. bash benchmarks/gpu_pending.sh        # results in $OUT, else benchmarks/results/
#
# 1. the 125m rows: offload modes against no offload (the state now arrives after the
#    gradients), the MoE 125m (8 experts, top-2) against its dense twin, opt_state offload with
#    4 micro-batches a step;
# 2. the fp8 preset against bf16 on the 1B shape: tokens/s and the loss after 300 steps (batch 4
#    where the GPU has under 100 GB: both runs live in one process);
# 3. where the fp8 step's time goes: the top device ops of a traced 1B fp8 step.
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
step() {   # step LIMIT_S SCRIPT ARGS...: run one measurement under a time limit, go on either way
    local limit=$1
    shift
    echo "== python $* (limit ${limit} s)"
    timeout -k 10 "$limit" python "$@"
    echo "== exit $?"
}
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
fp8_batch=8
if [ -n "$memory_mib" ] && [ "$memory_mib" -lt 100000 ]; then fp8_batch=4; fi
step 240 benchmarks/gpu.py --cases "125m-shape: offload modes" "125m-shape MoE 8 x top-2" \
    "125m-shape, 4 micro-batches: offload" --budget-s 180 --out "$out/gpu_pending.json"
step 200 benchmarks/fp8.py --steps 300 --batch "$fp8_batch" --out "$out/fp8.json"
step 80 benchmarks/gpu_probe.py --only 1b --loss-chunks 8 --precision fp8 --out "$out/probe_fp8.json"
