"""`LocalStore`: the `Store` of a local POSIX directory (the default), with atomic renames.

Example::

    from ckpt_callbacks.localstore import LocalStore
    store = LocalStore("/tmp/run")            # what storage.open_store("/tmp/run") returns
    store.committed_steps()                   # [] on a new directory
    print(store.in_memory, store.direct_io)   # tmpfs: True False; ext4/XFS: False True

Who calls what: as for every `Store` (see `ckpt_callbacks.storage`): the manager, the writer
thread (`writing`) and its chunk and fsync threads, `restore`, and the CLI. A save is written into
``step_N.tmp-<token>/``, its files and new directories fsynced (`sync`), then `publish` renames it
to ``step_N`` and fsyncs the parent; a forced replacement swaps the two directories atomically
(``renameat2(RENAME_EXCHANGE)`` where the kernel has it, else two renames, the old step put back by
`recover` after a crash between them). `delete` hides a step (``step_N.del-<hex>``) before removing
it, and with ``reuse=True`` keeps its files for the next save to `claim`. Memory file systems skip
fsyncs; local disks let `chunkwrite` bypass the page cache (``direct_io``).
"""

from __future__ import annotations

import os
import stat
import threading

from . import format as fmt
from . import localfs
from .errors import CheckpointError, CheckpointNotFoundError, StorageUnavailableError, storage_unavailable
from .storage import Store

__all__ = ["LocalStore"]


def _hidden_name(step: int, kind: str) -> str:
    """A fresh name for a step directory renamed out of the way: `step_N.del-<hex>` (deleted)
    or `step_N.old-<hex>` (superseded by a forced replacement)."""
    return f"{fmt.step_name(step)}.{kind}-{os.urandom(6).hex()}"



class LocalStore(Store):
    """A POSIX directory; commit by atomic rename of a staging directory."""

    local = True

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root
        # on a local disk, page-aligned chunk buffers are written with O_DIRECT (chunkwrite); not on
        # a memory file system (tmpfs: its page cache is the storage), nor over a network or FUSE,
        # where direct I/O means a synchronous round trip per write, or is refused
        kind = localfs.fs_type(self.root)
        self.direct_io = hasattr(os, "O_DIRECT") and kind in localfs.DIRECT_FS
        self.in_memory = kind in localfs.MEMORY_FS
        self._kept: list[str] = []              # hidden (.del-) step directories kept for reuse
        self._pool: dict[int, list[str]] = {}   # their chunk and blob files by size
        self._inplace: dict[str, int] = {}      # chunk files of a kept directory made staging: size
        self._reused: set[str] = set()          # staging directories that are kept directories
        self._stamps: dict[str, dict] = {}      # kept or reused directory -> its unchanged subdirectories
        self._pool_lock = threading.Lock()

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def kvstore(self, rel: str) -> dict:
        return {"driver": "file", "path": self.path(rel) + "/"}

    def _fsync(self, path: str, directory: bool = False) -> None:
        # On a memory file system an fsync makes nothing more durable: tmpfs and ramfs implement
        # it as a no-op (the kernel's noop_fsync). Skipping it spares a save an open, an fsync and
        # a close per file and directory, and the thread-pool round trips that spread them.
        if not self.in_memory:
            localfs.fsync_path(path, directory)

    def write(self, rel: str, data, sync: bool = True) -> None:
        """Write bytes, or a list of buffers one after another; fsync the file unless ``sync=False``."""
        p = self.path(rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        localfs.unlink_quiet(p)   # a file there (a reused staging directory) may be hard-linked elsewhere
        with open(p, "wb") as f:
            for part in (data if isinstance(data, list) else [data]):
                f.write(part)
            f.flush()
            if sync and not self.in_memory:   # see `_fsync`
                os.fsync(f.fileno())

    def read(self, rel: str) -> bytes:
        try:
            with localfs.open_file(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path(rel)} does not exist") from None
        except OSError as e:
            if storage_unavailable(e):   # permission, stale handle, timeout: not the file's content
                raise StorageUnavailableError(f"reading {self.path(rel)} failed: {e}; check permissions, "
                                              f"mounts and network, then retry") from None
            raise

    def committed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointError(f"{self.root} is a file, not a checkpoint directory") from None
        return sorted(s for s in map(fmt.parse_step_name, names) if s is not None)

    def has_step(self, step: int) -> bool:
        # the name `committed_steps` would list (a `step_N` entry, damaged or not): one lstat, whose
        # failure other than "no such entry" is raised as a failed listing is (not taken for "absent")
        try:
            os.lstat(self.path(fmt.step_name(step)))
            return True
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            raise CheckpointError(f"{self.root} is a file, not a checkpoint directory") from None

    def staging(self, step: int, token: str) -> str:
        """The staging directory (relative) that `begin` makes for the save `token` of `step`."""
        return f"{fmt.step_name(step)}.tmp-{token}"

    def begin(self, step: int, token: str, lead: bool = True, reuse_tree: bool = False) -> str:
        rel = self.staging(step, token)
        if not (lead and reuse_tree and self._adopt(rel)):
            os.makedirs(self.path(rel), exist_ok=True)
        return rel

    def _adopt(self, rel: str) -> bool:
        """Rename the last kept step directory to the staging directory `rel`: its directories and
        files are this save's, its chunk files overwritten in place where this save writes the
        same file again (`claim` with the path). Nothing is created or deleted for a save of the
        same tree; on a disk file system each new inode and each deletion is a metadata write."""
        with self._pool_lock:
            if not self._kept or os.path.lexists(self.path(rel)):
                return False
            hidden = self._kept.pop()
            stamps = self._stamps.pop(hidden, {})
            try:
                os.rename(self.path(hidden), self.path(rel))
            except OSError:   # removed behind our back: that directory is gone for good
                return False
            self._stamps[rel] = stamps
            old, new = self.path(hidden) + os.sep, self.path(rel) + os.sep
            for size, paths in self._pool.items():
                mine = [p for p in paths if p.startswith(old)]
                paths[:] = [p for p in paths if not p.startswith(old)]
                self._inplace.update((new + p[len(old):], size) for p in mine)
            self._reused.add(rel)
        # a staging directory holds no manifest before its own (written last, before the rename)
        localfs.unlink_quiet(self.path(f"{rel}/{fmt.MANIFEST}"))
        return True

    def holds(self, rel: str, data: bytes) -> bool:
        with self._pool_lock:
            if not any(rel.startswith(r + "/") for r in self._reused):
                return False
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            return stat.S_ISREG(st.st_mode) and st.st_size == len(data) and os.read(fd, len(data) + 1) == data
        finally:
            os.close(fd)

    def prune(self, staging: str, keep: set, pool=None, last: bool = True) -> None:
        with self._pool_lock:
            if staging not in self._reused:
                return
            if last:
                self._forget(staging)
        top = self.path(staging)
        dirs, files = localfs.tree(top)
        under = tuple(k for k in keep if k.endswith("/"))
        n = len(top) + 1   # `localfs.tree` names every file `top` + os.sep + its relative path
        stale = [f for f in files if (rel := f[n:]) not in keep and not rel.startswith(under)]
        localfs.each(localfs.unlink_quiet, stale, pool)
        if stale:   # deepest first; a directory still holding this save's files stays
            for d in sorted(dirs[1:], key=lambda d: d.count(os.sep), reverse=True):
                try:
                    os.rmdir(d)
                except OSError:
                    pass

    def _forget(self, staging: str) -> None:
        """(Under the pool lock.) `staging` is no longer a reused directory with claimable files."""
        self._reused.discard(staging)
        prefix = self.path(staging) + os.sep
        for p in [p for p in self._inplace if p.startswith(prefix)]:
            del self._inplace[p]

    def abort(self, staging: str) -> None:
        with self._pool_lock:
            self._forget(staging)
            self._stamps.pop(staging, None)
        self.remove(staging)

    def sync(self, rels: list[str], skip=frozenset(), pool=None) -> None:
        """fsync the given files and the files of the given trees, in parallel on `pool` (or on
        threads started for the call; fsync releases the GIL, and the device is kept busy with
        several flushes at once), except the relative paths in `skip`. Directories are fsynced
        once, by `publish`, for the whole staging tree. Never call it on a thread of `pool`.
        On a memory file system (``in_memory``) there is nothing to make durable: it returns."""
        if self.in_memory:
            return
        files = []
        skip = {self.path(r) for r in skip}
        for rel in rels:
            top = self.path(rel)
            if os.path.isfile(top):
                files.append(top)
            else:
                files += localfs.tree(top)[1]
        files = [f for f in files if f not in skip]

        def one(path):
            try:
                localfs.fsync_path(path)
            except FileNotFoundError:  # another process's temporary file, renamed meanwhile
                pass

        localfs.each(one, files, pool)   # re-raises the first failure: the save aborts

    def publish(self, staging: str, step: int, replace: bool = False, pool=None) -> None:
        final = self.path(fmt.step_name(step))
        # every directory of the staging tree (the writers fsynced their own files); on a file
        # system without a journal each is a synchronous metadata write: several at once. Of a
        # reused tree (`begin` with reuse_tree), not the directories whose entries are as they
        # were when their step was deleted: durable since that step's commit (`localfs.dir_stamps`).
        with self._pool_lock:
            stamps = self._stamps.pop(staging, {})
        if not self.in_memory:   # see `_fsync`
            top = self.path(staging)
            dirs = localfs.tree(top)[0]
            if stamps:
                dirs = [top] + [d for d in dirs[1:] if stamps.get(d[len(top) + 1:]) != localfs.stamp(d)]
            localfs.each(lambda d: localfs.fsync_path(d, directory=True), dirs, pool)
        old = None
        if os.path.exists(final):
            if not replace:
                raise CheckpointError(f"{final} already exists")
            if localfs.exchange(self.path(staging), final):   # one atomic step: readers never miss the step
                self._fsync(self.root, directory=True)
                localfs.remove_tree(self.path(staging))   # the old copy (a leftover if we die)
                return
            # `.old-`, not `.del-`: if we die before the next rename, `recover` puts it back
            old = _hidden_name(step, "old")
            os.rename(final, self.path(old))
        os.rename(self.path(staging), final)
        self._fsync(self.root, directory=True)
        if old:
            localfs.remove_tree(self.path(old))

    def recover(self) -> list[int]:
        """At start-up, before leftovers are removed: put back a step whose forced replacement
        (`publish(replace=True)`) died between its two renames. Returns the steps put back."""
        back = []
        for name, step in self.recoverable().items():
            final = self.path(fmt.step_name(step))
            if not os.path.exists(final):   # (two `.old-` of one step: only the first goes back)
                os.rename(self.path(name), final)
                back.append(step)
        if back:
            self._fsync(self.root, directory=True)
        return back

    def delete(self, step: int, reuse: bool = False) -> None:
        # first the copies its forced replacements left (`.old-`, superseded while `step_N` is
        # there): once `step_N` is gone, `recover` would put such a copy back
        # (renamed to `.del-`, which nothing puts back, then removed as far as it goes)
        old = [n for n, s in self._old_copies().items() if s == step]
        gone = [_hidden_name(step, "del") for _ in old]
        for name, new in zip(old, gone):
            os.rename(self.path(name), self.path(new))
        if old:
            self._fsync(self.root, directory=True)   # durable before `step_N` goes
        for new in gone:
            localfs.remove_tree(self.path(new))
        hidden = _hidden_name(step, "del")
        try:
            os.rename(self.path(fmt.step_name(step)), self.path(hidden))
        except FileNotFoundError:
            return
        self._fsync(self.root, directory=True)
        if not reuse:
            localfs.remove_tree(self.path(hidden))
            return
        # Kept for the next save to overwrite in place: the page cache pages (and on disk, the
        # blocks) are neither freed now nor allocated again then. Only plain chunk and blob files.
        # On a disk the next save may take the whole directory (`begin` with reuse_tree): its
        # directories are stamped too, for `publish`, here and not when that save takes it: only
        # now are their entries surely those the commit made durable (a `claim` in between renames
        # chunk files out, unsynced; its stamp then differs and `publish` fsyncs that directory).
        found = []
        reusable = (self.path(f"{hidden}/arrays") + os.sep, self.path(f"{hidden}/blobs") + os.sep)
        dirs, files = localfs.tree(self.path(hidden))
        for path in files:
            if not path.startswith(reusable) or os.path.basename(path) == "zarr.json":
                continue
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                found.append((st.st_size, path))
        stamps = localfs.dir_stamps(self.path(hidden), dirs) if self.direct_io else {}
        with self._pool_lock:
            self._kept.append(hidden)
            self._stamps[hidden] = stamps
            for size, path in found:
                self._pool.setdefault(size, []).append(path)

    def step_token(self, step: int):
        # the step directory and its manifest (a re-save of the step writes a new one, also into
        # a reused directory); None when the step is not there
        d = self.path(fmt.step_name(step))
        try:
            a, m = os.stat(d), os.stat(os.path.join(d, fmt.MANIFEST))
        except OSError:
            return None
        return a.st_dev, a.st_ino, m.st_ino, m.st_mtime_ns, m.st_size

    def claim(self, nbytes: int, path: str | None = None) -> str | None:
        with self._pool_lock:
            if path is not None and self._inplace.get(path) == nbytes:
                del self._inplace[path]
                return path
            paths = self._pool.get(nbytes)
            return paths.pop() if paths else None

    def claim_all(self, sizes: list[int]) -> list[str] | None:
        with self._pool_lock:
            if any(len(self._pool.get(n, ())) < sizes.count(n) for n in set(sizes)):
                return None
            return [self._pool[n].pop() for n in sizes]

    def _old_copies(self) -> dict[str, int]:
        """The `.old-` copies that forced replacements left: {name: step}."""
        found = {}
        for name in self.leftovers():
            m = fmt.STAGING_RE.match(name)
            if m.group(2) == "old":
                found[name] = int(m.group(1))
        return found

    def recoverable(self) -> dict[str, int]:
        return {n: s for n, s in self._old_copies().items() if not os.path.exists(self.path(fmt.step_name(s)))}

    def drop_reusable(self, pool=None) -> None:
        with self._pool_lock:
            kept, self._kept, self._pool = self._kept, [], {}
            for hidden in kept:
                self._stamps.pop(hidden, None)
        files = []
        for hidden in kept:
            try:
                files += localfs.tree(self.path(hidden))[1]
            except OSError:   # (only ours write there) rmtree below removes what is left
                pass
        # unlinks first, several at once: with `discard` each one waits for the device
        localfs.each(localfs.unlink_quiet, files, pool)
        for hidden in kept:
            localfs.remove_tree(self.path(hidden))

    def leftovers(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if fmt.STAGING_RE.match(n))
        except FileNotFoundError:
            return []

    def remove(self, name: str) -> None:
        if not fmt.STAGING_RE.match(name):
            raise ValueError(f"refusing to remove {name!r}: not a name ckpt_callbacks creates")
        localfs.remove_tree(self.path(name))

    def size(self, step: int) -> int | None:
        total = 0
        for dirpath, _, files in os.walk(self.path(fmt.step_name(step))):
            for f in files:
                try:   # the entry itself: a dangling symlink in a damaged step is that step's, not ls's, failure
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:   # removed meanwhile (a writer's retention)
                    pass
        return total

    def check_writable(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {self.root}: {e}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {self.root} is not writable by this process "
                                  f"(uid {os.getuid()}); fix its permissions or choose another directory")
