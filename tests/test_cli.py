"""`ckpt-callbacks` subcommands on real checkpoints written by CheckpointManager."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks import cli, snapshot
from ckpt_callbacks.storage import open_store

STEPS = [10, 20, 30, 40]
LOSS = {10: 0.9, 20: 0.2, 30: 0.5, 40: 0.7}   # best by min: 20; by max: 10 (of kept steps)


def make_tree(step, devices):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
    w = jax.device_put(jnp.arange(512 * 1024, dtype=jnp.float32).reshape(512, 1024) + step,
                       NamedSharding(mesh, P("data", "model")))
    return {"params": {"w": w, "b": np.full(7, step, np.float32)}, "step": step,
            "rng": jax.random.key(step), "note": None}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, devices):
    d = str(tmp_path_factory.mktemp("cli") / "run")
    with pytest.MonkeyPatch.context() as mp:   # "w" (2 MiB) a zarr array: see conftest.zarr_above_1mib
        mp.setattr(snapshot, "PACK_MAX_BYTES", 1 << 20)
        with cc.CheckpointManager(d, retention=[cc.KeepLast(3), cc.KeepBest("val_loss", "min", 1)]) as m:
            for s in STEPS:
                m.save(s, make_tree(s, devices), metrics={"val_loss": LOSS[s]})
            m.wait_until_finished()
            assert m.all_steps() == [20, 30, 40]
    return d


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        cli_out = sys.stdout
        sys.stdout = out
        try:
            rc = cli.main(list(argv))
        finally:
            sys.stdout = cli_out
    finally:
        sys.stderr = old
    return rc, out.getvalue(), err.getvalue()


def tree_digest(d):
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(d)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, d).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_ls_lists_steps_metrics_and_marks_the_recorded_best(ckpt):
    rc, out, _ = run("ls", ckpt)
    assert rc == 0
    lines = {int(line.split()[0]): line for line in out.splitlines()[2:] if line.split() and line.split()[0].isdigit()}
    assert sorted(lines) == [20, 30, 40]
    assert "* best" in lines[20] and "* best" not in lines[30] + lines[40]
    assert "val_loss=0.2" in lines[20] and "committed" in lines[30]
    assert "best by val_loss (min, from the run's KeepBest): 20" in out


def test_ls_quotes_a_str_metric_so_it_never_reads_as_a_number(tmp_path, capsys):
    d = str(tmp_path / "run")
    with cc.CheckpointManager(d) as m:
        m.save(1, {"w": np.ones(2)}, metrics={"val_loss": "0.1", "note": "warm-up"})
        m.save(2, {"w": np.ones(2)}, metrics={"val_loss": 0.5})
    rc, out, _ = run("ls", d, "--best", "val_loss:min")
    assert rc == 0 and "val_loss='0.1'" in out and "note='warm-up'" in out and "val_loss=0.5" in out
    assert "best by val_loss (min, from --best): 2" in out


def test_ls_best_flag_overrides_and_json(ckpt):
    rc, out, _ = run("ls", ckpt, "--best", "val_loss:max", "--json")
    assert rc == 0
    data = json.loads(out)
    assert [r["step"] for r in data["steps"]] == [20, 30, 40]
    assert [r["step"] for r in data["steps"] if r["best"]] == [40]
    assert data["best"] == {"step": 40, "metric": "val_loss", "mode": "max", "n": 1, "source": "--best"}
    sizes = {r["step"]: r["size"] for r in data["steps"]}
    assert all(sizes[s] > 512 * 1024 * 4 for s in sizes)   # on-disk size includes the array
    assert data["partial"] == []


def test_ls_shows_partial_leftover(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    # what a save killed before its commit leaves: a staging directory without a manifest
    staging = os.path.join(d, "step_0000000050.tmp-0123456789ab")
    shutil.copytree(os.path.join(d, "step_0000000040"), staging)
    os.remove(os.path.join(staging, "manifest.msgpack"))
    rc, out, _ = run("ls", d)
    assert rc == 0 and "1 partial" in out and "step_0000000050.tmp-0123456789ab" in out
    assert open_store(d).committed_steps() == [20, 30, 40]
    rc, out, _ = run("ls", d, "--json")   # the same keys as a recoverable or stale entry (was: no "step")
    assert rc == 0 and json.loads(out)["partial"] == [
        {"name": "step_0000000050.tmp-0123456789ab", "status": "partial", "step": 50}]


def test_ls_tells_a_deleted_step_left_over_from_a_save_in_flight(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    # what retention's delete leaves while its removal runs, is interrupted, or its files are kept
    # for the trainer's next save to write over: the step directory renamed to `.del-`
    os.rename(os.path.join(d, "step_0000000020"), os.path.join(d, "step_0000000020.del-0123456789ab"))
    rc, out, _ = run("ls", d)
    line = next(x for x in out.splitlines() if "step_0000000020.del-0123456789ab" in x)
    # was: "(staging of a save that is running or was interrupted; ...)", of a step retention deleted
    assert rc == 0 and "a step deleted by retention" in line and "staging" not in line
    # the copy a forced replacement moved aside and did not get to remove (step 40 itself is there)
    shutil.copytree(os.path.join(d, "step_0000000040"), os.path.join(d, "step_0000000040.old-0123456789ab"))
    rc, out, _ = run("ls", d)
    line = next(x for x in out.splitlines() if "step_0000000040.old-0123456789ab" in x)
    assert rc == 0 and "the previous copy of step 40, which a forced save replaced" in line and "staging" not in line


def test_inspect_shows_paths_shapes_dtypes_shardings_bytes(ckpt):
    rc, out, _ = run("inspect", ckpt, "--step", "30")
    assert rc == 0
    assert "step 30" in out and "val_loss=0.5" in out
    assert "['w']: float32[512, 1024]  2.1 MB  NamedSharding(mesh[data=4,model=2], P(data, model))" in out
    assert "['b']: float32[7]  28 B" in out
    assert "['rng']: key<threefry2x32>[]" in out
    assert "['step']: int = 30" in out and "['note']: None" in out
    rc, out, _ = run("inspect", ckpt, "--json")
    data = json.loads(out)
    assert data["step"] == 40
    leaves = {leaf["path"]: leaf for leaf in data["leaves"]}
    assert leaves["['params']['w']"]["bytes"] == 512 * 1024 * 4
    assert leaves["['params']['w']"]["sharding"]["spec"] == ["data", "model"]
    assert leaves["['params']['w']"]["file"].startswith("arrays/") and leaves["['params']['w']"]["chunks"]
    assert leaves["['rng']"]["prng"] == "threefry2x32" and leaves["['rng']"]["key_shape"] == []
    assert leaves["['rng']"]["shape"] == [2] and leaves["['params']['b']"]["file"].startswith("blobs/")
    assert (leaves["['step']"]["type"], leaves["['step']"]["value"]) == ("int", 40)
    assert leaves["['note']"]["kind"] == "none"


def test_inspect_unknown_step_names_committed_steps(ckpt):
    rc, _, err = run("inspect", ckpt, "--step", "10")
    assert rc == 1 and "step 10 is not committed" in err and "[20, 30, 40]" in err


def test_verify_intact_checkpoint_with_progress_bar(ckpt):
    rc, out, err = run("verify", ckpt, "--all")
    assert rc == 0
    assert out.splitlines() == ["step 20: ok", "step 30: ok", "step 40: ok"]
    assert "verify [" in err and "100.0%" in err


@pytest.mark.parametrize("flags", [[], ["--all"]])
def test_verify_of_a_directory_without_a_committed_step_fails(tmp_path, flags):
    # with --all too: nothing read is not "all ok" (a mistyped object-store prefix lists nothing)
    (tmp_path / "empty").mkdir()
    rc, out, err = run("verify", str(tmp_path / "empty"), *flags)
    assert rc == 1 and "no committed checkpoint" in err and out == "", (rc, out, err)


def _chunk_files(step_dir):
    arrays = os.path.join(step_dir, "arrays")
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(arrays) for f in fs if f != "zarr.json")


def test_verify_catches_a_corrupted_chunk_and_a_damaged_blob(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    chunks = _chunk_files(os.path.join(d, "step_0000000030"))
    assert len(chunks) == 8   # one chunk per shard of the 4x2 sharding
    with open(chunks[3], "r+b") as f:   # flip one byte of array data
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    blob = os.path.join(d, "step_0000000040", "blobs", "p0-0.msgpack")
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF   # the last packed entry's bytes
    open(blob, "wb").write(bytes(data))
    rc, out, _ = run("verify", d, "--all", "--quiet")
    assert rc == 1
    assert "step 20: ok" in out
    assert "step 30: DAMAGED, 1 leaf/leaves:" in out and "['params']['w']: " in out
    assert "step 40: DAMAGED" in out
    assert "2 of 3 step(s) damaged" in out
    # the same damage is what a restore reports
    with pytest.raises(cc.CorruptCheckpointError):
        cc.CheckpointManager(d, read_only=True).restore(30)
    rc, out, _ = run("verify", d, "--step", "20", "--quiet")
    assert rc == 0 and out.strip() == "step 20: ok"


@pytest.mark.parametrize("what", ["manifest", "chunk"])
def test_ls_lists_a_step_holding_a_dangling_symlink_and_verify_reports_it(ckpt, tmp_path, what):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    step = os.path.join(d, "step_0000000040")
    f = os.path.join(step, "manifest.msgpack") if what == "manifest" else _chunk_files(step)[0]
    os.remove(f)
    os.symlink(os.path.join(d, "gone"), f)   # ls failed for the whole directory (FileNotFoundError)
    rc, out, err = run("ls", d, "--json")
    assert rc == 0, err
    status = {r["step"]: r["status"] for r in json.loads(out)["steps"]}
    assert status == {20: "committed", 30: "committed", 40: "damaged" if what == "manifest" else "committed"}
    rc, out, _ = run("verify", d, "--quiet")
    assert rc == 1 and "step 40: DAMAGED" in out


def test_a_step_retention_deletes_while_verify_reads_it_is_not_reported_damaged(ckpt, tmp_path, monkeypatch):
    from ckpt_callbacks import verify
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    real = verify.read_manifest

    def read_then_retention_deletes(store, step):   # a trainer's KeepLast hides the step meanwhile
        m = real(store, step)
        os.rename(os.path.join(d, "step_0000000040"), os.path.join(d, "step_0000000040.del-0123456789ab"))
        return m

    monkeypatch.setattr(verify, "read_manifest", read_then_retention_deletes)
    rc, out, _ = run("verify", d, "--quiet")   # was: "step 40: DAMAGED" (its blob and chunks missing), exit 1
    assert rc == 0 and "step 40: deleted while it was being verified" in out and "DAMAGED" not in out


def test_steps_a_live_trainer_deletes_after_verify_all_listed_them_are_not_reported_damaged(
        ckpt, tmp_path, monkeypatch, devices):
    from ckpt_callbacks import verify
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    real, trained = verify.read_manifest, []

    def trainer_saves_meanwhile(store, step):   # while verify reads step 20, the trainer saves 50
        if not trained:
            trained.append(1)
            with cc.CheckpointManager(d, retention=cc.KeepSteps([20])) as m:   # its retention deletes 30, 40
                m.save(50, make_tree(50, devices))
        return real(store, step)

    monkeypatch.setattr(verify, "read_manifest", trainer_saves_meanwhile)
    rc, out, _ = run("verify", d, "--all", "--quiet")   # was: 30 and 40 DAMAGED ("manifest ... does not exist"), exit 1
    assert out.splitlines() == ["step 20: ok"] + [
        f"step {s}: deleted while it was being verified (by a writer's retention, or a forced save of it); "
        f"not damaged" for s in (30, 40)]
    assert rc == 0
    with pytest.raises(cc.CheckpointNotFoundError, match="not committed"):
        verify.verify_step(open_store(d), 30)


def test_verify_catches_a_missing_chunk(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    os.remove(_chunk_files(os.path.join(d, "step_0000000040"))[0])
    rc, out, _ = run("verify", d, "--quiet")
    assert rc == 1 and "step 40: DAMAGED" in out and "['params']['w']" in out


def test_verify_names_the_missing_and_truncated_chunk_files(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    step = os.path.join(d, "step_0000000040")
    files = _chunk_files(step)
    os.remove(files[1])
    size = os.path.getsize(files[5])
    os.truncate(files[5], 100)   # a full disk
    rc, out, _ = run("verify", d, "--quiet")
    rel = [os.path.relpath(f, os.path.dirname(os.path.dirname(os.path.dirname(files[0])))) for f in (files[1], files[5])]
    # was: "... declares [512, 1024] (8 chunks, ...) but holds 7 chunk files (...)", naming no file
    assert rc == 1 and "step 40: DAMAGED" in out and "['params']['w']" in out
    assert f"{rel[0]} missing" in out and f"{rel[1]} 100 of {size} bytes" in out, out


def test_json_output_is_strict_json_with_nan_and_infinite_metrics(tmp_path):
    d = str(tmp_path / "run")
    with cc.CheckpointManager(d, async_save=False) as m:
        m.save(1, {"a": np.ones(3)}, metrics={"loss": float("nan"), "lo": float("-inf"), "ok": 0.5})

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))

    rc, out, _ = run("ls", d, "--json")
    assert rc == 0 and strict(out)["steps"][0]["metrics"] == {"loss": "NaN", "lo": "-Infinity", "ok": 0.5}
    rc, out, _ = run("inspect", d, "--json")
    assert rc == 0 and strict(out)["metrics"]["loss"] == "NaN"


def test_verify_catches_bytes_appended_to_a_chunk_as_restore_does(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    with open(_chunk_files(os.path.join(d, "step_0000000040"))[2], "ab") as f:
        f.write(b"\0" * 4)   # tensorstore's own reads take such a file
    rc, out, _ = run("verify", d, "--quiet")
    assert rc == 1 and "step 40: DAMAGED" in out and "expected" in out
    with pytest.raises(cc.CorruptCheckpointError, match="bytes, expected"):
        cc.CheckpointManager(d, read_only=True).restore(40)


@pytest.mark.usefixtures("zarr_above_1mib")
def test_an_outage_is_never_reported_as_damage_by_ls_or_verify(ckpt, monkeypatch):
    from ckpt_callbacks import restore as restore_mod
    real_array, real_manifest = restore_mod.leaf_reader.array, restore_mod.read_manifest

    def array(self, rec, *a, **k):   # step 30's arrays cannot be reached
        if self.step == 30:
            raise cc.StorageUnavailableError("['params']['w']: reading arrays/0 failed: the storage could not be "
                                             "reached (simulated)")
        return real_array(self, rec, *a, **k)

    monkeypatch.setattr(restore_mod.leaf_reader, "array", array)
    rc, out, err = run("verify", ckpt, "--all", "--quiet")
    assert rc == 1 and "StorageUnavailableError" in err and "DAMAGED" not in out
    assert out.splitlines() == ["step 20: ok", "verification stopped: 2 step(s) not verified"]
    monkeypatch.setattr(restore_mod, "read_manifest", lambda store, s: (
        (_ for _ in ()).throw(cc.StorageUnavailableError("simulated")) if s == 30 else real_manifest(store, s)))
    rc, out, err = run("ls", ckpt)
    assert rc == 1 and "StorageUnavailableError" in err and "damaged" not in out


def test_gc_dry_run_changes_nothing_then_gc_deletes_exactly(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    before = tree_digest(d)
    rc, out, _ = run("gc", d, "--keep-last", "1", "--keep-best", "val_loss:min:1", "--dry-run")
    assert rc == 0
    assert "would delete step 30" in out and "would delete step 20" not in out
    assert tree_digest(d) == before
    rc, out, _ = run("gc", d, "--keep-last", "1", "--keep-best", "val_loss:min:1")
    assert rc == 0 and "deleting step 30" in out
    assert open_store(d).committed_steps() == [20, 40]
    assert not os.path.exists(os.path.join(d, ".ckpt_callbacks.lock"))   # released
    rc, out, _ = run("gc", d, "--keep-steps", "20")   # never deletes the newest
    assert open_store(d).committed_steps() == [20, 40]


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_gc_refuses_keep_steps_that_are_not_committed(ckpt, tmp_path, dry):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    before = tree_digest(d)
    # a typo: 300 for 30; was: exit 0, "deleting step 30" (and 20), the step meant to be kept
    rc, out, err = run("gc", d, "--keep-steps", "300,20", "--keep-last", "1", *dry)
    assert rc == 2 and "--keep-steps 300: not committed" in err and "20, 30, 40" in err, (rc, out, err)
    assert "delet" not in out and tree_digest(d) == before


@pytest.mark.usefixtures("zarr_above_1mib")
def test_gc_verify_keeps_an_intact_step_in_place_of_a_damaged_one(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    chunks = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "step_0000000040", "arrays"))
              for f in fs if f != "zarr.json"]
    with open(chunks[0], "r+b") as f:   # one bit of the newest step's data
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    rc, out, _ = run("gc", d, "--keep-last", "1", "--dry-run")   # reads no data: would keep only step 40
    assert rc == 0 and "would delete step 30" in out
    rc, out, _ = run("gc", d, "--keep-last", "1", "--verify")
    assert rc == 0 and "keeping [30, 40]" in out and "deleting step 20" in out and "deleting step 30" not in out
    assert "step 40: damaged" in out and "not counted" in out
    assert open_store(d).committed_steps() == [30, 40]
    assert cc.CheckpointManager(d, read_only=True).restore(30)["step"] == 30


def test_gc_needs_a_policy_and_removes_partial_only_when_asked(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    rc, out, err = run("gc", d)
    assert rc == 2 and "at least one retention flag" in err and not out
    os.makedirs(os.path.join(d, "step_0000000050.tmp-0123456789ab"))
    rc, out, _ = run("gc", d, "--keep-every", "10")
    assert open_store(d).leftovers() == ["step_0000000050.tmp-0123456789ab"]
    rc, out, _ = run("gc", d, "--keep-every", "10", "--remove-partial")
    assert rc == 0 and open_store(d).leftovers() == [] and open_store(d).committed_steps() == [20, 30, 40]


def test_a_step_left_only_as_old_by_an_interrupted_replacement_is_put_back_never_removed(ckpt, tmp_path, devices):
    """force=True died between its two renames: the step exists only as `step_N.old-<hex>`.
    `gc --remove-partial` removed it as a leftover, the only copy of a committed step."""
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    os.rename(os.path.join(d, "step_0000000040"), os.path.join(d, "step_0000000040.old-0123456789ab"))
    os.makedirs(os.path.join(d, "step_0000000040.tmp-0123456789cd"))   # the unfinished replacement
    rc, out, _ = run("ls", d)
    assert rc == 0 and "1 partial, 1 recoverable" in out and "recoverable step_0000000040.old-" in out, out
    rc, out, _ = run("gc", d, "--keep-last", "1", "--remove-partial", "--dry-run")
    assert "would put back step 40" in out and "step_0000000040.old-0123456789ab" in os.listdir(d), out
    rc, out, _ = run("gc", d, "--keep-last", "1", "--remove-partial")
    assert rc == 0 and "put back step 40" in out and "deleting partial step_0000000040.tmp-" in out, out
    assert open_store(d).committed_steps() == [40] and open_store(d).leftovers() == []
    with cc.CheckpointManager(d, read_only=True) as m:
        np.testing.assert_array_equal(m.restore(40)["params"]["b"], make_tree(40, devices)["params"]["b"])


@pytest.mark.usefixtures("zarr_above_1mib")
def test_gc_never_brings_back_a_replaced_copy_of_a_step_it_deleted(ckpt, tmp_path, devices):
    """force=True died after its commit, while removing the replaced copy (`step_N.old-*`, torn):
    `gc` deleted step_N and the next start put the stale, torn copy back as step N."""
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    old = os.path.join(d, "step_0000000030.old-0123456789ab")
    shutil.copytree(os.path.join(d, "step_0000000030"), old)
    shutil.rmtree(os.path.join(old, "arrays"))   # half removed
    rc, out, _ = run("ls", d)
    assert rc == 0 and "recoverable" not in out, out
    rc, out, _ = run("gc", d, "--keep-last", "1")
    assert rc == 0 and "deleting step 30" in out and "put back" not in out, out
    assert not os.path.exists(old)
    with cc.CheckpointManager(d) as m:
        assert m.all_steps() == [40]
    assert open_store(d).leftovers() == []


def test_gc_bad_flag_values_are_usage_errors(ckpt):
    with pytest.raises(SystemExit) as e:
        run("gc", ckpt, "--keep-best", "val_loss:median:2")
    assert e.value.code == 2
    # refused by the flag's own name (as typed), with the usage, before the directory is read
    for flag, value, says in (("--keep-last", "0", "expected a positive int"),
                              ("--keep-every", "-2", "expected a positive int"),
                              ("--keep-every-n-seconds", "nan", "expected a positive, finite number"),
                              ("--keep-steps", "20,-30", "expected non-negative steps"),
                              ("--keep-steps", "20,,30", "expected non-negative steps")):   # a typo, not two steps
        err = io.StringIO()
        with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
            cli.main(["gc", ckpt, flag, value])
        assert e.value.code == 2
        assert f"argument {flag}: {says}" in err.getvalue() and "keep_" not in err.getvalue()
    assert cc.CheckpointManager(ckpt).all_steps()   # nothing deleted
    # a metric no step reported (a typo) kept no best: it deleted the run's best step without a word
    for dry in ([], ["--dry-run"]):
        rc, out, err = run("gc", ckpt, "--keep-last", "1", "--keep-best", "val_los:min:1", *dry)
        assert rc == 2 and "no committed step reported 'val_los'" in err and "they report: val_loss" in err, err
        assert "delete" not in out
    assert open_store(ckpt).committed_steps() == [20, 30, 40]


def test_a_step_a_live_trainer_deletes_while_ls_reads_it_is_gone_not_damaged(tmp_path, monkeypatch):
    # `ls` (and `gc --dry-run`) run next to a training job: its retention may delete a listed step
    # before the tool reads the manifest; that step went, it is not shown as damaged
    from ckpt_callbacks import restore
    d = str(tmp_path / "run")
    with cc.CheckpointManager(d, retention=cc.KeepBest("loss", "min", 3)) as m:
        for s in (1, 2, 3):
            m.save(s, {"w": np.int32(s)}, metrics={"loss": 1.0 / s})
    real, going = restore.read_manifest, {1}

    def deleted_first(store, step):
        if step in going:
            store.delete(step)   # the trainer's retention, in another process
        return real(store, step)
    monkeypatch.setattr(restore, "read_manifest", deleted_first)
    rc, out, _ = run("ls", d, "--json")
    js = json.loads(out)
    assert rc == 0 and [r["step"] for r in js["steps"]] == [2, 3] and js["best"]["step"] == 3, out
    assert all(r["status"] == "committed" for r in js["steps"]), out
    going.add(2)
    rc, out, _ = run("gc", d, "--keep-last", "1", "--dry-run")
    assert rc == 0 and "keeping [3]" in out and "unreadable" not in out and "step 2" not in out, out


def test_timeline_writes_self_contained_html(ckpt, tmp_path):
    out_path = str(tmp_path / "t.html")
    rc, out, _ = run("timeline", ckpt, "-o", out_path)
    assert rc == 0 and "3 saves" in out
    page = open(out_path).read()
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")   # nothing fetched
    for s in (20, 30, 40):
        assert f"step {s} snapshot" in page and f"step {s} write" in page
    # commit and gc of 20 and 30 come from the next save's manifest; 40 is the newest
    assert "step 30 commit" in page and "step 30 gc" in page and "step 40 commit" not in page
    rc, out, _ = run("timeline", ckpt, "-o", out_path, "--last", "2")
    assert rc == 0 and "2 saves" in out
    for bad in ("0", "-2", "x"):   # (--last 0 drew every save, --last -2 all but two)
        with pytest.raises(SystemExit) as e:
            run("timeline", ckpt, "-o", out_path, "--last", bad)
        assert e.value.code == 2


@pytest.mark.parametrize("url", ["s3://", "gs://", "s3:///prefix"])
def test_a_malformed_object_store_url_is_bad_usage(url):
    rc, out, err = run("ls", url)
    assert rc == 2 and "ConfigError" in err and not out, (rc, out, err)


@pytest.mark.parametrize("sub", ["ls", "inspect", "verify", "gc", "timeline"])
def test_every_subcommand_has_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    assert f"usage: ckpt-callbacks {sub}" in capsys.readouterr().out


def test_bench_is_dispatched_lazily():
    try:
        import ckpt_callbacks.bench  # noqa: F401
    except ModuleNotFoundError:
        rc, _, err = run("bench", "--help")
        assert rc == 2 and "ckpt_callbacks.bench is missing" in err
    else:
        with pytest.raises(SystemExit) as e:
            run("bench", "--help")
        assert e.value.code == 0


def test_console_script_refuses_gc_while_a_trainer_holds_the_directory(ckpt, tmp_path, devices):
    """The installed entry point, in its own process, on a directory a live manager writes."""
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    exe = shutil.which("ckpt-callbacks", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "ckpt_callbacks.cli"]
    env = dict(os.environ, JAX_PLATFORMS="")   # the CLI pins itself to the CPU
    with cc.CheckpointManager(d, retention=cc.KeepLast(3)):
        p = subprocess.run(cmd + ["gc", d, "--keep-last", "1"], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 1 and "CheckpointLockedError" in p.stderr and str(os.getpid()) in p.stderr
        assert open_store(d).committed_steps() == [20, 30, 40]
        p = subprocess.run(cmd + ["ls", d], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0 and "* best" in p.stdout


def test_gc_dry_run_is_refused_like_gc_while_a_trainer_holds_the_directory(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    cmd = [sys.executable, "-m", "ckpt_callbacks.cli", "gc", d, "--keep-last", "1", "--remove-partial"]
    with cc.CheckpointManager(d, retention=cc.KeepLast(3)):
        os.makedirs(os.path.join(d, "step_0000000050.tmp-0123456789ab"))   # as its save in flight
        before = tree_digest(d)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "CheckpointLockedError" in p.stderr
        # was: exit 0, "would delete step 20 ... would delete partial step_0000000050.tmp-..." (the save
        # in flight), while gc itself is refused
        p = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "CheckpointLockedError" in p.stderr and str(os.getpid()) in p.stderr
        assert "would delete" not in p.stdout
        assert tree_digest(d) == before
    rc, out, _ = run("gc", d, "--keep-last", "1", "--remove-partial", "--dry-run")   # once it closed
    assert rc == 0 and "would delete step 20" in out and "would delete partial step_0000000050.tmp-" in out


def _unprivileged(cmd):
    """`cmd` run so that file permissions apply to it (as root: without CAP_DAC_OVERRIDE)."""
    if os.geteuid() != 0:
        return cmd
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permissions cannot be made to apply")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]


def test_gc_that_cannot_remove_a_step_completely_says_so_and_fails(ckpt, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    step = os.path.join(d, "step_0000000020")
    stuck = os.path.dirname(_chunk_files(step)[0])
    os.chmod(stuck, 0o555)   # a careless user's chmod: its chunk files cannot be unlinked
    try:
        p = subprocess.run(_unprivileged([sys.executable, "-m", "ckpt_callbacks.cli", "gc", d, "--keep-last", "2"]),
                           capture_output=True, text=True, timeout=120)
        left = [n for n in os.listdir(d) if n.startswith("step_0000000020.del-")]
        assert open_store(d).committed_steps() == [30, 40] and len(left) == 1   # hidden, not all removed
        # was: exit 0 and "deleting step 20" only, the step's bytes still on disk
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"could not remove all of {left[0]}" in p.stdout and left[0] in p.stderr
        os.chmod(os.path.join(d, left[0], os.path.relpath(stuck, step)), 0o755)
        p = subprocess.run(_unprivileged([sys.executable, "-m", "ckpt_callbacks.cli", "gc", d, "--keep-last", "2",
                                          "--remove-partial"]), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and f"deleting partial {left[0]}" in p.stdout and not os.path.exists(os.path.join(d, left[0]))
    finally:
        for root, dirs, _ in os.walk(d):
            for x in dirs:
                os.chmod(os.path.join(root, x), 0o755)


try:
    from objstore import objstore, objstore_env  # noqa: F401 - pytest fixtures (real S3/GCS servers)
except ImportError:
    @pytest.fixture(params=["s3", "gs"])
    def objstore(request):
        pytest.skip("tests/objstore.py (real object-store servers) is not in this tree yet")


@pytest.mark.usefixtures("zarr_above_1mib")
def test_cli_on_object_store_urls(objstore, devices):
    """ls, inspect, verify (catching a damaged chunk object), gc on s3:// and gs:// URLs."""
    url = objstore.url
    with cc.CheckpointManager(url, retention=cc.KeepBest("val_loss", "min", 3)) as m:
        for s in (10, 20, 30):
            m.save(s, make_tree(s, devices), metrics={"val_loss": LOSS[s]})
    rc, out, _ = run("ls", url)
    assert rc == 0 and "3 committed, 0 partial" in out and "best by val_loss (min, from the run's KeepBest): 20" in out
    rc, out, _ = run("inspect", url, "--step", "20")
    assert rc == 0 and "['w']: float32[512, 1024]" in out
    rc, out, _ = run("verify", url, "--all", "--quiet")
    assert rc == 0 and out.splitlines() == ["step 10: ok", "step 20: ok", "step 30: ok"]
    store = open_store(url)
    chunk = next(k for k in store._list("step_0000000020/arrays/") if "/c/" in k)
    data = bytearray(store.read(chunk))
    data[10] ^= 0xFF
    store.write(chunk, bytes(data))
    rc, out, _ = run("verify", url, "--all", "--quiet")
    assert rc == 1 and "step 20: DAMAGED" in out and "['params']['w']" in out and "step 30: ok" in out
    # a save killed between its commit marker and dropping its pending record: the step is
    # committed, only the record is stale (neither "partial" nor removed with the record)
    store.write("pending/step_0000000030", msgpack.packb({"op": "save", "token": "dead", "time": time.time() - 3600,
                                                          "host": socket.gethostname(), "pid": 2**22 + 12345}))
    rc, out, _ = run("ls", url)
    assert rc == 0 and "3 committed, 0 partial, 1 stale record(s)" in out and "stale      step_0000000030" in out, out
    rc, out, _ = run("gc", url, "--keep-last", "1", "--dry-run")
    assert rc == 0 and open_store(url).committed_steps() == [10, 20, 30]
    rc, out, _ = run("gc", url, "--keep-last", "1", "--remove-partial")
    assert rc == 0 and "dropping the stale record of committed step 30 (the step stays)" in out, out
    assert open_store(url).committed_steps() == [30] and open_store(url).leftovers() == []
    assert cc.CheckpointManager(url, read_only=True).restore(30) is not None


@pytest.mark.parametrize("argv", [["ls"], ["inspect"], ["verify"], ["timeline"], ["gc", "--keep-last", "1"]])
def test_a_directory_that_does_not_exist_is_an_error_not_an_empty_run(tmp_path, argv):
    missing = str(tmp_path / "no-such-run")
    rc, out, err = run(*argv[:1], missing, *argv[1:])
    assert rc == 1 and "no such directory" in err and "no-such-run" in err, (rc, out, err)
    assert not os.path.exists(missing)


@pytest.mark.parametrize("argv", [["ls"], ["inspect"], ["verify"], ["timeline", "-o", "-"], ["gc", "--keep-last", "1"]])
def test_a_step_directory_given_for_the_run_is_refused_and_its_run_named(ckpt, tmp_path, argv):
    d = str(tmp_path / "run")
    shutil.copytree(ckpt, d)
    before = tree_digest(d)
    for inside in ("step_0000000040", os.path.join("step_0000000040", "blobs")):
        rc, out, err = run(*argv[:1], os.path.join(d, inside), *argv[1:])
        # was: ls "0 committed, 0 partial" and gc "nothing to delete" (exit 0, its lock file made inside the step)
        assert rc == 1 and "is a step's directory (or inside one)" in err and err.rstrip().endswith(d), (rc, out, err)
    assert tree_digest(d) == before


@pytest.mark.parametrize("argv", [["ls"], ["inspect"], ["verify"], ["timeline"], ["gc", "--keep-last", "1"]])
def test_a_file_given_for_the_directory_is_named_a_file(ckpt, argv):
    manifest = os.path.join(ckpt, "step_0000000040", "manifest.msgpack")
    rc, out, err = run(*argv[:1], manifest, *argv[1:])
    # was: ".../manifest.msgpack: no such directory", of a file that exists
    assert rc == 1 and "is a file, not a checkpoint directory" in err and "no such" not in err, (rc, out, err)
