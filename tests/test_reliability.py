"""Reliability and security: disk full, read-only directories, hostile checkpoints, corrupt newest
step on resume. (Crash trials live in test_crash.py; damaged chunks in test_restore.py.)"""

import errno
import logging
import os
import pickle  # test-only: we craft pickle payloads to prove they are never executed
import shutil
import subprocess
import threading

import msgpack
import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import format as fmt


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB tmpfs of its own (skipped where this machine forbids mounting)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_cleanly_and_recovers(small_fs):
    d = os.path.join(small_fs, "ck")
    keep = {"w": np.arange(300_000, dtype=np.float32)}               # 1.2 MiB
    with cc.CheckpointManager(d) as m:
        m.save(1, keep)
        m.wait_until_finished()
        filler = os.path.join(small_fs, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (3 << 20))
        m.save(2, {"w": np.ones((1024, 1024), np.float32)})        # 4 MiB: does not fit
        with pytest.raises(cc.CheckpointSaveError, match="[Nn]o space|ENOSPC|RESOURCE_EXHAUSTED|space") as e:
            m.wait_until_finished()
        assert f"file system holding {d} is full (or over quota): free space there" in str(e.value)
        assert m.all_steps() == [1]
        assert not [n for n in os.listdir(d) if ".tmp-" in n]       # staging removed
        np.testing.assert_array_equal(m.restore(1)["w"], keep["w"])
        os.remove(filler)
        m.save(3, {"w": np.ones((1024, 1024), np.float32)})
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]


def test_a_manager_opened_on_a_full_disk_says_so_and_leaves_nothing(small_fs):
    d = os.path.join(small_fs, "ck")
    os.makedirs(d)
    try:
        with open(os.path.join(small_fs, "filler"), "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    with pytest.raises(cc.CheckpointError, match=f"cannot create the lock file {d}/.*No space left.*{d} is full"):
        cc.CheckpointManager(d)
    assert os.listdir(d) == []          # no owner file of the lock left behind
    os.remove(os.path.join(small_fs, "filler"))
    with cc.CheckpointManager(d) as m:
        m.save(1, {"a": 1})


def test_read_only_directory_fails_at_start(small_fs):
    d = os.path.join(small_fs, "ck")
    with cc.CheckpointManager(d) as m:
        m.save(1, {"a": 1})
    subprocess.run(["mount", "-o", "remount,ro", small_fs], check=True)
    with pytest.raises(cc.CheckpointError, match="not writable"):
        cc.CheckpointManager(d)
    assert cc.CheckpointManager(d, read_only=True).restore() == {"a": 1}   # reading still works


def _write_manifest(d, step, body):
    path = os.path.join(d, fmt.step_name(step), fmt.MANIFEST)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(body)


def test_escaping_keys_are_only_names(ckdir, tmp_path):
    tree = {"../../escape": np.ones(3), "/etc/passwd": 1, "a/../../b": {"..": np.zeros(2)}}
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, tree)
    before = sorted(os.listdir(tmp_path))
    out = cc.CheckpointManager(ckdir, read_only=True).restore()
    assert sorted(out) == sorted(tree) and sorted(os.listdir(tmp_path)) == before
    for dirpath, _, files in os.walk(ckdir):
        assert os.path.realpath(dirpath).startswith(os.path.realpath(ckdir))


def _golden_manifest(ckdir, **leaf_changes):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"w": np.ones((600, 600), np.float32), "s": np.ones(4, np.float32)})
    path = os.path.join(ckdir, fmt.step_name(1), fmt.MANIFEST)
    m = fmt.unpack_manifest(open(path, "rb").read())
    return m, path


@pytest.mark.usefixtures("zarr_above_1mib")
def test_declared_shape_beyond_stored_bytes_is_refused_before_allocating(ckdir):
    m, path = _golden_manifest(ckdir)
    big = next(l for l in m["leaves"] if l["k"] == "array")
    zarr_json = os.path.join(ckdir, fmt.step_name(1), big["z"], "zarr.json")
    import json
    meta = json.load(open(zarr_json))
    meta["shape"] = [600 * 2**10, 600 * 2**8]                     # ~377 GB of float32
    json.dump(meta, open(zarr_json, "w"))
    big["sh"] = meta["shape"]
    with_crcs = fmt.pack_manifest(m)   # the chunk CRCs recorded do not cover that shape's chunks
    with pytest.raises(cc.CorruptCheckpointError, match="leaf 1 chunk checksums"):
        fmt.unpack_manifest(with_crcs)
    del big["cc"]                      # as a manifest written before they were recorded
    open(path, "wb").write(fmt.pack_manifest(m))
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\].*declares"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    small = next(l for l in m["leaves"] if l["k"] == "packed")
    big["sh"] = [600, 600]
    small["sh"] = [2**30]
    open(path, "wb").write(fmt.pack_manifest(m))
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['s'\]"):
        cc.CheckpointManager(ckdir, read_only=True).restore()


@pytest.mark.parametrize("bomb", ["deep", "long", "ext", "huge_str"])
def test_msgpack_bombs_are_rejected(ckdir, bomb):
    os.makedirs(ckdir)
    if bomb == "deep":
        body = b"\x91" * 100_000 + b"\xc0"                         # 100k nested one-element arrays
    elif bomb == "long":
        body = b"\xdd\xff\xff\xff\xff"                              # array claiming 4 billion items
    elif bomb == "ext":
        body = msgpack.packb(msgpack.ExtType(1, b"x" * 10))
    else:
        body = b"\xdb\xff\xff\xff\xf0" + b"a" * 10                  # str claiming 4 GiB
    outer = msgpack.packb({"magic": "ckpt_callbacks", "version": 1, "crc32c": fmt.crc32c(body), "body": body})
    _write_manifest(ckdir, 1, outer)
    with pytest.raises(cc.CorruptCheckpointError):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    _write_manifest(ckdir, 1, body)
    with pytest.raises(cc.CorruptCheckpointError):
        cc.CheckpointManager(ckdir, read_only=True).restore()


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {EVIL_MARK}",))


EVIL_MARK = "/tmp/ckpt_callbacks_pwned"


def test_pickle_payloads_never_run(ckdir):
    if os.path.exists(EVIL_MARK):
        os.remove(EVIL_MARK)
    payload = pickle.dumps(Evil())
    m, path = _golden_manifest(ckdir)
    # as the manifest itself
    shutil.copy(path, path + ".orig")
    open(path, "wb").write(payload)
    with pytest.raises(cc.CorruptCheckpointError):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    shutil.copy(path + ".orig", path)
    os.remove(path + ".orig")
    # as a packed blob
    small = next(l for l in m["leaves"] if l["k"] == "packed")
    open(os.path.join(ckdir, fmt.step_name(1), small["b"]), "wb").write(payload)
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['s'\]"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    # as a bytes value: handed back as bytes, never loaded
    with cc.CheckpointManager(ckdir) as mm:
        mm.save(2, {"blob": payload})
    assert cc.CheckpointManager(ckdir, read_only=True).restore(2) == {"blob": payload}
    assert not os.path.exists(EVIL_MARK)


def test_unknown_dtype_is_refused(ckdir):
    m, path = _golden_manifest(ckdir)
    m["leaves"][0]["dt"] = "float128x"
    open(path, "wb").write(fmt.pack_manifest(m))
    with pytest.raises(cc.IncompatibleCheckpointError, match="unknown dtype 'float128x'"):
        cc.CheckpointManager(ckdir, read_only=True).restore()


def test_corrupt_newest_step_fallback_is_explicit_and_logged(ckdir, caplog):
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2, 3):
            m.save(s, {"x": np.full(4, s)})
    man = os.path.join(ckdir, fmt.step_name(3), fmt.MANIFEST)
    open(man, "wb").write(b"garbage")
    m = cc.CheckpointManager(ckdir)
    assert m.all_steps() == [1, 2, 3]                    # a damaged step stays listed
    with pytest.raises(cc.CorruptCheckpointError):
        m.restore()                                      # never silently
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        out = m.restore(fallback=True)
    assert m.restored_step == 2 and out["x"][0] == 2
    assert "step 3" in caplog.text and "falling back to step 2" in caplog.text
    with pytest.raises(cc.CorruptCheckpointError):
        m.restore(step=3, fallback=True)                 # an explicit step never falls back
    m.close()


def test_a_damaged_host_state_is_caught_by_its_checksum_and_fallback_passes_it(ckdir, caplog):
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"x": np.full(4, s)}, host_state={"data": {"pos": 123456789 + s}})
    host = os.path.join(ckdir, fmt.step_name(2), "host", "p0.msgpack")
    data = bytearray(open(host, "rb").read())
    data[-1] ^= 1   # still valid msgpack: another position
    open(host, "wb").write(bytes(data))
    m = cc.CheckpointManager(ckdir, read_only=True)
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 2 in .* is damaged: host state of process 0 .* checksum mismatch"):
        m.host_state(2)
    assert m.restore()["x"][0] == 2   # the tree alone reads intact ...
    with caplog.at_level(logging.WARNING, "ckpt_callbacks"):
        out = m.restore(fallback=True)   # ... but with a fallback the step's data position is its too
    assert m.restored_step == 1 and out["x"][0] == 1 and m.host_state(1) == {"data": {"pos": 123456790}}
    assert "falling back to step 1" in caplog.text
    from ckpt_callbacks.verify import verify_step
    assert [w for w, _ in verify_step(m.store, 2)] == ["host state of process 0"]


def test_a_host_state_that_cannot_be_read_is_damage_and_fallback_passes_it(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"x": np.full(4, s)}, host_state={"data": {"pos": s}})
    host = os.path.join(ckdir, fmt.step_name(2), "host", "p0.msgpack")
    os.remove(host)
    os.mkdir(host)   # a directory in its place: the raw IsADirectoryError, no fallback, was raised
    m = cc.CheckpointManager(ckdir, read_only=True)
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 2 in .* is damaged: host state of process 0 .* cannot be read"):
        m.host_state(2)
    out = m.restore(fallback=True)
    assert m.restored_step == 1 and out["x"][0] == 1 and m.host_state(1) == {"data": {"pos": 1}}
    from ckpt_callbacks.verify import verify_step
    assert [w for w, _ in verify_step(m.store, 2)] == ["host state of process 0"]


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("rel", ["manifest.msgpack", "arrays/0/zarr.json", "arrays/0/c/0/0", "blobs/p0-0.msgpack",
                                 "host/p0.msgpack"])
def test_a_fifo_in_a_files_place_is_damage_and_never_blocks_a_reader(ckdir, rel):
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"a": np.ones((1, 2 << 20), np.uint8), "b": np.ones(3)}, host_state={"pos": 1})
    path = os.path.join(ckdir, fmt.step_name(1), rel)
    os.remove(path)
    os.mkfifo(path)   # open() for reading waited forever for a writer (restore, host_state, verify, ls)
    r = cc.CheckpointManager(ckdir, read_only=True)
    got = []

    def read():
        try:
            r.host_state(1) if rel.startswith("host") else r.restore(1)
        except Exception as e:  # noqa: BLE001 - judged below
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():   # let the blocked reader go (a writer's open and close give it EOF)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"a reader of {rel} blocked on the FIFO")
    assert len(got) == 1 and isinstance(got[0], cc.CorruptCheckpointError), got
    from ckpt_callbacks.verify import verify_step
    assert verify_step(r.store, 1)   # reported, not waited on


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("damage", ["dir_is_file", "file_is_dir"])
def test_broken_chunk_tree_is_corruption_and_restore_falls_back(ckdir, damage):
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"w": np.full((400, 1000), s, np.float32)})   # one array leaf, one chunk file
    chunk_dir = os.path.join(ckdir, fmt.step_name(2), "arrays", "0", "c", "0")
    data = open(os.path.join(chunk_dir, "0"), "rb").read()
    if damage == "dir_is_file":   # a file with the chunk's bytes where its directory was
        shutil.rmtree(chunk_dir)
        open(chunk_dir, "wb").write(data)
    else:                         # a directory where the chunk file was
        os.remove(os.path.join(chunk_dir, "0"))
        os.mkdir(os.path.join(chunk_dir, "0"))
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\]"):
            m.restore(2)
        out = m.restore(fallback=True)
        assert m.restored_step == 1 and out["w"][0, 0] == 1


def test_committed_step_without_its_manifest_is_damage_and_falls_back(ckdir):
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"x": np.full(4, s)})
    os.remove(os.path.join(ckdir, fmt.step_name(2), fmt.MANIFEST))
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert m.all_steps() == [1, 2]
        with pytest.raises(cc.CorruptCheckpointError, match="step 2 is committed but unreadable"):
            m.restore()
        assert m.restore(fallback=True)["x"][0] == 1 and m.restored_step == 1


def _failing(real, needle: str, err: int):
    """`real` (an open function) raising OSError(`err`) for every path that contains `needle`."""
    def fn(path, *a, **k):
        if needle in str(path):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, *a, **k)
    return fn


def _falls_back_or_unavailable(ckdir, key: str, falls_back: bool, match: str):
    """restore(fallback=True) of `ckdir`, whose step 2 cannot be read: step 1 when step 2 is
    damaged; otherwise StorageUnavailableError matching `match`, and nothing restored."""
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        if falls_back:
            assert np.asarray(m.restore(fallback=True)[key]).flat[0] == 1 and m.restored_step == 1
        else:
            with pytest.raises(cc.StorageUnavailableError, match=match):
                m.restore(fallback=True)
            assert m.restored_step is None


@pytest.mark.parametrize("err,falls_back", [(errno.EACCES, False), (errno.ESTALE, False), (errno.ETIMEDOUT, False),
                                            (errno.EIO, True)])
@pytest.mark.usefixtures("zarr_above_1mib")
def test_unreadable_chunk_falls_back_only_when_the_data_is_bad(ckdir, monkeypatch, err, falls_back):
    """A permission, stale-handle or timeout error says nothing about the step: restore raises
    StorageUnavailableError and never quietly restores an older step. An I/O error (bad sectors) does."""
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"w": np.full((400, 1000), s, np.float32)})   # one array leaf, one chunk file
    chunk = os.path.join(fmt.step_name(2), "arrays", "0", "c", "")
    monkeypatch.setattr(os, "open", _failing(os.open, chunk, err))
    if falls_back:
        with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\]"):
            cc.CheckpointManager(ckdir, read_only=True).restore()
    _falls_back_or_unavailable(ckdir, "w", falls_back, r"\['w'\].*not known to be damaged")


@pytest.mark.parametrize("err,expected", [(errno.EACCES, cc.StorageUnavailableError),
                                          (errno.EIO, cc.CorruptCheckpointError)])
def test_unreadable_manifest_is_unavailable_storage_or_damage_by_its_errno(ckdir, monkeypatch, err, expected):
    from ckpt_callbacks import localfs
    with cc.CheckpointManager(ckdir) as m:
        for s in (1, 2):
            m.save(s, {"x": np.full(4, s)})

    monkeypatch.setattr(localfs, "open", _failing(open, os.path.join(fmt.step_name(2), fmt.MANIFEST), err),
                        raising=False)
    _falls_back_or_unavailable(ckdir, "x", expected is cc.CorruptCheckpointError, "step_0000000002")


@pytest.mark.parametrize("err,expected", [(errno.EACCES, cc.StorageUnavailableError),
                                          (errno.EIO, cc.CorruptCheckpointError)])
def test_unreadable_blob_is_unavailable_storage_or_damage_by_its_errno(ckdir, monkeypatch, err, expected):
    from ckpt_callbacks import restore as restore_mod
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"b": np.arange(10.0)})   # a small leaf: packed into a blob
    real = restore_mod.leaf_reader._read_aligned

    def failing(self, rel):
        if "blobs/" in rel:
            raise OSError(err, os.strerror(err), rel)
        return real(self, rel)

    monkeypatch.setattr(restore_mod.leaf_reader, "_read_aligned", failing)
    with pytest.raises(expected, match=r"\['b'\]"):
        cc.CheckpointManager(ckdir, read_only=True).restore()


@pytest.mark.parametrize("message,expected", [
    ("UNAVAILABLE: Failed to connect", cc.StorageUnavailableError),
    ("FAILED_PRECONDITION: Error reading \"c/0/0\": [OS error 116: Stale file handle]", cc.StorageUnavailableError),
    ("DATA_LOSS: Error reading \"c/0/0\": Digest mismatch", cc.CorruptCheckpointError),
])
def test_verify_tells_an_unreadable_chunk_from_a_damaged_one(message, expected):
    from ckpt_callbacks import verify

    class Failed:
        def result(self):
            raise ValueError(message)

    with pytest.raises(expected, match=r"\['w'\]"):
        verify._drain(((0, 0), (slice(0, 4), slice(0, 4)), Failed()), {"z": "arrays/0"}, "['w']", 4, None, str)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_array_without_its_crc32c_codec_is_never_read_unchecked(ckdir):
    import json
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"w": np.ones((400, 1000), np.float32)})
    zarr_json = os.path.join(ckdir, fmt.step_name(1), "arrays", "0", "zarr.json")
    meta = json.load(open(zarr_json))
    meta["codecs"] = [c for c in meta["codecs"] if c["name"] != "crc32c"]
    json.dump(meta, open(zarr_json, "w"))
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\].*has codecs .*; the format has little-endian bytes then crc32c"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
