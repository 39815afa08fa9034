"""Keras 3 `model.fit` callback: async full-state checkpoints, best-by-metric retention, exact resume.

Example::

    import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras, numpy as np
    from ckpt_callbacks.keras import AsyncCheckpoint

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x, y = np.random.rand(64, 4), np.random.rand(64, 1)
    cb = AsyncCheckpoint("/tmp/run", keep_last=2, keep_best=1)          # best by val_loss
    model.fit(x, y, validation_split=0.25, epochs=5, callbacks=[cb])     # re-run it: it resumes

Who calls what, in which order (Keras calls the hooks; on every process under multi-host SPMD):
  * `batches` (a generator over a ``data=`` iterator, passed to `fit`), at its first ``next()``:
    puts the iterator at the latest committed step's position, before Keras reads the first
    batches to learn their shapes (which it does before any hook runs, and trains on first).
  * `on_train_begin`: refuses several AsyncCheckpoints in one `fit` and a model whose state
    Keras cannot collect (`ConfigError`, before anything is opened or restored), then opens a `CheckpointManager` on `directory`; if a step is committed there,
    restores it strictly into the model (every variable or an `IncompatibleCheckpointError` listing
    the mismatched paths), restores the host RNGs Keras' input pipelines draw from, and makes `fit`
    start at the next unseen epoch (it sets ``model._initial_epoch``, the attribute Keras' own
    `BackupAndRestore` uses and `fit` reads right after this hook).
  * `on_epoch_begin`: for the epoch a resumed run continues in the middle of, positions the
    `ResumableDataset` after the batches already trained on and restores the epoch's running metrics.
  * `on_train_batch_begin` (main thread): counts the batches run so far; with ``save_freq=N`` a due
    save is taken there, before the next batch (it never collides with the epoch-end save).
    `on_train_batch_end` only records how far the epoch got; it is ``async_safe``, so Keras may run
    it on a thread of its own and need not wait for each step's logs (see `AsyncCheckpoint`).
  * `on_epoch_end`: records the monitor's best value and saves with the epoch's logs as metrics
    (``val_*`` appear only here, so only epoch-end steps can rank as best). An epoch that
    ``stop_training`` cut short is saved where it stopped (as a mid-epoch save), or, without
    ``data=``, not at all (a resume would skip its remaining batches). Callbacks listed after
    this one run their `on_epoch_end` after the snapshot.
  * `on_train_end`: waits for the last save, applies retention, closes the manager; a background
    failure is raised here, never swallowed.
  * Preemption (SIGTERM by default), from `on_train_begin` to the end of `fit`: the handler only
    records the signal; the next step boundary on `fit`'s thread (the next batch's begin, a batch
    end that Keras calls in line, the epoch's end) saves the step reached, waits for its commit and
    stops `fit` or raises `Preempted`; with several processes all agree on it at every boundary
    (`ckpt_callbacks.keras_preempt`).

To load a checkpoint's weights into a model without `fit` (evaluation, inference, export):
`load_weights` (`ckpt_callbacks.keras_load`).

Where a resumed fit starts (the restore, the data's position): `ckpt_callbacks.keras_resume`;
which way metrics rank and the retention built from the arguments: `ckpt_callbacks.keras_policy`.
A save takes ``model.get_state_tree()`` (`ckpt_callbacks.keras_state`; trainable, non-trainable incl. seed-generator state,
optimizer incl. iteration, metrics; the optimizer's auto-numbered name is stored as "optimizer")
after `model.jax_state_sync()` (mid-epoch the JAX trainer keeps
the live state outside the variables and donates it every step; the manager copies it before
`save` returns), plus progress (epoch, batch within it, global step, best) and, per process, the
state of Python's and NumPy's global RNGs. The step number is the global count of trained batches.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Mapping

import keras

from . import keras_policy, keras_preempt, keras_resume, keras_state
from .checks import check_flag, check_save_options, check_timeout
from .errors import ConfigError
from .keras_data import ResumableDataset
from .keras_load import load_weights
from .manager import CheckpointManager
from .preemption import Preempted, checked_on_preemption, checked_signals
from .retention import KeepBest, KeepLast, as_policies
from .storage import open_store

__all__ = ["AsyncCheckpoint", "Preempted", "ResumableDataset", "load_weights"]

log = logging.getLogger("ckpt_callbacks")

# directory -> (the AsyncCheckpoint that opened a manager there last, that manager, both weakly; the
# thread its fit ran on), see `_close_abandoned`. The callback of a fit that raised may be collected
# before its manager is (whose lock holds the directory until it is closed or collected).
_OPEN: dict = {}
_ALL = weakref.WeakSet()   # every AsyncCheckpoint (`_refuse_another_in_this_fit`)
_HOOK_WAIT_S = 60.0   # how long a mid-epoch save waits for the batch-end hook of its last step


def _close_manager(manager: CheckpointManager, raise_errors: bool) -> None:
    try:
        manager.close()
    except Exception as e:  # noqa: BLE001
        if raise_errors:
            raise
        log.warning("ckpt_callbacks: the previous fit()'s last save failed: %s", e)


def _dir_key(directory) -> str:
    """One key per checkpoint directory however it is written (``s3://b/run`` and ``s3://b/run/``,
    ``file:///x/run`` and ``/x/run``): the one `_OPEN` entry of each."""
    store = open_store(os.fspath(directory))   # (opens nothing: a URL is parsed, a path resolved below)
    return os.path.realpath(store.root) if store.local else store.url


_RAN_OUT = "Your input ran out of data"


class AsyncCheckpoint(keras.callbacks.Callback):
    """Checkpoints `model.fit` asynchronously and resumes it exactly.

    Example::

        import keras, numpy as np
        from ckpt_callbacks.keras import AsyncCheckpoint
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=["mae"])
        cb = AsyncCheckpoint("/tmp/run", monitor="val_mae", keep_best=2, keep_last=1)   # "auto": mae minimizes
        model.fit(np.ones((32, 2)), np.ones((32, 1)), validation_split=0.25, epochs=3, callbacks=[cb], verbose=0)
        cb.manager.all_steps(), cb.manager.best_step()   # the run's kept steps and its best by val_mae

    When Keras calls which hook and what each does: see the module docstring.

    Keras may run `on_train_batch_end` off the main thread (``async_safe``): a batch-end hook
    that Keras must call in line makes it turn every batch's logs into Python floats first, i.e.
    wait for each step before dispatching the next. This one only records how far the epoch got;
    saves are decided on the main thread, in `on_train_batch_begin` and `on_epoch_end`.

    Args:
      directory: local path, ``s3://bucket/prefix`` or ``gs://bucket/prefix``; one run per directory.
      save_freq: ``"epoch"`` (at each epoch end) or an int N: every N batches, and at each epoch end.
      monitor: the logs key that ranks checkpoints for `keep_best` (``"val_loss"``).
      mode: ``"auto"`` (losses minimize; compiled metrics use their direction), ``"min"``, ``"max"``.
      initial_value_threshold: a step ranks as best only if its monitor value beats this.
      retention: a policy, list of policies or config dict (see `ckpt_callbacks.retention_from_config`);
        combined ("kept if any keeps") with the two shorthands below. All None: keep every step. A
        dict's ``keep_best`` without a ``mode`` takes the direction ``mode="auto"`` finds for its metric.
      keep_last: keep the N newest steps.
      keep_best: keep the N best steps by `monitor` (True means 1). Steps without the monitor
        (mid-epoch saves, epochs without validation) never rank.
      resume: restore the latest committed step in `on_train_begin` (False: refuse a directory that
        already holds checkpoints rather than mix two runs; once this callback's first `fit` has
        begun on it, the checkpoints there are this run's, and its later `fit`s continue it).
      fallback: when the latest step is damaged, resume from the newest intact one instead (with a
        warning; the run then saves the damaged steps' numbers anew, over them). False: `fit`
        raises `CorruptCheckpointError` naming the step and the ways out, before training.
      data: what lets a mid-epoch resume continue at the next unseen batch: the `ResumableDataset`
        passed to `fit`, or any object with ``get_state()``/``set_state()`` (saved per process at the
        step boundary, restored in `on_train_begin`; feed it to `fit` through `batches()` for an
        exact resume). Required with an int `save_freq`; ``data=False`` accepts restarting an
        interrupted epoch from its first batch (its earlier batches are trained on twice).
      data_remap: which saved position a ``get_state()``/``set_state()`` `data` iterator of each
        process resumes from, needed where the checkpoint was saved by another number of processes
        (`fit` raises `IncompatibleCheckpointError` before training otherwise): a dict
        ``{this_process: saved_process}`` (that process's host state, NumPy/Python RNG included)
        or ``fn(saved: dict[int, state], process_index, process_count) -> state`` over the saved
        ``get_state()`` values (the RNG is then not restored). Used whenever given.
      async_save, max_staging_bytes: passed to `CheckpointManager`.
      timeout_s: passed to `CheckpointManager`: with several processes, how long a save or the
        resume waits for the others; a process that died makes the survivors' next save raise
        `CheckpointSaveError` after it. Keep it below half of JAX's heartbeat timeout, which
        otherwise terminates the survivors first, raising nothing (docs/multihost.md).
      verbose: 1 prints a line per resume and per save.
      preemption_signals: signals that mean "preempted" (default SIGTERM), watched from
        `on_train_begin` to the end of `fit` (the previous handlers are put back then); ``()``
        watches none. A collection of signals a handler can catch (not SIGKILL or SIGSTOP).
      on_preemption: what follows the preemption save, once committed: ``"stop"`` sets
        ``model.stop_training`` (Keras checks it after a batch: where Keras runs this callback's
        batch-end hook on a thread of its own, the batch that was about to begin still runs, unsaved,
        and the epoch's validation runs as for any stop); ``"raise"`` raises `Preempted` from the hook
        (no batch runs after the save). Either way `preempted` turns True and `preempted_step` names
        the step committed; the run resumes from it when the same `fit` runs again (mid-epoch: with
        ``data=``; without it the last step saved before stays the one to resume from, with a warning).
    """

    async_safe = True

    def __init__(self, directory, *, save_freq="epoch", monitor: str = "val_loss", mode: str = "auto",
                 initial_value_threshold: float | None = None, retention=None, keep_last: int | None = None,
                 keep_best: int | bool | None = None, resume: bool = True, data=None, async_save: bool = True,
                 max_staging_bytes: int | None = None, verbose: int = 0, fallback: bool = False,
                 timeout_s: float = 600.0, data_remap=None, preemption_signals=(signal.SIGTERM,),
                 on_preemption: str = "stop"):
        super().__init__()
        _ALL.add(self)
        if keras.config.backend() != "jax":
            raise ConfigError(f"AsyncCheckpoint needs the JAX backend, but Keras runs on "
                              f"{keras.config.backend()!r}. Fix: set KERAS_BACKEND=jax before importing keras.")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise ConfigError(f"directory must be a path or a URL (str or os.PathLike), got {directory!r}")
        if isinstance(verbose, bool) or not isinstance(verbose, numbers.Integral) or verbose not in (0, 1):
            raise ConfigError(f"verbose must be 0 (silent) or 1 (a line per resume and save), got {verbose!r}")
        if not (isinstance(save_freq, str) and save_freq == "epoch"):
            if isinstance(save_freq, bool) or not isinstance(save_freq, numbers.Integral) or save_freq < 1:
                raise ConfigError(f"save_freq must be 'epoch' or a positive int (batches), got {save_freq!r}")
            save_freq = int(save_freq)   # (a NumPy integer too, as keep_last takes one)
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"monitor must be a metric name (a non-empty str), got {monitor!r}")
        if initial_value_threshold is not None and (isinstance(initial_value_threshold, bool) or not isinstance(
                initial_value_threshold, numbers.Real) or math.isnan(initial_value_threshold)):
            raise ConfigError(f"initial_value_threshold must be a number or None, got {initial_value_threshold!r}")
        check_flag("resume", resume)
        check_flag("fallback", fallback)
        check_save_options(async_save, max_staging_bytes)
        check_timeout(timeout_s)
        self.preemption_signals = checked_signals(preemption_signals)
        self.on_preemption = checked_on_preemption(on_preemption, ("stop", "raise"))
        if keep_best is True:
            keep_best = 1
        if keep_best is False:
            keep_best = None
        self._base_policies = as_policies(retention)  # validates now
        # a config dict's keep_best without a mode takes the direction that mode="auto" finds for
        # its metric (the callback's own mode for its monitor), once the model is known
        kb = retention.get("keep_best") if isinstance(retention, Mapping) else None
        self._auto_best = dict(retention) if isinstance(kb, Mapping) and kb.get("mode") is None else None
        if keep_last is not None:
            KeepLast(keep_last)
        if keep_best is not None:
            KeepBest(monitor, "min", keep_best)
        if isinstance(save_freq, int) and data is None:
            raise ConfigError(
                f"save_freq={save_freq} saves mid-epoch, but AsyncCheckpoint cannot make a resumed fit() "
                "continue at the next unseen batch without the input's position. Fix: wrap an index-based "
                "PyDataset in ckpt_callbacks.keras_data.ResumableDataset and pass it both to fit() and as "
                "data=..., pass an iterator with get_state()/set_state() as data=..., or pass data=False "
                "to restart an interrupted epoch from its first batch.")
        if data not in (None, False) and not isinstance(data, ResumableDataset) and not (
                callable(getattr(data, "get_state", None)) and callable(getattr(data, "set_state", None))):
            raise ConfigError(f"data must be a ResumableDataset, an object with get_state()/set_state(), "
                              f"None or False; got {type(data).__name__}")
        if data_remap is not None:
            if not (isinstance(data_remap, Mapping) or callable(data_remap)):
                raise ConfigError(f"data_remap must be a dict {{this_process: saved_process}} or a callable "
                                  f"fn(saved_states, process_index, process_count), got {data_remap!r}")
            if data in (None, False) or isinstance(data, ResumableDataset):
                raise ConfigError("data_remap maps saved positions of a data= iterator with get_state()/"
                                  "set_state(); this AsyncCheckpoint has none (a ResumableDataset's position "
                                  "is the step's epoch and batch, the same on every process)")
        self.directory = directory
        self.save_freq, self.monitor, self.mode = save_freq, monitor, mode
        self.initial_value_threshold = initial_value_threshold
        self.keep_last, self.keep_best = keep_last, keep_best
        self.resume, self.data, self.verbose = resume, data, verbose
        self.data_remap = dict(data_remap) if isinstance(data_remap, Mapping) else data_remap
        self._own_run = False   # a resume=False callback's first fit() began here: later ones continue it
        self.async_save, self.max_staging_bytes, self.timeout_s = async_save, max_staging_bytes, timeout_s
        self.manager: CheckpointManager | None = None
        self.best: float | None = None
        self.resumed_step: int | None = None     # step restored by the last on_train_begin, or None
        self.initial_epoch = 0                   # where the last fit() started (after resuming)
        self.initial_batch = 0                   # batches of `initial_epoch` skipped on resume
        self.last_blocking_s: float | None = None
        self._warn_ctx = None
        self._epoch_end = None
        self._set_initial_epoch = False
        self._open = False
        self._fit_thread: threading.Thread | None = None
        # `_data_at`: the step whose position a get_state()/set_state() `data` iterator holds
        # already when the next fit() begins (put there by `batches`, or where the last fit ended
        # on a save), so that on_train_begin does not set it back over batches fit() has read.
        self._data_at = self._data_saved = None
        self._served_at = None   # see `_check_data_is_read`
        self._yields = self._yields_mark = 0   # items batches() generators gave; as of the last hook
        self.fallback = fallback
        self._replace: set[int] = set()   # damaged steps a fallback went past: saved anew when reached
        self.preempted, self.preempted_step = False, None   # the last fit's preemption (`keras_preempt`)
        self._preemption: keras_preempt.FitPreemption | None = None
        self._saved_at = None   # the step of this fit's last save started

    # -- set-up -------------------------------------------------------------------------------
    def _state_iterator(self) -> bool:
        return self.data not in (None, False) and not isinstance(self.data, ResumableDataset)

    def batches(self):
        """A generator over the ``data=`` iterator's items, for `fit`, that resumes exactly.

        Example::

            import grain, keras, numpy as np
            from ckpt_callbacks.keras import AsyncCheckpoint
            xy = np.random.default_rng(0).random((256, 5), np.float32)
            it = iter(grain.MapDataset.source(xy).repeat(None).batch(32).map(lambda b: (b[:, :4], b[:, 4:])))
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
            cb = AsyncCheckpoint("/tmp/grain_run", data=it, save_freq=5)   # saves it.get_state() with each step
            model.fit(cb.batches(), steps_per_epoch=8, epochs=2, callbacks=[cb], verbose=0)

        Keras reads the first two items of a generator before any callback runs (to learn their
        shapes) and trains on them first, so the iterator must be at the checkpoint's position
        before that: on its first ``next()`` this generator puts it at the latest committed step's
        position (this process's own; nothing when there is none or ``resume=False``), and
        `on_train_begin` then leaves it there. Call it anew for each `fit`.
        """
        if not self._state_iterator():
            raise ConfigError("AsyncCheckpoint.batches() needs data= an iterator with get_state()/set_state()")
        self._close(raise_errors=False)   # a fit() that raised may have left a save in flight
        self._data_at = keras_resume.position_data(self) if self.resume or self._own_run else None
        while True:
            try:
                item = next(self.data)
            except StopIteration:
                return
            self._yields += 1
            yield item

    def on_train_begin(self, logs=None):
        try:
            self._train_begin()
        finally:
            self._yields_mark = self._yields

    def _train_begin(self):
        self._close(raise_errors=False)      # left open by a fit() that raised
        self._close_abandoned()
        self._refuse_another_in_this_fit()
        keras_resume.check_epochs_are_passes(self)
        keras_state.state_tree(self.model)   # a model whose state cannot be saved fails now, not after an epoch
        self._mode = keras_policy.resolved_mode(self)
        self._dtype_policies = keras_state.dtype_policies(self.model)
        self.manager = CheckpointManager(self.directory, retention=keras_policy.policies(self, self._mode),
                                         async_save=self.async_save, max_staging_bytes=self.max_staging_bytes,
                                         timeout_s=self.timeout_s)
        self._open = True
        self._fit_thread = threading.current_thread()
        _OPEN[_dir_key(self.directory)] = (weakref.ref(self), weakref.ref(self.manager), self._fit_thread)
        try:
            self.preempted, self.preempted_step, self._saved_at = False, None, None
            self._preemption = keras_preempt.FitPreemption(self)   # (a signal during the restore counts)
            self._resume()
        except BaseException:   # nothing trains: the directory is free again for a fixed model or callback
            self._undo_initial_epoch()
            self._close(raise_errors=False)
            raise

    def _undo_initial_epoch(self) -> None:
        """Clear the `model._initial_epoch` a resume set (Keras never does: a later fit() would start
        there); at the first epoch's begin, once fit() has read it, or at train end."""
        if self._set_initial_epoch:
            self.model._initial_epoch = None
            self._set_initial_epoch = False

    def _close_abandoned(self) -> None:
        """Close the manager that another AsyncCheckpoint left open on this directory when its
        fit() raised (Keras then calls no on_train_end): one whose fit ran on this thread (which is
        here now, so that fit is over) or on a thread that has ended, even if that callback has been
        garbage-collected since. Its lock would refuse ours."""
        entry = _OPEN.get(_dir_key(self.directory))
        if entry is None:
            return
        ref, manager_ref, thread = entry
        other, manager = ref(), manager_ref()
        if other is self or manager is None or manager._closed or (other is not None and other.params is self.params):
            return   # (the same `params`: two callbacks of this very fit; the lock refuses the second)
        if thread is threading.current_thread() or not thread.is_alive():
            log.warning("ckpt_callbacks: AsyncCheckpoint: closing the checkpoint manager that another "
                        "AsyncCheckpoint left open on %s (its fit() raised)", self.directory)
            if other is not None:
                other._close(raise_errors=False)
            else:
                _close_manager(manager, raise_errors=False)

    def _refuse_another_in_this_fit(self) -> None:
        """Two AsyncCheckpoints in one fit() (e.g. a fast local one beside a remote one) would each
        restore their own latest step, one after the other, into the same model and data: the
        model would hold one's step and the data another's position, and the later saves would
        be numbered from that mix. Refused by the first one's on_train_begin, before anything is
        opened or restored: Keras gives every callback of a fit() the same `params` before it."""
        for other in list(_ALL):
            if other is not self and other.params is self.params and other.model is self.model:
                raise ConfigError(
                    f"AsyncCheckpoint: this fit() has two AsyncCheckpoint callbacks ({other.directory} and "
                    f"{self.directory}); each would resume from its own latest step, into the same model. "
                    f"Fix: use one AsyncCheckpoint per fit(); its retention can keep both what a frequent "
                    f"and what a sparse schedule would (e.g. keep_last= with retention={{'keep_every': N}}).")

    def _resume(self) -> None:
        """This fit()'s run state from scratch, then the restore of the latest step (if any)."""
        self.best = self.initial_value_threshold
        self.resumed_step, self.initial_epoch, self.initial_batch = None, 0, 0
        self._epoch, self._batch, self._global_step = 0, 0, 0
        self._since_save, self._skip, self._ended = 0, 0, 0
        self._mid_saved = None   # the step a mid-epoch save of this epoch took, if any
        # guards `_ended`, `_loss_at`, `_last_loss` (set by batch-end hooks on Keras' threads)
        self._ended_changed = threading.Condition()
        self._loss_at = 0   # the step (within the epoch) whose batch-end hook set `_last_loss`
        self._resume_at, self._resumed_metrics = None, None
        self._data_saved = None
        self._replace = set()
        self._last_loss = None   # the running loss of the last batch-end hook (`_skip_nonfinite`)
        self._unrankable = set()   # ranked metrics the logs hold as arrays (`_warn_unrankable` said so)
        # batches read from a ResumableDataset `data` before this fit trained: fit() must read on from it
        self._served_at = self.data.served if isinstance(self.data, ResumableDataset) else None
        step = self.manager.latest_step()
        if not self.resume and step is None:
            self._own_run = True   # this run's from now on: the next fit() continues it
        if step is None:
            return
        if not (self.resume or self._own_run):
            raise ConfigError(f"{self.manager.store.url} already holds checkpoints (latest step {step}) and "
                              f"resume=False. Fix: use a new directory, or resume=True to continue that run.")
        keras_resume.restore(self, step)

    # -- hooks --------------------------------------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        # fit() has read model._initial_epoch: clear it now, not only at train end (a fit() that
        # raises gets no on_train_end, and the next fit(), with or without this callback, would start there)
        self._undo_initial_epoch()
        skip = 0
        if self._resume_at is not None:
            self._check_resumed_epoch(epoch)
            skip = self._resume_at[1]
        self._resume_at = None
        self._epoch, self._batch, self._skip = epoch, skip, skip
        with self._ended_changed:
            self._ended, self._loss_at = skip, skip   # (`_last_loss` stays the last epoch's until a step ends)
        if isinstance(self.data, ResumableDataset):
            self.data.set_position(epoch, skip)
        if skip:
            # fit() reset the metrics before this hook: put back the running values of this epoch
            for v in self.model.metrics_variables:
                v.assign(self._resumed_metrics[v.path])
            if isinstance(self.data, ResumableDataset):  # the shortened epoch ends by running out
                self._warn_ctx = warnings.catch_warnings()
                self._warn_ctx.__enter__()
                warnings.filterwarnings("ignore", message=_RAN_OUT)
        self._resumed_metrics = None
        # where this epoch's batches end: a ResumableDataset's pass, else what Keras runs after `skip`
        steps = (self.params or {}).get("steps")
        if isinstance(self.data, ResumableDataset):
            self._epoch_end = int(self.data.dataset.num_batches)
        else:
            self._epoch_end = skip + int(steps) if steps else None

    def _check_resumed_epoch(self, epoch: int) -> None:
        """The first epoch of a resumed fit() must be the one the restored step continues in. A
        callback listed after this one that sets ``model._initial_epoch`` too (Keras'
        `BackupAndRestore`, which also loads its own weights) or ``fit(initial_epoch=...)`` with a
        step inside epoch 1 (Keras takes a 0 as unset) would otherwise train on from a mix: the
        model at one epoch, the step numbers, RNGs and data position at another."""
        want = self._resume_at[0]
        if epoch == want:
            return
        self._resume_at = None
        self._undo_initial_epoch()
        self._close(raise_errors=False)   # (Keras calls no on_train_end after this)
        raise ConfigError(
            f"AsyncCheckpoint: resumed from step {self.resumed_step} in {self.manager.store.url}, which continues "
            f"in epoch {want + 1}, but fit() began epoch {epoch + 1}: something else set where fit() starts "
            f"after this callback's on_train_begin (a callback listed after it, e.g. Keras' BackupAndRestore, "
            f"which also loads its own weights over the restored ones; or fit(initial_epoch={epoch}), which "
            f"Keras uses when the step is inside epoch 1). Training on would mix two states. Fix: drop "
            f"BackupAndRestore (AsyncCheckpoint restores everything it does) or list AsyncCheckpoint after it, "
            f"and drop initial_epoch=.")

    def on_train_batch_begin(self, batch, logs=None):
        # `batch` is the first step of this call: every step before it has run
        done = self._skip + int(batch)
        if int(batch):
            self._check_data_is_read()
        if self._epoch_end is not None and done >= self._epoch_end:
            # Keras counts a resumed epoch's calls from the full epoch's length: this call finds
            # no data left (nothing runs), and the epoch-end save follows
            self._advance(self._epoch_end)
            return
        self._advance(done)
        if self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._since_save = 0
            if self._save_mid_epoch("inside"):
                self._mid_saved = self._global_step
        self._at_boundary()

    def _save_mid_epoch(self, where: str) -> bool:
        """Save the step reached inside an epoch (fit's thread; a scheduled or a preemption save),
        unless the epoch's running loss after its last step is not finite; True if a save started.
        That loss is the last step's batch-end hook's: Keras may run those hooks on its own
        threads, in any order, so wait for it, as the save waits for the step."""
        with self._ended_changed:
            if not self._ended_changed.wait_for(lambda: self._loss_at >= self._batch, timeout=_HOOK_WAIT_S):
                log.warning("ckpt_callbacks: AsyncCheckpoint: the batch-end hook of step %d did not run within "
                            "%gs; judging the mid-epoch save by an earlier step's loss", self._global_step,
                            _HOOK_WAIT_S)
            loss = self._last_loss
        return (not self._skip_nonfinite(loss, f"step {self._global_step} ({where} epoch {self._epoch + 1})")
                and self._save(self._epoch, self._batch, metrics=None))

    def on_train_batch_end(self, batch, logs=None):
        # Off the main thread (async_safe): only records how far the epoch got (and its running loss).
        # With steps_per_execution, Keras reports the last step of a call as begin + N - 1 even
        # when the epoch's data ran out inside it: never count beyond the epoch.
        ended = self._skip + int(batch) + 1
        if self._epoch_end is not None:
            ended = min(ended, self._epoch_end)
        loss = (logs or {}).get("loss")   # Python floats here: Keras converts them on this thread
        with self._ended_changed:
            self._ended = max(self._ended, ended)
            if ended > self._loss_at:   # (the running loss of the latest step, whichever hook runs last)
                self._loss_at = ended
                self._last_loss = float(loss) if isinstance(loss, (int, float)) else None
            self._ended_changed.notify_all()
        if self.preemption_signals and threading.current_thread() is self._fit_thread and ended != self._epoch_end:
            self._advance(ended)   # called in line, on fit's thread: a step boundary (not the epoch's last)
            self._at_boundary()

    def _at_boundary(self, save: bool = True) -> None:
        if self._preemption is not None:   # (on fit's thread; see keras_preempt)
            self._preemption.at_boundary(save)

    def _advance(self, done: int) -> None:
        """Count the steps of this epoch up to `done` (main thread)."""
        n = done - self._batch
        if n > 0:
            self._global_step += n
            self._batch = done
            self._since_save += n

    def _check_data_is_read(self) -> None:
        """Once a step of this fit has run: a ResumableDataset `data` that fit() reads from has
        served a batch. One that it does not read (another input passed to fit()) would position
        nothing: a resume would run the interrupted epoch's first batches again, and the step
        numbers would drift from the batches trained."""
        if self._served_at is None:
            return
        if self.data.served == self._served_at:
            raise ConfigError(
                "AsyncCheckpoint: data= is a ResumableDataset that this fit() does not read from (it has "
                "served no batch while steps ran), so a resume could not continue at the next unseen batch. "
                "Fix: pass the same ResumableDataset to fit() as its input, or data=False to restart an "
                "interrupted epoch from its first batch.")
        self._served_at = None

    def on_epoch_end(self, epoch, logs=None):
        self._exit_warn_ctx()
        with self._ended_changed:   # Keras has waited for every batch-end hook of the epoch
            self._advance(self._ended)
        if self._batch > self._skip:   # (a resumed epoch with no batch left reads nothing)
            self._check_data_is_read()
        if self.preempted:   # saved where it was preempted (then Keras may have run one more batch)
            return
        self._since_save = 0
        metrics = keras_state.numeric_logs(logs)
        self._warn_unrankable(logs, metrics)
        current = metrics.get(self.monitor)   # (a ranked metric missing from them: the manager warns)
        if current is not None and self._mode is not None and not math.isnan(current):
            better = self.best is None or (current < self.best if self._mode == "min" else current > self.best)
            if better:
                if self.verbose:
                    was = (math.inf if self._mode == "min" else -math.inf) if self.best is None else self.best
                    print(f"\nAsyncCheckpoint: {self.monitor} improved from {was:.5f} to {current:.5f}", flush=True)
                self.best = current
        # Data of unknown length: Keras begins one more call after the last batch, before it finds
        # the data ended, and that call may have saved this very step mid-epoch (no metrics, the
        # epoch not ended): the epoch-end save replaces it.
        again, self._mid_saved = self._mid_saved == self._global_step, None
        # `stop_training` set inside the epoch (a time budget): its batches did not all run (not
        # an epoch whose data ran out before steps_per_epoch: Keras trains on, and it has ended)
        partial = (getattr(self.model, "stop_training", False) and self._epoch_end is not None
                   and self._batch < self._epoch_end)
        if partial and self.data is None:
            self._at_boundary(save=False)
            log.warning("ckpt_callbacks: AsyncCheckpoint: fit() stopped after batch %d of epoch %d's %d; not "
                        "saving it as an ended epoch (a resumed fit() would skip the rest of it); the last "
                        "step saved stays the one a resumed fit() starts from. To keep stopped epochs, pass "
                        "data= (a ResumableDataset continues at the next batch) or data=False (the epoch "
                        "restarts from its first batch)", self._batch, epoch + 1, self._epoch_end)
            return
        if self._skip_nonfinite(metrics.get("loss"), f"epoch {epoch + 1}"):
            pass
        elif partial:   # saved where it stopped, as a mid-epoch save is (its logs' val_* measure these weights)
            self._save(epoch, self._batch, metrics=metrics, replace=again)
        else:
            self._save(epoch + 1, 0, metrics=metrics, replace=again)
        self._at_boundary(save=False)

    def _warn_unrankable(self, logs, metrics: dict) -> None:
        """Once per fit and metric: the monitor or a metric a KeepBest ranks by is in the logs, but
        not as one number (`F1Score(average=None)` logs one value per class), so no step ranks by
        it. Said here rather than by the manager, whose warning would say the logs lack it."""
        ranked = [self.monitor] + [p.metric for p in self.manager.policies or [] if isinstance(p, KeepBest)]
        found = keras_state.unrankable(logs, metrics, [m for m in dict.fromkeys(ranked) if m not in self._unrankable])
        for name, what in found.items():
            self._unrankable.add(name)
            self.manager._warned_unranked.add(name)
            log.warning("ckpt_callbacks: AsyncCheckpoint: %r is %s in epoch %d's logs, not one number, so no step "
                        "ranks by it (monitor, keep_best; the steps are saved without it). Fix: make it one "
                        "number (e.g. F1Score(average='macro') instead of one value per class), or rank by "
                        "another metric", name, what, self._epoch + 1)

    def _skip_nonfinite(self, loss, what: str) -> bool:
        """Whether to skip a save because the loss is NaN or infinite: weights that produced it are
        no place to resume from, and retention would delete a good step to make room for them."""
        if loss is None or math.isfinite(loss):
            return False
        log.warning("ckpt_callbacks: AsyncCheckpoint: not saving %s: its loss is %s; the last step saved "
                    "stays the one a resumed fit() starts from", what, loss)
        return True

    def on_train_end(self, logs=None):
        self._exit_warn_ctx()
        if isinstance(self.data, ResumableDataset) and self.data.skip:   # stopped inside a resumed epoch
            self.data.set_position(self.data.epoch, 0)                    # (stop_training): whole next time
        self._yields_mark = self._yields
        last = self._data_saved if self._state_iterator() else None
        claim = last[0] if last is not None and keras_resume.same(last[1], keras_resume.state_of(self.data)) else None
        self._undo_initial_epoch()
        self._data_at = None
        self._at_boundary(save=False)   # (a signal after the last epoch's end: its save is the last)
        self._close(raise_errors=True)
        self._data_at = claim   # only once the step it names is committed

    # -- saving -------------------------------------------------------------------------------
    def _save(self, epoch: int, batch: int, metrics, replace: bool = False) -> bool:
        t0 = time.perf_counter()
        model = self.model
        model.jax_state_sync()   # mid-epoch, the live (to-be-donated) state is in model._jax_state
        progress = {"epoch": int(epoch), "batch": int(batch), "global_step": int(self._global_step),
                    "best": float("nan") if self.best is None else float(self.best), "version": 1}
        host = {"rng": keras_state.rng_state(), "steps": keras_resume.epoch_steps(self),
                "dtype_policies": self._dtype_policies, "monitor": [self.monitor, self._mode]}
        refused = None
        if self._state_iterator():
            try:
                host["data"] = self.data.get_state()
            except Exception as e:  # noqa: BLE001 - one process alone: the others hear of it in the save
                if self.manager.coord.process_count == 1:
                    raise
                refused = e   # raised by the manager, after every process refused the save at once
        force = replace or self._global_step in self._replace
        started = self.manager._save(self._global_step, {"model": keras_state.state_tree(model), "progress": progress},
                                     metrics=metrics, host_state=host, due=force, replace=force, refused=refused)
        self.last_blocking_s = time.perf_counter() - t0
        if started:
            self._replace.discard(self._global_step)
            self._saved_at = self._global_step
        if started and "data" in host:   # a copy: an iterator may hand out its live state, which moves on
            self._data_saved = (self._global_step, keras_resume.copy_state(host["data"]))
        if started and self.verbose:
            where = f"epoch {epoch + 1}, batch {batch}" if batch else f"end of epoch {epoch}"
            # (a line of its own: Keras' progress bar has not ended its line yet, as for ModelCheckpoint)
            print(f"\nAsyncCheckpoint: saving step {self._global_step} ({where}); "
                  f"training blocked {self.last_blocking_s * 1e3:.1f} ms", flush=True)
        return started

    def wait_until_finished(self) -> None:
        """Wait for the save in flight and its retention; re-raise its failure (`fit` waits at its end).

        Example::

            cb.wait_until_finished()
        """
        if self.manager is not None:
            self.manager.wait_until_finished()

    def _exit_warn_ctx(self) -> None:
        if self._warn_ctx is not None:
            ctx, self._warn_ctx = self._warn_ctx, None
            ctx.__exit__(None, None, None)

    def _close(self, raise_errors: bool) -> None:
        """Close the manager (kept as `self.manager` for queries such as `best_step()`) and put
        back the signal handlers this fit's preemption watch replaced."""
        if self._preemption is not None:
            self._preemption.close()
        if self.manager is None or not self._open:
            return
        self._open = False
        entry = _OPEN.get(_dir_key(self.directory))
        if entry is not None and entry[1]() is self.manager:
            del _OPEN[_dir_key(self.directory)]
        _close_manager(self.manager, raise_errors)
