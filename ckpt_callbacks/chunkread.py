"""Reading whole zarr3 chunks of a local checkpoint straight into restore buffers.

Example (what `restore.leaf_reader.read_boxes` does for a local array leaf)::

    import numpy as np, tensorstore as ts
    from ckpt_callbacks import chunkread
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
Chunks that several target shards share (a restore onto another mesh) are read once into a
scratch buffer and split. Arrays with other codecs and object stores go through tensorstore
(restore.leaf_reader.read_boxes).

Called by restore worker threads, on every process, for the boxes that process needs.
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np

from . import format as fmt
from . import layout
from .errors import CorruptCheckpointError, read_failure


def direct(arr) -> bool:
    """Whether the opened tensorstore `arr` stores chunks as raw C-order bytes + CRC-32C."""
    meta = arr.spec().to_json().get("metadata", {})
    codecs = meta.get("codecs") or [{}]
    raw = codecs[0].get("name") == "bytes" and codecs[0].get("configuration", {}).get("endian", "little") == "little"
    return (raw and codecs[1:] == [{"name": "crc32c"}] and meta.get("chunk_key_encoding") == {"name": "default"}
            and arr.chunk_layout.inner_order in (None, tuple(range(arr.rank))))


def _read_exact(fd: int, bufs: list, nbytes: int, path: str, where: str) -> None:
    done = 0
    views = [memoryview(b).cast("B") for b in bufs]
    while done < nbytes:
        # skip what is already read; preadv may return short counts
        skip, rest = done, []
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        got = os.preadv(fd, rest, done)
        if got == 0:
            raise CorruptCheckpointError(f"{where}: chunk file {path} is truncated", where)
        done += got


def read_boxes(root: str, rec: dict, boxes: list, outs: list, where: str) -> None:
    """Fill each ``outs[k]`` (shape of ``boxes[k]``, storage dtype, C order) from the chunk files of
    array directory `root`. Each chunk any box touches is read once: straight into its box's
    buffer when it lies whole and contiguous inside one box, else into a scratch buffer from which
    every box it meets takes its part. Raises CorruptCheckpointError naming `where` for a missing,
    short or damaged chunk."""
    shape, chunks = rec["sh"], rec["ch"]
    users: dict = {}
    for k, box in enumerate(boxes):
        for idx in layout.chunks_of(box, chunks):
            users.setdefault(idx, []).append(k)
    if not users:
        return
    chunk_bytes = math.prod(chunks) * outs[0].dtype.itemsize
    scratch = None
    for idx in sorted(users):
        cbox = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunks, shape))
        parts = []   # (view of an out, slices of the chunk) for every box the chunk meets
        for k in users[idx]:
            inter = layout.intersect(cbox, boxes[k])
            view = outs[k][tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, boxes[k])) + (Ellipsis,)]
            parts.append((view, tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(inter, cbox))))
        view = parts[0][0]
        direct = len(parts) == 1 and view.nbytes == chunk_bytes and view.flags.c_contiguous
        if direct:   # straight into the destination
            dest = view.reshape(-1).view(np.uint8)
        else:        # an edge chunk, one shared by boxes or not contiguous in its box: via scratch
            scratch = scratch if scratch is not None else np.empty(chunk_bytes, np.uint8)
            dest = scratch
        path = os.path.join(root, fmt.chunk_key(idx))
        _read_chunk(path, dest, chunk_bytes, where)
        if not direct:
            full = dest.view(outs[0].dtype).reshape(chunks)
            for view, sl in parts:
                view[...] = full[sl + (Ellipsis,)]


def _read_chunk(path: str, dest: np.ndarray, chunk_bytes: int, where: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: chunk file {path} is missing", where) from None
    except OSError as e:   # e.g. a file where a chunk directory should be
        raise read_failure(e, where, f"chunk file {path}", str(e),
                           f"{where}: chunk file {path} cannot be opened: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{where}: chunk file {path} is not a regular file", where)
        if st.st_size != chunk_bytes + 4:
            raise CorruptCheckpointError(f"{where}: chunk file {path} holds {st.st_size} bytes, "
                                         f"expected {chunk_bytes + 4}", where)
        tail = bytearray(4)
        try:
            _read_exact(fd, [dest, tail], chunk_bytes + 4, path, where)
        except OSError as e:
            raise read_failure(e, where, f"chunk file {path}", str(e),
                               f"{where}: reading chunk file {path} failed: {e}") from None
    finally:
        os.close(fd)
    if fmt.crc32c(dest) != int.from_bytes(tail, "little"):
        raise CorruptCheckpointError(f"{where}: checksum mismatch in chunk {path} (the data is damaged)", where)
