"""`ckpt-callbacks bench`: a tiny run of every workload and peer on tmpfs and disk, checked for
every field and sane values (no timing asserts: speed is what the bench reports, not what tests
assert), the child-process path of the console script, and the target verdicts on known rows."""

import json
import os
import subprocess
import sys

import pytest

from ckpt_callbacks import bench
from ckpt_callbacks.bench_report import render, targets

PEERS = ["ckpt_callbacks", "orbax", "flax-msgpack", "np.savez", "raw"]
TINY = ["--scale", "0.001", "--repeats", "1", "--leak-saves", "3", "--fit-epochs", "1", "--fit-repeats", "1"]


def _keras_callback_importable():
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import ckpt_callbacks.keras  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """The whole tiny bench, every cell in one process of its own (``--in-process`` there): the
    peers' threads (Orbax's event loops, Keras') then end with it instead of living on in the
    test process beside every later test's tensorstore and XLA threads."""
    d = tmp_path_factory.mktemp("bench")
    out = d / "bench.json"
    p = subprocess.run([sys.executable, "-m", "ckpt_callbacks.bench", *TINY, "--in-process", "--disk-dir",
                        str(d / "disk"), "--output", str(out), "--json"],
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def _rows(result, workload, storage):
    return [r for r in result["rows"] if r["workload"] == workload and r["storage"] == storage]


@pytest.mark.parametrize("storage", ["tmpfs", "disk"])
@pytest.mark.parametrize("workload", ["big", "small"])
def test_every_peer_saves_and_restores_correctly(result, workload, storage):
    rows = {r["peer"]: r for r in _rows(result, workload, storage)}
    assert sorted(rows) == sorted(PEERS)
    nbytes = rows["ckpt_callbacks"]["bytes"]
    assert nbytes > 0
    for peer, r in rows.items():
        assert not r.get("skipped"), (peer, r.get("skipped"))
        assert r["correct"] is True, peer                   # restored bits equal the saved ones
        assert r["bytes"] == nbytes and r["repeats"] == 1
        assert 0 < r["blocking_s"] <= r["durable_s"], peer  # durable includes the blocking part
        assert r["restore_s"] > 0 and r["peak_rss"] >= 0
        assert r["files"] >= 1 and r["disk_bytes"] >= 0.8 * nbytes, peer   # orbax compresses a little
        assert len(r["samples"]) == 1
    assert rows["raw"]["disk_bytes"] == nbytes
    ratios = [x for x in result["ratios"] if (x["workload"], x["storage"]) == (workload, storage)]
    assert sorted(x["peer"] for x in ratios) == sorted(p for p in PEERS if p != "ckpt_callbacks")
    for x in ratios:
        assert all(x[k] > 0 for k in ("blocking_s", "durable_s", "restore_s"))
    assert next(x for x in ratios if x["peer"] == "raw")["bandwidth_fraction"] > 0


@pytest.mark.parametrize("storage", ["tmpfs", "disk"])
def test_reshard_reports_bytes_read_against_bytes_needed(result, storage):
    rows = _rows(result, "reshard", storage)
    assert sorted((r["peer"], r["case"]) for r in rows) == sorted(
        (p, c) for p in ("ckpt_callbacks", "orbax") for c in ("4x2 (same)", "2x4", "1 device"))
    big = next(r for r in _rows(result, "big", storage) if r["peer"] == "ckpt_callbacks")
    for r in rows:
        assert r["correct"] is True and r["restore_s"] > 0
        assert r["bytes_needed"] == big["bytes"]            # one process holds every shard of the target
        assert r["bytes_read"] >= 0.8 * r["bytes_needed"]   # read from the files (rchar) or their mappings
        assert r["ts_bytes_read"] >= 0


@pytest.mark.parametrize("storage", ["tmpfs", "disk"])
def test_memory_reports_peak_budget_and_growth(result, storage):
    rows = {r["case"]: r for r in _rows(result, "memory", storage)}
    assert len(rows) == 3 and "no budget" in rows and rows["no budget"]["correct"] is True
    leak = rows["3 saves"]
    assert leak["repeats"] == 3 and leak["rss_first"] > 0 and leak["rss_last"] > 0
    assert "growth_bytes" in leak and "slope_bytes_per_save" in leak
    budget = next(r for c, r in rows.items() if c.startswith("budget"))
    assert budget["budget"] >= 2**20 and budget["correct"] is True


@pytest.mark.parametrize("storage", ["tmpfs", "disk"])
def test_fit_compares_callbacks_against_no_callback(result, storage):
    rows = {r["peer"]: r for r in _rows(result, "fit", storage)}
    assert set(rows) == {"none", "ckpt_callbacks", "keras-ModelCheckpoint", "keras-OrbaxCheckpoint"}
    assert rows["none"]["overhead"] == 0.0 and rows["none"]["fit_s"] > 0
    if not _keras_callback_importable():
        assert rows["ckpt_callbacks"]["skipped"]
    else:
        assert not rows["ckpt_callbacks"].get("skipped")
        assert rows["ckpt_callbacks"]["files"] >= 1         # it really saved
        assert rows["ckpt_callbacks"]["blocking_s"] > 0 and rows["ckpt_callbacks"]["last_save_s"] > 0
    assert rows["none"]["round_overhead"] == 0.0
    for r in rows.values():
        if not r.get("skipped"):
            assert r["fit_s"] > 0 and r["bytes"] > 0 and r["overhead"] > -1 and r["round_overhead"] > -1
            assert r["cpu_s"] > 0 and r["cpu_overhead"] is not None


def test_targets_and_table_cover_every_workload(result):
    names = {t["target"] for t in result["targets"]}
    for prefix in ("big: blocking", "big: save <= 1/3", "big: restore <= 1/3", "big: save bandwidth",
                   "small: blocking", "small: save", "small: restore", "reshard -> 2x4: restore",
                   "reshard -> 1 device: bytes read", "memory: peak during save <= 1.1x saved",
                   "memory: peak during save <= 1.1x the budget", "memory: 3 saves without growth", "fit: overhead"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert all(t["met"] in (True, False) and "note" in t for t in result["targets"])  # scale != 1 is noted
    m = result["machine"]
    assert m["cpus"] >= 1 and m["jax"] and "tmpfs_fs" in m and "disk_fs" in m
    for key in ("fresh_memory_ms_per_mib", "reused_memory_ms_per_mib"):   # before and after the workloads
        assert len(m[key]) == 2 and all(v > 0 for v in m[key]), m
    text = render(result)
    for head in ("== big on tmpfs", "== small on disk", "== reshard on disk", "== memory on tmpfs",
                 "== fit on disk", "== targets", "ours/peer blk/dur/rst", "read/needed", "overhead", "+cpu ms",
                 "ckpt_callbacks per fit (medians): blocking"):
        assert head in text, head


def test_fresh_memory_times_the_first_write_of_every_page(monkeypatch):
    """Two mappings, each written on every page (so each page is faulted in) and unmapped."""
    import mmap
    made, written = [], []
    real = mmap.mmap

    class Spy(real):
        def close(self):
            written.append(all(self[i] == 1 for i in range(0, len(self), mmap.PAGESIZE)))
            super().close()

    monkeypatch.setattr(mmap, "mmap", lambda *a, **kw: made.append(Spy(*a, **kw)) or made[-1])
    got = bench.fresh_memory(4 << 20)
    assert set(got) == {"fresh_memory_ms_per_mib", "reused_memory_ms_per_mib"}
    assert all(v > 0 for v in got.values())
    assert len(made) == 2 and all(m.closed for m in made) and written == [True, True]


def _row(wl, st, peer, case="", **kw):
    return {"workload": wl, "storage": st, "peer": peer, "case": case, **kw}


def test_target_verdicts_on_known_rows():
    rows = [_row("big", "tmpfs", "ckpt_callbacks", blocking_s=0.04, durable_s=1.0, restore_s=1.0),
            _row("big", "tmpfs", "orbax", blocking_s=0.02, durable_s=3.3, restore_s=2.7),
            _row("big", "disk", "ckpt_callbacks", blocking_s=0.06, durable_s=3.0, restore_s=1.0),
            _row("big", "disk", "raw", blocking_s=2.8, durable_s=2.8, restore_s=1.0),
            _row("memory", "disk", "ckpt_callbacks", "no budget", peak_rss=110, bytes=100),
            _row("memory", "disk", "ckpt_callbacks", "budget 1 MiB", peak_rss=120, bytes=400, budget=100),
            _row("memory", "disk", "ckpt_callbacks", "100 saves", bytes=2**30, growth_bytes=200 * 2**20),
            _row("fit", "disk", "ckpt_callbacks", "5 epochs", overhead=0.099)]
    got = {(t["target"], t["storage"]): t["met"] for t in targets(rows)}
    assert got == {
        ("big: blocking <= max(Orbax's, 50 ms)", "tmpfs"): True,      # 40 ms <= max(20 ms, 50 ms)
        ("big: save <= 1/3 of Orbax's", "tmpfs"): True,               # 1.0 <= 1.1
        ("big: restore <= 1/3 of Orbax's", "tmpfs"): False,           # 1.0 > 0.9
        ("big: blocking <= max(Orbax's, 50 ms)", "disk"): False,      # no Orbax row: 50 ms
        ("big: save bandwidth >= 0.9x raw write+fsync", "disk"): True,  # 2.8 / 3.0 = 0.93
        ("memory: peak during save <= 1.1x saved bytes", "disk"): True,
        ("memory: peak during save <= 1.1x the budget (budget 1 MiB)", "disk"): False,
        ("memory: 100 saves without growth (<= 102 MiB)", "disk"): False,
        ("fit: overhead <= 10%", "disk"): True,
    }


def test_console_script_runs_each_cell_in_a_child_with_8_devices(tmp_path):
    """The default path: `ckpt-callbacks bench` spawns a child per workload and storage."""
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt-callbacks")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "ckpt_callbacks.cli"]
    p = subprocess.run(cmd + ["bench", "--workloads", "reshard", "--peers", "ckpt_callbacks", "--storage", "disk",
                              "--disk-dir", str(tmp_path), "--scale", "0.001", "--repeats", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    cases = {r["case"]: r for r in got["rows"]}
    assert set(cases) == {"4x2 (same)", "2x4", "1 device"}      # the 2x4 mesh needs the 8 devices
    assert all(r["correct"] for r in cases.values())
    assert got["command"].startswith("ckpt-callbacks bench --workloads reshard")
    assert got["config"]["memory"] == "recycled"
    assert os.listdir(tmp_path) == []     # the page-cache file of --memory recycled removed at the end


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--workloads", "big,nope"])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err


def test_a_cell_past_its_timeout_is_reported_not_waited_for(tmp_path, capsys):
    """A hanging workload (e.g. a save that never finishes) becomes a "skipped" row; the bench goes on."""
    rc = bench.main(["--workloads", "big", "--peers", "ckpt_callbacks", "--storage", "disk", "--disk-dir",
                     str(tmp_path), "--scale", "0.001", "--repeats", "1", "--cell-timeout", "0.5", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["skipped"] for r in got["rows"]] == [
        "did not finish within --cell-timeout 0.5 s (a hang?); rows measured before are kept"]


def test_the_peers_take_turns_so_each_ratio_is_paired(tmp_path, devices):
    """The targets are ratios (ours / raw write+fsync on disk, ours / Orbax on tmpfs): every peer
    saves once per round, in the order given on even rounds and reversed on odd ones, each
    repeat reported; a row comes out when its peer has its last sample."""
    from ckpt_callbacks import bench_workloads as bw
    said = []
    ctx = bw.Context(root=str(tmp_path), storage="disk", scale=0.001, repeats=3,
                     peers=("ckpt_callbacks", "np.savez", "raw"), log=said.append)
    rows = list(bw.WORKLOADS["big"](ctx))
    order = [m.split()[1] for m in said if "#" in m]
    assert order == ["ckpt_callbacks", "np.savez", "raw", "raw", "np.savez", "ckpt_callbacks",
                     "ckpt_callbacks", "np.savez", "raw"]
    got = {r["peer"]: r for r in rows}
    assert [r["peer"] for r in rows] == ["ckpt_callbacks", "np.savez", "raw"]
    assert got["raw"]["case"] == "write+fsync" and got["np.savez"]["case"] == ""
    assert all(got[p]["repeats"] == 3 and got[p]["correct"] for p in got)
    assert got["ckpt_callbacks"]["durable_s"] == pytest.approx(min(s["durable_s"] for s in got["ckpt_callbacks"]["samples"]), abs=1e-4)
    assert got["raw"]["durable_s"] == pytest.approx(min(s["durable_s"] for s in got["raw"]["samples"]), abs=1e-4)


def test_recycle_page_cache_reads_its_file_through_the_cache_then_drops_it(tmp_path, monkeypatch):
    from ckpt_callbacks import bench_peers as bp
    path = str(tmp_path / "sub" / "recycle.bin")
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (
        dropped.append((os.readlink(f"/proc/self/fd/{fd}"), off, n, advice)), real(fd, off, n, advice))[1])
    r0 = bp.bytes_read()
    bp.recycle_page_cache(path, 3 << 20)
    assert os.path.getsize(path) == 3 << 20 and bp.bytes_read() - r0 >= 3 << 20
    assert dropped == [(path, 0, 0, os.POSIX_FADV_DONTNEED)]
    made = os.stat(path)
    bp.recycle_page_cache(path, 2 << 20)          # large enough: read again, not rewritten
    again = os.stat(path)
    assert (again.st_ino, again.st_mtime_ns, again.st_size) == (made.st_ino, made.st_mtime_ns, 3 << 20)
    assert len(dropped) == 2
    bp.recycle_page_cache(path, 5 << 20)          # too small: made again at the new size
    assert os.path.getsize(path) == 5 << 20


@pytest.mark.parametrize("recycle", [True, False])
def test_every_timed_save_and_restore_of_every_peer_starts_after_the_same_recycling(
        tmp_path, devices, monkeypatch, recycle):
    """``--memory recycled``: each peer's save and restore starts right after 1.25x its bytes of
    page cache were filled and dropped (so no peer inherits the memory state of the turn before)."""
    from ckpt_callbacks import bench_peers as bp
    from ckpt_callbacks import bench_workloads as bw
    events = []
    monkeypatch.setattr(bp, "recycle_page_cache", lambda path, n: events.append(("recycle", path, n)))

    class Spy(bp.Engine):
        def save(self, step, tree):
            events.append("save")
            return super().save(step, tree)

        def restore(self, step, target):
            events.append("restore")
            return super().restore(step, target)
    monkeypatch.setitem(bp.PEERS, "ckpt_callbacks", Spy)
    raw_write, raw_read = bp.raw_write, bp.raw_read
    monkeypatch.setattr(bp, "raw_write", lambda *a, **kw: events.append("write") or raw_write(*a, **kw))
    monkeypatch.setattr(bp, "raw_read", lambda *a, **kw: events.append("read") or raw_read(*a, **kw))
    ctx = bw.Context(root=str(tmp_path / "cell"), storage="disk", scale=0.001, repeats=1,
                     peers=("ckpt_callbacks", "raw"), log=lambda m: None,
                     recycle=str(tmp_path / "recycle.bin") if recycle else None)
    rows = list(bw.WORKLOADS["big"](ctx))
    assert all(r["correct"] for r in rows)
    r = ("recycle", str(tmp_path / "recycle.bin"), int(bw.tree_bytes(bw.big_tree(0.001)) * 1.25))
    if recycle:
        assert events == [r, "save", r, "restore", r, "write", r, "read"]
    else:
        assert events == ["save", "restore", "write", "read"]


def test_a_slow_peer_is_not_repeated_and_a_missing_one_is_skipped_while_the_others_take_turns(
        tmp_path, devices, monkeypatch):
    from ckpt_callbacks import bench_peers as bp
    from ckpt_callbacks import bench_workloads as bw

    def missing(path, **kw):
        raise bp.Unavailable("orbax-checkpoint is not installed")
    monkeypatch.setitem(bp.PEERS, "orbax", missing)
    real = bw._sample

    def slow_savez(ctx, workload, name, *a, **kw):
        s = real(ctx, workload, name, *a, **kw)
        return {**s, "durable_s": ctx.slow_s + 1} if name == "np.savez" else s
    monkeypatch.setattr(bw, "_sample", slow_savez)
    said = []
    ctx = bw.Context(root=str(tmp_path), storage="tmpfs", scale=0.001, repeats=2,
                     peers=("ckpt_callbacks", "orbax", "np.savez", "raw"), log=said.append)
    rows = list(bw.WORKLOADS["small"](ctx))
    order = [m.split()[1] for m in said if "#" in m]
    assert order == ["ckpt_callbacks", "np.savez", "raw", "raw", "ckpt_callbacks"]
    assert [(r["peer"], r.get("skipped"), r.get("repeats")) for r in rows] == [
        ("orbax", "orbax-checkpoint is not installed", None), ("np.savez", None, 1),
        ("raw", None, 2), ("ckpt_callbacks", None, 2)]
    assert all(r["correct"] for r in rows if "skipped" not in r)
    assert not os.listdir(tmp_path)   # every peer's directory removed


def test_fit_runs_in_a_child_with_glibcs_default_mmap_threshold(monkeypatch):
    """Save workloads measure memory peaks, so their children fix glibc's mmap threshold; the
    fit workload measures wall time against a fit without a callback, in a process like a
    user's (with the fixed threshold every training step maps fresh memory: 1.5x slower)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in bench._child_env("fit")
    for w in ("big", "small", "reshard", "memory"):
        assert bench._child_env(w)["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert bench._child_env("fit")["JAX_PLATFORMS"] == "cpu"


def test_each_timed_fit_starts_after_a_full_garbage_collection(tmp_path, monkeypatch):
    """A full collection in a Keras process takes ~130 ms (~15 % of a bench fit): left to
    chance it lands in one timed fit of one variant per run, so each timed fit starts right
    after `gc.collect()` (untimed), whatever callback it runs."""
    if not _keras_callback_importable():
        pytest.skip("ckpt_callbacks.keras is not importable here")
    import time as real_time
    import types

    from ckpt_callbacks import bench_fit
    from ckpt_callbacks import bench_workloads as bw
    events = []
    monkeypatch.setattr(bench_fit, "gc", types.SimpleNamespace(collect=lambda: events.append("gc")))
    monkeypatch.setattr(bench_fit, "time", types.SimpleNamespace(
        perf_counter=lambda: events.append("clock") or real_time.perf_counter(), process_time=real_time.process_time))
    ctx = bw.Context(root=str(tmp_path), storage="disk", scale=0.001, fit_epochs=1, fit_repeats=2, log=lambda m: None)
    rows = bench_fit.run(ctx, bw._row)
    timed = [r for r in rows if not r.get("skipped")]
    assert {r["peer"] for r in timed} >= {"none", "ckpt_callbacks", "keras-ModelCheckpoint"}
    n = sum(r["repeats"] for r in timed)
    assert events == ["gc", "clock", "clock"] * n   # collected, then the fit's start and end read


def test_the_table_lists_this_package_first_whatever_order_the_peers_finished_in():
    """Peers take turns and a slow one (Orbax on small: one save of minutes) finishes first."""
    def row(peer, t):
        return {"workload": "small", "storage": "tmpfs", "peer": peer, "case": "", "blocking_s": t,
                "durable_s": t, "restore_s": t, "peak_rss": 0, "files": 1, "disk_bytes": 1 << 20,
                "bytes": 1 << 20, "repeats": 1, "correct": True}
    text = render({"rows": [row("orbax", 140.0), row("ckpt_callbacks", 0.2), row("np.savez", 0.3)]})
    lines = [ln.split()[0] for ln in text.splitlines() if ln.split()[:1] in (["orbax"], ["ckpt_callbacks"], ["np.savez"])]
    assert lines[:3] == ["ckpt_callbacks", "orbax", "np.savez"]


@pytest.mark.parametrize("ndev", [8, 1])
def test_stall_times_a_donating_training_loop_with_and_without_a_save(tmp_path, devices, ndev, monkeypatch):
    """The accelerator workload, run on the CPU devices it is handed: the device-to-host copies
    (pinned and pageable), then per peer a training loop of donating steps alone and with a save
    before its first step, in turns; the values restored equal those the first step donated."""
    import functools

    import jax
    from ckpt_callbacks import bench_stall
    from ckpt_callbacks import bench_workloads as bw
    # The bench's step (a @ a.T) on a 4x2 mesh of CPU devices all-gathers; XLA's CPU collectives
    # under a loop of async-dispatched donating steps, on 2 busy cores, missed their rendezvous and
    # aborted the whole pytest process ("Termination timeout for `all gather ...` of 40 seconds
    # exceeded", one run in three). The step's arithmetic is the accelerator's load, not what is
    # tested here: an elementwise donating step, which needs no collective
    monkeypatch.setattr(bench_stall, "_step", functools.partial(jax.jit, donate_argnums=0)(
        lambda tree: jax.tree.map(lambda a: a * 0.999 + 1e-3 * jax.numpy.tanh(a), tree)))
    said = []
    ctx = bw.Context(root=str(tmp_path), storage="tmpfs", scale=0.001, repeats=2, log=said.append)
    rows = list(bench_stall.run(ctx, bw._row, devices=devices[:ndev]))
    assert [(r["peer"], r["case"]) for r in rows[:2]] == [("d2h", "pinned_host"), ("d2h", "pageable")]
    for r in rows[:2]:
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["repeats"] == 2 and r["devices"] == ndev and r["platform"] == "cpu"
    saves = {r["peer"]: r for r in rows[2:]}
    assert sorted(saves) == ["ckpt_callbacks", "orbax"]
    for r in saves.values():
        assert not r.get("skipped") and r["correct"] is True and r["repeats"] == 2
        assert r["stall_s"] == pytest.approx(r["loop_s"] - r["base_s"])
        paired = sorted(s["loop_s"] - s["base_s"] for s in r["samples"])
        assert paired[0] - 1e-3 <= r["round_stall_s"] <= paired[-1] + 1e-3
        assert 0 < r["blocking_s"] <= r["durable_s"] and r["restore_s"] > 0
        assert r["steps"] >= 5 and r["case"] == f"{r['steps']} steps" and r["step_s"] > 0
        assert r["loop_s"] == pytest.approx(min(s["loop_s"] for s in r["samples"]), abs=1e-4)
    # untimed warm-up rounds (#0) first, then the peers in turns
    order = [m.split()[1] for m in said if "#" in m]
    assert order == ["ckpt_callbacks", "orbax", "ckpt_callbacks", "orbax", "orbax", "ckpt_callbacks"]
    assert not os.listdir(tmp_path)
    text = render({"rows": rows, "targets": targets(rows)})
    assert "into pinned_host memory" in text and "stall/Orbax's" in text
    assert [t["target"] for t in targets(rows)] == [
        "stall: <= 1.25x bytes / pinned device-to-host bandwidth + 50 ms"]


def test_stall_times_durable_beside_the_loop_and_alternates_which_loop_runs_first(tmp_path, devices, monkeypatch):
    """`durable_s` was the time until `wait` returned after the loop, i.e. the loop's own length
    whenever the loop outlasted the save (as the number of steps is chosen to make it: 1.799 s
    against the 1.2 s of a save alone on the H200); and the loop alone always ran first in a
    round, so a drift of the loop's speed over the run fell on one side of the stall."""
    import time

    import jax
    from ckpt_callbacks import bench_peers as bp
    from ckpt_callbacks import bench_stall
    from ckpt_callbacks import bench_workloads as bw

    class Slow:   # durable 50 ms after its save returned
        def __init__(self, d):
            os.makedirs(d)

        def save(self, step, tree):
            self.host, self.done = jax.device_get(tree), time.perf_counter() + 0.05

        def wait(self):
            time.sleep(max(0.0, self.done - time.perf_counter()))

        def restore(self, step, target):
            return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), self.host, target)

        def close(self):
            pass

    monkeypatch.setitem(bp.PEERS, "ckpt_callbacks", Slow)
    monkeypatch.setattr(bench_stall, "_step", lambda tree: (time.sleep(0.02), tree)[1])   # 5 steps: 0.1 s
    loops, real = [], bench_stall._loop
    monkeypatch.setattr(bench_stall, "_loop", lambda state, steps, before=None: (
        loops.append("save" if before else "alone"), real(state, steps, before))[1])
    ctx = bw.Context(root=str(tmp_path), storage="disk", scale=0.001, repeats=2, peers=("ckpt_callbacks",),
                     log=lambda m: None)
    r = [x for x in bench_stall.run(ctx, bw._row, devices=devices[:1]) if x["peer"] == "ckpt_callbacks"][0]
    assert r["steps"] == 5 and r["correct"] is True
    for s in r["samples"]:
        assert 0.05 <= s["durable_s"] < s["loop_s"] - 0.02, r["samples"]
    # two untimed loops (compile, step time), then rounds #0 (warm-up), #1, #2
    assert loops[2:] == ["save", "alone", "alone", "save", "save", "alone"]


def test_stall_without_an_accelerator_is_skipped_and_its_child_keeps_jaxs_platforms(tmp_path, monkeypatch):
    """On CPU alone the workload says so; its child process is not forced onto the CPU (the
    others are: 8 CPU devices), and the console script leaves the user's JAX_PLATFORMS to it."""
    from ckpt_callbacks import bench_stall
    from ckpt_callbacks import bench_workloads as bw
    rows = list(bench_stall.run(bw.Context(root=str(tmp_path), storage="disk"), bw._row))
    assert rows == [{"workload": "stall", "storage": "disk", "peer": "ckpt_callbacks", "case": "",
                     "skipped": "no accelerator: JAX's default backend is cpu"}]
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert bench._child_env("stall")["JAX_PLATFORMS"] == "cuda,cpu"
    assert bench._child_env("big")["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    assert "JAX_PLATFORMS" not in bench._child_env("stall")
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append((argv, os.environ.get("JAX_PLATFORMS"))) or 0)
    from ckpt_callbacks import cli
    assert cli.main(["bench", "--workloads", "stall"]) == 0
    assert seen == [(["--workloads", "stall"], None)]


def test_stall_target_is_stated_against_the_pinned_transfer():
    rows = [_row("stall", "tmpfs", "d2h", "pinned_host", seconds=0.02, gbps=53.7, bytes=2**30),
            _row("stall", "tmpfs", "ckpt_callbacks", "250 steps", stall_s=0.074, bytes=2**30),
            _row("stall", "disk", "d2h", "pinned_host", seconds=0.02, gbps=53.7, bytes=2**30),
            _row("stall", "disk", "ckpt_callbacks", "250 steps", stall_s=0.076, bytes=2**30),
            _row("stall", "dram", "d2h", "pageable", seconds=0.5, gbps=2.1, bytes=2**30),
            _row("stall", "dram", "ckpt_callbacks", "250 steps", stall_s=0.01, bytes=2**30)]
    got = [(t["storage"], t["goal"], t["met"]) for t in targets(rows)]
    assert got == [("tmpfs", pytest.approx(0.075), True), ("disk", pytest.approx(0.075), False),
                   ("dram", None, None)]   # no pinned transfer measured: no verdict
