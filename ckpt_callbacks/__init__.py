"""ckpt_callbacks: async, sharded, multi-host checkpointing for JAX training.

Example::

    import jax
    import ckpt_callbacks as cc
    with cc.CheckpointManager("/tmp/run", retention=cc.KeepLast(3)) as mngr:
        mngr.save(1, {"w": jax.numpy.ones(4)})
        mngr.wait_until_finished()
        tree = mngr.restore()          # {'w': array([1., 1., 1., 1.], dtype=float32)}

Integrations live in submodules: `ckpt_callbacks.keras.AsyncCheckpoint` (needs keras) and
`ckpt_callbacks.flax.CheckpointHook`. Importing this package has no side effects.
"""

from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, CheckpointSaveError,
                     ConfigError, CorruptCheckpointError, IncompatibleCheckpointError, InvalidTreeError,
                     StorageUnavailableError)
from .manager import CheckpointManager
from .retention import (KeepBest, KeepEvery, KeepEveryNSeconds, KeepLast, KeepSteps, Policy, StepInfo,
                        retention_from_config)
from .writing import SaveStats

__all__ = [
    "CheckpointManager",
    "KeepLast", "KeepEvery", "KeepBest", "KeepSteps", "KeepEveryNSeconds", "Policy", "StepInfo",
    "retention_from_config", "SaveStats",
    "CheckpointError", "CheckpointNotFoundError", "IncompatibleCheckpointError", "CorruptCheckpointError",
    "CheckpointSaveError", "CheckpointLockedError", "ConfigError", "InvalidTreeError", "StorageUnavailableError",
]

__version__ = "0.1.0"
