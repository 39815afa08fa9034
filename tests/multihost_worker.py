"""Functions run inside `jax.distributed` processes by tests/test_multihost.py (via tests/multiproc.py).

Example (from a test, in the pytest process)::

    from multiproc import launch
    res = launch("multihost_worker:save_and_check", 2, devices_per_process=4, args={"root": str(tmp)})

Each function is called with the same JSON arguments on every process, runs SPMD, and returns a
JSON value. Trees are built from deterministic global numpy values (`global_values`), so any
process (or the pytest process) can check a restore bit-exactly without shipping data around.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc

# name -> (shape, dtype, partition spec over mesh axes ("a", "b"))
LAYOUT = {
    "w": ((64, 48), "float32", P("a", "b")),
    "emb": ((128, 32), "bfloat16", P("a", None)),         # replicated over b
    "cols": ((32, 64), "int8", P(None, "b")),              # replicated over a
    "rep_big": ((1024, 1280), "float32", P()),             # 5.2 MB replicated: a zarr array
    "bias": ((48,), "float32", P()),                        # small replicated: packed
    "u16": ((16, 8), "uint16", P("a", None)),              # small but sharded across processes
}


def global_values(seed: int = 0) -> dict:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dt, _) in LAYOUT.items():
        if dt == "bfloat16":
            out[name] = rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)
        elif dt.startswith(("int", "uint")):
            out[name] = rng.integers(0, 100, shape).astype(dt)
        else:
            out[name] = rng.standard_normal(shape).astype(dt)
    out["np"] = np.arange(10, dtype=np.int64) * (seed + 1)
    return out


def mesh(shape, devices=None) -> Mesh:
    devs = np.array(devices if devices is not None else jax.devices())
    return Mesh(devs[:int(np.prod(shape))].reshape(shape), ("a", "b"))


def make_tree(values: dict, m: Mesh, seed: int = 0) -> dict:
    tree = {}
    for name, (shape, _, spec) in LAYOUT.items():
        s = NamedSharding(m, spec)
        v = values[name]
        tree[name] = jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
    tree["np"] = values["np"]
    tree["step"] = 7 + seed
    tree["key"] = jax.jit(lambda: jax.random.key(seed), out_shardings=NamedSharding(m, P()))()
    return tree


def abstract(m: Mesh, seed: int = 0) -> dict:
    """A restore target on mesh `m`: ShapeDtypeStructs with shardings, plus host leaves."""
    values = global_values(seed)
    t = {name: jax.ShapeDtypeStruct(shape, values[name].dtype, sharding=NamedSharding(m, spec))
         for name, (shape, _, spec) in LAYOUT.items()}
    t["np"] = values["np"]
    t["step"] = 0
    t["key"] = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                    sharding=NamedSharding(m, P()))
    return t


def check(restored: dict, seed: int = 0, sharding_of: dict | None = None) -> list[str]:
    """Bit-exact comparison of what this process holds against the global values; [] when equal."""
    values = global_values(seed)
    bad = []
    for name in LAYOUT:
        x = restored[name]
        if not isinstance(x, jax.Array):
            if np.asarray(x).tobytes() != values[name].tobytes() or np.asarray(x).dtype != values[name].dtype:
                bad.append(f"{name}: host value differs")
            continue
        if x.dtype != values[name].dtype or x.shape != values[name].shape:
            bad.append(f"{name}: {x.dtype}{x.shape} vs {values[name].dtype}{values[name].shape}")
            continue
        if sharding_of is not None and x.sharding != sharding_of[name]:
            bad.append(f"{name}: sharding {x.sharding} != {sharding_of[name]}")
        for sh in x.addressable_shards:
            if np.asarray(sh.data).tobytes() != values[name][sh.index].tobytes():
                bad.append(f"{name}: shard {sh.index} on {sh.device} differs")
    if np.asarray(restored["np"]).tobytes() != values["np"].tobytes():
        bad.append("np differs")
    if restored["step"] != 7 + seed:
        bad.append(f"step {restored['step']} != {7 + seed}")
    kd = np.asarray(jax.random.key_data(restored["key"]).addressable_shards[0].data)
    if kd.tobytes() != np.asarray(jax.random.key_data(jax.random.key(seed))).tobytes():
        bad.append("key differs")
    return bad


def replicated_tree(m: Mesh) -> dict:
    """A mostly replicated tree (data parallelism): many replicated leaves of mixed sizes."""
    rng = np.random.default_rng(1)
    rep = NamedSharding(m, P())
    tree = {}
    for i, n in enumerate([300_000, 260_000, 250_000, 200_000, 180_000, 150_000, 120_000, 100_000,
                           90_000, 80_000, 60_000, 50_000, 40_000, 30_000, 20_000, 10_000, 5_000, 1_000]):
        v = rng.standard_normal(n).astype(np.float32)
        tree[f"p{i:02d}"] = jax.make_array_from_callback(v.shape, rep, lambda idx, v=v: v[idx])
    return tree


def row_sharded(m: Mesh, abstract_only: bool = False):
    """A 2 MB float32 array sharded by rows over mesh axis "a" (one zarr chunk per saved shard)."""
    v = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    s = NamedSharding(m, P("a", None))
    if abstract_only:
        return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
    return jax.make_array_from_callback(v.shape, s, lambda idx: v[idx])


def _bytes_read() -> int:
    from ckpt_callbacks.bench_peers import bytes_read   # rchar: every read(2)-family call
    return bytes_read()


def _stats(mngr) -> dict:
    s = mngr.last_stats
    return {"bytes_written": s.bytes_written, "bytes_total": s.bytes_total, "process_index": s.process_index,
            "files": s.files}


def probe(fail_on: int = -1) -> dict:
    """What a child sees; process `fail_on` raises instead (tests the launcher itself)."""
    if jax.process_index() == fail_on:
        raise ValueError(f"failing on purpose in process {fail_on}")
    return {"pi": jax.process_index(), "pc": jax.process_count(), "devices": len(jax.devices()),
            "local": len(jax.local_devices()), "collectives": jax.config.jax_cpu_collectives_implementation}


def save_and_check(root: str, one_process_dir: str | None = None, mesh_shape=(2, 4), other_mesh=(4, 2),
                   locked_dir: str | None = None) -> dict:
    """Save the test tree and a replicated tree from this run; restore them back onto another mesh.

    Also restores `one_process_dir` (saved by a 1-process run) onto this run's mesh, exercises
    retention decided on process 0 with every process told, and (with `locked_dir`, whose lock a
    live process holds) a start-up failure on process 0 that every process must report.
    """
    pi, pc = jax.process_index(), jax.process_count()
    out: dict = {"process_index": pi}
    if locked_dir:
        try:
            cc.CheckpointManager(locked_dir, timeout_s=60)
            out["locked"] = None
        except cc.CheckpointError as e:
            out["locked"] = [type(e).__name__, str(e)]
    m = mesh(mesh_shape)
    if one_process_dir:
        with cc.CheckpointManager(one_process_dir, read_only=True) as r:
            out["from_one_process"] = check(r.restore(target=abstract(m, seed=3)), seed=3)

    tree = make_tree(global_values(), m)
    with cc.CheckpointManager(os.path.join(root, "tree"), timeout_s=60) as mngr:
        assert mngr.save(10, tree, metrics={"loss": 0.5}, host_state={"pos": 100 + pi, "proc": pi})
        mngr.wait_until_finished()
        out["tree_stats"] = _stats(mngr)
        out["steps"] = mngr.all_steps()
        for name, shape in (("same", mesh_shape), ("other", other_mesh)):
            target = abstract(mesh(shape))
            restored = mngr.restore(target=target)   # step None: process 0's latest, told to all
            out[f"restore_{name}"] = check(restored, sharding_of={k: target[k].sharding for k in LAYOUT})
        out["host_state"] = mngr.host_state()
        out["host_numpy"] = check(mngr.restore(10))   # target None: full host numpy on every process

    with cc.CheckpointManager(os.path.join(root, "replicated"), timeout_s=60) as mngr:
        mngr.save(1, replicated_tree(m))
        mngr.wait_until_finished()
        out["replicated_stats"] = _stats(mngr)

    with cc.CheckpointManager(os.path.join(root, "sharded"), timeout_s=60) as mngr:
        mngr.save(1, {"rows": row_sharded(m)})

    with cc.CheckpointManager(os.path.join(root, "retained"), retention=cc.KeepLast(2), timeout_s=60) as mngr:
        for step in range(1, 5):
            mngr.save(step, {"x": np.full(4, step, np.int32), "w": tree["w"]})
        mngr.wait_until_finished()
        out["retained_steps"] = mngr.all_steps()
        out["retained_deleted"] = [list(s.deleted) for s in mngr.history]
        out["retained_x"] = mngr.restore(target={"x": np.zeros(4, np.int32), "w": abstract(m)["w"]})["x"].tolist()
    out.update(fallback_together(os.path.join(root, "fallback"), m))
    out.update(read_only_latest_together(root, m))

    # process 0 cannot list the committed steps when save(2) is called (an outage there only):
    # every process raises CheckpointSaveError, and the next save works on every process
    with cc.CheckpointManager(os.path.join(root, "outage"), timeout_s=60) as mngr:
        mngr.save(1, {"w": tree["w"]})
        mngr.wait_until_finished()
        real, real_has = mngr.store.committed_steps, mngr.store.has_step
        if pi == 0:
            def unreachable(*_):
                raise cc.StorageUnavailableError("list commits/ failed: connection refused")
            mngr.store.committed_steps = mngr.store.has_step = unreachable
        try:
            mngr.save(2, {"w": tree["w"]})
            out["outage_save"] = None
        except cc.CheckpointError as e:
            out["outage_save"] = [type(e).__name__, str(e)]
        mngr.store.committed_steps, mngr.store.has_step = real, real_has
        t0 = time.monotonic()
        mngr.save(3, {"w": tree["w"]})
        mngr.wait_until_finished()
        out["outage_next_s"] = time.monotonic() - t0
        out["outage_steps"] = mngr.all_steps()
    out.update(refusals(os.path.join(root, "refusals"), tree["w"]))
    return out


def refusals(root: str, w) -> dict:
    """A call that one process alone refuses, different steps on two processes, and metrics given
    on one process only: every process must hear of it at once and stay in step (a refusal on one
    process left the save counters apart for good: every later save timed out)."""
    from ckpt_callbacks.flax import CheckpointHook
    pi = jax.process_index()
    out, errors = {}, []
    policies = [cc.KeepBest("loss", "min", 2), cc.KeepLast(2)]
    t0 = time.monotonic()
    with cc.CheckpointManager(os.path.join(root, "m"), retention=policies, timeout_s=60) as mngr:
        mngr.save(1, {"w": w}, metrics={"loss": 0.5} if pi == 0 else None)
        extra = {"extra": np.ones(3)} if pi == 1 else {}   # another tree on process 1: its leaves numbered apart
        for step, tree, kw in ((2, {"w": w}, {"host_state": {"p": object()} if pi == 1 else None}),
                               (3 + pi, {"w": w}, {}),   # (process 0 saves 3, process 1 saves 4)
                               (4, {"w": w, **extra}, {})):
            try:
                mngr.save(step, tree, **kw)
                errors.append(None)
            except cc.CheckpointError as e:
                errors.append([type(e).__name__, str(e)])
        mngr.save(5, {"w": w}, metrics={"loss": 0.25} if pi == 1 else None)
        mngr.save(6, {"w": w})
        mngr.wait_until_finished()
        out["refusal_errors"] = errors
        out["refusal_s"] = time.monotonic() - t0
        out["refusal_steps"] = mngr.all_steps()
        out["refusal_best"] = mngr.best_step()
        out["refusal_metrics"] = [mngr.metrics(s) for s in mngr.all_steps()]
        # restore(step=None) that finds the step deleted (a save committing meanwhile) on process 1
        # only, then damage on process 1 only: process 0 returned data while process 1 raised
        from ckpt_callbacks import restore as restore_mod
        real, calls = restore_mod.restore, []

        def flaky(store, step, target=None, partial=False):
            calls.append(step)
            if pi == 1 and len(calls) == 1:
                raise restore_mod.deleted_error(store, step)
            if pi == 1 and len(calls) == 3:
                raise cc.CorruptCheckpointError(f"step {step}: simulated damage on process 1")
            return real(store, step, target, partial)
        restore_mod.restore = flaky
        try:
            out["deleted_restore"] = [mngr.restore()["w"].shape[0], mngr.restored_step, len(calls)]
            try:
                mngr.restore()
                out["damaged_restore"] = None
            except cc.CheckpointError as e:
                out["damaged_restore"] = [type(e).__name__, str(e)]
            # a named step onto arrays that span both processes: damage found on process 1 only
            # (process 0 returned while process 1 raised), then a step listed on process 0 only
            spec = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)}

            def damaged_on_1(store, step, target=None, partial=False):
                if pi == 1:
                    raise cc.CorruptCheckpointError(f"step {step}: simulated damage on process 1")
                return real(store, step, target, partial)
            restore_mod.restore = damaged_on_1
            for case, listed in (("named_damaged", None), ("named_unlisted", [6] if pi == 0 else [5])):
                real_steps = mngr.all_steps
                if listed is not None:
                    restore_mod.restore = real
                    mngr.all_steps = lambda listed=listed: listed
                try:
                    mngr.restore(6, target=spec)
                    out[case] = None
                except cc.CheckpointError as e:
                    out[case] = [type(e).__name__, str(e)]
                finally:
                    mngr.all_steps = real_steps
        finally:
            restore_mod.restore = real
    with cc.CheckpointManager(os.path.join(root, "hook"), timeout_s=60) as mngr:
        hook = CheckpointHook(mngr, every_steps=4, preemption_signals=())
        out["hook_started"] = [hook(s, {"w": w}, metrics={"loss": 0.1} if s == 3 and pi == 0 else None)
                               for s in range(1, 9)]
        hook.close()
        out["hook_steps"] = mngr.all_steps()
    return out


def read_only_latest_together(root: str, m: Mesh) -> dict:
    """Read-only managers (an eval job's) restore the latest step onto arrays that span both
    processes while step 2 commits between process 0's listing and process 1's: process 0 renames
    step 2 into place right after it listed, process 1 lists only once it is there. Every process
    must read the same step (step 1), or the arrays hold shards of two steps."""
    from jax.experimental import multihost_utils
    pi = jax.process_index()
    d = os.path.join(root, "read_only_latest")
    with cc.CheckpointManager(d, timeout_s=60) as mngr:
        for step in (1, 2):
            mngr.save(step, make_tree(global_values(step), m, seed=step))
    step2, aside = os.path.join(d, "step_0000000002"), os.path.join(root, "read_only_step2")
    if pi == 0:
        os.rename(step2, aside)
    multihost_utils.sync_global_devices("read-only step 2 aside")
    reader = cc.CheckpointManager(d, read_only=True, timeout_s=60)
    if pi == 0:
        listed = reader.all_steps

        def list_then_commit():
            steps = listed()
            os.rename(aside, step2)   # step 2 commits
            return steps
        reader.all_steps = list_then_commit
    else:
        while not os.path.exists(step2):
            time.sleep(0.01)
    restored = reader.restore(target=abstract(m, seed=1))
    out = {"read_only_step": reader.restored_step, "read_only_check": check(restored, seed=1)}
    reader.close()
    return out


def fallback_together(root: str, m: Mesh) -> dict:
    """``restore(fallback=True)`` when only one process meets the problem: a chunk of step 2 that
    only process 1 reads is damaged (every process falls back to step 1), then process 1 cannot
    reach its storage (no process falls back: every process raises StorageUnavailableError, the
    others saying which process failed), then process 0 cannot list the steps."""
    from jax.experimental import multihost_utils
    from ckpt_callbacks import restore as restore_mod
    pi = jax.process_index()
    target = {"rows": row_sharded(m, abstract_only=True)}
    out = {}
    with cc.CheckpointManager(root, timeout_s=60) as mngr:
        for step in (1, 2):
            mngr.save(step, {"rows": row_sharded(m)})
        mngr.wait_until_finished()
        if pi == 0:   # rows 512.. live in chunk c/1/0, which only process 1's shards need
            path = os.path.join(root, "step_0000000002", "arrays", "0", "c", "1", "0")
            data = bytearray(open(path, "rb").read())
            data[1000] ^= 0x20
            open(path, "wb").write(bytes(data))
        multihost_utils.sync_global_devices("damaged")
        restored = mngr.restore(target=target, fallback=True)
        out["fallback_step"] = mngr.restored_step
        out["fallback_ok"] = bool(np.array_equal(
            np.concatenate([np.asarray(s.data) for s in restored["rows"].addressable_shards if s.replica_id == 0]),
            np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)[512 * pi:512 * (pi + 1)]))
        real = restore_mod.leaf_reader._check_backing
        if pi == 1:
            def unreachable(self, rec, where):
                raise cc.StorageUnavailableError(f"{where}: simulated outage on process 1")
            restore_mod.leaf_reader._check_backing = unreachable
        try:
            mngr.restore(target=target, fallback=True)
            out["unavailable"] = None
        except cc.CheckpointError as e:
            out["unavailable"] = [type(e).__name__, str(e)]
        finally:
            restore_mod.leaf_reader._check_backing = real
        # process 0 cannot even list the steps: every process is told, nobody waits out a timeout
        if pi == 0:
            def unlisted():
                raise cc.StorageUnavailableError("simulated listing outage on process 0")
            mngr.all_steps = unlisted
        t0 = time.monotonic()
        try:
            mngr.restore(target=target, fallback=True)
            out["unlisted"] = None
        except cc.CheckpointError as e:
            out["unlisted"] = [type(e).__name__, str(e), time.monotonic() - t0 < 30]
        finally:
            mngr.__dict__.pop("all_steps", None)
        mngr.restore(target=target, fallback=True)   # and all stay in step afterwards
        out["after"] = mngr.restored_step
    return out


def restore_and_save(saved_dir: str, root: str, mesh_shape=(4, 2)) -> dict:
    """Restore a checkpoint written by another process count onto this run's mesh; host-state rules;
    then save this run's own tree and replicated tree."""
    pi = jax.process_index()
    m = mesh(mesh_shape)
    out: dict = {"process_index": pi}
    with cc.CheckpointManager(saved_dir, read_only=True) as r:
        target = abstract(m)
        out["restore"] = check(r.restore(target=target), sharding_of={k: target[k].sharding for k in LAYOUT})
        try:
            r.host_state()
            out["host_state_error"] = None
        except cc.IncompatibleCheckpointError as e:
            out["host_state_error"] = str(e)
        out["host_state_remapped"] = r.host_state(remap={p: p % 2 for p in range(jax.process_count())})
        out["host_state_fn"] = r.host_state(remap=lambda saved, i, n: {"pos": sum(s["pos"] for s in saved.values()), "i": i, "n": n})
    with cc.CheckpointManager(os.path.join(os.path.dirname(saved_dir), "sharded"), read_only=True) as r:
        before = _bytes_read()
        rows = r.restore(target={"rows": row_sharded(m, abstract_only=True)})["rows"]
        out["sharded_bytes_read"] = _bytes_read() - before
        want = np.asarray(row_sharded(mesh((1, 1), jax.local_devices())))
        out["sharded_ok"] = all(np.array_equal(np.asarray(sh.data), want[sh.index]) for sh in rows.addressable_shards)
    with cc.CheckpointManager(os.path.join(root, "tree"), timeout_s=60) as mngr:
        mngr.save(20, make_tree(global_values(), m), host_state={"pos": 200 + pi})
        mngr.wait_until_finished()
        out["tree_stats"] = _stats(mngr)
    with cc.CheckpointManager(os.path.join(root, "replicated"), timeout_s=60) as mngr:
        mngr.save(1, replicated_tree(m))
        mngr.wait_until_finished()
        out["replicated_stats"] = _stats(mngr)
    return out


def die_mid_save(root: str, victim: int, timeout_s: float, phase: str = "sync") -> dict:
    """Commit step 1, then save step 2 while process `victim` dies mid-save (``os._exit(17)``).

    phase "sync": the victim dies after writing its shards, before making them durable/reporting;
    phase "start": it dies right after the snapshot, before the writer's first barrier.
    """
    pi = jax.process_index()
    m = mesh((2, 4))
    mngr = cc.CheckpointManager(root, timeout_s=timeout_s, async_save=True)
    mngr.save(1, make_tree(global_values(1), m, seed=1), host_state={"pos": 1})
    mngr.wait_until_finished()
    out: dict = {"process_index": pi}
    # first an ordinary failure on the victim (a write error): every process learns it, nothing commits
    write = mngr.store.write
    if pi == victim:
        def failing_write(rel, data, sync=True):
            raise OSError(f"injected write failure of {rel.split('/', 1)[1]}")
        mngr.store.write = failing_write
    try:
        mngr.save(2, make_tree(global_values(2), m, seed=2), host_state={"pos": 2})
        mngr.wait_until_finished()
        out["write_error"] = None
    except cc.CheckpointSaveError as e:
        out["write_error"] = {str(k): v for k, v in e.failures.items()}
    mngr.store.write = write
    out["steps_after_write_error"] = mngr.all_steps()
    # then the victim dies mid-save
    if pi == victim:
        def die(*a, **k):
            os._exit(17)
        if phase == "sync":
            mngr.store.sync = die
        else:
            mngr.store.begin = die
    t0 = time.monotonic()
    try:
        mngr.save(2, make_tree(global_values(2), m, seed=2), host_state={"pos": 2})
        mngr.wait_until_finished()
        out["error_type"] = None
    except cc.CheckpointSaveError as e:
        out.update(error_type=type(e).__name__, error=str(e), failures={str(k): v for k, v in e.failures.items()})
    out["elapsed_s"] = time.monotonic() - t0
    out["steps"] = mngr.all_steps()
    out["latest"] = mngr.latest_step()
    out["leftovers"] = mngr.store.leftovers()
    # leave without close(): a real survivor would exit; the lock is taken over as stale on restart
    return out


def resume(root: str) -> dict:
    """Restart after a failed save: clean up, resume from the latest committed step, save the next."""
    pi = jax.process_index()
    m = mesh((2, 4))
    with cc.CheckpointManager(root, timeout_s=60) as mngr:
        out = {"process_index": pi, "latest": mngr.latest_step(), "leftovers": mngr.store.leftovers()}
        out["restore"] = check(mngr.restore(target=abstract(m, seed=1)), seed=1)
        out["host_state"] = mngr.host_state()
        mngr.save(2, make_tree(global_values(2), m, seed=2))
        mngr.wait_until_finished()
        out["steps"] = mngr.all_steps()
        out["restore2"] = check(mngr.restore(2, target=abstract(m, seed=2)), seed=2)
    return out


class _Position:
    """A data iterator with Grain's get_state()/set_state() protocol: its position only."""

    def __init__(self):
        self.pos = 0

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def flax_damaged_host_state(root: str) -> dict:
    """A Flax loop saves steps 1-2 with a data iterator; process 1's host state of step 2 is then
    damaged; a fresh hook's restore_or_init must fail on every process: process 0 alone returned
    (and would have trained on into its first collective with a process that had raised)."""
    from jax.experimental import multihost_utils

    from ckpt_callbacks.flax import CheckpointHook
    m = mesh((2, 4))
    state = {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(m, P("a", "b")))}
    it = _Position()
    with cc.CheckpointManager(root, timeout_s=60) as mngr:
        hook = CheckpointHook(mngr, every_steps=1, data_iterator=it, preemption_signals=())
        for step in (1, 2):
            it.pos = 10 * step + jax.process_index()
            hook(step, state)
        hook.close()
    if jax.process_index() == 1:
        blob = os.path.join(root, "step_0000000002", "host", "p1.msgpack")
        data = bytearray(open(blob, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(blob, "wb").write(bytes(data))
    multihost_utils.sync_global_devices("damaged")
    with cc.CheckpointManager(root, timeout_s=60) as mngr:
        hook = CheckpointHook(mngr, every_steps=1, preemption_signals=())
        try:
            hook.restore_or_init(state, data_iterator=_Position())
            return {"error": None}
        except cc.CheckpointError as e:
            return {"error": [type(e).__name__, str(e)]}
        finally:
            hook.close()
