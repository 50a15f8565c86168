"""Compiles a bf16 GPT step under ZeRO 3 with XLA's program dumped after SPMD partitioning, and
prints the dtype and shape of each all-gather in the training step's program (before XLA:CPU
computes bf16 in f32, which rewrites them), as JSON lines: tests/test_auto_compile.py compares
them with what the cost model prices ZeRO 3's gathers in, and how often.
Usage: zero3_gathers.py DUMP_DIR REMAT"""
import json
import os
import re
import sys

dump, remat = sys.argv[1], sys.argv[2]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                           " --xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=flat_step").strip()
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"      # compile here, so the dump is written
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402,F401  8 CPU devices, the suite's flags
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from helpers import batches, mesh_for  # noqa: E402
from jaxpar.models.gpt import GPT, loss_fn  # noqa: E402
from test_auto_compile import SCANNED  # noqa: E402

config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", precision="bf16", remat=remat,
                               optimizer=jaxpar.OptimizerConfig(level=3, threshold_kb=0))
trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(SCANNED, rngs=nnx.Rngs(0)), config, mesh_for(config)),
                         optax.adamw(1e-3), loss_fn, config, mesh_for(config))
trainer.lower(batches(1, batch=64)[0]).compile()
steps = [name for name in sorted(os.listdir(dump)) if "flat_step" in name and "after_spmd-partitioning" in name]
if len(steps) != 1:
    sys.exit(f"expected one dump of the training step's partitioned program, found {steps}")
text = open(os.path.join(dump, steps[0])).read()
for dtype, shape in re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", text):
    print(json.dumps({"dtype": dtype, "shape": [int(n) for n in shape.split(",") if n]}))
