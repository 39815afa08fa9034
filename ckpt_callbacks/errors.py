"""The exception hierarchy. Every error this package raises on purpose is a `CheckpointError`.

Example::

    import ckpt_callbacks as cc
    try:
        cc.CheckpointManager("/tmp/run").restore()
    except cc.CheckpointNotFoundError:
        ...  # nothing committed yet: start from scratch

Messages say what went wrong, where (the key path), what was found, what was expected, and how
to fix it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompatibleCheckpointError",
    "CorruptCheckpointError",
    "CheckpointSaveError",
    "CheckpointLockedError",
    "ConfigError",
    "InvalidTreeError",
]


class CheckpointError(Exception):
    """Base class of every error raised by ckpt_callbacks."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for (empty directory, unknown step)."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint and the restore target disagree (structure, shape, dtype, format version).

    `mismatches` lists `(key_path, in_checkpoint, in_target)` triples; the message names them all.
    """

    def __init__(self, message: str, mismatches: list[tuple[str, str, str]] | None = None):
        super().__init__(message)
        self.mismatches = list(mismatches or [])


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match what the manifest promises (checksum, size, missing file).

    `key_path` names the damaged leaf when one is known (None for the manifest itself).
    """

    def __init__(self, message: str, key_path: str | None = None):
        super().__init__(message)
        self.key_path = key_path


class CheckpointSaveError(CheckpointError):
    """A save failed; nothing of it was committed.

    `failures` maps process index to a one-line description of what failed there.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class CheckpointLockedError(CheckpointError):
    """Another live writer owns the checkpoint directory (its host and pid are in the message)."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is unknown or invalid; the message names the key."""


class InvalidTreeError(CheckpointError, TypeError):
    """A leaf or key of the tree passed to save cannot be saved; the message names its key path."""
