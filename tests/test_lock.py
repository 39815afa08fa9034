"""The writer lock (lock.py): one writer per directory; a dead writer's lock is taken over, and a
writer killed at any moment of taking it never leaves the directory locked for good."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from ckpt_callbacks import lock
from ckpt_callbacks.errors import CheckpointError, CheckpointLockedError

HOLDER = r"""
import sys
from ckpt_callbacks import lock
print("ready", flush=True)
while True:        # take and give back the lock until killed
    lock.acquire(sys.argv[1])
    lock.release(sys.argv[1])
"""


def test_a_writer_killed_while_taking_the_lock_never_leaves_it_unreadable(tmp_path):
    d = str(tmp_path)
    rnd = random.Random(0)
    for _ in range(12):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, d], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.0, 0.2))
        p.send_signal(signal.SIGKILL)
        p.wait()
        path = os.path.join(d, lock.LOCK_NAME)
        if os.path.exists(path):   # whatever the kill left is a complete owner record
            with open(path) as f:
                assert json.load(f)["pid"] == p.pid
        t0 = time.monotonic()
        lock.acquire(d)            # taken over at once: its owner is dead
        assert time.monotonic() - t0 < lock._UNREADABLE_S
        lock.release(d)
        assert [n for n in os.listdir(d) if n.startswith(lock.LOCK_NAME)] == []   # no scratch files left


@pytest.mark.parametrize("content", [b"", b"{\"host\": ", b"[1, 2]"])
def test_a_lock_file_without_a_readable_owner_is_stale_once_it_was_last_written_2_s_ago(tmp_path, content):
    """As an older version's writer killed between creating the file and writing it left it."""
    d = str(tmp_path)
    path = os.path.join(d, lock.LOCK_NAME)
    with open(path, "wb") as f:
        f.write(content)
    os.utime(path, (time.time() - 60, time.time() - 60))
    t0 = time.monotonic()
    lock.acquire(d)                     # old: taken over at once
    assert time.monotonic() - t0 < 1.0
    lock.release(d)
    with open(path, "wb") as f:         # just written (an O_EXCL writer, on a file system without
        f.write(content)                # hard links, between creating and writing it): waited for
    t0 = time.monotonic()
    lock.acquire(d)
    assert lock._UNREADABLE_S - 0.1 <= time.monotonic() - t0 < lock._UNREADABLE_S + 5
    with open(path) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release(d)
    assert not os.path.exists(path)


@pytest.mark.parametrize("kill_at", ["link", "unlink"])
def test_a_writer_killed_at_either_side_of_linking_its_lock_leaves_none_or_a_whole_one(tmp_path, kill_at):
    d = str(tmp_path)
    code = (f"import os, signal, sys\nfrom ckpt_callbacks import lock\nreal = os.{kill_at}\n"
            f"def die(*a):\n    if os.path.basename(a[0]).startswith(lock.LOCK_NAME + '.new-'):\n"
            f"        os.kill(os.getpid(), signal.SIGKILL)\n    return real(*a)\n"
            f"os.{kill_at} = die\nlock.acquire(sys.argv[1])\n")
    p = subprocess.Popen([sys.executable, "-c", code, d])
    assert p.wait(timeout=120) == -signal.SIGKILL
    path = os.path.join(d, lock.LOCK_NAME)
    assert os.path.exists(path) == (kill_at == "unlink")
    if kill_at == "unlink":             # linked: whole, naming its (dead) owner
        with open(path) as f:
            assert json.load(f)["pid"] == p.pid
    t0 = time.monotonic()
    lock.acquire(d)                     # at once: no lock, or a dead owner's
    assert time.monotonic() - t0 < 1.0
    lock.release(d)
    assert [n for n in os.listdir(d) if n.startswith(lock.LOCK_NAME)] == []   # its scratch file swept


def test_a_live_owner_is_named_and_its_lock_kept(tmp_path):
    d = str(tmp_path)
    owner = {"host": socket.gethostname(), "pid": os.getppid(), "time": time.time()}   # alive
    with open(os.path.join(d, lock.LOCK_NAME), "w") as f:
        json.dump(owner, f)
    with pytest.raises(CheckpointLockedError, match=f"pid {os.getppid()}"):
        lock.acquire(d)
    with open(os.path.join(d, lock.LOCK_NAME)) as f:
        assert json.load(f) == owner


def test_a_lock_path_that_cannot_be_read_is_a_checkpoint_error_naming_it_and_is_left_alone(tmp_path):
    d = str(tmp_path)
    os.mkdir(os.path.join(d, lock.LOCK_NAME))   # a directory of the lock's name: raw IsADirectoryError before
    with pytest.raises(CheckpointError, match=f"cannot read the lock file {os.path.join(d, lock.LOCK_NAME)}"):
        lock.acquire(d)
    assert os.listdir(d) == [lock.LOCK_NAME] and os.path.isdir(os.path.join(d, lock.LOCK_NAME))


def test_a_take_over_removes_only_the_stale_lock_it_read(tmp_path):
    """Two processes found the same stale lock; one removed it and took the lock itself: the
    other's take-over must leave that new lock alone."""
    d = str(tmp_path)
    path = os.path.join(d, lock.LOCK_NAME)
    with open(path, "wb") as f:
        f.write(b'{"host": "h", "pid": 1}')   # the stale lock, as both read it
    st = os.stat(path)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(b'{"host": "h", "pid": 2}')   # the lock the first one took since
    lock._take_over(d, path, st, b'{"host": "h", "pid": 1}')
    with open(path, "rb") as f:
        assert f.read() == b'{"host": "h", "pid": 2}'
    lock._take_over(d, path, os.stat(path), b'{"host": "h", "pid": 2}')
    assert os.listdir(d) == []


def test_scratch_files_of_dead_processes_of_this_host_are_swept(tmp_path):
    d = str(tmp_path)
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = {f"{lock.LOCK_NAME}.new-{host}-{dead}-0a1b2c3d": False,     # removed
             f"{lock.LOCK_NAME}.new-{host}-{os.getppid()}-0a1b2c3d": True,   # its writer lives
             f"{lock.LOCK_NAME}.new-otherhost-{dead}-0a1b2c3d": True,    # another host's: unknown
             "notes.txt": True}
    for n in names:
        open(os.path.join(d, n), "w").close()
    lock.acquire(d)
    lock.release(d)
    assert sorted(os.listdir(d)) == sorted(n for n, kept in names.items() if kept)
