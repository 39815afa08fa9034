"""Multi-host for real: 2 and 4 `jax.distributed` processes on 127.0.0.1 (gloo CPU collectives).

Each launch costs a few seconds, so a launch runs several checks (tests/multihost_worker.py) and
module fixtures share them: one 2-process run (save, restore on two meshes, host state, retention,
start-up failure), one 4-process run (restore the 2-process checkpoint on 4x2, host-state remap,
save), and the pytest process itself (8 devices) restores them on 1x8 and 1x2. A process killed
mid-save, and the restart after it, are their own launches. Keras `fit` with AsyncCheckpoint
(tests/keras_multihost_worker.py) runs on 2 x 4 uninterrupted, cut and resumed, and resumes on 1 x 8.
"""

import collections
import itertools
import json
import math
import os
import shutil
import socket

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

import ckpt_callbacks as cc
import multihost_worker as W
from ckpt_callbacks import coordination, layout, snapshot
from ckpt_callbacks import format as fmt
from ckpt_callbacks.keras_state import flatten
from ckpt_callbacks.restore import read_manifest
from ckpt_callbacks.storage import open_store
from multiproc import launch


def _ok(results):
    results.raise_if_failed()
    return [r.result for r in results]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The 2 x 4 run. Before it, this (1-process) pytest process saves a checkpoint for it to restore."""
    root = tmp_path_factory.mktemp("two")
    one = str(root / "one_process")
    with cc.CheckpointManager(one, async_save=False) as m:
        m.save(3, W.make_tree(W.global_values(3), W.mesh((2, 4)), seed=3))
    locked = root / "locked"
    locked.mkdir()
    (locked / ".ckpt_callbacks.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "time": 0}))   # held by this live process
    res = _ok(launch("multihost_worker:save_and_check", 2, devices_per_process=4, timeout_s=240,
                     args={"root": str(root), "one_process_dir": one, "locked_dir": str(locked)}))
    return root, res


@pytest.fixture(scope="module")
def four(two):
    """The 4 x 2 run: restores the 2-process checkpoint, then saves its own."""
    root2, _ = two
    root = root2 / "four"
    res = _ok(launch("multihost_worker:restore_and_save", 4, devices_per_process=2, timeout_s=240,
                     args={"saved_dir": str(root2 / "tree"), "root": str(root)}))
    return root, res


def _balance(stats):
    written = [s["bytes_written"] for s in stats]
    return written, max(written) / (sum(written) / len(written))


def test_launcher_runs_real_distributed_processes_and_reports_errors():
    res = launch("multihost_worker:probe", 2, devices_per_process=3, args={"fail_on": 1}, timeout_s=120)
    assert res[0].ok and res[0].result == {"pi": 0, "pc": 2, "devices": 6, "local": 3, "collectives": "gloo"}
    assert not res[1].ok and res[1].error_type == "ValueError" and "process 1" in res[1].error
    with pytest.raises(AssertionError, match="failing on purpose"):
        res.raise_if_failed()


def test_two_processes_save_then_restore_bit_exact_on_same_and_other_mesh(two):
    _, res = two
    for r in res:
        assert r["steps"] == [10]
        assert r["restore_same"] == [] and r["restore_other"] == [] and r["host_numpy"] == []


def test_fallback_moves_every_process_together_and_never_on_unavailable_storage(two):
    _, res = two
    # step 2 is damaged only where process 1 reads: both processes restore step 1
    assert [(r["fallback_step"], r["fallback_ok"]) for r in res] == [(1, True), (1, True)]
    # process 1 cannot reach its storage: nobody falls back, and process 0 says who failed
    (n0, m0), (n1, m1) = res[0]["unavailable"], res[1]["unavailable"]
    assert n1 == "StorageUnavailableError" and "simulated outage" in m1
    assert n0 == "StorageUnavailableError" and "failed on process(es) [1]" in m0
    # process 0 cannot list the steps: both raise at once, and the next restore works on both
    assert [r["unlisted"][0] for r in res] == ["StorageUnavailableError"] * 2
    assert "simulated listing outage" in res[0]["unlisted"][1] and "on process 0 failed" in res[1]["unlisted"][1]
    assert [r["unlisted"][2] for r in res] == [True, True] and [r["after"] for r in res] == [1, 1]


def test_one_process_checkpoint_restores_onto_two_processes(two):
    _, res = two
    assert [r["from_one_process"] for r in res] == [[], []]


def test_each_replicated_byte_written_once_and_spread(two):
    root, res = two
    for key in ("tree_stats", "replicated_stats"):
        stats = [r[key] for r in res]
        assert [s["process_index"] for s in stats] == [0, 1]
        written, worst = _balance(stats)
        assert sum(written) == stats[0]["bytes_total"], (key, written)   # exactly one copy in total
        assert all(w > 0 for w in written) and worst <= 1.1, (key, written)
    m = read_manifest(open_store(str(root / "tree")), 10)
    assert m["process_count"] == 2 and m["host"] == {0: "host/p0.msgpack", 1: "host/p1.msgpack"}
    blob_writers = {rec["b"].split("/")[1].split("-")[0] for rec in m["leaves"] if rec["k"] == "packed"}
    assert blob_writers <= {"p0", "p1"}
    # every chunk's CRC is recorded, whichever process wrote it: each is the one its file ends with
    arrays = [rec for rec in m["leaves"] if rec["k"] == "array"]
    assert arrays and all(len(rec["cc"]) == layout.chunk_count(rec["sh"], rec["ch"]) for rec in arrays)
    step = root / "tree" / "step_0000000010"
    for rec in arrays:
        for idx in layout.chunks_of([(0, n) for n in rec["sh"]], rec["ch"]):
            tail = (step / rec["z"] / fmt.chunk_key(idx)).read_bytes()[-4:]
            assert int.from_bytes(tail, "little") == rec["cc"][layout.chunk_number(idx, rec["sh"], rec["ch"])]


def test_retention_runs_on_process_0_and_every_process_sees_the_same_steps(two):
    _, res = two
    assert [r["retained_steps"] for r in res] == [[3, 4], [3, 4]]
    assert [r["retained_deleted"] for r in res] == [[[], [], [1], [2]]] * 2
    assert [r["retained_x"] for r in res] == [[4] * 4] * 2


def test_host_state_is_saved_per_process(two):
    _, res = two
    assert [r["host_state"] for r in res] == [{"pos": 100, "proc": 0}, {"pos": 101, "proc": 1}]


def test_a_listing_outage_on_process_0_fails_that_save_on_every_process_and_the_next_works(two):
    # each process listing for itself would let one start a save the others skip, for good
    _, res = two
    for r in res:
        assert r["outage_save"][0] == "CheckpointSaveError" and "step 2 was not saved" in r["outage_save"][1], r
        assert r["outage_steps"] == [1, 3] and r["outage_next_s"] < 30, r


def test_a_call_one_process_refuses_fails_on_every_process_at_once_and_the_next_save_works(two):
    _, res = two
    p0, p1 = (r["refusal_errors"] for r in res)
    assert p1[0][0] == "ConfigError" and "host_state must be msgpack-able" in p1[0][1]
    assert p0[0][0] == "CheckpointSaveError" and "process(es) [1] refused the call" in p0[0][1], p0
    for errors in (p0, p1):   # process 0 saved step 3, process 1 step 4
        assert errors[1][0] == "CheckpointSaveError" and "different steps ({0: 3, 1: 4})" in errors[1][1]
        # different trees: committed, the step read as damaged (each process had written into the
        # other's arrays) and retention deleted the last intact one; now refused before anything starts
        assert errors[2][0] == "CheckpointSaveError" and "the processes passed different trees" in errors[2][1]
        assert "process 1 at leaf #0: ['extra']: packed float64[3]" in errors[2][1], errors[2][1]
        assert "process 0: ['w']:" in errors[2][1], errors[2][1]
    for r in res:
        assert r["refusal_s"] < 30 and r["refusal_steps"] == [1, 5, 6], r


def test_metrics_given_on_one_process_are_every_process_s_metrics(two):
    """Each process cached the metrics of its own call: best_step() and metrics() differed by process
    (and from the manifests); the Flax hook saved an eval step on process 0 alone."""
    _, res = two
    for r in res:
        assert r["refusal_metrics"] == [{"loss": 0.5}, {"loss": 0.25}, {}] and r["refusal_best"] == 5, r
        assert r["hook_started"] == [False, False, True, True, False, False, False, True], r
        assert r["hook_steps"] == [3, 4, 8], r


def test_a_restore_of_the_latest_step_that_fails_on_one_process_fails_or_retries_on_all(two):
    _, res = two
    for r in res:   # the step deleted while process 1 read it: every process lists and reads again
        assert r["deleted_restore"] == [W.LAYOUT["w"][0][0], 6, 2], r
    assert res[1]["damaged_restore"][0] == "CorruptCheckpointError" and "simulated damage" in res[1]["damaged_restore"][1]
    assert res[0]["damaged_restore"][0] == "CorruptCheckpointError" and "damaged on process(es) [1]" in res[0]["damaged_restore"][1]


def test_a_named_step_onto_arrays_that_span_the_processes_fails_on_every_process_or_on_none(two):
    """Damage that one process found in a named step made it raise while the other returned (and
    then waited in its next collective); so did a step listed on one process only."""
    _, res = two
    assert res[1]["named_damaged"][0] == "CorruptCheckpointError" and "simulated damage" in res[1]["named_damaged"][1]
    assert res[0]["named_damaged"][0] == "CorruptCheckpointError" and "damaged on process(es) [1]" in res[0]["named_damaged"][1]
    assert "Fix:" in res[0]["named_damaged"][1]
    assert [r["named_unlisted"][0] for r in res] == ["CheckpointNotFoundError"] * 2, res


def test_read_only_managers_restore_the_same_latest_step_on_every_process(two):
    """An eval job's read-only managers listed the steps on each process: a step committing in
    between gave process 0 step 1 and process 1 step 2, one array holding shards of both."""
    _, res = two
    for r in res:
        assert r["read_only_step"] == 1 and r["read_only_check"] == [], r


def test_start_up_failure_on_process_0_is_raised_on_every_process(two):
    _, res = two
    assert res[0]["locked"][0] == "CheckpointLockedError"
    assert res[1]["locked"][0] == "CheckpointError" and "process 0 could not open" in res[1]["locked"][1]


@pytest.mark.parametrize("shape", [(1, 8), (1, 2)])
def test_two_process_checkpoint_restores_in_one_process(two, shape):
    root, _ = two
    m = W.mesh(shape)
    target = W.abstract(m)
    with cc.CheckpointManager(str(root / "tree"), read_only=True) as mngr:
        out = mngr.restore(target=target)
        assert W.check(out, sharding_of={k: target[k].sharding for k in W.LAYOUT}) == []
        assert all(out[k].is_fully_addressable for k in W.LAYOUT)
        with pytest.raises(cc.IncompatibleCheckpointError, match="2 processes .* this run has 1"):
            mngr.host_state()
        assert mngr.host_state(remap={0: 1}) == {"pos": 101, "proc": 1}
        assert mngr.host_state(process_index=0) == {"pos": 100, "proc": 0}


def test_four_processes_restore_two_process_checkpoint_on_4x2(four):
    _, res = four
    assert [r["restore"] for r in res] == [[]] * 4


def test_each_process_reads_only_the_chunks_its_shards_need(four):
    """2 MB saved by 2 processes as two row-half chunks; on 4x2 each process needs a quarter of
    the rows, which lie in one chunk: it reads that chunk (1 MB, chunks are checksummed whole)."""
    _, res = four
    for r in res:
        assert r["sharded_ok"]
        assert (1 << 20) <= r["sharded_bytes_read"] < (1 << 20) + 4096, r["sharded_bytes_read"]


def test_host_state_on_another_process_count_needs_a_mapping(four):
    _, res = four
    for r in res:
        assert "2 processes [0, 1], but this run has 4 processes" in r["host_state_error"]
        assert "remap=" in r["host_state_error"]
    assert [r["host_state_remapped"]["pos"] for r in res] == [100, 101, 100, 101]
    assert [r["host_state_fn"] for r in res] == [{"pos": 201, "i": i, "n": 4} for i in range(4)]


def test_four_process_save_spreads_bytes_and_restores_in_one_process(four):
    root, res = four
    for key in ("tree_stats", "replicated_stats"):
        stats = [r[key] for r in res]
        written, worst = _balance(stats)
        assert sum(written) == stats[0]["bytes_total"] and worst <= 1.1, (key, written)
    for shape in ((1, 8), (2, 4)):
        target = W.abstract(W.mesh(shape))
        with cc.CheckpointManager(str(root / "tree"), read_only=True) as mngr:
            assert W.check(mngr.restore(target=target)) == []
            assert mngr.host_state(remap=lambda saved, i, n: sorted(s["pos"] for s in saved.values())) \
                == [200, 201, 202, 203]


def _die_then_resume(tmp_path, victim, phase="sync", nprocs=2):
    root = str(tmp_path / "ckpt")
    timeout_s = 20   # generous: a loaded 2-core CI machine must not time out the healthy phase
    died = launch("multihost_worker:die_mid_save", nprocs, devices_per_process=8 // nprocs, timeout_s=180,
                  args={"root": root, "victim": victim, "timeout_s": timeout_s, "phase": phase})
    assert died[victim].returncode == 17 and not died[victim].ok
    for r in died:
        if r.ok:   # an ordinary write error on the victim first: reported by every process, not committed
            assert list(r.result["write_error"]) == [str(victim)], r.result["write_error"]
            assert "OSError: injected write failure of " in r.result["write_error"][str(victim)]
            assert r.result["steps_after_write_error"] == [1]
    assert sorted(os.listdir(root)) != [] and "step_0000000002" not in os.listdir(root)
    assert open_store(root).committed_steps() == [1]
    resumed = _ok(launch("multihost_worker:resume", nprocs, devices_per_process=8 // nprocs, timeout_s=180,
                         args={"root": root}))
    for r in resumed:
        assert r["latest"] == 1 and r["leftovers"] == [] and r["restore"] == []
        assert r["host_state"] == {"pos": 1}
        assert r["steps"] == [1, 2] and r["restore2"] == []
    return died, timeout_s


def test_process_dies_mid_save_survivor_raises_nothing_committed_restart_resumes(tmp_path):
    died, timeout_s = _die_then_resume(tmp_path, victim=1)
    s = died[0]
    assert s.ok, s.describe()
    r = s.result
    assert r["error_type"] == "CoordinationTimeoutError" and "not committed" in r["error"]   # a CheckpointSaveError
    assert f"within {timeout_s}s" in r["error"] and "process 1" in r["error"]
    assert "died or stuck" in r["failures"]["1"]
    assert r["steps"] == [1] and r["latest"] == 1
    print(f"survivor raised after {r['elapsed_s']:.1f}s (timeout_s={timeout_s})")


@pytest.mark.slow
def test_process_dies_before_first_barrier(tmp_path):
    died, _ = _die_then_resume(tmp_path, victim=1, phase="start")
    r = died[0].result
    assert died[0].ok and r["error_type"] == "CoordinationTimeoutError", died[0].describe()
    assert "died or stuck" in r["failures"]["1"] and "silent: process 1" in r["error"]   # named at the barrier
    assert r["steps"] == [1]


@pytest.mark.slow
def test_coordinator_process_dies_mid_save(tmp_path):
    """Process 0 hosts JAX's coordination service: when it dies, JAX terminates the others itself
    (fail-fast) -- unless a survivor's save fails first on the lost connection and it gets to
    report that. Nothing is committed, and the restart resumes from the previous step."""
    died, _ = _die_then_resume(tmp_path, victim=0)
    s = died[1]
    if s.ok:   # it raced JAX's fail-fast: its save must have raised (nothing committed: checked above)
        assert s.result["error_type"] in ("CheckpointSaveError", "CoordinationTimeoutError"), s.result
        assert s.result["steps"] == [1], s.result


@pytest.mark.slow
def test_one_of_four_processes_dies_mid_save(tmp_path):
    died, _ = _die_then_resume(tmp_path, victim=2, nprocs=4)
    for i in (0, 1, 3):
        assert died[i].ok and died[i].result["error_type"] == "CoordinationTimeoutError", died[i].describe()
        assert died[i].result["steps"] == [1]


def test_single_process_coordination_is_a_no_op():
    c = coordination.current()
    assert isinstance(c, coordination.SingleProcess) and c.process_count == 1 == jax.process_count()
    assert coordination.for_directory(c, "/x") is c and c.scoped("a") is c
    assert c.all_gather("g", b"x", 1) == [b"x"] and c.broadcast("b", b"y", 1) == b"y"


def test_coordination_failures_say_whether_a_wait_timed_out_or_the_service_is_gone():
    class Refusing:   # what the jax.distributed client raises (the service's status first)
        def __init__(self, said):
            self.said = said

        def wait_at_barrier(self, key, ms):
            raise RuntimeError(self.said)

        blocking_key_value_get_bytes = wait_at_barrier

        def key_value_set_bytes(self, key, data):
            raise RuntimeError(self.said)

        key_value_dir_get_bytes = wait_at_barrier

    gone = coordination.JaxDistributed(Refusing("UNAVAILABLE: failed to connect to all addresses"), 1, 2)
    with pytest.raises(coordination.CoordinationTimeoutError, match="service .* is gone or refused it") as e:
        gone.barrier("b", 60)
    assert "within 60s" not in str(e.value) and "UNAVAILABLE" in str(e.value)
    with pytest.raises(coordination.CoordinationTimeoutError, match="publishing 'g/1' failed: the coordination"):
        gone.all_gather("g", b"x", 60)
    late = coordination.JaxDistributed(Refusing("DEADLINE_EXCEEDED: Barrier timed out"), 1, 2)
    with pytest.raises(coordination.CoordinationTimeoutError, match="did not complete within 60s") as e:
        late.broadcast("t", None, 60)
    assert "died or stuck" in e.value.failures[0]


def test_a_barrier_that_times_out_names_the_processes_that_never_came():
    class Store:   # process 1 of 4; processes 0 and 1 came, 2 and 3 never did
        def __init__(self):
            self.kv = {"ns/meta/7/at/0": b""}

        def key_value_set_bytes(self, key, data):
            self.kv[key] = data

        def wait_at_barrier(self, key, ms):
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Check the task logs.")

        def key_value_dir_get_bytes(self, prefix):
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    c = coordination.JaxDistributed(Store(), 1, 4, "ns")
    with pytest.raises(coordination.CoordinationTimeoutError, match=r"within 30s \(silent: process 2, 3\)") as e:
        c.barrier("meta/7", 30)
    assert sorted(e.value.failures) == [1, 2, 3] and "died or stuck" in e.value.failures[3]
    assert isinstance(e.value, cc.CheckpointSaveError)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.integers(1, 4)), min_size=0, max_size=3))
def test_replicated_shard_pieces_tile_the_shard_exactly(dims):
    """The pieces a replicated shard is split into are chunk-aligned, disjoint and cover it."""
    box = tuple((a, a + n * k) for a, n, k in dims)       # extent n*k: chunk k divides it
    chunk = [k for _, _, k in dims]
    pieces = snapshot._pieces(box, chunk)
    cells = collections.Counter()
    for p in pieces:
        assert all(a0 <= lo < hi <= a1 and (lo - a0) % c == 0 and hi - lo == c
                   for (lo, hi), (a0, a1), c in zip(p, box, chunk))
        cells.update(itertools.product(*[range(lo, hi) for lo, hi in p]))
    assert set(cells.values()) <= {1}
    assert len(cells) == math.prod(b - a for a, b in box)


@pytest.fixture(scope="module")
def keras_run(tmp_path_factory):
    """Keras `fit` with AsyncCheckpoint on 2 x 4 (ModelParallel, the kernel's halves on different
    processes): one run uninterrupted, one whose processes all leave mid-epoch and a fresh launch
    resumes it."""
    pytest.importorskip("keras")
    root = tmp_path_factory.mktemp("keras")
    whole = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                       args={"root": str(root / "whole"), "epochs": 2}))
    died = launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                  args={"root": str(root / "cut"), "epochs": 2, "exit_at": 13})
    assert [r.returncode for r in died] == [17, 17], [r.describe() for r in died]
    resumed = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                         args={"root": str(root / "cut"), "epochs": 2}))
    return root, whole, resumed


def test_keras_fit_on_two_processes_resumes_bit_exact_and_writes_each_byte_once(keras_run):
    root, whole, resumed = keras_run
    assert whole[0]["error_type"] is None and whole[0]["kernel"] == [None, "model"]
    # one state on every process; each process wrote its own shards, every replicated byte once
    assert len({r["digest"] for r in whole}) == 1
    assert sum(r["bytes_written"] for r in whole) == whole[0]["bytes_total"] and all(r["bytes_written"] for r in whole)
    assert open_store(str(root / "whole")).committed_steps() == whole[0]["steps"] == [8, 14, 16]   # keep_last=2, best 8
    assert [r["best"] for r in whole] == [8, 8]
    # all processes left at batch 13 (step 11 committed): a fresh launch goes on from the next unseen batch
    assert [(r["resumed"], r["steps"]) for r in resumed] == [(11, [8, 14, 16])] * 2
    assert [r["digest"] for r in resumed] == [whole[0]["digest"]] * 2


def test_keras_sigterm_on_one_of_two_processes_saves_the_same_step_on_both_and_the_rerun_resumes_exactly(
        keras_run, tmp_path):
    """Process 1 alone is signalled at the begin of batch 5 (after the callback's hook there): at
    the next boundary every process learns of it (they agree at each one), all save step 5 (not a
    save_freq=3 step) and stop; the same fit() run again resumes from it and ends with the weights
    of the uninterrupted run."""
    _, whole, _ = keras_run
    root = str(tmp_path / "preempted")
    cut = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                     args={"root": root, "epochs": 2, "sigterm_1_at": 5}))
    assert [(r["error_type"], r["preempted"], r["steps"]) for r in cut] == [(None, [True, 5], [3, 5])] * 2
    assert [r["iterations"] for r in cut] == [6, 6]   # the batch begun after the save ran; not saved
    assert [r["agreement_keys"] for r in cut] == [2, 2]   # the last agreement's, one per process: no more
    resumed = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                         args={"root": root, "epochs": 2}))
    assert [(r["resumed"], r["preempted"], r["digest"]) for r in resumed] == [(5, [False, None], whole[0]["digest"])] * 2


def test_keras_two_process_checkpoint_resumes_on_one_process_and_on_data_parallel(keras_run):
    root, whole, _ = keras_run
    for kind in ("mp", "dp"):   # (1, 8) ModelParallel and 8-way DataParallel: resharded, nothing left to train
        (r,) = _ok(launch("keras_multihost_worker:fit", 1, devices_per_process=8, timeout_s=180,
                          args={"root": str(root / "whole"), "epochs": 2, "kind": kind}))
        assert (r["resumed"], r["digest"]) == (16, whole[0]["digest"]), kind


def test_keras_load_weights_on_two_processes_and_on_one_gives_the_saved_weights(keras_run):
    """`keras.load_weights` into a model under ModelParallel whose kernel spans the two processes
    (each restores its own half), and into one process's 8-way DataParallel model."""
    root, whole, _ = keras_run
    with cc.CheckpointManager(str(root / "whole"), read_only=True) as m:
        saved = m.restore(16)["model"]
    want = {**flatten(saved["trainable_variables"]), **flatten(saved["non_trainable_variables"])}
    two = _ok(launch("keras_multihost_worker:load", 2, devices_per_process=4, timeout_s=180,
                     args={"root": str(root / "whole")}))
    (one,) = _ok(launch("keras_multihost_worker:load", 1, devices_per_process=8, timeout_s=180,
                        args={"root": str(root / "whole"), "kind": "dp"}))
    assert two[0]["kernel"] == [None, "model"]
    for r in two + [one]:
        assert r["step"] == 16 and set(r["values"]) == set(want)
        for path, value in r["values"].items():
            np.testing.assert_array_equal(np.asarray(value, want[path].dtype), want[path], err_msg=path)


def test_keras_resume_onto_a_damaged_host_state_of_one_process_fails_on_every_process(keras_run, tmp_path):
    """Only process 1 reads host/p1.msgpack: were it alone to raise, process 0 would train on into
    Keras' first collective with a process that is gone (a hang, or a gloo error)."""
    import shutil
    root, _, _ = keras_run
    run = tmp_path / "run"
    shutil.copytree(root / "whole", run)
    blob = run / "step_0000000016" / "host" / "p1.msgpack"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    res = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                     args={"root": str(run), "epochs": 3}))
    assert [r["error_type"] for r in res] == ["CorruptCheckpointError"] * 2, res
    assert "host/p1.msgpack" in res[1]["error"] and "process(es) [1]" in res[0]["error"]
    assert "step 16" in res[0]["error"] and "fallback=True" in res[0]["error"]


def test_keras_batches_over_an_iterator_whose_host_state_is_damaged_on_one_process_fail_on_every_process(tmp_path):
    """cb.batches() positions each process's iterator before fit() reads from it: were process 1
    alone to raise there, process 0 would wait in Keras' collective over the first batches."""
    pytest.importorskip("keras")
    run = tmp_path / "run"
    args = {"root": str(run), "epochs": 1, "save_freq": "epoch", "iterator": True}
    assert [r["steps"] for r in _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4,
                                           timeout_s=180, args=args))] == [[8], [8]]
    blob = run / "step_0000000008" / "host" / "p1.msgpack"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    res = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                     args=dict(args, epochs=2)))
    assert [r["error_type"] for r in res] == ["CorruptCheckpointError"] * 2, res
    assert "host/p1.msgpack" in res[1]["error"] and "process(es) [1]" in res[0]["error"]


def test_keras_survivor_of_a_process_that_died_before_the_epoch_end_save_raises_within_timeout_s(tmp_path):
    """AsyncCheckpoint(timeout_s=...) reaches the manager: the survivor's save raises a
    CheckpointSaveError within it (with the default 600 s, JAX's heartbeat ends it first, silently)."""
    pytest.importorskip("keras")
    res = launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                 args={"root": str(tmp_path / "run"), "epochs": 2, "exit_on_epoch_end": 1, "timeout_s": 4})
    assert res[1].returncode == 17 and res[0].ok, res[0].describe()
    r = res[0].result
    assert r["error_type"] == "CoordinationTimeoutError" and "within 4s" in r["error"], r
    assert "silent: process 1" in r["error"]


def test_flax_resume_onto_a_damaged_host_state_of_one_process_fails_on_every_process(tmp_path):
    """As for Keras: only process 1 reads host/p1.msgpack; process 0's restore_or_init returned
    while process 1's raised, and process 0 would have trained on into a collective with it."""
    res = _ok(launch("multihost_worker:flax_damaged_host_state", 2, devices_per_process=4, timeout_s=180,
                     args={"root": str(tmp_path / "run")}))
    assert [r["error"] and r["error"][0] for r in res] == ["CorruptCheckpointError"] * 2, res
    assert "host/p1.msgpack" in res[1]["error"][1] and "process(es) [1]" in res[0]["error"][1]


def test_keras_iterator_whose_get_state_fails_on_one_process_fails_that_save_on_every_process(tmp_path):
    """Process 1's data.get_state() raised alone, before its save's agreement: process 0 waited
    there for timeout_s (JAX's heartbeat ends it first with the defaults, raising nothing)."""
    pytest.importorskip("keras")
    res = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180,
                     args={"root": str(tmp_path / "run"), "epochs": 1, "save_freq": 3, "iterator": True,
                           "timeout_s": 20, "fail_get_state_on_1": 2}))
    assert [r["error_type"] for r in res] == ["CheckpointSaveError", "RuntimeError"], res
    assert "process(es) [1] refused the call" in res[0]["error"] and "get_state failed" in res[0]["error"], res
    assert res[0]["steps"] == res[1]["steps"] == [3], res


def test_keras_iterator_positions_of_two_processes_resume_on_one_process_only_through_data_remap(tmp_path):
    """Saved by 2 processes, resumed by 1: which saved position the iterator continues from is not
    known, so fit() raises before training, nothing lost (it took neither, with a warning, and the
    pipeline restarted); `data_remap` says it, as a dict or a function."""
    pytest.importorskip("keras")
    import ckpt_callbacks as cc

    run = tmp_path / "run"
    args = {"root": str(run), "epochs": 1, "save_freq": "epoch", "iterator": True, "offset_iterators": True,
            "kind": "dp"}   # (each process feeds its own part of the batch)
    saved = _ok(launch("keras_multihost_worker:fit", 2, devices_per_process=4, timeout_s=180, args=args))
    assert [r["steps"] for r in saved] == [[8], [8]], saved

    def one(**kw):   # on a copy of the 2-process run
        root = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(run, root)
        (r,) = _ok(launch("keras_multihost_worker:fit", 1, devices_per_process=8, timeout_s=180,
                          args=dict(args, root=str(root), epochs=2, **kw)))
        return r

    r = one()
    assert r["error_type"] == "IncompatibleCheckpointError", r
    assert "saved by 2 processes" in r["error"] and "data_remap" in r["error"], r
    with cc.CheckpointManager(tmp_path / "copy1", read_only=True) as m:
        assert m.all_steps() == [8] and m.host_state(8, process_index=1) is not None
    by_dict, by_fn = one(data_remap={"0": 0}), one(remap_to=1)
    assert by_dict["error_type"] is None and by_fn["error_type"] is None, (by_dict, by_fn)
    assert by_dict["resumed"] == by_fn["resumed"] == 8 and by_fn["steps"] == [8, 16], (by_dict, by_fn)
    # one more epoch of 8 batches from where process 0 / process 1 stood (1 started 100 further)
    assert by_dict["data_pos"] == saved[0]["data_pos"] + 8, (saved, by_dict)
    assert by_fn["data_pos"] == saved[1]["data_pos"] + 8, (saved, by_fn)
