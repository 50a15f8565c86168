"""Communication fusion: collective counts from the HLO, compiler options, numerics."""

import math

import jax
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import TINY, assert_close, assert_losses_close, batches, mesh_for, reference, train_gpt
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.optim import compiler_options
from jaxpar.report import collectives


def _all_reduce_buffers(config):
    mesh = mesh_for(config)
    trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(TINY, rngs=nnx.Rngs(0)), config, mesh), optax.adamw(1e-3),
                             loss_fn, config, mesh)
    cols = [c for c in collectives(trainer.lower(batches(1)[0]).compile(), mesh) if c.kind == "all-reduce"]
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.params))
    # XLA's CPU combiner packs everything into tuple all-reduces afterwards (and cannot be
    # tuned on CPU), so count the buffers the all-reduces carry, not the instructions.
    return sum(len(c.shapes) for c in cols), len(jax.tree.leaves(trainer.params)), grad_bytes


def test_hybrid_fusion_buckets_gradients():
    bucket_mb = 0.004
    fused, n_params, grad_bytes = _all_reduce_buffers(
        jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", comm_fusion={"mode": "size", "bucket_mb": bucket_mb}))
    plain, _, _ = _all_reduce_buffers(jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid"))
    bound = math.ceil(grad_bytes / (bucket_mb * 2**20)) + 1          # + the loss
    print(f"all-reduce buffers: fused {fused} (bound {bound}), unfused {plain} ({n_params} parameters + loss)")
    assert fused <= bound
    assert plain == n_params + 1


@pytest.mark.slow  # hybrid fusion numerics are also covered by test_zero (zero2 + fusion)
def test_hybrid_fusion_matches_one_device():
    ref_losses, ref_params = reference(TINY, 2)
    losses, params, _ = train_gpt(jaxpar.ParallelConfig(mesh={"data": 8}, mode="hybrid", comm_fusion="auto"), steps=2)
    assert_losses_close(losses, ref_losses)
    assert_close(params, ref_params)


def test_jit_fusion_sets_combiner_thresholds_per_backend():
    fusion = jaxpar.CommFusionConfig(mode="size", bucket_mb=4)
    gpu = compiler_options(fusion, "gpu")
    assert gpu["xla_gpu_all_reduce_combine_threshold_bytes"] == 4 * 2**20
    assert gpu["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 4 * 2**20
    assert compiler_options(fusion, "cpu") == {}             # CPU's combiner has no such option
    assert compiler_options(jaxpar.CommFusionConfig(mode="auto"), "gpu") == {}
    assert compiler_options(None, "gpu") == {}


def test_comm_fusion_config_loads_and_validates():
    cfg = jaxpar.ParallelConfig.from_dict({"comm_fusion": {"mode": "size", "bucket_mb": 2}, "interleave": 2})
    assert cfg.comm_fusion.bucket_bytes == 2 * 2**20 and cfg.interleave == 2
    assert jaxpar.ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert jaxpar.ParallelConfig(comm_fusion="auto").comm_fusion.mode == "auto"
    with pytest.raises(ValueError, match="comm_fusion.bucket_mb"):
        jaxpar.ParallelConfig(comm_fusion={"bucket_mb": 0})
    with pytest.raises(ValueError, match="interleave"):
        jaxpar.ParallelConfig(interleave=0)
