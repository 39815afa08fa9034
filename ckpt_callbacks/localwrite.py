"""How a local store's files of a save are written: the writer's thread pools, fsyncs as each file
lands, blobs through page-aligned windows, chunk files straight from the snapshot's buffers, and
the write-through of small host-side states during the snapshot.

Example (what `writing.write_and_commit` and `CheckpointManager.save` do)::

    import numpy as np
    from ckpt_callbacks import localwrite
    from ckpt_callbacks.storage import open_store
    store, workers = open_store("/tmp/run"), localwrite.Workers()
    store.begin(1, "0123456789ab")                       # the staging directory step_1.tmp-<token>
    rec = {"k": "array", "dt": "float32", "sh": [4, 8], "ch": [4, 8], "z": "arrays/0"}
    rels, views = localwrite.chunk_files(store.staging(1, "0123456789ab"), rec, [(0, 4), (0, 8)],
                                         np.ones((4, 8), np.float32))
    rels, crcs = workers.chunks.submit(localwrite.write_chunk_files, store, rels, views).result()
    store.abort(store.staging(1, "0123456789ab")); workers.close()

Who calls what: `CheckpointManager` keeps one `Workers` (its `close` closes it) and, for each save
to a local store off a disk, builds a `WriteThrough` that `snapshot.copy` calls on the caller's
thread. The writer thread (`writing.write_and_commit`) submits `write_blob` and
`write_chunk_files` to the chunk threads and fsyncs what landed through an `EarlySync` on the
fsync threads. Tasks on these pools never wait for other tasks of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import numpy as np

from . import chunkwrite
from . import format as fmt
from .hostmem import host_empty
from .snapshot import Snapshot
from .storage import Store, submit

__all__ = ["WINDOW_BYTES", "Workers", "EarlySync", "WriteThrough", "write_blob", "chunk_files",
           "write_chunk_files", "to_storage"]

WINDOW_BYTES = 1 << 20   # a blob goes to a disk through a page-aligned window of this size (256 KiB,
                         # 1 and 4 MiB: the same small-tree save times on the test VM)


def to_storage(a: np.ndarray, dt: str) -> np.ndarray:
    """`a` bit-cast to its leaf's storage dtype."""
    sdt = fmt.storage_dtype(dt)
    return a if sdt == dt else a.view(sdt)


class Workers:
    """The writer's thread pools (local stores): `chunks` writes chunk files and blobs, `fsync`
    makes them durable; and the page-aligned windows through which blobs go to a disk
    (`window`, at most one per chunk thread, kept from save to save). `CheckpointManager` keeps
    one from save to save (a save would otherwise start and end about ten threads) and closes it
    in its own `close`; `write_and_commit` called without one starts one for the call. Tasks on
    these pools never wait for other tasks of them."""

    def __init__(self):
        self.chunks = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckpt-chunk")
        self.fsync = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-fsync")
        self._windows: list = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def window(self):
        """A `WINDOW_BYTES` page-aligned buffer for `chunkwrite.write_parts`, the caller's until
        the block ends (then kept for the next caller)."""
        with self._lock:
            win = self._windows.pop() if self._windows else None
        if win is None:
            win = host_empty(WINDOW_BYTES)
        try:
            yield win
        finally:
            with self._lock:
                self._windows.append(win)

    def close(self) -> None:
        self.chunks.shutdown(wait=True)
        self.fsync.shutdown(wait=True)
        self._windows.clear()


class EarlySync:
    """fsync each box's chunk files, and on a disk each blob, as soon as they are written (local
    stores only), on the `fsync` pool, so the device flushes early leaves while later ones are
    still being written; the final `store.sync` then skips what is done. Errors re-raise from
    `close` (the save fails)."""

    def __init__(self, store: Store, pool):
        self.store, self.pool, self.done = store, pool, set()
        self.futures: list = []
        self.lock = threading.RLock()   # re-entered where the pool runs `_sync` on this thread (at exit)
        self.closed = False

    def _sync(self, rel: str) -> None:
        self.store.sync([rel])   # one file: fsynced on this thread
        with self.lock:
            self.done.add(rel)

    def submit(self, rels: list) -> None:
        """fsync the chunk files `rels`, just written (unless `close` was called: then the final
        sync does; on a memory file system, where an fsync does nothing, they are done at once)."""
        with self.lock:
            if self.store.in_memory:
                self.done.update(rels)
            elif not self.closed:
                self.futures += [submit(self.pool, self._sync, r) for r in rels]

    def after(self, rels: list):
        """A done-callback for the write future of the box whose chunk files are `rels`."""
        def cb(fut):
            if not fut.cancelled() and fut.exception() is None:
                self.submit(rels)
        return cb

    def close(self) -> set:
        """Wait for every fsync started; the relative paths made durable (a late box is left to
        the final sync)."""
        with self.lock:
            self.closed = True
        concurrent.futures.wait(self.futures)
        for f in self.futures:
            f.result()
        return self.done


def write_blob(store: Store, rel: str, parts: list, workers: Workers) -> None:
    """Write a blob file (`format.pack_bins`'s buffers) of a local store, over a deleted step's
    file of its size where one is kept (`store.claim`); on a disk through one of the writer's
    windows. Not fsynced here (`EarlySync` does, once the write has succeeded)."""
    path = store.path(rel)
    if not store.direct_io:
        chunkwrite.write_parts(path, parts, direct=False, claim=store.claim)
        return
    with workers.window() as win:
        if not chunkwrite.write_parts(path, parts, win, direct=True, claim=store.claim):
            store.direct_io = False   # this file system refused O_DIRECT: not asked again


def chunk_files(staging: str, rec: dict, box, data: np.ndarray) -> tuple[list, list] | None:
    """The chunk files (relative paths) of `box` and the views of `data` they hold, or None where
    `chunkwrite` cannot write them byte for byte."""
    todo = chunkwrite.pieces(rec, box, data)
    if todo is None:
        return None
    return [f"{staging}/{rec['z']}/{k}" for k, _ in todo], [v for _, v in todo]


def write_chunk_files(store: Store, rels: list, views: list, claimed: list | None = None) -> tuple[list, list]:
    """Write chunk files (fsynced later, by the writer): over the kept files `claimed` (one per
    file, already the caller's), else over any kept file of the right size that is left.
    Returns `rels` and the files' CRCs."""
    crcs = []
    for j, (rel, view) in enumerate(zip(rels, views)):
        claim = store.claim if claimed is None else (lambda _n, _p, old=claimed[j]: old)
        crc, direct = chunkwrite.write_chunk(store.path(rel), view, sync=False, claim=claim, direct=store.direct_io)
        crcs.append(crc)
        if not direct:
            store.direct_io = False   # this file system refused O_DIRECT: not asked again
    return rels, crcs


class WriteThrough:
    """`snapshot.copy`'s `through` for a local store off a local disk (not ``store.direct_io``:
    tmpfs, network or FUSE mounts; on a disk the pool's copies go by O_DIRECT and leave almost no
    cached pages to overwrite): the chunk files of a host-side box (numpy, CPU jax) are written at
    once, straight from the caller's buffer, on the chunk threads, over the files of a step that
    retention deleted (the steady state of a run with `KeepLast`), or on a memory file system as
    new files, instead of copying the box and writing the copy later: the state crosses memory
    once instead of twice. Elsewhere a box without such files is declined (copied, and written
    later).
    `copy` waits for these writes before the save returns, so the caller may donate or mutate its
    buffers as usual; the writer then fsyncs the files, commits and retains as for any other box.

    Who calls what: `CheckpointManager.save` builds one per save (such stores, every process;
    it acts only where the snapshot goes to the HostPool, i.e. small host-side states, and off a
    memory file system only over files kept by this process's store: retention deletes on
    process 0, so with several processes the others decline every box there) and hands it to
    `snapshot.copy` on the caller's thread; the files land in the staging directory that the
    writer thread's ``store.begin`` names (created by whichever comes first)."""

    def __init__(self, store: Store, step: int, token: str, snap: Snapshot, workers: Workers):
        self.store, self.snap, self.pool = store, snap, workers.chunks
        self.staging = store.staging(step, token)

    def __call__(self, leaf: int, box, data: np.ndarray):
        rec = self.snap.records[leaf]
        todo = chunk_files(self.staging, rec, box, to_storage(data, rec["dt"]))
        if todo is None:
            return None
        rels, views = todo
        claimed = self.store.claim_all([chunkwrite.file_bytes(v) for v in views])
        if claimed is None and not self.store.in_memory:
            # Elsewhere (a network or FUSE mount) only over a deleted step's files: creating a
            # file may wait for a server, and the caller would wait for it.
            return None
        # In memory (tmpfs) fresh files too: their pages are filled once, here, where a copy
        # would fill a pool buffer first and new file pages later, in the background, anyway.
        return submit(self.pool, write_chunk_files, self.store, rels, views, claimed)
