"""A Keras model's full state as one tree, and back; the host RNGs Keras' input pipelines draw from.

Example::

    import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras, numpy as np
    from ckpt_callbacks import keras_state

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
    tree = keras_state.state_tree(model)   # trainable, non-trainable, optimizer (as "optimizer"), metrics
    keras_state.assign(model, tree)        # every variable from `tree`, or IncompatibleCheckpointError
    keras_state.set_rng_state(keras_state.rng_state())

Who calls what: `AsyncCheckpoint` (main thread): `state_tree` when it saves and as the restore
target, `assign` and `set_rng_state` in `on_train_begin` after the manager's strict restore,
`rng_state` with each save (per process, as host state).
"""

from __future__ import annotations

import random
import re

import numpy as np

from .errors import ConfigError, IncompatibleCheckpointError

__all__ = ["PROGRESS", "OPTIMIZER", "state_tree", "assign", "flatten", "dtype_policies", "rng_state",
           "set_rng_state", "numeric_logs", "unrankable", "mismatch"]

PROGRESS = ("epoch", "batch", "global_step", "best", "version")   # the run's position, saved beside the model
OPTIMIZER = "optimizer"


def flatten(nested: dict, prefix: str = "") -> dict:
    """A nested dict of variables as {"layer/.../name": value} (Keras' variable paths)."""
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def state_tree(model) -> dict:
    """`model.get_state_tree()`, with the optimizer's own (auto-numbered: "adam", "adam_1", ...) name
    replaced by "optimizer", so a model rebuilt in the same process still matches its checkpoint."""
    try:
        tree = model.get_state_tree()
    except ValueError as e:   # e.g. two variables of a layer with one name: one path
        raise ConfigError(f"AsyncCheckpoint: Keras cannot collect the model's state (model.get_state_tree()): "
                          f"{e}\nFix: give each variable of a layer its own name (add_weight(name=...))") from e
    opt = tree["optimizer_variables"]
    name = model.optimizer.name
    if name in opt and OPTIMIZER not in opt:
        opt[OPTIMIZER] = opt.pop(name)
    return tree


GROUPS = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")


def _variables(model, group: str) -> list:
    if group == "optimizer_variables":
        return model.optimizer.variables
    return getattr(model, group)


def _saved_path(model, group: str, path: str) -> str:
    if group != "optimizer_variables":
        return path
    name = model.optimizer.name
    return OPTIMIZER + path[len(name):] if path.startswith(name + "/") else path


def assign(model, values: dict, groups: tuple = GROUPS) -> None:
    """Assign every variable of `model` in `groups` from `values` (a `state_tree` as restored).
    All paths are checked before any is assigned: a model is never left half loaded."""
    plan = []
    for group in groups:
        variables = _variables(model, group)
        flat = flatten(values[group])
        paths = [_saved_path(model, group, v.path) for v in variables]
        missing = [p for p in paths if p not in flat]
        if missing:  # cannot happen after the manager's structural check
            raise IncompatibleCheckpointError(f"{group}: no saved value for {missing}",
                                              [(f"{group}/{p}", "absent", "present") for p in missing])
        plan += [(v, flat[p]) for v, p in zip(variables, paths)]
    for v, value in plan:
        v.assign(value)


def dtype_policies(model) -> list[str]:
    """The names of the dtype policies of `model` and its layers, sorted (e.g. ["float32",
    "mixed_bfloat16"]): saved with each step, so that a resume under another policy is told.
    Variables keep their dtype under a mixed policy, so the restore itself cannot see it."""
    layers = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else [model]
    return sorted({str(p.name) for layer in layers if (p := getattr(layer, "dtype_policy", None)) is not None})


def rng_state() -> dict:
    """Python's and NumPy's global RNG states (Keras shuffles arrays with NumPy's, PyDatasets with
    Python's), msgpack-able."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss],
            "numpy": [name, np.asarray(keys, "<u4").tobytes(), int(pos), int(has_gauss), float(cached)]}


def set_rng_state(s: dict) -> None:
    version, state, gauss = s["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((name, np.frombuffer(keys, "<u4").copy(), pos, has_gauss, cached))


def numeric_logs(logs) -> dict:
    """The entries of Keras' logs that are numbers, as floats (the metrics a step is saved with); an
    array of one value counts as that number (e.g. `F1Score` of one class logs shape (1,)). Arrays
    of several values (`F1Score(average=None)`: one per class) are left out: no step ranks by them."""
    out = {}
    for k, v in (logs or {}).items():
        if getattr(v, "shape", ()) != () and getattr(v, "size", None) == 1:
            v = np.asarray(v).reshape(())
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            pass
    return out


def unrankable(logs, metrics: dict, names) -> dict:
    """Of `names`, those that Keras' `logs` hold but `metrics` (`numeric_logs(logs)`) left out, as
    {name: what they are}, e.g. {"val_f1_score": "an array of shape (3,)"}."""
    out = {}
    for name in names:
        if name in (logs or {}) and name not in metrics:
            v = logs[name]
            shape = getattr(v, "shape", None)
            out[name] = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(v).__name__}"
    return out


def mismatch(e: IncompatibleCheckpointError, what: str, url: str, step, fix: str) -> IncompatibleCheckpointError:
    """A restore's `e` retold of a Keras model (`what`, e.g. "AsyncCheckpoint: the model"): the
    step, the directory, every mismatched key path, and `fix` instead of the restore's own."""
    detail = "\n".join(line for line in str(e).splitlines() if not line.startswith("Fix:"))
    numbered = list(dict.fromkeys(   # of the paths the model has and the checkpoint lacks
        k for path, saved, *_ in e.mismatches or () if saved == "absent"
        for k in re.findall(r"\['([^']*)'\]", path)[2:] if _NUMBERED.fullmatch(k)))
    if numbered:   # the same model built twice in one process: Keras numbered its names on
        fix += (f" Names such as {', '.join(repr(k) for k in numbered[:3])} may be Keras' numbering of "
                f"unnamed layers, seed generators and optimizers, which goes on in a process that built "
                f"a model before: call keras.backend.clear_session() before building the model (then set "
                f"a mixed-precision policy again), or build it in a fresh process, as the run that saved did.")
    return IncompatibleCheckpointError(
        f"{what} does not match checkpoint step {getattr(e, 'step', step)} in {url}; nothing was loaded. "
        f"{detail}\nFix: {fix}", e.mismatches)


_NUMBERED = re.compile(r"[a-z][a-z0-9_]*_[0-9]+")   # dense_2, seed_generator_1, sequential_3
