"""Verification: read every stored byte of a step and check every checksum, without a device.

Example::

    import numpy as np
    import ckpt_callbacks as cc
    from ckpt_callbacks.storage import open_store
    from ckpt_callbacks.verify import verify_step
    with cc.CheckpointManager("/tmp/run") as mngr:
        mngr.save(200, {"w": np.ones(3)})
    verify_step(open_store("/tmp/run"), 200)    # [] when intact, else [(key path, problem), ...]
    # a step that is not committed (never saved, or deleted meanwhile): CheckpointNotFoundError

Who calls what: `ckpt-callbacks verify` (any machine, one process) calls `verify_step` per step
with a `Progress`. It reads through `restore.leaf_reader` (the same checks as a restore) chunk
by chunk, so memory stays at a few chunks however large the array: in a local directory by the
restore's own chunk reads (file size, CRC-32C), elsewhere through tensorstore with a bounded window
of reads in flight, checked by its crc32c codec; each chunk's CRC also against the one the
manifest records (a chunk of another save is a problem too); packed leaves and the manifest
by their crc32c in the manifest; per-process host-state blobs must parse.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import time

import numpy as np

from . import chunkread, format as fmt, treepath
from .errors import CheckpointError, CheckpointNotFoundError, StorageUnavailableError, read_failure
from .restore import changed, leaf_reader, read_host_state, read_manifest

__all__ = ["verify_step", "problem_text", "Progress"]


def _human(n) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


class Progress:
    """A byte-counting progress bar on stderr (redrawn at most 10 times a second)."""

    def __init__(self, total: int, stream, enabled: bool):
        self.total, self.done, self.stream, self.enabled = max(total, 1), 0, stream, enabled
        self.t0 = self.last = time.monotonic()

    def add(self, n: int, label: str = "", force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and not force):
            return
        self.last = now
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        rate = self.done / max(now - self.t0, 1e-6)
        self.stream.write(f"\rverify [{bar:<30}] {frac * 100:5.1f}% {_human(self.done)}/{_human(self.total)} "
                          f"{_human(rate)}/s {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.add(0, "done", force=True)
            self.stream.write("\n")
            self.stream.flush()


def _chunks(shape, chunks):
    grid = [range(-(-d // c)) for d, c in zip(shape, chunks)]
    for idx in itertools.product(*grid):
        yield idx, tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(idx, chunks, shape))


def problem_text(where: str, msg: str) -> str:
    """One of `verify_step`'s problems as a line: the message, led by its key path unless it names it."""
    return msg if msg.startswith(where) else f"{where}: {msg}"


def verify_step(store, step: int, progress=None, window: int = 16) -> list[tuple[str, str]]:
    """Read every leaf and host-state blob of `step`, checking every checksum.

    Returns ``[(key path or file, problem)]``; empty when the step is intact. Raises
    `StorageUnavailableError` when the storage cannot be read at all (nothing is known then), and
    `CheckpointNotFoundError` when the step is not committed as the call begins, or was deleted or
    replaced while it was read (a writer's retention, as `restore` tells it: its files went, it was
    not damaged).
    """
    token = store.step_token(step)
    if step not in store.committed_steps():   # (listed by the caller: a writer's retention deleted it since)
        raise _gone(store, step, "before it could be verified")
    damaged = _verify(store, step, progress, window)
    if damaged and changed(store, step, token):
        raise _gone(store, step, "while it was being verified")
    return damaged


def _gone(store, step: int, when: str) -> CheckpointNotFoundError:
    e = CheckpointNotFoundError(f"step {step} in {store.url} is not committed: deleted or replaced {when} (by a "
                                f"writer's retention, or a forced save of that step); it was not found damaged")
    e.deleted = True
    return e


def _verify(store, step: int, progress, window: int) -> list[tuple[str, str]]:
    try:
        m = read_manifest(store, step)
    except StorageUnavailableError:   # says nothing about the step: verifying cannot go on
        raise
    except CheckpointError as e:
        return [(fmt.MANIFEST, str(e))]
    reader = leaf_reader(store, step, m)
    damaged = []
    for rec in m["leaves"]:
        where = treepath.keystr(tuple(map(tuple, rec["p"])))
        if rec["k"] not in ("array", "packed"):
            continue
        itemsize = np.dtype(fmt.logical_dtype(rec["dt"])).itemsize
        try:
            if rec["k"] == "packed":
                reader.packed(rec)
                if progress:
                    progress.add(math.prod(rec["sh"]) * itemsize, where)
                continue
            arr = reader.array(rec)
            if store.local and chunkread.direct(arr, reader.meta[rec["z"]]):   # the very reads of a restore
                root = store.path(f"{reader.base}/{rec['z']}")
                dtype = fmt.storage_dtype(rec["dt"])
                for idx, sl in _chunks(rec["sh"], rec["ch"]):
                    box = tuple((x.start, x.stop) for x in sl)
                    out = chunkread.aligned_empty(tuple(b - a for a, b in box), dtype)
                    chunkread.read_boxes(root, rec, [box], [out], where)
                    if progress:
                        progress.add(out.size * itemsize, where)
                continue
            pending = []
            for idx, sl in _chunks(rec["sh"], rec["ch"]):
                pending.append((idx, sl, arr[sl].read()))
                if len(pending) >= window:
                    _drain(pending.pop(0), rec, where, itemsize, progress, store.redact)
            while pending:
                _drain(pending.pop(0), rec, where, itemsize, progress, store.redact)
            reader.check_recorded(arr, rec, [idx for idx, _ in _chunks(rec["sh"], rec["ch"])], where)
        except StorageUnavailableError:
            raise
        except CheckpointError as e:
            bad = ""
            if rec["k"] == "array" and store.local:   # which files, where the array was refused as a whole
                bad = _bad_chunk_files(store.path(f"{reader.base}/{rec['z']}"), rec)
            damaged.append((where, str(e) + bad))
    for p in sorted((m.get("host") or {})):
        try:
            read_host_state(store, step, m, p)
        except StorageUnavailableError:
            raise
        except CheckpointError as e:
            damaged.append((f"host state of process {p}", str(e)))
    return damaged


def _bad_chunk_files(root: str, rec: dict, most: int = 8) -> str:
    """The chunk files of array leaf `rec` (local directory `root`) that are missing or not of a
    chunk's size (its bytes and 4 of CRC), as text to add to a problem ("" when all are there):
    the restore's checks refuse such an array as a whole, before reading any chunk."""
    size = fmt.chunk_nbytes(rec) + 4
    bad = []
    for idx, _ in _chunks(rec["sh"], rec["ch"]):
        key = fmt.chunk_key(idx)
        try:
            st = os.stat(os.path.join(root, key))
        except FileNotFoundError:
            bad.append(f"{key} missing")
            continue
        except OSError:   # (e.g. a path through a file: the array's open said so already)
            continue
        if not stat.S_ISREG(st.st_mode):
            bad.append(f"{key} not a file")
        elif st.st_size != size:
            bad.append(f"{key} {st.st_size} of {size} bytes")
    if not bad:
        return ""
    more = f", and {len(bad) - most} more" if len(bad) > most else ""
    return f"; chunk files in {root}: {', '.join(bad[:most])}{more}"


def _drain(item, rec, where, itemsize, progress, redact):
    idx, sl, fut = item
    if progress:
        progress.add(math.prod(s.stop - s.start for s in sl) * itemsize, where)
    try:
        fut.result()
    except Exception as e:
        detail = redact(str(e))
        raise read_failure(e, where, f"chunk {list(idx)} of {rec['z']}", detail[:300],
                           f"{where}: chunk {list(idx)} of {rec['z']} is damaged or missing: {detail[:200]}") from None
