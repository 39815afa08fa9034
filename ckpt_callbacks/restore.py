"""Reading checkpoints back, driven by the target: each process reads only what its shards need.

Example::

    import jax, jax.numpy as jnp
    import ckpt_callbacks as cc
    from ckpt_callbacks.restore import restore, read_manifest
    from ckpt_callbacks.storage import open_store
    with cc.CheckpointManager("/tmp/run") as m:        # (a step 10 to read)
        m.save(10, {"w": jnp.ones((8, 8))}, force=True)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract_state = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=one)}
    store = open_store("/tmp/run")
    tree = restore(store, 10)                          # host numpy leaves, saved structure
    tree = restore(store, 10, target=abstract_state)   # onto the target's shardings, its classes

Who calls what: `CheckpointManager.restore` on every process. The manifest is read and validated
first; then leaves are read on a few threads. Per array leaf, each process reads only what its
target shards need: each distinct shard is read into its own 64-byte-aligned buffer, all of a
leaf's cut from one allocation (CPU devices adopt each without a copy). From a local directory `chunkread` reads the chunk files
itself, each once (straight into the buffer when a chunk lies whole inside one shard, else split
between the shards that share it); otherwise tensorstore reads them, through a small per-leaf
chunk cache when shards cut through chunks. Packed leaves come from their blob. Host buffers
go to their devices in one batched `jax.device_put`. crc32c checksums are verified on
every chunk and packed leaf read, and each chunk's against the one the manifest records for it
(so a chunk file of another save is refused, not restored).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import threading

import jax
import msgpack
import numpy as np
import tensorstore as ts

from . import format as fmt
from . import chunkread, layout, localfs, targets, treepath
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError,
                     InvalidTreeError, StorageUnavailableError, read_failure)
from .storage import Store, submit

log = logging.getLogger("ckpt_callbacks")

__all__ = ["restore", "read_manifest", "read_host_state", "leaf_reader", "changed", "deleted_error"]


def read_manifest(store: Store, step: int) -> dict:
    rel = f"{fmt.step_name(step)}/{fmt.MANIFEST}"
    where = f"{store.url.rstrip('/')}/{rel}"   # (an object store's url ends with "/")
    try:
        data = store.read(rel)
    except OSError as e:
        if isinstance(e, (CheckpointNotFoundError, StorageUnavailableError)):
            raise
        raise CorruptCheckpointError(f"{where} cannot be read: {e}") from None   # e.g. EIO
    m = fmt.unpack_manifest(data, where=where)
    if m["step"] != step:   # an intact manifest, checksum and all, of another step: never its data
        raise CorruptCheckpointError(
            f"{where} is the manifest of step {m['step']}, not of step {step}: the step's directory (or "
            f"its manifest) was renamed, swapped or copied from another step. Fix: restore another step, "
            f"or give the directory back its own name ({fmt.step_name(m['step'])})")
    return m


def read_host_state(store: Store, step: int, manifest: dict, process_index: int):
    name = manifest.get("host", {}).get(process_index)
    if name is None:
        return None
    try:
        data = store.read(f"{fmt.step_name(step)}/{name}")
    except CheckpointNotFoundError:   # the manifest names it: a committed step lost it (not "nothing saved")
        raise CorruptCheckpointError(f"host state of process {process_index} ({name}) is missing") from None
    except StorageUnavailableError:
        raise
    except OSError as e:   # e.g. a directory in its place, EIO: damage, as for a manifest
        raise CorruptCheckpointError(f"host state of process {process_index} ({name}) cannot be read: {e}") from None
    crc = (manifest.get("host_crc") or {}).get(process_index)
    if crc is not None and fmt.crc32c(data) != crc:
        raise CorruptCheckpointError(f"host state of process {process_index} ({name}) is damaged: "
                                     f"checksum mismatch")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=fmt._no_ext)
    except Exception as e:
        raise CorruptCheckpointError(f"host state of process {process_index} ({name}) is damaged: {e}") from None


class leaf_reader:
    """Reads leaves of one step; caches packed blobs. Used by restore and by `verify`."""

    def __init__(self, store: Store, step: int, manifest: dict):
        self.store, self.step, self.m = store, step, manifest
        self.base = fmt.step_name(step)
        self._blobs: dict = {}
        self._lock = threading.Lock()   # leaves are restored from several threads
        self._loading: dict = {}        # one lock per blob: different blobs load in parallel
        self.meta: dict = {}            # array dir -> its zarr metadata (`array` reads it, `chunkread.direct` asks)

    def _blob(self, rel: str, where: str) -> tuple:
        with self._lock:
            lock = self._loading.setdefault(rel, threading.Lock())
        with lock:
            return self._load_blob(rel, where)

    def prefetch(self, recs: list) -> None:
        """Load every blob of `recs` at once, on a few threads (leaves then only slice them)."""
        first: dict = {}
        for r in recs:
            if r["k"] == "packed":
                first.setdefault(r["b"], treepath.keystr(tuple(map(tuple, r["p"]))))
        _map(lambda rel: self._blob(rel, first[rel]), list(first))

    def _load_blob(self, rel: str, where: str):
        if rel not in self._blobs:
            try:
                buf = self._read_aligned(f"{self.base}/{rel}")
            except (FileNotFoundError, CheckpointNotFoundError):
                raise CorruptCheckpointError(f"{where}: blob {rel} is missing", where) from None
            except (OSError, ValueError) as e:
                raise read_failure(e, where, f"blob {rel}", str(e), f"{where}: blob {rel} cannot be read: {e}") from None
            try:
                entries = fmt.bin_entries(buf)
            except ValueError as e:
                raise CorruptCheckpointError(f"{where}: blob {rel} is damaged (not a msgpack array of bins: {e})",
                                             where) from None
            self._blobs[rel] = (buf, entries)
        return self._blobs[rel]

    def _read_aligned(self, rel: str) -> np.ndarray:
        """A whole file in one aligned buffer: packed leaves are views of it (blobs written with
        aligned entries then go to CPU devices without a copy). The buffer lives as long as any
        array restored from it: keeping one small restored leaf keeps its blob (≤ 64 MiB)."""
        if not self.store.local:
            data = self.store.read(rel)
            buf = chunkread.aligned_empty((len(data),), np.uint8)
            buf[:] = np.frombuffer(data, np.uint8)
            return buf
        with localfs.open_file(self.store.path(rel)) as f:
            size = os.fstat(f.fileno()).st_size
            buf = chunkread.aligned_empty((size,), np.uint8)
            if f.readinto(memoryview(buf)) != size:
                raise ValueError("it changed size while being read")
        return buf

    def packed(self, rec: dict, writable: bool = True) -> np.ndarray:
        where = treepath.keystr(tuple(map(tuple, rec["p"])))
        buf, entries = self._blob(rec["b"], where)
        if not isinstance(rec["bi"], int) or not 0 <= rec["bi"] < len(entries):
            raise CorruptCheckpointError(f"{where}: entry {rec['bi']} missing from blob {rec['b']}", where)
        off, n = entries[rec["bi"]]
        raw = buf[off:off + n]
        if fmt.crc32c(raw) != rec["crc"]:
            raise CorruptCheckpointError(f"{where}: checksum mismatch in {rec['b']} (the data is damaged)", where)
        dt = fmt.logical_dtype(rec["dt"])
        if n != math.prod(rec["sh"]) * dt.itemsize:
            raise CorruptCheckpointError(f"{where}: {n} bytes stored, shape {rec['sh']} needs "
                                         f"{math.prod(rec['sh']) * dt.itemsize}", where)
        out = raw.view(fmt.storage_dtype(rec["dt"])).view(dt).reshape(rec["sh"])
        if writable:
            return out.copy()
        out.flags.writeable = False   # views of the blob feed device transfers (CPU devices adopt them)
        return out

    def array(self, rec: dict, cache_bytes: int = 0):
        """The opened tensorstore of an array leaf (metadata checked against the manifest).

        ``cache_bytes`` > 0 keeps up to that many decoded chunk bytes, so reading several boxes
        that share chunks decodes (and reads) each chunk once."""
        where = treepath.keystr(tuple(map(tuple, rec["p"])))
        raw = None   # the zarr.json bytes, where they are read here anyway (see `chunkread.metadata`)
        if self.store.local:   # tensorstore would wait forever in open() on a FIFO there
            meta = self.store.path(f"{self.base}/{rec['z']}/zarr.json")
            try:
                with localfs.open_file(meta) as f:
                    raw = f.read(chunkread.ZARR_JSON_MAX_BYTES + 1)
            except (OSError, ValueError) as e:   # (FileNotFoundError: tensorstore says it below)
                if not isinstance(e, FileNotFoundError):
                    raise read_failure(e, where, f"{rec['z']}/zarr.json", str(e),
                                       f"{where}: {rec['z']}/zarr.json cannot be read: {e}") from None
        spec = {"driver": "zarr3", "kvstore": self.store.kvstore(f"{self.base}/{rec['z']}"),
                "fill_missing_data_reads": False, "open": True}
        ctx = None
        if cache_bytes:
            spec["recheck_cached_data"] = False   # a committed step never changes
            ctx = ts.Context({"cache_pool": {"total_bytes_limit": int(cache_bytes)}})
        try:
            arr = ts.open(spec, context=ctx).result()
        except Exception as e:
            detail = self.store.redact(str(e))[:300]
            raise read_failure(e, where, f"array {rec['z']}", detail,
                               f"{where}: cannot open array {rec['z']}: {detail}") from None
        chunks = list(arr.chunk_layout.read_chunk.shape or [])   # None for a 0-d array
        if (list(arr.shape) != rec["sh"] or arr.dtype.numpy_dtype != np.dtype(fmt.storage_dtype(rec["dt"]))
                or chunks != rec["ch"]):
            raise CorruptCheckpointError(f"{where}: array metadata {list(arr.shape)} {arr.dtype} chunks {chunks} "
                                         f"disagrees with the manifest {rec['sh']} {rec['dt']} {rec['ch']}", where)
        if raw is None and not self.store.local:   # one more request per array: the spec leaks (`chunkread.metadata`)
            try:
                raw = self.store.read(f"{self.base}/{rec['z']}/zarr.json")
            except CheckpointError:
                raw = None   # tensorstore read it a moment ago: its spec says the same
        self.meta[rec["z"]] = meta = chunkread.metadata(arr, raw)
        codecs = meta.get("codecs") or [{}]
        # the format's codecs only: every chunk checksummed (never read unchecked), little-endian
        # bytes (zarr.json has no checksum of its own: another codec there is damage, not a format)
        if (len(codecs) != 2 or codecs[0].get("name") != "bytes" or codecs[1] != {"name": "crc32c"}
                or (codecs[0].get("configuration") or {}).get("endian", "little") != "little"):
            raise CorruptCheckpointError(f"{where}: array {rec['z']} has codecs {codecs}; the format has "
                                         f"little-endian bytes then crc32c", where)
        self._check_backing(rec, where)
        return arr

    def _check_backing(self, rec: dict, where: str) -> None:
        """Refuse arrays whose stored chunks cannot hold the declared shape, before allocating."""
        stored = None
        if self.store.local:
            root = self.store.path(f"{self.base}/{rec['z']}")
            try:
                kv = ts.KvStore.open(self.store.kvstore(f"{self.base}/{rec['z']}")).result()
                keys = _chunk_keys(kv.list().result())
                stored = sum(os.path.getsize(os.path.join(root, k.decode())) for k in keys)
            except (OSError, ValueError) as e:
                raise read_failure(e, where, f"the chunk list of {rec['z']}", str(e),
                                   f"{where}: the chunks of {rec['z']} cannot be listed: {e}") from None
        else:  # list from the store's root: listing a sub-path gcs kvstore aborts tensorstore (std::out_of_range)
            base = f"{self.base}/{rec['z']}/"
            keys = _chunk_keys([k[len(base):].encode() for k in self.store._list(base + "c")])
        need = layout.chunk_count(rec["sh"], rec["ch"])
        chunk_bytes = fmt.chunk_nbytes(rec)
        if len(keys) != need or (stored is not None and stored < need * chunk_bytes):
            raise CorruptCheckpointError(
                f"{where}: {rec['z']} declares {rec['sh']} ({need} chunks, {need * chunk_bytes} bytes) but holds "
                f"{len(keys)} chunk files{'' if stored is None else f' ({stored} bytes)'}: missing or truncated data",
                where)

    def read_box(self, rec: dict, box, writable: bool = True) -> np.ndarray:
        if rec["k"] == "packed":
            full = self.packed(rec, writable)
            return full[tuple(slice(a, b) for a, b in box) or ...]   # `...`: a 0-d array stays an array
        return self.read_boxes(rec, [box])[0]

    def read_boxes(self, rec: dict, boxes: list) -> list:
        """One new 64-byte-aligned buffer per box of array leaf `rec`, all views of one allocation
        (`chunkread.aligned_slab`; a CPU device adopts each without another copy, while
        `jax.device_put` copies misaligned host arrays)."""
        where = treepath.keystr(tuple(map(tuple, rec["p"])))
        shared = not all(_aligned(b, rec["ch"], rec["sh"]) for b in boxes)
        nbytes = math.prod(rec["sh"]) * np.dtype(fmt.storage_dtype(rec["dt"])).itemsize
        # boxes that cut through chunks share them: tensorstore's chunk cache reads each once
        arr = self.array(rec, cache_bytes=min(nbytes, CHUNK_CACHE_BYTES) if shared else 0)
        # allocated only once the stored chunks are known to hold the declared shape
        outs = chunkread.aligned_slab([layout.box_shape(b) for b in boxes], fmt.storage_dtype(rec["dt"]))
        if self.store.local and chunkread.direct(arr, self.meta[rec["z"]]):
            chunkread.read_boxes(self.store.path(f"{self.base}/{rec['z']}"), rec, boxes, outs, where)
        else:
            # the chunks' CRCs, in flight while the data is read (one more request per chunk)
            crcs = self._read_crcs(arr, rec, [idx for b in boxes for idx in layout.chunks_of(b, rec["ch"])])
            for b, out in zip(boxes, outs):
                try:   # decoded straight into our buffer
                    ts.array(out).write(arr[tuple(slice(lo, hi) for lo, hi in b)]).result()
                except Exception as e:
                    detail = self.store.redact(str(e))[:300]
                    raise read_failure(e, where, rec["z"], detail,
                                       f"{where}: reading {rec['z']} failed (damaged or missing chunk): {detail}") from None
            self._check_crcs(crcs, rec, where)
        return [out.view(fmt.logical_dtype(rec["dt"])) for out in outs]

    def check_recorded(self, arr, rec: dict, idxs: list, where: str) -> None:
        """Compare the stored CRC of each chunk `idxs` of the opened array `arr` (its last 4
        bytes, one ranged read each, all in flight at once) with the one the manifest records
        (`chunkread.check_recorded`); tensorstore checked each chunk's bytes against their CRC
        as it read them. For what tensorstore reads (object stores: twice the requests of the
        data alone, the extra ones of 4 bytes); `chunkread` checks its own."""
        self._check_crcs(self._read_crcs(arr, rec, idxs), rec, where)

    @staticmethod
    def _read_crcs(arr, rec: dict, idxs: list) -> list:
        if not rec.get("cc"):
            return []
        at = fmt.chunk_nbytes(rec)
        return [(idx, arr.kvstore.read(fmt.chunk_key(idx), byte_range=slice(at, at + 4))) for idx in dict.fromkeys(idxs)]

    def _check_crcs(self, reads: list, rec: dict, where: str) -> None:
        recorded = rec.get("cc")
        for idx, fut in reads:
            chunk = f"{rec['z']}/{fmt.chunk_key(idx)}"
            try:
                got = fut.result()
            except Exception as e:
                detail = self.store.redact(str(e))[:300]
                raise read_failure(e, where, chunk, detail, f"{where}: reading the CRC of {chunk} failed: {detail}") from None
            if got.state != "value" or len(got.value) != 4:
                raise CorruptCheckpointError(f"{where}: chunk {chunk} is missing or truncated", where)
            chunkread.check_recorded(int.from_bytes(got.value, "little"),
                                     recorded[layout.chunk_number(idx, rec["sh"], rec["ch"])], chunk, where)


def _chunk_keys(keys: list) -> list:
    """The chunk keys among the keys of an array's directory (a 0-d array's one chunk is "c")."""
    return [k for k in keys if k == b"c" or k.startswith(b"c/")]


def _host_value(rec: dict, data: np.ndarray):
    if rec.get("prng"):
        return jax.random.wrap_key_data(data, impl=rec["prng"])
    if rec.get("o") == "npscalar":
        return data[()]
    return data


def restore(store: Store, step: int, target=None, partial: bool = False):
    """Restore step `step`; see the module docstring. Raises IncompatibleCheckpointError listing every
    mismatched key path, CorruptCheckpointError naming the damaged leaf, CheckpointNotFoundError
    when the step is deleted (or replaced) while it is being read. With `partial`, the saved leaves
    that `target` lacks are neither required nor restored (every leaf it has must still match; a
    packed blob is read whole when it holds one of the target's leaves).

    A writer's retention may delete the step meanwhile (another process training on, or this
    one's save in flight), and in a local directory the next save then writes over its chunk
    files in place, checksums and all: a reader holding them open would get the new step's bytes.
    So the step's files are identified (`Store.step_token`) before and after reading, and a
    restore whose step changed under it raises instead of returning what it read."""
    token = store.step_token(step)
    m = read_manifest(store, step)   # a step that is not there raises here, as it is
    try:
        out = _restore(store, step, target, m, partial)
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:
        if changed(store, step, token):
            raise deleted_error(store, step) from e   # its files went: not damage
        raise
    if token is not None and store.step_token(step) != token:
        raise deleted_error(store, step)
    return out


def changed(store: Store, step: int, token) -> bool:
    """Whether `step` was deleted or replaced since its `Store.step_token` was `token` (a reader's
    failure then says that its files went, not that the step is damaged)."""
    return token is not None and store.step_token(step) != token or step not in store.committed_steps()


def deleted_error(store: Store, step: int) -> CheckpointNotFoundError:
    e = CheckpointNotFoundError(
        f"step {step} in {store.url} was deleted or replaced while it was being restored (by a writer's "
        f"retention, or a forced save of that step); nothing was returned. Fix: restore a step that "
        f"retention keeps, or restore after the writer's wait_until_finished()")
    e.deleted = True   # `CheckpointManager.restore`: not a committed step's missing manifest
    return e


def _restore(store: Store, step: int, target, m: dict, partial: bool = False):
    recs = m["leaves"]
    reader = leaf_reader(store, step, m)
    if target is None:
        reader.prefetch(recs)
        leaves = _map(lambda rec: _restore_leaf(reader, rec, None), recs)
        return treepath.rebuild(m["tree"], leaves)
    try:
        flat = treepath.flatten(target)
    except TypeError as e:   # a key or nesting no checkpoint can hold (save refuses them alike)
        raise InvalidTreeError(f"step {step}: the restore target cannot match any checkpoint: {e}. Fix: "
                               f"restore onto a target built like the saved state, or pass target=None") from None
    order = treepath.match([r["p"] for r in recs], flat.paths, partial)
    tleaves = [targets.concrete(t) for t in flat.leaves]
    problems = [p for i, t, path in zip(order, tleaves, flat.paths)
                if (p := targets.check(recs[i], t, treepath.keystr(path)))]
    if problems:
        lines = "\n".join(f"  {w}: checkpoint has {a}, target expects {b}" for w, a, b in problems[:50])
        raise IncompatibleCheckpointError(
            f"step {step}: {len(problems)} leaf/leaves do not fit the target (kind, shape, dtype, PRNG "
            f"implementation, or what jax can make):\n{lines}\n"
            f"Fix: restore onto a target built like the saved state, or pass target=None.", problems)
    for where, saved, wanted in treepath.class_changes(m["tree"], flat.skeleton):
        log.warning("ckpt_callbacks: step %d: %s was saved as a %s and is restored into the target's %s "
                    "(the same fields, so nothing refuses it); check that this is the state you meant, "
                    "e.g. that the optimizer did not change", step, where, saved, wanted)
    reader.prefetch([recs[i] for i in order] if partial else recs)
    leaves = _put(_map(lambda it: _restore_leaf(reader, recs[it[0]], it[1]), list(zip(order, tleaves))))
    leaves = [_weak_as(v, t) for v, t in zip(leaves, tleaves)]
    treedef = jax.tree_util.tree_structure(target, is_leaf=lambda x: x is None)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class _Put(tuple):
    """A whole host array bound for a fully addressable sharding: transferred in one batch."""

    def __new__(cls, host, sharding):
        return super().__new__(cls, (host, sharding))


class _Shards(tuple):
    """Per-device host buffers of one array: transferred in one batch, then assembled."""

    def __new__(cls, shape, sharding, pieces):
        return super().__new__(cls, (shape, sharding, pieces))


CHUNK_CACHE_BYTES = 256 << 20   # per leaf being restored, only when target shards cut through chunks


def _aligned(box, chunks, shape) -> bool:
    return all(lo % c == 0 and (hi % c == 0 or hi == n) for (lo, hi), c, n in zip(box, chunks, shape))


def _put(leaves: list) -> list:
    """Replace every `_Put` and `_Shards` by its jax.Array, with one batched `jax.device_put` (far
    cheaper than one call per leaf or shard when there are many of them)."""
    puts = [i for i, x in enumerate(leaves) if isinstance(x, _Put)]
    shards = [i for i, x in enumerate(leaves) if isinstance(x, _Shards)]
    hosts = [leaves[i][0] for i in puts] + [h for i in shards for _, h in leaves[i][2]]
    dests = [leaves[i][1] for i in puts] + [d for i in shards for d, _ in leaves[i][2]]
    if not hosts:
        return leaves
    arrays = iter(jax.device_put(hosts, dests))
    for i in puts:
        leaves[i] = next(arrays)
    for i in shards:
        shape, sharding, pieces = leaves[i]
        leaves[i] = jax.make_array_from_single_device_arrays(shape, sharding, [next(arrays) for _ in pieces])
    return leaves


def _map(fn, items: list) -> list:
    """`fn` over items on a few threads: tensorstore reads and device transfers overlap. The
    items go in runs of consecutive ones (about 8 per thread; one each where there are few), so
    that 20,000 small leaves are not 20,000 tasks of a pool. Under the caller's `jax_enable_x64`
    and `jax_default_device` (a ``jax.enable_x64`` or ``jax.default_device`` block holds for its
    own thread only: without them there, the workers' transfers would narrow 64-bit leaves and put
    placement-free leaves on another device)."""
    if len(items) < 2:
        return [fn(x) for x in items]
    x64, device = jax.config.jax_enable_x64, jax.config.jax_default_device
    enable_x64 = getattr(jax, "enable_x64", None)   # (older jax: only jax.experimental's)
    if enable_x64 is None:
        from jax.experimental import enable_x64
    threads = min(8, len(items))
    size = max(1, len(items) // (8 * threads))

    def as_caller(run):
        with enable_x64(x64), jax.default_device(device):
            return [fn(x) for x in run]

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        # (`submit`: on this thread once interpreter exit has stopped the pools)
        futures = [submit(pool, as_caller, items[i:i + size]) for i in range(0, len(items), size)]
        return [y for f in futures for y in f.result()]


def _restore_leaf(reader: leaf_reader, rec: dict, t):
    if rec["k"] == "none":
        return None
    kind = targets.kind(t)
    if rec["k"] == "py":
        return rec["v"] if kind not in ("numpy", "jax") else _py_onto(rec["v"], t, kind)
    full = tuple((0, d) for d in rec["sh"])
    if kind in ("host", "numpy") or (kind == "jax" and _placement_free(t)):
        data = reader.read_box(rec, full)
        if kind == "numpy":
            value = _like_numpy_target(data, t)
        else:
            value = _host_value(rec, data)
            if t is not None and kind == "host" and isinstance(value, np.ndarray) and value.shape == ():
                value = value[()]   # a Python number's place: a numpy scalar, hashable, immutable
        return jax.device_put(value) if kind == "jax" and not rec.get("prng") else value
    sharding = t.sharding
    if rec.get("prng"):
        return _restore_keys(rec, reader.read_box(rec, full), sharding)
    shape = tuple(rec["sh"])
    dmap = sharding.addressable_devices_indices_map(shape)
    boxes = [layout.box_of(idx, shape) for idx in dmap.values()]
    if rec["k"] == "array" and boxes:
        # read each distinct target shard into its own aligned buffer (all cut from one allocation
        # per leaf), which then goes to its device as it is (no whole array + slices)
        distinct = list(dict.fromkeys(boxes))
        hosts = dict(zip(distinct, reader.read_boxes(rec, distinct)))
        return _Shards(shape, sharding, [(_in_memory_of(sharding, d), hosts[b]) for d, b in zip(dmap, boxes)])
    if not boxes:
        host, bbox = None, full
    else:
        bbox = layout.bounding(boxes)
        host = reader.read_box(rec, bbox, writable=False)
        if bbox == full and sharding.is_fully_addressable:
            return _Put(host, sharding)

    def cb(index):
        b = layout.box_of(index, shape)
        return host[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(b, bbox))]

    return jax.make_array_from_callback(shape, sharding, cb)


def _in_memory_of(sharding, device):
    """Where one shard of an array of `sharding` goes: `device` itself, or, where the sharding
    names a memory other than the device's default (``memory_kind="pinned_host"``: an optimizer
    state offloaded to host memory), that memory of it. (A shard put on the device's default
    memory made jax refuse to assemble the array: "Memory kind mismatch", naming no leaf.)"""
    kind = sharding.memory_kind
    if kind is None or kind == device.default_memory().kind:
        return device
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def _weak_as(value, t):
    """`value` weakly typed where the target leaf is (`jnp.asarray(0.9)`, a TrainState's `step`
    after a jitted step, `ShapeDtypeStruct(..., weak_type=True)`). jax promotes weak types
    differently (weak float32 * bfloat16 is bfloat16; float32 * bfloat16 is float32): restored
    strong, such a leaf would change the training's dtypes after a resume. Same values, same
    placement."""
    if not getattr(t, "weak_type", False) or not isinstance(value, jax.Array) or value.weak_type:
        return value
    return _weakly_typed()(value, value.dtype, True)


@functools.cache
def _weakly_typed():
    """jax's conversion that sets weak_type, jitted once per process (no public API sets it)."""
    from jax._src.lax.lax import _convert_element_type
    return jax.jit(_convert_element_type, static_argnums=(1, 2))


def _placement_free(t) -> bool:
    """Whether target leaf `t` leaves its placement to jax: a ShapeDtypeStruct without a sharding,
    or an array never put on a device explicitly (``jnp.zeros(())``: an optimizer's `count`). Its
    value comes back the same (uncommitted, on the default device), so that jit may still move it
    next to the sharded arrays it meets; pinned to that device it would fail the first step."""
    if isinstance(t, jax.Array):
        return not t.committed
    return getattr(t, "sharding", None) is None


def _like_numpy_target(value: np.ndarray, t):
    """`value` as a numpy scalar where the target leaf is one (`np.float32(0)`), else as the array,
    in the target's byte order (a big-endian ``>f4`` target matches a saved float32 by name: it
    came back little-endian)."""
    if isinstance(t, np.generic):
        return value[()]
    return value if value.dtype == t.dtype else value.astype(t.dtype)


def _py_onto(v, t, kind: str):
    """A saved Python number as the 0-d array target `t` asks for (see `targets.check`)."""
    value = np.asarray(v, np.dtype(t.dtype))
    if kind == "numpy":
        return _like_numpy_target(value, t)
    if _placement_free(t):
        return jax.device_put(value)
    return jax.make_array_from_callback((), t.sharding, lambda idx: value[idx])


def _restore_keys(rec: dict, data: np.ndarray, sharding):
    """Typed PRNG keys onto `sharding`. A sharding spanning other processes cannot take a host
    value (`device_put`), so the key data is built as a global array and wrapped under jit."""
    wrap = functools.partial(jax.random.wrap_key_data, impl=rec["prng"])
    if sharding.is_fully_addressable or not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.device_put(wrap(data), sharding)
    nk = len(rec.get("kshape", []))
    spec = list(sharding.spec) + [None] * (data.ndim - nk - len(sharding.spec)) + [None] * nk
    dsharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    garr = jax.make_array_from_callback(data.shape, dsharding, lambda idx: data[idx])
    return jax.jit(wrap, out_shardings=sharding)(garr)
