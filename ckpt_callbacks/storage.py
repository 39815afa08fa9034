"""Where checkpoints live: a local POSIX directory or an object-store prefix, behind one small seam.

Example::

    from ckpt_callbacks.storage import open_store
    store = open_store("/tmp/run")          # or "s3://bucket/prefix", "gs://bucket/prefix", "file:///x"
    store.committed_steps()                 # [] on a new directory

Who calls what, in order, for one save (process 0 unless said otherwise):
  1. ``begin(step, token, lead=...)`` on every process -> the staging location (relative name) to
     write into; only the lead (process 0) prepares it (object stores: writes the pending record
     ``pending/step_N`` naming this save, then clears bytes of an earlier attempt at ``step_N/``);
  2. every process writes arrays through ``kvstore(rel)`` (tensorstore) and blobs through ``write``,
     then calls ``sync(rel_dirs)`` so that its own bytes are durable;
  3. after a barrier, process 0 writes the manifest and calls ``publish(staging, step)``: POSIX
     fsyncs and renames ``step_N.tmp-<token>`` to ``step_N`` and fsyncs the parent; object stores check
     that the pending record is still this save's, then write the commit marker ``commits/step_N``
     last. Only then is the step visible to ``committed_steps``. A failed save calls ``abort``.
Deletion (``delete``) hides the step first (rename to ``.del-``, or marker removed first), then removes
its bytes, so a half-deleted step is never seen as committed. ``delete(reuse=True)`` (the manager's
retention, local stores) keeps the hidden step's chunk and blob files for the next save's writers to `claim`
(``claim_all``: one for each file of a box, or none) and overwrite in place; ``drop_reusable``
removes what they left. ``begin(..., reuse_tree=True)`` (one writing process, nothing written
before it) may instead rename the whole hidden directory to the staging directory, whose chunk
files are then claimed by path; ``prune`` removes what the new manifest does not name.
``direct_io`` (LocalStore on ext4/XFS/btrfs/f2fs) lets `chunkwrite` send page-aligned chunk
buffers past the page cache; ``in_memory`` (LocalStore on tmpfs/ramfs) lets a save write new chunk
files straight from the caller's buffers (`localwrite.WriteThrough`), `chunkread` map chunk files
that a restore cannot read whole into one shard instead of copying them into a buffer first, and
the store itself skip fsyncs, which such file systems implement as no-ops.
``leftovers`` lists only names this package creates (``step_N.tmp-*``, ``step_N.del-*``; object
stores: steps whose pending record belongs to no live save), and ``remove`` deletes one. Messages
never contain an endpoint or a credential (``redact``/``scrub``); see docs/storage.md for URLs,
credentials and atomicity. Implementations: `ckpt_callbacks.localstore.LocalStore`,
`ckpt_callbacks.objectstore.ObjectStore`.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import urllib.parse

from .errors import CheckpointError, ConfigError, StorageUnavailableError, storage_unavailable

__all__ = ["Store", "open_store", "submit"]


class Store:
    """Common interface; see the module docstring for the call order."""

    url: str
    local: bool
    direct_io: bool = False   # chunk files may bypass the page cache (``O_DIRECT``; LocalStore on disk)
    in_memory: bool = False   # chunk files live in memory (tmpfs): written through, never fsynced

    def kvstore(self, rel: str) -> dict:
        raise NotImplementedError

    def write(self, rel: str, data, sync: bool = True) -> None:
        """Write `data` (bytes, or a list of buffers to concatenate) as the object/file `rel`.

        With ``sync=False`` the caller makes it durable later with `sync` (object stores: every
        completed write is durable)."""
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        raise NotImplementedError

    def committed_steps(self) -> list[int]:
        raise NotImplementedError

    def has_step(self, step: int) -> bool:
        """Whether `step` is among `committed_steps()`; a backend may answer without listing them all."""
        return step in self.committed_steps()

    def begin(self, step: int, token: str, lead: bool = True, reuse_tree: bool = False) -> str:
        """`lead` is True on the one process (0) that owns the step's staging and publishes it.
        `reuse_tree` (a single writing process): the backend may make a step directory kept by
        ``delete(reuse=True)`` the staging directory (LocalStore); the writer then calls `prune`."""
        raise NotImplementedError

    def staging(self, step: int, token: str) -> str:
        """The staging location (relative) that `begin` returns for the save `token` of `step`."""
        raise NotImplementedError

    def sync(self, rels: list[str], skip=frozenset(), pool=None) -> None:
        """Make the given files and trees durable (`skip`: relative paths of files already synced;
        `pool`: an executor the backend may run fsyncs on)."""

    def publish(self, staging: str, step: int, replace: bool = False, pool=None) -> None:
        """Make `staging` the committed step `step` (`pool`: as for `sync`)."""
        raise NotImplementedError

    def delete(self, step: int, reuse: bool = False) -> None:
        """Delete a committed step. With `reuse` a backend may keep its chunk and blob files, hidden, for
        `claim` by the next save instead (LocalStore); `drop_reusable` deletes what is left."""
        raise NotImplementedError

    def step_token(self, step: int):
        """What identifies the committed files of `step` now, where a later save may write over a
        deleted step's files in place (None elsewhere: there a deleted step's objects just go).
        A restore compares it before and after reading (`restore.restore`)."""
        return None

    def claim(self, nbytes: int, path: str | None = None) -> str | None:
        """The absolute path of a kept chunk file of exactly `nbytes`, now the caller's, or None;
        `path` itself when it is such a file (in a staging directory that `begin` reused)."""
        return None

    def claim_all(self, sizes: list[int]) -> list[str] | None:
        """A kept chunk file for each of `sizes` (as `claim`), or None and nothing claimed."""
        return None

    def drop_reusable(self, pool=None) -> None:
        """Delete the files kept by ``delete(reuse=True)`` that no save claimed (`pool`: as for
        `sync`)."""

    def holds(self, rel: str, data: bytes) -> bool:
        """Whether `rel` is a file of a staging directory that `begin` reused, holding exactly
        `data`: a file of the committed step that directory was (durable since that commit), which
        the writer keeps as it is instead of writing it again. Asked before the save writes `rel`."""
        return False

    def prune(self, staging: str, keep: set, pool=None, last: bool = True) -> None:
        """In a staging directory that `begin` reused: delete every file that is not in `keep`
        (relative to `staging`; an entry ending in "/" keeps everything under it), and the
        directories left empty. The writer calls it right after `begin` (``last=False``: the files
        it will write) and before the manifest (the files the manifest names)."""

    def leftovers(self) -> list[str]:
        raise NotImplementedError

    def recover(self) -> list[int]:
        """Undo an interrupted forced replacement, where the backend can (POSIX); see LocalStore."""
        return []

    def recoverable(self) -> dict[str, int]:
        """The leftovers that `recover` would put back: {name: step}."""
        return {}

    def remove(self, name: str) -> None:
        raise NotImplementedError

    def abort(self, staging: str) -> None:
        self.remove(staging)

    def redact(self, message: str) -> str:
        """`message` safe to log: without endpoints or credentials (identity for local paths)."""
        return message

    def scrub(self, error: BaseException) -> BaseException:
        """`error` itself, or a CheckpointError carrying its redacted message (and no chained cause):
        a `StorageUnavailableError` where the storage could not be reached or refused access (on an
        object store also where the message named no endpoint, e.g. tensorstore's "ABORTED: ...
        Timeout was reached" of a chunk write to a server that hangs)."""
        msg = str(error)
        clean = self.redact(msg)
        if clean == msg and (self.local or isinstance(error, CheckpointError) or not storage_unavailable(error)):
            return error
        cls = StorageUnavailableError if storage_unavailable(error) else CheckpointError
        new = cls(f"{type(error).__name__}: {clean}").with_traceback(error.__traceback__)
        new.__suppress_context__ = True
        return new

    def size(self, step: int) -> int | None:
        return None

    def check_writable(self) -> None:
        pass


def threads_refused() -> bool:
    """Whether this interpreter refuses to start threads: from Python 3.12 on, once it began to
    exit ("can't create new thread at interpreter shutdown"; `threading` sets ``_SHUTTING_DOWN``
    first, before it runs its exit hooks and joins the non-daemon threads, which may still be
    saving or restoring, as may a save in flight that the exit hook closes)."""
    return sys.version_info >= (3, 12) and bool(getattr(threading, "_SHUTTING_DOWN", False))


def submit(pool, fn, *args) -> concurrent.futures.Future:
    """``pool.submit(fn, *args)``, or `fn` run on this thread, its outcome in a done future, where
    the pool would not run it: at interpreter exit `concurrent.futures` stops every pool (while a
    non-daemon thread may still be saving or restoring), and from Python 3.12 on no thread can be
    started then (`threads_refused`). Any other failure is raised: a pool that could not start a
    thread has queued the task already, and running it here as well would run it twice."""
    try:
        if threads_refused():
            raise RuntimeError("cannot schedule new futures: the interpreter is exiting")
        return pool.submit(fn, *args)
    except RuntimeError as e:
        if not str(e).startswith("cannot schedule new futures"):
            raise
        f = concurrent.futures.Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the future's holder re-raises it
            f.set_exception(e)
        return f


def open_store(directory) -> Store:
    """A Store for a local path, ``file://`` URL, ``s3://bucket/prefix`` or ``gs://bucket/prefix``."""
    directory = os.fspath(directory)
    if not isinstance(directory, str) or not directory.strip():
        raise ConfigError(f"the checkpoint directory must be a non-empty path or URL, got {directory!r}")
    scheme = urllib.parse.urlparse(directory).scheme
    if scheme in ("s3", "gs"):
        from .objectstore import ObjectStore   # here, not at the top: objectstore builds on Store
        return ObjectStore(directory)
    from .localstore import LocalStore   # (as ObjectStore: it builds on Store)
    if scheme == "file":
        # the path taken literally, as object-store prefixes are: a URL parser cut "?..." and "#..."
        # off (file:///ckpt/run#2 opened /ckpt/run, another run's checkpoints)
        rest, host = directory.lstrip()[len("file:"):], ""
        if rest.startswith("//"):
            host, sep, path = rest[2:].partition("/")
            rest = sep + path
        if host not in ("", "localhost"):   # (its path was taken on this machine: file://nas/x wrote /x)
            raise ConfigError(f"{directory!r}: a file:// URL names a file on this machine (file:///path or "
                              f"file://localhost/path), not on host {host!r}; mount it and give its path")
        if not rest.strip():   # (it meant the working directory, which "" does not)
            raise ConfigError(f"{directory!r}: a file:// URL needs a path, e.g. file:///ckpt/run1")
        return LocalStore(rest)
    if scheme and len(scheme) > 1:
        raise ConfigError(f"{directory!r}: unsupported URL scheme {scheme!r} (use a path, file://, s3:// or gs://)")
    return LocalStore(directory)
