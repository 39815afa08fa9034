"""Load the weights of an `AsyncCheckpoint` checkpoint into a Keras model: for evaluation,
inference or export, without `fit`.

Example::

    import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras, numpy as np
    import ckpt_callbacks as cc
    from ckpt_callbacks.keras import AsyncCheckpoint, load_weights

    def make():   # the same layers (names, shapes) as the run that saved
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")], name="net")
    model = make(); model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((32, 4)), np.ones((32, 1)), validation_split=0.25, epochs=3, verbose=0,
              callbacks=[AsyncCheckpoint("/tmp/run", keep_best=1)])

    served = make()                              # built, not compiled: no optimizer needed
    step = load_weights(served, "/tmp/run")      # the latest committed step (returned)
    best = cc.CheckpointManager("/tmp/run", read_only=True, retention=cc.KeepBest("val_loss")).best_step()
    load_weights(served, "/tmp/run", best)       # or a step by number

Who calls what: the user, on the main thread, on every process of a multi-process run (the
model's variables may span processes; a read-only `CheckpointManager` reads the step, and every
process restores the same one). Only the model's trainable and non-trainable variables are
read (and, with ``optimizer=True``, the optimizer's); nothing is written, and a training run
may go on saving into the directory meanwhile.
"""

from __future__ import annotations

import keras

from .errors import CheckpointError, ConfigError, IncompatibleCheckpointError
from .checks import check_flag
from .keras_state import OPTIMIZER, flatten, mismatch
from .manager import CheckpointManager
from .restore import read_manifest
from . import treepath

__all__ = ["load_weights"]


_WEIGHTS = ("trainable_variables", "non_trainable_variables")


def _nested(items) -> dict:
    """(path, variable) pairs as the nested dict of their paths (as `model.get_state_tree()` nests them)."""
    out: dict = {}
    for path, v in items:
        *parents, name = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if name in node:
            raise ConfigError(f"load_weights: the model has two variables at {path!r}. Fix: give each layer "
                              f"and variable its own name, as in the run that saved")
        node[name] = v.value
    return out


def _saved_leaves(mngr, at) -> list | None:
    """The manifest's leaf records of step `at`; None where there is no such step or it cannot be
    read (the restore then raises what is wrong: no such step, a bad step, damage)."""
    try:
        return read_manifest(mngr.store, at)["leaves"] if at is not None else None
    except (CheckpointError, ValueError, TypeError):
        return None


def _as_saved(leaves: list, plan: list) -> list:
    """`plan` with each weight read from the group it was saved in (`leaves`: the step's manifest
    records): a variable whose trainable flag changed since (``model.trainable = False`` for
    inference or feature extraction, a frozen base for fine-tuning) is the same variable; only
    the optimizer cares which ones train."""
    saved: dict = {}
    for r in leaves:
        keys = [k for _, k in r["p"]]
        if len(keys) > 2 and keys[0] == "model" and keys[1] in _WEIGHTS:
            saved.setdefault("/".join(map(str, keys[2:])), set()).add(keys[1])
    return [(v, g, p) if g not in _WEIGHTS or g in saved.get(p, {g}) else (v, min(saved[p]), p)
            for v, g, p in plan]


def _check_no_variable_left_out(mngr, step: int, leaves: list, target: dict, name: str, groups: dict) -> None:
    """The restore left out the saved leaves (`leaves`: step `step`'s manifest records) the target
    lacks (the optimizer's, the metrics', the run's progress); a saved variable of a loaded group
    that the model lacks means another model."""
    have = {tuple(map(tuple, p)) for p in treepath.flatten(target).paths}
    heads = [(("d", "model"), ("d", g)) for g in groups]
    extra = [tuple(map(tuple, r["p"])) for r in leaves]
    extra = [p for p in extra if p[:2] in heads and p not in have]
    if extra:
        lines = "\n".join(f"  {treepath.keystr(p)}" for p in extra[:50])
        raise IncompatibleCheckpointError(
            f"load_weights: step {step} in {mngr.store.url} holds {len(extra)} variable(s) that {name!r} lacks; "
            f"nothing was loaded:\n{lines}\nFix: build the model of the run that saved (the same layers and "
            f"names)", [(treepath.keystr(p), "present", "absent") for p in extra])


def load_weights(model, directory, step: int | None = None, *, optimizer: bool = False) -> int:
    """Assign `model`'s variables from step `step` (the latest committed when None) of an
    `AsyncCheckpoint` directory, and return the step read.

    Example::

        import keras, numpy as np
        from ckpt_callbacks.keras import AsyncCheckpoint, load_weights
        make = lambda: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="out")], name="net")
        model = make(); model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=2, verbose=0, callbacks=[AsyncCheckpoint("/tmp/run")])
        load_weights(make(), "/tmp/run")   # 2: the latest step, into a model that was never compiled

    Args:
      model: a built Keras model with the layers of the run that saved (the same layer names
        and shapes; Keras numbers unnamed layers per process, so name them, or build the model
        in a fresh process as training did). It need not be compiled, and which of its layers
        train may differ from that run (``model.trainable = False``, a frozen base).
      directory: the callback's directory (a path, ``s3://`` or ``gs://`` URL).
      step: a committed step; None for the latest. The best by a metric:
        ``cc.CheckpointManager(directory, read_only=True, retention=cc.KeepBest("val_loss")).best_step()``.
      optimizer: also load the optimizer's variables (its slots and iteration count); the model
        must then be compiled with the optimizer of the run that saved. A run with
        ``use_ema=True`` saved the raw weights; for the EMA ones (what `fit` returned), load with
        ``optimizer=True``, then ``model.optimizer.finalize_variable_values(model.trainable_variables)``.

    Each variable is restored onto its own sharding. The saved tree must hold every variable
    of the model: a missing or differently shaped one raises `IncompatibleCheckpointError`
    naming its key path, before any is assigned (the model is never left half loaded). Metrics
    and the run's progress (epoch, RNGs, data position) are not loaded: to train on, use
    `AsyncCheckpoint`, which resumes all of it.
    """
    check_flag("optimizer", optimizer)
    if not isinstance(model, keras.Model):
        raise ConfigError(f"load_weights: model must be a keras.Model (built with the layers of the run that "
                          f"saved), got {type(model).__name__}. Fix: load_weights(model, directory, step)")
    if not getattr(model, "built", False) or not model.variables:
        raise ConfigError(f"load_weights: {model.name!r} has no variables yet. Fix: build it first (a "
                          f"keras.Input as its first layer, model.build(shape), or call it on a batch)")
    plan = [(v, g, v.path) for g in _WEIGHTS for v in getattr(model, g)]   # (variable, group, saved path)
    if optimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise ConfigError(f"load_weights(optimizer=True): {model.name!r} is not compiled. Fix: compile it "
                              f"with the optimizer of the run that saved, or leave optimizer=False")
        if not opt.built:
            opt.build(model.trainable_variables)
        prefix = opt.name + "/"
        plan += [(v, "optimizer_variables", OPTIMIZER + v.path[len(opt.name):] if v.path.startswith(prefix)
                  else v.path) for v in opt.variables]
    with CheckpointManager(directory, read_only=True) as mngr:
        at = mngr.latest_step() if step is None else step
        leaves = _saved_leaves(mngr, at)   # read once: for the plan, and for the check after the restore
        plan = _as_saved(leaves or [], plan)
        groups = dict.fromkeys(_WEIGHTS + (("optimizer_variables",) if optimizer else ()))
        target = {"model": {g: _nested([(p, v) for v, vg, p in plan if vg == g]) for g in groups}}
        try:
            tree = mngr.restore(step, target, partial=True)
        except IncompatibleCheckpointError as e:
            raise mismatch(e, f"load_weights: {model.name!r}", mngr.store.url, step,
                           "build the model of the run that saved (the same layer names and shapes), or restore "
                           "with cc.CheckpointManager(...).restore(target=None) and pick what you need.") from None
        step = mngr.restored_step
        if leaves is None or step != at:   # (another step than the one listed: a writer's retention meanwhile)
            leaves = read_manifest(mngr.store, step)["leaves"]
        _check_no_variable_left_out(mngr, step, leaves, target, model.name, groups)
    flat = {g: flatten(tree["model"][g]) for g in groups}
    values = [(v, flat[g][p]) for v, g, p in plan]   # (every one: the restore was strict about the target)
    for v, value in values:
        v.assign(value)
    return step
