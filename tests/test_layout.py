"""Shard and chunk arithmetic (pure functions), property-tested."""

import math

import jax
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ckpt_callbacks import layout

dims = st.lists(st.integers(1, 300), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(shard=dims, itemsize=st.sampled_from([1, 2, 4, 8]), cap=st.integers(1, 1 << 20))
def test_chunks_tile_the_shard_exactly_and_respect_the_cap_when_possible(shard, itemsize, cap):
    c = layout.chunk_shape(shard, itemsize, cap)
    assert len(c) == len(shard)
    assert all(s % k == 0 for s, k in zip(shard, c))                 # aligned: whole chunks per shard
    if math.prod(shard) * itemsize <= cap:
        assert tuple(c) == tuple(shard)                              # no split when it fits
    elif itemsize <= cap:
        # over the cap only when no exact divisor brings it under (e.g. prime dimensions)
        assert math.prod(c) * itemsize <= cap or any(k > 1 for k in c)


@settings(max_examples=300, deadline=None)
@given(shard=dims, itemsize=st.sampled_from([1, 2, 4, 8]), cap=st.integers(1, 1 << 20))
def test_over_whole_array_dimensions_chunks_may_pad_the_edge_instead_of_cutting_rows(shard, itemsize, cap):
    """A numpy leaf (or a dimension no mesh axis shards) of a prime extent: no divisor near the
    split needed, so the chunk is the extent over that split and the last chunk is padded. Before,
    such a dimension was cut into rows: (4099, 16411) bytes became 4,099 chunk files."""
    c = layout.chunk_shape(shard, itemsize, cap, [True] * len(shard))
    total = math.prod(shard) * itemsize
    if total <= cap:
        assert tuple(c) == tuple(shard)
    elif itemsize <= cap:
        assert math.prod(c) * itemsize <= cap
        chunks = math.prod(-(-s // k) for s, k in zip(shard, c))
        assert chunks <= 4 * -(-total // cap) + 2, (c, chunks)
    assert layout.chunk_shape([4099, 16411], 1, 64 << 20, [True, True]) == (2050, 16411)
    assert layout.chunk_shape([4099, 16411], 1, 64 << 20) == (1, 16411)   # a sharded dimension: divisors only


def test_chunking_a_long_dimension_costs_its_square_root_not_its_extent():
    """A 1-d leaf of 2^31+4097 int8 elements blocked save() for 259 s: the chunk split listed every
    divisor of the extent up to the extent itself. 2^27+1 (a 128 MiB leaf) took ~8 s."""
    import time
    t = time.perf_counter()
    assert layout.chunk_shape([2**27 + 1], 1, 64 << 20, [True]) == (44739243,)
    assert layout.chunk_shape([2**27 + 1], 1, 64 << 20) == (44739243,)   # 2^27+1 = 3 x 44739243
    assert time.perf_counter() - t < 0.5


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5000), need=st.integers(1, 6000))
def test_the_split_is_the_smallest_divisor_at_least_the_one_needed(n, need):
    assert layout._divisor_at_least(n, need) == next((k for k in range(2, n + 1) if n % k == 0 and k >= need), n)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.tuples(st.integers(0, 10**6), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
                      max_size=30))
def test_assign_picks_a_holder_deterministically(items):
    a = layout.assign(items, 4)
    assert a == layout.assign(list(items), 4)
    assert all(w in holders for w, (_, holders) in zip(a, items))


def test_assign_spreads_replicated_bytes():
    items = [(100, [0, 1, 2, 3])] * 40
    a = layout.assign(items, 4)
    assert sorted(a.count(p) for p in range(4)) == [10, 10, 10, 10]


@settings(max_examples=100, deadline=None)
@given(a=st.sampled_from([1, 2, 4, 8]), spec=st.sampled_from([P("x", "y"), P("y", "x"), P("x"), P(None, "y"), P()]),
       m=st.integers(1, 5), n=st.integers(1, 5))
def test_unique_boxes_partition_the_array(a, spec, m, n):
    devs = np.array(jax.devices()).reshape(a, 8 // a)
    sh = NamedSharding(Mesh(devs, ("x", "y")), spec)
    shape = (8 * m, 8 * n)
    boxes = layout.unique_boxes(sh, shape)
    cover = np.zeros(shape, np.int32)
    for b, holders in boxes:
        cover[tuple(slice(lo, hi) for lo, hi in b)] += 1
        assert holders == sorted(holders, key=lambda d: d.id)
    assert (cover == 1).all()                                         # disjoint and complete
    assert sum(len(h) for _, h in boxes) == 8                          # every device holds one


def test_intersect_and_bounding():
    assert layout.intersect(((0, 4), (0, 4)), ((2, 6), (3, 9))) == ((2, 4), (3, 4))
    assert layout.intersect(((0, 4),), ((4, 6),)) is None
    assert layout.bounding([((0, 2), (4, 6)), ((2, 4), (0, 2))]) == ((0, 4), (0, 6))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(0, 40), min_size=0, max_size=3))
def test_chunks_of_lists_exactly_the_chunks_a_box_touches(data, shape):
    chunks = [data.draw(st.integers(1, max(1, n))) for n in shape]
    box = tuple(sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n)))) for n in shape)
    got = layout.chunks_of(box, chunks)
    # brute force: every element of the box lies in a listed chunk, and every listed chunk meets the box
    touched = {tuple(i // c for i, c in zip(pt, chunks))
               for pt in np.ndindex(*[hi - lo for lo, hi in box])
               for pt in [tuple(p + lo for p, (lo, _) in zip(pt, box))]}
    assert set(got) == touched and len(got) == len(set(got)) and got == sorted(got)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 30), min_size=0, max_size=3))
def test_chunk_numbers_count_the_grid_in_c_order(data, shape):
    chunks = [data.draw(st.integers(1, n)) for n in shape]
    grid = layout.chunks_of(tuple((0, n) for n in shape), chunks)   # C order, as the manifest lists them
    assert [layout.chunk_number(idx, shape, chunks) for idx in grid] == list(range(len(grid)))
    assert layout.chunk_count(shape, chunks) == len(grid)
