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

import errno
import re

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompatibleCheckpointError",
    "CorruptCheckpointError",
    "CheckpointSaveError",
    "CheckpointLockedError",
    "ConfigError",
    "InvalidTreeError",
    "StorageUnavailableError",
    "storage_unavailable",
    "read_failure",
]


class CheckpointError(Exception):
    """Base class of every error raised by ckpt_callbacks."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for (empty directory, unknown step)."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint and the restore target disagree (structure, shape, dtype, format version).

    `mismatches` lists `(key_path, in_checkpoint, in_target)` triples; the message tells them all
    (a container against a leaf, or keys of other kinds at one path, in one line).
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


class StorageUnavailableError(CheckpointError, OSError):
    """The storage could not be reached or refused access (after the configured retries).

    Says nothing about the checkpoint: no step is considered damaged because of it, so
    ``restore(fallback=True)`` does not skip to an older step. Retry once the endpoint, the
    credentials or the network are back.
    """


# errno values that describe the storage or this machine, not the stored bytes
_UNAVAILABLE_ERRNO = {errno.EACCES, errno.EPERM, errno.ETIMEDOUT, errno.ENOTCONN, errno.ECONNREFUSED,
                      errno.ECONNRESET, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH,
                      errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
# tensorstore status codes of the same kind (its messages start with the code)
_OS_ERROR_RE = re.compile(r"OS error (\d+)")
_UNAVAILABLE_STATUS = ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED",
                       "RESOURCE_EXHAUSTED", "CANCELLED")


def storage_unavailable(e: BaseException) -> bool:
    """Whether the failed read `e` (an OSError, or a tensorstore error) says the storage could not be
    reached or refused access, rather than that the stored bytes are wrong or missing. Restore uses
    it to raise `StorageUnavailableError` instead of `CorruptCheckpointError`."""
    if isinstance(e, StorageUnavailableError):
        return True
    if isinstance(e, OSError):
        return e.errno in _UNAVAILABLE_ERRNO or isinstance(e, (TimeoutError, ConnectionError, PermissionError))
    msg = str(e)
    if msg.split(":", 1)[0].strip() in _UNAVAILABLE_STATUS:
        return True
    # tensorstore's file kvstore maps errno to a status (ENOTCONN of a dead FUSE mount becomes
    # FAILED_PRECONDITION) and keeps the number in the text
    os_error = _OS_ERROR_RE.search(msg)
    return bool(os_error) and int(os_error.group(1)) in _UNAVAILABLE_ERRNO


def read_failure(e: BaseException, where: str, what: str, detail: str, damaged: str) -> CheckpointError:
    """The error to raise when reading `what` of the leaf at key path `where` failed with `e`
    (`detail`: its message, redacted where it may name an endpoint): `StorageUnavailableError` when
    `storage_unavailable(e)`, else `CorruptCheckpointError` with the message `damaged`."""
    if storage_unavailable(e):
        return StorageUnavailableError(f"{where}: reading {what} failed: the storage could not be reached or "
                                       f"refused access ({detail}). The step is not known to be damaged: check "
                                       f"the endpoint, credentials, permissions and network, then retry.")
    return CorruptCheckpointError(damaged, where)


_FULL = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]")


def space_hint(text: str, where: str) -> str:
    """What to do, where `text` (an error's message) says the file system is full or read-only;
    "" otherwise. The errno's words are all a failure gathered from another process carries."""
    if any(s in text for s in _FULL):
        return (f". The file system holding {where} is full (or over quota): free space there, then save again; "
                f"steps committed before are intact")
    if "Read-only file system" in text or "[Errno 30]" in text:
        return f". The file system holding {where} is read-only: remount it writable or choose another directory"
    return ""
