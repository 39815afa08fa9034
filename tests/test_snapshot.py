"""The blocking part of a save: what `snapshot.copy` hands the writer, and the HostPool of warm
buffers that host-side leaves are copied into."""

import ctypes
import mmap
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import snapshot


def _copies(tree, pool=None, budget=None):
    snap = snapshot.plan(tree)
    items = []
    snapshot.copy(snap, items.append, budget, pool)
    assert items[-1] is None
    out = {}
    for it in items[:-1]:
        if it[0] == "packed":
            out[it[1]] = it[2]
        else:
            out[it[1].leaf] = it[1].data
    return snap, out


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
    pool = snapshot.HostPool()
    got = pool.copy_of(src)
    assert got.dtype == np.asarray(src).dtype and got.shape == np.shape(src)
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, src)
    assert not np.shares_memory(got, np.asarray(src)) or got.nbytes == 0


def test_recycled_buffers_are_reused_by_size_and_unused_ones_are_dropped():
    pool = snapshot.HostPool()
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


def _resident_pages(buf) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(-(-buf.nbytes // mmap.PAGESIZE))
    assert libc.mincore(buf.ctypes.data, buf.nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and madvise as on Linux")
@pytest.mark.parametrize("kernel", ["madvise-populate", "before-5.14"])
def test_a_mapped_pool_buffer_is_page_aligned_and_populated_before_its_first_copy(monkeypatch, kernel):
    """From 2 MiB a buffer is an anonymous mapping, every page present before the first copy
    (which would otherwise fault page by page on the caller's blocking path); on a kernel
    without MADV_POPULATE_WRITE (EINVAL) it is mapped again with MAP_POPULATE."""
    if kernel == "before-5.14":
        monkeypatch.setattr(snapshot, "_MADV_POPULATE_WRITE", 0x7FFF)   # an advice the kernel refuses
    buf = snapshot._host_empty(6 << 20)
    assert buf.nbytes == 6 << 20 and buf.flags.writeable and buf.ctypes.data % mmap.PAGESIZE == 0
    assert _resident_pages(buf) == (6 << 20) // mmap.PAGESIZE
    buf[:] = 7
    assert int(buf[-1]) == 7


@pytest.mark.parametrize("modes, asks", [("always defer defer+madvise [madvise] never", False),
                                          ("[always] defer defer+madvise madvise never", False),
                                          ("always defer [defer+madvise] madvise never", False),
                                          ("always [defer] defer+madvise madvise never", True),
                                          ("always defer defer+madvise madvise [never]", True), (None, False)])
def test_huge_pages_are_asked_for_only_where_the_kernel_never_compacts_memory_for_them(tmp_path, modes, asks):
    """MADV_HUGEPAGE under defrag ``madvise`` (and ``always``, ``defer+madvise``) lets a page fault
    compact memory first (the first save of a fit took up to 150 ms here): asked for only under
    ``defer`` and ``never``, and not at all without that file."""
    f = tmp_path / "defrag"
    if modes is not None:
        f.write_text(modes + "\n")
    assert snapshot._huge_pages_never_stall(str(f)) is asks


def test_clear_in_the_background_empties_the_pool_at_once_and_frees_the_buffers_soon():
    import gc
    import time
    import weakref
    pool = snapshot.HostPool()
    pool.copy_of(np.ones(1 << 20, np.float32))                   # 4 MiB, mapped
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


def test_cpu_state_within_the_pool_limit_is_copied_and_larger_or_budgeted_state_is_viewed():
    x = jax.device_put(jnp.arange(1 << 19, dtype=jnp.float32))   # 2 MiB: a zarr array
    tree = {"x": x, "n": np.ones(4), "s": jnp.float32(1)}
    snap, out = _copies(tree, snapshot.HostPool())
    assert snap.pooled
    assert not any(np.shares_memory(v, np.asarray(x)) for v in out.values())
    np.testing.assert_array_equal(out[2], np.asarray(x))

    snap, out = _copies(tree, snapshot.HostPool(max_bytes=1 << 20))   # over the limit: a view
    assert not snap.pooled and np.shares_memory(out[2], np.asarray(x))

    budget = snapshot.ByteBudget(1 << 20)        # the budget wins too (x alone: nothing releases here)
    snap, out = _copies({"x": x}, snapshot.HostPool(), budget)
    assert not snap.pooled and np.shares_memory(out[0], np.asarray(x))

    snap, out = _copies(tree)                                            # no pool: views
    assert not snap.pooled and np.shares_memory(out[2], np.asarray(x))


def test_a_deleted_jax_array_is_an_invalid_tree_naming_the_key_path(ckdir):
    import jax.numpy as jnp
    gone = jnp.ones(3)
    gone.delete()   # as a donating step leaves it
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: this jax.Array was deleted"):
            m.save(1, {"opt": [jnp.zeros(2), gone]})
        assert m.all_steps() == []


@pytest.mark.parametrize("leaf,message", [
    (np.ma.masked_array([1.0, 2.0, -999.0], mask=[0, 0, 1]), "a numpy masked array would lose its mask"),
    (np.zeros((1,) * 33, np.float32), "33 dimensions; the format holds at most 32"),            # packed
    (np.zeros((2,) * 20 + (1,) * 13, np.float32), "33 dimensions; the format holds at most 32"),  # a zarr array
])
def test_leaves_the_format_cannot_hold_as_they_are_are_refused_at_save_naming_the_key_path(ckdir, leaf, message):
    """A masked array was saved without its mask (restored with the masked values); a leaf of more
    than 32 dimensions (numpy 2 allows 64) committed a step that no restore could read, or failed
    in the writer without a key path."""
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: " + message):
            m.save(1, {"opt": [np.zeros(2), leaf]})
        assert m.all_steps() == []
