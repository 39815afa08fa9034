"""Writing whole zarr3 chunks of a local checkpoint straight from the snapshot's buffers.

Example (what `writing` does for a box of a local array leaf, after tensorstore created the
array's zarr.json)::

    import numpy as np
    from ckpt_callbacks import chunkwrite
    rec = {"sh": [8, 4], "ch": [4, 4], "dt": "float32"}
    data = np.arange(16, dtype=np.float32).reshape(4, 4)     # the box ((4, 8), (0, 4))
    pieces = chunkwrite.pieces(rec, ((4, 8), (0, 4)), data)   # [("c/1/0", view)], or None
    for key, view in pieces:
        chunkwrite.write_chunk(f"/tmp/run/step_0000000010.tmp-0/arrays/0/{key}", view)

A chunk file of the format is the chunk's raw little-endian C-order bytes followed by their
CRC-32C (zarr3 ``bytes`` + ``crc32c`` codecs; see writing.zarr_spec and chunkread). After the
snapshot, a shard that a CPU device holds is a numpy view of the device's own buffer, and each of
its chunks a contiguous piece of it: `write_chunk` writes the file straight from that view, with
one ``pwritev`` (on a disk, a page-aligned view's whole 4 KiB blocks first, with ``O_DIRECT``).
Tensorstore would first copy every chunk into a buffer of its own, and on small machines fresh
memory is the dearest part of a save. Tensorstore still creates every
array's zarr.json and writes what this module declines (`pieces` returns None): chunks padded at
the array's edge, data that is not C-contiguous or not little-endian, bool; and object stores.
Every chunk's CRC goes into the manifest (`write_chunk` returns it; `chunk_crcs` computes it for
what tensorstore writes), so a restore can tell a chunk of this save from another save's.

Called on the writer's small pool (`writing._consume`), on every process, for the boxes that
process writes; a failure (disk full, I/O error) propagates and fails the save.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import sys

import numpy as np

from . import format as fmt
from . import layout

__all__ = ["pieces", "file_bytes", "write_chunk", "write_parts", "chunk_crcs"]

DIRECT_ALIGN = 4096   # O_DIRECT: buffer address, file offset and length in whole blocks of this size
_IOV_MAX = 1024       # buffers per pwritev call (Linux's IOV_MAX; a blob of 2,000 leaves has ~6,000)


def pieces(rec: dict, box, data: np.ndarray) -> list | None:
    """``[(chunk key, contiguous view of data)]`` for every chunk of `box` (which `data`, in the
    storage dtype, holds), or None when a chunk cannot be written byte for byte from `data`."""
    dt = data.dtype
    if dt == np.bool_ or (dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder != "little")):
        return None   # bools are normalised by tensorstore; big-endian bytes need a swap
    shape, chunks = rec["sh"], rec["ch"]
    out = []
    for idx in layout.chunks_of(box, chunks):
        cbox = [(i * c, (i + 1) * c) for i, c in zip(idx, chunks)]
        if any(a < lo or b > min(hi, n) for (a, b), (lo, hi), n in zip(cbox, box, shape)):
            return None   # the chunk sticks out of the box or is padded at the array's edge
        view = data[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(cbox, box))]
        if not view.flags.c_contiguous:
            return None
        out.append((fmt.chunk_key(idx), view))
    return out


def file_bytes(view: np.ndarray) -> int:
    """The size of the chunk file holding `view`: its bytes and their 4-byte CRC-32C."""
    return view.nbytes + 4


def write_chunk(path: str, view: np.ndarray, sync: bool = True, claim=None, direct: bool = False) -> tuple[int, bool]:
    """Create the chunk file at `path` (and its directory) holding `view`'s bytes and their
    CRC-32C; fsync it when `sync` (the writer fsyncs on other threads, so that writing goes on
    meanwhile; directories are fsynced with the whole staging tree at commit). `claim(nbytes,
    path)` (e.g. `LocalStore.claim`) may hand over a deleted step's chunk file of the same size
    (`path` itself, in a reused staging directory): it is moved to `path` and overwritten in
    place, unless it is no longer a plain file with one link (a hard link elsewhere, e.g. a
    backup, is never written through). Without a claim a file at `path` is replaced, never
    written. `direct` (``LocalStore.direct_io``): the whole 4 KiB blocks of a page-aligned `view`
    go to the device with ``O_DIRECT``, without the page cache (`_write_direct_blocks`); the rest,
    and the CRC, through the page cache.
    Returns the chunk's CRC-32C (the manifest records it: `chunk_crcs`) and False when `direct`
    was asked for and the file system refused it (the caller may stop asking), else True."""
    flat = view.reshape(-1).view(np.uint8)
    raw = memoryview(flat)
    value = fmt.crc32c(raw)
    crc = value.to_bytes(4, "little")
    fd = _open_for_write(path, file_bytes(view), claim)
    try:
        off, refused = _write_direct_blocks(fd, raw, flat.ctypes.data) if direct else (0, False)
        _pwrite_all(fd, [raw[off:], memoryview(crc)], off, path)
        if sync:
            os.fsync(fd)   # an error here aborts the save: never retried
    finally:
        os.close(fd)
    return value, not refused


def write_parts(path: str, parts: list, window: np.ndarray | None = None, direct: bool = True,
                claim=None) -> bool:
    """Create the file at `path` (and its directory) holding the buffers `parts` one after
    another (a blob of packed leaves: `format.pack_bins`), not fsynced. `claim` as for
    `write_chunk`: a deleted step's file of the blob's size, overwritten in place. With `direct`
    the parts are copied through `window`, a page-aligned uint8 buffer a whole number of
    `DIRECT_ALIGN` blocks long, and each full window goes to the device with ``O_DIRECT``, the
    last one's whole blocks too, and only its last partial block through the page cache; a
    page-aligned part at a block boundary of the file goes by ``O_DIRECT`` from where it is,
    but for its last partial block (`_write_through_window`); without
    it they go through the page cache with one ``pwritev`` (no window). Returns False when the
    file system refused direct I/O (what was left went through the page cache).

    Why a window: a blob's pieces (msgpack heads, paddings, leaves) start anywhere, and
    ``O_DIRECT`` wants block-aligned memory and offsets. Through the page cache every blob file
    would fill new cache pages (on the test VM, whose host takes freed memory back, a small-tree
    save's first 0.25 GiB of blobs cost ~1 s of system time there) and dirty them for the fsync
    to write back; the copy into a window that the writer keeps from save to save costs less.
    Why a claim: on a memory file system a new file's pages are fresh memory (on that VM ~1 ms
    per MiB), an overwritten file's are not; on a disk, blocks are not allocated again.
    Called on the writer's chunk pool (`localwrite.write_blob`), one window per call."""
    if direct and (window is None or len(window) % DIRECT_ALIGN or window.ctypes.data % DIRECT_ALIGN):
        raise ValueError("the window must be page-aligned and a whole number of blocks long")
    fd = _open_for_write(path, sum(memoryview(p).nbytes for p in parts), claim)
    try:
        if not direct:
            _pwrite_all(fd, [memoryview(p).cast("B") for p in parts], 0, path)
            return True
        return _write_through_window(fd, path, parts, window)
    finally:
        os.close(fd)


def _write_through_window(fd: int, path: str, parts: list, window: np.ndarray) -> bool:
    """`write_parts` with ``O_DIRECT``: the parts are copied through `window`, except the whole
    blocks of a page-aligned part that starts at a block boundary of the file (a large packed
    leaf's pool copy: `format.blob_align`), which go to the device straight from it."""
    win, fill, off, refused = memoryview(window), 0, 0, False

    def put():   # the window's `fill` bytes to offset `off` (a multiple of DIRECT_ALIGN)
        nonlocal refused
        done = 0
        if not refused:
            done, refused = _write_direct_blocks(fd, win[:fill], window.ctypes.data, off)
        _pwrite_all(fd, [win[done:fill]], off + done, path)

    for part in parts:
        src = memoryview(part).cast("B")
        if not refused and len(src) >= DIRECT_ALIGN and (off + fill) % DIRECT_ALIGN == 0:
            address = np.frombuffer(src, np.uint8).ctypes.data
            if address % DIRECT_ALIGN == 0:
                if fill:   # whole blocks (the part starts at a block boundary)
                    put()
                    off, fill = off + fill, 0
                done, refused = _write_direct_blocks(fd, src, address, off)
                off, src = off + done, src[done:]   # its last partial block goes through the window
        while len(src):
            k = min(len(src), len(win) - fill)
            win[fill:fill + k] = src[:k]
            fill, src = fill + k, src[k:]
            if fill == len(win):
                put()
                off, fill = off + fill, 0
    if fill:
        put()
    return not refused


def _pwrite_all(fd: int, bufs: list, off: int, path: str) -> None:
    """Write the buffers `bufs` one after another at offset `off` of `fd`, all of them (pwritev
    may write less than asked: it goes on from where it stopped)."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], off)   # (more buffers than IOV_MAX: EINVAL)
        if not n:
            raise OSError(errno.EIO, f"writing {path} made no progress")
        off += n
        while n:
            k = min(n, len(bufs[0]))
            bufs[0], n = bufs[0][k:], n - k
            if not len(bufs[0]):
                bufs.pop(0)


def chunk_crcs(rec: dict, box, data: np.ndarray) -> list[int]:
    """The CRC-32C of every chunk of `box` (``layout.chunks_of`` order) as the chunk is stored:
    `data` (the box, as `writing` stores it: the storage dtype, bools as bytes 0/1) in
    little-endian C order, a chunk padded at the array's edge with zeros (the arrays' fill
    value) to its full shape. For what tensorstore writes (the writer records them in the
    manifest, as `write_chunk`'s); one pass over `data`: the padding is never built, and only a
    piece that is not C-contiguous little-endian already is copied (a row at a time where padded)."""
    shape, chunks = rec["sh"], rec["ch"]
    dt = data.dtype
    swap = dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder != "little")
    out = []
    for idx in layout.chunks_of(box, chunks):
        lo = [i * c for i, c in zip(idx, chunks)]
        view = data[tuple(slice(a - b0, min(a + c, n) - b0) for a, c, n, (b0, _) in zip(lo, chunks, shape, box))
                    + (Ellipsis,)]   # `...`: a 0-d box stays an array
        out.append(_padded_crc(view, tuple(chunks), swap, 0))
    return out


def _padded_crc(view: np.ndarray, chunks: tuple, swap: bool, crc: int) -> int:
    """`crc` continued over `view` stored in a chunk of shape `chunks` (zeros after each row that
    is shorter than the chunk's, and after the last row)."""
    if view.shape[1:] == chunks[1:]:   # whole inner rows: the data, then zeros
        if swap:
            view = view.astype(view.dtype.newbyteorder("<"))
        crc = fmt.crc32c(memoryview(np.ascontiguousarray(view).reshape(-1).view(np.uint8)), crc)
        return _zeros_crc((math.prod(chunks) - view.size) * view.dtype.itemsize, crc)
    for row in view:   # padded in an inner dimension: row by row
        crc = _padded_crc(row, chunks[1:], swap, crc)
    return _zeros_crc((chunks[0] - len(view)) * math.prod(chunks[1:]) * view.dtype.itemsize, crc)


_ZEROS = bytes(1 << 16)


def _zeros_crc(n: int, crc: int) -> int:
    """`crc` continued over `n` zero bytes."""
    while n > 0:
        k = min(n, len(_ZEROS))
        crc = fmt.crc32c(memoryview(_ZEROS)[:k], crc)
        n -= k
    return crc


def _write_direct_blocks(fd: int, raw: memoryview, address: int, base: int = 0) -> tuple[int, bool]:
    """Write the leading whole `DIRECT_ALIGN` blocks of `raw` (at `address` in memory) to offset
    `base` (a multiple of DIRECT_ALIGN) of `fd` with ``O_DIRECT`` when `address` is block-aligned;
    return how many bytes were written (0 where the buffer is not aligned) and whether the file
    system refused direct I/O. The caller writes the rest through the page cache.

    Why: a page-aligned `hostmem.HostPool` buffer goes from memory to the device without
    filling new page-cache pages, which on a VM whose host takes back freed memory cost ~8x the
    CPU of the copy itself (docs/benchmarks-log.md), and without evicting the user's own cached data.
    The file is fsynced as usual afterwards: ``O_DIRECT`` alone does not make it durable."""
    body = len(raw) - len(raw) % DIRECT_ALIGN
    if not body or address % DIRECT_ALIGN or not hasattr(os, "O_DIRECT"):
        return 0, False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno not in _REFUSED:
            raise
        return 0, True
    off, refused = 0, False
    try:
        while off < body:
            n = os.pwrite(fd, raw[off:body], base + off)
            off += n
            if not n or n % DIRECT_ALIGN:   # a short write off the block grid: the rest goes buffered
                break
    except OSError as e:
        if e.errno not in _REFUSED:
            raise
        # refused (this file system takes no O_DIRECT, or wants a larger alignment): from `off`,
        # a multiple of DIRECT_ALIGN, the page cache writes the rest
        refused = True
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return off, refused


_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}   # no direct I/O here, or not this alignment


def _open_for_write(path: str, nbytes: int, claim) -> int:
    """An fd open for writing the file at `path` (its directory made) of `nbytes`: a claimed
    file overwritten in place (`_reuse`), else a new file replacing whatever was there."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = _reuse(path, nbytes, claim) if claim is not None else None
    if fd is None:
        _unlink(path)   # a file there (a reused staging directory) may be hard-linked elsewhere
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    return fd


def _reuse(path: str, nbytes: int, claim) -> int | None:
    """An fd open for writing on a claimed file of `nbytes` moved to `path` (or `path` itself,
    claimed in place), or None."""
    old = claim(nbytes, path)
    if old is None:
        return None
    try:
        if old != path:
            os.rename(old, path)
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        _unlink(path)
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size == nbytes:
        return fd
    os.close(fd)
    _unlink(path)
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
