"""The error hierarchy and how a failed read is classified: damaged data, or unavailable storage."""

import errno

import pytest

import ckpt_callbacks as cc
from ckpt_callbacks.errors import read_failure, storage_unavailable


def test_hierarchy_and_builtin_bases():
    for cls in (cc.CheckpointNotFoundError, cc.IncompatibleCheckpointError, cc.CorruptCheckpointError,
                cc.CheckpointSaveError, cc.CheckpointLockedError, cc.ConfigError, cc.InvalidTreeError,
                cc.StorageUnavailableError):
        assert issubclass(cls, cc.CheckpointError)
    assert issubclass(cc.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(cc.IncompatibleCheckpointError, ValueError)
    assert issubclass(cc.StorageUnavailableError, OSError)
    assert not issubclass(cc.StorageUnavailableError, cc.CorruptCheckpointError)


@pytest.mark.parametrize("e,expected", [
    (OSError(errno.EACCES, "Permission denied"), True),
    (PermissionError(errno.EPERM, "Operation not permitted"), True),
    (OSError(errno.ESTALE, "Stale file handle"), True),
    (TimeoutError("timed out"), True),
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
    (OSError(errno.EMFILE, "Too many open files"), True),
    (OSError(errno.EIO, "Input/output error"), False),
    (FileNotFoundError(errno.ENOENT, "No such file"), False),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), False),
    (ValueError("ABORTED: All 1 retry attempts failed: CURL error Could not connect to server"), True),
    (ValueError("UNAVAILABLE: Failed to connect"), True),
    (ValueError("PERMISSION_DENIED: Error reading \"x\": HTTP 403"), True),
    (ValueError("DEADLINE_EXCEEDED: read timed out"), True),
    (ValueError("DATA_LOSS: Error reading \"c/0/0\": Digest mismatch"), False),
    (ValueError("FAILED_PRECONDITION: Error reading \"c/0/0\": Not enough data"), False),
    (ValueError("NOT_FOUND: chunk {0, 0} stored at \"c/0/0\" is missing"), False),
    (ValueError("garbage that mentions UNAVAILABLE: later"), False),
    (ValueError("FAILED_PRECONDITION: Error reading local file \"/mnt/gcs/c/0\": [OS error 107: "
                "Transport endpoint is not connected]"), True),   # a dead FUSE mount
    (ValueError("FAILED_PRECONDITION: Error reading local file \"/x/c/0\": [OS error 5: Input/output error]"),
     False),
    (cc.StorageUnavailableError("s3://b/: list failed"), True),
    (cc.CorruptCheckpointError("['w']: checksum mismatch"), False),
])
def test_storage_unavailable_tells_outages_from_damage(e, expected):
    assert storage_unavailable(e) is expected


def test_unavailable_error_names_the_key_path_and_what_to_do():
    e = read_failure(ValueError("PERMISSION_DENIED: HTTP 403"), "['params']['w']", "chunk c/0/0",
                     "PERMISSION_DENIED: HTTP 403", "unused")
    assert isinstance(e, cc.StorageUnavailableError)
    msg = str(e)
    assert msg.startswith("['params']['w']: reading chunk c/0/0 failed") and "HTTP 403" in msg
    assert "not known to be damaged" in msg and "retry" in msg


def test_a_read_failure_that_is_not_an_outage_is_damage_naming_the_key_path():
    e = read_failure(ValueError("DATA_LOSS: Digest mismatch"), "['w']", "chunk c/0/0", "DATA_LOSS", "['w']: damaged")
    assert isinstance(e, cc.CorruptCheckpointError) and str(e) == "['w']: damaged" and e.key_path == "['w']"
