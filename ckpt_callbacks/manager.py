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
end of a ``with`` block: `ckpt_callbacks.shutdown`; argument checks: `ckpt_callbacks.checks`;
what the processes agree on before a save: `ckpt_callbacks.agreement`; retention after a commit:
`ckpt_callbacks.retain`.

Saving a step that is already committed never overwrites it: the save is skipped with a warning
(the resumed-run case) and returns False; ``force=True`` replaces it: readers see the old step or
the new one, never a mix (POSIX: two renames; a crash between them puts the old step back at the
next start; object stores: see docs/storage.md).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import msgpack

from . import agreement, coordination, hostmem, lock, retain, resume, shutdown, snapshot
from . import format as fmt
from .checks import check_flag, check_metrics, check_save_options, check_step, check_timeout
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     StorageUnavailableError)
from .retention import StepInfo, as_int, as_policies, best_policy
from .storage import open_store, threads_refused
from .localwrite import Workers, WriteThrough
from .writing import SaveStats, write_and_commit

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckpt_callbacks")


def _writer(fn, name: str) -> threading.Thread:
    """The writer thread of one save (daemon, not started); its `finished` event is set once
    `fn` has returned. Wait for it with `_join`.

    Example::

        t = _writer(run, "ckpt_callbacks-save-4")
        t.start()
        _join(t)   # run() has returned
    """
    finished = threading.Event()

    def body():
        try:
            fn()
        finally:
            finished.set()

    t = threading.Thread(target=body, name=name, daemon=True)
    t.finished = finished
    return t


def _join(t: threading.Thread) -> None:
    """Wait until writer `t` (`_writer`) is done: by its event, and then `join()`. A `join()` alone
    that a KeyboardInterrupt (Ctrl-C) interrupts marks a thread still running as stopped (CPython
    3.11's `_wait_for_tstate_lock`), and every later `join()` and `is_alive()` took the save in
    flight for done; an interrupted `Event.wait()` leaves nothing changed."""
    t.finished.wait()
    t.join()


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
        check_timeout(timeout_s)
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
        self._nhook_calls = 0   # CheckpointHook's per-step agreements: hooks sharing it in turn reuse no key
        self.history: list[SaveStats] = []
        self._infos: dict[int, StepInfo] = {}
        self._info_tokens: dict = {}   # step -> its `retain.local_token` when its info was read
        self._damaged: dict[int, str] = {}   # committed steps whose manifest could not be read: why
        self._fell_past: set[int] = set()   # damaged steps a fallback restore went past (`retain.step_infos`)
        self.restored_step: int | None = None   # the step the last restore() read
        self._warned_below = False   # `agreement.warn_below` said it once
        self._top_saved = -1   # the highest step this manager committed (`agreement.warn_below`)
        self._listed_top = float("inf")   # the latest step when `agreement.warn_below` last listed them
        self._warned_unranked: set[str] = set()   # `agreement.warn_unranked` said it for these metrics
        self._thread: threading.Thread | None = None   # the save in flight's `_writer`
        self._pool = hostmem.HostPool()   # warm buffers for the copies of host-side leaves
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
            if got is not None and err is None:   # an outage as on process 0: a caller that retries
                outage = got.startswith(f"{StorageUnavailableError.__name__}:")   # does so on every process
                cls = StorageUnavailableError if outage else CheckpointError
                raise cls(f"process 0 could not open {self.store.url} for writing: {got}")
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
        replacing a committed step, `quiet` skips a committed step without a warning, `refused` is
        the caller's own failure in building the call (the hook's data iterator), told to the other
        processes and raised as this process's refusal of the call. Calls from
        several threads take turns: each waits for the save before it (as one thread's would)."""
        self._check_process()   # (before the turn: a child's copy of it may be held for good)
        with self._turn:
            return self._save_in_turn(step, tree, **kw)

    def _save_in_turn(self, step, tree, *, metrics=None, host_state=None, due=False, replace=False,
                      quiet=False, refused: Exception | None = None) -> bool:
        if self._closed or self.read_only:
            raise CheckpointError("save on a closed or read-only CheckpointManager")
        step = check_step(step)
        if self._error is not None:   # a failed save is told by the next call, due or not
            self._wait()
        if not due and step % self.save_interval_steps:
            return False
        # this process's checks of the call: told to the others, who refuse it too
        try:
            if refused is not None:
                raise refused
            if self._locked:
                lock.check(self.store.root)
            metrics = check_metrics(metrics)
            try:
                host_bytes = None if host_state is None else fmt.pack_host_state(host_state)
            except (TypeError, ValueError) as e:   # (ValueError: a str with a lone surrogate, nesting too deep)
                raise ConfigError(f"host_state must be msgpack-able (dicts, lists, valid Unicode str, bytes, bool, "
                                  f"None, numbers within 64 bits): {e}") from None
            snap = snapshot.plan(tree, coord=self.coord)
        except Exception as e:  # noqa: BLE001 - raised here, after the other processes hear of it
            if self.coord.process_count == 1:
                raise
            refused = e
        self._wait()
        self._caller = threading.current_thread()
        self._pool.recycle()   # the previous save's writer is joined: its copies are free again
        token, committed, metrics = agreement.agree(self, step, metrics, refused, replace,
                                                    None if refused is not None else snap)
        if committed and not replace:
            if not quiet:
                log.warning("ckpt_callbacks: step %d is already committed in %s; not saving it again "
                            "(pass force=True to replace it)", step, self.store.url)
            return False
        if self.coord.process_index == 0:
            agreement.warn_unranked(self, step, metrics)
        # At interpreter exit on Python 3.12+ no thread can be started (a non-daemon thread saving
        # after the main thread returned): this save then runs on the caller's thread, whole, as
        # with async_save=False (its copies first: a staging budget would wait for a writer that
        # runs only after them, so it does not apply)
        inline = threads_refused()
        budget = hostmem.ByteBudget(None if inline else self.max_staging_bytes)
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
                self._info_tokens[step] = retain.local_token(self, step)
                self._damaged.pop(step, None)   # a forced save replaced a damaged step
                self._fell_past.discard(step)
                self._top_saved = max(self._top_saved, step)
                stats = retain.apply(self, stats, token)
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
        self._thread = t = _writer(run, f"ckpt_callbacks-save-{step}")
        try:
            if inline:
                self._thread = None
            else:
                t.start()
            through = WriteThrough(self.store, step, token, snap, self._workers) if through_ok else None
            snapshot.copy(snap, items.put, budget, self._pool, through)
        except BaseException as e:
            items.put(("abort", e))
            items.put(None)
            self._thread = None
            if not inline and _began(t):
                _join(t)   # it takes the abort and cleans up as usual
            else:
                run()
            self._error = None
            raise
        if inline:
            run()
        if not self.async_save or inline:
            self._wait()
        return True

    def _wait(self) -> None:
        t = self._thread
        if t is not None:
            _join(t)
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
                if self._thread is None:   # (not under a save still in flight: interrupted by Ctrl-C)
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
        if not self.store.has_step(step):
            return None
        if not self.store.local:   # no cheap token says whether the step changed: one read of its manifest
            self._infos.pop(step, None)
        info = retain.step_info(self, step)
        why = self._damaged.get(step)
        if why is not None:
            raise CorruptCheckpointError(f"step {step} in {self.store.url}: its manifest cannot be read "
                                         f"({why}); run `ckpt-callbacks verify`")
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
        ranked = p.rank(retain.step_infos(self))
        return ranked[0] if ranked else None

    def restore(self, step: int | None = None, target=None, *, fallback: bool = False, partial: bool = False):
        """Restore `step` (latest committed when None) onto `target` (see `ckpt_callbacks.restore`).

        Example::

            mngr.restore()["w"]   # the latest step as host numpy: array([4, 4, 4], dtype=int32)
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            mngr.restore(3, target={"w": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=device)})   # jax.Arrays

        With several processes and ``step=None``, process 0 picks the latest step and tells the
        others, so every process restores the same step even while a save commits concurrently
        (through a read-only manager: when `target` has arrays that span several processes, which
        every process must restore alike; any other read-only restore decides on each process).

        A damaged step raises `CorruptCheckpointError` (it stays listed). With ``fallback=True``
        and ``step=None``, a damaged step is skipped with a warning and the next older committed
        step is tried (every process moves together, as above); `restored_step` says which step
        was read. Storage that cannot be reached or refuses access raises
        `StorageUnavailableError` (on every process, when several move together) and is never a
        reason to fall back: it says nothing about the step.

        With ``partial=True`` the target may hold a part of the saved tree: its leaves are restored
        (each must match, as always), the checkpoint's others are left out, e.g. the parameters of a
        training state without its optimizer state. A leaf of the target the step lacks still raises.

        A step deleted while it is read (a writer elsewhere saving on with `KeepLast`, say) raises
        `CheckpointNotFoundError`; with ``step=None`` in one process the steps are listed again
        and the new latest is read instead (a few times at most).

        This manager's own save in flight is waited for first (`_own_save_first`), so ``save(s,
        tree)`` then ``restore(s)`` (or ``restore()``) reads step `s`.
        """
        check_flag("fallback", fallback)
        check_flag("partial", partial)
        if partial and target is None:
            raise ConfigError("restore(partial=True) needs a target: the part of the saved tree to restore "
                              "(target=None restores all of it)")
        self._check_process(reading=True)
        self._own_save_first()
        coord = None   # a read-only manager's processes agree when the target spans them
        if self.read_only and resume.collective(target):
            coord = coordination.for_collective_read(self.coord, self.store.url)
        for attempt in range(3):
            try:
                return resume.read(self, step, target, fallback, coord, partial)
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
            # (interrupted by Ctrl-C with the save still in flight, it keeps its threads, buffers and
            # lock: they were released under the running writer; close() again finishes it)
            if self._thread is None:
                self._release()

    def _release(self) -> None:
        """`close` once no save is in flight: drop what retention kept, end the threads, unlock."""
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
