"""Shard and chunk arithmetic: pure functions, no I/O (property-tested in tests/test_layout.py).

Example::

    from ckpt_callbacks import layout
    layout.chunk_shape((1024, 2048), itemsize=4, cap_bytes=4 << 20)   # (512, 2048)

Who calls what: the snapshot (every process, identically) asks `unique_boxes` for the distinct
shards of each array, `assign` for which process writes each (so that exactly one copy of every
replicated shard is written, and replicated bytes are spread over processes), and `chunk_shape`
for a zarr chunk grid aligned to the shards and capped in bytes. Restore uses `bounding` (and `box_of`);
the writer's early fsyncs and the restore's direct chunk reads use `chunks_of`; the manifest's
per-chunk checksums are listed by `chunk_number`.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

__all__ = ["Box", "box_of", "unique_boxes", "chunk_shape", "assign", "intersect", "bounding", "box_shape",
           "chunks_of", "chunk_count", "chunk_number"]

Box = tuple  # tuple of (start, stop) per dimension


def box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """Normalize a tuple of slices (as in `Sharding.devices_indices_map`) to a box."""
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError("strided shards are not supported")
        out.append((start, stop))
    return tuple(out)


def box_shape(box: Box) -> tuple:
    return tuple(b - a for a, b in box)


def unique_boxes(sharding, shape) -> list[tuple[Box, list]]:
    """Distinct shard boxes of an array, each with the devices holding it (sorted by id)."""
    groups: dict = {}
    for dev, index in sharding.devices_indices_map(tuple(shape)).items():
        groups.setdefault(box_of(index, shape), []).append(dev)
    return [(b, sorted(devs, key=lambda d: d.id)) for b, devs in sorted(groups.items())]


def _divisor_at_least(n: int, need: int) -> int:
    """The smallest divisor of `n` that is at least `need` and 2 (`n` itself when there is none).

    Searches the pairs (i, n // i) up to sqrt(n): a 1-d leaf of 2^31 elements takes ~46k steps,
    where listing every divisor up to n took minutes of the caller's blocking `save()`."""
    best = n
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            for k in (i, n // i):
                if 2 <= k < best and k >= need:
                    best = k
    return best


def chunk_shape(shard: Sequence[int], itemsize: int, cap_bytes: int, whole: Sequence[bool] = ()) -> tuple:
    """Largest chunk that tiles `shard` exactly and holds at most `cap_bytes` (where possible).

    Dimensions are split from the first on, each by its smallest sufficient divisor, so chunks stay
    aligned to shard boundaries and contiguous in C order. Where `whole[d]` (the shard spans the
    array's whole dimension d: no shard boundary to keep) and no divisor comes near the split
    needed (a prime extent would otherwise be cut into rows), the chunk is the extent over the
    split, rounded up, and the array's last chunk is padded, as zarr allows.
    """
    c = [max(1, int(d)) for d in shard]
    for d in range(len(c)):
        total = math.prod(c) * itemsize
        if total <= cap_bytes:
            break
        need = -(-total // cap_bytes)   # the split this dimension alone would need
        k = _divisor_at_least(c[d], need)
        if d < len(whole) and whole[d] and need < c[d] and k > 2 * need:
            row = total // c[d]
            c[d] = max(1, min(-(-c[d] // need), cap_bytes // row))
        else:
            c[d] //= k
    return tuple(c)


def assign(items: Sequence[tuple[int, Sequence[int]]], nprocs: int) -> list[int]:
    """Pick one writer process per item, balancing bytes.

    `items` are ``(nbytes, holder_processes)``; the result is, per item, the process that writes
    it. Deterministic: every process computes the same answer from the same inputs. Largest items
    are placed first, each on the least-loaded holder (ties: lowest index).
    """
    if nprocs <= 1:
        return [0] * len(items)
    load = [0] * nprocs
    out = [0] * len(items)
    order = sorted(range(len(items)), key=lambda i: (-items[i][0], i))
    for i in order:
        nbytes, holders = items[i]
        p = min(sorted(set(holders)), key=lambda h: (load[h], h))
        load[p] += nbytes
        out[i] = p
    return out


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) and len(out) else out


def bounding(boxes: Sequence[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def chunks_of(box: Box, chunks: Sequence[int]) -> list[tuple]:
    """Grid indices of the chunks that `box` touches, in C order (``[()]`` for a 0-d array)."""
    ranges = [range(lo // c, -(-hi // c)) if hi > lo else range(0) for (lo, hi), c in zip(box, chunks)]
    return list(itertools.product(*ranges))


def chunk_count(shape: Sequence[int], chunks: Sequence[int]) -> int:
    """How many chunks the regular grid `chunks` has over `shape` (1 for a 0-d array)."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunks))


def chunk_number(idx: Sequence[int], shape: Sequence[int], chunks: Sequence[int]) -> int:
    """The position of chunk `idx` (grid indices) in the C-order list of the grid's chunks."""
    k = 0
    for i, n, c in zip(idx, shape, chunks):
        k = k * -(-n // c) + i
    return k
