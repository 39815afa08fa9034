"""CheckpointHook: checkpointing for a hand-written Flax (NNX or Linen) training loop.

Example (NNX; the Linen form is the same with a `TrainState` that `restore_or_init` returns anew;
docs/flax.md has both, with a Grain data pipeline)::

    import grain, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import ckpt_callbacks as cc
    from ckpt_callbacks.flax import CheckpointHook
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    it = iter(grain.MapDataset.range(10**6).map(lambda i: np.full((8, 4), i % 7, np.float32)))
    loss_of = lambda model, x: jnp.mean((model(x)[:, 0] - x.sum(1)) ** 2)
    @nnx.jit
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(loss_of)(model, x)
        optimizer.update(model, grads)
        return loss
    evaluate = lambda model: {"val_loss": float(loss_of(model, jnp.ones((8, 4))))}
    num_steps = 1000
    hook = CheckpointHook("/tmp/run", every_steps=100, retention=cc.KeepLast(3))
    (model, optimizer), step = hook.restore_or_init((model, optimizer), data_iterator=it)
    while step < num_steps:
        loss = train_step(model, optimizer, next(it))        # nnx.jit, updates in place
        step += 1
        metrics = evaluate(model) if step % 500 == 0 else None
        hook(step, (model, optimizer), metrics=metrics)      # True when a save started
        if hook.should_stop:                                 # SIGTERM: saved and committed
            break
    hook.close()

Who calls what, in which order, on which process: every process constructs the hook (on the main
thread, so that it can watch SIGTERM), calls `restore_or_init` once before the loop, then
`hook(step, state)` after every training step with the number of steps completed so far, with
the same arguments on every process (SPMD), and finally `close`. Saves are asynchronous: `hook`
blocks only for the snapshot (see `CheckpointManager.save`).

What is saved: for NNX (a Module, an `nnx.Optimizer`, `nnx.Rngs`, or a tuple/list/dict of them)
``nnx.state(state)`` -- every Variable, typed RNG keys and optimizer state included -- restored
with ``nnx.update`` in place onto the shardings the live Variables have now (so a model saved on a
4x2 mesh resumes on 2x4); a tuple/list/dict that also holds other values (``{"model": m, "step":
7}``) is saved element by element, and `restore_or_init` returns it anew. Any other pytree (a Linen `TrainState`, a dict) is saved as is and
restored onto its own leaves' shardings; `restore_or_init` then returns a new state. The data
iterator's ``get_state()`` (Grain `DatasetIterator`, `DataLoader` iterators, any object with
``get_state``/``set_state``) is saved per process as host state at the same step boundary, so a
resumed run sees exactly the batches an uninterrupted run would.

When it saves: at steps where ``step % every_steps == 0``, at `on_steps`, when `every_secs` passed
since the last save, at every step called with eval `metrics` (``save_on_eval=True``; this is what
lets `KeepBest` rank evaluations, and a step without metrics is never a best candidate), and on
preemption. With none of the three schedules given, it saves every step (like the manager's
default ``save_interval_steps=1``; with a manager passed in, every ``save_interval_steps`` of
it); an empty `on_steps` alone schedules no step (as CLU's): the hook then saves at eval steps
and on preemption only (with ``save_on_eval=False`` it is a `ConfigError`).

Eval metrics: pass them as ``hook(step, state, metrics=...)``, or call ``report_eval(step,
metrics)`` *before* ``hook(step, ...)`` for that step. Metrics are written in the step's manifest
at save time; a report for a step already passed to the hook raises `ConfigError` (the state of
that step is gone, and a committed manifest is never rewritten).

Preemption: on SIGTERM (configurable) the handler only sets a flag; the next hook call saves that
step (whatever the schedule), waits until it is committed, sets ``hook.should_stop`` and returns
True; with ``on_preemption="raise"`` it then raises `Preempted` instead. The loop should exit.
With several processes, every hook call first agrees (through the coordination service) whether
any process was signalled or any `every_secs` timer expired, so all save the same step.
"""

from __future__ import annotations

import logging
import math
import operator
import signal
import sys
import time

import msgpack
import numpy as np

from . import resume
from .checks import check_flag, check_metrics, check_step, check_timeout
from .coordination import agree_round
from .errors import (CheckpointError, CheckpointNotFoundError, CheckpointSaveError, ConfigError,
                     IncompatibleCheckpointError)
from .manager import CheckpointManager
from .shutdown import close_on_exit
from .preemption import Preempted, PreemptionWatcher, checked_on_preemption, checked_signals
from .retention import as_int

__all__ = ["CheckpointHook", "Preempted"]

log = logging.getLogger("ckpt_callbacks")

_ITER_KEY = "data_iterator"


# -- the train state as a pytree ------------------------------------------------------------------

def _nnx():
    """`flax.nnx` if the program imported it (NNX objects cannot exist otherwise), else None."""
    return sys.modules.get("flax.nnx")


def _is_nnx(state) -> bool:
    nnx = _nnx()
    if nnx is None:
        return False
    if nnx.graph.is_graph_node(state):
        return True
    if isinstance(state, (tuple, list)):
        return any(_is_nnx(x) for x in state)
    if isinstance(state, dict):
        return any(_is_nnx(x) for x in state.values())
    return False


def _mixed(state) -> bool:
    """A tuple/list/dict holding NNX objects beside other values (``{"model": m, "step": 3}``):
    ``nnx.state`` of it would drop its Python numbers, str and None, and ``nnx.update`` cannot
    set a tuple's elements back, so each element is saved (and put back) on its own."""
    if not isinstance(state, (tuple, list, dict)) or not _is_nnx(state):
        return False
    items = state.values() if isinstance(state, dict) else state
    return not all(_nnx().graph.is_graph_node(x) for x in items)


def _elements(state, fn, other=None):
    """`state` (a tuple, list or dict) rebuilt from ``fn(element, other's element)``."""
    if isinstance(state, dict):
        return {k: fn(v, None if other is None else other[k]) for k, v in state.items()}
    out = [fn(v, None if other is None else other[i]) for i, v in enumerate(state)]
    return type(state)(*out) if hasattr(state, "_fields") else type(state)(out)


def state_tree(state):
    """The pytree saved for `state`: ``nnx.state(state)`` for NNX objects (a container mixing them
    with other values: element by element), `state` itself otherwise."""
    if _mixed(state):
        return _elements(state, lambda x, _: state_tree(x))
    return _nnx().state(state) if _is_nnx(state) else state


def put_back(state, restored):
    """Apply a restored tree to `state`: ``nnx.update`` in place for NNX (returns `state`; a
    container mixing NNX objects with other values comes back anew, holding the same NNX objects),
    otherwise the restored tree is the new state."""
    if _mixed(state):
        return _elements(state, put_back, restored)
    if _is_nnx(state):
        _nnx().update(state, restored)
        return state
    return restored


def _as_step(step) -> int:
    s = as_int(step)   # an int, numpy int or 0-d integer array (a TrainState's step); never a bool
    if s is None:
        raise ConfigError(f"step must be an int (the number of training steps done), got "
                          f"{type(step).__name__} {step!r}")
    return check_step(s)   # a step names a directory of 10 digits: refused as the manager's save refuses it


def _checked_iterator(it):
    """`it` if it can report and take its position (else every save would fail, at the first one)."""
    missing = [m for m in ("get_state", "set_state") if it is not None and not callable(getattr(it, m, None))]
    if missing:
        raise ConfigError(
            f"data_iterator: {type(it).__name__} has no {' or '.join(m + '()' for m in missing)}, so its position "
            f"cannot be saved and restored. Fix: pass a Grain DatasetIterator / DataLoader iterator or an "
            f"object with get_state() and set_state(state), or data_iterator=None (the data then restarts "
            f"from its beginning on resume)")
    return it


def _positive_or_none(name, v, kind=int):
    """A positive int (numpy integers too) or finite positive float for `kind=float`, or None."""
    if v is None:
        return None
    try:
        if isinstance(v, (bool, np.bool_)):
            raise TypeError
        n = operator.index(v) if kind is int else float(v)
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or not math.isfinite(n) or n <= 0 or (kind is float and isinstance(v, (str, bytes))):
        raise ConfigError(f"{name} must be a positive {'int' if kind is int else 'number of seconds'} "
                          f"or None, got {v!r}")
    return int(n) if kind is int else n


class CheckpointHook:
    """Saves a training loop's state on a schedule; resumes it.

    Example (the methods' examples continue this one)::

        import jax.numpy as jnp
        from ckpt_callbacks.flax import CheckpointHook
        hook = CheckpointHook("/tmp/run", every_steps=10, retention={"keep_last": 2})

    The order of calls, on which thread and process, and what is saved: see the module docstring.

    Args:
      directory_or_manager: a directory / ``s3://`` / ``gs://`` URL (the hook then owns a
        `CheckpointManager` and closes it), or an existing open, writing manager (not closed by
        the hook; a read-only or closed one is a `ConfigError`).
      every_steps, every_secs, on_steps: CLU-style schedule; any that fires saves the step
        (`on_steps`: a collection of steps; a ``range`` is kept as is, however long). None of
        them given: every step, or every ``save_interval_steps`` of a manager passed in (given
        one, the hook's schedule decides, not the manager's interval).
      retention: policy / list / config dict for the manager the hook creates (see
        `CheckpointManager`); give it to your own manager instead when passing one.
      data_iterator: object with ``get_state()``/``set_state()``; can also be given to
        `restore_or_init`.
      save_on_eval: save every step that comes with eval metrics (default True; True or False).
      on_preemption: ``"flag"`` (set `should_stop`) or ``"raise"`` (raise `Preempted`).
      preemption_signals: signals that mean "preempted" (default SIGTERM); ``()`` watches none.
        A collection of signals a handler can catch (not SIGKILL or SIGSTOP), else `ConfigError`.
      async_save: passed to the manager the hook creates.
      timeout_s: passed to the manager the hook creates (None: its default, 600 s): with several
        processes, how long a hook call, save or restore waits for the others; a process that
        died makes the survivors' next hook call raise `CheckpointSaveError` after it. Keep it
        below half of JAX's heartbeat timeout, which otherwise terminates the survivors first,
        raising nothing (docs/multihost.md).
      clock: seconds, monotonic; inject for tests of `every_secs`.
    """

    def __init__(self, directory_or_manager, *, every_steps: int | None = None, every_secs: float | None = None,
                 on_steps=None, retention=None, data_iterator=None, save_on_eval: bool = True,
                 on_preemption: str = "flag", preemption_signals=(signal.SIGTERM,), async_save: bool = True,
                 timeout_s: float | None = None, clock=time.monotonic):
        check_flag("save_on_eval", save_on_eval)   # "false" (a config's string) is truthy
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning monotonic seconds (like time.monotonic), got {clock!r}")
        self.every_steps = _positive_or_none("every_steps", every_steps)
        self.every_secs = _positive_or_none("every_secs", every_secs, float)
        try:
            if isinstance(on_steps, (str, bytes)):
                raise TypeError(on_steps)
            if isinstance(on_steps, range) and on_steps.step > 0:
                # kept as is: a range answers `in` at once, however many steps it spans
                for s in (on_steps[0], on_steps[-1]) if on_steps else ():   # its first and last step
                    _as_step(s)
                self.on_steps = on_steps
            else:
                self.on_steps = frozenset(_as_step(s) for s in (on_steps if on_steps is not None else ()))
        except ConfigError as e:
            raise ConfigError(f"on_steps: {e}") from None
        except TypeError:   # not a collection: an int, a str, a 0-d numpy array
            raise ConfigError(f"on_steps must be a collection of steps (e.g. [1000, 5000]), got {on_steps!r}") from None
        if self.every_steps is None and self.every_secs is None and not self.on_steps:
            # an empty on_steps, given, schedules no step (as CLU's): saves come with eval metrics
            # and on preemption only; with neither kind of save left, it is refused
            if on_steps is not None and not save_on_eval:
                raise ConfigError(
                    f"on_steps={on_steps!r} is empty, no every_steps / every_secs is given and save_on_eval=False, "
                    f"so nothing would be saved but on preemption. Fix: list the steps to save, give every_steps= "
                    f"or every_secs=, or leave all three unset to save every step.")
            if on_steps is None:   # a manager passed in says how often: its save_interval_steps
                self.every_steps = as_int(getattr(directory_or_manager, "save_interval_steps", 1))
        self.on_preemption = checked_on_preemption(on_preemption, ("flag", "raise"))
        self.save_on_eval = save_on_eval
        self.data_iterator = _checked_iterator(data_iterator)
        preemption_signals = checked_signals(preemption_signals)
        self.clock = clock
        if timeout_s is not None:
            check_timeout(timeout_s)
        if isinstance(directory_or_manager, CheckpointManager):
            if retention is not None or async_save is not True or timeout_s is not None:
                raise ConfigError("retention=, async_save= and timeout_s= are for the manager the hook creates; you "
                                  "passed a CheckpointManager: give them to it instead")
            if directory_or_manager.read_only or directory_or_manager._closed:   # else: refused at the first save
                raise ConfigError(f"the CheckpointManager of {directory_or_manager.store.url} is "
                                  f"{'read-only' if directory_or_manager.read_only else 'closed'}: the hook saves "
                                  f"through it. Fix: pass an open manager without read_only=True, or the directory")
            self.manager, self._owns_manager = directory_or_manager, False
        else:
            self.manager = CheckpointManager(directory_or_manager, retention=retention, async_save=async_save,
                                             **({} if timeout_s is None else {"timeout_s": timeout_s}))
            self._owns_manager = True
        self.coord = self.manager.coord
        self.should_stop = False
        self.last_saved_step: int | None = None
        self._last_step: int | None = None       # the last step passed to the hook / restored
        self._last_save_time = clock()
        self._pending: dict[int, dict] = {}
        self._warned_back = False
        self._replace: set[int] = set()   # damaged steps a fallback went past: replaced when reached
        self._closed = False
        self._watcher = PreemptionWatcher(preemption_signals) if preemption_signals else None

    # -- start ------------------------------------------------------------------------------------
    def restore_or_init(self, state, data_iterator=None, *, iterator_remap=None, fallback: bool = False):
        """Return ``(state, start_step)``: the latest committed checkpoint applied to `state`, or
        ``(state, 0)`` when there is none. With several processes, process 0 picks the step
        (`CheckpointManager.restore`) and every process resumes from it.

        Example::

            state, step = hook.restore_or_init({"w": jnp.zeros(3)})   # a new directory: step 0

        `state` is the freshly initialised train state: its leaves give the shardings, shapes and
        dtypes to restore onto (a different mesh than at save time is fine). NNX objects are
        updated in place and returned; other pytrees come back as a new tree. The data iterator's
        position is restored too (this process's own state); a `data_iterator` given here is the
        one the hook saves from then on, once the restore works (after a refusal, a retry without
        it restores without one). Call it once, before the loop, on
        every process. Resuming on a different process count needs `iterator_remap` to say which
        saved iterator state each process takes: ``{this_process: saved_process}`` or
        ``fn(saved: dict[int, host_state], process_index, process_count) -> host_state`` (see
        `CheckpointManager.host_state`; a host state is ``{"data_iterator": it.get_state()}``).
        A damaged latest step raises `CorruptCheckpointError`; with ``fallback=True`` the newest
        intact step is restored instead, with a warning (`CheckpointManager.restore`).
        """
        self._check_open()
        # taken on only by a restore that works: a retry without it, as a refusal below advises, works
        it = self.data_iterator if data_iterator is None else _checked_iterator(data_iterator)
        try:
            # the latest step as process 0 lists it (after a save in flight): each process listing
            # for itself could resume one from a step and another from scratch, silently
            restored = self.manager.restore(target=state_tree(state), fallback=fallback)
        except CheckpointNotFoundError as e:
            if getattr(e, "deleted", False):   # deleted while read, again and again: not "no checkpoint"
                raise
            self._last_step, self._last_save_time = 0, self.clock()
            self.data_iterator = it
            return state, 0
        step = self.manager.restored_step
        if fallback:   # the damaged steps after it: the resumed run saves those step numbers anew, over them
            self._replace = {s for s in self.manager.all_steps() if s > step}
        if it is not None:
            try:
                # read on every process at once: one failing alone would leave the others training
                # into their first collective with it (a damaged host/p<i>.msgpack fails them all)
                hs = resume.host_state_together(self.manager, step, remap=iterator_remap)
            except IncompatibleCheckpointError as e:
                raise IncompatibleCheckpointError(
                    f"{e}\nWith CheckpointHook: pass restore_or_init(..., iterator_remap=...) with that "
                    f"mapping, or data_iterator=None to restart the data pipeline.", e.mismatches) from None
            except ConfigError as e:   # a bad mapping: named as the argument given here
                raise ConfigError(f"iterator_remap: {e}") from None
            if callable(iterator_remap) and (not isinstance(hs, dict) or _ITER_KEY not in hs):
                raise ConfigError(
                    f"iterator_remap returned {hs!r} for process {self.coord.process_index}: it must return a host "
                    f"state as saved, {{{_ITER_KEY!r}: <the iterator's state>}} (e.g. saved[p]), not the "
                    f"iterator's state alone")
            if not isinstance(hs, dict) or _ITER_KEY not in hs:
                raise IncompatibleCheckpointError(
                    f"step {step} in {self.manager.store.url} holds no data-iterator state for process "
                    f"{self.coord.process_index}, but a data_iterator was given. Fix: restore without "
                    f"data_iterator= (the iterator then starts from its beginning), or resume from a "
                    f"checkpoint saved with one on the same number of processes.",
                    [(f"host_state[{self.coord.process_index}]['data_iterator']", "absent", "present")])
            it.set_state(hs[_ITER_KEY])
        elif _ITER_KEY in (self._saved_host_state(step) or {}):
            log.warning("ckpt_callbacks: step %d in %s holds this process's data-iterator position, but "
                        "restore_or_init got no data_iterator: the data pipeline starts from its beginning "
                        "(pass data_iterator= to continue where it was)", step, self.manager.store.url)
        state = put_back(state, restored)
        self.data_iterator = it
        self._last_step = self.last_saved_step = step
        self._last_save_time = self.clock()
        log.info("ckpt_callbacks: resumed from step %d of %s", step, self.manager.store.url)
        return state, step

    def _saved_host_state(self, step):
        try:
            hs = self.manager.host_state(step)
        except CheckpointError:   # e.g. saved on another process count: only a warning hangs on it
            return None
        return hs if isinstance(hs, dict) else None

    # -- every step -------------------------------------------------------------------------------
    def report_eval(self, step, metrics: dict) -> None:
        """Record eval `metrics` for `step`; the coming ``hook(step, ...)`` call saves them with it.

        Example::

            hook.report_eval(step + 1, {"val_loss": 0.5})   # before hook(step + 1, ...)

        Must come before ``hook(step, state)`` for that step: after it, raises `ConfigError`, as
        for metrics that cannot be stored (not a dict of str -> number or str, e.g. an array).
        """
        self._check_open()
        step = _as_step(step)
        if not isinstance(metrics, dict):
            raise ConfigError(f"report_eval: metrics must be a dict of str -> number, got {type(metrics).__name__}")
        try:
            metrics = check_metrics(metrics)   # here, not at the hook call of that step (its save would fail)
        except ConfigError as e:
            raise ConfigError(f"report_eval(step={step}): {e}") from None
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(
                f"report_eval(step={step}) arrived after hook({self._last_step}, ...): the state of step "
                f"{step} was already handed over (and a committed manifest is never rewritten). Fix: call "
                f"report_eval(step, metrics) before hook(step, state), or pass hook(step, state, metrics=...).")
        self._pending.setdefault(step, {}).update(metrics)

    def __call__(self, step, state, metrics: dict | None = None) -> bool:
        """Call after every training step with the number of steps done; True when a save started.

        Example::

            while step < 25:
                state = {"w": state["w"] + 1}
                step += 1
                hook(step, state)   # True at 10 and 20 (every_steps), and at 1 (its eval metrics)

        On a preemption step the save is committed before this returns; then `should_stop` is
        True (or `Preempted` is raised with ``on_preemption="raise"``).
        """
        self._check_open()
        try:
            step = _as_step(step)
            if metrics is not None and not isinstance(metrics, dict):
                raise ConfigError(f"metrics must be a dict of str -> number, got {type(metrics).__name__}")
        except ConfigError as e:   # told to the other processes first: they raise with this one
            self._agree(step, False, refused=e)
            raise
        pending = self._pending.pop(step, None)
        for s in [s for s in self._pending if s < step]:
            log.warning("ckpt_callbacks: eval metrics reported for step %d were never saved: the hook was "
                        "not called with step %d", s, s)
            del self._pending[s]
        if pending:
            metrics = {**pending, **(metrics or {})}
        if self._last_step is not None and step < self._last_step and not self._warned_back:
            self._warned_back = True   # e.g. a step counted within the epoch: nothing would be saved
            log.warning("ckpt_callbacks: CheckpointHook got step %d after step %d: steps must count every training "
                        "step done since the start of the run; a step already saved is not saved again", step,
                        self._last_step)
        self._last_step = step
        preempted, timer, evaled = self._agree(step, bool(metrics) and self.save_on_eval)
        due = (timer or evaled or step in self.on_steps
               or (self.every_steps is not None and step % self.every_steps == 0))
        started = False
        if (due or preempted) and step != self.last_saved_step:
            started = self.save(step, state, metrics=metrics)
        elif metrics and step == self.last_saved_step:
            log.warning("ckpt_callbacks: step %d is already saved; its eval metrics are not recorded", step)
        if preempted:
            self._stop(step)
        return started

    def save(self, step, state, *, metrics: dict | None = None) -> bool:
        """Save `step` now, whatever the schedule (e.g. the final step); True when a save started.

        Example::

            hook.save(step, state)   # 25, off the schedule: True

        Returns False, quietly, when `step` is already committed (the schedule saved it; a resumed
        run reaching a saved step); a save of `step` in flight is waited for first, and its failure
        raised (then the next ``save(step, ...)`` saves it). Eval metrics that `report_eval` got
        for `step` are saved with it (`metrics` given here take precedence).
        """
        self._check_open()
        step = _as_step(step)
        pending = self._pending.pop(step, None)   # (a hook call passes them on itself)
        if pending:
            metrics = {**pending, **(metrics or {})}
        tree = host = refused = None
        try:
            tree = state_tree(state)
            if self.data_iterator is not None:
                host = {_ITER_KEY: self.data_iterator.get_state()}
        except Exception as e:  # noqa: BLE001 - one process alone: the others hear of it in the save
            if self.coord.process_count == 1:
                raise
            refused = e   # raised here by the manager, after every process refused the call at once
        # the hook decides when (not the manager's interval), and never replaces a committed step
        # (which the manager finds out, for every process alike, and skips quietly)
        started = self.manager._save(step, tree, metrics=metrics, host_state=host, due=True,
                                     quiet=True, replace=step in self._replace, refused=refused)
        self._replace.discard(step)
        if started:
            self.last_saved_step = step
            self._last_save_time = self.clock()
        return started

    def _agree(self, step, evaled: bool, refused: Exception | None = None) -> tuple[bool, bool, bool]:
        """(preempted, every_secs timer fired, eval metrics given), the same answer on every
        process: one that evaluates alone (metrics on process 0 only) saves with the others.
        A call that this process `refused` (its step or metrics: a `ConfigError`, raised by the
        caller) is refused by every process at once: the others raise `CheckpointSaveError`
        naming it, rather than wait for it here until their timeout. So is a call with another
        step than the others' (each would decide its schedule alone, and one wait in a save that
        the others skipped)."""
        preempted = bool(self._watcher and self._watcher.requested)
        timer = self.every_secs is not None and self.clock() - self._last_save_time >= self.every_secs
        if self.coord.process_count > 1 and (self._watcher is not None or self.every_secs is not None
                                             or self.save_on_eval):
            self.manager._nhook_calls += 1   # counted by the manager: a later hook on it reuses no key
            why = None if refused is None else f"{type(refused).__name__}: {refused}"
            mine = msgpack.packb([preempted, timer, evaled, why, None if refused is not None else step])
            got = [msgpack.unpackb(g) for g in agree_round(
                self.coord, f"hook/{self.manager.store.url.lstrip('/')}/", self.manager._nhook_calls, mine,
                self.manager.timeout_s)]
            failures = {i: g[3] for i, g in enumerate(got) if g[3] is not None}
            if failures and refused is None:
                raise CheckpointSaveError(
                    f"hook({step!r}, ...): process(es) {sorted(failures)} refused the call "
                    f"({'; '.join(f'{i}: {w}' for i, w in failures.items())}); nothing was saved, every "
                    f"process raises (each process must call the hook with the same step, and metrics "
                    f"that are a dict or None)", failures)
            steps = {i: g[4] for i, g in enumerate(got)}
            if not failures and len(set(steps.values())) > 1:
                raise CheckpointSaveError(
                    f"nothing was saved: the processes called the hook with different steps ({steps}); every "
                    f"process must call hook(step, state) with the same step after every training step",
                    {i: f"step {s}" for i, s in steps.items()})
            preempted, timer, evaled = (any(g[i] for g in got) for i in range(3))
        return preempted, timer, evaled

    def _stop(self, step) -> None:
        self.manager.wait_until_finished()   # a failure leaves the request standing: the next call saves again
        if self._watcher is not None:       # handled: a loop that goes on saves on schedule again
            self._watcher.requested = False
        # this step, where it committed (the latest may be a damaged step that a fallback went past)
        saved = step if step in self.manager.all_steps() else self.manager.latest_step()
        self.should_stop = True
        sig = signal.Signals(self._watcher.signum).name if self._watcher and self._watcher.signum else "a peer"
        log.warning("ckpt_callbacks: preempted (%s): step %d is committed in %s; stop the loop",
                    sig, saved if saved is not None else -1, self.manager.store.url)
        if self.on_preemption == "raise":
            raise Preempted(f"preempted ({sig}) at step {step}; checkpoint committed at step {saved} in "
                            f"{self.manager.store.url}. Re-run the same command to resume.", step)

    # -- end --------------------------------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Wait for the save in flight (and its retention); re-raise a background failure.

        Example::

            hook.wait_until_finished()
            hook.manager.all_steps()   # [20, 25]: keep_last=2
        """
        self.manager.wait_until_finished()

    def _check_open(self):
        if self._closed:
            raise CheckpointError("this CheckpointHook is closed")

    def close(self) -> None:
        """Wait for the save in flight, restore the previous signal handlers, close an owned manager.

        Example::

            hook.close()   # or use the hook as a context manager: ``with CheckpointHook(...) as hook:``
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._owns_manager:
                self.manager.close()
            else:
                self.manager.wait_until_finished()
        finally:
            if self._watcher is not None:
                self._watcher.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        close_on_exit(self.close, exc, self.manager.store)
        return False
