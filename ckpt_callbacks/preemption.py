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
`requested` on every hook call; `AsyncCheckpoint` (`keras_preempt`) constructs one in each
`fit`'s `on_train_begin` and closes it at that `fit`'s end; `close` restores the handlers that
were installed before. Both validate their options with `checked_signals` and
`checked_on_preemption` when they are constructed. The
handler only records the signal (it never saves or raises inside the signal), so the save happens
at the next step boundary, with the train state consistent. Previous handlers are not chained: a
preemption notice means "save, then exit", which the loop does itself -- except those of other
live watchers (two hooks at once, e.g. the full state and the params apart): every one of them
sees the signal, and closing them in any order leaves the handler that was there before them.

Only the main thread of the main interpreter may install signal handlers; constructed elsewhere,
the watcher installs nothing and `requested` stays False (a warning says so).

A watcher given ``active`` (a callable, run in the handler) that its owner could not close (a
Keras `fit` that raised gets no `on_train_end`) ends itself at the first signal for which
``active()`` is False: it puts the previous handlers back and hands that signal to the handler that
was there before it (the default action of SIGTERM ends the process), as if it had never been
installed.
"""

from __future__ import annotations

import logging
import signal
import threading

from .errors import CheckpointError, ConfigError

__all__ = ["PreemptionWatcher", "Preempted", "checked_signals", "checked_on_preemption"]

log = logging.getLogger("ckpt_callbacks")

_live: list = []   # the watchers not closed yet, oldest first (main thread only)


class Preempted(CheckpointError):
    """Raised by `CheckpointHook` and `AsyncCheckpoint` (with ``on_preemption="raise"``) after the
    preemption save committed.

    `step` is the step that was saved (None where none is committed). Catch it around the training
    loop (or `model.fit`) to exit cleanly.
    """

    def __init__(self, message: str, step: int | None):
        super().__init__(message)
        self.step = step


class PreemptionWatcher:
    """Owns signal handlers from construction to `close`; `requested` turns True on a signal."""

    def __init__(self, signals=(signal.SIGTERM,), active=None):
        self._active = active   # None, or a callable: False once the owner is gone (see the module docstring)
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
        if self._active is not None and not self._active():
            self._hand_back(signum, frame)
            return
        self.requested = True
        self.signum = signum
        prev = self._previous.get(signum)
        if isinstance(getattr(prev, "__self__", None), PreemptionWatcher):   # a watcher installed before
            prev(signum, frame)

    def _hand_back(self, signum, frame) -> None:
        """A stale watcher: closed, and `signum` handled as the handler before it would have."""
        first = signal.getsignal(signum) == self._handle   # not called by a later watcher's handler
        prev = self._previous.get(signum)
        self.close()
        if isinstance(getattr(prev, "__self__", None), PreemptionWatcher) or (first and callable(prev)):
            prev(signum, frame)
        elif first and prev in (signal.SIG_DFL, None):
            signal.raise_signal(signum)   # the default action, now installed again (SIGTERM: the process ends)

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


def checked_signals(signals) -> tuple:
    """`signals` as a tuple of signals that a handler can catch (not SIGKILL, SIGSTOP or a number
    that names no signal), each once; else `ConfigError`. Called by `CheckpointHook` and
    `AsyncCheckpoint` at construction, before anything is installed or opened."""
    try:
        if isinstance(signals, (str, bytes, int)):
            raise TypeError
        out = tuple(dict.fromkeys(signals))   # each once (`PreemptionWatcher`)
    except TypeError:
        raise ConfigError(f"preemption_signals must be a collection of signals (e.g. (signal.SIGTERM,), or () "
                          f"for none), got {signals!r}") from None
    uncatchable = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or s not in signal.valid_signals() or s in uncatchable:
            raise ConfigError(f"preemption_signals: {s!r} is not a signal a handler can catch (give signal.SIGTERM, "
                              f"signal.SIGUSR1, ...; SIGKILL and SIGSTOP cannot be caught)")
    return out


def checked_on_preemption(value, choices: tuple) -> str:
    """`value` if it is one of `choices` (``("flag", "raise")`` for `CheckpointHook`, ``("stop",
    "raise")`` for `AsyncCheckpoint`), else `ConfigError`; at construction."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"on_preemption must be {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return value
