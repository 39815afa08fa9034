"""Run configs: a YAML file (or dict) that says where checkpoints go, how often, what is kept, and
what a restart resumes from. The recipes in recipes/ read these.

Example::

    from ckpt_callbacks.config import load_config
    cfg = load_config({"checkpoint": {"directory": "/tmp/run", "save_interval_steps": 10,
                                      "retention": {"keep_last": 2,
                                                    "keep_best": {"metric": "val_loss", "mode": "min"}},
                                      "resume": "latest"},
                       "train": {"steps": 50}},
                      train_defaults={"steps": 100, "lr": 1e-3})
    cfg.train["lr"]                        # 0.001 (a default)
    with cfg.checkpoint.manager() as mngr:     # a CheckpointManager built from the config
        step = cfg.checkpoint.resume_step(mngr)   # latest committed step, or None to start fresh

Who calls what: a training script (every process, identically) calls `load_config` once at start,
then `CheckpointConfig.manager()` and `resume_step()`. Nothing here touches devices.

The ``checkpoint`` section (every key optional except ``directory``)::

    directory: /path | file:///path | s3://bucket/prefix | gs://bucket/prefix   (~ and $VARS expand)
    save_interval_steps: 10          # positive int
    async_save: true                 # false: save() returns after the commit
    max_staging_bytes: null          # cap on host staging memory (bytes; a larger shard alone), null = no cap
    timeout_s: 600                   # cross-process waits of a save
    retention:                       # see ckpt_callbacks.retention_from_config; omit to keep all
      keep_last: 3
      keep_every: 1000
      keep_steps: [5000]
      keep_every_n_seconds: 3600
      keep_best: {metric: val_loss, mode: min, n: 2}
    resume: latest                   # latest | best | <step> | off

Unknown keys and bad values raise `ConfigError` naming the key (``checkpoint.retention.keep_last``).
The ``train`` section holds the script's own knobs: every key must appear in the script's
``train_defaults`` and have the same type (an int is accepted for a float). Overrides such as
``["train.steps=20", "checkpoint.async_save=false"]`` (values parsed as YAML) are applied before
validation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import yaml

from .errors import ConfigError
from .retention import Policy, best_policy, retention_from_config

__all__ = ["CheckpointConfig", "RunConfig", "load_config", "parse_checkpoint", "apply_overrides",
           "RESUME_MODES"]

RESUME_MODES = ("latest", "best", "step", "off")
_CKPT_KEYS = ("directory", "save_interval_steps", "async_save", "max_staging_bytes", "timeout_s",
              "retention", "resume")
_TOP_KEYS = ("checkpoint", "train")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The validated ``checkpoint`` section. `resume` is "latest", "best", an int step, or None (off)."""

    directory: str
    save_interval_steps: int = 1
    async_save: bool = True
    max_staging_bytes: int | None = None
    timeout_s: float = 600.0
    retention: Mapping | None = None
    resume: str | int | None = "latest"

    @property
    def policies(self) -> list[Policy] | None:
        return None if self.retention is None else retention_from_config(self.retention, "checkpoint.retention")

    def manager(self, **overrides):
        """A `CheckpointManager` for this config (keyword `overrides` win, e.g. ``coordinator=``)."""
        from .manager import CheckpointManager
        kw = dict(save_interval_steps=self.save_interval_steps, retention=self.policies,
                  async_save=self.async_save, max_staging_bytes=self.max_staging_bytes, timeout_s=self.timeout_s)
        kw.update(overrides)
        return CheckpointManager(self.directory, **kw)

    def resume_step(self, mngr) -> int | None:
        """The committed step to restore from, or None to start fresh.

        ``latest``: the newest committed step (None when there is none). ``best``: the manager's
        `best_step()` (falls back to the latest when no step reported the metric yet). An int: that
        step, `CheckpointNotFoundError` if it is not committed. ``off``: None.
        """
        if self.resume is None:
            return None
        if self.resume == "latest":
            return mngr.latest_step()
        if self.resume == "best":
            best = mngr.best_step()
            return best if best is not None else mngr.latest_step()
        mngr._resolve(self.resume)  # raises CheckpointNotFoundError naming the committed steps
        return self.resume


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run config: the ``checkpoint`` section and the script's ``train`` knobs."""

    checkpoint: CheckpointConfig
    train: dict
    raw: dict


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_checkpoint(section: Mapping, where: str = "checkpoint",
                     resume_modes: Sequence[str] = RESUME_MODES) -> CheckpointConfig:
    """Validate a ``checkpoint`` mapping; ConfigError naming the key on any problem."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(section).__name__}: {section!r}")
    for key in section:
        if key not in _CKPT_KEYS:
            raise ConfigError(f"{where}.{key}: unknown key; expected one of {list(_CKPT_KEYS)}")
    if "directory" not in section:
        raise ConfigError(f"{where}.directory: missing; give a local path, s3://bucket/prefix or gs://bucket/prefix")
    directory = section["directory"]
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ConfigError(f"{where}.directory: expected a non-empty path or URL, got {directory!r}")
    directory = str(directory)
    if "://" not in directory:
        directory = os.path.expanduser(os.path.expandvars(directory))
    else:
        scheme = directory.split("://", 1)[0]
        if scheme not in ("s3", "gs", "file"):
            raise ConfigError(f"{where}.directory: unsupported URL scheme {scheme!r} in {directory!r}; "
                              f"use a path, file://, s3:// or gs://")
    kw: dict[str, Any] = {"directory": directory}
    if "save_interval_steps" in section:
        v = section["save_interval_steps"]
        if not _is_int(v) or v < 1:
            raise ConfigError(f"{where}.save_interval_steps: expected a positive int, got {v!r}")
        kw["save_interval_steps"] = v
    if "async_save" in section:
        v = section["async_save"]
        if not isinstance(v, bool):
            raise ConfigError(f"{where}.async_save: expected true or false, got {v!r}")
        kw["async_save"] = v
    if section.get("max_staging_bytes") is not None:
        v = section["max_staging_bytes"]
        if not _is_int(v) or v < 1:
            raise ConfigError(f"{where}.max_staging_bytes: expected a positive int (bytes) or null, got {v!r}")
        kw["max_staging_bytes"] = v
    if "timeout_s" in section:
        v = section["timeout_s"]
        if not _is_number(v) or not 0 < v < math.inf:   # (.nan and .inf too: the manager refuses them)
            raise ConfigError(f"{where}.timeout_s: expected a positive, finite number of seconds, got {v!r}")
        kw["timeout_s"] = float(v)
    retention = section.get("retention")
    if retention is not None:
        if not isinstance(retention, Mapping):
            raise ConfigError(f"{where}.retention: expected a mapping such as {{keep_last: 3}}, got {retention!r}")
        retention_from_config(retention, f"{where}.retention")  # raises naming the key
        kw["retention"] = dict(retention)
    kw["resume"] = _parse_resume(section.get("resume", "latest"), where, resume_modes, retention)
    return CheckpointConfig(**kw)


def _parse_resume(v, where, modes, retention):
    allowed = " | ".join("<step>" if m == "step" else m for m in modes)
    if v is False or v is None:   # YAML `off` / `no` parse as False
        v = "off"
    if _is_int(v):
        if "step" not in modes:
            raise ConfigError(f"{where}.resume: this script resumes only from {allowed}, got step {v}")
        if v < 0:
            raise ConfigError(f"{where}.resume: a step must be >= 0, got {v}")
        return v
    if not isinstance(v, str) or v == "step" or v not in modes:
        raise ConfigError(f"{where}.resume: expected {allowed}, got {v!r}")
    if v == "best" and best_policy(retention_from_config(retention or {}, f"{where}.retention")) is None:
        raise ConfigError(f"{where}.resume: 'best' needs {where}.retention.keep_best "
                          f"(which metric ranks the steps); add it or use resume: latest")
    return None if v == "off" else v


def apply_overrides(data: Mapping, overrides: Sequence[str]) -> dict:
    """Apply ``"a.b=value"`` overrides (value parsed as YAML) to a copy of `data`."""
    out = copy.deepcopy(dict(data))
    for item in overrides or ():
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value, e.g. train.steps=20")
        path, _, text = item.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise ConfigError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {path}: value {text!r} is not valid YAML ({e})") from None
        node = out
        for i, k in enumerate(keys[:-1]):
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {path}: {'.'.join(keys[:i + 1])} is not a mapping")
            node = child
        node[keys[-1]] = value
    return out


def _check_train(train: Mapping, defaults: Mapping, where="train") -> dict:
    if not isinstance(train, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(train).__name__}")
    out = dict(defaults)
    for key, value in train.items():
        if key not in defaults:
            raise ConfigError(f"{where}.{key}: unknown key; this script knows {sorted(defaults)}")
        d = defaults[key]
        ok = (d is None
              or (isinstance(d, bool) and isinstance(value, bool))
              or (_is_int(d) and _is_int(value))
              or (isinstance(d, float) and _is_number(value))
              or (isinstance(d, str) and isinstance(value, str))
              or (isinstance(d, (list, tuple)) and isinstance(value, (list, tuple))))
        if not ok:
            raise ConfigError(f"{where}.{key}: expected {type(d).__name__} like the default {d!r}, got {value!r}")
        out[key] = float(value) if isinstance(d, float) else value
    return out


def load_config(source, *, train_defaults: Mapping | None = None, overrides: Sequence[str] = (),
                resume_modes: Sequence[str] = RESUME_MODES) -> RunConfig:
    """Load a run config from a YAML file path or a dict; ConfigError naming the key on any problem.

    `train_defaults` lists the ``train`` keys the script accepts (with their defaults and types);
    `resume_modes` narrows ``resume`` for scripts that cannot restore arbitrary steps.
    """
    if isinstance(source, Mapping):
        data, where = dict(source), "config"
    else:
        path = os.fspath(source)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        where = path
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping with 'checkpoint' and 'train', got {type(data).__name__}")
    data = apply_overrides(data, overrides)
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: unknown top-level key in {where}; expected {list(_TOP_KEYS)}")
    if "checkpoint" not in data:
        raise ConfigError(f"checkpoint: missing section in {where}; it needs at least checkpoint.directory")
    ckpt = parse_checkpoint(data["checkpoint"], resume_modes=resume_modes)
    train = _check_train(data.get("train") or {}, train_defaults or {})
    return RunConfig(ckpt, train, data)
