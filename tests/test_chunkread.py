"""Direct reads of whole local zarr3 chunks: byte-identical to tensorstore's reads, strict about damage."""

import itertools
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts

from ckpt_callbacks import chunkread
from ckpt_callbacks import format as fmt
from ckpt_callbacks import layout
from ckpt_callbacks.errors import CorruptCheckpointError
from ckpt_callbacks.chunkread import aligned_empty
from ckpt_callbacks.storage import open_store
from ckpt_callbacks.writing import zarr_spec
from helpers import random_array

CASES = [  # shape, chunks, dtype
    ((64, 48), (16, 48), "float32"),      # chunks contiguous in any row band
    ((64, 48), (16, 16), "int16"),        # chunks not contiguous in a multi-chunk box
    ((50, 30), (16, 16), "float64"),      # edge chunks padded in their files
    ((7, 5, 3), (2, 5, 3), "uint8"),
    ((33,), (8,), "bool"),
    ((), (), "int32"),                    # 0-d: one chunk file named "c"
    ((0, 4), (1, 4), "float32"),          # empty: no chunk files at all
]


def write(ckdir, shape, chunks, dtype, seed=0):
    store = open_store(str(ckdir))
    rec = {"sh": list(shape), "ch": list(chunks), "dt": dtype}
    x = random_array(shape, dtype, seed)
    arr = ts.open(zarr_spec(store, "a", rec), create=True).result()
    arr.write(x).result()
    return store.path("a"), rec, x, ts.open({"driver": "zarr3", "kvstore": store.kvstore("a"), "open": True}).result()


def aligned_boxes(shape, chunks):
    """Every box that starts on a chunk boundary and ends on one or at the edge."""
    per_dim = []
    for n, c in zip(shape, chunks):
        cuts = sorted(set(range(0, n, c)) | {n})
        per_dim.append([(a, b) for a, b in itertools.combinations(cuts, 2)] or [(0, 0)])
    return list(itertools.product(*per_dim))


@pytest.mark.parametrize("shape,chunks,dtype", CASES)
def test_direct_reads_match_tensorstore_for_every_aligned_box(tmp_path, shape, chunks, dtype):
    root, rec, x, arr = write(tmp_path, shape, chunks, dtype)
    assert chunkread.direct(arr)
    for box in aligned_boxes(shape, chunks)[:60]:
        out = aligned_empty(tuple(b - a for a, b in box), np.dtype(dtype))
        chunkread.read_boxes(root, rec, [box], [out], "['x']")
        want = arr[tuple(slice(a, b) for a, b in box)].read().result()
        assert out.tobytes() == np.asarray(want).tobytes(), box


def _chunk(root, *idx):
    return os.path.join(root, "c", *map(str, idx))


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow", "delete", "flip_crc", "dir_is_file", "file_is_dir"])
def test_damaged_chunk_is_refused_with_the_key_path(tmp_path, damage):
    root, rec, x, _ = write(tmp_path, (64, 48), (16, 16), "float32")
    path = _chunk(root, 1, 2)
    data = bytearray(open(path, "rb").read())
    if damage in ("dir_is_file", "file_is_dir"):   # the tree itself is broken
        if damage == "dir_is_file":
            shutil.rmtree(os.path.dirname(path))
            open(os.path.dirname(path), "wb").write(bytes(data))
        else:
            os.remove(path)
            os.mkdir(path)
        damage = "keep"
    if damage == "flip":
        data[100] ^= 0x10
    elif damage == "flip_crc":
        data[-1] ^= 0x01
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "grow":
        data += b"\0"
    if damage == "delete":
        os.remove(path)
    elif damage != "keep":
        open(path, "wb").write(bytes(data))
    out = aligned_empty((64, 48), np.float32)
    with pytest.raises(CorruptCheckpointError, match=r"\['params'\]\['w'\]") as e:
        chunkread.read_boxes(root, rec, [((0, 64), (0, 48))], [out], "['params']['w']")
    assert e.value.key_path == "['params']['w']"
    # the chunks that are intact still read, box by box
    good = aligned_empty((16, 48), np.float32)
    chunkread.read_boxes(root, rec, [((0, 16), (0, 48))], [good], "['params']['w']")
    np.testing.assert_array_equal(good, x[:16])


def test_other_codecs_are_left_to_tensorstore(tmp_path):
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "z")},
            "metadata": {"shape": [8, 8], "data_type": "float32",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
                         "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]}}
    arr = ts.open(spec, create=True).result()
    assert not chunkread.direct(arr)
    spec["kvstore"]["path"] = str(tmp_path / "z2")
    spec["metadata"]["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]
    assert not chunkread.direct(ts.open(spec, create=True).result())


def test_storage_dtype_of_exotic_dtypes_reads_bit_exactly(tmp_path):
    x = random_array((32, 16), "bfloat16", 3)
    store = open_store(str(tmp_path))
    rec = {"sh": [32, 16], "ch": [8, 16], "dt": "bfloat16"}
    arr = ts.open(zarr_spec(store, "b", rec), create=True).result()
    arr.write(x.view(fmt.storage_dtype("bfloat16"))).result()
    out = aligned_empty((16, 16), fmt.storage_dtype("bfloat16"))
    chunkread.read_boxes(store.path("b"), rec, [((8, 24), (0, 16))], [out], "['b']")
    assert out.view(x.dtype).tobytes() == x[8:24].tobytes()


@pytest.mark.parametrize("rows,cols", [([0, 24, 64], [0, 20, 48]), ([0, 32, 64], [0, 8, 16, 24, 32, 40, 48]),
                                       ([0, 64], [0, 48]), ([0, 1, 63, 64], [0, 47, 48])])
def test_boxes_that_cut_chunks_read_each_chunk_once(tmp_path, rows, cols):
    """Counted as the bench counts (read(2)'s ``rchar``)."""
    from helpers import bytes_read
    root, rec, x, _ = write(tmp_path, (64, 48), (16, 16), "float32")
    boxes = [((r0, r1), (c0, c1)) for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]
    outs = [aligned_empty((r1 - r0, c1 - c0), np.float32) for (r0, r1), (c0, c1) in boxes]
    before = bytes_read()
    chunkread.read_boxes(root, rec, boxes, outs, "['x']")
    got = bytes_read() - before
    assert 12 * (16 * 16 * 4 + 4) <= got < 12 * (16 * 16 * 4 + 4) + 512, got   # 4 x 3 chunks, each once
    for ((r0, r1), (c0, c1)), out in zip(boxes, outs):
        np.testing.assert_array_equal(out, x[r0:r1, c0:c1])


@pytest.fixture(params=[1, 192, 1 << 20], ids=["band=1row", "band=192B", "band=1MiB"])
def shared(request, monkeypatch):
    """How shared chunks are read: in bands of BAND_BYTES (one row, a few rows that do not divide
    the chunk: 3 rows of a 16-row float32 chunk of 16 columns, or the whole chunk at once)."""
    monkeypatch.setattr(chunkread, "BAND_BYTES", request.param)


@pytest.mark.parametrize("shape,chunks,dtype", [((64, 48), (16, 16), "float32"), ((50, 30), (16, 16), "float64"),
                                                ((7, 5, 3), (2, 5, 3), "uint8"), ((33,), (8,), "bool"),
                                                ((6, 1000), (3, 1000), "int32"), ((20, 6), (8, 6), "bfloat16")])
def test_chunks_split_between_boxes_match_tensorstore(tmp_path, shape, chunks, dtype, shared):
    root, rec, x, arr = write(tmp_path, shape, chunks, dtype)
    # boxes that cut every chunk in every dimension: halves of each chunk, plus a box spanning chunks
    cuts = [sorted({0, n} | {min(n, i + max(1, c // 2)) for i in range(0, n, c)} | set(range(0, n, c)))
            for n, c in zip(shape, chunks)]
    boxes = list(itertools.product(*[list(zip(cs, cs[1:])) for cs in cuts]))
    boxes.append(tuple((n // 3, n) for n in shape))   # overlaps the others
    outs = [aligned_empty(tuple(b - a for a, b in box), np.dtype(dtype)) for box in boxes]
    chunkread.read_boxes(root, rec, boxes, outs, "['x']")
    for box, out in zip(boxes, outs):
        assert out.tobytes() == x[tuple(slice(a, b) for a, b in box)].tobytes(), box


@pytest.mark.parametrize("shape,chunks,box", [((32, 16), (16, 16), ((0, 16), (0, 16))), ((), (), ())])
def test_a_box_listed_twice_gets_the_whole_chunk_both_times(tmp_path, shape, chunks, box, shared):
    root, rec, x, _ = write(tmp_path, shape, chunks, "int16")
    outs = [aligned_empty(layout.box_shape(box), np.int16) for _ in range(2)]
    chunkread.read_boxes(root, rec, [box, box], outs, "['x']")
    for out in outs:
        np.testing.assert_array_equal(out, x[tuple(slice(a, b) for a, b in box)])


def test_buffers_are_64_byte_aligned():
    for shape, dtype in [((3,), np.uint8), ((5, 7), np.float64), ((), np.int32), ((1 << 20,), np.float32)]:
        out = aligned_empty(shape, dtype)
        assert out.ctypes.data % 64 == 0 and out.shape == shape and out.dtype == dtype and out.flags.c_contiguous
    out = aligned_empty((3, 5000), np.uint8, 4096)   # any alignment asked for
    assert out.ctypes.data % 4096 == 0 and out.shape == (3, 5000) and out.flags.c_contiguous


@pytest.mark.parametrize("byte", [0, 700, 1023])   # first, middle and last byte of the chunk's data
def test_damage_in_a_chunk_shared_by_boxes_is_refused(tmp_path, byte, shared):
    root, rec, x, _ = write(tmp_path, (64, 48), (16, 16), "float32")
    path = _chunk(root, 1, 2)
    data = bytearray(open(path, "rb").read())
    data[byte] ^= 0x40
    open(path, "wb").write(bytes(data))
    boxes = [((16, 24), (32, 48)), ((24, 32), (32, 40)), ((24, 32), (40, 48))]   # three boxes share it
    outs = [aligned_empty((8, 16), np.float32), aligned_empty((8, 8), np.float32),
            aligned_empty((8, 8), np.float32)]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as e:
        chunkread.read_boxes(root, rec, boxes, outs, "['params']['w']")
    assert e.value.key_path == "['params']['w']"


@pytest.mark.parametrize("damage", ["truncate", "grow", "delete"])
def test_shared_chunk_with_a_wrong_size_or_missing_is_refused(tmp_path, damage):
    root, rec, x, _ = write(tmp_path, (64, 48), (16, 16), "float32")
    path = _chunk(root, 0, 0)
    if damage == "delete":
        os.remove(path)
    else:
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-8] if damage == "truncate" else data + b"\0")
    out = aligned_empty((8, 8), np.float32)
    with pytest.raises(CorruptCheckpointError, match=r"\['w'\]"):
        chunkread.read_boxes(root, rec, [((4, 12), (4, 12))], [out], "['w']")


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.complex64])
def test_aligned_slab_gives_aligned_disjoint_views_of_one_allocation(dtype):
    shapes = [(3, 5), (0,), (7,), (2, 2, 3), ()]
    outs = chunkread.aligned_slab(shapes, dtype)
    assert [o.shape for o in outs] == shapes and all(o.dtype == np.dtype(dtype) for o in outs)
    full = [o for o in outs if o.nbytes]
    assert all(o.ctypes.data % 64 == 0 and o.flags.c_contiguous for o in full)
    roots = set()
    for o in full:
        while o.base is not None:
            o = o.base
        roots.add(id(o))
    assert len(roots) == 1                                      # one allocation
    spans = sorted((o.ctypes.data, o.ctypes.data + o.nbytes) for o in outs if o.nbytes)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))   # no two overlap
    for k, o in enumerate(outs):
        o[...] = k + 1
    assert [float(np.real(o).max(initial=0)) for o in outs] == [1, 0, 3, 4, 5]
