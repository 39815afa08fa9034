"""The checkpointers `ckpt-callbacks bench` compares, behind one tiny interface, and its instruments.

Example::

    import jax, jax.numpy as jnp
    from ckpt_callbacks import bench_peers as bp
    tree = {"w": jnp.ones((256, 256))}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    peer = bp.PEERS["ckpt_callbacks"]("/dev/shm/x")     # or "orbax", "flax-msgpack", "np.savez"
    with bp.RssPeak() as mem:
        peer.save(1, tree)           # the blocking part (time it)
        peer.wait()                  # until durable (time it)
    out = peer.restore(1, target)    # target: pytree of jax.ShapeDtypeStruct with shardings
    peer.close(); print(mem.peak)    # bytes of host RSS above the level when the block started

Who calls what: only `ckpt_callbacks.bench` (one process, the caller's thread) constructs a peer per
measured save in a fresh directory, then calls ``save``, ``wait``, ``restore``, ``close`` in that order.
A peer whose library is missing raises `Unavailable` from its constructor (the row reads "skipped").
This module (and `bench`) are the only places allowed to import orbax: it is a peer, never a
dependency. Instruments: `RssPeak` samples host RSS from a thread, `evict` drops a directory's
pages from the page cache (cold restores on disk), `raw_write` / `raw_read` measure the directory's
plain write+fsync and read bandwidth with the same byte count.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np

__all__ = ["PEERS", "Unavailable", "RssPeak", "evict", "count_files", "raw_write", "raw_read",
           "fsync_dir", "place", "bytes_read", "ts_bytes_read", "recycle_page_cache"]

RAW_CHUNK = 64 << 20


class Unavailable(Exception):
    """The peer's library is not importable here; the message says why."""


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: str, chunks) -> None:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def count_files(path: str) -> tuple[int, int]:
    """(files, bytes) under `path` (a file or a directory)."""
    if os.path.isfile(path):
        return 1, os.path.getsize(path)
    n = size = 0
    for root, _, files in os.walk(path):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(root, f))
    return n, size


def evict(path: str) -> None:
    """Drop `path`'s clean pages from the page cache (no-op on tmpfs), so a restore reads the disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bytes_read() -> int:
    """Bytes this process has read so far: through read(2)-family calls (``rchar``: every library,
    page cache or not; tensorstore's file kvstore and Python file reads alike)."""
    import psutil
    return psutil.Process().io_counters().read_chars


def ts_bytes_read() -> int:
    """Bytes tensorstore's file kvstore has read in this process so far."""
    import tensorstore as ts
    total = 0
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        total += sum(int(v.get("value", 0)) for v in m.get("values", []))
    return total


class RssPeak:
    """Context manager: `peak` = highest host RSS sampled in the block minus RSS at its start."""

    def __init__(self, interval_s: float = 0.002):
        import psutil
        self.proc, self.interval = psutil.Process(), interval_s
        self.base = self.high = self.peak = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.high = max(self.high, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.base = self.high = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.high = max(self.high, self.proc.memory_info().rss)
        self.peak = self.high - self.base
        return False


def recycle_page_cache(path: str, nbytes: int) -> None:
    """Read `nbytes` of the file at `path` (made once, on a disk: a page-cache file system) and drop
    its pages from the page cache, so that the next `nbytes` of page cache or buffers this process
    fills reuse those just-freed pages.

    Why: on a VM whose host takes back the memory its guest frees (a balloon with free page
    reporting, as on this project's EPYC test VM), memory left free for ~2 s is handed to the host,
    and the first write of it costs a host-side fault per page. A save fills a checkpoint's worth of
    page cache (disk) or tmpfs pages, a restore a checkpoint's worth of new buffers, so each timing
    depended on how long ago the turn before it freed its memory: 1 GiB of raw write+fsync took
    0.5-0.7 s right after another one and 1.1-2.8 s after a 3 s pause, on the same disk. The bench
    calls this before every timed save and restore of every peer (``--memory recycled``, the
    default), outside the timers, so that every peer starts in the same state: that of a host
    whose memory is in use (mostly page cache), as a training host's is. Freed tmpfs pages and
    anonymous memory did not do the same there; freed disk page cache did."""
    if not os.path.exists(path) or os.path.getsize(path) < nbytes:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        zeros = memoryview(bytes(min(RAW_CHUNK, max(1, nbytes))))   # ext4 stores them like any bytes
        _write_durable(path, (zeros[:min(len(zeros), nbytes - at)] for at in range(0, nbytes, len(zeros))))
    buf = bytearray(min(RAW_CHUNK, max(1, nbytes)))
    with open(path, "rb", buffering=0) as f:
        left = nbytes
        while left > 0 and (k := f.readinto(buf)):
            left -= k
    evict(path)


def place(host_tree, target):
    """Host numpy leaves onto the target's shardings (what a non-sharded format must do)."""
    leaves, treedef = jax.tree.flatten(host_tree)
    tleaves = jax.tree.leaves(target)
    out = [jax.device_put(np.asarray(x), t.sharding) for x, t in zip(leaves, tleaves)]
    return jax.block_until_ready(jax.tree.unflatten(treedef, out))


# -- raw bandwidth -----------------------------------------------------------------------------
def raw_write(d: str, nbytes: int, nfiles: int = 4) -> list[str]:
    """Write `nbytes` of random bytes in 64 MiB chunks to `nfiles` files (one thread each), fsync
    each and the directory. Returns the paths. The buffer is made before the caller's timer."""
    os.makedirs(d, exist_ok=True)
    per = -(-nbytes // nfiles)
    paths = [os.path.join(d, f"raw{i}.bin") for i in range(nfiles)]
    buf = _random_buffer(min(RAW_CHUNK, max(per, 1)))
    errors: list = []

    def one(path, n):
        try:
            with open(path, "wb") as f:
                left = n
                while left > 0:
                    k = min(left, len(buf))
                    f.write(memoryview(buf)[:k])
                    left -= k
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    sizes = [max(0, min(per, nbytes - i * per)) for i in range(nfiles)]
    threads = [threading.Thread(target=one, args=(p, n)) for p, n in zip(paths, sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    fsync_dir(d)
    return paths


_BUF: dict = {}


def _random_buffer(n: int) -> bytes:
    if _BUF.get("n") != n:
        _BUF.update(n=n, b=np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
    return _BUF["b"]


def raw_read(paths: list[str]) -> int:
    """Read the files back (one thread each) into reused buffers; returns the byte count."""
    total = [0] * len(paths)

    def one(i, p):
        buf = bytearray(max(1, min(RAW_CHUNK, os.path.getsize(p))))
        with open(p, "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                total[i] += k

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(total)


# -- peers -------------------------------------------------------------------------------------
class Engine:
    """This package: `CheckpointManager` (async), restore onto the target's shardings."""

    name = "ckpt_callbacks"

    def __init__(self, d: str, **options):
        from .manager import CheckpointManager
        self.d = d
        self.m = CheckpointManager(d, **options)

    def save(self, step, tree):
        self.m.save(step, tree)

    def wait(self):
        self.m.wait_until_finished()

    def restore(self, step, target):
        return jax.block_until_ready(self.m.restore(step, target=target))

    def path(self, step):
        from .format import step_name
        return os.path.join(self.d, step_name(step))

    def close(self):
        self.m.close()


class Orbax:
    """Orbax `CheckpointManager` with async checkpointing and `StandardSave`/`StandardRestore`."""

    name = "orbax"

    def __init__(self, d: str, **_):
        try:
            import orbax.checkpoint as ocp
        except Exception as e:  # noqa: BLE001 - any import failure means "not here"
            raise Unavailable(f"orbax.checkpoint is not importable ({type(e).__name__}: {e})") from None
        self.ocp, self.d = ocp, os.path.abspath(d)
        self.m = ocp.CheckpointManager(self.d, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True, max_to_keep=None))

    def save(self, step, tree):
        self.m.save(step, args=self.ocp.args.StandardSave(tree))

    def wait(self):
        self.m.wait_until_finished()

    def restore(self, step, target):
        return jax.block_until_ready(self.m.restore(step, args=self.ocp.args.StandardRestore(target)))

    def path(self, step):
        return os.path.join(self.d, str(step))

    def close(self):
        self.m.close()


class _Sync:
    """A synchronous single-file format: gather to host, serialize, write, fsync (all blocking)."""

    name, ext = "?", ""

    def __init__(self, d: str, **_):
        self.d = d
        os.makedirs(d, exist_ok=True)

    def path(self, step):
        return os.path.join(self.d, f"{step}{self.ext}")

    def wait(self):
        pass

    def close(self):
        pass


class FlaxMsgpack(_Sync):
    """`flax.serialization.msgpack_serialize` of the host tree, written and fsynced."""

    name, ext = "flax-msgpack", ".msgpack"

    def __init__(self, d: str, **_):
        try:
            from flax import serialization
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"flax is not importable ({type(e).__name__}: {e})") from None
        self.ser = serialization
        super().__init__(d)

    def save(self, step, tree):
        _write_durable(self.path(step), [self.ser.msgpack_serialize(jax.device_get(tree))])

    def restore(self, step, target):
        with open(self.path(step), "rb") as f:
            return place(self.ser.msgpack_restore(f.read()), target)


class NpSavez(_Sync):
    """`np.savez` (uncompressed) of the host tree into an open file, then fsync."""

    name, ext = "np.savez", ".npz"

    def save(self, step, tree):
        host = jax.device_get(tree)
        with open(self.path(step), "wb") as f:
            np.savez(f, **host)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.d)

    def restore(self, step, target):
        with np.load(self.path(step)) as z:
            host = {k: z[k] for k in z.files}
        return place(host, target)


PEERS = {p.name: p for p in (Engine, Orbax, FlaxMsgpack, NpSavez)}
