"""What a local file system offers a `LocalStore`: its kind (memory or a block device that takes
direct I/O), fsyncs, directory stamps that tell whether a directory changed, an atomic exchange of
two paths, tree walks and removal, and opening a file refused unless it is a regular one.

Example::

    import os
    from ckpt_callbacks import localfs
    localfs.fs_type("/dev/shm")                 # "tmpfs" (in MEMORY_FS: a store skips fsyncs there)
    os.makedirs("/tmp/run/arrays", exist_ok=True)
    dirs, files = localfs.tree("/tmp/run")      # (["/tmp/run", "/tmp/run/arrays"], []): one scandir each
    localfs.fsync_path("/tmp/run", directory=True)
    localfs.remove_tree("/tmp/run")

Who calls what: `localstore.LocalStore` (on the manager's, the writer's and its pools' threads,
and the CLI's) and the local read paths of `restore`. Nothing here knows the checkpoint format.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import os
import re
import shutil
import stat
import time

from .storage import submit

__all__ = ["each", "remove_tree", "unlink_quiet", "tree", "DIRECT_FS", "MEMORY_FS", "fs_type", "open_file",
           "fsync_path", "STAMP_MARGIN_NS", "stamp", "dir_stamps", "exchange"]


def each(fn, items: list, pool=None) -> None:
    """`fn` on every item: on `pool`'s threads (or, without one, on threads started for the call)
    when there are several, for calls that wait on the device and release the GIL; on this
    thread where the pool takes no more tasks (interpreter shutdown, e.g. `close()` from
    `atexit`: `submit`).
    Returns once all have run; then re-raises the first failure (in item order). Never call it on
    a thread of `pool`."""
    if len(items) < 2:
        for x in items:
            fn(x)
        return
    own = None
    try:
        if pool is None:
            pool = own = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(items)))
        futures = [submit(pool, fn, x) for x in items]
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()
    finally:
        if own is not None:
            own.shutdown(wait=True)


def remove_tree(path: str) -> None:
    """Remove the directory `path`, or a file or symlink in its place (a step name a user put a
    file at), as far as possible: what cannot be removed stays (start-up tries again)."""
    if os.path.islink(path) or os.path.isfile(path):
        unlink_quiet(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:   # gone already, or not ours to remove: rmtree tries again and ignores it
        pass


def tree(top: str) -> tuple[list[str], list[str]]:
    """The directories (`top` first) and the files under `top`: one ``scandir`` per directory
    (`os.walk` costs several times more per entry). A symlink, even to a directory, is listed as
    a file; nothing if `top` does not exist; a subdirectory that vanishes or cannot be read
    raises (unlike `os.walk`): for staging trees, which only this package writes."""
    dirs, files, todo = [], [], [top]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    (todo if e.is_dir(follow_symlinks=False) else files).append(e.path)
        except FileNotFoundError:
            if d == top:
                return [], []
            raise
        dirs.append(d)
    return dirs, files


DIRECT_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"}   # local block devices
MEMORY_FS = {"tmpfs", "ramfs"}   # their page cache is the storage: mapping a file reads nothing


def fs_type(path: str, mounts: str = "/proc/self/mounts") -> str:
    """The type of the file system holding `path` (or its nearest existing parent): the longest
    mount point above it in `mounts`, the later of equal ones ("" where that is not readable,
    e.g. not Linux)."""
    target = os.fsencode(os.path.realpath(path))
    try:
        with open(mounts, "rb") as f:
            entries = [line.split()[1:3] for line in f]
    except OSError:
        return ""
    best, kind = b"", ""
    for point, fs in (e for e in entries if len(e) == 2):
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), point)   # "\040" is a space
        if (target == point or target.startswith(point.rstrip(b"/") + b"/")) and len(point) >= len(best):
            best, kind = point, os.fsdecode(fs)
    return kind


def open_file(path: str):
    """`path` opened for reading in binary mode, refused (OSError EINVAL; a directory: EISDIR)
    unless it is a regular file: a FIFO or device in a checkpoint file's place would block a
    reader in open() forever (hence O_NONBLOCK, which regular files ignore)."""
    f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file", path)
    return f


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)  # an error here aborts the save: never retried (fsyncgate)
    finally:
        os.close(fd)


# A directory whose entries changed less than this long before it was stamped is not stamped:
# file systems take timestamps from a clock that advances by ticks (1-10 ms), so a later change
# in the same tick could leave its mtime as it was.
STAMP_MARGIN_NS = 100_000_000


def stamp(path: str):
    """What changes when an entry of directory `path` is added, removed or renamed (None if gone)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def dir_stamps(top: str, dirs: list[str]) -> dict:
    """{path relative to `top`: `stamp`} for the directories under `top` (`dirs` from `tree`,
    `top` first and left out: it is renamed, and always fsynced) last changed at least
    `STAMP_MARGIN_NS` ago. `publish` of a reused tree fsyncs only the directories whose stamp
    differs: POSIX updates a directory's mtime and ctime with every entry added, removed or
    renamed, so an equal stamp means the same entries as at the commit that made them durable."""
    now = time.time_ns()
    out = {}
    for d in dirs[1:]:
        st = stamp(d)
        if st is not None and now - max(st[1], st[2]) >= STAMP_MARGIN_NS:
            out[d[len(top) + 1:]] = st
    return out


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2`` with ``RENAME_EXCHANGE``);
    False where the C library or the file system has no such call."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:   # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


@functools.lru_cache(maxsize=1)
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn
