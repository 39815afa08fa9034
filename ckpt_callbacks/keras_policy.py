"""Which way the Keras callback's metrics rank, and the retention policies it builds from its arguments.

Example::

    import keras
    from ckpt_callbacks import keras_policy
    from ckpt_callbacks.keras import AsyncCheckpoint
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    cb = AsyncCheckpoint("/tmp/run", keep_best=2, keep_last=1)   # monitor="val_loss", mode="auto"
    cb.set_model(model)
    mode = keras_policy.resolved_mode(cb)   # "min": losses minimize
    keras_policy.policies(cb, mode)          # [KeepBest(metric='val_loss', mode='min', n=2), KeepLast(n=1)]

Who calls what: `AsyncCheckpoint.on_train_begin` (every process), once the model is known and
before it opens its manager: `resolved_mode` for its `monitor` ("min"/"max" under ``mode="auto"``:
losses minimize, compiled metrics go their own direction, "val_" and multi-output prefixes
stripped), then `policies`.
"""

from __future__ import annotations

from .errors import ConfigError
from .retention import KeepBest, KeepBestBeyond, KeepLast, as_policies

__all__ = ["resolved_mode", "compiled_metrics", "known_metrics", "policies"]


def resolved_mode(cb, monitor: str | None = None) -> str | None:
    """"min" or "max" for `monitor` (the callback's own by default) under this callback's mode;
    None where mode="auto" cannot tell."""
    if cb.mode != "auto" and monitor in (None, cb.monitor):
        return cb.mode
    name = (monitor or cb.monitor).removeprefix("val_")
    if name == "loss" or name.endswith("_loss"):
        return "min"
    # a model with several outputs logs "<output>_<metric>" ("a_accuracy")
    names = {name} | {name[len(o) + 1:] for o in getattr(cb.model, "output_names", None) or ()
                      if isinstance(o, str) and name.startswith(f"{o}_")}
    directions = {m._direction for m in compiled_metrics(cb.model)
                  if getattr(m, "name", None) in names and hasattr(m, "_direction")}
    if len(directions) == 1:
        return "max" if directions.pop() == "up" else "min"
    return None


def compiled_metrics(model) -> list:
    """The model's metric objects, those inside its compiled-metrics containers included."""
    return [m for container in getattr(model, "metrics", [])
            for m in getattr(container, "metrics", [container])]


def known_metrics(model) -> str:
    """What mode="auto" knows the direction of, for messages."""
    known = sorted({n for m in compiled_metrics(model) if isinstance(n := getattr(m, "name", None), str)})
    return (f"mode='auto' knows losses and the model's compiled metrics ({', '.join(known) or 'none yet'}; "
            f"'val_' + a name for validation)")


def policies(cb, mode: str | None):
    """The retention policies of the callback's manager: its `retention`, `keep_last` and `keep_best`
    (by `monitor` in direction `mode`), a config dict's mode-less keep_best given its direction."""
    policies = list(cb._base_policies or [])
    if cb._auto_best is not None:
        metric = cb._auto_best["keep_best"]["metric"]
        best_mode = resolved_mode(cb, metric)
        if best_mode is None:
            raise ConfigError(f"retention.keep_best: cannot tell whether {metric!r} should be minimized or "
                              f"maximized: {known_metrics(cb.model)}. Fix: check the name's spelling, or give "
                              f"it a mode ('min' or 'max').")
        config = {**cb._auto_best, "keep_best": {**cb._auto_best["keep_best"], "mode": best_mode}}
        policies = as_policies(config) or []
    if cb.keep_last is not None:
        policies.append(KeepLast(cb.keep_last))
    if cb.keep_best is not None:
        if mode is None:
            raise ConfigError(f"keep_best: cannot tell whether monitor={cb.monitor!r} should be minimized "
                              f"or maximized: {known_metrics(cb.model)}. Fix: check the name's spelling, or "
                              f"pass mode='min' or mode='max'.")
        if cb.initial_value_threshold is None:
            policies.insert(0, KeepBest(cb.monitor, mode, cb.keep_best))
        else:
            policies.insert(0, KeepBestBeyond(cb.monitor, mode, cb.keep_best, cb.initial_value_threshold))
    return policies if (policies or cb._base_policies is not None) else None
