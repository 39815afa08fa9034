"""The async save lifecycle: donation-safe snapshots, one save in flight, failures surfaced,
durable atomic commits, bounded staging memory, phase timings."""

import fcntl
import functools
import glob
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks import chunkwrite, localfs, localstore, localwrite, storage
from helpers import assert_tree_equal, skip_without_direct_io


def sharded_state(seed=0):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    k = jax.random.key(seed)
    return {"w": jax.device_put(jax.random.normal(k, (512, 1024)), NamedSharding(mesh, P("a", "b"))),
            "b": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P())),
            "count": jnp.int32(0)}


@pytest.fixture(params=["pooled copies", "views"])
def snapshot_path(request, monkeypatch):
    """CPU leaves are copied into the manager's HostPool (small states) or viewed (large ones)."""
    from ckpt_callbacks import hostmem
    if request.param == "views":
        monkeypatch.setattr(hostmem, "EAGER_COPY_MAX_BYTES", 0)
    return request.param


def test_donated_state_after_save_is_still_saved_exactly(ckdir, snapshot_path):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda x: x * 2 + 1, state)

    state = sharded_state()
    expected = jax.tree.map(np.asarray, state)
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, state)
        for _ in range(3):              # donation deletes the buffers the save was given
            state = step(state)
        assert state["w"].is_deleted() is False
        m.wait_until_finished()
        out = m.restore(1)
    assert_tree_equal(out, expected)


@pytest.mark.parametrize("direct_io,in_memory", [(False, False), (False, True), (True, False)],
                         ids=["page cache (network mount)", "in memory (tmpfs)", "O_DIRECT (disk)"])
@pytest.mark.usefixtures("zarr_above_1mib")
def test_pooled_buffers_serve_the_next_save_and_every_step_restores_exactly(ckdir, direct_io, in_memory, monkeypatch):
    if direct_io:
        skip_without_direct_io(ckdir)
    direct_writes, real_pwrite = [], os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (
        direct_writes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), real_pwrite(fd, data, off))[1])

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda x: ~x if x.dtype == bool else x * 2 + 1, state)

    state, expected, before = sharded_state(), {}, None
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    state["flags"] = jax.device_put(jnp.arange(1024 * 1152).reshape(1024, 1152) % 3 == 0, NamedSharding(mesh, P("a")))
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(2)) as m:
        m.store.direct_io, m.store.in_memory = direct_io, in_memory   # as LocalStore decides from the file system
        for k in range(1, 7):
            expected[k] = jax.tree.map(np.asarray, state)
            m.save(k, state)
            state = step(state)          # donates while the save is being written
            lent = sorted(b.ctypes.data for b in m._pool._lent)
            if in_memory:                # every save writes w's 8 shards through, also as new files (k < 4);
                # flags, b and count are copied, into the buffers of the save before
                assert len(lent) == 4 + 2 and (k == 1 or lent == before)
                before = lent
                continue
            if k == 2:                   # the 8 shards of w, the 4 of flags, b and count
                assert len(lent) == 8 + 4 + 2
                lent2 = lent
            if k == 3:                   # save 3 copied into the buffers save 2 had used
                assert lent == lent2
            if k >= 4 and not direct_io:   # step k - 3's chunk files were kept for save k: the 8 shards
                # of w are written over them straight from the device buffers (WriteThrough); flags
                # (bool: tensorstore writes it), b and count are still copied, into the same buffers
                assert len(lent) == 4 + 2 and set(lent) <= set(lent2)
            if k >= 4 and direct_io:       # no page cache to write through: copied, then O_DIRECT
                assert lent == lent2
            m._wait() if k == 3 else None   # (as save 4 does first: step 1 is deleted, its files kept)
        m.wait_until_finished()
        assert m.all_steps() == [5, 6]
        for k in (5, 6):
            assert_tree_equal(m.restore(k), expected[k])
    assert m._pool._lent == [] and m._pool._free == {}    # close() frees the buffers
    # on a disk every save's 8 page-aligned copies of w's 256 KiB shards went by O_DIRECT
    assert sum(map(bool, direct_writes)) == (6 * 8 if direct_io else 0)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_in_memory_saves_without_kept_files_write_new_files_through_and_restore_exactly(ckdir):
    """On a memory file system every save writes the chunk files it can straight from the
    caller's buffers before returning, as new files where retention kept none (here: no
    retention, so never any); the caller donates them at once, and every step restores exactly."""
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda x: x * 2 + 1, state)

    state, expected = sharded_state(), {}
    with cc.CheckpointManager(ckdir) as m:
        m.store.direct_io, m.store.in_memory = False, True   # as LocalStore decides on tmpfs
        for k in range(1, 4):
            expected[k] = jax.tree.map(np.asarray, state)
            m.save(k, state)
            assert len(m._pool._lent) == 2   # b and count copied; w's 8 shards written, not copied
            state = step(state)
            m.wait_until_finished()
        assert m.all_steps() == [1, 2, 3]
        for k in (1, 2, 3):
            assert_tree_equal(m.restore(k), expected[k])


@pytest.mark.parametrize("direct_io,in_memory", [(False, False), (False, True), (True, False)],
                         ids=["page cache (network mount)", "in memory (tmpfs)", "O_DIRECT (disk)"])
def test_blobs_of_a_deleted_step_are_written_over_in_place_and_every_step_restores_exactly(
        ckdir, direct_io, in_memory):
    """A state of leaves up to 4 MiB (a Keras model's weights and optimizer slots) is one blob
    per save. Retention keeps a deleted step's blob for the next save of the same tree, which
    writes over it in place (the same inode): on a memory file system its pages are not fresh
    memory again, on a disk its blocks are not allocated again."""
    from ckpt_callbacks.verify import verify_step
    if direct_io:
        skip_without_direct_io(ckdir)
    rng = np.random.default_rng(0)

    def state(k):
        return {"w": jnp.asarray(rng.standard_normal((1024, 1024), np.float32)),    # 4 MiB
                "m": rng.standard_normal((512, 1024)).astype(np.float32),              # 2 MiB
                "b": jnp.full(1024, k, jnp.float32), "step": k}

    def blob_inodes(step):
        blobs = sorted(glob.glob(os.path.join(ckdir, f"step_{step:010d}", "blobs", "*")))
        return [os.stat(b).st_ino for b in blobs]

    expected, inodes, claimed = {}, {}, []
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(2)) as m:
        m.store.direct_io, m.store.in_memory = direct_io, in_memory   # as LocalStore decides from the file system
        real_claim = m.store.claim
        m.store.claim = lambda n, p=None: (claimed.append((p, real_claim(n, p))), claimed[-1][1])[1]
        for k in range(1, 6):
            expected[k] = state(k)
            m.save(k, expected[k])
            m._wait()   # the save and its retention, which keeps the deleted step's files for the next
            inodes[k] = blob_inodes(k)
            assert len(inodes[k]) == 1 and not glob.glob(os.path.join(ckdir, f"step_{k:010d}", "arrays"))
        assert m.all_steps() == [4, 5]
        for k in (4, 5):
            assert_tree_equal(m.restore(k), expected[k])
            assert verify_step(m.store, k) == []
    assert inodes[4] == inodes[1] and inodes[5] == inodes[2]   # step 1's blob became step 4's
    blobs = [(p, got) for p, got in claimed if "/blobs/" in p]
    assert len(blobs) == 5 and [got is not None for _, got in blobs] == [False] * 3 + [True] * 2


@pytest.mark.parametrize("direct_io,in_memory", [(False, False), (False, True)], ids=["page cache", "in memory (tmpfs)"])
def test_a_blob_of_thousands_of_small_leaves_saves_and_restores_off_a_disk(ckdir, direct_io, in_memory):
    rng = np.random.default_rng(3)
    tree = {f"l{i}": rng.standard_normal(1 + i % 50).astype(np.float32) for i in range(2500)}
    with cc.CheckpointManager(ckdir) as m:
        m.store.direct_io, m.store.in_memory = direct_io, in_memory   # as LocalStore decides from the file system
        m.save(1, tree)
        m.wait_until_finished()
        assert_tree_equal(m.restore(1), tree)


def test_bools_are_checked_for_bytes_other_than_0_and_1_off_the_callers_thread(ckdir, monkeypatch):
    """The check (and a copy where a byte is not 0/1) ran in the snapshot on a memory file
    system, stalling the caller for bools that are then copied and written later anyway."""
    from ckpt_callbacks import writing
    seen, real = [], writing._bools
    monkeypatch.setattr(writing, "_bools", lambda a: (seen.append(threading.current_thread()), real(a))[1])
    raw = np.random.default_rng(0).integers(0, 4, (1200, 1000), dtype=np.uint8)
    tree = {"f": raw.view(bool), "g": jnp.asarray(raw > 1), "w": jnp.ones((512, 1024))}
    with cc.CheckpointManager(ckdir) as m:
        m.store.direct_io, m.store.in_memory = False, True   # as LocalStore decides on tmpfs
        m.save(1, tree)
        m.wait_until_finished()
        got = m.restore(1)
    assert seen and threading.main_thread() not in seen
    assert_tree_equal(got, {"f": raw != 0, "g": np.asarray(raw > 1), "w": np.ones((512, 1024), np.float32)})


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("in_memory", [True, False], ids=["in memory (tmpfs)", "disk"])
def test_a_save_fsyncs_nothing_on_a_memory_file_system_and_everything_on_a_disk(ckdir, in_memory, monkeypatch):
    """tmpfs and ramfs implement fsync as a no-op, so there a save opens and fsyncs no file or
    directory for it; it still commits atomically, retention still deletes, and every kept step
    restores exactly. On a disk the same saves fsync every file they write."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    state, expected = sharded_state(), {}
    state["small"] = np.arange(5.0)                  # in a blob
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(2)) as m:
        m.store.direct_io, m.store.in_memory = False, in_memory   # as LocalStore decides from the file system
        for k in range(1, 5):                           # steps 3 and 4 overwrite the files of 1 and 2
            expected[k] = jax.tree.map(np.asarray, state)
            m.save(k, state)
            state = jax.tree.map(lambda x: x + 1, state)
        m.wait_until_finished()
        assert m.all_steps() == [3, 4]
        for k in (3, 4):
            assert_tree_equal(m.restore(k), expected[k])
    synced = [p for p in synced if "/.ckpt_callbacks.lock" not in p]   # the manager's lock file, at open
    if in_memory:
        assert synced == []
        return
    for step in (3, 4):   # every file of a kept step, fsynced under its staging name
        top = os.path.join(ckdir, f"step_{step:010d}")
        rels = [os.path.relpath(os.path.join(d, f), top) for d, _, names in os.walk(top) for f in names]
        assert len(rels) > 5
        for rel in rels:
            assert any(f"/step_{step:010d}.tmp-" in p and p.endswith("/" + rel) for p in synced), rel


def test_numpy_mutated_after_save_does_not_leak(ckdir):
    a = np.zeros((700, 700), np.float32)          # > 1 MiB: a zarr array
    small = np.zeros(10, np.int64)
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"a": a, "small": small})
        a += 5
        small += 7
        m.wait_until_finished()
        out = m.restore(1)
    assert not out["a"].any() and not out["small"].any()


class Faulty(localstore.LocalStore):
    """A local store whose writes fail (an injected storage fault) while `fail` is set."""

    fail = False

    def write(self, rel, data, sync=True):
        if self.fail:
            raise OSError(28, "No space left on device (injected)")
        return super().write(rel, data, sync)


def test_background_failure_surfaces_on_next_call_and_nothing_partial_is_listed(ckdir, caplog):
    m = cc.CheckpointManager(ckdir)
    m.store = Faulty(ckdir)
    m.save(1, {"x": np.ones(3)})
    m.wait_until_finished()
    m.store.fail = True
    assert m.save(2, {"x": np.ones(3)}) is True      # async: the failure happens in the background
    with pytest.raises(cc.CheckpointSaveError, match="injected"):
        m.save(3, {"x": np.ones(3)})                  # ... and surfaces from the next call
    assert m.all_steps() == [1]
    assert [n for n in os.listdir(ckdir) if ".tmp-" in n] == []
    m.save(4, {"x": np.ones(3)})                      # this one started: it fails too
    with pytest.raises(cc.CheckpointSaveError):
        m.wait_until_finished()
    m.save(5, {"x": np.ones(3)})
    with pytest.raises(cc.CheckpointSaveError):
        m.close()
    m.store.fail = False
    with cc.CheckpointManager(ckdir) as m2:
        assert m2.all_steps() == [1]
        m2.save(6, {"x": np.ones(3)})
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [1, 6]


def test_failed_fsync_aborts_and_is_not_retried(ckdir, monkeypatch):
    monkeypatch.setattr(localfs, "MEMORY_FS", frozenset())   # a disk's fsyncs, also where tmp_path is a tmpfs
    calls = []
    real = os.fsync

    def bad_fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(5, "Input/output error (injected)")

    with cc.CheckpointManager(ckdir, async_save=False) as m:
        m.save(1, {"x": np.ones(3)})
        monkeypatch.setattr(os, "fsync", bad_fsync)
        with pytest.raises(cc.CheckpointSaveError, match="Input/output error"):
            m.save(2, {"x": np.ones(300_000)})
        monkeypatch.setattr(os, "fsync", real)
        assert calls and len(calls) == len(set(calls))  # no file's fsync was ever retried
        assert len(calls) <= 16                         # the failure aborted the save (<= one parallel wave)
        assert m.all_steps() == [1]
        m.save(3, {"x": np.ones(3)})
        assert m.all_steps() == [1, 3]


def test_one_save_in_flight(ckdir):
    order = []

    class Slow(localstore.LocalStore):
        def publish(self, staging, step, replace=False, pool=None):
            order.append(("publish-start", step))
            time.sleep(0.3)
            super().publish(staging, step, replace, pool)
            order.append(("publish-end", step))

    with cc.CheckpointManager(ckdir) as m:
        m.store = Slow(ckdir)
        m.save(1, {"x": np.ones(3)})
        m.save(2, {"x": np.ones(3)})
        order.append(("save2-returned", 2))
        m.wait_until_finished()
    assert order.index(("publish-end", 1)) < order.index(("save2-returned", 2))
    assert order.index(("publish-end", 1)) < order.index(("publish-start", 2))


@pytest.mark.usefixtures("zarr_above_1mib")
def test_commit_is_atomic_rename_with_fsyncs(ckdir, monkeypatch):
    monkeypatch.setattr(localfs, "MEMORY_FS", frozenset())   # a disk's fsyncs, also where tmp_path is a tmpfs
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(a, b):
        renamed.append((a, b, list(synced)))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    sh = jax.sharding.NamedSharding(jax.make_mesh((4, 2), ("a", "b")), jax.sharding.PartitionSpec("a", "b"))
    tree = {"w": np.ones((600, 600), np.float32), "s": np.ones(3),
            "j": jax.device_put(np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512), sh),
            "b": np.ones((1200, 1200), bool)}   # written by tensorstore (chunkwrite declines bool)
    with cc.CheckpointManager(ckdir, async_save=False) as m:
        m.save(1, tree)
    (src, dst, before), = [r for r in renamed if "step_" in r[1]]
    assert ".tmp-" in src and dst.endswith("step_0000000001")
    # every file of the step (chunk files fsynced early, as their box landed; blobs, metadata and
    # the manifest at the end) was fsynced before the rename, and exactly once
    files = [os.path.join(src, os.path.relpath(os.path.join(d, f), dst))
             for d, _, names in os.walk(dst) for f in names]
    assert len([f for f in files if "/c/" in f]) == 8 + 1 + 1
    file_syncs = [p for p in before if p.startswith(src + "/") and not os.path.isdir(p.replace(src, dst))]
    assert sorted(file_syncs) == sorted(files)
    dirs = [os.path.normpath(os.path.join(src, os.path.relpath(d, dst))) for d, _, _ in os.walk(dst)]
    assert len(dirs) > 8 and set(dirs) <= set(before)                  # every directory of it too
    assert synced[-1] == os.path.abspath(ckdir)                       # then the parent directory


def test_staging_memory_is_bounded_by_the_budget(ckdir):
    tree = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(8)}   # 8 x 2 MiB
    budget = 5 << 20
    with cc.CheckpointManager(ckdir, max_staging_bytes=budget) as m:
        m.save(1, tree)
        m.wait_until_finished()
        stats = m.last_stats
        out = m.restore(1)
    assert_tree_equal(out, tree)
    assert stats.bytes_total == 8 * (2 << 20)
    assert stats.peak_staging_bytes <= budget


def test_a_shard_larger_than_the_budget_is_staged_alone_and_whole(ckdir):
    """The documented bound: max(budget, the largest shard), one over-budget shard at a time."""
    tree = {f"w{i}": np.full((1024, 1024), i, np.float32) for i in range(3)}   # 3 x 4 MiB numpy copies
    with cc.CheckpointManager(ckdir, max_staging_bytes=1 << 20) as m:
        m.save(1, tree)
        m.wait_until_finished()
        assert m.last_stats.peak_staging_bytes == 4 << 20
        assert_tree_equal(m.restore(1), tree)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_phase_timings_are_reported(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, sharded_state())
        m.wait_until_finished()
        s = m.last_stats
    assert s.step == 1 and s.bytes_total == 512 * 1024 * 4 + 8 * 4 + 4
    assert 0 <= s.blocking_s <= s.total_s and s.write_s >= 0 and s.commit_s >= 0
    assert abs(s.blocking_s + s.write_s + s.commit_s - s.total_s) < 1e-3
    assert s.files >= 3 and s.started <= time.time()
    assert set(s.as_dict()) >= {"blocking_s", "write_s", "commit_s", "total_s", "bytes_total", "files"}


def test_arrays_deleted_after_save_are_still_saved_exactly(ckdir):
    state = sharded_state(3)
    expected = jax.tree.map(np.asarray, state)
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, state)
        for x in jax.tree.leaves(state):
            x.delete()
        del state
        junk = [jnp.full((512, 1024), 7.0) for _ in range(8)]   # reuse freed memory if any was freed
        jax.block_until_ready(junk)
        m.wait_until_finished()
        assert_tree_equal(m.restore(1), expected)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_budget_smaller_than_one_sharded_leaf_streams_without_deadlock(ckdir):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    sh = NamedSharding(mesh, P("a", "b"))
    tree = {f"w{i}": jax.device_put(np.full((1024, 1024), i, np.float32), sh) for i in range(6)}  # 6 x 4 MiB
    with cc.CheckpointManager(ckdir, max_staging_bytes=3 << 20) as m:        # less than one leaf
        m.save(1, tree)
        m.wait_until_finished()
        assert m.last_stats.peak_staging_bytes <= 3 << 20
        assert_tree_equal(m.restore(1), jax.tree.map(np.asarray, tree))


@pytest.mark.parametrize("case", ["small leaves over the budget", "a leaf over it after a small one"])
def test_packed_leaves_held_for_a_blob_never_deadlock_the_budget(ckdir, case):
    """Small leaves gather in a blob that is written when full (64 MiB) or at the end; a copy that
    must wait for the budget first asks the writer to write that blob, whose bytes come back."""
    if case.startswith("small"):
        tree = {"a": np.full(150_000, 1, np.float32), "b": np.full(150_000, 2, np.float32)}   # 2 x 600 KB
        budget = 1 << 20
    else:
        tree = {"a": np.arange(4, dtype=np.float32), "b": np.ones((1024, 1024), np.float32)}
        budget = 2 << 20
    result = {}

    def run():
        with cc.CheckpointManager(ckdir, max_staging_bytes=budget) as m:
            m.save(1, tree)
            m.wait_until_finished()
            result["peak"] = m.last_stats.peak_staging_bytes
            result["out"] = m.restore(1)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the save deadlocked on its byte budget"
    assert_tree_equal(result["out"], tree)
    assert result["peak"] <= max(budget, max(x.nbytes for x in tree.values()))


@pytest.fixture(params=["pinned host", "on device"])
def device_copy_path(monkeypatch, request):
    """Exercise the accelerator snapshot path on the CPU devices: copies into pinned host memory
    (GPU, TPU), or on-device copies (devices without pinned host memory)."""
    from ckpt_callbacks import snapshot
    monkeypatch.setattr(snapshot, "_on_cpu", lambda x: False)
    if request.param == "on device":
        monkeypatch.setattr(snapshot, "_has_pinned_host", lambda d: False)
    return request.param


@pytest.mark.usefixtures("zarr_above_1mib")
def test_device_copy_path_is_donation_safe_and_streams_under_a_budget(ckdir, device_copy_path):
    test_donated_state_after_save_is_still_saved_exactly(ckdir + "-a", "device copies")
    test_budget_smaller_than_one_sharded_leaf_streams_without_deadlock(ckdir + "-b")


def test_device_copy_path_packs_sharded_leaves_up_to_4_mib_donation_safe(ckdir, device_copy_path):
    from ckpt_callbacks.restore import read_manifest
    test_donated_state_after_save_is_still_saved_exactly(ckdir, "device copies")
    kinds = {r["p"][0][1]: r["k"] for r in read_manifest(storage.open_store(ckdir), 1)["leaves"]}
    assert kinds["w"] == "packed"   # 2 MiB over 8 devices: one on-device copy, transferred by the writer


@pytest.mark.usefixtures("zarr_above_1mib")
def test_blobs_go_to_a_disk_through_windows_kept_from_save_to_save_and_restore_exactly(ckdir, monkeypatch):
    """On a disk each blob of packed leaves is written on a chunk thread through one of the
    writer's page-aligned windows (at most one per chunk thread, kept for later saves), by
    O_DIRECT; every step restores exactly and verifies."""
    skip_without_direct_io(ckdir)
    import ckpt_callbacks.writing as writing_mod
    from ckpt_callbacks.verify import verify_step
    monkeypatch.setattr(writing_mod, "BLOB_MAX_BYTES", 300 << 10)   # several blobs per save
    monkeypatch.setattr(localwrite, "WINDOW_BYTES", 64 << 10)      # several windows per blob
    calls, real = [], chunkwrite.write_parts

    claimed = []

    def spy(path, parts, window, direct=True, claim=None):
        calls.append((threading.current_thread().name, window.ctypes.data, direct))
        got = lambda n, p: (claimed.append(claim(n, p)), claimed[-1])[1]
        return real(path, parts, window, direct, claim=got)

    monkeypatch.setattr(chunkwrite, "write_parts", spy)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40_000, 60)
    trees = {}
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(2)) as m:
        m.store.direct_io = True   # as LocalStore decides on a disk
        for step in range(1, 5):
            trees[step] = {f"leaf{i}": rng.integers(0, 255, n, np.uint8) if i % 3 else rng.standard_normal(n // 4 + 1)
                           for i, n in enumerate(sizes)} | {"n": step}
            m.save(step, trees[step])
        m.wait_until_finished()
        for step in m.all_steps():
            assert_tree_equal(m.restore(step), trees[step])
            assert verify_step(m.store, step) == []
            blobs = glob.glob(os.path.join(ckdir, f"step_{step:010d}", "blobs", "*"))
            assert len(blobs) >= 4 and sum(map(os.path.getsize, blobs)) > int(sizes.sum())
    assert len(calls) >= 4 * 4 and all(name.startswith("ckpt-chunk") and direct for name, _, direct in calls)
    assert len({addr for _, addr, _ in calls}) <= 4   # one window per chunk thread at most, reused
    # once the third save committed, retention deleted step 1: the fourth writes over its blobs in place
    assert sum(c is not None for c in claimed) == len(blobs) >= 4


@pytest.mark.parametrize("direct_io", [False, True], ids=["page cache", "O_DIRECT window"])
def test_a_failing_blob_write_under_a_budget_fails_the_save_instead_of_hanging(ckdir, monkeypatch, direct_io):
    import ckpt_callbacks.writing as writing_mod
    monkeypatch.setattr(writing_mod, "BLOB_MAX_BYTES", 1000)

    real_parts = chunkwrite.write_parts

    def parts_fail(path, parts, window=None, direct=True, claim=None):   # blobs of a local store, on a chunk thread
        if "/blobs/" in path:
            raise OSError(28, "No space left on device (injected)")
        return real_parts(path, parts, window, direct, claim)

    monkeypatch.setattr(chunkwrite, "write_parts", parts_fail)
    m = cc.CheckpointManager(ckdir, max_staging_bytes=(2 << 20) + 100)
    m.store.direct_io = direct_io   # as LocalStore decides from the file system
    tree = {f"s{i}": np.full(75, i, np.float32) for i in range(4)}
    tree["big"] = np.ones((1024, 1280), np.float32)   # a zarr array, larger than the budget
    done = threading.Event()

    def run():
        try:
            m.save(1, tree)
            m.wait_until_finished()
        except cc.CheckpointSaveError as e:
            assert "No space left on device (injected)" in str(e)
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "the save hung instead of failing"
    assert m.all_steps() == []
    m.close()


@pytest.mark.usefixtures("zarr_above_1mib")
def test_zarr_json_of_a_known_metadata_is_the_bytes_tensorstore_wrote(ckdir, monkeypatch):
    from ckpt_callbacks import writing
    monkeypatch.setattr(writing, "_ZARR_JSON", {})
    opened = []
    real_open = writing.ts.open
    monkeypatch.setattr(writing.ts, "open", lambda spec, **kw: opened.append(kw) or real_open(spec, **kw))
    # float32 and (copied to native order) the big-endian ints go the direct chunk path; bools
    # go through tensorstore
    trees = [{"w": np.full((1024, 300), k, np.float32), "flags": np.arange(1_100_000) % (k + 2) == 0,
              "be": np.arange(300_000, dtype=">i4") * k} for k in (1, 2, 3)]   # each > PACK_MAX_BYTES
    with cc.CheckpointManager(ckdir) as m:
        for k, tree in enumerate(trees, start=1):
            m.save(k, tree)
            m.wait_until_finished()
        creates = [kw for kw in opened if kw.get("create")]
        assert len(creates) == 3                       # once per distinct metadata, at the first save
        assert sum(1 for kw in opened if kw.get("assume_metadata")) == 2   # the bools of saves 2 and 3
        for k, tree in enumerate(trees, start=1):
            assert_tree_equal(m.restore(k), tree)
    def jsons(step):
        root = os.path.join(ckdir, f"step_{step:010d}", "arrays")
        return {d: open(os.path.join(root, d, "zarr.json"), "rb").read() for d in sorted(os.listdir(root))}
    assert jsons(1) == jsons(2) == jsons(3) and len(jsons(1)) == 3
    monkeypatch.setattr(writing, "_ZARR_JSON", {})   # tensorstore reads what the cache wrote, as its own
    with cc.CheckpointManager(ckdir) as m:
        m.save(4, trees[0])
    assert jsons(4) == jsons(1)


def test_the_manager_keeps_its_writer_threads_from_save_to_save_and_close_ends_them(ckdir):
    def writers():
        return {t.ident for t in threading.enumerate() if t.name.startswith(("ckpt-chunk", "ckpt-fsync"))}

    before = writers()
    tree = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(6)}   # 2 MiB each: chunk files
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(2))
    m.save(1, tree)
    m.wait_until_finished()
    first = writers() - before
    assert first
    for k in range(2, 6):
        m.save(k, {n: a + k for n, a in tree.items()})
        m.wait_until_finished()
        now = writers() - before
        assert first <= now and len(now) <= 4 + 8     # the same threads (a pool adds one only up to its size)
    m.close()
    assert not writers() - before
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(5), {n: a + 5 for n, a in tree.items()})


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_small_host_state_is_written_over_a_deleted_steps_files_before_save_returns(ckdir, monkeypatch):
    from ckpt_callbacks import format as fmt, writing
    gate = threading.Event()          # holds the writer thread back until the checks below are done
    real = writing._open_arrays
    a = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    expected = a.copy()
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(1)) as m:
        m.store.direct_io = False     # a memory file system (on disk the copy goes by O_DIRECT instead)
        m.save(1, {"a": a + 1})
        m.save(2, {"a": a + 2})          # deletes step 1, whose chunk file waits for save 3
        m._wait()
        monkeypatch.setattr(writing, "_open_arrays", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
        m.save(3, {"a": a})
        chunks = [os.path.join(d, f) for d, _, fs in os.walk(ckdir) for f in fs
                  if "/c/" in os.path.join(d, f) and ".tmp-" in d]
        assert len(chunks) == 1                                    # written through, not yet committed
        raw = open(chunks[0], "rb").read()
        assert raw[:-4] == expected.tobytes() and int.from_bytes(raw[-4:], "little") == fmt.crc32c(raw[:-4])
        a[:] = -1                                                  # the caller's buffer is its own again
        gate.set()
        m.wait_until_finished()
        assert m.all_steps() == [3]
        np.testing.assert_array_equal(m.restore(3)["a"], expected)


# -- a deleted step's directory reused as the next save's staging directory -----------------------
def _save_reusing(store, step, tree, workers):
    """One save as the manager runs it without write-through (a disk): the writer's `begin` may
    adopt a directory that `delete(reuse=True)` kept."""
    import queue
    from ckpt_callbacks import snapshot, writing
    snap = snapshot.plan(tree)
    items = queue.SimpleQueue()
    snapshot.copy(snap, items.put)
    return writing.write_and_commit(store, step, snap, items, token=os.urandom(6).hex(), workers=workers,
                                    reuse_tree=True)


def _reuse_for(ckdir, old, new):
    """Steps 1 and 2 of `old`; step 1 deleted by retention; step 3 of `new` in its directory."""
    store, workers = localstore.LocalStore(ckdir), localwrite.Workers()
    try:
        _save_reusing(store, 1, old, workers)
        _save_reusing(store, 2, old, workers)
        store.delete(1, reuse=True)
        _save_reusing(store, 3, new, workers)
    finally:
        workers.close()
    return store


def _inodes(top) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, top)] = os.lstat(p).st_ino
    return out


def _tree_a(k):
    r = np.random.default_rng(k)
    return {"w": r.standard_normal((512, 1024)).astype(np.float32), "m": [r.standard_normal((700, 512)).astype(np.float32)],
            "b": r.standard_normal(64).astype(np.float32), "step": k}


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_deleted_steps_directory_becomes_the_next_saves_and_is_overwritten_in_place(ckdir, monkeypatch):
    """Steady state on a disk: no directory or file is created or deleted; every chunk file is
    rewritten in place, every zarr.json kept as it is (neither written nor fsynced again); the
    step holds exactly its manifest's files and restores exactly."""
    from ckpt_callbacks import verify
    store, workers = localstore.LocalStore(ckdir), localwrite.Workers()
    touched = []
    try:
        _save_reusing(store, 1, _tree_a(1), workers)
        _save_reusing(store, 2, _tree_a(2), workers)
        before = _inodes(os.path.join(ckdir, "step_0000000001"))
        store.delete(1, reuse=True)
        for name in ("write", "sync"):
            real = getattr(store, name)
            monkeypatch.setattr(store, name, lambda rel, *a, _real=real, **k: (touched.append(rel), _real(rel, *a, **k))[1])
        monkeypatch.setattr(localfs, "fsync_path", lambda p, *a, _real=localfs.fsync_path, **k: (touched.append(p), _real(p, *a, **k))[1])
        _save_reusing(store, 3, _tree_a(3), workers)
    finally:
        workers.close()
    after = _inodes(os.path.join(ckdir, "step_0000000003"))
    assert set(after) == set(before)
    # every directory, chunk file and zarr.json is the deleted step's own (blobs and the manifest
    # are written anew, and a freed inode number may come back, so nothing is said about them)
    kept = {rel for rel in after if os.path.isdir(os.path.join(ckdir, "step_0000000003", rel)) or "/c/" in rel
            or rel.endswith("zarr.json")}
    assert len(kept) == 2 + 2 * 5 and all(before[rel] == after[rel] for rel in kept)
    assert touched and not any("zarr.json" in str(t) for t in touched)
    assert not any(".del-" in n or ".tmp-" in n for n in os.listdir(ckdir))
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert m.all_steps() == [2, 3]
    assert_tree_equal(m.restore(3), _tree_a(3))
    assert verify.verify_step(store, 3) == []


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_reused_directorys_zarr_json_is_written_again_unless_it_holds_this_saves_bytes(ckdir):
    """A zarr.json of the deleted step is kept only when its bytes are the ones this process
    wrote for the same metadata: a file edited meanwhile (or replaced by a link) is written anew."""
    from ckpt_callbacks import verify
    store, workers = localstore.LocalStore(ckdir), localwrite.Workers()
    try:
        _save_reusing(store, 1, _tree_a(1), workers)
        _save_reusing(store, 2, _tree_a(2), workers)
        metas = sorted(glob.glob(os.path.join(ckdir, "step_0000000001", "arrays", "*", "zarr.json")))
        good = [open(p, "rb").read() for p in metas]
        with open(metas[0], "ab") as f:
            f.write(b"\n")                               # still JSON, other bytes
        os.unlink(metas[1])
        os.symlink(os.path.join(ckdir, "step_0000000002", os.path.relpath(metas[1], os.path.join(ckdir, "step_0000000001"))),
                   metas[1])
        store.delete(1, reuse=True)
        _save_reusing(store, 3, _tree_a(3), workers)
    finally:
        workers.close()
    for p, data in zip(metas, good):
        p3 = p.replace("step_0000000001", "step_0000000003")
        assert not os.path.islink(p3) and open(p3, "rb").read() == data
    assert verify.verify_step(store, 3) == []
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(3), _tree_a(3))


def test_a_reused_directory_keeps_nothing_of_the_deleted_step_when_the_tree_changed(ckdir):
    """Other shapes (another chunk grid and zarr metadata), a leaf gone, fewer blobs: whatever
    the deleted step had and this save did not write is removed before the manifest."""
    from ckpt_callbacks import verify, writing
    r = np.random.default_rng(7)
    old = {"w": r.standard_normal((512, 1024)).astype(np.float32), "gone": r.standard_normal((600, 600)).astype(np.float32),
           "small": [np.full(10, i, np.float32) for i in range(3)], "step": 1}
    new = {"w": r.standard_normal((2048, 256)).astype(np.float32), "x": np.arange(300000, dtype=np.int64), "step": 3}
    store = _reuse_for(ckdir, old, new)
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert_tree_equal(m.restore(3), new)
    assert verify.verify_step(store, 3) == []
    from ckpt_callbacks import format as fmt
    manifest = fmt.unpack_manifest(open(os.path.join(ckdir, "step_0000000003", fmt.MANIFEST), "rb").read())
    files = {rel for rel, ino in _inodes(os.path.join(ckdir, "step_0000000003")).items()
             if os.path.isfile(os.path.join(ckdir, "step_0000000003", rel))}
    assert files == writing._files(manifest) | {fmt.MANIFEST}
    dirs = {os.path.dirname(f) for f in files}
    for rel in _inodes(os.path.join(ckdir, "step_0000000003")):   # no directory left empty
        p = os.path.join(ckdir, "step_0000000003", rel)
        assert not os.path.isdir(p) or any(d == rel or d.startswith(rel + "/") for d in dirs)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_files_hard_linked_elsewhere_are_never_written_in_a_reused_directory(ckdir, tmp_path):
    """`cp -al` of a step that retention then deletes: the next save reuses the directory but
    never writes into a linked file: chunks, blobs and the manifest are replaced, a zarr.json
    holding this save's bytes is kept as it is."""
    store, workers = localstore.LocalStore(ckdir), localwrite.Workers()
    backup = {}
    try:
        _save_reusing(store, 1, _tree_a(1), workers)
        top = os.path.join(ckdir, "step_0000000001")
        for rel, _ in _inodes(top).items():
            if os.path.isfile(os.path.join(top, rel)):
                dst = str(tmp_path / rel.replace(os.sep, "_"))
                os.link(os.path.join(top, rel), dst)
                backup[dst] = open(dst, "rb").read()
        _save_reusing(store, 2, _tree_a(2), workers)
        store.delete(1, reuse=True)
        _save_reusing(store, 3, _tree_a(3), workers)
    finally:
        workers.close()
    assert len(backup) >= 5
    for dst, data in backup.items():
        assert open(dst, "rb").read() == data
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(3), _tree_a(3))


@pytest.mark.parametrize("change", ["2-d to 1-d", "1-d to 2-d", "leaves renumbered"])
def test_a_reused_directory_takes_a_tree_whose_leaves_changed_rank_or_place(ckdir, change):
    """A 2-d leaf's chunk `c/0/0` sits in a directory `c/0`, where a 1-d leaf's chunk is the file
    `c/0` (and the reverse): the reused directory first keeps only what this save writes again."""
    from ckpt_callbacks import verify
    r = np.random.default_rng(3)
    two, one = r.standard_normal((600, 600)).astype(np.float32), r.standard_normal(400000).astype(np.float32)
    old, new = {"a": two, "z": one}, {"a": one, "z": two}
    if change == "1-d to 2-d":
        old, new = new, old
    if change == "leaves renumbered":   # an optimizer state added in front: every array moves
        new = {"a": one, "b": two, "c": r.standard_normal((64, 64, 64)).astype(np.float32), "z": two}
    store = _reuse_for(ckdir, old, new)
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(3), new)
    assert verify.verify_step(store, 3) == []
