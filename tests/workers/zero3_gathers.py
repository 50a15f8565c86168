"""Compiles a bf16 GPT step under ZeRO 3 with XLA's program dumped after SPMD partitioning, and
prints the dtype and shape of each all-gather in it (before XLA:CPU computes bf16 in f32, which
rewrites them), as JSON lines: tests/test_auto_compile.py compares them with what the cost
model prices ZeRO 3's gathers in. Usage: zero3_gathers.py DUMP_DIR"""
import json
import os
import re
import sys

dump = sys.argv[1]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                           " --xla_dump_hlo_pass_re=spmd-partitioning").strip()
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"      # compile here, so the dump is written
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402,F401  8 CPU devices, the suite's flags
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from helpers import batches, mesh_for  # noqa: E402
from jaxpar.models.gpt import GPT, loss_fn  # noqa: E402
from test_auto_compile import SCANNED  # noqa: E402

config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data", precision="bf16",
                               optimizer=jaxpar.OptimizerConfig(level=3, threshold_kb=0))
trainer = jaxpar.Trainer(jaxpar.init(lambda: GPT(SCANNED, rngs=nnx.Rngs(0)), config, mesh_for(config)),
                         optax.adamw(1e-3), loss_fn, config, mesh_for(config))
trainer.lower(batches(1, batch=64)[0]).compile()
for name in sorted(os.listdir(dump)):
    if "after_spmd-partitioning" in name:     # the step's program (the only one with all-gathers)
        text = open(os.path.join(dump, name)).read()
        for dtype, shape in re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", text):
            print(json.dumps({"dtype": dtype, "shape": [int(n) for n in shape.split(",") if n]}))
