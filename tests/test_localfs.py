"""What a local store asks of its file system: the file system's kind from the mounts, and the
directory stamps that spare a reused tree's unchanged directories their fsyncs."""

import os

from ckpt_callbacks import localfs


def test_the_file_system_under_a_directory_is_read_from_the_mounts(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_bytes(b"""/dev/vda / ext4 rw,discard 0 0
tmpfs /dev/shm tmpfs rw 0 0
broken-line-without-fields
/dev/vdb /data xfs rw 0 0
server:/x /data/nfs nfs4 rw 0 0
tmpfs /data/nfs tmpfs rw 0 0
/dev/vdc /data/my\\040disk ext4 rw 0 0
/dev/vdd /data/my xfs rw 0 0
""")
    kind = lambda p: localfs.fs_type(p, str(mounts))   # noqa: E731
    assert kind("/dev/shm/run") == "tmpfs" and kind("/dev/shmx/run") == "ext4"   # a prefix is not a parent
    assert kind("/data/ck/not yet") == "xfs" and kind("/data") == "xfs"
    assert kind("/data/nfs/ck") == "tmpfs"               # mounted over: the later entry
    assert kind("/data/my disk/ck") == "ext4" and kind("/data/my/ck") == "xfs"   # "\\040" is a space
    assert localfs.fs_type("/x", str(tmp_path / "none")) == ""


def test_a_directory_is_stamped_only_when_its_entries_last_changed_beyond_the_margin(tmp_path):
    """`publish` of a reused tree skips the fsync of a directory whose stamp is unchanged: only
    directories last changed long enough ago get a stamp (a clock tick could hide a change made
    in the same tick), and adding an entry changes the stamp."""
    import time
    top, sub = tmp_path / "step", tmp_path / "step" / "arrays"
    sub.mkdir(parents=True)
    (sub / "a").write_bytes(b"x")
    assert localfs.dir_stamps(str(top), [str(top), str(sub)]) == {}          # changed just now
    time.sleep(localfs.STAMP_MARGIN_NS / 1e9 + 0.05)
    stamps = localfs.dir_stamps(str(top), [str(top), str(sub)])
    assert list(stamps) == ["arrays"] and stamps["arrays"] == localfs.stamp(str(sub))
    (sub / "a").write_bytes(b"y")                     # a file's bytes: the directory is as it was
    assert localfs.stamp(str(sub)) == stamps["arrays"]
    (sub / "b").write_bytes(b"z")                     # a new entry
    assert localfs.stamp(str(sub)) != stamps["arrays"]
    os.unlink(sub / "b")
    assert localfs.stamp(str(sub)) != stamps["arrays"]
