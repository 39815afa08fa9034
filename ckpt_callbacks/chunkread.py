"""Reading whole zarr3 chunks of a local checkpoint straight into restore buffers.

Example (what `restore.leaf_reader.read_boxes` does for a local array leaf)::

    import numpy as np, tensorstore as ts
    import ckpt_callbacks as cc
    from ckpt_callbacks import chunkread
    with cc.CheckpointManager("/tmp/run") as m:        # (a step 10 whose leaf 0 is a zarr array)
        m.save(10, {"w": np.ones((1024, 2048), np.float32)}, force=True)
    root = "/tmp/run/step_0000000010/arrays/0"
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": root}, "open": True}).result()
    rec = {"sh": list(arr.shape), "ch": list(arr.chunk_layout.read_chunk.shape)}
    out = np.empty(arr.shape, arr.dtype.numpy_dtype)
    if chunkread.direct(arr):
        chunkread.read_boxes(root, rec, [tuple((0, n) for n in arr.shape)], [out], "['w']")

The format's arrays are zarr3 with the ``bytes`` (little-endian, C order) and ``crc32c`` codecs
(see writing.zarr_spec; local chunk files are written by `chunkwrite`, others by tensorstore): a
chunk file is the chunk's raw bytes followed by their CRC-32C. For local files that layout lets a
restore ``preadv`` each chunk into the very buffer its device will adopt, and check the CRC on
it, with no intermediate buffer: on small machines fresh memory is the cost of a restore, and
tensorstore's read path touches each byte's memory twice (its own read buffer, then ours).
Chunks that several target shards share (a restore onto another mesh) are read once, ~1 MiB of
rows at a time into a small buffer, each band checked into the running CRC and split among the
shards while it is still in cache (on tmpfs too: there a read-only mapping of each such chunk
file, which skips the band's copy, was faster on one test VM and slower on another; see
docs/benchmarks-log.md). Destination buffers are 64-byte aligned (`aligned_empty`): the kernel's
copy into a 16-byte-aligned numpy buffer runs at a third of the speed on some x86 CPUs. Arrays
with other codecs and object stores go through tensorstore (restore.leaf_reader.read_boxes).

Called by restore worker threads, on every process, for the boxes that process needs.
"""

from __future__ import annotations

import json
import math
import os
import stat

import numpy as np

from . import format as fmt
from . import layout
from .errors import CorruptCheckpointError, read_failure


ZARR_JSON_MAX_BYTES = 1 << 20   # a zarr.json read for `metadata` (the format's are ~300 bytes)


def metadata(arr, raw: bytes | None = None) -> dict:
    """The zarr metadata of the opened tensorstore `arr`: parsed from `raw`, the bytes of its
    zarr.json where the caller has them (read from the directory or the object store), else from
    ``arr.spec()``.

    Why not always the spec: tensorstore's ``Spec.to_json()`` (0.1.86) never frees the lists and
    dicts nested in what it returns (~4.7 KB per zarr array spec): called for every array leaf
    of every restore and verify, it grew a process that restores repeatedly without bound."""
    if raw is not None:
        try:
            meta = json.loads(raw)
        except ValueError:
            meta = None
        if isinstance(meta, dict):
            return meta
    return arr.spec().to_json().get("metadata", {})


def direct(arr, meta: dict | None = None) -> bool:
    """Whether the opened tensorstore `arr` stores chunks as raw C-order bytes + CRC-32C (`meta`:
    its `metadata`, where the caller has it)."""
    meta = metadata(arr) if meta is None else meta
    codecs = meta.get("codecs") or [{}]
    raw = codecs[0].get("name") == "bytes" and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    return (raw and codecs[1:] == [{"name": "crc32c"}] and meta.get("chunk_key_encoding") == {"name": "default"}
            and arr.chunk_layout.inner_order in (None, tuple(range(arr.rank))))


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised host buffer aligned to `align` bytes (64 by default: a CPU device adopts it
    without a copy, and the kernel copies file data into it ~3x faster than into numpy's own
    16-byte-aligned buffers: ``preadv`` from tmpfs on this project's AMD EPYC test machine; see
    docs/benchmarks-log.md). `aligned_slab` of one shape."""
    return aligned_slab([tuple(shape)], dtype, align)[0]


def aligned_slab(shapes: list, dtype, align: int = 64) -> list:
    """One uninitialised buffer per shape in `shapes`, each `align`-byte aligned, all views of one
    allocation (a restore's shards of one leaf: they live and die together as one jax.Array).

    Why one allocation: first writes to eight separate 8 MiB buffers cost 1.6-1.8x those to one
    64 MiB buffer on this project's EPYC test VM (18-20 against 10-13 ms per 64 MiB, numpy copies
    of 512 KiB bands into memory freed a moment before), and a restore's first write of its
    buffers is most of its cost there (docs/benchmarks-log.md, "The twenty-seventh stop")."""
    dtype = np.dtype(dtype)   # numpy's allocation, `align` bytes more, cut at aligned offsets
    sizes = [math.prod(s) * dtype.itemsize for s in shapes]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // align) * align
    raw = np.empty(at + align, np.uint8)
    base = -raw.ctypes.data % align
    return [raw[base + o:base + o + n].view(dtype).reshape(s) for o, n, s in zip(offsets, sizes, shapes)]


def read_boxes(root: str, rec: dict, boxes: list, outs: list, where: str) -> None:
    """Fill each ``outs[k]`` (shape of ``boxes[k]``, storage dtype, C order) from the chunk files of
    array directory `root`. Each chunk any box touches is read once: straight into its box's
    buffer when it lies whole and contiguous inside one box; else band by band (`BAND_BYTES` of its
    leading rows at a time) into a small buffer from which every box it meets takes its part
    while the band is still in cache. Raises CorruptCheckpointError naming `where` for a
    missing, short or damaged chunk, and for one whose CRC is not the one ``rec["cc"]`` records
    (an intact chunk file of another save: see `check_recorded`)."""
    shape, chunks = rec["sh"], rec["ch"]
    users: dict = {}
    for k, box in enumerate(boxes):
        for idx in layout.chunks_of(box, chunks):
            users.setdefault(idx, []).append(k)
    if not users:
        return
    dtype = outs[0].dtype
    chunk_bytes = math.prod(chunks) * dtype.itemsize
    band = None
    recorded = rec.get("cc")
    for idx in sorted(users):
        want = recorded[layout.chunk_number(idx, shape, chunks)] if recorded else None
        cbox = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunks, shape))
        parts = []   # (view of an out, slices of the chunk) for every box the chunk meets
        for k in users[idx]:
            inter = layout.intersect(cbox, boxes[k])
            view = outs[k][tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, boxes[k])) + (Ellipsis,)]
            parts.append((view, tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(inter, cbox))))
        path = os.path.join(root, fmt.chunk_key(idx))
        view = parts[0][0]
        if len(parts) == 1 and view.nbytes == chunk_bytes and view.flags.c_contiguous:
            _read_whole(path, view.reshape(-1).view(np.uint8), where, want)   # straight into the destination
            continue
        # an edge chunk, one shared by boxes or not contiguous in its box
        if not chunks:   # 0-d, as one row
            parts = [(v.reshape(1), (slice(0, 1),)) for v, _ in parts]
        nrows = chunks[0] if chunks else 1
        if band is None:
            rows = min(nrows, max(1, BAND_BYTES * nrows // chunk_bytes))   # never more than a chunk
            band = aligned_empty((rows,) + tuple(chunks[1:]), dtype)
        _read_banded(path, band, parts, nrows, where, want)


BAND_BYTES = 1 << 20   # banded reads: small enough to stay in cache between read, CRC and copies


def _open(path: str, nbytes: int, where: str) -> int:
    """An fd of chunk file `path`, checked to be a regular file of `nbytes` data + 4 CRC bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO there is refused below, not waited on
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: chunk file {path} is missing", where) from None
    except OSError as e:   # e.g. a file where a chunk directory should be
        raise read_failure(e, where, f"chunk file {path}", str(e),
                           f"{where}: chunk file {path} cannot be opened: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{where}: chunk file {path} is not a regular file", where)
        if st.st_size != nbytes + 4:
            raise CorruptCheckpointError(f"{where}: chunk file {path} holds {st.st_size} bytes, "
                                         f"expected {nbytes + 4}", where)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_exact(fd: int, bufs: list, at: int, path: str, where: str) -> None:
    """Fill `bufs` from offset `at` of the file (preadv may return short counts)."""
    views = [memoryview(b).cast("B") for b in bufs]
    nbytes, done = sum(len(v) for v in views), 0
    while done < nbytes:
        skip, rest = done, []   # skip what is already read
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        try:
            got = os.preadv(fd, rest, at + done)
        except OSError as e:
            raise read_failure(e, where, f"chunk file {path}", str(e),
                               f"{where}: reading chunk file {path} failed: {e}") from None
        if got == 0:
            raise CorruptCheckpointError(f"{where}: chunk file {path} is truncated", where)
        done += got


def _check(crc: int, tail: bytearray, path: str, where: str, want: int | None) -> None:
    if crc != int.from_bytes(tail, "little"):
        raise CorruptCheckpointError(f"{where}: checksum mismatch in chunk {path} (the data is damaged)", where)
    check_recorded(crc, want, path, where)


def check_recorded(crc: int, want: int | None, chunk: str, where: str) -> None:
    """Raise CorruptCheckpointError unless chunk `chunk`'s stored CRC `crc` is the one the
    manifest records for it (`want`; None: a manifest from before chunks' CRCs were recorded).

    A chunk carries its own CRC, which tells damaged bytes from intact ones, but not this save's
    chunk from an intact chunk of another save (a file copied over it, a step directory merged
    into another, a file a save should have written over and did not): the manifest's record
    does. Used by every reader: local reads here, object stores' in `restore`."""
    if want is not None and crc != want:
        raise CorruptCheckpointError(
            f"{where}: chunk {chunk} is intact but is not the chunk this step saved (CRC-32C {crc:08x}, "
            f"the manifest records {want:08x}): a chunk of another save, copied or left there", where)


def _read_whole(path: str, dest: np.ndarray, where: str, want: int | None = None) -> None:
    """One chunk into `dest` (its bytes, flat), then its CRC checked on `dest`."""
    fd = _open(path, dest.nbytes, where)
    tail = bytearray(4)
    try:
        _read_exact(fd, [dest, tail], 0, path, where)
    finally:
        os.close(fd)
    _check(fmt.crc32c(dest), tail, path, where, want)


def _read_banded(path: str, band: np.ndarray, parts: list, nrows: int, where: str, want: int | None = None) -> None:
    """One chunk of `nrows` leading rows, ``len(band)`` rows at a time into `band`: each band is
    added to the CRC and copied to every (view, chunk slices) of `parts` before the next is read.
    The CRC is checked at the end, so a damaged chunk may have been partly copied: the caller
    discards its buffers on the error."""
    row = band[0].nbytes
    fd = _open(path, nrows * row, where)
    crc, tail = 0, bytearray(4)
    try:
        for r0 in range(0, nrows, len(band)):
            r1 = min(r0 + len(band), nrows)
            got = band[:r1 - r0]
            raw = got.reshape(-1).view(np.uint8)   # the buffer protocol refuses some dtypes (bfloat16)
            _read_exact(fd, [raw], r0 * row, path, where)
            crc = fmt.crc32c(raw, crc)
            for view, sl in parts:
                a, b = max(sl[0].start, r0), min(sl[0].stop, r1)
                if a < b:
                    view[a - sl[0].start:b - sl[0].start] = got[(slice(a - r0, b - r0),) + sl[1:]]
        _read_exact(fd, [tail], nrows * row, path, where)
    finally:
        os.close(fd)
    _check(crc, tail, path, where, want)
