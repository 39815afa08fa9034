"""Host memory for a save's copies: the HostPool of warm buffers that host-side leaves are copied
into, its page-aligned heap buffers, and the ByteBudget that bounds the copies held at once."""

import mmap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from ckpt_callbacks import hostmem


SOURCES = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "bf16": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
    "bool": np.array([True, False, True]),
    "scalar": np.float64(2.5),
    "empty": np.zeros((0, 5), np.int32),
    "fortran": np.asfortranarray(np.arange(20, dtype=np.int16).reshape(4, 5)),
    "big_endian": np.arange(5, dtype=">i4"),
    "large": np.arange(3 << 19, dtype=np.float32),          # 6 MiB: a mapped buffer
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_pool_copy_is_exact_c_contiguous_and_writable(name):
    src = SOURCES[name]
    pool = hostmem.HostPool()
    got = pool.copy_of(src)
    assert got.dtype == np.asarray(src).dtype and got.shape == np.shape(src)
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, src)
    assert not np.shares_memory(got, np.asarray(src)) or got.nbytes == 0


def test_recycled_buffers_are_reused_by_size_and_unused_ones_are_dropped():
    pool = hostmem.HostPool()
    a = pool.copy_of(np.ones(1 << 20, np.float32))              # 4 MiB
    b = pool.copy_of(np.ones(10, np.float32))
    pool.recycle()
    a2 = pool.copy_of(np.full(1 << 20, 3, np.float32))           # the same bytes: the same buffer
    assert np.shares_memory(a, a2) and (a == 3).all()
    c = pool.copy_of(np.ones(11, np.float32))                    # another size: a new buffer
    assert not np.shares_memory(b, c)
    pool.recycle()                                               # b was not used in this round
    assert sorted(pool._free) == [44, 4 << 20]
    pool.clear()
    assert pool._free == {} and pool._lent == []


@pytest.mark.parametrize("nbytes", [100, (64 << 10) + 3, 6 << 20])
def test_a_pool_buffer_comes_from_the_heap_page_aligned_from_64_kib(nbytes):
    """Pool buffers are malloc'd memory, not fresh mappings: a training process has freed memory
    in its heap that comes back without page faults, where each page of a new mapping is faulted
    in (on this project's VM ~3 ms per MiB). From 64 KiB they are page-aligned for O_DIRECT, by
    ``posix_memalign`` rather than numpy (which asks for huge pages from 4 MiB, and under the
    kernel's default defrag mode a fault there may first compact memory)."""
    import weakref
    buf = hostmem.host_empty(nbytes)
    assert buf.nbytes == nbytes and buf.flags.writeable and buf.flags.c_contiguous
    owner = buf
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if nbytes < 64 << 10:
        assert owner.base is None and owner.flags.owndata        # numpy's own, small
        return
    assert buf.ctypes.data % mmap.PAGESIZE == 0
    assert isinstance(owner.base, hostmem._Aligned)             # posix_memalign'd
    buf[:] = 7
    view = buf[-10:]
    gone = weakref.ref(owner.base)
    del buf, owner
    assert gone() is not None and int(view.sum()) == 70          # a view keeps the block
    del view
    import gc
    gc.collect()
    assert gone() is None                                        # and the last one frees it


def test_without_posix_memalign_a_pool_buffer_is_numpys_page_aligned(monkeypatch):
    monkeypatch.setattr(hostmem, "_libc", lambda: None)   # e.g. Windows
    buf = hostmem.host_empty(1 << 20)
    assert buf.nbytes == 1 << 20 and buf.ctypes.data % mmap.PAGESIZE == 0 and buf.flags.writeable
    assert not isinstance(buf.base, hostmem._Aligned)


def test_clear_in_the_background_empties_the_pool_at_once_and_frees_the_buffers_soon():
    import gc
    import time
    import weakref
    pool = hostmem.HostPool()
    pool.copy_of(np.ones(1 << 20, np.float32))                   # 4 MiB
    pool.recycle()
    pool.copy_of(np.ones(3, np.float32))                         # lent
    refs = [weakref.ref(b) for free in pool._free.values() for b in free] + [weakref.ref(b) for b in pool._lent]
    pool.clear(background=True)
    assert pool._free == {} and pool._lent == []
    deadline = time.monotonic() + 10
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert all(r() is None for r in refs)


def test_a_budget_blocks_until_released_lets_one_oversized_item_through_alone_and_opens_for_good():
    budget = hostmem.ByteBudget(100)
    budget.acquire(150)                      # larger than the budget: allowed while nothing is held
    got, asked = [], []
    t = threading.Thread(target=lambda: (budget.acquire(10, before_wait=lambda: asked.append(1)), got.append(1)))
    t.start()
    time.sleep(0.2)
    assert got == [] and asked == [1]        # waits, and first asked the writer to give bytes back
    budget.release(150)
    t.join(5)
    assert got == [1] and budget.used == 10 and budget.peak == 150
    budget.acquire(90)                       # fits exactly: no wait
    budget.open()                            # after a failure nothing waits again
    budget.acquire(1 << 40)
    assert budget.used == 100 + (1 << 40) and budget.limit is None
