"""One writer per checkpoint directory: a lock file naming its owner (host, pid).

Example::

    from ckpt_callbacks.lock import acquire, release
    acquire("/tmp/run")     # CheckpointLockedError if another live process writes there
    release("/tmp/run")

Who calls what: `CheckpointManager` on process 0, at start (acquire) and in `close` (release).
A lock whose owner is on this host and no longer alive is stale and is taken over. Locks on other
hosts cannot be checked for liveness; remove the file by hand if its owner is gone
(the message says so). Object stores have no lock (see docs/storage.md).
"""

from __future__ import annotations

import json
import os
import socket
import time

from .errors import CheckpointLockedError

__all__ = ["acquire", "release", "LOCK_NAME"]

LOCK_NAME = ".ckpt_callbacks.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


_HELD: set = set()   # roots this process holds: one writer per directory within a process too


def acquire(root: str) -> None:
    path = os.path.join(root, LOCK_NAME)
    if os.path.realpath(root) in _HELD:
        raise CheckpointLockedError(
            f"{root} is already open for writing by another CheckpointManager in this process "
            f"(pid {os.getpid()}); close() it first, or open this one with read_only=True")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                owner = {}
            host, pid = owner.get("host"), owner.get("pid")
            if host == me["host"] and pid == me["pid"]:
                _HELD.add(os.path.realpath(root))   # left by an earlier manager of ours that was never closed
                return
            if host == me["host"] and isinstance(pid, int) and not _alive(pid):
                try:  # stale: its owner died; take it over atomically
                    os.rename(path, f"{path}.stale-{os.getpid()}")
                    os.unlink(f"{path}.stale-{os.getpid()}")
                except FileNotFoundError:
                    pass
                continue
            if not owner:
                time.sleep(0.05)  # being written right now
                continue
            raise CheckpointLockedError(
                f"{root} is being written by another process (host {host}, pid {pid}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(owner.get('time', 0)))}). "
                f"Use another directory, stop that process, or delete {path} if it is gone.")
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        _HELD.add(os.path.realpath(root))
        return
    raise CheckpointLockedError(f"could not take the lock {path}")


def release(root: str) -> None:
    path = os.path.join(root, LOCK_NAME)
    _HELD.discard(os.path.realpath(root))
    try:
        with open(path) as f:
            owner = json.load(f)
        if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            os.unlink(path)
    except (OSError, ValueError):
        pass
