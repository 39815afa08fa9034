"""Preemption notice: turn SIGTERM into a flag that a training loop checks at its step boundary.

Example::

    from ckpt_callbacks.preemption import PreemptionWatcher
    watcher = PreemptionWatcher()          # installs handlers for SIGTERM (main thread only)
    for step in range(1, 1001):
        pass                               # a training step
        if watcher.requested:              # set by the signal, read between steps
            break                          # save (and wait for it), then exit
    watcher.close()                        # puts the previous handlers back

Who calls what: `CheckpointHook` constructs one watcher on the main thread and reads
`requested` on every hook call; `close` restores the handlers that were installed before. The
handler only records the signal (it never saves or raises inside the signal), so the save happens
at the next step boundary, with the train state consistent. Previous handlers are not chained: a
preemption notice means "save, then exit", which the loop does itself -- except those of other
live watchers (two hooks at once, e.g. the full state and the params apart): every one of them
sees the signal, and closing them in any order leaves the handler that was there before them.

Only the main thread of the main interpreter may install signal handlers; constructed elsewhere,
the watcher installs nothing and `requested` stays False (a warning says so).
"""

from __future__ import annotations

import logging
import signal
import threading

from .errors import CheckpointError

__all__ = ["PreemptionWatcher", "Preempted"]

log = logging.getLogger("ckpt_callbacks")

_live: list = []   # the watchers not closed yet, oldest first (main thread only)


class Preempted(CheckpointError):
    """Raised by `CheckpointHook` (with ``on_preemption="raise"``) after the preemption save committed.

    `step` is the step that was saved. Catch it around the training loop to exit cleanly.
    """

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class PreemptionWatcher:
    """Owns signal handlers from construction to `close`; `requested` turns True on a signal."""

    def __init__(self, signals=(signal.SIGTERM,)):
        # each once: a second install would record this watcher's own handler as the one before it
        # (the handler then calls itself until RecursionError, and close() leaves it installed)
        self.signals = tuple(dict.fromkeys(signals))
        self.requested = False
        self.signum: int | None = None
        self._previous: dict = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckpt_callbacks: not on the main thread: no handler installed for %s; "
                        "preemption saves are off", [signal.Signals(s).name for s in self.signals])
            return
        try:
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        except BaseException:   # (a signal that cannot be caught): none left installed
            for s, h in self._previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            self._previous = {}
            raise
        _live.append(self)

    def _handle(self, signum, frame):  # runs on the main thread, between bytecodes
        self.requested = True
        self.signum = signum
        prev = self._previous.get(signum)
        if isinstance(getattr(prev, "__self__", None), PreemptionWatcher):   # a watcher installed before
            prev(signum, frame)

    def close(self) -> None:
        """Put back the handlers that were installed before (idempotent)."""
        prev, self._previous = self._previous, {}
        if self in _live:
            _live.remove(self)
        for s, h in prev.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            else:   # a later watcher is installed over this one: it goes back to what was before this one
                for w in _live:
                    if w._previous.get(s) == self._handle:
                        w._previous[s] = h
