"""Preemption for `AsyncCheckpoint`: a SIGTERM during `model.fit` saves the step reached, then stops `fit`.

Example::

    import os, signal
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras, numpy as np
    from ckpt_callbacks.keras import AsyncCheckpoint

    class Notice(keras.callbacks.Callback):        # stands in for the VM's preemption notice
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    cb = AsyncCheckpoint("/tmp/preempted", data=False)   # data=False: a resume restarts the epoch
    model.fit(np.ones((64, 2)), np.ones((64, 1)), batch_size=8, epochs=3, callbacks=[cb, Notice()], verbose=0)
    cb.preempted, cb.preempted_step, cb.manager.all_steps()   # True 3 [3]: signalled in batch 3

Who calls what (all on `fit`'s thread, the main thread; on every process under SPMD):
  * `AsyncCheckpoint.__init__` checks ``preemption_signals`` and ``on_preemption``
    (`preemption.checked_signals`, `preemption.checked_on_preemption`).
  * `AsyncCheckpoint.on_train_begin` makes a `FitPreemption`, which installs a `PreemptionWatcher`
    (its handler only records the signal); `AsyncCheckpoint._close` closes it (on_train_end, the
    refusals that end a `fit`, the next `fit`'s begin). A `fit` that raised something else gets no
    `on_train_end`: the watcher then ends itself at the next signal, which finds no `fit` with this
    callback running, and passes it on to the handler from before (`PreemptionWatcher`'s ``active``).
  * At each step boundary -- `on_train_batch_begin` (the batches before it have ended; Keras
    runs this callback's batch-end hook on its own threads), `on_train_batch_end` where Keras calls
    it on `fit`'s thread (another callback in the list is not ``async_safe``), `on_epoch_end`
    after its save, and `on_train_end` -- `AsyncCheckpoint` asks `agreed`; on True it saves the
    step reached (unless a save covers it) and calls `finish`, which waits for the commit and
    stops `fit` or raises `Preempted`.

With several processes `agreed` gathers every process's flag (one `all_gather` through the
coordination service per boundary, only then), so all save the same step; alone it reads a flag.
"""

from __future__ import annotations

import logging
import signal
import sys

from .coordination import agree_round
from .keras_data import ResumableDataset
from .preemption import Preempted, PreemptionWatcher

__all__ = ["FitPreemption", "in_fit"]

log = logging.getLogger("ckpt_callbacks")


def in_fit(cb) -> bool:
    """Whether the main thread is inside a ``model.fit`` that `cb` is a callback of (the innermost
    ``fit`` frame of its model on the stack, its ``callbacks`` holding `cb`); run by the signal
    handler, which runs on the main thread, where Keras' `fit` runs too."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is cb.model:
            callbacks = frame.f_locals.get("callbacks")
            callbacks = getattr(callbacks, "callbacks", callbacks)   # (Keras' CallbackList, or the list given)
            if not isinstance(callbacks, (list, tuple)):   # a Keras that keeps them elsewhere: taken as this fit
                return True
            return any(c is cb for c in callbacks)
        frame = frame.f_back
    return False


class FitPreemption:
    """One `fit`'s preemption watch: from `AsyncCheckpoint.on_train_begin` to its close."""

    def __init__(self, cb):
        self.cb = cb
        self.watcher = (PreemptionWatcher(cb.preemption_signals, active=lambda: in_fit(cb))
                        if cb.preemption_signals else None)
        self.done = False      # handled: no boundary asks again
        self._asked = None     # the step whose boundary was asked last (sync batch end, then batch begin)
        self._n = 0            # agreements so far (each a key of its own in this manager's scope)

    def at_boundary(self, save: bool = True) -> None:
        """At a step boundary, on fit's thread: if any process was signalled, save the step
        reached (unless a save covers it; ``save=False`` at epoch and train end, after their own
        saves), then `finish`."""
        cb = self.cb
        step = cb._global_step
        if not self.agreed(step, final=not save):
            return
        if not save or step in (0, cb._saved_at, cb.resumed_step):
            pass
        elif cb._batch and cb.data is None:
            log.warning("ckpt_callbacks: AsyncCheckpoint: preempted inside epoch %d, after batch %d: not saving it "
                        "without data= (a resumed fit() could not continue at the next batch); the last step "
                        "saved stays the one a resumed fit() starts from", cb._epoch + 1, cb._batch)
        else:
            cb._save_mid_epoch("preempted inside")
        self.finish(step)

    def agreed(self, step: int, final: bool = False) -> bool:
        """Whether any process was signalled, asked at a step boundary on every process (once per
        step, but for `final` asks: at epoch and train end, where a signal may have come since)."""
        if self.watcher is None or self.done or (step == self._asked and not final):
            return False
        self._asked = step
        mine = self.watcher.requested
        coord = self.cb.manager.coord
        if coord.process_count > 1:
            self._n += 1
            got = agree_round(coord, "keras-preemption/", self._n, b"1" if mine else b"0",
                              self.cb.manager.timeout_s)
            mine = b"1" in got
        self.done = mine
        return mine

    def finish(self, step: int) -> None:
        """After the preemption save of `step` (or none) started: wait for its commit, set
        `preempted`/`preempted_step`, then stop `fit` (``model.stop_training``) or close the
        callback and raise `Preempted`."""
        cb, manager = self.cb, self.cb.manager
        if not manager._closed:
            manager.wait_until_finished()   # a failure is raised here, as at train end
        steps = manager.all_steps()
        saved = step if step in steps else (steps[-1] if steps else None)
        cb.preempted, cb.preempted_step = True, saved
        signum = self.watcher.signum if self.watcher.requested else None
        sig = signal.Signals(signum).name if signum else "a peer process's signal"
        how = "fit() raises Preempted" if cb.on_preemption == "raise" else "fit() stops"
        what = f"step {saved} is committed" if saved is not None else "no step is committed"
        log.warning("ckpt_callbacks: AsyncCheckpoint: preempted (%s): %s in %s; %s (run the same fit() again "
                    "to resume)", sig, what, manager.store.url, how)
        if cb.on_preemption == "raise":   # Keras calls no on_train_end after a raise: its clean-up here
            cb._exit_warn_ctx()
            if isinstance(cb.data, ResumableDataset) and cb.data.skip:   # inside a resumed epoch: whole next time
                cb.data.set_position(cb.data.epoch, 0)
            cb._close(raise_errors=True)
            raise Preempted(f"preempted ({sig}) at step {step}; checkpoint committed at step {saved} in "
                            f"{manager.store.url}. Run the same fit() again to resume.", saved)
        cb.model.stop_training = True

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
