"""The blocking part of a save: classify leaves, plan the layout, and copy what will be written.

Example::

    import jax.numpy as jnp
    from ckpt_callbacks.snapshot import plan, copy
    snap = plan({"w": jnp.ones((8, 8))})
    items = []
    copy(snap, items.append)   # returns once the copies are taken; `w` may now be donated

Who calls what: `CheckpointManager.save` calls `plan` then `copy` on every process, on the caller's
thread; the background writer (`writing.write_and_commit`) consumes the copies `copy` emits (started
alongside it). Everything that depends on the caller's buffers happens here; nothing after it
reads them.

Copies: numpy leaves are copied (`np.array`; they are mutable). jax.Array shards this process
writes: on CPU, a zero-copy numpy view (the runtime does not donate a buffer while a view of it is
alive, so the view keeps the value of the call: see `_on_cpu`) -- or, when this process's host-side
bytes fit in the manager's `HostPool` (`EAGER_COPY_MAX_BYTES`), a copy at once into warm buffers
reused from save to save, so that the next donating step need not copy (in a local directory, boxes
whose chunk files can be written byte for byte are not copied but written at once, before `copy`
returns: `localwrite.WriteThrough`); elsewhere (GPU, TPU) a copy dispatched asynchronously, one
per unreplicated leaf, one per shard otherwise: into the devices' pinned host memory, where the
writer reads it (or, on devices without such memory, on the device, and the writer transfers it;
`_off_device`). With a `ByteBudget`, each copy first reserves its
bytes and the writer releases them once written, so staging memory never exceeds the budget (the
save then blocks until enough earlier shards are written).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import math
import time
from typing import Any

import jax
import msgpack
import numpy as np

from . import format as fmt
from . import layout, treepath
from .coordination import Coordinator, SingleProcess
from .errors import InvalidTreeError
from .hostmem import ByteBudget, HostPool

__all__ = ["plan", "copy", "Snapshot", "PACK_MAX_BYTES", "CHUNK_MAX_BYTES"]

PACK_MAX_BYTES = 4 << 20      # leaves up to this size are packed into msgpack blobs
CHUNK_MAX_BYTES = 64 << 20    # zarr chunks are capped at this size
BLOB_MAX_BYTES = 64 << 20     # a blob holds packed leaves up to this total
SPLIT_MIN_BYTES = 1 << 20     # with several processes, replicated shards above this are split


def _pieces(box, chunk) -> list:
    """The chunk-aligned sub-boxes (one per chunk) of `box`, whose extents the chunk divides."""
    ranges = [[(a + k, min(a + k + c, b)) for k in range(0, b - a, c)] for (a, b), c in zip(box, chunk)]
    return [tuple(p) for p in itertools.product(*ranges)]


@dataclasses.dataclass
class ArrayWrite:
    leaf: int
    box: layout.Box
    data: Any          # private copy: jax.Array (single device) or np.ndarray
    nbytes: int


@dataclasses.dataclass
class Snapshot:
    """What the writer needs; built by `plan`. Leaf records become the manifest's ``leaves``."""

    records: list                  # one dict per leaf (manifest form, filled further by the writer)
    skeleton: Any
    array_leaves: list             # leaf indices stored as zarr arrays
    process_index: int
    process_count: int
    bytes_total: int               # unique bytes of the tree (all processes)
    started: float                 # time.perf_counter() when `plan` began
    wall_started: float            # time.time() then: the save's start in SaveStats and the manifest
    blocking_s: float = 0.0
    pooled: bool = False           # host-side copies live in a HostPool: reused by a later save
    _sources: Any = None           # the caller's leaves; dropped by `copy`
    _boxes: Any = None             # (leaf, box, devices, nbytes) this process writes


def _sharding_desc(x) -> dict:
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        return {"type": "NamedSharding", "mesh": {str(k): int(v) for k, v in s.mesh.shape.items()},
                "spec": [None if p is None else (list(p) if isinstance(p, tuple) else str(p)) for p in s.spec]}
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"type": "SingleDeviceSharding"}
    if s is None:
        return {"type": "host"}
    return {"type": type(s).__name__}


def _unsavable_dtype(where: str, dtype, name: str) -> InvalidTreeError:
    """The error for a leaf whose dtype the format cannot hold: what it is (a structured dtype as
    its fields, not numpy's "void64"), what the format holds, and how to save it instead."""
    dtype = np.dtype(dtype)
    if dtype == jax.dtypes.float0:   # (a structured dtype to numpy: its advice would be to save the field)
        what = "dtype float0 (the gradient jax.grad(..., allow_int=True) gives an int or bool input; it holds no values)"
        fix = ("leave it out, or save None in its place, e.g. "
               "jax.tree.map(lambda g: None if g.dtype == jax.dtypes.float0 else g, grads)")
    elif dtype.names is not None:
        what = f"a structured dtype {dtype.descr}"
        fix = "save each field as a leaf of its own, e.g. {name: x[name] for name in x.dtype.names}"
    else:
        what = f"dtype {dtype}" + (f" ({name})" if name != str(dtype) else "")
        fix = ("save the values as Python str or bytes leaves (e.g. x.tolist()), or their encoded bytes as "
               "a uint8 array" if dtype.kind in "US" else
               "convert it to one of these dtypes (e.g. datetimes as int64 with x.astype(np.int64))")
    return InvalidTreeError(f"at {where}: {what} cannot be saved; the format can hold "
                            f"{', '.join(fmt.dtype_names())}. Fix: {fix}")


class _Where:
    """A key path's text, made only when an error message formats it (~9 us a leaf otherwise)."""

    __slots__ = ("path",)

    def __init__(self, path):
        self.path = path

    def __str__(self) -> str:
        return treepath.keystr(self.path)


def _classify(path, x) -> dict:
    """The manifest record for one leaf, without storage details."""
    where = _Where(path)
    rec: dict = {"p": [list(e) for e in path]}
    if x is None:
        rec["k"] = "none"
    elif (isinstance(x, (bool, str, bytes, float)) and not isinstance(x, np.float64)) or \
            (isinstance(x, int) and -2**63 <= x < 2**64):   # (np.float64 is a float: kept a numpy scalar below)
        if isinstance(x, str) and not treepath.encodable(x):
            raise InvalidTreeError(f"at {where}: the str {x!r} is not valid Unicode (a lone surrogate); store it "
                                   f"as bytes (e.g. x.encode('utf-8', 'surrogatepass'))")
        rec.update(k="py", v=x)
    elif isinstance(x, int):
        raise InvalidTreeError(f"at {where}: int {x} does not fit in 64 bits; store it as a str")
    elif isinstance(x, (np.ndarray, np.generic, jax.Array)):
        if isinstance(x, np.ndarray) and x.dtype == object:
            raise InvalidTreeError(f"at {where}: numpy arrays of dtype object cannot be saved")
        if isinstance(x, np.ma.MaskedArray):
            raise InvalidTreeError(f"at {where}: a numpy masked array would lose its mask; save its "
                                   f"`.data` and `np.ma.getmaskarray(x)` as two leaves")
        if x.ndim > fmt.MAX_NDIM:
            raise InvalidTreeError(f"at {where}: {x.ndim} dimensions; the format holds at most {fmt.MAX_NDIM}")
        if isinstance(x, jax.core.Tracer):   # (it has no value: `is_deleted` raised jax's ConcretizationTypeError)
            raise InvalidTreeError(f"at {where}: a traced value ({type(x).__name__}): save() was called inside "
                                   f"jax.jit, grad or vmap; call it outside, on the arrays the step returned")
        if isinstance(x, jax.Array) and x.is_deleted():
            raise InvalidTreeError(f"at {where}: this jax.Array was deleted (donated to a jitted step, or "
                                   f"`.delete()`d); save the arrays the step returned")
        rec["o"] = "jax" if isinstance(x, jax.Array) else ("numpy" if isinstance(x, np.ndarray) else "npscalar")
        if treepath.is_prng_key(x):
            rec["prng"] = str(jax.random.key_impl(x))
            rec["kshape"] = list(jax.random.key_data(x).shape[x.ndim:])
            x = jax.random.key_data(x)
        dt = fmt.dtype_name(x.dtype)
        try:
            fmt.logical_dtype(dt)
        except Exception:
            raise _unsavable_dtype(where, x.dtype, dt) from None
        rec.update(k="array", dt=dt, sh=[int(d) for d in x.shape], sd=_sharding_desc(x))
    else:
        raise InvalidTreeError(
            f"at {where}: cannot save a leaf of type {type(x).__module__}.{type(x).__qualname__}; "
            f"leaves must be jax/numpy arrays, numpy scalars, int, float, bool, str, bytes or None "
            f"(register custom containers as pytrees)")
    return rec


def plan(tree, *, coord: Coordinator | None = None,
         pack_max_bytes: int | None = None, chunk_max_bytes: int = CHUNK_MAX_BYTES) -> Snapshot:
    """Classify leaves and decide the layout and who writes what. Reads no array data.
    Leaves of at most `pack_max_bytes` (default `PACK_MAX_BYTES`) that this process holds whole
    are packed into blobs; the others become zarr arrays."""
    t0, wall = time.perf_counter(), time.time()
    pack_max_bytes = PACK_MAX_BYTES if pack_max_bytes is None else pack_max_bytes
    coord = coord or SingleProcess()
    pi, pc = coord.process_index, coord.process_count
    try:
        flat = treepath.flatten(tree)
    except TypeError as e:
        raise InvalidTreeError(str(e)) from None
    records, sources = [], []
    for path, x in zip(flat.paths, flat.leaves):
        rec = _classify(path, x)
        if rec.get("prng"):
            x = jax.random.key_data(x)
        elif isinstance(x, (np.ndarray, np.generic)) and not x.dtype.isnative:
            # stored in this machine's byte order, as the manifest's dtype name says (a copy,
            # taken now: a snapshot like any other)
            x = x.astype(x.dtype.newbyteorder("="))
        records.append(rec)
        sources.append(x)

    # decide packed vs zarr, and who writes what (identically on every process)
    pack_items, pack_leaves, box_items, box_meta = [], [], [], []
    array_leaves = []
    bytes_total = 0
    for i, (rec, x) in enumerate(zip(records, sources)):
        if rec["k"] != "py" and rec["k"] != "none":
            nbytes = math.prod(rec["sh"]) * np.dtype(x.dtype).itemsize
            bytes_total += nbytes
            is_jax = isinstance(x, jax.Array)
            whole_here = not is_jax or x.is_fully_addressable or x.is_fully_replicated
            if nbytes <= pack_max_bytes and whole_here:
                rec["k"] = "packed"
                # every process holds a copy (numpy / replicated / process-local values, assumed
                # equal on every process): the same answer on every process keeps `assign` identical
                holders = list(range(pc))
                pack_items.append((nbytes, holders))
                pack_leaves.append(i)
            else:
                rec["k"] = "array"
                rec["z"] = f"arrays/{i}"
                array_leaves.append(i)
                itemsize = np.dtype(x.dtype).itemsize
                if is_jax:
                    boxes = layout.unique_boxes(x.sharding, x.shape)
                else:
                    boxes = [(tuple((0, d) for d in x.shape), [None])]
                shard = max((layout.box_shape(b) for b, _ in boxes), key=math.prod)
                global_ = is_jax and not x.is_fully_addressable
                holders = [sorted({d.process_index for d in devs}) if global_ else list(range(pc))
                           for _, devs in boxes]
                # shards held by several processes are cut into chunk-aligned pieces, so that one
                # large replicated array is spread over the processes too (disjoint chunks each)
                shard_bytes = math.prod(shard) * itemsize
                split = pc > 1 and shard_bytes > SPLIT_MIN_BYTES and all(len(h) > 1 for h in holders)
                cap = min(chunk_max_bytes, max(SPLIT_MIN_BYTES // 4, shard_bytes // (4 * pc))) if split \
                    else chunk_max_bytes
                rec["ch"] = list(layout.chunk_shape(shard, itemsize, cap, [s == n for s, n in zip(shard, x.shape)]))
                for (b, devs), procs in zip(boxes, holders):
                    for piece in (_pieces(b, rec["ch"]) if split else [b]):
                        box_items.append((math.prod(layout.box_shape(piece)) * itemsize, procs))
                        box_meta.append((i, piece, devs))

    writers = layout.assign(box_items + pack_items, pc)
    for i, w in zip(pack_leaves, writers[len(box_items):]):
        records[i]["w"] = w
    snap = Snapshot(records, flat.skeleton, array_leaves, pi, pc, bytes_total, t0, wall)
    snap._sources = sources
    snap._boxes = [(i, b, devs, nbytes) for (i, b, devs), w, (nbytes, _)
                   in zip(box_meta, writers[:len(box_items)], box_items) if w == pi]
    return snap


def structure(snap: Snapshot) -> tuple[bytes, list[str]]:
    """(a digest, one line per leaf) of what every process must plan alike for one save, i.e. what
    decides which files hold which bytes: the tree's structure, each leaf's key path, kind, dtype
    and shape, a packed leaf's writer, an array leaf's sharding and chunking (not the value of an
    inline Python scalar, nor whether a packed value came as numpy or jax: one process's copy is
    saved). `CheckpointManager` compares the digests of all processes before a save starts:
    processes that planned different trees would write each other's files."""
    lines = []
    for r in snap.records:
        line = f"{treepath.keystr([tuple(e) for e in r['p']])}: {r['k']}"
        if "dt" in r:
            line += f" {r['dt']}{r['sh']}"
        if r["k"] == "array":
            sd = r.get("sd") or {}
            line += f" chunks {r['ch']} {sd.get('type')}" + (f" {sd.get('mesh')} {sd.get('spec')}" if "mesh" in sd else "")
        lines.append(line + "".join(f" {k}={r[k]}" for k in ("prng", "kshape", "w", "z") if k in r))
    digest = hashlib.sha256(msgpack.packb([snap.skeleton, lines])).digest()[:16]
    return digest, lines


@jax.jit
def _device_copy(x):
    return x.copy()


@functools.lru_cache(maxsize=None)
def _has_pinned_host(device) -> bool:
    return "pinned_host" in {m.kind for m in device.addressable_memories()}


def _off_device(x):
    """A copy of jax.Array `x` (not on CPU) that its buffers' later donation leaves intact,
    dispatched asynchronously: a transfer into the pinned host memory of its devices where they all
    have it (GPU, TPU: the fastest device-to-host path, and no device memory taken; the runtime
    orders the transfer before any later donation of `x`, as it would a jitted read), else an
    on-device copy, which the writer transfers."""
    if all(_has_pinned_host(d) for d in x.sharding.device_set):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"), may_alias=False)
    return _device_copy(x)


def _on_cpu(x) -> bool:
    """CPU jax arrays are snapshotted without a copy: a numpy view of the buffer. While a view is
    alive, the runtime cannot donate that buffer (a donating step then allocates a fresh output
    instead), and jax arrays are otherwise immutable, so the view keeps the value of the call.
    Other platforms copy on device (an asynchronously dispatched copy) and transfer later."""
    return isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set)


def _whole_copy(x, boxes, budget, before_wait=None) -> dict | None:
    """Off CPU, a leaf whose every addressable shard is unique and written here gets one copy
    (`_off_device`), dispatched asynchronously; its bytes are reserved at once. Returns
    {box: single-device array}, or None."""
    if not isinstance(x, jax.Array) or _on_cpu(x):
        return None
    shards = {layout.box_of(s.index, x.shape): s.device for s in x.addressable_shards}
    if len(shards) != len(x.addressable_shards) or sorted(shards) != sorted(b for b, _, _ in boxes):
        return None  # replicated somewhere, or split into pieces: copied shard by shard instead
    total = sum(n for _, _, n in boxes)
    if budget and budget.limit is not None and total > budget.limit:
        return None  # larger than the whole budget: shard by shard, so the budget holds
    if budget:
        budget.acquire(total, before_wait)
    c = _off_device(x)
    return {layout.box_of(s.index, x.shape): s.data for s in c.addressable_shards}


def _host_side(x) -> bool:
    return not isinstance(x, jax.Array) or _on_cpu(x)


def _copies(snap: Snapshot):
    """(leaf, bytes) of each copy `copy` takes on this process: its packed leaves, then its boxes."""
    pi, sources = snap.process_index, snap._sources
    for i, rec in enumerate(snap.records):
        if rec["k"] == "packed" and rec["w"] == pi:
            yield i, math.prod(rec["sh"]) * np.dtype(sources[i].dtype).itemsize
    for i, _, _, nbytes in snap._boxes:
        yield i, nbytes


def _host_bytes(snap: Snapshot) -> int:
    """Bytes of the host-side leaves (numpy, CPU jax) this process copies in `copy`."""
    return sum(nbytes for i, nbytes in _copies(snap) if _host_side(snap._sources[i]))


def _pool_limit(budget: ByteBudget | None, pool: HostPool) -> int:
    """The most host-side bytes `copy` puts in `pool` (else it keeps views)."""
    return pool.max_bytes if budget is None or budget.limit is None else min(pool.max_bytes, budget.limit)


def _wait_all(futures) -> None:
    while True:
        try:
            concurrent.futures.wait(futures)
            return
        except BaseException:  # noqa: BLE001 - e.g. KeyboardInterrupt: wait on, then let it propagate
            if all(f.done() for f in futures):
                raise


def copy(snap: Snapshot, emit, budget: ByteBudget | None = None, pool: HostPool | None = None,
         through=None) -> None:
    """Copy every leaf this process writes, in order, handing each copy to `emit`.

    `emit(("packed", leaf, array))` (an ndarray, or off CPU an asynchronous copy, `_off_device`,
    that the writer reads) or `emit(("array", ArrayWrite))`; then `emit(None)`. With a
    budget, each copy first reserves its bytes; the consumer releases them once written, so the
    copies of later leaves wait for the writes of earlier ones (before such a wait, `emit(("flush",))`
    asks the consumer to write the packed leaves it gathers for a blob: their bytes come back then).
    With a `pool`, host-side leaves are copied into its buffers when they fit (``snap.pooled`` then says so). Then `through`
    (`localwrite.WriteThrough`, local stores) is offered each host-side box of an array leaf first:
    it returns a future of the files it writes from the caller's buffer, or None (then the box is
    copied). `copy` waits for those futures and emits ``("written", ArrayWrite(leaf, box, None,
    nbytes), future)`` for each (the writer takes a failure as its own). Drops the snapshot's
    references to the caller's buffers and waits for everything that reads them before returning
    (also when it raises).
    """
    sources, pi = snap._sources, snap.process_index
    if pool is not None:
        snap.pooled = _host_bytes(snap) <= _pool_limit(budget, pool)
    eager = pool.copy_of if snap.pooled else None
    through = through if snap.pooled else None
    pending: list = []

    def flush():
        emit(("flush",))

    try:
        for i, rec in enumerate(snap.records):
            if rec["k"] == "packed" and rec["w"] == pi:
                x = sources[i]
                if eager and _host_side(x):
                    arr = eager(x)
                elif isinstance(x, jax.Array):   # a CPU view, or an asynchronous copy off the device
                    arr = np.asarray(x) if _on_cpu(x) else _off_device(x)   # buffers (the writer transfers)
                else:
                    arr = np.array(x, copy=True)
                if budget:
                    budget.acquire(arr.nbytes, flush)
                emit(("packed", i, arr))
        by_leaf: dict = {}
        for i, b, devs, nbytes in snap._boxes:
            by_leaf.setdefault(i, []).append((b, devs, nbytes))
        for i, boxes in by_leaf.items():
            x = sources[i]
            whole = _whole_copy(x, boxes, budget, flush)
            for b, devs, nbytes in boxes:
                if whole is not None:
                    emit(("array", ArrayWrite(i, b, whole.pop(b), nbytes)))
                    continue
                if isinstance(x, jax.Array):
                    mine = next(d for d in devs if d.process_index == pi)
                    shard = next(s for s in x.addressable_shards if s.device == mine)
                    sbox = layout.box_of(shard.index, x.shape)
                    piece = tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(b, sbox))
                    view = np.asarray(shard.data)[piece] if _on_cpu(x) else None
                else:
                    view = x[tuple(slice(lo, hi) for lo, hi in b)]
                fut = through(i, b, view) if through is not None and view is not None else None
                if fut is not None:
                    pending.append((fut, ArrayWrite(i, b, None, nbytes)))
                    continue
                if budget:
                    budget.acquire(nbytes, flush)
                if view is not None and eager:
                    data = eager(view)
                elif view is not None:   # a CPU jax view keeps its value (see `_on_cpu`); numpy is mutable
                    data = view if isinstance(x, jax.Array) else np.array(view, copy=True)
                elif sbox == b:
                    data = _off_device(shard.data)
                else:  # a piece of a replicated shard: the slice is a new buffer, taken now
                    data = shard.data[piece]
                emit(("array", ArrayWrite(i, b, data, nbytes)))
    finally:   # nothing reads the caller's buffers after this (not even after a KeyboardInterrupt)
        _wait_all([f for f, _ in pending])
    for fut, w in pending:
        emit(("written", w, fut))   # done; a failed write fails the save in the writer, as any write
    snap._sources = snap._boxes = None
    snap.blocking_s = time.perf_counter() - snap.started
    emit(None)
