"""Chunk files written straight from the snapshot's buffers: byte-identical to tensorstore's."""

import ctypes
import errno
import fcntl
import mmap
import os

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks import chunkwrite, layout, localstore
from ckpt_callbacks import format as fmt
from ckpt_callbacks.restore import read_manifest
from ckpt_callbacks.storage import open_store
from ckpt_callbacks.verify import verify_step
from ckpt_callbacks.writing import zarr_spec
from helpers import assert_tree_equal, random_array, skip_without_direct_io

CASES = [  # shape, chunks, box, dtype
    ((64, 48), (16, 48), ((16, 48), (0, 48)), "float32"),    # two whole-row chunks
    ((64, 48), (16, 16), ((0, 16), (16, 32)), "int16"),      # one chunk, a column block of the array
    ((8, 6, 4), (2, 6, 4), ((2, 8), (0, 6), (0, 4)), "uint8"),
    ((40,), (8,), ((8, 40),), "complex64"),
    ((32, 16), (8, 16), ((0, 32), (0, 16)), "bfloat16"),
    ((16, 16), (4, 16), ((4, 12), (0, 16)), "int4"),
    ((), (), (), "float64"),                                    # 0-d: one chunk file named "c"
]


@pytest.mark.parametrize("shape,chunks,box,dtype", CASES)
def test_chunk_files_are_byte_identical_to_tensorstores(tmp_path, shape, chunks, box, dtype):
    store = open_store(str(tmp_path))
    rec = {"sh": list(shape), "ch": list(chunks), "dt": dtype}
    x = random_array(shape, dtype, 1)
    part = np.array(x[tuple(slice(a, b) for a, b in box)], order="C").view(fmt.storage_dtype(dtype))
    ours = ts.open(zarr_spec(store, "ours", rec), create=True).result()
    theirs = ts.open(zarr_spec(store, "theirs", rec), create=True).result()
    theirs[tuple(slice(a, b) for a, b in box)].write(part).result()
    todo = chunkwrite.pieces(rec, box, part)
    assert [k for k, _ in todo] == [fmt.chunk_key(idx) for idx in layout.chunks_of(box, chunks)]
    for (key, view), crc in zip(todo, chunkwrite.chunk_crcs(rec, box, part)):
        assert chunkwrite.write_chunk(store.path(f"ours/{key}"), view) == (crc, True)
        assert open(store.path(f"ours/{key}"), "rb").read() == open(store.path(f"theirs/{key}"), "rb").read(), key
    # tensorstore reads them back, checking each crc32c
    got = ours[tuple(slice(a, b) for a, b in box)].read().result()
    assert np.asarray(got).tobytes() == part.tobytes()


@pytest.mark.parametrize("why,rec,box,data", [
    ("padded at the edge", {"sh": [10, 4], "ch": [4, 4]}, ((8, 10), (0, 4)), np.zeros((2, 4), np.float32)),
    ("box ends inside a chunk", {"sh": [16, 4], "ch": [8, 4]}, ((0, 4), (0, 4)), np.zeros((4, 4), np.float32)),
    ("box starts inside a chunk", {"sh": [16, 4], "ch": [8, 4]}, ((4, 16), (0, 4)), np.zeros((12, 4), np.float32)),
    ("chunk not contiguous in the box", {"sh": [8, 8], "ch": [8, 4]}, ((0, 8), (0, 8)), np.zeros((8, 8), np.int32)),
    ("bool", {"sh": [8], "ch": [8]}, ((0, 8),), np.zeros(8, bool)),
    ("big-endian", {"sh": [8], "ch": [8]}, ((0, 8),), np.zeros(8, ">f4")),
])
def test_what_cannot_be_written_byte_for_byte_is_left_to_tensorstore(why, rec, box, data):
    assert chunkwrite.pieces(rec, box, data) is None, why


@pytest.mark.parametrize("shape,chunks,box,data", [
    ((10, 6), (4, 6), ((8, 10), (0, 6)), np.arange(12, dtype=np.float32).reshape(2, 6)),   # padded edge
    ((10, 6), (4, 4), ((0, 10), (0, 6)), np.arange(60, dtype=np.int16).reshape(10, 6)),    # padded both ways
    ((5, 3, 7), (2, 2, 4), ((0, 5), (0, 3), (0, 7)), np.arange(105.0).reshape(5, 3, 7)),   # in every dimension
    ((5, 3), (4, 2), ((0, 5), (0, 3)), np.arange(15, dtype=">i4").reshape(5, 3)),          # big-endian, padded
    ((9,), (9,), ((0, 9),), np.array([0, 1, 1, 1, 0, 1, 1, 0, 1], bool)),
    ((8,), (4,), ((0, 8),), np.arange(8, dtype=">f4")),                                     # big-endian
    ((6, 4), (3, 4), ((0, 6), (0, 4)), np.arange(48, dtype=np.float32).reshape(6, 8)[:, ::2]),   # not contiguous
    ((), (), (), np.array(2.5)),                                                            # 0-d
    ((0, 4), (1, 4), ((0, 0), (0, 4)), np.zeros((0, 4), np.float32)),                      # no chunks
])
def test_chunk_crcs_are_those_of_the_chunks_tensorstore_stores(tmp_path, shape, chunks, box, data):
    """What tensorstore writes (object stores, and what `pieces` declines) is recorded in the
    manifest by `chunk_crcs`: each must be the CRC that ends the stored chunk."""
    store = open_store(str(tmp_path))
    rec = {"sh": list(shape), "ch": list(chunks), "dt": data.dtype.newbyteorder("=").name}
    arr = ts.open(zarr_spec(store, "a", rec), create=True).result()
    arr[tuple(slice(a, b) for a, b in box)].write(data).result()
    idxs = layout.chunks_of(box, chunks)
    tails = [open(store.path(f"a/{fmt.chunk_key(idx)}"), "rb").read()[-4:] for idx in idxs]
    assert chunkwrite.chunk_crcs(rec, box, data) == [int.from_bytes(t, "little") for t in tails]
    assert tails or 0 in shape


def test_chunk_crcs_of_a_padded_chunk_never_build_the_chunk():
    """A chunk padded at the array's edge (up to 64 MiB) was built whole to take its CRC: memory
    outside any budget. The CRC runs over the data, then over the padding's zeros."""
    import tracemalloc
    rec = {"sh": [4099, 1024], "ch": [4096, 1024]}     # the second chunk: 3 rows of data, 4093 padded
    data = np.ones((3, 1024), np.float32)
    tracemalloc.start()
    try:
        got = chunkwrite.chunk_crcs(rec, ((4096, 4099), (0, 1024)), data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    full = np.zeros((4096, 1024), np.float32)
    full[:3] = 1
    assert got == [fmt.crc32c(full)] and peak < 1 << 20


@pytest.mark.parametrize("size", [9, 400_000])   # packed in a blob; a zarr array written by tensorstore
def test_bools_held_in_bytes_other_than_0_and_1_are_saved_as_true(ckdir, size):
    """numpy reads any nonzero byte as True (a bool view of other bytes); tensorstore stored such a
    byte as it was and then refused to read the chunk back: the step was lost."""
    raw = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    flags = raw.view(bool)
    with cc.CheckpointManager(ckdir, async_save=False) as m:
        m.save(1, {"f": flags})
        got = m.restore()["f"]
    assert verify_step(open_store(ckdir), 1) == []
    assert got.dtype == bool and np.array_equal(got, raw != 0) and got.view(np.uint8).max() == 1


def test_short_writes_are_continued(tmp_path, monkeypatch):
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real(fd, [memoryview(bufs[0])[:1000]], off))
    x = random_array((64, 48), "float32", 2)
    chunkwrite.write_chunk(str(tmp_path / "c" / "0" / "0"), x)
    data = open(tmp_path / "c" / "0" / "0", "rb").read()
    assert data[:-4] == x.tobytes() and int.from_bytes(data[-4:], "little") == fmt.crc32c(x)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_save_writes_native_arrays_directly_and_the_rest_through_tensorstore(ckdir, monkeypatch):
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    tree = {"w": jax.device_put(random_array((512, 640), "float32", 3), NamedSharding(mesh, P("a", "b"))),
            "flags": random_array((1500, 1000), "bool", 4),                     # tensorstore: bools
            "be": random_array((600, 700), "float32", 5).astype(">f4"),       # made native at save: direct
            "np": random_array((1000, 1000), "int16", 6)}
    written = []
    real = chunkwrite.write_chunk
    monkeypatch.setattr(chunkwrite, "write_chunk", lambda path, view, **kw: (written.append(path), real(path, view, **kw))[1])
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree)
        m.wait_until_finished()
        out = m.restore(target=tree)
        plain = m.restore()
    assert_tree_equal(out, tree)   # onto a >f4 target: in the target's byte order
    assert_tree_equal(plain["be"], tree["be"].astype(np.float32))   # target None: in native order
    arrays = {r["p"][0][1]: r["z"] for r in read_manifest(open_store(ckdir), 1)["leaves"] if r["k"] == "array"}
    direct = {}
    for path in written:
        rel = os.path.relpath(path, ckdir).split(os.sep)   # step_N.tmp-<id>/arrays/<n>/c/...
        z = f"{rel[1]}/{rel[2]}"
        direct[z] = direct.get(z, 0) + 1
    assert set(arrays) == {"w", "flags", "be", "np"}      # all stored as zarr arrays, none packed
    assert direct == {arrays["w"]: 8, arrays["np"]: 1, arrays["be"]: 1}   # every shard of "w"; not "flags"


@pytest.mark.parametrize("offer", ["same size", "other size", "symlink", "hard link", "gone"])
def test_a_claimed_file_is_overwritten_in_place_only_when_safe(tmp_path, offer):
    x = random_array((64, 32), "float32", 1)
    expected = x.tobytes() + fmt.crc32c(x).to_bytes(4, "little")
    old = str(tmp_path / "old")
    target = str(tmp_path / "target")   # what a symlink points at: must stay untouched
    open(target, "wb").write(b"\1" * len(expected))
    if offer == "symlink":
        os.symlink(target, old)
    elif offer != "gone":
        open(old, "wb").write(b"\0" * (len(expected) + (offer == "other size")))
    if offer == "hard link":
        os.link(old, str(tmp_path / "backup"))
    held = os.open(old, os.O_RDONLY) if offer in ("same size", "other size", "hard link") else None
    before = os.pread(held, 1 << 20, 0) if held is not None else None
    asked = []
    path = str(tmp_path / "step" / "c" / "0")
    chunkwrite.write_chunk(path, x, claim=lambda n, _p: asked.append(n) or old)
    assert asked == [len(expected)]
    assert open(path, "rb").read() == expected and not os.path.islink(path) and not os.path.exists(old)
    assert open(target, "rb").read() == b"\1" * len(expected)   # a symlink is never followed
    if held is not None:   # the offered file: overwritten in place only when it was safe
        reused = os.fstat(held).st_ino == os.stat(path).st_ino
        assert reused == (offer == "same size")
        assert (os.pread(held, 1 << 20, 0) == before) == (not reused)
        os.close(held)
    if offer == "hard link":
        assert open(str(tmp_path / "backup"), "rb").read() == b"\0" * len(expected)


def page_aligned(x: np.ndarray) -> np.ndarray:
    """A copy of `x` in an anonymous mapping, page-aligned like hostmem.HostPool's buffers."""
    out = np.frombuffer(mmap.mmap(-1, max(x.nbytes, 1)), x.dtype, count=x.size).reshape(x.shape)
    out[...] = x
    return out


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mincore of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        try:
            assert libc.mincore(addr, size, vec) == 0
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def spy_direct(monkeypatch) -> list:
    """Record each write: ("pwrite" | "pwritev", offset, bytes, whether the fd had O_DIRECT set)."""
    seen, real, realv = [], os.pwrite, os.pwritev
    flag = lambda fd: bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)   # noqa: E731
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (
        seen.append(("pwrite", off, len(data), flag(fd))), real(fd, data, off))[1])
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: (
        seen.append(("pwritev", off, sum(len(b) for b in bufs), flag(fd))), realv(fd, bufs, off))[1])
    return seen


@pytest.fixture
def direct_dir(tmp_path):
    """`tmp_path`, where its file system lets a file be switched to O_DIRECT (else skipped)."""
    skip_without_direct_io(tmp_path)
    return tmp_path


def expected_file(x: np.ndarray) -> bytes:
    return x.tobytes() + fmt.crc32c(x).to_bytes(4, "little")


@pytest.mark.parametrize("shape,dtype", [((1024, 1024), "float32"),   # whole 4 KiB blocks only
                                         ((1000, 1001), "uint8"),     # blocks, then a tail
                                         ((10, 10), "float32")])     # under one block: no O_DIRECT
def test_page_aligned_chunks_go_to_the_device_without_the_page_cache(direct_dir, monkeypatch, shape, dtype):
    x = page_aligned(random_array(shape, dtype, 7))
    seen = spy_direct(monkeypatch)
    path = str(direct_dir / "c" / "0")
    assert chunkwrite.write_chunk(path, x, direct=True) == (fmt.crc32c(x), True)
    n = x.nbytes
    blocks = n - n % chunkwrite.DIRECT_ALIGN
    assert seen == ([("pwrite", 0, blocks, True)] if blocks else []) + [("pwritev", blocks, n + 4 - blocks, False)]
    if blocks and localstore.LocalStore(str(direct_dir)).direct_io:   # a disk: only the tail's page was cached
        assert resident_pages(path) <= 1
    assert open(path, "rb").read() == expected_file(x)


def test_unaligned_or_undirected_chunks_go_through_the_page_cache(direct_dir, monkeypatch):
    x = page_aligned(random_array((1024, 1040), "float32", 8))
    off64 = np.frombuffer(x.data, np.uint8)[64:64 + 4096 * 100]    # 64 bytes into the mapping
    seen = spy_direct(monkeypatch)
    for k, (view, direct) in enumerate([(off64, True), (x[1:], True), (x, False)]):   # x[1:]: 4160 bytes in
        assert chunkwrite.write_chunk(str(direct_dir / f"c{k}"), view, direct=direct)[1] is True
        assert open(direct_dir / f"c{k}", "rb").read() == expected_file(view)
    assert [w[0] for w in seen] == ["pwritev"] * 3 and not any(w[3] for w in seen)


@pytest.mark.parametrize("refusal", ["fcntl", "pwrite", "pwrite-notsup", "short"])
def test_a_refused_or_short_direct_write_falls_back_to_the_page_cache(direct_dir, monkeypatch, refusal):
    x = page_aligned(random_array((512, 1024), "float32", 9))
    real_fcntl, real_pwrite = fcntl.fcntl, os.pwrite
    short = 3 * 4096 + 100

    def no_direct_flag(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    def pwrite(fd, data, off):
        if refusal.startswith("pwrite"):
            raise OSError(errno.EOPNOTSUPP if refusal.endswith("notsup") else errno.EINVAL, "refused")
        # a short write that ends off the block grid (through a descriptor without O_DIRECT)
        other = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
        try:
            return real_pwrite(other, memoryview(data)[:short], off)
        finally:
            os.close(other)

    if refusal == "fcntl":
        monkeypatch.setattr(chunkwrite.fcntl, "fcntl", no_direct_flag)
    else:
        monkeypatch.setattr(os, "pwrite", pwrite)
    seen = spy_direct(monkeypatch) if refusal == "short" else []
    path = str(direct_dir / "c" / "0")
    assert chunkwrite.write_chunk(path, x, direct=True)[1] is (refusal == "short")
    assert open(path, "rb").read() == expected_file(x)
    if refusal == "short":   # the page cache takes over exactly where the short write stopped
        assert seen == [("pwrite", 0, x.nbytes, True), ("pwritev", short, x.nbytes + 4 - short, False)]


def test_a_failed_direct_write_fails_the_chunk(direct_dir, monkeypatch):
    x = page_aligned(random_array((512, 1024), "float32", 10))

    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        chunkwrite.write_chunk(str(direct_dir / "c" / "0"), x, direct=True)


def blob_parts(seed: int, sizes) -> list:
    """Buffers as `format.pack_bins` hands them over: bytes and views of arrays, of any size."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, np.uint8).tobytes() if k % 2 else memoryview(rng.integers(0, 256, n, np.uint8))
            for k, n in enumerate(sizes)]


def window(blocks: int) -> np.ndarray:
    return page_aligned(np.zeros(blocks * chunkwrite.DIRECT_ALIGN, np.uint8))


@pytest.mark.parametrize("sizes", [[3, 0, 5000, 70_000, 1, 4093, 20_000],   # several windows, then a tail
                                   [4096 * 3, 4096 * 3],                      # whole windows only
                                   [100, 0, 7],                               # under one block
                                   []])                                       # an empty file
def test_blob_parts_go_to_the_device_through_a_window(direct_dir, monkeypatch, sizes):
    parts = blob_parts(1, sizes)
    total = sum(sizes)
    win = window(3)
    seen = spy_direct(monkeypatch)
    path = str(direct_dir / "blobs" / "p0-0.msgpack")
    assert chunkwrite.write_parts(path, parts, win) is True
    span, blocks = len(win), total - total % chunkwrite.DIRECT_ALIGN
    # every full window, and the last one's whole blocks, by O_DIRECT at the window's offset;
    # only the last partial block through the page cache
    expected = [("pwrite", off, min(span, blocks - off), True) for off in range(0, blocks, span)]
    if total % chunkwrite.DIRECT_ALIGN:
        expected.append(("pwritev", blocks, total - blocks, False))
    assert seen == expected
    if blocks and localstore.LocalStore(str(direct_dir)).direct_io:   # a disk: only the tail's page was cached
        assert resident_pages(path) <= 1
    assert open(path, "rb").read() == b"".join(bytes(p) for p in parts)


def test_a_page_aligned_leaf_at_a_block_boundary_of_the_blob_goes_to_the_device_from_its_own_buffer(
        direct_dir, monkeypatch):
    """A large packed leaf starts at a multiple of 4 KiB in its blob (`format.blob_align`); its
    pool copy is page-aligned: its whole blocks are written by O_DIRECT straight from it, not
    copied through the window first. Smaller or unaligned parts still go through the window."""
    rng = np.random.default_rng(7)
    big = page_aligned(rng.integers(0, 256, 3 * 4096 + 100, np.uint8))    # 3 whole blocks and a tail
    unaligned = rng.integers(0, 256, 2 * 4096 + 1, np.uint8)[1:]             # whole blocks, but off the page grid
    small = rng.integers(0, 256, 300, np.uint8)
    items = [small, big, unaligned, big]
    parts, index = fmt.pack_bins([memoryview(x) for x in items], align=[64, 4096, 4096, 4096])
    seen = spy_direct(monkeypatch)
    path = direct_dir / "blob"
    win = window(2)
    assert chunkwrite.write_parts(str(path), parts, win) is True
    data = path.read_bytes()
    entries = fmt.bin_entries(data)
    for x, i in zip(items, index):
        off, n = entries[i]
        assert data[off:off + n] == x.tobytes()
    starts = [entries[index[1]][0], entries[index[3]][0]]
    # the window's blocks before each big leaf, then the big leaf's 3 blocks at its own offset
    assert [(off, n) for kind, off, n, direct in seen if direct and n == 3 * 4096 and off in starts] == \
        [(starts[0], 3 * 4096), (starts[1], 3 * 4096)]
    assert sum(n for _, _, n, _ in seen) == len(data)   # every byte written once
    assert [w for w in seen if not w[3]] == [("pwritev", len(data) - len(data) % 4096, len(data) % 4096, False)]


def test_blob_parts_without_direct_io_or_refused_go_through_the_page_cache(direct_dir, monkeypatch):
    parts = blob_parts(2, [5000, 30_000, 11])
    seen = spy_direct(monkeypatch)
    assert chunkwrite.write_parts(str(direct_dir / "a"), parts, direct=False) is True
    assert seen == [("pwritev", 0, 35_011, False)]   # straight from the parts: no window, one call
    real_fcntl = fcntl.fcntl

    def no_direct_flag(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(chunkwrite.fcntl, "fcntl", no_direct_flag)
    assert chunkwrite.write_parts(str(direct_dir / "b"), parts, window(2)) is False   # the caller stops asking
    for name in "ab":
        assert open(direct_dir / name, "rb").read() == b"".join(bytes(p) for p in parts)


def test_a_blob_of_more_parts_than_one_pwritev_takes_is_written_whole(tmp_path):
    parts = blob_parts(8, [1 + k % 7 for k in range(3000)])   # IOV_MAX is 1024 on Linux
    assert chunkwrite.write_parts(str(tmp_path / "blob"), parts, direct=False) is True
    assert (tmp_path / "blob").read_bytes() == b"".join(bytes(p) for p in parts)


def test_a_blob_replaces_a_file_hard_linked_elsewhere_and_refuses_a_misaligned_window(direct_dir):
    path, backup = direct_dir / "blob", direct_dir / "backup"
    path.write_bytes(b"old" * 5000)
    os.link(path, backup)
    chunkwrite.write_parts(str(path), blob_parts(3, [9000]), window(1))
    assert backup.read_bytes() == b"old" * 5000 and path.read_bytes() == bytes(blob_parts(3, [9000])[0])
    for bad in (page_aligned(np.zeros(4096 + 512, np.uint8)), np.frombuffer(window(2).data, np.uint8)[64:64 + 4096]):
        with pytest.raises(ValueError, match="page-aligned"):
            chunkwrite.write_parts(str(path), [b"x"], bad)


@pytest.mark.parametrize("direct", [True, False])
def test_a_blob_overwrites_a_claimed_file_of_its_size_in_place(direct_dir, direct):
    parts = blob_parts(5, [5000, 30_000, 11])
    total = sum(len(memoryview(p)) for p in parts)
    old, path = direct_dir / "old", direct_dir / "blobs" / "p0-0.msgpack"
    old.write_bytes(b"x" * total)
    ino = os.stat(old).st_ino
    asked = []
    claim = lambda n, p: (asked.append((n, p)), str(old))[1]
    win = window(2) if direct else None
    assert chunkwrite.write_parts(str(path), parts, win, direct=direct, claim=claim) is True
    assert asked == [(total, str(path))] and not old.exists()
    assert os.stat(path).st_ino == ino and path.read_bytes() == b"".join(bytes(p) for p in parts)
    # a claimed file hard-linked elsewhere (a backup) is never written through: a new file instead
    backup = direct_dir / "backup"
    os.link(path, backup)
    before = backup.read_bytes()
    new = blob_parts(6, [5000, 30_000, 11])
    chunkwrite.write_parts(str(path), new, win, direct=direct, claim=lambda n, p: str(path))
    assert backup.read_bytes() == before and path.read_bytes() == b"".join(bytes(p) for p in new)
    assert os.stat(path).st_ino != ino


def test_a_failed_blob_write_fails_it(direct_dir, monkeypatch):
    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        chunkwrite.write_parts(str(direct_dir / "blob"), blob_parts(4, [20_000]), window(2))
