"""The background part of a save: write the copies, make them durable, commit, report timings.

Example (what `CheckpointManager` does; most users never call this directly)::

    import queue
    import numpy as np
    from ckpt_callbacks import snapshot, writing
    from ckpt_callbacks.storage import open_store
    snap = snapshot.plan({"w": np.ones((512, 1024), np.float32), "step": 10})
    q = queue.SimpleQueue()
    snapshot.copy(snap, q.put)                       # caller's thread: the blocking part
    stats = writing.write_and_commit(open_store("/tmp/run"), 10, snap, q)   # writer thread

Who calls what, in order, on which process (every process runs this function for the same step):
  1. ``store.begin`` -> staging location; process 0 creates every zarr array's metadata
     (`_Arrays.create`); barrier.
  2. consume the queue: zarr chunk writes (local stores: `localwrite` on the `Workers` pools,
     straight from the snapshot's buffers, or already written during the snapshot by
     `WriteThrough` ("written" items: only fsynced here); else tensorstore futures) and msgpack
     blobs of packed leaves,
     releasing the byte budget as each lands; then the per-process host-state blob.
  3. ``store.sync`` this process's files (local chunk files are fsynced as each box lands, the
     rest at the end); gather every process's status, packed-leaf and chunk checksums.
  4. process 0 writes the manifest and ``store.publish``es (rename / marker) only if every process
     succeeded, else removes the staging data; the outcome is broadcast, and every process raises
     `CheckpointSaveError` (with each process's failure) when the save failed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import msgpack
import numpy as np
import tensorstore as ts

from . import format as fmt
from . import chunkwrite, layout, localwrite
from .coordination import CoordinationTimeoutError, Coordinator, SingleProcess
from .errors import CheckpointSaveError, space_hint
from .hostmem import ByteBudget
from .snapshot import BLOB_MAX_BYTES, Snapshot
from .storage import Store, submit

__all__ = ["SaveStats", "write_and_commit", "zarr_spec"]

@dataclasses.dataclass(frozen=True)
class SaveStats:
    """Timings and sizes of one save, as seen by this process (wall-clock seconds)."""

    step: int
    started: float          # time.time() when save() was called
    blocking_s: float       # snapshot: the only part that stalls the caller
    write_s: float          # from the end of the snapshot to this process's bytes being durable
    commit_s: float         # barrier + manifest + rename/marker
    total_s: float          # save() call to durable commit
    bytes_written: int      # leaf bytes written by this process (payload, without framing, manifest
                            # or host state): summed over processes it equals bytes_total
    bytes_total: int        # unique bytes of the tree (all processes)
    files: int              # files/objects written by this process
    process_index: int = 0
    peak_staging_bytes: int = 0  # most bytes of copies held at once by this process
    gc_s: float = 0.0
    deleted: tuple = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def zarr_spec(store: Store, rel: str, rec: dict) -> dict:
    """The tensorstore spec of one zarr3 array leaf (uncompressed, crc32c per chunk)."""
    return {
        "driver": "zarr3",
        "kvstore": store.kvstore(rel),
        "metadata": {
            "shape": rec["sh"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": rec["ch"]}},
            "chunk_key_encoding": {"name": "default"},
            "data_type": fmt.storage_dtype(rec["dt"]),
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
        "store_data_equal_to_fill_value": True,
    }


def _bools(a: np.ndarray) -> np.ndarray:
    """Bool data `a` with True stored as byte 1: numpy takes any nonzero byte for True (a bool view
    of other bytes); tensorstore stores the byte as it is, then refuses to read it back ("Invalid
    bool value"). On the writer thread: one scan of the bytes, a copy only where one is not 0/1."""
    if a.dtype == np.bool_ and a.size and a.view(np.uint8).max() > 1:
        return np.not_equal(a, False)
    return a


def write_and_commit(store: Store, step: int, snap: Snapshot, items, *, coord: Coordinator | None = None,
                     metrics: dict | None = None, host_state: bytes | None = None,
                     budget: ByteBudget | None = None, replace: bool = False, token: str = "0" * 12,
                     timeout_s: float = 600.0, extra: dict | None = None, workers: localwrite.Workers | None = None,
                     reuse_tree: bool = False) -> SaveStats:
    """Run the background part of a save. `items` has ``.get()`` yielding what `snapshot.copy` emits;
    `workers`: the pools to write and fsync local files on (None: started and ended here);
    `reuse_tree`: the staging directory may be a step directory that retention deleted (one
    process only, and nothing written into the staging directory before `store.begin`)."""
    if workers is None and store.local:
        workers = localwrite.Workers()
        try:
            return write_and_commit(store, step, snap, items, coord=coord, metrics=metrics, host_state=host_state,
                                    budget=budget, replace=replace, token=token, timeout_s=timeout_s, extra=extra,
                                    workers=workers, reuse_tree=reuse_tree)
        finally:
            workers.close()
    coord = coord or SingleProcess()
    pi = coord.process_index
    items = _Items(items)
    staging = None
    error = None
    written = files = 0
    packed_info: dict = {}
    chunk_crcs: dict = {}
    mine: list = []
    try:
        if store.local:   # known up front: `WriteThrough` may have written into it already
            staging = store.staging(step, token)
        if reuse_tree and coord.process_count == 1:
            staging = store.begin(step, token, lead=pi == 0, reuse_tree=True)
            # a reused directory: first only the chunk files this save will write again may stay
            # there (a leaf of another rank wants a file where a directory is, or the reverse),
            # but no padded edge chunk (tensorstore reads such a file to write it: a stale one of
            # another leaf fails the save), and the zarr.json files whose bytes this process
            # knows (`_Arrays.create` keeps those that hold them); any other zarr.json goes, for
            # tensorstore to create it anew
            keep = {f for f in _array_files(snap.records, padded=False) if not f.endswith("/zarr.json")}
            arrays = _Arrays(store, staging, snap)
            keep |= {f"{snap.records[i]['z']}/zarr.json" for i in arrays.known}
            store.prune(staging, keep | {"blobs/", "host/"}, pool=workers and workers.fsync, last=False)
        else:
            staging = store.begin(step, token, lead=pi == 0)
            arrays = _Arrays(store, staging, snap)
        _open_arrays(arrays, coord, timeout_s, f"meta/{step}/{token}")
        written, files, packed_info, chunk_crcs, mine, synced = _consume(store, staging, snap, items, arrays,
                                                                         budget, workers)
        # the zarr.json files this process created (kept ones are durable already), also of arrays
        # whose chunks are all another process's
        mine += [f"{snap.records[i]['z']}/zarr.json" for i in arrays.created if i not in arrays.kept]
        if host_state is not None:
            rel = f"host/p{pi}.msgpack"
            store.write(f"{staging}/{rel}", host_state, sync=False)   # made durable by store.sync below
            files += 1
            mine.append(rel)
        store.sync([f"{staging}/{r}" for r in mine], skip=synced, pool=workers and workers.fsync)
    except BaseException as e:  # noqa: BLE001 - reported to every process, then re-raised
        error = store.scrub(e)  # object stores: the message without endpoint or credentials
        if budget:
            budget.open()  # bytes reserved for what will never be written must not block the producer
        _drain(items, budget)
    t_written = time.perf_counter()
    status = msgpack.packb({"ok": error is None, "err": None if error is None else f"{type(error).__name__}: {error}",
                            "packed": packed_info, "cc": chunk_crcs, "host": pi if host_state is not None else None,
                            "hc": None if host_state is None else fmt.crc32c(host_state)},
                           use_bin_type=True)
    try:
        if isinstance(error, CoordinationTimeoutError):
            raise error  # a peer is gone: gathering would only wait out the timeout again
        statuses = [msgpack.unpackb(s, strict_map_key=False) for s in coord.all_gather(f"status/{step}/{token}", status, timeout_s)]
    except Exception as e:
        if pi == 0:  # only process 0 commits or removes the (shared) staging data; leftovers go at start-up
            _abort(store, staging)
        raise _save_error(e)(f"save of step {step} failed and was not committed: {e}{space_hint(str(e), store.url)}",
                             getattr(e, "failures", None) or {pi: str(e)}) from (error or e)
    failures = {p: s["err"] for p, s in enumerate(statuses) if not s["ok"]}
    outcome = b""
    if pi == 0:
        if not failures:
            try:
                manifest = _manifest(step, snap, statuses, metrics, extra)
                store.prune(staging, _files(manifest), pool=workers and workers.fsync)
                store.write(f"{staging}/{fmt.MANIFEST}", fmt.pack_manifest(manifest))
                store.publish(staging, step, replace=replace, pool=workers and workers.fsync)
            except BaseException as e:  # noqa: BLE001
                failures[0] = f"{type(e).__name__}: {e}"
                error = error or e
        if failures:
            _abort(store, staging)
        outcome = msgpack.packb(failures, use_bin_type=True)
    try:
        failures = msgpack.unpackb(coord.broadcast(f"outcome/{step}/{token}", outcome, timeout_s), strict_map_key=False)
    except Exception as e:
        raise _save_error(e)(f"save of step {step}: outcome unknown: {e}",
                             getattr(e, "failures", None) or {pi: str(e)}) from e
    if failures:
        lines = "; ".join(f"process {p}: {m}" for p, m in sorted(failures.items()))
        raise CheckpointSaveError(f"save of step {step} failed and was not committed ({lines})"
                                  f"{space_hint(lines, store.url)}", failures) from error
    now = time.perf_counter()
    return SaveStats(step=step, started=snap.wall_started, blocking_s=snap.blocking_s,
                     write_s=t_written - snap.started - snap.blocking_s, commit_s=now - t_written,
                     total_s=now - snap.started, bytes_written=written, bytes_total=snap.bytes_total,
                     files=files + (1 if pi == 0 else 0), process_index=pi,
                     peak_staging_bytes=budget.peak if budget else 0)


def _save_error(e: Exception) -> type:
    """The class a save failed by `e` raises: a coordination timeout stays one (a peer is gone)."""
    return CoordinationTimeoutError if isinstance(e, CoordinationTimeoutError) else CheckpointSaveError


def _abort(store: Store, staging: str | None) -> None:
    if staging is None:  # begin itself failed
        return
    try:
        store.abort(staging)
    except Exception:  # noqa: BLE001 - leftovers are cleaned at the next start
        pass


class _Items:
    """The producer's items, remembering whether its end (None) was taken already."""

    def __init__(self, items):
        self.items, self.ended = items, False

    def get(self):
        item = self.items.get()
        self.ended = self.ended or item is None
        return item


def _drain(items, budget):
    """After a failure: keep taking items so the producer never blocks on the budget (unless it
    has finished: a failure after the last item, e.g. a chunk write failing, must not wait)."""
    while not items.ended:
        item = items.get()
        if item is None:
            return
        if budget and item[0] in ("packed", "array"):
            budget.release(item[2].nbytes if item[0] == "packed" else item[1].nbytes)


_ZARR_JSON: dict[str, bytes] = {}   # an array's zarr metadata (as JSON) -> the zarr.json tensorstore wrote for it
_ZARR_JSON_MAX = 4096


class _Arrays:
    """The step's zarr arrays, by leaf. `create` (process 0) makes every array's zarr.json; a
    tensorstore handle is opened when a leaf is first written through tensorstore (``arrays[i]``):
    local chunk files written by `chunkwrite` need none. Local stores: tensorstore writes the
    zarr.json of each distinct metadata once per process; later saves write the same bytes (they
    depend on the metadata only), which spares a tensorstore open per array and save, or, in a
    reused staging directory (`Store.holds`), keep the deleted step's file when it holds them."""

    def __init__(self, store: Store, staging: str, snap: Snapshot):
        self.store, self.staging, self.recs, self.leaves = store, staging, snap.records, snap.array_leaves
        # local files: tensorstore need not fsync each chunk as it lands; `store.sync` fsyncs every
        # file this process wrote once all are written (one pass, before the commit)
        self.ctx = ts.Context({"file_io_sync": False}) if store.local else None
        self.handles: dict = {}
        self.created: list = []   # leaves whose zarr.json this process made (or kept)
        self.kept: set = set()    # of those, the leaves whose zarr.json a reused directory held already

    def spec(self, i: int) -> dict:
        return zarr_spec(self.store, f"{self.staging}/{self.recs[i]['z']}", self.recs[i])

    @functools.cached_property
    def keys(self) -> dict:
        """Each array leaf's `_ZARR_JSON` key: its zarr metadata as JSON (local stores, else None).
        Computed only where asked: by `create` (process 0) and for a reused directory's prune."""
        return {i: json.dumps(zarr_spec(self.store, "", self.recs[i])["metadata"], sort_keys=True)
                if self.store.local else None for i in self.leaves}

    @functools.cached_property
    def known(self) -> dict:
        """The zarr.json bytes this process already has for an array leaf's metadata, by leaf."""
        return {i: b for i, k in self.keys.items() if (b := _ZARR_JSON.get(k))}

    def create(self, leaves) -> None:
        futs = {}
        self.created = list(leaves)
        for i in leaves:
            cached = self.known.get(i)
            rel = f"{self.staging}/{self.recs[i]['z']}/zarr.json"
            if cached is not None and self.store.holds(rel, cached):
                self.kept.add(i)
            elif cached is not None:
                self.store.write(rel, cached, sync=False)
            else:
                futs[i] = (self.keys[i], ts.open(self.spec(i), create=True, open=True, context=self.ctx))
        for i, (key, fut) in futs.items():
            self.handles[i] = fut.result()
            if key is not None:
                if len(_ZARR_JSON) >= _ZARR_JSON_MAX:
                    _ZARR_JSON.clear()
                _ZARR_JSON[key] = self.store.read(f"{self.staging}/{self.recs[i]['z']}/zarr.json")

    def __getitem__(self, i: int):
        h = self.handles.get(i)
        if h is None:
            h = self.handles[i] = ts.open(self.spec(i), open=True, assume_metadata=True, context=self.ctx).result()
        return h


def _open_arrays(arrays: _Arrays, coord, timeout_s, barrier_name) -> None:
    failure = None
    if coord.process_index == 0:
        try:
            arrays.create(arrays.leaves)
        except Exception as e:  # noqa: BLE001 - the others must not wait out the barrier for it
            failure = e
    coord.barrier(barrier_name, timeout_s) if coord.process_count > 1 else None
    if failure is not None:
        raise failure


def _consume(store, staging, snap, items, arrays, budget, workers):
    written = files = 0
    futures = []
    packed_info: dict = {}
    crcs: list = []   # (leaf, box, CRCs of its chunks or the future of `_write_chunk_files`)
    blob: list = []
    blob_leaves: list = []
    blob_bytes = 0
    mine: set = set()
    nblob = 0
    early = localwrite.EarlySync(store, workers.fsync) if store.local else None
    # local stores: chunk files written straight from the snapshot's buffers (chunkwrite)
    chunk_pool = workers.chunks if store.local else None

    def flush():
        nonlocal blob, blob_leaves, blob_bytes, nblob, written, files
        if not blob:
            return
        rel = f"blobs/p{snap.process_index}-{nblob}.msgpack"
        parts, index = fmt.pack_bins(blob, align=[fmt.blob_align(b.nbytes) for b in blob])
        if chunk_pool:
            # a local store: on a chunk thread (the writer goes on meanwhile), over a deleted
            # step's blob where one is kept, fsynced early as chunk files are
            pending(submit(chunk_pool, localwrite.write_blob, store, f"{staging}/{rel}", parts, workers),
                    [f"{staging}/{rel}"], blob_bytes)
        else:
            store.write(f"{staging}/{rel}", parts, sync=False)   # store.sync(mine) makes it durable
            if budget:
                budget.release(blob_bytes)
        for j, (leaf, crc) in zip(index, blob_leaves):
            packed_info[leaf] = [rel, j, crc]
        written += blob_bytes
        files += 1
        mine.add(rel)
        nblob += 1
        blob, blob_leaves, blob_bytes = [], [], 0

    def pending(fut, rels, nbytes):
        """A write in flight: its files `rels` fsynced once it lands (local stores), its `nbytes`
        given back to the budget, and waited for before the commit."""
        if early:
            fut.add_done_callback(early.after(rels))
        if budget:
            fut.add_done_callback(lambda _f: budget.release(nbytes))
        futures.append(fut)

    try:
        while True:
            item = items.get()
            if item is None:
                break
            if item[0] == "abort":
                raise CheckpointSaveError(f"the snapshot failed: {item[1]}") from item[1]
            if item[0] == "flush":   # the snapshot waits for the budget: give the blob's bytes back
                flush()
                continue
            if item[0] == "written":   # by `WriteThrough`, during the snapshot
                _, w, done = item
                rels, _ = done.result()   # a failed write (disk full) fails the save here
                crcs.append((w.leaf, w.box, done))
                early.submit(rels)
                written += w.nbytes
                mine.update(r[len(staging) + 1:] for r in rels)
                files += len(rels)
                continue
            if item[0] == "packed":
                _, leaf, arr = item
                arr = _bools(np.asarray(arr))   # (off CPU: the device-to-host transfer, here)
                # a byte view, not a copy: msgpack copies it once, into the blob
                raw = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                blob.append(raw)
                blob_leaves.append((leaf, fmt.crc32c(raw)))
                blob_bytes += arr.nbytes
                if blob_bytes >= BLOB_MAX_BYTES:
                    flush()
                continue
            w = item[1]
            rec = snap.records[w.leaf]
            data = _bools(localwrite.to_storage(np.asarray(w.data), rec["dt"]))
            todo = localwrite.chunk_files(staging, rec, w.box, data) if chunk_pool else None
            if todo is not None:
                rels, views = todo
                fut = submit(chunk_pool, localwrite.write_chunk_files, store, rels, views)
                crcs.append((w.leaf, w.box, fut))
            else:
                rels = [f"{staging}/{rec['z']}/{fmt.chunk_key(idx)}"
                        for idx in layout.chunks_of(w.box, rec["ch"])] if early else []
                # the copy is ours and never changes (unless a later save reuses its pooled
                # buffer): tensorstore may then keep it instead of copying it again
                fut = arrays[w.leaf][tuple(slice(a, b) for a, b in w.box)].write(
                    data, can_reference_source_data_indefinitely=not snap.pooled)
                # the chunks as tensorstore stores them (here, while it writes: `data` may be a
                # pooled buffer that is released once the write lands)
                crcs.append((w.leaf, w.box, chunkwrite.chunk_crcs(rec, w.box, data)))
            pending(fut, rels, w.nbytes)
            written += w.nbytes
            if early:   # local stores: the very files (`store.sync` then walks no directory)
                mine.update(r[len(staging) + 1:] for r in rels)
            else:
                mine.add(rec["z"])
            files += max(1, int(np.prod([-(-(b - a) // c) for (a, b), c in zip(w.box, rec["ch"])])))
        flush()
        for f in futures:
            f.result()
    except BaseException:
        for f in futures:  # let started writes finish before the staging data is removed
            try:
                f.result()
            except Exception:  # noqa: BLE001 - the first failure is what gets reported
                pass
        if early:
            try:
                early.close()
            except Exception:  # noqa: BLE001 - the first failure is what gets reported
                pass
        raise
    synced = early.close() if early else set()
    chunk_crcs: dict = {}   # {leaf: {chunk number: CRC}} of the chunks this process wrote
    for leaf, box, got in crcs:
        rec = snap.records[leaf]
        got = got if isinstance(got, list) else got.result()[1]
        by_number = chunk_crcs.setdefault(leaf, {})
        for idx, crc in zip(layout.chunks_of(box, rec["ch"]), got):
            by_number[layout.chunk_number(idx, rec["sh"], rec["ch"])] = crc
    return written, files, packed_info, chunk_crcs, sorted(mine), synced


def _array_files(records, padded: bool = True) -> set:
    """The zarr.json and chunk files of the array leaves among `records` (relative to the step);
    without the chunks that stick out of their array's shape unless `padded`."""
    out = set()
    for rec in records:
        if "z" in rec:
            out.add(f"{rec['z']}/zarr.json")
            grid = layout.chunks_of([(0, n) for n in rec["sh"]], rec["ch"])
            out.update(f"{rec['z']}/{fmt.chunk_key(idx)}" for idx in grid
                       if padded or all((i + 1) * c <= n for i, c, n in zip(idx, rec["ch"], rec["sh"])))
    return out


def _files(manifest: dict) -> set:
    """Every file of the step `manifest` describes, but the manifest (relative to the step)."""
    return (set(manifest["host"].values()) | {rec["b"] for rec in manifest["leaves"] if "b" in rec}
            | _array_files(manifest["leaves"]))


def _manifest(step, snap: Snapshot, statuses, metrics, extra) -> dict:
    leaves = []
    for i, rec in enumerate(snap.records):
        rec = dict(rec)
        if rec["k"] == "packed":
            rel, j, crc = statuses[rec["w"]]["packed"][i]
            rec.update(b=rel, bi=j, crc=crc)
        elif rec["k"] == "array":
            got = {k: c for s in statuses for k, c in (s.get("cc") or {}).get(i, {}).items()}
            n = layout.chunk_count(rec["sh"], rec["ch"])
            if len(got) == n:   # every chunk is written by one process
                rec["cc"] = [got[k] for k in range(n)]
        leaves.append(rec)
    host = {p: f"host/p{p}.msgpack" for p, s in enumerate(statuses) if s["host"] is not None}
    host_crc = {p: s["hc"] for p, s in enumerate(statuses) if s["host"] is not None}
    m = {"version": fmt.FORMAT_VERSION, "step": int(step), "time": time.time(),
         "metrics": dict(metrics or {}), "process_count": snap.process_count, "tree": snap.skeleton,
         "leaves": leaves, "host": host, "host_crc": host_crc, "bytes": snap.bytes_total,
         "timings": {"started": snap.wall_started,
                     "blocking_s": snap.blocking_s, "write_s": time.perf_counter() - snap.started - snap.blocking_s}}
    if extra:
        m["extra"] = extra
    return m
