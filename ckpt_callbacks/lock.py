"""One writer per checkpoint directory: a lock file naming its owner (host, pid).

Example::

    import os
    from ckpt_callbacks.lock import acquire, release
    os.makedirs("/tmp/run", exist_ok=True)
    acquire("/tmp/run")     # CheckpointLockedError if another live process writes there
    release("/tmp/run")

Who calls what: `CheckpointManager` on process 0, at start (acquire), at each save (check) and in
`close` (release).
A lock whose owner is on this host and no longer alive is stale and is taken over, and so is a
lock file without a readable owner last written over 2 s ago (an older version's writer killed
while creating it). Locks on other hosts cannot be checked for liveness; remove the file by hand
if its owner is gone (the message says so). Object stores have no lock (see docs/storage.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from .errors import CheckpointError, CheckpointLockedError, space_hint

__all__ = ["acquire", "check", "check_free", "release", "LOCK_NAME"]

LOCK_NAME = ".ckpt_callbacks.lock"
_UNREADABLE_S = 2.0   # a lock file without a readable owner, last written this long ago, is stale
_ATTEMPTS = 100


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


def _write_owner(fd: int, me: dict) -> None:
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())


def _create(path: str, me: dict) -> bool:
    """Create the lock file holding `me`, or return False if it exists. The owner is written to
    a file of our own first and linked into place, so the lock never exists without its owner
    (a process killed while taking it leaves no empty lock); where the file system has no hard
    links, created in place (``O_EXCL``) and written."""
    tmp = f"{path}.new-{me['host']}-{me['pid']}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_owner(fd, me)
    except BaseException:   # e.g. a full file system: no owner file of ours left behind
        os.unlink(tmp)
        raise
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
    finally:
        os.unlink(tmp)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    _write_owner(fd, me)
    return True


def acquire(root: str) -> None:
    path = os.path.join(root, LOCK_NAME)
    if os.path.realpath(root) in _HELD:
        raise CheckpointLockedError(
            f"{root} is already open for writing by another CheckpointManager in this process "
            f"(pid {os.getpid()}); close() it first, or open this one with read_only=True (an "
            f"AsyncCheckpoint whose fit() raised keeps its manager open: cb.manager.close(), or its next fit())")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    _sweep(root, me["host"])
    for _ in range(_ATTEMPTS):
        try:
            created = _create(path, me)
        except OSError as e:
            raise CheckpointError(f"cannot create the lock file {path}: {e}{space_hint(str(e), root)}") from None
        if created:
            _HELD.add(os.path.realpath(root))
            return
        try:
            with open(path, "rb") as f:
                st, data = os.fstat(f.fileno()), f.read()
        except FileNotFoundError:
            continue   # released meanwhile
        except OSError as e:   # e.g. a directory of that name: no owner to judge, and not ours to remove
            raise CheckpointError(f"cannot read the lock file {path}: {e}. Fix: remove it if no process "
                                  f"writes to {root}, or use another directory") from None
        try:
            owner = json.loads(data)
        except ValueError:
            owner = {}
        owner = owner if isinstance(owner, dict) else {}
        if _ours(owner):
            _HELD.add(os.path.realpath(root))   # left by an earlier manager of ours that was never closed
            return
        if not owner and time.time() - st.st_mtime < _UNREADABLE_S:
            time.sleep(0.05)   # being written by an `O_EXCL` writer (no hard links) right now
            continue
        if not owner or _dead(owner):
            # stale: its owner died (or it has had no owner for a while: a writer of an older
            # version of this package killed between creating and writing it)
            _take_over(root, path, st, data)
            continue
        raise _held(root, path, owner)
    raise CheckpointLockedError(f"could not take the lock {path}")


def check_free(root: str) -> None:
    """Raise `CheckpointLockedError` where `acquire` would (a live process holds the lock of
    `root`), without taking the lock: for a reader that must not act beside a writer
    (``gc --dry-run``). A lock without a readable owner, or of a dead process, `acquire` takes over."""
    path = os.path.join(root, LOCK_NAME)
    owner = _owner(path)
    if owner and not _ours(owner) and not _dead(owner):
        raise _held(root, path, owner)


def _dead(owner: dict) -> bool:
    """Whether the lock's owner is a process of this host that is gone."""
    pid = owner.get("pid")
    return owner.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid)


def _held(root: str, path: str, owner: dict) -> CheckpointLockedError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("time", 0)))
    return CheckpointLockedError(
        f"{root} is being written by another process (host {owner.get('host')}, pid {owner.get('pid')}, since "
        f"{since}). Use another directory, stop that process, or delete {path} if it is gone.")


def _take_over(root: str, path: str, st: os.stat_result, data: bytes) -> None:
    """Remove the stale lock `path` (its stat and content as read: `st`, `data`) if it is still
    that one. Take-overs on this host take turns (``flock`` on the directory), so of several
    processes that found the same stale lock, the first removes it and the others find a new one."""
    dfd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)
        except OSError:   # a file system without flock on a directory: the check below still holds
            pass
        try:
            with open(path, "rb") as f:
                now = os.fstat(f.fileno())
                if (now.st_ino, now.st_mtime_ns) != (st.st_ino, st.st_mtime_ns) or f.read() != data:
                    return   # taken over (or written) meanwhile: judged again by the caller
            os.unlink(path)
        except FileNotFoundError:
            pass
    finally:
        os.close(dfd)   # (releases the flock)


def _sweep(root: str, host: str) -> None:
    """Remove the owner files (``.new-``) that dead processes of this host left, killed between
    creating and removing one."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(LOCK_NAME + ".new-"):
            continue
        who, _, pid = name[len(LOCK_NAME + ".new-"):].rsplit("-", 1)[0].rpartition("-")
        if who == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass


def _owner(path: str) -> dict | None:
    """The owner a lock file names; None where there is none or it cannot be read."""
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _ours(owner: dict | None) -> bool:
    return owner is not None and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()


def check(root: str) -> None:
    """Raise `CheckpointLockedError` unless this process still holds the lock of `root` (the
    manager's save asks, process 0): a directory removed or replaced while its manager was open
    has lost the lock, and another writer may hold it since."""
    owner = _owner(os.path.join(root, LOCK_NAME))
    if _ours(owner):
        return
    now = "no lock file" if owner is None else f"the lock of host {owner.get('host')}, pid {owner.get('pid')}"
    raise CheckpointLockedError(
        f"{root} no longer holds this process's lock ({now}): the directory was removed or replaced while "
        f"its CheckpointManager was open, and another writer may use it now; nothing was saved. Fix: close "
        f"this manager and open a new one on the directory (it refuses while another process writes there).")


def release(root: str) -> None:
    path = os.path.join(root, LOCK_NAME)
    _HELD.discard(os.path.realpath(root))
    if _ours(_owner(path)):
        try:
            os.unlink(path)
        except OSError:
            pass
