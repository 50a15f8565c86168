"""The XLA:CPU flags the test suite compiles with (tests/conftest.py sets them before JAX starts;
tests/workers/matrix_costs.py times the matrix under the same ones).

The suite compiles hundreds of small programs and runs each for a few steps: the machine
code's quality buys nothing here, its compile time is most of the suite's. So LLVM optimises
at -O0 (its passes were about 45 % of each compile's CPU time); XLA:CPU emits fused loops with
its classic element-wise emitters instead of its MLIR fusion emitters (a third less backend
compile time, with the same run time and temp bytes); and it emits each program's LLVM module
whole instead of splitting it for parallel code generation: the suite's two workers keep both
cores busy, so the split's threads find no idle core and the split itself is work (``llvm::
SplitModule`` was 4 % of a pipelined matrix cell's profile). `python benchmarks/suite_flags.py`
measures each set on three of the matrix's steps: with a second core idle the whole module
compiles in the same time as the split one (3.53 s against 3.51 s,
benchmarks/results/suite_flags.json); with one core kept busy, as in the suite, in 7 % less
(4.25 s against 4.59 s; ``--busy``, benchmarks/results/suite_flags_busy.json). The HLO passes — sharding propagation, the SPMD
partitioner, collectives — run as in production; only the machine code is made another way.
"""

FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
         "xla_cpu_parallel_codegen_split_count": "1"}


def xla_flags(existing: str = "") -> str:
    """``existing`` (an ``XLA_FLAGS`` value) with the suite's flags it does not set itself."""
    return " ".join([existing] + [f"--{k}={v}" for k, v in FLAGS.items() if k not in existing]).strip()
