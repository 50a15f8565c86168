"""A collective that XLA places inside a pipeline stage's op is refused before the program runs.

The executor's per-tick ``lax.switch`` sends the devices of each stage into their own op's branch; a
collective in a branch that devices of other stages must join (any collective-permute on XLA:CPU,
any group spanning stages) hangs the program or aborts the process. The Trainer compiles the step,
reads it (`jaxpar.report.stage_collectives`) and raises a ValueError naming the stage, the
parameter and the mesh axis instead of running it.
"""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.report.stage_collectives import check_stage_collectives, stage_collectives

WORKER = os.path.join(os.path.dirname(__file__), "workers", "fused_qkv_worker.py")

LABEL_F = "pipeline_op(F;stages=0;virtual=0)"
LABEL_B = "pipeline_op(B+loss;stages=1;virtual=1)"
HLO = """HloModule m, num_partitions=4

FileNames
1 "/home/u/model.py"
2 "/work/jaxpar/pipeline/model.py"

FunctionNames
1 "Block.__call__"
2 "one"

FileLocations
1 {file_name_id=2 function_name_id=2 line=116 end_line=116 column=1 end_column=1}
2 {file_name_id=1 function_name_id=1 line=53 end_line=53 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}
%fused (p: f32[2]) -> f32[2] {
  ROOT %ar4 = f32[2]{0} all-reduce(%p), channel_id=4, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add, metadata={op_name="jit(f)/cond/branch_1_fun/LABEL_B/psum"}
}
%branch_0 (x: f32[2]) -> f32[2] {
  %ar1 = f32[2]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="jit(f)/cond/branch_0_fun/LABEL_F/dot"}
  ROOT %cp = f32[2]{0} collective-permute(%ar1), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}, metadata={op_name="jit(f)/cond/branch_0_fun/LABEL_F/split" stack_frame_id=2}
}
%branch_1 (x: f32[2]) -> f32[2] {
  ROOT %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/cond/branch_1_fun/LABEL_B/mul"}
}
%user_0 (x: f32[2]) -> f32[2] {
  ROOT %cp9 = f32[2]{0} collective-permute(%x), channel_id=9, source_target_pairs={{0,2},{2,0}}
}
%user_1 (x: f32[2]) -> f32[2] {
  ROOT %n = f32[2]{0} negate(%x)
}
ENTRY %main (i: s32[], x: f32[2]) -> f32[2] {
  %outside = f32[2]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,2},{2,0}}
  %mine = f32[2]{0} conditional(%i, %outside), branch_computations={%branch_0, %branch_1}
  ROOT %theirs = f32[2]{0} conditional(%i, %mine), branch_computations={%user_0, %user_1}
}
""".replace("LABEL_F", LABEL_F).replace("LABEL_B", LABEL_B)


def _mesh():
    # devices 0, 1 on stage 0, devices 2, 3 on stage 1; 'model' pairs 0-1 and 2-3
    return jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "model"))


def test_the_collectives_a_stage_op_must_not_hold():
    found = stage_collectives(HLO, _mesh())
    # the permute in the forward's branch and the all-reduce across stages in what the backward's branch
    # calls; not the all-reduce within a stage, the permute outside, nor a conditional of other code
    assert sorted(f.collective.name for f in found) == ["ar4", "cp"], found
    cp = next(f for f in found if f.collective.name == "cp")
    assert cp.branch == {"op": "F", "embed": False, "loss": False, "stages": (0,), "virtual": (0,)}
    assert cp.collective.mesh_axes == ("model",)
    assert cp.frames == (("/home/u/model.py", 53, "Block.__call__"), ("/work/jaxpar/pipeline/model.py", 116, "one"))
    ar = next(f for f in found if f.collective.name == "ar4")
    assert ar.branch["op"] == "B" and ar.branch["loss"] and "more than one pipeline stage" in ar.reason


def test_the_refusal_names_the_stage_the_axis_and_the_line():
    with pytest.raises(ValueError, match=r"forward op \(F\) of pipeline stage 0 \(virtual stage 0\) holds a "
                                         r"collective-permute over mesh axis 'model' at /home/u/model.py:53 "
                                         r"\(Block.__call__\).*1 more such collective.*separate q/k/v"):
        check_stage_collectives(HLO, _mesh())
    clean = HLO.replace("collective-permute(%ar1)", "negate(%ar1)").replace("[2,2]<=[2,2]T(1,0)", "{{0,1},{2,3}}")
    check_stage_collectives(clean, _mesh())   # nothing left to refuse


def test_a_collective_over_the_pipe_axis_alone_is_named_a_cross_stage_collective():
    # the all-reduce over {0, 2}, {1, 3} (the stages, 'pipe') is the only one left in a branch
    only_pipe = HLO.replace("collective-permute(%ar1)", "negate(%ar1)")
    with pytest.raises(ValueError, match=r"backward op \(B with the loss\) of pipeline stage 1 \(virtual stage 1\) "
                                         r"holds an all-reduce between pipeline stages \(mesh axis 'pipe'\).*"
                                         r"cross-stage collective inside a stage's op.*keep values that cross "
                                         r"stages out of the stage function") as info:
        check_stage_collectives(only_pipe, _mesh())
    assert "over mesh axis" not in str(info.value) and "q, k, v" not in str(info.value)
    assert "shard boundaries" not in str(info.value)


def test_compile_step_refuses_what_the_trainer_refuses():
    # jaxpar plan's and the job search's dry run (compile_step) compile the same step: refused alike,
    # without running it, naming the stage, the axis and the model's line
    import jaxpar
    from jaxpar.report.stage_collectives import StageCollectiveError
    from jaxpar.train import compile_step
    from workers.fused_qkv_worker import LM, Shape, pipeline_loss
    from flax import nnx

    config = jaxpar.ParallelConfig(
        mesh={"pipe": 2, "data": 2, "model": 2}, pipeline={"stages": 2, "microbatches": 2, "schedule": "1f1b"},
        rules={"layers": "pipe", "batch": "data", "vocab": None, "embed": None, "heads": "model", "mlp": "model"})
    tokens = np.random.default_rng(0).integers(0, 16, size=(8, 9), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    with pytest.raises(StageCollectiveError, match=r"pipeline stage \d.*mesh axis 'model' at .*fused_qkv_worker.py:"):
        compile_step(lambda: LM(Shape(), nnx.Rngs(0)), pipeline_loss(), batch, config)


def test_the_job_search_rules_out_a_candidate_its_dry_run_refuses():
    from jaxpar.auto import JobSearchSpace, search_job
    from jaxpar.models.gpt import GPT, GPTConfig, loss_fn
    from jaxpar.report.stage_collectives import StageCollectiveError
    from jaxpar.train import compile_step
    from flax import nnx

    calls = []

    def dry_run(*args):
        calls.append(args[3])
        if len(calls) == 1:
            raise StageCollectiveError("pipeline: the forward op (F) of pipeline stage 0 holds a collective-permute")
        return compile_step(*args)

    cfg = GPTConfig(vocab_size=16, seq_len=8, embed=16, heads=2, mlp=32, layers=2)
    tokens = np.random.default_rng(0).integers(0, 16, size=(8, 9), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    space = JobSearchSpace(devices=8, memory_budget=1e12, meshes=[{"data": 8}, {"data": 4, "model": 2}])
    job = search_job(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn, batch, space, dry_run=dry_run)
    assert len(calls) == 2 and job.config == calls[1] and job.dry_run["fits"]
    assert any("refused by its dry run" in o.verdict for o in job.candidates)
    with pytest.raises(ValueError, match=r"every option that fits .* was refused by its dry run; the first: .*"
                                         r"pipeline stage 0"):
        search_job(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn, batch, dataclasses.replace(space, meshes=[{"data": 8}]),
                   dry_run=lambda *a: (_ for _ in ()).throw(StageCollectiveError("pipeline stage 0")))


def _worker(*args) -> dict:
    proc = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("schedule,what", [("1f1b", "train"), ("zb-v", "train"), ("interleaved", "evaluate")])
def test_a_fused_qkv_split_off_shard_boundaries_is_refused_before_it_runs(schedule, what):
    # q, k, v (16 columns each) of a [16, 48] kernel split over model=2 (24 columns a shard): slicing
    # them out is a collective-permute inside the stage's op. Without the check the process aborts
    # (XLA:CPU's rendezvous: 'Expected 8 threads to join the rendezvous, but only 4 of them arrived').
    out = _worker(schedule, what)
    assert "refused" in out, out
    message = out["refused"]
    assert "pipeline stage" in message and "virtual stage" in message
    assert "['qkv']['kernel']" in message and "'model'" in message
    assert "fused_qkv_worker.py:" in message and "separate q/k/v" in message


def test_the_same_model_with_its_projection_whole_trains():
    out = _worker("1f1b", "train", "heads=None")
    assert "losses" in out and all(np.isfinite(out["losses"])), out
