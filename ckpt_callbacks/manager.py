"""CheckpointManager: which steps get saved, which survive, and what a restart resumes from.

Example::

    import jax, jax.numpy as jnp
    import ckpt_callbacks as cc
    state = {"w": jnp.zeros((4, 4)), "count": 0}
    abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
    train_step = jax.jit(lambda s: {"w": s["w"] + 1, "count": s["count"] + 1})
    with cc.CheckpointManager("/tmp/run", save_interval_steps=100,
                              retention=[cc.KeepLast(3), cc.KeepBest("val_loss", "min", 2)]) as mngr:
        start = (mngr.latest_step() or 0)
        state = mngr.restore(target=abstract_state) if mngr.latest_step() is not None else state
        for step in range(start + 1, 1_000):
            state = train_step(state)
            mngr.save(step, state, metrics={"val_loss": 0.3})   # returns after the snapshot

Who calls what: every process constructs the manager and calls `save`/`restore` with the same
arguments in the same order (SPMD). `save` runs on the caller's thread only for the snapshot; a
background thread, started alongside it, writes, commits, then (process 0) applies retention
and deletes, and tells the other processes, which wait for it (so every process then sees the
same committed steps). One save is in flight at a time: the next `save`, `wait_until_finished`
or `close` waits for it and re-raises its failure. Start-up (process 0): check the directory is
writable, take the writer lock, remove leftovers of crashed saves (only names this package
creates); the other processes wait for its outcome and raise if it failed. A manager left open
with a save in flight when the interpreter exits normally is closed then (before Python stops
the thread pools its writer uses), so that save commits, with a warning that `close` was not
called. Multi-host details: docs/multihost.md. Which step a restore reads, on every process, and
which host state it resumes from: `ckpt_callbacks.resume`; at exit, in a forked child and at the
end of a ``with`` block: `ckpt_callbacks.shutdown`; argument checks: `ckpt_callbacks.checks`.

Saving a step that is already committed never overwrites it: the save is skipped with a warning
(the resumed-run case) and returns False; ``force=True`` replaces it: readers see the old step or
the new one, never a mix (POSIX: two renames; a crash between them puts the old step back at the
next start; object stores: see docs/storage.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import queue
import threading
import time

import msgpack

from . import coordination, lock, restore as restore_mod, resume, shutdown, snapshot
from . import format as fmt
from .checks import check_flag, check_metrics, check_save_options, check_step
from .errors import (CheckpointError, CheckpointNotFoundError, CheckpointSaveError, ConfigError,
                     CorruptCheckpointError, StorageUnavailableError)
from .retention import KeepBest, StepInfo, as_int, as_policies, best_policy, decide, has_number
from .storage import open_store
from .localwrite import Workers, WriteThrough
from .writing import SaveStats, write_and_commit

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckpt_callbacks")


def _began(t: threading.Thread, within_s: float = 5.0) -> bool:
    """Whether thread `t` runs (or ran), for a `start()` that an exception interrupted: it
    either never started the thread or did, and then the thread sets its ident at once."""
    deadline = time.monotonic() + within_s
    while t.ident is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return t.ident is not None


class CheckpointManager:
    """Saves, retains and restores the steps of one training run.

    Example (the methods' examples continue this one)::

        import jax, jax.numpy as jnp
        import ckpt_callbacks as cc
        mngr = cc.CheckpointManager("/tmp/run", retention=cc.KeepLast(2))
        for step in (1, 2, 3):
            mngr.save(step, {"w": jnp.full(3, step)}, metrics={"loss": 1 / step})

    The order of calls, the threads and the processes: see the module docstring.

    Args:
      directory: local path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix``.
      save_interval_steps: `save(step)` saves when ``step % N == 0`` (or with ``force=True``).
      retention: None (keep all), a policy, a list of policies (kept if any keeps), or a config dict.
      async_save: False makes `save` return only after the commit (and retention).
      max_staging_bytes: cap on host bytes held for staging (a shard is copied whole: a shard
        larger than the cap is staged alone); None copies everything at once.
      timeout_s: limit on every cross-process wait of a save (barriers, gathers).
      clock: the time recorded as a step's save time (inject for tests of time-based retention).
      read_only: open for restore only: no lock, no cleanup, `save` raises.
    """

    def __init__(self, directory, *, save_interval_steps: int = 1, retention=None, async_save: bool = True,
                 max_staging_bytes: int | None = None, timeout_s: float = 600.0, clock=time.time,
                 read_only: bool = False, coordinator: coordination.Coordinator | None = None):
        if (interval := as_int(save_interval_steps)) is None or interval < 1:
            raise ConfigError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}")
        save_interval_steps = interval
        check_save_options(async_save, max_staging_bytes)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        check_flag("read_only", read_only)
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning the time in seconds (like time.time), got {clock!r}")
        self.directory = os.fspath(directory) if isinstance(directory, os.PathLike) else directory
        if not isinstance(self.directory, str) or not self.directory.strip():
            raise ConfigError(f"directory must be a path or a URL (str or os.PathLike), got {directory!r}")
        self.store = open_store(self.directory)
        self.save_interval_steps = save_interval_steps
        self.policies = as_policies(retention)
        self.async_save = async_save
        self.max_staging_bytes = None if max_staging_bytes is None else int(max_staging_bytes)
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.read_only = read_only
        self.coord = coordinator or coordination.current()
        if not read_only:  # one key-value scope per writing manager (same order on every process)
            self.coord = coordination.for_directory(self.coord, self.store.url)
        self._nsaves = self._nrestores = 0
        self.history: list[SaveStats] = []
        self._infos: dict[int, StepInfo] = {}
        self._info_tokens: dict = {}   # step -> its `_local_token` when its info was read (see `_step_infos`)
        self._damaged: dict[int, str] = {}   # committed steps whose manifest could not be read: why
        self.restored_step: int | None = None   # the step the last restore() read
        self._warned_below = False   # `_warn_below` said it once
        self._top_saved = -1   # the highest step this manager committed (`_warn_below`)
        self._warned_unranked: set[str] = set()   # `_warn_unranked` said it for these metrics
        self._thread: threading.Thread | None = None
        self._pool = snapshot.HostPool()   # warm buffers for the copies of host-side leaves
        self._workers: Workers | None = None   # the writer's threads, started at the first save
        self._error: BaseException | None = None
        self._closed = False
        self._locked = False
        self._caller: threading.Thread | None = None   # the thread of the last save
        # saves, waits and close take turns (several threads may save through one manager)
        self._turn = threading.RLock()
        self._pid = os.getpid()   # a forked child's copy must not write (see `_check_process`)
        if not read_only:
            self._start_up()
            shutdown.watch(self)

    # -- start-up -----------------------------------------------------------------------------
    def _start_up(self) -> None:
        """Process 0 checks, locks and cleans; the others wait for its outcome and share its failure."""
        err = None
        if self.coord.process_index == 0:
            try:
                self.store.check_writable()
                if self.store.local:
                    lock.acquire(self.store.root)
                    self._locked = True
                for step in self.store.recover():
                    log.warning("ckpt_callbacks: put back step %d, whose forced replacement was interrupted", step)
                for name in self.store.leftovers():
                    log.info("ckpt_callbacks: removing leftover %s of an interrupted save or deletion", name)
                    self.store.remove(name)
            except Exception as e:  # noqa: BLE001 - told to the other processes, then re-raised
                err = e
        if self.coord.process_count > 1:
            msg = None if self.coord.process_index else msgpack.packb(
                None if err is None else f"{type(err).__name__}: {err}")
            got = msgpack.unpackb(self.coord.broadcast("startup", msg, self.timeout_s))
            if got is not None and err is None:
                raise CheckpointError(f"process 0 could not open {self.store.url} for writing: {got}")
        if err is not None:
            raise err

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, tree, *, metrics: dict | None = None, force: bool = False,
             host_state=None) -> bool:
        """Save `tree` as `step` if due; returns True when a save started (async: after the snapshot).

        Example::

            mngr.save(4, {"w": jnp.full(3, 4)}, metrics={"loss": 0.25}, host_state={"data": {"pos": 4}})  # True

        `metrics` (str -> number) are stored in the manifest and drive `KeepBest`. `host_state`
        is this process's own msgpack-able state (e.g. a data iterator's `get_state()`).
        """
        check_flag("force", force)
        return self._save(step, tree, metrics=metrics, host_state=host_state, due=force, replace=force)

    def _save(self, step, tree, **kw) -> bool:
        """`save`; also `CheckpointHook.save`'s: `due` skips the interval check, `replace` allows
        replacing a committed step, `quiet` skips a committed step without a warning. Calls from
        several threads take turns: each waits for the save before it (as one thread's would)."""
        self._check_process()   # (before the turn: a child's copy of it may be held for good)
        with self._turn:
            return self._save_in_turn(step, tree, **kw)

    def _save_in_turn(self, step, tree, *, metrics=None, host_state=None, due=False, replace=False,
                      quiet=False) -> bool:
        if self._closed or self.read_only:
            raise CheckpointError("save on a closed or read-only CheckpointManager")
        step = check_step(step)
        if self._error is not None:   # a failed save is told by the next call, due or not
            self._wait()
        if not due and step % self.save_interval_steps:
            return False
        refused = None   # this process's checks of the call: told to the others, who refuse it too
        try:
            if self._locked:
                lock.check(self.store.root)
            metrics = check_metrics(metrics)
            try:
                host_bytes = None if host_state is None else fmt.pack_host_state(host_state)
            except TypeError as e:
                raise ConfigError(f"host_state must be msgpack-able (dicts, lists, str, bytes, bool, None, "
                                  f"numbers within 64 bits): {e}") from None
            snap = snapshot.plan(tree, coord=self.coord)
        except Exception as e:  # noqa: BLE001 - raised here, after the other processes hear of it
            if self.coord.process_count == 1:
                raise
            refused = e
        self._wait()
        self._caller = threading.current_thread()
        self._pool.recycle()   # the previous save's writer is joined: its copies are free again
        token, committed, metrics = self._agree_to_save(step, metrics, refused, replace,
                                                        None if refused is not None else snap)
        if committed and not replace:
            if not quiet:
                log.warning("ckpt_callbacks: step %d is already committed in %s; not saving it again "
                            "(pass force=True to replace it)", step, self.store.url)
            return False
        if self.coord.process_index == 0:
            self._warn_unranked(step, metrics)
        budget = snapshot.ByteBudget(self.max_staging_bytes)
        items: queue.SimpleQueue = queue.SimpleQueue()
        save_time = self.clock()
        extra_info = {"time": save_time}
        # For `ckpt-callbacks ls/timeline`: the ranking policy, and the previous save's commit/gc
        # timings (a manifest is written before its own commit, so they land in the next one).
        if (bp := best_policy(self.policies)) is not None:
            extra_info["keep_best"] = {"metric": bp.metric, "mode": bp.mode, "n": bp.n}
            if getattr(bp, "threshold", None) is not None:   # (the Keras callback's initial_value_threshold)
                extra_info["keep_best"]["threshold"] = float(bp.threshold)
        if self.history:
            prev = self.history[-1]
            extra_info["prev"] = {"step": prev.step, "started": prev.started, "commit_s": prev.commit_s,
                                  "gc_s": prev.gc_s, "deleted": list(prev.deleted)}

        if self._workers is None and self.store.local:
            self._workers = Workers()
        # write-through overwrites cached pages; on a disk the pool's page-aligned copies go by
        # O_DIRECT instead, and leave (almost) no page cache for a later save to overwrite. Without
        # write-through nothing lands in the staging directory before the writer's `begin`, which
        # may then make it the directory of a step that retention deleted (`LocalStore.begin`).
        through_ok = self.store.local and not self.store.direct_io

        def run():
            try:
                stats = write_and_commit(self.store, step, snap, items, coord=self.coord, metrics=metrics,
                                         host_state=host_bytes, budget=budget, replace=replace, token=token,
                                         timeout_s=self.timeout_s, extra=extra_info, workers=self._workers,
                                         reuse_tree=self.store.local and not through_ok)
                self._infos[step] = StepInfo(step, save_time, metrics)
                self._info_tokens[step] = self._local_token(step)
                self._damaged.pop(step, None)   # a forced save replaced a damaged step
                self._top_saved = max(self._top_saved, step)
                stats = self._retain(stats, token)
                self.history.append(stats)
                log.info("ckpt_callbacks: committed step %d to %s: %.1f MB, blocking %.3fs, total %.3fs%s",
                         step, self.store.url, stats.bytes_total / 1e6, stats.blocking_s, stats.total_s,
                         f", deleted steps {list(stats.deleted)}" if stats.deleted else "")
            except BaseException as e:  # noqa: BLE001 - re-raised by the next call
                self._error = e

        # The writer starts first, alongside the snapshot: a budget may make the copies wait for
        # it; on tmpfs the write-through runs during the snapshot anyway; and where the snapshot
        # copies into the pool (CPU training) its start, first chunk CRCs and write submissions
        # use the cores that the paused training leaves idle, where later they would be taken
        # from training (Keras fit on disk, 2 vCPUs, six interleaved A/Bs: per-round median
        # overheads 2-10 points lower, hooks ~1 ms longer; docs/benchmarks-log.md).
        # (a KeyboardInterrupt may land anywhere from here on, inside `start()` too: the writer
        # then gets the abort all the same, or, where it never began, its clean-up runs here)
        self._thread = t = threading.Thread(target=run, name=f"ckpt_callbacks-save-{step}", daemon=True)
        try:
            t.start()
            through = WriteThrough(self.store, step, token, snap, self._workers) if through_ok else None
            snapshot.copy(snap, items.put, budget, self._pool, through)
        except BaseException as e:
            items.put(("abort", e))
            items.put(None)
            self._thread = None
            if _began(t):
                t.join()   # it takes the abort and cleans up as usual
            else:
                run()
            self._error = None
            raise
        if not self.async_save:
            self._wait()
        return True

    def _warn_below(self, step: int, steps: list) -> None:
        """(Process 0, once per manager.) A save below the directory's latest committed step, e.g. a
        new run started in an old run's directory without restoring: retention ranks steps by
        number, so `KeepLast` deletes such a step right after it commits, and a later restore
        reads the old run's latest; a step that run committed is not saved again (the Flax hook
        skips it without a word). Said, not refused: the save goes on. Not said where this manager
        committed the latest step itself (the run is this one; e.g. a final save of an earlier step)."""
        if self._warned_below or not steps or step >= steps[-1] or self._top_saved >= steps[-1]:
            return
        self._warned_below = True
        log.warning("ckpt_callbacks: saving step %d below the latest committed step %d in %s (an earlier "
                    "run's?): retention ranks steps by number, so a KeepLast policy deletes the steps saved "
                    "below it as soon as they commit, a step committed already is not saved again, and "
                    "restore() reads step %d. To continue that run, restore() first and save the steps "
                    "after it; for a new run, use a new directory.", step, steps[-1], self.store.url, steps[-1])

    def _warn_unranked(self, step: int, metrics: dict) -> None:
        """(Process 0, once per metric.) Metrics saved without the one a `KeepBest` ranks by: such a
        step never ranks. Expected for saves without evaluation; a typo otherwise, which would
        leave no step ranked and the best steps deleted as they fall out of the other policies."""
        if not metrics:
            return
        for p in self.policies or []:
            if isinstance(p, KeepBest) and p.metric not in self._warned_unranked and not has_number(metrics, p.metric):
                self._warned_unranked.add(p.metric)
                log.warning("ckpt_callbacks: retention ranks steps by %r (KeepBest), but the metrics saved with step "
                            "%d do not have it (they have: %s): such steps never rank as best. Expected for saves "
                            "without evaluation (e.g. Keras epochs without validation, validation_freq > 1); "
                            "otherwise check the metric's name.", p.metric, step, ", ".join(sorted(metrics)))

    def _agree_to_save(self, step: int, metrics: dict, refused: Exception | None,
                       replace: bool = False, snap=None) -> tuple[str, bool, dict]:
        """(the save's token, whether `step` is committed, the metrics to record), the same on every
        process: with several processes, each listing for itself could answer differently (an
        outage on one) and leave their save counters apart for good. So do a call that only one
        process refuses (its own checks: metrics, host state, tree), saves of different steps
        (e.g. threads whose saves reach the processes in different orders), and metrics given on
        one process only: every process hears of all of it here, and refuses alike (nothing
        started; the next save tries again). The metrics recorded are process 0's, or, where it
        gave none, the first process's that did. A listing that fails fails the save everywhere
        (CheckpointSaveError). Trees planned differently (`snapshot.structure`: another key, shape,
        dtype or sharding on one process) are refused too, naming the first difference: each
        process would write files the others' manifest names otherwise, and the step, committed,
        would read as damaged."""
        pi, multi = self.coord.process_index, self.coord.process_count > 1
        why = None if refused is None else f"{type(refused).__name__}: {refused}"
        digest, lines = snapshot.structure(snap) if multi and snap is not None else (None, None)
        mine, error = [step, why, metrics if refused is None else {}, None, False, None, digest], None
        if pi == 0:
            try:
                steps = self.all_steps()
                mine[3:5] = [os.urandom(6).hex(), step in steps]
                if not replace:
                    self._warn_below(step, steps)
            except Exception as e:  # noqa: BLE001 - told to the others, then raised everywhere
                error = e
                mine[5] = f"{type(e).__name__}: {self.store.redact(str(e))}"
        got = [mine]
        if multi:
            self._nsaves += 1
            got = [msgpack.unpackb(g) for g in self.coord.all_gather(
                f"save/{self._nsaves}/agree", msgpack.packb(mine), self.timeout_s)]
        steps = {i: g[0] for i, g in enumerate(got)}
        if len(set(steps.values())) > 1:
            raise CheckpointSaveError(
                f"nothing was saved: the processes called save() with different steps ({steps}); every "
                f"process must save the same steps in the same order (one thread saving per process)",
                {i: f"step {s}" for i, s in steps.items()})
        failures = {i: g[1] for i, g in enumerate(got) if g[1] is not None}
        if refused is not None:
            raise refused
        if failures:
            raise CheckpointSaveError(
                f"step {step} was not saved: process(es) {sorted(failures)} refused the call "
                f"({'; '.join(f'{i}: {w}' for i, w in failures.items())}); nothing was started", failures)
        if len({g[6] for g in got}) > 1:
            self._refuse_other_trees(step, got, lines)
        token, committed, failed = got[0][3:6]
        if failed is not None:
            raise CheckpointSaveError(
                f"step {step} was not saved: the committed steps of {self.store.url} cannot be listed "
                f"({failed}); nothing was started, the next save tries again", {0: failed}) from error
        return token, committed, got[0][2] or next((g[2] for g in got if g[2]), {})

    def _refuse_other_trees(self, step: int, got: list, lines: list) -> None:
        """CheckpointSaveError naming, for each process whose tree differs from process 0's, the first
        leaf that differs (every process exchanges its leaf lines: only on this failure path)."""
        every = [msgpack.unpackb(g) for g in self.coord.all_gather(
            f"save/{self._nsaves}/trees", msgpack.packb(lines), self.timeout_s)]
        first, failures = every[0], {}
        for p, other in enumerate(every[1:], 1):
            if got[p][6] == got[0][6]:
                continue
            i = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
            has = other[i] if i < len(other) else f"no leaf #{i} ({len(other)} leaves)"
            want = first[i] if i < len(first) else f"no leaf #{i} ({len(first)} leaves)"
            failures[p] = f"leaf #{i}: {has}; process 0: {want}" if i < max(len(first), len(other)) else \
                "the same leaves in another tree structure"
        raise CheckpointSaveError(
            f"step {step} was not saved: the processes passed different trees (every process must save the "
            f"same tree: the same keys, shapes, dtypes and shardings; per-process data goes in host_state): "
            + "; ".join(f"process {p} at {w}" for p, w in failures.items()) + "; nothing was started", failures)

    def _retain(self, stats: SaveStats, token: str = "") -> SaveStats:
        """Process 0 decides and deletes; then it tells the others (who wait), so that every
        process sees the same committed steps once its save has finished."""
        if self.policies is None:
            return stats
        t0 = time.perf_counter()
        deleted, err = [], None
        if self.coord.process_index == 0:
            doing = "reading the steps' metrics"
            try:
                # the chunk files of steps deleted after the previous save were there for this
                # save to overwrite (localstore.LocalStore.claim); what it did not take goes now
                self.store.drop_reusable(self._workers and self._workers.fsync)
                infos = self._step_infos()
                keep = decide(self.policies, infos)
                for s in sorted(i.step for i in infos if i.step not in keep):
                    doing = f"deleting step {s}"
                    self.store.delete(s, reuse=True)
                    deleted.append(s)
            except StorageUnavailableError as e:   # nothing is lost by waiting: tried again after the next save
                log.warning("ckpt_callbacks: retention after step %d skipped (storage unavailable): %s", stats.step, e)
            except Exception as e:  # noqa: BLE001 - told to the others, then raised
                err = CheckpointError(
                    f"step {stats.step} was committed, but retention failed {doing} in {self.store.url}: "
                    f"{type(e).__name__}: {self.store.redact(str(e))}. Nothing committed was lost: the steps "
                    f"not deleted stay listed, and retention runs again after the next save.")
                err.__cause__ = e
        if self.coord.process_count > 1:
            msg = msgpack.packb([deleted, None if err is None else str(err)])
            deleted, remote = msgpack.unpackb(self.coord.broadcast(
                f"retain/{token}", msg if self.coord.process_index == 0 else None, self.timeout_s))
            if remote is not None and err is None:
                err = CheckpointError(f"(on process 0) {remote}")
        for s in deleted:
            self._infos.pop(s, None)
            self._info_tokens.pop(s, None)
        if err is not None:
            raise err
        return dataclasses.replace(stats, gc_s=time.perf_counter() - t0, deleted=tuple(deleted))

    def _local_token(self, step: int):
        """`Store.step_token` where it costs a `stat` (a local directory), else None."""
        return self.store.step_token(step) if self.store.local else None

    def _step_infos(self) -> list[StepInfo]:
        """Each committed step's time and metrics, read once from its manifest; read again where a
        local step was replaced since (a forced save through another manager or process)."""
        steps = self.store.committed_steps()
        for s in steps:
            token = self._local_token(s)
            if s in self._infos and self._info_tokens.get(s) != token:
                del self._infos[s]
            if s not in self._infos:
                self._info_tokens[s] = token
                try:
                    m = restore_mod.read_manifest(self.store, s)
                    self._infos[s] = StepInfo(s, float((m.get("extra") or {}).get("time", m.get("time", 0.0))),
                                              m.get("metrics") or {})
                except StorageUnavailableError:
                    raise   # says nothing about the step: not remembered as metric-less
                except CheckpointError as e:
                    # damaged: listed, never ranked, never deleted by retention (its metrics are
                    # unknown: it may be the best), as `ckpt-callbacks gc` does; read again next time
                    if s not in self._damaged:
                        log.warning("ckpt_callbacks: step %d in %s: cannot read its manifest (%s); kept "
                                    "(run `ckpt-callbacks verify`)", s, self.store.url, e)
                    self._damaged[s] = str(e)
                    continue
                self._damaged.pop(s, None)
        infos = [self._infos.get(s) for s in steps]   # background retention may drop a step meanwhile
        return [i for i in infos if i is not None]

    def _wait(self) -> None:
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def wait_until_finished(self) -> None:
        """Wait for the save in flight and its retention deletions; re-raise a background failure.

        Example::

            mngr.wait_until_finished()   # step 4 committed and step 2 deleted (KeepLast(2)), or the failure raised
        """
        self._check_process()
        with self._turn:
            try:
                self._wait()
            finally:
                self.store.drop_reusable(self._workers and self._workers.fsync)

    def _own_save_first(self) -> None:
        """Before a read: wait for this manager's save in flight, which then has committed (or
        failed: its failure is raised here, as `wait_until_finished` raises it). Without this a
        restore right after ``save(s, tree)`` did not find step `s` (the background write had not
        committed it yet); Orbax's async restore waits likewise. Listing (`all_steps`,
        `latest_step`) stays committed-only and never waits."""
        # (read unlocked: None means no save of ours in flight now; a forked child has no writer)
        if self._thread is not None and os.getpid() == self._pid:
            with self._turn:
                self._wait()

    def _check_process(self, reading: bool = False) -> None:
        """A forked child's copy of a writing manager has no writer threads (a save would hang) and
        must not touch what its parent writes; and tensorstore, once the parent has used it, aborts
        a forked child that uses it (a restore): both refused."""
        if os.getpid() != self._pid and (reading or not self.read_only):
            raise CheckpointError(
                f"this CheckpointManager of {self.store.url} was created in process {self._pid}, and this is a "
                f"forked child ({os.getpid()}); a child can neither save nor restore through its parent's "
                f"manager (tensorstore, once used, aborts a forked child that uses it). Fix: save and restore "
                f"in the parent, or start the worker with the 'spawn' or 'forkserver' method and create a "
                f"CheckpointManager there")

    @property
    def last_stats(self) -> SaveStats | None:
        return self.history[-1] if self.history else None

    # -- reading ------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps, ascending (never a step still being written).

        Example::

            mngr.all_steps()   # [3, 4]
        """
        return self.store.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step; None when there is none.

        Example::

            mngr.latest_step()   # 4
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with `step`; None when it is not committed. A step whose manifest
        cannot be read raises `CorruptCheckpointError`.

        Example::

            mngr.metrics(4)   # {'loss': 0.25}
        """
        step = check_step(step)
        if step not in self.all_steps():
            return None
        if not self.store.local:   # no cheap token says whether the step changed: one read of its manifest
            self._infos.pop(step, None)
        self._step_infos()
        why = self._damaged.get(step)
        if why is not None:
            raise CorruptCheckpointError(f"step {step} in {self.store.url}: its manifest cannot be read "
                                         f"({why}); run `ckpt-callbacks verify`")
        info = self._infos.get(step)
        return None if info is None else dict(info.metrics)

    def best_step(self) -> int | None:
        """Best committed step by the KeepBest policy in `retention`; None without one.

        Example::

            mngr.best_step()   # None: this manager's retention has no KeepBest
            cc.CheckpointManager("/tmp/run", read_only=True, retention=cc.KeepBest("loss")).best_step()   # 4
        """
        p = best_policy(self.policies)
        if p is None:
            return None
        ranked = p.rank(self._step_infos())
        return ranked[0] if ranked else None

    def restore(self, step: int | None = None, target=None, *, fallback: bool = False):
        """Restore `step` (latest committed when None) onto `target` (see `ckpt_callbacks.restore`).

        Example::

            mngr.restore()["w"]   # the latest step as host numpy: array([4, 4, 4], dtype=int32)
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            mngr.restore(3, target={"w": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=device)})   # jax.Arrays

        With several processes and ``step=None``, process 0 picks the latest step and tells the
        others, so every process restores the same step even while a save commits concurrently.

        A damaged step raises `CorruptCheckpointError` (it stays listed). With ``fallback=True``
        and ``step=None``, a damaged step is skipped with a warning and the next older committed
        step is tried (every process moves together; a read-only manager decides alone on each
        process); `restored_step` says which step was read. Storage that cannot be reached or
        refuses access raises `StorageUnavailableError` (on every process, when several move
        together) and is never a reason to fall back: it says nothing about the step.

        A step deleted while it is read (a writer elsewhere saving on with `KeepLast`, say) raises
        `CheckpointNotFoundError`; with ``step=None`` in one process the steps are listed again
        and the new latest is read instead (a few times at most).

        This manager's own save in flight is waited for first (`_own_save_first`), so ``save(s,
        tree)`` then ``restore(s)`` (or ``restore()``) reads step `s`.
        """
        check_flag("fallback", fallback)
        self._check_process(reading=True)
        self._own_save_first()
        for attempt in range(3):
            try:
                return resume.read(self, step, target, fallback)
            except CheckpointNotFoundError as e:   # (with several processes: raised on all of them alike)
                if step is not None or not getattr(e, "deleted", False) or attempt == 2:
                    raise
                log.warning("ckpt_callbacks: %s; restoring the latest step again", e)

    def host_state(self, step: int | None = None, process_index: int | None = None, *, remap=None):
        """This process's host state saved with `step` (None if none was saved).

        Example::

            mngr.host_state(4)   # {'data': {'pos': 4}}

        Host state is saved per process index. When the checkpoint was written by a different
        number of processes than this run has, this raises `IncompatibleCheckpointError` unless
        you say which state this process takes: ``process_index=`` (read that saved process's
        state), ``remap={this_process: saved_process, ...}``, or ``remap=fn`` called as
        ``fn(saved: dict[int, state], process_index, process_count) -> state``. An index (given or
        remapped to) of no process whose state the step holds is a `ConfigError`, not None.
        This manager's own save in flight is waited for first, as by `restore`.
        """
        self._own_save_first()
        step = self._resolve(step)
        try:
            return resume.host_state(self, step, process_index, remap)
        except CorruptCheckpointError as e:
            raise resume.named(self.store.url, step, e) from None

    def _resolve(self, step):
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.store.url}")
            return steps[-1]
        step = check_step(step)
        if step not in steps:
            raise CheckpointNotFoundError(f"step {step} is not a committed checkpoint in {self.store.url} "
                                          f"(committed: {steps[-10:]}{' ...' if len(steps) > 10 else ''})")
        return step

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure), then release the directory. In a
        forked child, the parent's manager is only marked closed there (the parent's to close).

        Example::

            mngr.close()   # or use the manager as a context manager: ``with cc.CheckpointManager(...) as mngr:``
        """
        if os.getpid() != self._pid:
            self._closed = True
            return
        with self._turn:
            self._close_in_turn()

    def _close_in_turn(self) -> None:
        if self._closed:
            return
        try:
            self._wait()
        finally:
            self._closed = True
            try:
                self.store.drop_reusable(self._workers and self._workers.fsync)
            finally:
                try:
                    if self._workers is not None:
                        self._workers.close()
                        self._workers = None
                    self._pool.clear(background=True)
                finally:
                    if self._locked:   # whatever failed above, the directory is free again
                        lock.release(self.store.root)
                        self._locked = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        shutdown.close_on_exit(self.close, exc, self.store)
        return False

    def __del__(self):
        workers = getattr(self, "_workers", None)
        if workers is not None:   # an unclosed manager: its writer threads end with it
            workers.chunks.shutdown(wait=False)
            workers.fsync.shutdown(wait=False)
        if getattr(self, "_locked", False) and not getattr(self, "_closed", True):
            try:
                lock.release(self.store.root)
            except Exception:  # noqa: BLE001
                pass
