"""Checks of the arguments users pass, shared by `CheckpointManager` and the integrations: each
raises `ConfigError` saying what was received and what is expected, before anything starts.

Example::

    import numpy as np
    import ckpt_callbacks as cc
    from ckpt_callbacks import checks
    assert checks.check_step(np.int64(100)) == 100
    assert checks.check_metrics({"val_loss": np.float32(0.25)}) == {"val_loss": 0.25}
    try:
        checks.check_flag("force", "yes")
    except cc.ConfigError as e:
        print(e)                                # force must be True or False, got 'yes'

Who calls what: `CheckpointManager` (construction, `save`, `metrics`, `restore`) and the Keras
callback's and Flax hook's constructors, on the caller's thread.
"""

from __future__ import annotations

import math
import numbers

from . import format as fmt
from .errors import ConfigError
from .retention import as_int
from .treepath import encodable

__all__ = ["check_flag", "check_save_options", "check_timeout", "check_step", "check_metrics"]


def check_flag(name: str, flag) -> None:
    """ConfigError unless `flag` is a bool (also for the Keras callback's flags)."""
    if not isinstance(flag, bool):   # "no" and 0.0 are truthy or falsy by accident, not by intent
        raise ConfigError(f"{name} must be True or False, got {flag!r}")


def check_save_options(async_save, max_staging_bytes) -> None:
    """ConfigError for a bad `async_save` or `max_staging_bytes` (also checked by the Keras
    callback when it is constructed, before its manager is)."""
    check_flag("async_save", async_save)
    if max_staging_bytes is not None and (isinstance(max_staging_bytes, bool)
                                          or not isinstance(max_staging_bytes, numbers.Integral)
                                          or max_staging_bytes < 1):
        raise ConfigError(f"max_staging_bytes must be a positive int (bytes) or None, got {max_staging_bytes!r}")


def check_timeout(timeout_s) -> None:
    """ConfigError unless `timeout_s` is a positive, finite number of seconds (also checked by the
    Keras callback when it is constructed, before its manager is)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def check_step(step) -> int:
    """`step` as an int (numpy integers and 0-d integer arrays too), or ConfigError: a step names a
    directory of 10 digits."""
    i = as_int(step)
    try:
        fmt.step_name(step if i is None else i)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return i


def check_metrics(metrics) -> dict:
    """`metrics` as stored in a manifest: str keys; bools as bools, ints exactly (64 bits), other
    numbers as floats, str as str; ConfigError naming the key otherwise."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise ConfigError(f"metrics must be a dict of str -> number, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not encodable(k):
            raise ConfigError(f"metrics key {k!r} must be a str (valid Unicode)")
        if isinstance(v, str) and not encodable(v):
            raise ConfigError(f"metrics[{k!r}] = {v!r} is not valid Unicode (a lone surrogate)")
        if isinstance(v, bool) or (getattr(v, "dtype", None) == bool and getattr(v, "shape", None) == ()):
            out[k] = bool(v)   # kept as a bool (never ranks), numpy's as Python's
            continue
        if (i := as_int(v)) is not None:   # numpy and 0-d jax ints exactly, as Python's
            if not -2**63 <= i < 2**64:
                raise ConfigError(f"metrics[{k!r}] = {v} does not fit in 64 bits; pass it as a float")
            out[k] = i
            continue
        try:
            if getattr(getattr(v, "dtype", None), "kind", None) == "c":   # float() dropped its imaginary part
                raise TypeError
            out[k] = v if isinstance(v, str) else float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"metrics[{k!r}] must be a number or str, got {type(v).__name__}") from None
    return out
