"""Where a resumed `fit` starts: the latest step restored into the model, and the data's position.

Example::

    import keras, numpy as np
    from ckpt_callbacks.keras import AsyncCheckpoint
    x, y = np.random.rand(32, 2), np.random.rand(32, 1)
    for epochs in (2, 4):                     # the second fit resumes: keras_resume.restore(cb, step)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="out")], name="net")
        model.compile("adam", "mse")
        cb = AsyncCheckpoint("/tmp/run")
        model.fit(x, y, epochs=epochs, callbacks=[cb], verbose=0)
        print(cb.resumed_step, cb.initial_epoch)   # None 0, then 2 2

Who calls what, on every process: `AsyncCheckpoint.batches` calls `position_data` at the
generator's first ``next()`` (the iterator's position, before Keras reads its first batches);
`AsyncCheckpoint.on_train_begin` calls `check_epochs_are_passes`, then `restore` for the latest
committed step (strict: every variable, or nothing loaded), which sets the model's
``_initial_epoch`` and the batch the resumed epoch continues after. `epoch_steps` is saved with
each step (host state) so that a resume into epochs of another length is recognised.
"""

from __future__ import annotations

import copy
import logging
import math

import keras

from . import coordination, keras_state, resume
from .errors import CheckpointError, ConfigError, IncompatibleCheckpointError
from .keras_data import ResumableDataset
from .manager import CheckpointManager

__all__ = ["position_data", "epoch_steps", "check_epochs_are_passes", "restore", "newest_intact", "state_of",
           "copy_state", "same"]

log = logging.getLogger("ckpt_callbacks")


def state_of(data):
    """`data.get_state()`, or None where it fails (then nothing is compared)."""
    try:
        return data.get_state()
    except Exception:  # noqa: BLE001 - only used to compare
        return None


def copy_state(state):
    """A deep copy of an iterator state (msgpack-able data) to compare with later; None where it
    cannot be copied (then nothing is compared). An iterator may return its live state object,
    which its next batches change: kept as is, it always equalled the iterator's later state."""
    try:
        return copy.deepcopy(state)
    except Exception:  # noqa: BLE001 - only used to compare
        return None


def same(a, b) -> bool | None:
    """Whether two iterator states are equal; None where they cannot be compared."""
    if a is None or b is None:
        return None
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. states holding numpy arrays
        return None


def newest_intact(manager: CheckpointManager, latest: int) -> int:
    """The newest committed step up to `latest` whose every byte reads intact (as `restore(fallback=True)`
    picks it), warning about each damaged one; `latest` when all are damaged (its restore then fails)."""
    from .verify import problem_text, verify_step
    for s in reversed([s for s in manager.all_steps() if s <= latest]):
        problems = verify_step(manager.store, s)
        if not problems:
            return s
        log.warning("ckpt_callbacks: step %d in %s is damaged (%s); positioning the data at an older step",
                    s, manager.store.url, problem_text(*problems[0]))
    return latest


def host_state(cb, manager, step: int, coord=None) -> dict:
    """This process's host state of `step` (``rng``, ``steps``, ``data``), read on every process at
    once (`resume.host_state_together`), through ``cb.data_remap``. Saved by another number of
    processes and without `data_remap`: `IncompatibleCheckpointError` when `cb` has a state
    iterator (which position it continues from is not known), else ``{}`` with a warning."""
    remap = cb.data_remap
    if callable(remap):   # over the saved iterator states only; no RNG then
        user = remap

        def remap(saved, pi, pc):
            return {"data": user({p: (h or {}).get("data") for p, h in saved.items()}, pi, pc)}
    try:
        return resume.host_state_together(manager, step, coord, remap=remap) or {}
    except IncompatibleCheckpointError as e:   # saved by another number of processes
        if not cb._state_iterator():
            log.warning("ckpt_callbacks: not restoring the host RNG state of step %d: %s", step, e)
            return {}
        _, saved, now = e.mismatches[0] if e.mismatches else ("", "another number of processes", "this one")
        raise IncompatibleCheckpointError(
            f"AsyncCheckpoint: step {step} in {manager.store.url} was saved by {saved} and this fit() runs "
            f"on {now}, so which saved position the data= iterator of process {manager.coord.process_index} "
            f"continues from is not known (the data's sharding changes with the process count); nothing "
            f"was restored. Fix: pass AsyncCheckpoint(data_remap={{this_process: saved_process}}) or "
            f"data_remap=fn(saved_states, process_index, process_count) -> state, or leave out data= to "
            f"start the data from its beginning.", e.mismatches) from None


def position_data(cb) -> int | None:
    """Put `data` at the latest committed step's position; that step, or None where there is
    none or it holds no state for this process (as `on_train_begin` treats it). Any other
    failure (e.g. unreachable storage) is raised: into `fit`, from its input. With `fallback`,
    the newest step that reads intact (verified first: a resume then reads that step twice)."""
    with CheckpointManager(cb.directory, read_only=True, timeout_s=cb.timeout_s) as manager:
        step = manager.latest_step()
        if step is None:
            return None
        if cb.fallback:   # the step on_train_begin will restore: the newest that reads intact
            step = newest_intact(manager, step)
        # read on every process at once: one that fails alone would leave the others in Keras'
        # first collective over the batches it reads (a damaged host/p<i>.msgpack fails them all)
        coord = coordination.for_collective_read(manager.coord, manager.store.url)
        state = host_state(cb, manager, step, coord).get("data")
    if state is None:
        return None
    cb.data.set_state(state)
    return step


def epoch_steps(cb) -> int | None:
    """Batches in an epoch of this fit: a ResumableDataset's pass, else Keras' steps (None when
    unknown: an iterator without a length). Saved with each step: a mid-epoch resume into
    epochs of another length (another batch size) continues at a batch that means other data."""
    if isinstance(cb.data, ResumableDataset):
        return int(cb.data.dataset.num_batches)
    steps = (cb.params or {}).get("steps")
    return int(steps) if steps else None


def check_epochs_are_passes(cb) -> None:
    """A ResumableDataset's epoch must be one pass over it: with another `steps_per_epoch`,
    Keras carries its iterator over epoch ends (or stops short), so epochs and passes drift
    apart and an epoch's batch order would change in the middle of a pass."""
    if not isinstance(cb.data, ResumableDataset):
        return
    steps = (cb.params or {}).get("steps")
    n = int(cb.data.dataset.num_batches)
    if steps is None or int(steps) == n:
        return
    if cb.data.skip and int(steps) == cb.data.num_batches:
        # Keras read the length before any callback ran, while the wrapper still stood inside
        # the resumed epoch of an earlier fit() that raised: every epoch would be that short
        cb.data.set_position(cb.data.epoch, 0)
        raise ConfigError(
            f"AsyncCheckpoint: the ResumableDataset was still positioned inside an epoch (after batch "
            f"{n - int(steps)}) of an earlier fit() that raised when this fit() read its length, so every "
            f"epoch would run {steps} of its {n} batches; nothing was trained. Its position is reset now: "
            f"call fit() again.")
    raise ConfigError(
        f"AsyncCheckpoint: fit() runs {steps} steps per epoch, but the ResumableDataset holds {n} "
        f"batches: its epochs must be whole passes for a resume to continue at the right batch. "
        f"Fix: drop steps_per_epoch (or set it to {n}), or make the dataset's length the epoch.")


def restore(cb, step: int) -> None:
    model = cb.model
    if not hasattr(model, "_initial_epoch"):
        raise CheckpointError(f"this Keras ({keras.__version__}) has no model._initial_epoch, which "
                              "AsyncCheckpoint sets to resume at the next epoch; use Keras >= 3.0")
    data_at, cb._data_at = cb._data_at, None   # used once: a fit() that raises leaves no claim
    target = {"model": keras_state.state_tree(model), "progress": dict.fromkeys(keras_state.PROGRESS, 0)}
    try:
        if cb.fallback:   # the newest intact step (a warning names each damaged one passed)
            tree = cb.manager.restore(target=target, fallback=True)
            latest, step = step, cb.manager.restored_step
            # the damaged steps after it: the resumed run saves those step numbers anew, over them
            cb._replace = {s for s in cb.manager.all_steps() if step < s <= latest}
        else:
            tree = cb.manager.restore(step, target=target)
    except IncompatibleCheckpointError as e:
        raise keras_state.mismatch(e, "AsyncCheckpoint: the model", cb.manager.store.url, step,
                                   "build and compile the same model (layer names and shapes, optimizer, "
                                   "metrics) before fit(), or start in a new directory.") from None
    host = host_state(cb, cb.manager, step)   # (damage on one process fails every process)
    move_data = host.get("data") is not None and cb._state_iterator() and step != data_at
    if move_data and cb._yields != cb._yields_mark:   # before anything is loaded
        raise ConfigError(
            f"AsyncCheckpoint: fit() read batches from a batches() generator at a position other "
            f"than step {step}'s (the generator of an earlier fit() whose last save was not "
            f"committed, or that raised), so resuming would train on them first; nothing was "
            f"restored. Fix: pass a new cb.batches() to each fit().")
    progress = tree["progress"]
    epoch, batch = int(progress["epoch"]), int(progress["batch"])
    if batch and cb.data is None:   # before anything is loaded
        raise ConfigError(
            f"AsyncCheckpoint: step {step} in {cb.manager.store.url} was saved inside epoch {epoch + 1}, "
            f"after batch {batch} (by a run with data= or an int save_freq), but this AsyncCheckpoint has no "
            f"data=, so fit() would train on that epoch's first {batch} batches again; nothing was restored. "
            f"Fix: pass data= as the run that saved it did (the ResumableDataset also given to fit(), or the "
            f"iterator), or data=False to restart that epoch from its first batch.")
    values = tree["model"]
    keras_state.assign(model, values)
    cb._resumed_metrics = keras_state.flatten(values["metrics_variables"])
    cb._global_step = int(progress["global_step"])
    best = progress["best"]
    ranked_by = host.get("monitor")   # [monitor, mode] of the run that saved (absent in older steps)
    if ranked_by is not None and list(ranked_by) != [cb.monitor, cb._mode]:
        cb.best = cb.initial_value_threshold   # another metric's or direction's best means nothing here
    else:
        cb.best = None if best is None or math.isnan(best) else float(best)
    if host.get("rng"):
        keras_state.set_rng_state(host["rng"])
    if move_data:
        cb.data.set_state(host["data"])   # (at `_data_at`, fit() has read on from there already)
    saved_policies = host.get("dtype_policies")
    if saved_policies is not None and list(saved_policies) != cb._dtype_policies:
        log.warning("ckpt_callbacks: step %d was trained by a model with the dtype policies %s, and this one has "
                    "%s: the resumed run computes in other dtypes than the run that saved (the variables restore "
                    "all the same). keras.backend.clear_session() resets the global policy: call "
                    "keras.mixed_precision.set_global_policy(...) again after it, before building the model",
                    step, ", ".join(saved_policies), ", ".join(cb._dtype_policies))
    saved_steps, steps = host.get("steps"), epoch_steps(cb)
    if batch and saved_steps and steps and int(saved_steps) != steps:
        log.warning("ckpt_callbacks: step %d was saved after batch %d of epoch %d, whose epochs had %d "
                    "batches; this fit's have %d (another batch size, steps_per_epoch or dataset?), so batch "
                    "%d is not the same place in the data: the epoch continues from there all the same "
                    "(resume from an epoch-end step to avoid this)", step, batch, epoch + 1, int(saved_steps),
                    steps, batch)
        if batch >= steps:   # nothing of that epoch is left (Keras fails on an epoch that runs no step)
            log.warning("ckpt_callbacks: batch %d is at or past the end of this fit's epochs: resuming at the "
                        "start of epoch %d", batch, epoch + 2)
            epoch, batch = epoch + 1, 0
    if batch and cb._state_iterator():
        log.warning("ckpt_callbacks: step %d was saved after batch %d of epoch %d; the iterator continues "
                    "at the next unseen batch, but Keras runs all of that epoch's steps_per_epoch batches "
                    "again, so later epochs end %d batches later than in an uninterrupted run (for an exact "
                    "mid-epoch resume use ResumableDataset, or save at epoch ends)", step, batch, epoch + 1,
                    batch)
    if batch and cb.data is False:
        log.warning("ckpt_callbacks: step %d was saved after batch %d of epoch %d; data=False, so that "
                    "epoch restarts from its first batch", step, batch, epoch + 1)
        batch = 0
    epochs = (cb.params or {}).get("epochs")
    if epochs is not None and epoch >= epochs:
        log.warning("ckpt_callbacks: AsyncCheckpoint: resumed from step %d at epoch %d, but fit(epochs=%d) "
                    "ends there: nothing left to train (epochs count from the start of the run in %s, "
                    "as with BackupAndRestore; raise `epochs` to train on)", step, epoch + 1, epochs,
                    cb.manager.store.url)
    model._initial_epoch = epoch or None
    cb._set_initial_epoch = True
    cb._resume_at = (epoch, batch)
    cb.resumed_step, cb.initial_epoch, cb.initial_batch = step, epoch, batch
    if cb.verbose:
        print(f"AsyncCheckpoint: resumed from step {step} in {cb.manager.store.url}: epoch {epoch + 1}"
              + (f", after batch {batch}" if batch else ""), flush=True)
