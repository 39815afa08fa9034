"""Crash consistency: a saving process killed with SIGKILL at random moments never leaves a
torn, unlisted-but-visible or lost checkpoint (DESIGN.md §3)."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import format as fmt
from crash_worker import content
from helpers import assert_tree_equal

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")


def run_trials(d, trials, seed, max_delay=1.2, extra=()):
    rnd = random.Random(seed)
    latest_seen = None
    kills = 0
    for t in range(trials):
        p = subprocess.Popen([sys.executable, WORKER, d, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
        line = p.stdout.readline()
        if line.strip() != "ready":
            p.kill()
            raise AssertionError(f"worker failed to start: {line!r} {p.stderr.read()[-3000:]}")
        time.sleep(rnd.uniform(0, max_delay))
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        latest_seen = check(d, latest_seen)
    return kills, latest_seen


def check(d, latest_before):
    """Every listed step restores bit-exactly; the latest never goes backwards; no staging listed."""
    m = cc.CheckpointManager(d, read_only=True)
    steps = m.all_steps()
    assert steps, "no committed step"
    assert all(fmt.parse_step_name(fmt.step_name(s)) == s for s in steps)
    if latest_before is not None:
        assert steps[-1] >= latest_before, (steps, latest_before)
    for s in steps:
        out = m.restore(s)
        assert_tree_equal(out, content(s))
    return steps[-1]


def test_sigkill_during_saves_30_trials(tmp_path):
    d = str(tmp_path / "ck")
    kills, latest = run_trials(d, 30, seed=0)
    assert kills == 30
    # the next start cleans what the kills left behind, and only that
    open(os.path.join(d, "notes.txt"), "w").write("mine")
    with cc.CheckpointManager(d) as m:
        assert m.latest_step() == latest
    names = os.listdir(d)
    assert not [n for n in names if ".tmp-" in n or ".del-" in n], names
    assert "notes.txt" in names


@pytest.mark.slow
def test_sigkill_during_saves_200_trials(tmp_path):
    d = str(tmp_path / "ck")
    kills, _ = run_trials(d, 100, seed=1)
    kills2, _ = run_trials(d, 100, seed=2, extra=("--sync", "--keep", "1"))
    assert kills + kills2 == 200
