"""CheckpointManager: intervals, retention with restart, start-up cleanup, existing steps, locks."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import format as fmt
from helpers import assert_tree_equal, skip_without_direct_io


# a script's first lines: every write of a save takes a second longer (still in flight at exit)
_SLOW_WRITES = ("import sys, time, threading, numpy as np, ckpt_callbacks as cc, ckpt_callbacks.manager as mm\n"
                "real = mm.write_and_commit\n"
                "mm.write_and_commit = lambda *a, **k: (time.sleep(1.0), real(*a, **k))[1]\n")


def _python(*args):
    """Run a Python script in a fresh interpreter; its CompletedProcess (stdout, stderr as text)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def tree(step):
    return {"x": np.full(4, step, np.float32), "step": step}


def test_interval_and_force(ckdir):
    with cc.CheckpointManager(ckdir, save_interval_steps=5) as m:
        saved = [s for s in range(1, 13) if m.save(s, tree(s))]
        assert m.save(13, tree(13), force=True)
        m.wait_until_finished()
        assert saved == [5, 10] and m.all_steps() == [5, 10, 13] and m.latest_step() == 13


def test_a_restore_right_after_a_save_waits_for_that_save_and_reads_it(ckdir, monkeypatch):
    """save() returns after the snapshot; a restore (or host_state) right after it, through the
    same manager, waits for the save in flight: it read "step 1 is not a committed checkpoint
    (committed: [])" before. Listing stays committed-only and does not wait. A failure of the
    save in flight is raised by that restore (once: close() then has nothing to raise)."""
    import ckpt_callbacks.manager as mm
    real = mm.write_and_commit
    monkeypatch.setattr(mm, "write_and_commit", lambda *a, **k: (time.sleep(0.5), real(*a, **k))[1])
    m = cc.CheckpointManager(ckdir)
    assert m.save(1, tree(1), host_state={"pos": 1})
    assert m.all_steps() == [] and m.latest_step() is None   # still in flight
    got = m.restore(1)
    assert got["step"] == 1 and np.array_equal(got["x"], np.full(4, 1, np.float32))
    m.save(2, tree(2), host_state={"pos": 2})
    assert m.restore()["step"] == 2                            # the latest: the one just saved
    m.save(3, tree(3), host_state={"pos": 3})
    assert m.host_state(3) == {"pos": 3}
    assert m.all_steps() == [1, 2, 3]

    def fail(*a, **k):
        time.sleep(0.3)
        raise OSError(28, "No space left on device (simulated)")
    monkeypatch.setattr(mm, "write_and_commit", fail)
    m.save(4, tree(4))
    with pytest.raises(OSError, match="No space left"):
        m.restore()
    assert m.restore()["step"] == 3 and m.all_steps() == [1, 2, 3]   # nothing already saved is lost
    m.close()


def test_saving_below_an_earlier_runs_latest_step_is_said_once(ckdir, caplog):
    """A new run in an old run's directory, without restoring: each of its steps is below the
    latest committed one, so KeepLast deleted it as soon as it committed, with not a word."""
    with cc.CheckpointManager(ckdir) as m:
        for s in (8, 9, 10):
            m.save(s, tree(s))
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=cc.KeepLast(3)) as m:
            assert all(m.save(s, tree(s)) for s in (1, 2, 3))
            m.wait_until_finished()
            assert m.all_steps() == [8, 9, 10]   # what the policy says: the newest three
    said = [r.getMessage() for r in caplog.records if "below the latest committed step" in r.getMessage()]
    assert len(said) == 1 and "saving step 1 below the latest committed step 10" in said[0]
    assert "restore() first" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=cc.KeepLast(3)) as m:
            m.save(11, tree(11))                 # continuing: nothing to say
            m.wait_until_finished()
            m.save(7, tree(7))                   # below this run's own latest step: nothing either
    assert "below the latest" not in caplog.text


def test_a_save_does_not_list_every_committed_step_once_the_run_is_past_them(ckdir, monkeypatch):
    """A run keeping every step (thousands of them) listed them all in each save() (8 ms of
    blocking per save at 5,000 steps here): once this manager committed the directory's latest
    step, no other writer can add one (the lock), so a save asks about its own step only."""
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2, 3):
            m.save(s, tree(s))
    with cc.CheckpointManager(ckdir) as m:
        listed = []
        real = m.store.committed_steps
        monkeypatch.setattr(m.store, "committed_steps", lambda: listed.append(1) or real())
        m.save(4, tree(4))
        m.wait_until_finished()
        assert len(listed) == 1          # the first save looks for an earlier run's newer steps
        for s in (5, 6, 7):
            m.save(s, tree(s))
            m.wait_until_finished()
        assert len(listed) == 1
        assert not m.save(7, tree(7))    # committed already: still found, without a listing
        assert len(listed) == 1 and m.all_steps() == [1, 2, 3, 4, 5, 6, 7]


def test_an_outage_while_reading_metrics_skips_retention_instead_of_deleting_the_best(ckdir, monkeypatch, caplog):
    from ckpt_callbacks import restore as restore_mod
    policy = cc.KeepBest("loss", "min", 1)
    with cc.CheckpointManager(ckdir, retention=policy) as m:
        m.save(1, {"x": np.ones(3)}, metrics={"loss": 0.1})
    real = restore_mod.read_manifest
    monkeypatch.setattr(restore_mod, "read_manifest", lambda store, s: (
        (_ for _ in ()).throw(cc.StorageUnavailableError("simulated outage")) if s == 1 else real(store, s)))
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=policy) as m:   # a new manager: nothing remembered
            m.save(2, {"x": np.ones(3)}, metrics={"loss": 0.5})
            m.wait_until_finished()
            assert m.all_steps() == [1, 2]   # step 1 is the best: an outage is no reason to drop it
            assert "retention after step 2 skipped" in caplog.text
            monkeypatch.setattr(restore_mod, "read_manifest", real)
            m.save(3, {"x": np.ones(3)}, metrics={"loss": 0.9})
            m.wait_until_finished()
            assert m.all_steps() == [1, 3]   # the store is back: best (1) and newest (3)


def test_retention_survives_restart_and_best_is_rebuilt(ckdir):
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.7, 6: None, 7: 0.8}
    policy = [cc.KeepLast(2), cc.KeepBest("val_loss", "min", 2)]
    with cc.CheckpointManager(ckdir, retention=policy) as m:
        for s in range(1, 5):
            m.save(s, tree(s), metrics={"val_loss": losses[s]})
        m.wait_until_finished()
        assert m.all_steps() == [2, 3, 4] and m.best_step() == 4
    with cc.CheckpointManager(ckdir, retention=policy) as m:      # a restarted run
        assert m.latest_step() == 4 and m.best_step() == 4 and m.metrics(2) == {"val_loss": 0.3}
        for s in range(5, 8):
            m.save(s, tree(s), metrics=None if losses[s] is None else {"val_loss": losses[s]})
        m.wait_until_finished()
        assert m.all_steps() == [2, 4, 6, 7]
        assert m.metrics(6) == {} and m.metrics(99) is None
        np.testing.assert_array_equal(m.restore()["x"], tree(7)["x"])


def test_time_based_retention_with_injected_clock(ckdir):
    now = [1000.0]
    with cc.CheckpointManager(ckdir, retention=cc.KeepEveryNSeconds(3600), clock=lambda: now[0]) as m:
        for s in range(1, 8):
            m.save(s, tree(s))
            now[0] += 1500.0          # saves at 1000, 2500, 4000, 5500, 7000, 8500, 10000
        m.wait_until_finished()
        # windows [0,3600): 1; [3600,7200): 3; [7200,10800): 6; and the newest (7)
        assert m.all_steps() == [1, 3, 6, 7]


def test_existing_step_is_skipped_with_a_warning_and_force_replaces(ckdir, caplog):
    with cc.CheckpointManager(ckdir) as m:
        m.save(3, tree(3))
        m.wait_until_finished()
    with cc.CheckpointManager(ckdir) as m, caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        assert m.save(3, {"x": np.zeros(4, np.float32), "step": -1}) is False   # resumed run: no crash
        assert "already committed" in caplog.text
        np.testing.assert_array_equal(m.restore(3)["x"], tree(3)["x"])
        assert m.save(3, {"x": np.zeros(4, np.float32), "step": -1}, force=True)
        m.wait_until_finished()
        assert m.restore(3)["step"] == -1 and m.all_steps() == [3]
    assert not [n for n in os.listdir(ckdir) if ".del-" in n or ".tmp-" in n]


def test_leftovers_cleaned_foreign_files_untouched(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1))
    os.makedirs(os.path.join(ckdir, "step_0000000002.tmp-0123456789ab", "arrays"))
    os.makedirs(os.path.join(ckdir, "step_0000000001.del-abcdef012345"))
    foreign = ["README", "step_12", "step_0000000003.tmp-xyz", "my_step_0000000004", "tensorboard"]
    for f in foreign:
        open(os.path.join(ckdir, f), "w").write("user data")
    os.makedirs(os.path.join(ckdir, "step_0000000005.backup"))
    with cc.CheckpointManager(ckdir) as m:
        assert m.all_steps() == [1]
    left = sorted(os.listdir(ckdir))
    assert left == sorted(foreign + ["step_0000000001", "step_0000000005.backup"]), left
    assert all(open(os.path.join(ckdir, f)).read() == "user data" for f in foreign)


def test_discovery_of_1000_steps(ckdir):
    os.makedirs(ckdir)
    with cc.CheckpointManager(ckdir, async_save=False) as m:
        m.save(0, tree(0))
    src = os.path.join(ckdir, fmt.step_name(0))
    for s in range(1, 1000):       # committed steps made by copying one (the listing is what's tested)
        subprocess.run(["cp", "-r", src, os.path.join(ckdir, fmt.step_name(s))], check=True) if s < 3 else \
            os.makedirs(os.path.join(ckdir, fmt.step_name(s)))
    t = time.perf_counter()
    m = cc.CheckpointManager(ckdir)
    steps, latest = m.all_steps(), m.latest_step()
    elapsed = time.perf_counter() - t
    m.close()
    assert steps == list(range(1000)) and latest == 999
    print(f"start-up + discovery of 1000 steps: {elapsed * 1e3:.1f} ms")


def test_logging_one_line_per_commit(ckdir, caplog):
    with caplog.at_level(logging.INFO, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=cc.KeepLast(1)) as m:
            m.save(1, tree(1))
            m.save(2, tree(2))
    lines = [r.getMessage() for r in caplog.records if "committed step" in r.getMessage()]
    assert len(lines) == 2
    assert "step 2" in lines[1] and "blocking" in lines[1] and "total" in lines[1] and "deleted steps [1]" in lines[1]


def test_second_writer_is_refused_naming_the_owner_and_stale_lock_recovered(ckdir):
    m = cc.CheckpointManager(ckdir)
    code = ("import sys, ckpt_callbacks as cc\n"
            "try:\n    cc.CheckpointManager(sys.argv[1])\n"
            "except cc.CheckpointLockedError as e:\n    print('LOCKED', e)\n")
    r = _python("-c", code, ckdir)
    assert "LOCKED" in r.stdout and f"pid {os.getpid()}" in r.stdout, r.stdout + r.stderr
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == []        # readers are never refused
    m.close()
    # a writer killed without close() leaves a stale lock, recovered by the next writer
    code2 = ("import os, sys, ckpt_callbacks as cc\n"
             "m = cc.CheckpointManager(sys.argv[1]); m.save(1, {'a': 1}); m.wait_until_finished()\n"
             "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code2, ckdir], check=True, timeout=120)
    assert os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))
    with cc.CheckpointManager(ckdir) as m2:
        assert m2.all_steps() == [1]


def test_bad_arguments_are_clear(ckdir):
    with pytest.raises(cc.ConfigError, match="save_interval_steps"):
        cc.CheckpointManager(ckdir, save_interval_steps=0)
    with pytest.raises(cc.ConfigError, match="retention"):
        cc.CheckpointManager(ckdir, retention="keep_last")
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.ConfigError, match="metrics"):
            m.save(1, tree(1), metrics={"loss": "nope"} and {"loss": object()})
        with pytest.raises(cc.ConfigError, match="step"):
            m.save(-1, tree(1))
    with pytest.raises(cc.CheckpointError, match="closed"):
        m.save(2, tree(2))


def test_interrupted_forced_replacement_puts_the_old_step_back(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        m.save(3, tree(3))
    # a crash between publish's two renames: the old step hidden, the new one still staged
    os.rename(os.path.join(ckdir, "step_0000000003"), os.path.join(ckdir, "step_0000000003.old-0123456789ab"))
    os.makedirs(os.path.join(ckdir, "step_0000000003.tmp-abcdef012345"))
    with cc.CheckpointManager(ckdir) as m:
        assert m.all_steps() == [3]
        np.testing.assert_array_equal(m.restore(3)["x"], tree(3)["x"])
    assert sorted(n for n in os.listdir(ckdir) if n.startswith("step_")) == ["step_0000000003"]


def test_a_forced_replacement_swaps_the_step_in_one_step_where_the_system_can(ckdir, monkeypatch):
    """With two renames, a reader (or a crash) between them saw the step missing: the latest
    step went back for readers until a writer put the old copy back."""
    from ckpt_callbacks import localfs, localstore
    probe = [os.path.join(os.path.dirname(ckdir), n) for n in ("xa", "xb")]
    for p in probe:
        os.makedirs(p)
    exchanges = localfs.exchange(*probe)   # (not on every file system, nor with every C library)
    renames = []
    real = os.rename
    monkeypatch.setattr(localstore.os, "rename", lambda a, b: renames.append(b) or real(a, b))
    with cc.CheckpointManager(ckdir) as m:
        m.save(3, tree(3))
        m.save(3, {"x": np.zeros(4, np.float32), "step": -1}, force=True)
        m.wait_until_finished()
        assert bool([b for b in renames if ".old-" in b]) == (not exchanges)
        np.testing.assert_array_equal(m.restore(3)["x"], np.zeros(4, np.float32))
        monkeypatch.setattr(localfs, "exchange", lambda a, b: False)   # no renameat2: two renames
        m.save(3, tree(3), force=True)
        m.wait_until_finished()
        assert [b for b in renames if ".old-" in b]
        np.testing.assert_array_equal(m.restore(3)["x"], tree(3)["x"])
    assert sorted(n for n in os.listdir(ckdir) if n.startswith("step_")) == ["step_0000000003"]


def test_a_second_writer_in_the_same_process_is_refused(ckdir):
    m = cc.CheckpointManager(ckdir)
    m.save(1, tree(1))
    with pytest.raises(cc.CheckpointLockedError, match="this process"):
        cc.CheckpointManager(ckdir)
    m.close()
    with cc.CheckpointManager(ckdir) as m2:          # once closed, the directory can be reopened
        assert m2.all_steps() == [1]


def _chunk_inodes(ckdir, step) -> dict:
    """{path under the step: inode} of the step's chunk files."""
    top = os.path.join(ckdir, fmt.step_name(step))
    out = {}
    for dirpath, _, names in os.walk(os.path.join(top, "arrays")):
        for n in names:
            if n != "zarr.json":
                p = os.path.join(dirpath, n)
                out[os.path.relpath(p, top)] = os.stat(p).st_ino
    return out


def _big_tree(k):   # two arrays over the 1 MiB packing limit: written as chunk files
    rng = np.random.default_rng(k)
    return {"w": rng.standard_normal((1024, 384)).astype(np.float32),
            "m": rng.standard_normal((512, 640)).astype(np.float32), "step": k}


@pytest.mark.usefixtures("zarr_above_1mib")
def test_deleted_steps_chunk_files_are_overwritten_by_the_next_save_and_restore_exactly(ckdir):
    # KeepLast(2): saving step 3 deletes step 1, whose chunk files step 4 then takes over (the
    # page cache pages and disk blocks are reused, not freed and allocated again)
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(2))
    inodes = {}
    for k in range(1, 7):
        m.save(k, _big_tree(k))
        m._wait()   # as the next save() does: the kept files survive until that save
        inodes[k] = _chunk_inodes(ckdir, k)
    assert m.all_steps() == [5, 6]
    for k in (4, 5, 6):   # step k took over the files of step k - 3
        assert inodes[k] == inodes[k - 3] and inodes[k]
    for k in (5, 6):
        got = m.restore(step=k)
        for name in ("w", "m"):
            np.testing.assert_array_equal(got[name], _big_tree(k)[name])
    hidden = [n for n in os.listdir(ckdir) if ".del-" in n]
    assert hidden   # step 4's files wait for a save that never comes ...
    m.wait_until_finished()
    assert [n for n in os.listdir(ckdir) if ".del-" in n] == []   # ... until the caller waits
    m.close()


def test_a_hard_linked_chunk_file_of_a_deleted_step_is_never_written_through(ckdir, tmp_path):
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1))
    m.save(1, _big_tree(1))
    m._wait()
    backup = {}
    for rel in _chunk_inodes(ckdir, 1):   # e.g. `cp -al` of a step someone wants to keep
        dst = str(tmp_path / rel.replace(os.sep, "_"))
        os.link(os.path.join(ckdir, fmt.step_name(1), rel), dst)
        backup[dst] = open(dst, "rb").read()
    for k in (2, 3):
        m.save(k, _big_tree(k))
        m._wait()
    for dst, data in backup.items():
        assert open(dst, "rb").read() == data
    got = m.restore(step=3)
    np.testing.assert_array_equal(got["w"], _big_tree(3)["w"])
    m.close()
    assert [n for n in os.listdir(ckdir) if ".del-" in n] == []


def test_files_of_another_size_are_not_reused_and_are_deleted(ckdir):
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1))
    m.save(1, _big_tree(1))
    m._wait()
    top = os.path.join(ckdir, fmt.step_name(1))
    # held open: an inode number may be given to a new file once the old one is unlinked
    held = {os.open(os.path.join(top, rel), os.O_RDONLY): None for rel in _chunk_inodes(ckdir, 1)}
    held = {fd: os.pread(fd, 64 << 20, 0) for fd in held}
    bigger = {"w": np.ones((1024, 512), np.float32), "m": np.full((512, 700), 2, np.float32), "step": 2}
    m.save(2, bigger)   # deletes step 1 and keeps its files
    m._wait()
    m.save(3, bigger)   # nothing of step 1's files fits: all fresh, step 1's files dropped
    m._wait()
    for fd, before in held.items():   # never written into, and gone
        assert os.pread(fd, 64 << 20, 0) == before and os.fstat(fd).st_nlink == 0
        os.close(fd)
    kept = [n for n in os.listdir(ckdir) if ".del-" in n]
    assert len(kept) == 1 and kept[0].startswith(fmt.step_name(2))   # step 1's went; step 2's wait
    got = m.restore(step=3)
    np.testing.assert_array_equal(got["m"], bigger["m"])
    m.close()


def _listing(top):
    """{directory relative to `top`: its entries as (name, inode)}: what a directory fsync makes durable."""
    return {os.path.relpath(d, top): sorted((e.name, e.inode()) for e in os.scandir(d)) for d, _, _ in os.walk(top)}


def test_a_padded_edge_chunk_is_never_written_over_a_reused_directorys_stale_chunk_file(ckdir, monkeypatch):
    """On a disk the next save takes the directory retention deleted; tensorstore writes a
    leaf's padded last chunk by reading the file there first: another leaf's stale chunk file
    failed the save (its checksum, or its size)."""
    from ckpt_callbacks import snapshot
    skip_without_direct_io(ckdir)
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "chunk_max_bytes", 64 << 10)
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "pack_max_bytes", -1)
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1), async_save=False)
    m.store.direct_io, m.store.in_memory = True, False   # as LocalStore decides on a disk
    even = np.arange(2 * 65536, dtype=np.int64).astype(np.uint8)    # whole chunks
    odd = np.full(131063, 7, np.uint8)     # a prime extent: chunks of 65532, the last padded
    trees = {1: {"a": even}, 2: {"a": odd}, 3: {"a": odd + 1}, 4: {"a": even[::-1].copy()}, 5: {"a": odd + 2}}
    for k, t in trees.items():
        m.save(k, t)                      # 3 and 5 into the directory of 1 and 3: c/1 was even's
        np.testing.assert_array_equal(m.restore(k)["a"], t["a"])
    assert m.all_steps() == [5]
    m.close()


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_save_into_a_reused_directory_fsyncs_exactly_the_directories_whose_entries_changed(ckdir, monkeypatch):
    """On a disk, save k + 3 is written into the directory of step k (KeepLast(2)). A directory
    whose entries are those step k committed is durable already and is not fsynced again; every
    directory that gained, lost or replaced an entry is. Save 5 also drops a leaf and adds one."""
    from ckpt_callbacks import localfs
    skip_without_direct_io(ckdir)
    synced = []
    real = localfs.fsync_path
    monkeypatch.setattr(localfs, "fsync_path", lambda p, directory=False: (
        synced.append(p) if directory else None, real(p, directory))[1])
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(2))
    m.store.direct_io, m.store.in_memory = True, False   # as LocalStore decides on a disk
    trees, committed = {}, {}
    for k in range(1, 6):
        trees[k] = _big_tree(k)
        if k == 5:
            trees[k]["extra"] = np.ones((600, 600), np.float32)   # a new array leaf: new directories
            del trees[k]["m"]                                     # its directories go
        del synced[:]
        m.save(k, trees[k])
        m._wait()
        top = os.path.join(ckdir, fmt.step_name(k))
        committed[k] = _listing(top)
        staging = [os.path.relpath(p, ckdir).split("/", 1) for p in synced if ".tmp-" in p]
        fsynced = {(rest[1] if len(rest) > 1 else ".") for rest in staging}
        time.sleep(0.15)   # beyond localfs.STAMP_MARGIN_NS: a directory changed just now is always fsynced
        if k <= 3:   # a new directory: every one of its directories
            assert fsynced == set(committed[k]), k
            continue
        # into step k - 3's directory: at least every directory whose entries differ from its
        # commit (a name, or a file replaced; a freed inode number may come back, so this is a
        # lower bound), the top one (the manifest is written last) -- and none that is untouched
        old = committed[k - 3]
        changed = {d for d, entries in committed[k].items() if old.get(d) != entries}
        assert changed | {"."} <= fsynced, (k, changed - fsynced)
        if k == 4:   # the same tree as step 1's: its chunk files overwritten in place, nothing else
            assert fsynced == {"."}
        else:        # "m" (arrays/0) went, "extra" came there; "w" (arrays/2) was only overwritten
            assert "arrays/0" in fsynced   # its zarr.json is new
            assert not any(d.startswith("arrays/2") for d in fsynced), fsynced
    assert m.all_steps() == [4, 5]
    for k in (4, 5):
        got = m.restore(step=k)
        assert set(got) == set(trees[k])
        for name in trees[k]:
            np.testing.assert_array_equal(got[name], trees[k][name])
    m.close()


def _writer_running() -> bool:
    return any(t.name.startswith("ckpt_callbacks-save-") and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("where,budget", [("disk", None), ("disk", 1 << 20), ("tmpfs", None)])
def test_the_writer_runs_alongside_the_snapshot_and_each_save_is_whole(ckdir, monkeypatch, where, budget):
    """The writer thread is running while the snapshot is taken: on a disk where the snapshot
    copies every leaf into the manager's warm buffers (its start and first writes use the cores
    that the paused training leaves idle: CPU training on 2 vCPUs gained 2-10 points of fit
    overhead), under a budget smaller than the copies (it writes earlier copies so that later
    ones fit), and with write-through (tmpfs). Each save is whole either way."""
    from ckpt_callbacks import snapshot
    seen = []
    real = snapshot.copy
    monkeypatch.setattr(snapshot, "copy", lambda *a, **k: (seen.append(_writer_running()), real(*a, **k))[1])
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(2), max_staging_bytes=budget) as m:
        m.store.direct_io, m.store.in_memory = where == "disk", where == "tmpfs"
        for k in range(1, 5):
            m.save(k, _big_tree(k))
        m.wait_until_finished()
        assert m.all_steps() == [3, 4]
        for k in (3, 4):
            got = m.restore(step=k)
            for name, x in _big_tree(k).items():
                np.testing.assert_array_equal(got[name], x)
    assert seen == [True] * 4


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_snapshot_that_fails_midway_commits_nothing_leaves_nothing_and_the_next_save_works(
        ckdir, monkeypatch, where):
    """The snapshot raises after its first array leaf was copied (disk) or written through into
    the staging directory (tmpfs), in the save after the one that made retention hide step 1
    (whose directory that save takes over on a disk): the error reaches the caller, the writer
    removes what was staged, the committed steps stay, and the next save is whole."""
    from ckpt_callbacks import snapshot
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(2))
    m.store.direct_io, m.store.in_memory = where == "disk", where == "tmpfs"
    for k in (1, 2, 3):
        m.save(k, _big_tree(k))
    m.wait_until_finished()
    real, calls = snapshot._whole_copy, []

    def whole_copy(*a):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated: out of memory while copying the second array")
        return real(*a)
    monkeypatch.setattr(snapshot, "_whole_copy", whole_copy)
    with pytest.raises(MemoryError, match="simulated"):
        m.save(4, _big_tree(4))
    monkeypatch.setattr(snapshot, "_whole_copy", real)
    assert m.all_steps() == [2, 3]
    assert not [n for n in os.listdir(ckdir) if ".tmp-" in n]
    m.save(5, _big_tree(5))
    m.close()
    assert sorted(n for n in os.listdir(ckdir) if n.startswith("step_")) == [fmt.step_name(3), fmt.step_name(5)]
    with cc.CheckpointManager(ckdir) as r:
        for k in (3, 5):
            got = r.restore(step=k)
            for name, x in _big_tree(k).items():
                np.testing.assert_array_equal(got[name], x)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_on_a_disk_retention_hands_its_deleted_steps_directory_to_the_save_after_next(ckdir):
    """KeepLast(2), a save after each: step 1 is deleted after save 3's commit, and save 4 is
    written in its directory (renamed), so steady-state saves create no directories."""
    skip_without_direct_io(ckdir)
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(2))
    inode = {}
    for k in range(1, 6):
        m.save(k, _big_tree(k))
        m._wait()
        inode[k] = os.stat(os.path.join(ckdir, fmt.step_name(k), "arrays")).st_ino
    assert inode[4] == inode[1] and inode[5] == inode[2] and len({inode[1], inode[2], inode[3]}) == 3
    assert m.all_steps() == [4, 5]
    np.testing.assert_array_equal(m.restore(step=5)["w"], _big_tree(5)["w"])
    m.close()
    assert sorted(n for n in os.listdir(ckdir) if n.startswith("step_")) == [fmt.step_name(4), fmt.step_name(5)]


@pytest.mark.parametrize("retention", [[], (), {}, {"keep_last": None, "keep_best": None}])
def test_no_policy_at_all_keeps_every_step(ckdir, retention):
    # an empty list or a config with every key blank (YAML `keep_last:`) is no retention, not
    # "no policy keeps anything", which would delete every step but the newest
    with cc.CheckpointManager(ckdir, retention=retention) as m:
        for s in range(1, 5):
            m.save(s, tree(s))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2, 3, 4]


def test_bad_save_arguments_raise_at_the_call_and_nothing_is_saved_or_lost(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1))
        for step in (10**10, -1, True, np.bool_(True), "3", 2.0, None):
            with pytest.raises(cc.ConfigError, match="step must be an int"):
                m.save(step, tree(2))
        with pytest.raises(cc.ConfigError, match=r"metrics\['loss'\].*64 bits"):
            m.save(2, tree(2), metrics={"loss": 10**30})
        # a lone surrogate (not UTF-8) failed in the writer, without saying where
        with pytest.raises(cc.ConfigError, match="metrics key 'x\\\\udc80' must be a str \\(valid Unicode\\)"):
            m.save(2, tree(2), metrics={"x\udc80": 1.0})
        with pytest.raises(cc.ConfigError, match=r"metrics\['x'\] = '\\udc80' is not valid Unicode"):
            m.save(2, tree(2), metrics={"x": "\udc80"})
        with pytest.raises(cc.ConfigError, match="host_state must be msgpack-able"):
            m.save(2, tree(2), host_state={"pos": "\udc80"})
        m.wait_until_finished()   # nothing was started: no background failure to re-raise
        assert m.all_steps() == [1]
        assert m.save(np.int64(3), tree(3)) and m.save(np.uint32(4), tree(4), metrics={"n": 2**63})
        m.wait_until_finished()
        assert m.all_steps() == [1, 3, 4] and m.metrics(np.int64(4)) == {"n": 2**63}
        np.testing.assert_array_equal(m.restore(np.int32(3))["x"], tree(3)["x"])
        for step in ("3", True, 3.0):
            with pytest.raises(cc.ConfigError, match="step must be an int"):
                m.restore(step)
            with pytest.raises(cc.ConfigError, match="step must be an int"):
                m.metrics(step)


@pytest.mark.parametrize("kwargs, match", [({"async_save": "no"}, "async_save"),
                                           ({"async_save": 0}, "async_save"),
                                           ({"max_staging_bytes": "64MB"}, "max_staging_bytes"),
                                           ({"max_staging_bytes": 0}, "max_staging_bytes"),
                                           ({"max_staging_bytes": True}, "max_staging_bytes"),
                                           ({"timeout_s": -1}, "timeout_s"),
                                           ({"timeout_s": float("nan")}, "timeout_s"),
                                           ({"timeout_s": "600"}, "timeout_s"),
                                           ({"read_only": "yes"}, "read_only"),
                                           ({"clock": "x"}, "clock")])
def test_bad_manager_options_are_config_errors(ckdir, kwargs, match):
    with pytest.raises(cc.ConfigError, match=match):
        cc.CheckpointManager(ckdir, **kwargs)
    assert not os.path.exists(ckdir)


@pytest.mark.parametrize("directory", ["", "  ", "hdfs://namenode/run", 123, None, b"/tmp/x"])
def test_an_empty_or_unsupported_directory_is_a_config_error(tmp_path, monkeypatch, directory):
    monkeypatch.chdir(tmp_path)   # "" must not mean the working directory
    with pytest.raises(cc.ConfigError):
        cc.CheckpointManager(directory)
    assert os.listdir(tmp_path) == []


def test_a_file_url_naming_another_host_is_a_config_error(tmp_path):
    """file://nas/x wrote to /x on this machine (the host was dropped)."""
    with pytest.raises(cc.ConfigError, match="not on host 'nas'"):
        cc.CheckpointManager(f"file://nas{tmp_path}/run")
    assert os.listdir(tmp_path) == []
    for url in (f"file://localhost{tmp_path}/run", f"file://{tmp_path}/run"):
        with cc.CheckpointManager(url) as m:
            m.save(1, tree(1), force=True)
    assert cc.CheckpointManager(str(tmp_path / "run"), read_only=True).all_steps() == [1]


def test_force_and_fallback_must_be_bools_not_truthy_strings(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1))
        with pytest.raises(cc.ConfigError, match="force must be True or False"):
            m.save(1, tree(2), force="no")   # "no" is truthy: it would have replaced step 1
        with pytest.raises(cc.ConfigError, match="fallback must be True or False"):
            m.restore(fallback="no")
        assert_tree_equal(m.restore(1), tree(1))


def test_keep_last_after_a_fallback_counts_no_damaged_step_it_went_past(ckdir):
    """Restored from 4 past a damaged 6, a save of 5 under KeepLast(1) keeps 5 (and 6, damaged,
    until saved anew): counting 6 as the last step deleted 4 and 5 at once, leaving no intact step."""
    with cc.CheckpointManager(ckdir) as m:
        for step in (2, 4, 6):
            m.save(step, tree(step))
    blob = os.path.join(ckdir, "step_0000000006", "blobs", "p0-0.msgpack")
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(1)) as m:
        assert_tree_equal(m.restore(fallback=True), tree(4))
        m.save(5, tree(5))
        m.wait_until_finished()
        assert m.all_steps() == [5, 6]
        m.save(6, tree(6), force=True)   # saved anew: counted again
        m.wait_until_finished()
        assert m.all_steps() == [6]
        assert_tree_equal(m.restore(6), tree(6))


def test_host_state_of_a_process_index_that_saved_none_is_an_error_not_none(ckdir):
    # None means "no host state was saved": a wrong index or remap must not look like it
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1), host_state={"pos": 1})
        m.save(2, tree(2))
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert m.host_state(1, process_index=0) == {"pos": 1} and m.host_state(1, remap={0: 0}) == {"pos": 1}
        for kw, match in (({"process_index": 3}, r"process_index=3: step 1 holds the host state of processes \[0\]"),
                          ({"process_index": -1}, "process_index=-1"), ({"process_index": "0"}, "an int"),
                          ({"remap": {0: 1}}, r"remap\[0\]=1"), ({"remap": {0: "0"}}, "an int")):
            with pytest.raises(cc.ConfigError, match=match):
                m.host_state(1, **kw)
        assert m.host_state(2) is None and m.host_state(2, process_index=5) is None   # step 2 saved none


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_retention_never_deletes_a_step_whose_manifest_cannot_be_read(ckdir, caplog, damage):
    # its metrics are unknown: it may be the best (as `ckpt-callbacks gc`, it is kept and reported)
    policies = [cc.KeepBest("loss", "min", 1), cc.KeepLast(1)]
    with cc.CheckpointManager(ckdir, retention=policies) as m:
        for s, loss in ((1, 0.1), (2, 0.5), (3, 0.9)):
            m.save(s, tree(s), metrics={"loss": loss})
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
    manifest = os.path.join(ckdir, fmt.step_name(1), "manifest.msgpack")
    if damage == "truncate":
        with open(manifest, "r+b") as f:
            f.truncate(10)
    else:
        os.unlink(manifest)
        with pytest.raises(cc.CorruptCheckpointError):   # committed without it: damage, not "not found"
            cc.CheckpointManager(ckdir, read_only=True).host_state(1)
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=policies) as m:
            for s, loss in ((4, 0.2), (5, 0.7)):
                m.save(s, tree(s), metrics={"loss": loss})
                m.wait_until_finished()
            assert m.all_steps() == [1, 4, 5] and m.best_step() == 4   # 3 went by the policies
            with pytest.raises(cc.CorruptCheckpointError, match="step 1"):
                m.metrics(1)
            assert m.metrics(5) == {"loss": 0.7}
            m.save(1, tree(1), metrics={"loss": 0.05}, force=True)   # replacing it heals it
            m.wait_until_finished()
            assert m.metrics(1) == {"loss": 0.05} and m.best_step() == 1 and m.all_steps() == [1, 5]
    warned = [r for r in caplog.records if "cannot read its manifest" in r.getMessage()]
    assert len(warned) == 1 and "step 1" in warned[0].getMessage()   # once, not at every save


def test_an_outage_when_save_is_called_is_a_save_error_and_the_next_save_works(ckdir, monkeypatch):
    # as any save that meets an outage (docs/storage.md): CheckpointSaveError, training goes on
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1))
        m.wait_until_finished()
        real = m.store.committed_steps, m.store.has_step

        def unreachable(*args):
            raise cc.StorageUnavailableError("list commits/ failed: connection refused")
        monkeypatch.setattr(m.store, "committed_steps", unreachable)
        monkeypatch.setattr(m.store, "has_step", unreachable)
        with pytest.raises(cc.CheckpointSaveError, match="step 2 was not saved") as info:
            m.save(2, tree(2))
        assert isinstance(info.value.__cause__, cc.StorageUnavailableError)
        assert info.value.failures[0].startswith("StorageUnavailableError")
        monkeypatch.setattr(m.store, "committed_steps", real[0])
        monkeypatch.setattr(m.store, "has_step", real[1])
        m.save(3, tree(3))
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]


def test_a_committed_step_missing_its_host_state_file_is_damage_not_not_found(ckdir):
    # CheckpointNotFoundError means "nothing saved yet: start from scratch" to a caller; a run
    # restarted at step 0 in this directory would have its new low steps deleted by KeepLast
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, tree(s), host_state={"pos": s})
    os.unlink(os.path.join(ckdir, fmt.step_name(2), "host", "p0.msgpack"))
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        with pytest.raises(cc.CorruptCheckpointError, match=r"step 2 .*damaged.*host state of process 0.*missing"):
            m.host_state()
        assert m.host_state(1) == {"pos": 1}


def test_a_host_state_that_cannot_be_stored_fails_the_save_naming_its_path(tmp_path):
    with cc.CheckpointManager(str(tmp_path / "run")) as m:
        with pytest.raises(cc.ConfigError, match=r"host_state\['data'\]\['pos'\].*64 bits"):
            m.save(1, {"x": np.ones(2)}, host_state={"data": {"pos": 2**64}})
        assert m.save(2, {"x": np.ones(2)}, host_state={"data": {"pos": np.uint64(2**64 - 1)}})
        m.wait_until_finished()
        assert m.all_steps() == [2] and m.host_state(2) == {"data": {"pos": 2**64 - 1}}


def test_a_manager_left_open_finishes_its_save_in_flight_at_exit_and_says_so(ckdir):
    """A script that ends without close(): the save in flight commits (the writer thread is a
    daemon and the thread pools it submits to stop at exit: the manager closes before them)."""
    code = (_SLOW_WRITES +
            "m = cc.CheckpointManager(sys.argv[1], retention=cc.KeepLast(1))\n"
            "m.save(1, {'w': np.ones(3)}); m.wait_until_finished()\n"
            "m.save(2, {'w': np.full(300_000, 2.0)})\n"
            "print('saved', flush=True)\n")
    r = _python("-c", code, ckdir)
    assert r.returncode == 0 and "saved" in r.stdout, r.stdout + r.stderr
    assert "was not closed; finishing its save in flight at exit" in r.stderr, r.stderr
    assert sorted(os.listdir(ckdir)) == ["step_0000000002"]   # committed, retention applied, lock released
    with cc.CheckpointManager(ckdir) as m:
        np.testing.assert_array_equal(m.restore(2)["w"], np.full(300_000, 2.0))


@pytest.mark.parametrize("size", [1000, 300_000], ids=["a blob", "a chunk file"])
def test_at_exit_a_manager_a_live_thread_saves_through_is_left_to_that_thread(ckdir, size):
    """The main thread's save in flight at exit, a non-daemon worker already inside `save`: the
    exit hook judged the manager by the main thread's save and closed it under the worker, whose
    next save failed ("closed"). The worker's saves write on the caller's thread what the writer's
    pools, stopped by `concurrent.futures` at exit, no longer take ("cannot schedule new futures
    after interpreter shutdown" failed such a save of a chunk file before, and a restore of
    several leaves)."""
    code = (_SLOW_WRITES +
            "m = cc.CheckpointManager(sys.argv[1])\n"
            "m.save(1, {'w': np.full(1000, 1.0)})   # in flight when the main thread ends\n"
            "def worker():\n"
            "    time.sleep(0.2)\n"
            "    for s in (2, 3, 4):\n"
            f"        m.save(s, {{'w': np.full({size}, float(s)), 'v': np.arange(s)}})\n"
            "    m.wait_until_finished()\n"
            f"    assert (m.restore(4)['w'] == np.full({size}, 4.0)).all()   # restores there too\n"
            "    m.close()\n"
            "    print('worker closed', flush=True)\n"
            "threading.Thread(target=worker).start()\n"
            "time.sleep(0.4)\n")
    r = _python("-c", code, ckdir)
    assert r.returncode == 0 and "worker closed" in r.stdout, r.stdout + r.stderr
    assert "was not closed" not in r.stderr, r.stderr
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert m.all_steps() == [1, 2, 3, 4]
        np.testing.assert_array_equal(m.restore(4)["w"], np.full(size, 4.0))


def test_a_save_in_flight_that_a_live_thread_left_open_at_exit_commits_once_that_thread_ends(ckdir):
    """The exit hook leaves a manager to the live non-daemon thread whose save is in flight; that
    thread then ended without close(): nothing closed the manager after it, and the save in
    flight was cut off with the process (no step, the lock left behind, nothing said). A second
    pass after the non-daemon threads are joined closes it: the step commits, as the main
    thread's would."""
    code = (_SLOW_WRITES +
            "m = cc.CheckpointManager(sys.argv[1], retention=cc.KeepLast(1))\n"
            "def worker():\n"
            "    m.save(1, {'w': np.full(300_000, 1.0), 'v': np.arange(3)})\n"
            "    time.sleep(0.6)   # alive when the main thread returns, gone before the save commits\n"
            "    print('worker returned', flush=True)\n"
            "threading.Thread(target=worker).start()\n"
            "time.sleep(0.3)\n")
    r = _python("-c", code, ckdir)
    assert r.returncode == 0 and "worker returned" in r.stdout, r.stdout + r.stderr
    assert r.stderr.count("was not closed; finishing its save in flight at exit") == 1, r.stderr
    assert sorted(os.listdir(ckdir)) == ["step_0000000001"]   # committed, lock released
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert_tree_equal(m.restore(1), {"w": np.full(300_000, 1.0), "v": np.arange(3)})


def test_a_failed_save_nobody_was_told_of_is_logged_once_at_exit(ckdir):
    # the exit hook runs twice (before and after the non-daemon threads are joined)
    code = ("import sys, time, numpy as np, ckpt_callbacks as cc, ckpt_callbacks.manager as mm\n"
            "def fail(*a, **k):\n    raise OSError('the disk is gone')\n"
            "mm.write_and_commit = fail\n"
            "m = cc.CheckpointManager(sys.argv[1])\n"
            "m.save(1, {'w': np.ones(3)}); time.sleep(0.3)\n")
    r = _python("-c", code, ckdir)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("the last save to") == 1 and "the disk is gone" in r.stderr, r.stderr


def test_a_forked_child_leaves_its_parents_managers_alone_at_exit(ckdir):
    """A fork-started worker (multiprocessing, a data loader) inherits the parent's managers: at
    its exit it must neither wait on the parent's writer pools (which do not exist in the child:
    it hung) nor close, i.e. delete or unlock, anything of the parent's."""
    code = ("import sys, time, multiprocessing as mp, numpy as np, ckpt_callbacks as cc, ckpt_callbacks.manager as mm\n"
            "def work(i):\n    return i * i\n"
            "if __name__ == '__main__':\n"
            "    m = cc.CheckpointManager(sys.argv[1], retention=cc.KeepLast(1))\n"
            "    for s in (1, 2, 3):\n        m.save(s, {'w': np.full(300_000, float(s))})\n"
            "    real = mm.write_and_commit\n"
            "    mm.write_and_commit = lambda *a, **k: (time.sleep(1.0), real(*a, **k))[1]\n"
            "    m.save(4, {'w': np.full(300_000, 4.0)})   # in flight while the children start and end\n"
            "    ctx = mp.get_context('fork')\n"
            "    p = ctx.Process(target=work, args=(3,)); p.start(); p.join(60)\n"
            "    with ctx.Pool(2) as pool:\n        print(pool.map(work, range(3)))\n"
            "    print('child', p.exitcode, p.is_alive(), flush=True)\n"
            "    m.close()\n")
    script = os.path.join(os.path.dirname(ckdir), "fork_exit.py")
    with open(script, "w") as f:
        f.write(code)
    r = _python(script, ckdir)
    assert r.returncode == 0 and "child 0 False" in r.stdout, r.stdout + r.stderr
    assert "was not closed" not in r.stderr, r.stderr
    with cc.CheckpointManager(ckdir) as m:
        assert m.all_steps() == [4]
        np.testing.assert_array_equal(m.restore(4)["w"], np.full(300_000, 4.0))


@pytest.mark.parametrize("kind", ["packed", "zarr"])
def test_numpy_leaves_of_the_other_byte_order_restore_their_values(ckdir, kind):
    n = 5 if kind == "packed" else 300_000
    leaves = {"i": np.arange(n, dtype=">i4"), "f": np.linspace(-1, 1, n, dtype=">f8"), "s": np.array(7, ">u2")}
    expect = {k: np.array(v) for k, v in leaves.items()}
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, leaves)
        for v in leaves.values():   # mutated right after the call: the snapshot holds
            v[...] = 0
        m.wait_until_finished()
        out = m.restore(1)
    for k, v in expect.items():
        assert out[k].dtype == v.dtype.newbyteorder("=") and np.array_equal(out[k], v), k


def test_saves_from_several_threads_take_turns_and_commit_what_each_passed(ckdir):
    """Two threads saving through one manager: a save started another's thread (RuntimeError),
    saves that returned True were never committed, and a step was committed with another step's
    data (the pool's buffers recycled under a save in flight), which `verify` passed."""
    errors, started = [], []
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(40)) as m:
        def run(first):
            try:
                for s in range(first, 31, 2):
                    big = np.full(70_000, float(s), np.float32)   # over the pool's smallest buffer
                    if m.save(s, {"w": big, "x": big + 1}):
                        started.append(s)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m.wait_until_finished()
        assert not errors and sorted(started) == list(range(1, 31)) and m.all_steps() == list(range(1, 31))
        for s in m.all_steps():
            out = m.restore(s)
            assert (out["w"] == s).all() and (out["x"] == s + 1).all(), s


def test_a_wait_interrupted_by_ctrl_c_leaves_the_save_in_flight_to_be_waited_for(ckdir, monkeypatch):
    """Ctrl-C during `wait_until_finished()`: the interrupted `Thread.join()` (CPython 3.11) marked
    the writer, still running, as stopped. A restore right after then did not wait for the save
    (CheckpointNotFoundError for the step `save` had started), the next save ran beside it, and
    the exit hook took it for done."""
    import ckpt_callbacks.manager as mm
    real = mm.write_and_commit
    monkeypatch.setattr(mm, "write_and_commit", lambda *a, **k: (time.sleep(1.0), real(*a, **k))[1])
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree(1))
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            m.wait_until_finished()
        assert m.all_steps() == []                            # still in flight: a restore
        assert_tree_equal(m.restore(1), tree(1))              # waits for it, then reads it
        m.save(2, tree(2))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]


def test_a_close_interrupted_by_ctrl_c_keeps_the_lock_and_threads_until_close_finishes(ckdir, monkeypatch):
    """Ctrl-C during `close()`: it released the lock, ended the writer's threads and dropped the
    files kept for reuse while the save was still being written, and marked the manager closed,
    so the next close() returned at once: another writer could open the directory mid-save, and
    the kept step's `.del-` directory stayed behind."""
    import ckpt_callbacks.manager as mm
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1))
    m.save(1, tree(1))
    m.wait_until_finished()
    real = mm.write_and_commit
    monkeypatch.setattr(mm, "write_and_commit", lambda *a, **k: (time.sleep(1.0), real(*a, **k))[1])
    m.save(2, tree(2))
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        m.close()
    assert m.all_steps() == [1]   # still in flight, and the directory still this manager's
    with pytest.raises(cc.CheckpointLockedError):
        cc.CheckpointManager(ckdir)
    m.close()
    assert m.all_steps() == [2] and os.listdir(ckdir) == [fmt.step_name(2)]   # nothing kept, unlocked
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(2), tree(2))


def test_a_forked_child_cannot_save_through_its_parents_manager(ckdir):
    """A child inherits no writer threads: its save hung for good, as a second writer under the
    parent's lock. Refused, saying so; its close leaves the parent's manager and files alone."""
    with cc.CheckpointManager(ckdir, retention=cc.KeepLast(1)) as m:
        m.save(1, tree(1))
        m.save(2, tree(2))
        m.wait_until_finished()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: report, never return into pytest
            signal.alarm(30)   # (a save that hangs ends the child, and fails the test)
            code = 0
            try:
                m.save(3, tree(3))
                code = 1
            except cc.CheckpointError as e:
                code = 0 if "forked child" in str(e) else 2
            try:
                m.wait_until_finished()
                code = code or 3
            except cc.CheckpointError:
                pass
            try:   # (tensorstore, used by the parent, would abort the child)
                m.restore(2)
                code = code or 4
            except cc.CheckpointError as e:
                code = code or (0 if "'spawn'" in str(e) else 5)
            m.close()
            code = code or (0 if m.all_steps() == [2] else 6)   # listing is fine
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0 and os.read(r, 1) == b"\0"
        assert m.save(3, tree(3)) and not m._closed
        m.wait_until_finished()
        assert m.all_steps() == [3] and os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))
    assert sorted(os.listdir(ckdir)) == ["step_0000000003"]


def test_a_readers_metrics_follow_a_forced_replacement(ckdir):
    reader = cc.CheckpointManager(ckdir, read_only=True)
    with cc.CheckpointManager(ckdir, retention=cc.KeepBest("val", "min", 2)) as m:
        m.save(5, tree(5), metrics={"val": 1.0})
        m.save(6, tree(6), metrics={"val": 2.0})
        m.wait_until_finished()
        assert reader.metrics(6) == {"val": 2.0}
        m.save(6, tree(6), metrics={"val": 0.5}, force=True)
        m.wait_until_finished()
    assert reader.metrics(6) == {"val": 0.5}
    reader.policies = [cc.KeepBest("val", "min", 1)]
    assert reader.best_step() == 6


def test_metrics_of_one_step_reads_that_step_only(ckdir, monkeypatch):
    """metrics(step) read (once) and then stat'ed every committed step's manifest on every call:
    reading the metrics of each of 3,000 steps took 134 s (750 steps: 9 s), quadratic."""
    from ckpt_callbacks import retain
    with cc.CheckpointManager(ckdir) as m:
        for s in range(1, 6):
            m.save(s, tree(s), metrics={"loss": 1.0 / s})
    reader = cc.CheckpointManager(ckdir, read_only=True)
    real, read, stats = retain.restore_mod.read_manifest, [], []
    monkeypatch.setattr(retain.restore_mod, "read_manifest", lambda store, step: read.append(step) or real(store, step))
    monkeypatch.setattr(retain, "local_token", lambda mngr, step: stats.append(step) or mngr.store.step_token(step))
    monkeypatch.setattr(reader.store, "committed_steps", lambda: pytest.fail("listed every step"))
    assert [reader.metrics(s) for s in (3, 3, 5)] == [{"loss": 1 / 3}, {"loss": 1 / 3}, {"loss": 0.2}]
    assert reader.metrics(7) is None
    assert read == [3, 5] and stats == [3, 3, 5]


def test_a_step_that_retention_deletes_while_its_metrics_are_read_is_gone_not_damaged(ckdir, monkeypatch, caplog):
    # metrics(prev) right after an async save whose retention deletes prev: the step went, so
    # None, as for any step not committed; no CorruptCheckpointError, no "run verify" warning
    from ckpt_callbacks import retain
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, tree(s), metrics={"loss": 1.0 / s})
    reader = cc.CheckpointManager(ckdir, read_only=True, retention=cc.KeepBest("loss"))
    real = retain.restore_mod.read_manifest

    replaced = []

    def deleted_first(store, step):
        if step == 1:
            store.delete(1)   # as the writer's retention does, on its thread
        if step == 2 and not replaced:   # a forced save replaces it as it is read: read it again
            replaced.append(step)
            manifest = os.path.join(ckdir, fmt.step_name(2), "manifest.msgpack")
            shutil.copy(manifest, manifest + ".new")
            os.replace(manifest + ".new", manifest)
            raise cc.CheckpointNotFoundError(f"{manifest} does not exist (simulated)")
        return real(store, step)
    monkeypatch.setattr(retain.restore_mod, "read_manifest", deleted_first)
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        assert reader.metrics(2) == {"loss": 0.5} and replaced
        assert reader.metrics(1) is None and reader.best_step() == 2
    assert not [r for r in caplog.records if "cannot read its manifest" in r.getMessage()]


def test_a_failed_save_is_raised_by_the_next_save_even_when_that_one_is_not_due(ckdir, monkeypatch):
    import ckpt_callbacks.manager as mm

    def full(*a, **k):
        raise OSError(28, "No space left on device (simulated)")
    with cc.CheckpointManager(ckdir, save_interval_steps=10) as m:
        monkeypatch.setattr(mm, "write_and_commit", full)
        assert m.save(10, tree(10))
        m._thread.join()   # the failure is in; nobody has been told yet
        with pytest.raises(OSError, match="No space left"):
            m.save(11, tree(11))
        assert not m.save(12, tree(12))   # told once
        monkeypatch.undo()
        assert m.save(20, tree(20))
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [20]


def test_a_with_block_that_raises_keeps_its_exception_and_is_told_of_a_failed_save(ckdir, monkeypatch, caplog):
    """A background failure used to replace the exception that ended the `with` block (the user's
    `except KeyError` never caught it); it is now logged and noted on that exception. Leaving the
    block normally still raises it."""
    import ckpt_callbacks.manager as mm

    def full(*a, **k):
        raise OSError(28, "No space left on device (simulated)")
    monkeypatch.setattr(mm, "write_and_commit", full)
    with pytest.raises(KeyError, match="the body's own") as e:
        with cc.CheckpointManager(ckdir) as m:
            assert m.save(1, tree(1))
            raise KeyError("the body's own")
    assert any("No space left" in n and "also failed" in n for n in e.value.__notes__)
    assert "No space left" in caplog.text
    with pytest.raises(OSError, match="No space left"):
        with cc.CheckpointManager(ckdir) as m:
            assert m.save(2, tree(2))
    monkeypatch.undo()
    with cc.CheckpointManager(ckdir) as m:   # the directory is free again after each
        assert m.save(3, tree(3))
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [3]


def test_numpy_and_jax_integers_are_ints_everywhere_and_numpy_metrics_keep_their_kind(ckdir):
    """`save_interval_steps=np.int64(10)`, `KeepLast(np.int64(3))` and a jax step counter were
    refused; a numpy int metric was stored as a float (2**53 + 1 lost its last bit) and a numpy
    bool as 1.0, which ranked (a Python bool never does)."""
    import jax.numpy as jnp
    policies = [cc.KeepLast(np.int64(1)), cc.KeepSteps(np.array([20])), cc.KeepBest("n", "max", np.int32(1))]
    assert [p.n for p in (policies[0], policies[2])] == [1, 1] and type(policies[0].n) is int
    with cc.CheckpointManager(ckdir, save_interval_steps=np.int64(10), retention=policies) as m:
        assert not m.save(jnp.int32(15), tree(15))
        assert m.save(jnp.int32(20), tree(20), metrics={"n": np.int64(2 ** 53 + 1), "ok": np.bool_(True)})
        assert m.save(np.uint64(30), tree(30), metrics={"n": jnp.int32(3), "ok": jnp.array(False)})
        assert m.save(40, tree(40), metrics={"n": 1})
        m.wait_until_finished()
        assert m.all_steps() == [20, 40]
    m = cc.CheckpointManager(ckdir, read_only=True, retention=cc.KeepBest("ok", "max"))
    assert m.metrics(20) == {"n": 2 ** 53 + 1, "ok": True} and type(m.metrics(20)["n"]) is int
    assert m.best_step() is None   # bools never rank
    with cc.CheckpointManager(ckdir) as m:
        for bad in (np.array([True, False]), jnp.array([1, 2]), np.array([0.5]), 1 + 2j, np.complex64(1 + 2j),
                    jnp.asarray(1j)):   # (numpy's and jax's complex became a float, the imaginary part dropped)
            with pytest.raises(cc.ConfigError, match="must be a number or str"):
                m.save(50, tree(50), metrics={"m": bad})
    for bad in (True, 2.0, jnp.float32(2), jnp.array([1, 2]), np.bool_(True)):
        with pytest.raises(cc.ConfigError):
            cc.CheckpointManager(ckdir, read_only=True, save_interval_steps=bad)
        with pytest.raises(cc.ConfigError):
            cc.KeepLast(bad)


@pytest.mark.parametrize("where", ["after", "before"])
def test_a_keyboard_interrupt_inside_the_writers_start_leaves_a_manager_that_works(ckdir, monkeypatch, where):
    """Ctrl-C lands in `Thread.start()` (which waits for the new thread): with the writer started
    ("after") or not ("before"). The save is aborted and cleaned up either way; waiting, closing
    and the next save work (they hung: the writer waited for snapshot items that never came)."""
    from ckpt_callbacks import manager as manager_mod
    armed = [True]

    class Thread(threading.Thread):
        def start(self):
            fire = armed[0] and self.name.startswith("ckpt_callbacks-save-")
            if fire and where == "before":
                armed[0] = False
                raise KeyboardInterrupt
            super().start()
            if fire:
                armed[0] = False
                raise KeyboardInterrupt

    m = cc.CheckpointManager(ckdir, async_save=where == "after")
    m.save(1, tree(1))
    m.wait_until_finished()
    monkeypatch.setattr(manager_mod.threading, "Thread", Thread)
    with pytest.raises(KeyboardInterrupt):
        m.save(2, tree(2))
    m.wait_until_finished()
    assert m.all_steps() == [1] and not [n for n in os.listdir(ckdir) if ".tmp-" in n]
    assert m.save(2, tree(2))
    m.close()
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(2), tree(2))


def test_saved_metrics_without_the_one_keep_best_ranks_by_are_warned_about_once(ckdir, caplog):
    """A typo in the metric name: no step ever ranks, and the best steps are deleted as they fall
    out of KeepLast. Said once, naming what the metrics have; saves without metrics say nothing."""
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=[cc.KeepLast(1), cc.KeepBest("val_acc", "max")]) as m:
            m.save(1, tree(1))
            for s in (2, 3):
                m.save(s, tree(s), metrics={"val_acuracy": 0.5 + s / 10, "loss": 1.0})
    said = [r.getMessage() for r in caplog.records if "do not have it" in r.getMessage()]
    assert len(said) == 1 and "ranks steps by 'val_acc'" in said[0] and "step 2" in said[0], said
    assert "they have: loss, val_acuracy" in said[0]


def test_a_keep_best_metric_saved_as_a_str_or_bool_is_warned_about_as_such(ckdir, caplog):
    """The metric is there but never ranks: the warning said the metrics "do not have it"."""
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        with cc.CheckpointManager(ckdir, retention=[cc.KeepLast(1), cc.KeepBest("val_acc", "max")]) as m:
            for s in (1, 2):
                m.save(s, tree(s), metrics={"val_acc": True, "loss": 1.0})
    said = [r.getMessage() for r in caplog.records if "KeepBest" in r.getMessage()]
    assert len(said) == 1 and "step 1 saved it as a bool (True), which never ranks" in said[0], said


def test_a_retention_failure_is_a_checkpoint_error_saying_the_step_was_committed(ckdir, monkeypatch):
    """A step retention cannot delete (e.g. made immutable): the save's own step is committed; the
    failure is a CheckpointError naming the step it tried to delete (it was a raw PermissionError)."""
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1))
    m.save(1, tree(1))
    m.wait_until_finished()
    real = type(m.store).delete

    def refuse(self, step, **kw):
        raise PermissionError(1, "Operation not permitted", os.path.join(ckdir, fmt.step_name(step)))
    monkeypatch.setattr(type(m.store), "delete", refuse)
    m.save(2, tree(2))
    with pytest.raises(cc.CheckpointError, match=r"step 2 was committed, but retention failed deleting step 1 .*"
                                                 r"PermissionError.*Nothing committed was lost") as e:
        m.wait_until_finished()
    assert isinstance(e.value.__cause__, PermissionError)
    assert m.all_steps() == [1, 2]
    monkeypatch.setattr(type(m.store), "delete", real)
    m.save(3, tree(3))
    m.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [3]


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_directory_removed_while_its_manager_is_open_is_not_written_again(ckdir, how):
    """`rm -rf DIR` under an open manager took its lock away: its next save recreated DIR and
    committed without one, while a second writer could open the directory and save beside it."""
    import shutil
    m = cc.CheckpointManager(ckdir)
    m.save(1, tree(1))
    m.wait_until_finished()
    shutil.rmtree(ckdir)
    if how == "replaced":   # another run took the directory since
        other = subprocess.run([sys.executable, "-c", "import sys, ckpt_callbacks as cc\n"
                                "with cc.CheckpointManager(sys.argv[1]) as m: m.save(100, {'a': 1})", ckdir],
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 0, other.stderr
    with pytest.raises(cc.CheckpointLockedError, match="no longer holds this process's lock") as e:
        m.save(2, tree(2))
    assert "nothing was saved" in str(e.value)
    m.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == ([] if how == "removed" else [100])
    with cc.CheckpointManager(ckdir) as m:   # a new manager takes it
        m.save(2, tree(2))


def test_where_no_thread_can_start_a_save_runs_whole_on_the_callers_thread(ckdir, monkeypatch):
    """From Python 3.12 on, an exiting interpreter starts no thread ("can't create new thread at
    interpreter shutdown"): a save from a non-daemon thread still running then, or the writer of
    a save in flight that the exit hook closes, failed where it started its writer or submitted
    to a pool that had no thread yet. Then (`storage.threads_refused`) the save runs whole on
    the caller's thread (a staging budget, which would wait for the writer, does not apply), the
    pools' tasks too, and a restore reads on the caller's thread; the step is committed when
    `save` returns."""
    from ckpt_callbacks import hostmem, storage
    from ckpt_callbacks import manager as mm
    m = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1), max_staging_bytes=64 << 10)
    m.save(1, {"w": np.zeros(300_000, np.float32)})
    m.wait_until_finished()
    for mod in (mm, storage, hostmem):
        monkeypatch.setattr(mod, "threads_refused", lambda: True)
    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or (_ for _ in ()).throw(
        RuntimeError("can't create new thread at interpreter shutdown")))
    tree = {"w": np.arange(300_000, dtype=np.float32), "v": np.arange(5), "j": jax.numpy.arange(1000.0),
            "blob": {f"s{i}": np.full(100, i) for i in range(20)}}
    assert m.save(2, tree) is True
    assert m.all_steps() == [2]       # committed, and step 1 deleted, before save returned
    assert_tree_equal(m.restore(2), tree)
    m.close()
    assert started == []
    monkeypatch.undo()
    with cc.CheckpointManager(ckdir, read_only=True) as r:
        assert r.all_steps() == [2]
        assert_tree_equal(r.restore(2), tree)
