"""What becomes of a `CheckpointManager` when its user does not close it: at interpreter exit, in a
forked child, and at the end of a ``with`` block that raised.

Example::

    import ckpt_callbacks as cc
    try:
        with cc.CheckpointManager("/tmp/run") as mngr:   # __exit__ -> close_on_exit
            mngr.save(1, {"w": [1.0, 2.0]})
            raise KeyError("a bug in the training loop")
    except KeyError as e:   # the body's own error (a failed save would be logged and noted on it)
        print(e, getattr(e, "__notes__", []))

Who calls what: `CheckpointManager.__init__` (a writing manager, any thread) calls `watch`, which
registers `_close_at_exit` once per process as a `threading` exit hook (it runs on the main thread
when the interpreter exits, before `concurrent.futures` stops the writer's thread pools) and as an
`atexit` hook (after the non-daemon threads are joined), and
forgets the parent's managers in a forked child. `CheckpointManager.__exit__` and
`CheckpointHook.__exit__` call `close_on_exit`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref

__all__ = ["watch", "close_on_exit"]

log = logging.getLogger("ckpt_callbacks")

_OPEN: weakref.WeakSet = weakref.WeakSet()   # writing managers of this process, for `_close_at_exit`
_TOLD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # manager -> the failure logged at exit
_exit_hook = False


def _close_at_exit() -> None:
    """At interpreter exit, close every manager left open with a save in flight: it commits
    instead of being cut off with the process (its thread is a daemon). Runs as a threading exit
    hook, i.e. before `concurrent.futures` stops the thread pools that the writer submits to, and
    before non-daemon threads are joined: a manager whose last save came from such a thread, still
    alive, is left to it; and again as an `atexit` hook, once those threads have ended, for what
    they left open with a save in flight (its writer then runs its pools' tasks itself:
    `storage.submit`). Managers with nothing in flight are left as they are (their lock is taken
    over as stale, their leftovers go at the next start), after logging a failure nobody was told
    of. A forked child forgets its parent's managers (`os.register_at_fork`)."""
    for m in list(_OPEN):
        with m._turn:   # (a thread inside `save` now: judged once that call has returned)
            _close_left_open(m)


def _close_left_open(m) -> None:
    if m._closed:
        return
    t, caller = m._thread, m._caller
    if t is None or t.finished.is_set():   # (not is_alive(): see manager._join)
        if m._error is not None and _TOLD.get(m) is not m._error:   # (once: this runs twice at exit)
            _TOLD[m] = m._error
            log.error("ckpt_callbacks: the last save to %s failed, and the CheckpointManager was not "
                      "closed to say so: %s", m.store.url, m.store.redact(str(m._error)))
        return
    if caller is not threading.main_thread() and caller.is_alive():
        return
    log.warning("ckpt_callbacks: the CheckpointManager of %s was not closed; finishing its save in "
                "flight at exit (call close(), or use it as a context manager)", m.store.url)
    try:
        m.close()
    except BaseException as e:  # noqa: BLE001 - nobody is left to raise to
        log.error("ckpt_callbacks: closing the CheckpointManager of %s at exit failed: %s",
                  m.store.url, m.store.redact(str(e)))


def watch(manager) -> None:
    """Called by each writing `CheckpointManager` at its construction: close it at exit if left open."""
    global _exit_hook
    _OPEN.add(manager)
    if not _exit_hook:
        import concurrent.futures.thread  # noqa: F401 - registers its exit hook first: ours runs before it
        getattr(threading, "_register_atexit", atexit.register)(_close_at_exit)
        # again after the non-daemon threads are joined (and before jax's own exit hook, registered
        # when jax was imported): a save in flight that such a thread left open commits too
        atexit.register(_close_at_exit)
        os.register_at_fork(after_in_child=_OPEN.clear)   # the parent's managers are the parent's to close
        _exit_hook = True


def close_on_exit(close, exc: BaseException | None, store) -> None:
    """`close()` for a ``with`` block (the manager's, the Flax hook's) over `store`. Leaving it
    normally, a background failure is raised. Leaving it by an exception, that exception goes on (a
    failed save must not replace, say, the KeyboardInterrupt or the bug that ended training) and the
    failure of closing is logged and added to it as a note (redacted, as every message about an
    object store): told, never swallowed."""
    if exc is None:
        close()
        return
    try:
        close()
    except Exception as e:  # noqa: BLE001 - told on the exception that is propagating
        text = store.redact(f"{type(e).__name__}: {e}")
        log.error("ckpt_callbacks: closing the CheckpointManager of %s, while the `with` block raised %s, "
                  "failed too: %s", store.url, type(exc).__name__, text)
        note = f"ckpt_callbacks: closing the CheckpointManager of {store.url} also failed: {text}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:   # Python 3.10: what add_note keeps, by hand
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
