"""Distributed checkpoints that reshard: save in one layout, restore in any other.

    >>> jaxpar.checkpoint.save(trainer, "ckpt")              # whole state, step = trainer.step_count
    >>> jaxpar.checkpoint.restore(other_trainer, "ckpt")      # any mesh / ZeRO level / device count
    >>> load_strategy("ckpt")["mesh"]                         # the layout it was saved under

See ``docs/checkpoint.md``; ``jaxpar ckpt {inspect,transform,merge,import-hf,export-hf}`` (``python -m jaxpar.cli ckpt``) works offline.
"""

from jaxpar.deprecation import module_getattr
from jaxpar.checkpoint.damage import CheckpointDamagedError, CheckpointWriteError
from jaxpar.checkpoint.manager import (Checkpointer, latest_step, restore, restore_rows, restore_state, save,
                                       save_state)
from jaxpar.checkpoint.offline import format_inspect, inspect, load_strategy, merge, leaf_specs, transform
from jaxpar.checkpoint.state import CheckpointMismatchError
from jaxpar.checkpoint.strategy import strategy_config, strategy_specs

__all__ = [
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "Checkpointer",
    "format_inspect",
    "inspect",
    "latest_step",
    "load_strategy",
    "merge",
    "leaf_specs",
    "restore",
    "restore_rows",
    "restore_state",
    "save",
    "save_state",
    "strategy_config",
    "strategy_specs",
    "transform",
]

__getattr__ = module_getattr(__name__)   # former names (CHANGELOG.md): warn and forward, or say what replaced them
