#!/usr/bin/env bash
# The GPU figures issue #30 still lacks, most telling first, in one device call of under ten
# minutes (each step under its own time limit and all within 570 s; every script writes its
# JSON as it goes, so a step cut short keeps what it measured):
#
#   PYTHONPATH=. bash benchmarks/gpu_pending.sh        # results in $OUT, else benchmarks/results/
#
# 1. the 125m rows: offload modes against no offload (the state now arrives as the gradients
#    come; with scanned layers the parameters stream in one layer at a time), the MoE 125m (8 experts, top-2) against its dense twin, opt_state offload with 4
#    micro-batches a step;
# 2. the fp8 preset against bf16 on the 1B shape: tokens/s and the loss after 300 steps (batch 4
#    where the GPU has under 100 GB: both runs live in one process);
# 3. the 1B bf16 step with 8 loss chunks as gpu_probe_h200_profile.json measured it, since the
#    SwiGLU recomputes silu in the backward (jaxpar.ops.swiglu): peak memory, ms, top ops;
# 4. where the fp8 step's time goes: the top device ops of a traced 1B fp8 step.
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
total=570
step() {   # step LIMIT_S SCRIPT ARGS...: one measurement under min(LIMIT_S, the time left); go on either way
    local left=$((total - SECONDS)) limit=$1
    shift
    if [ "$left" -lt 30 ]; then echo "== skipped (${left} s left): python $*"; return; fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    echo "== python $* (limit ${limit} s)"
    timeout -k 5 "$limit" python "$@"
    echo "== exit $? after ${SECONDS} s"
}
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
fp8_batch=8
if [ -n "$memory_mib" ] && [ "$memory_mib" -lt 100000 ]; then fp8_batch=4; fi
step 260 benchmarks/gpu.py --cases "125m-shape: offload modes" "125m-shape scanned: parameters streamed" \
    "125m-shape MoE 8 x top-2" "125m-shape, 4 micro-batches: offload" --budget-s 200 --out "$out/gpu_pending.json"
step 180 benchmarks/fp8.py --steps 300 --batch "$fp8_batch" --out "$out/fp8.json"
step 70 benchmarks/gpu_probe.py --only 1b --loss-chunks 8 --out "$out/probe_bf16.json"
step 80 benchmarks/gpu_probe.py --only 1b --loss-chunks 8 --precision fp8 --out "$out/probe_fp8.json"
