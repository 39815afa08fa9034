"""Host memory for the copies a save takes: the warm buffers they go into (`HostPool`,
`host_empty`) and the byte budget that bounds them (`ByteBudget`).

Example::

    import numpy as np
    from ckpt_callbacks.hostmem import ByteBudget, HostPool
    pool, budget = HostPool(), ByteBudget(64 << 20)
    budget.acquire(4 << 20)                       # blocks while 64 MiB of copies are held
    copy = pool.copy_of(np.ones(1 << 20, np.float32))   # a page-aligned buffer of the pool
    budget.release(copy.nbytes)                   # once written
    pool.recycle()                                # the next save reuses the buffer

Who calls what: `CheckpointManager` owns one `HostPool` and makes one `ByteBudget` per save;
`snapshot.copy` takes buffers and reserves bytes on the caller's thread, the writer
(`writing.write_and_commit`) releases the bytes once each copy is written, and the manager recycles
the pool after joining the previous save's writer. `localwrite` takes its page-aligned windows
from `host_empty`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading

import numpy as np

from . import chunkread
from .storage import threads_refused

__all__ = ["ByteBudget", "HostPool", "host_empty", "EAGER_COPY_MAX_BYTES"]

EAGER_COPY_MAX_BYTES = 128 << 20   # host-side bytes up to this are copied at once into a HostPool


class ByteBudget:
    """A counting semaphore over bytes. `acquire` blocks while the budget is used up."""

    def __init__(self, limit: int | None):
        self.limit, self.used, self.peak = limit, 0, 0
        self._cv = threading.Condition()

    def _fits(self, n: int) -> bool:   # a single item larger than the budget is allowed alone
        return self.limit is None or self.used == 0 or self.used + n <= self.limit

    def acquire(self, n: int, before_wait=None) -> None:
        """Reserve `n` bytes. Where that must wait, `before_wait()` is called first (outside the
        lock): `copy` then asks the writer to write out what it holds back (packed leaves
        gathered for a blob), whose bytes would otherwise never come back."""
        if before_wait is not None:
            with self._cv:
                fits = self._fits(n)
            if not fits:
                before_wait()
        with self._cv:
            self._cv.wait_for(lambda: self._fits(n))
            self.used += n
            self.peak = max(self.peak, self.used)

    def open(self) -> None:
        """Lift the limit for good (after a failure: nothing reserved will be written)."""
        with self._cv:
            self.limit = None
            self._cv.notify_all()

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class HostPool:
    """Host buffers reused from save to save for the copies `copy` takes of host-side leaves
    (numpy leaves, and jax arrays on CPU) when this process writes at most `max_bytes` of them.

    Example::

        from ckpt_callbacks.snapshot import copy, plan
        pool, items = HostPool(), []
        copy(plan(state), items.append, pool=pool)   # save 1: buffers allocated
        pool.recycle()                                # once save 1's writer is done with them
        copy(plan(state), items.append, pool=pool)   # save 2: the same buffers, warm

    Why not the zero-copy view: a donating training step (Keras' ``train_step``, most optax
    loops) cannot donate a buffer that a view still holds, so the runtime copies it itself, into
    freshly allocated memory, on the step's critical path: 32 MiB of weights cost that step
    ~20 ms on this project's 2-vCPU test machine, against ~3.5 ms for copying them at once into
    warm buffers. Above `max_bytes` (or a save's `ByteBudget` limit) views are kept, so the caller
    is never blocked for long. Buffers come from the C heap, page-aligned from 64 KiB (`host_empty`).

    Who calls what: `CheckpointManager` owns one. `copy` takes buffers on the caller's thread;
    the manager calls `recycle` after joining the previous save's writer (nothing reads its
    buffers any more), and `clear(background=True)` when it closes. Not thread-safe beyond that order.
    """

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = EAGER_COPY_MAX_BYTES if max_bytes is None else max_bytes
        self._free: dict[int, list] = {}
        self._lent: list = []

    def copy_of(self, src) -> np.ndarray:
        """A C-contiguous copy of `src` in one of the pool's buffers."""
        src = np.asarray(src)
        free = self._free.get(src.nbytes)
        buf = free.pop() if free else host_empty(src.nbytes)
        self._lent.append(buf)
        dst = buf.view(src.dtype).reshape(src.shape)
        np.copyto(dst, src)
        return dst

    def recycle(self) -> None:
        """The buffers lent since the last call become the free ones (others are dropped)."""
        self._free = {}
        for b in self._lent:
            self._free.setdefault(b.nbytes, []).append(b)
        self._lent = []

    def clear(self, background: bool = False) -> None:
        """Drop every buffer. With `background` they are freed on a thread of its own (where
        malloc mapped them, unmapping 30 MiB costs ~7 ms here): the manager's `close` need not wait."""
        bufs = [b for free in self._free.values() for b in free] + self._lent
        self._free, self._lent = {}, []
        if background and bufs and not threads_refused():   # (at exit on Python 3.12+: freed here)
            threading.Thread(target=bufs.clear, name="ckpt_callbacks-free", daemon=True).start()


def host_empty(nbytes: int) -> np.ndarray:
    """A pool buffer from the C heap; from 64 KiB on page-aligned (``posix_memalign``), so that
    `chunkwrite` may send it to a disk with O_DIRECT.

    Why the heap and not a fresh anonymous mapping: by the first save a training process holds
    tens of MiB that it touched and freed (compiling, building the model: ~70 MiB in a Keras fit
    here), and malloc hands those pages back without a fault. A fresh mapping faults in new pages,
    which a VM whose balloon reports free memory to its host (this project's test VM) pays ~3 ms
    per MiB for: the first save of a 30 MiB Keras state took 12-94 ms in its pool copy (median of
    six fresh processes ~73 ms), against 9-70 ms (~27 ms) from the heap (docs/benchmarks-log.md).
    Where the heap has no room, malloc maps fresh pages itself and the first copy faults them in.
    Not numpy's own allocation: numpy asks for transparent huge pages on every buffer of 4 MiB
    and more, and under the kernel's default defrag mode (``madvise``) a fault there may first
    compact memory (a fit's first save took 76-150 ms in 3 of 12 fits on an earlier test VM).
    """
    if nbytes < (64 << 10):
        return np.empty(nbytes, np.uint8)
    libc = _libc()
    if libc is None:   # no posix_memalign (e.g. Windows): numpy's, page-aligned by hand
        return chunkread.aligned_empty((nbytes,), np.uint8, mmap.PAGESIZE)
    return np.asarray(_Aligned(nbytes, libc))


class _Aligned:
    """A page-aligned block from ``posix_memalign``, freed when the last array viewing it goes
    (numpy keeps this object as the base of every view of `np.asarray(_Aligned(n, libc))`)."""

    def __init__(self, nbytes: int, libc):
        self._ptr, ptr = None, ctypes.c_void_p()
        if libc.posix_memalign(ctypes.byref(ptr), mmap.PAGESIZE, nbytes):
            raise MemoryError(f"posix_memalign of {nbytes} bytes failed")
        self._free, self._ptr = libc.free, ptr.value
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self._ptr, False),
                                    "version": 3}

    def __del__(self):
        if self._ptr:
            self._free(self._ptr)
            self._ptr = None


@functools.lru_cache(maxsize=None)
def _libc():
    """The C library's ``posix_memalign`` and ``free``, or None where ctypes cannot find them."""
    try:
        libc = ctypes.CDLL(None)
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        libc.posix_memalign.restype = ctypes.c_int
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
        return libc
    except (OSError, AttributeError, TypeError):
        return None
