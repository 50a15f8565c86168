"""Batches on the mesh and the data that fills them.

How batches lie on the mesh is one value, `BatchLayout` (``jaxpar/data/layout.py``): which mesh
axes split each leaf's rows (``dataset_strategy``, else the batch axes), the context split, the
parts a training step and a pipeline cut a batch into, and the rows each process feeds in a run
of several processes (``jaxpar/data/processes.py``: checked against the batch shards its own
devices hold, never against the devices of the whole mesh). A ``TrainPlan`` holds it
(``plan.batch_layout``); the functions below are its functional forms.

Token datasets: `TokenStore` (``prepare``, ``verify_store``), `TokenLoader` (``LoaderProcess``:
whose rows it reads), tokenizers.
"""

from jaxpar.data.layout import (BatchLayout, batch_axes, batch_shardings, batch_specs, check_rows, leaf_spec,
                                part_shapes, place_batch, process_view, split_rows, step_parts)
from jaxpar.data.processes import (ProcessShards, check_process_rows, check_processes_agree, check_processes_same,
                                   mesh_process_shards, process_shards)
# Token datasets (after the batch layout, which jaxpar.plan imports without them).
from jaxpar.data.loader import LoaderProcess, TokenLoader  # noqa: E402
from jaxpar.data.store import ShardDamage, TokenStore, prepare, verify_store  # noqa: E402
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_tokenizer  # noqa: E402

__all__ = ["BatchLayout", "ByteTokenizer", "HFTokenizer", "LoaderProcess", "ProcessShards", "ShardDamage",
           "TokenLoader", "TokenStore", "batch_axes", "batch_shardings", "batch_specs", "check_process_rows",
           "check_processes_agree", "check_processes_same", "check_rows", "leaf_spec", "load_tokenizer", "mesh_process_shards", "part_shapes",
           "place_batch", "prepare", "process_shards", "process_view", "split_rows", "step_parts", "train_tokenizer", "verify_store"]
