"""Reading whole zarr3 chunks of a local checkpoint straight into restore buffers.

    >>> # restore.py, for a box of a local array that starts and ends on chunk boundaries:
    >>> # if chunkread.direct(arr): chunkread.read_box(root, rec, box, out, where)

The format's arrays are zarr3 with the ``bytes`` (little-endian, C order) and ``crc32c`` codecs
(written by tensorstore, see writing.zarr_spec): a chunk file is the chunk's raw bytes followed by
their CRC-32C. For local files that layout lets a restore ``preadv`` each chunk into the very
buffer its device will adopt, and check the CRC on it, with no intermediate buffer: on small
machines fresh memory is the cost of a restore, and tensorstore's read path touches each byte's
memory twice (its own read buffer, then ours). Boxes that cut through chunks, arrays with other
codecs and object stores go through tensorstore (restore.leaf_reader.read_box).

Called by restore worker threads, on every process, for the boxes that process needs.
"""

from __future__ import annotations

import math
import os

import numpy as np

from . import format as fmt
from . import layout
from .errors import CorruptCheckpointError

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


def read_box(root: str, rec: dict, box, out: np.ndarray, where: str) -> None:
    """Fill `out` (shape of `box`, storage dtype, C order) with the chunks of array directory
    `root` covering `box`. `box` must start on chunk boundaries and end on them or at the array's
    edge. Raises CorruptCheckpointError naming `where` for a missing, short or damaged chunk."""
    shape, chunks = rec["sh"], rec["ch"]
    item = out.dtype.itemsize
    chunk_bytes = math.prod(chunks) * item
    scratch = None
    for idx in layout.chunks_of(box, chunks):
        region = tuple(slice(i * c - lo, min((i + 1) * c, n) - lo)
                       for i, c, n, (lo, _) in zip(idx, chunks, shape, box))
        view = out[region + (Ellipsis,)]   # a view even when 0-d
        path = os.path.join(root, "c", *map(str, idx))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: chunk file {path} is missing", where) from None
        try:
            size = os.fstat(fd).st_size
            if size != chunk_bytes + 4:
                raise CorruptCheckpointError(f"{where}: chunk file {path} holds {size} bytes, "
                                             f"expected {chunk_bytes + 4}", where)
            tail = bytearray(4)
            whole = view.nbytes == chunk_bytes and view.flags.c_contiguous
            if whole:   # straight into the destination
                dest = view.reshape(-1).view(np.uint8)
            else:       # an edge chunk, or one not contiguous in `out`: via a scratch buffer
                scratch = scratch if scratch is not None else np.empty(chunk_bytes, np.uint8)
                dest = scratch
            _read_exact(fd, [dest, tail], chunk_bytes + 4, path, where)
        finally:
            os.close(fd)
        if fmt.crc32c(dest) != int.from_bytes(tail, "little"):
            raise CorruptCheckpointError(f"{where}: checksum mismatch in chunk {path} (the data is damaged)",
                                         where)
        if not whole:
            full = dest.view(out.dtype).reshape(chunks)
            view[...] = full[tuple(slice(0, r.stop - r.start) for r in region)]
