"""Retention: small policy objects that say which committed steps to keep.

Example::

    import ckpt_callbacks as cc
    policy = [cc.KeepLast(2), cc.KeepBest("val_loss", mode="min", n=1)]   # kept if ANY keeps
    cc.retention_from_config({"keep_last": 2, "keep_best": {"metric": "val_loss", "mode": "min"}})

Who calls what: after each durable commit, `CheckpointManager` (process 0 only) builds a
`StepInfo` per committed step from the manifests and calls `decide(policies, infos)`; the steps
not kept are deleted in the background. `decide` always keeps the newest committed step. Policies
are pure: the same infos in any order give the same answer.

Semantics: `KeepBest` ranks only steps that reported the metric; NaN ranks worst; ties go to the
newer step. A step without the metric is kept only if another policy keeps it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Iterable, Mapping, Sequence

from .errors import ConfigError

__all__ = ["StepInfo", "Policy", "KeepLast", "KeepEvery", "KeepBest", "KeepSteps", "KeepEveryNSeconds",
           "decide", "retention_from_config", "as_policies", "best_policy"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int
    time: float = 0.0
    metrics: Mapping = dataclasses.field(default_factory=dict)

    @classmethod
    def of_manifest(cls, step: int, manifest: Mapping) -> "StepInfo":
        """What retention ranks `step` by, from its manifest: the save time the manager recorded
        (``extra.time``; the manifest's own ``time`` where there is none) and the metrics."""
        when = (manifest.get("extra") or {}).get("time", manifest.get("time", 0.0))
        return cls(step, float(when), manifest.get("metrics") or {})


class Policy:
    """A retention policy: `keep(infos)` returns the set of steps it keeps."""

    def keep(self, infos: Sequence[StepInfo]) -> set[int]:
        raise NotImplementedError


def as_int(v) -> int | None:
    """`v` as an int where it is an integer: a Python or numpy int, a 0-d integer array (a jax
    step counter); None otherwise (a bool, a float, a str)."""
    if isinstance(v, (bool, float, str, bytes)) or getattr(v, "dtype", None) == bool:
        return None
    try:
        return int(operator.index(v))
    except TypeError:
        return None


def _positive(name, n):
    i = as_int(n)
    if i is None or i < 1:
        raise ConfigError(f"{name} must be a positive int, got {n!r}")
    return i


@dataclasses.dataclass(frozen=True)
class KeepLast(Policy):
    """Keep the `n` newest steps.

    Example::

        import ckpt_callbacks as cc
        cc.KeepLast(2).keep([cc.StepInfo(10), cc.StepInfo(20), cc.StepInfo(30)])   # {20, 30}
    """
    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", _positive("keep_last", self.n))

    def keep(self, infos):
        return set(sorted(i.step for i in infos)[-self.n:])


@dataclasses.dataclass(frozen=True)
class KeepEvery(Policy):
    """Keep steps that are multiples of `n` (e.g. every 1000th step as a permanent record).

    Example::

        import ckpt_callbacks as cc
        cc.KeepEvery(1000).keep([cc.StepInfo(s) for s in (500, 1000, 1500, 2000)])   # {1000, 2000}
    """
    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", _positive("keep_every", self.n))

    def keep(self, infos):
        return {i.step for i in infos if i.step % self.n == 0}


@dataclasses.dataclass(frozen=True)
class KeepSteps(Policy):
    """Keep exactly these steps when they exist.

    Example::

        import ckpt_callbacks as cc
        cc.KeepSteps([5000]).keep([cc.StepInfo(s) for s in (4000, 5000, 6000)])   # {5000}
    """
    steps: frozenset

    def __init__(self, steps: Iterable[int]):
        try:
            items = None if isinstance(steps, (str, bytes, dict)) else list(steps)   # (a dict's keys: by accident)
        except TypeError:   # not a collection: an int, None
            items = None
        ints = None if items is None else [as_int(s) for s in items]
        if ints is None or not all(i is not None and i >= 0 for i in ints):
            raise ConfigError(f"keep_steps must be a list of non-negative ints, got {steps if items is None else items!r}")
        object.__setattr__(self, "steps", frozenset(ints))

    def keep(self, infos):
        return {i.step for i in infos if i.step in self.steps}


@dataclasses.dataclass(frozen=True)
class KeepBest(Policy):
    """Keep the `n` best steps by `metric` (`mode` "min" or "max"); steps without it never rank.

    Example::

        import ckpt_callbacks as cc
        infos = [cc.StepInfo(1, metrics={"val_loss": 0.5}), cc.StepInfo(2, metrics={"val_loss": 0.3}),
                 cc.StepInfo(3)]                        # step 3 reported no val_loss: never ranks
        cc.KeepBest("val_loss", mode="min", n=1).keep(infos)   # {2}
    """
    metric: str
    mode: str = "min"
    n: int = 1

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"keep_best.metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"keep_best.mode must be 'min' or 'max', got {self.mode!r}")
        object.__setattr__(self, "n", _positive("keep_best.n", self.n))

    def rank(self, infos: Sequence[StepInfo]) -> list[int]:
        """Steps that reported the metric, best first (ints compared exactly, never via float)."""
        def key(i):
            v = i.metrics[self.metric]
            if isinstance(v, float) and math.isnan(v):
                return (1, 0.0, -i.step)
            return (0, v if self.mode == "min" else -v, -i.step)
        cands = [i for i in infos if has_number(i.metrics, self.metric)]
        return [i.step for i in sorted(cands, key=key)]

    def keep(self, infos):
        return set(self.rank(infos)[:self.n])


class KeepBestBeyond(KeepBest):
    """KeepBest whose candidates must also beat `threshold` (the Keras callback's
    ``initial_value_threshold``; `ckpt-callbacks ls` ranks by it too, from the manifest's
    ``extra.keep_best.threshold``)."""

    def __init__(self, metric, mode, n, threshold):
        super().__init__(metric, mode, n)
        object.__setattr__(self, "threshold", float(threshold))

    def rank(self, infos):
        ok = (lambda v: v < self.threshold) if self.mode == "min" else (lambda v: v > self.threshold)
        by_step = {i.step: i for i in infos}
        return [s for s in super().rank(infos) if ok(by_step[s].metrics[self.metric])]


def has_number(metrics, name) -> bool:
    v = (metrics or {}).get(name)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class KeepEveryNSeconds(Policy):
    """Keep the first step saved in each window of `seconds` (by the save time in the manifest).

    Example::

        import ckpt_callbacks as cc
        infos = [cc.StepInfo(1, time=0.0), cc.StepInfo(2, time=1800.0), cc.StepInfo(3, time=3700.0)]
        cc.KeepEveryNSeconds(3600).keep(infos)   # {1, 3}
    """
    seconds: float

    def __post_init__(self):
        if (not isinstance(self.seconds, (int, float)) or isinstance(self.seconds, bool)
                or not math.isfinite(self.seconds) or self.seconds <= 0):
            raise ConfigError(f"keep_every_n_seconds must be a positive, finite number, got {self.seconds!r}")

    def keep(self, infos):
        first: dict = {}
        for i in sorted(infos, key=lambda i: (i.time, i.step)):
            first.setdefault(math.floor(i.time / self.seconds), i.step)
        return set(first.values())


def as_policies(retention) -> list[Policy] | None:
    """Normalize `retention` (None, a Policy, a list of them, or a config dict) to a list or None.

    No policy at all -- an empty list, or a config dict without a key set (``{}``, every value
    None, as a YAML file with the keys left blank gives) -- is None, which keeps every step: under
    "kept if any policy keeps it" an empty list would keep nothing but the newest."""
    if retention is None:
        return None
    if isinstance(retention, Mapping):
        return retention_from_config(retention) or None
    if isinstance(retention, Policy):
        return [retention]
    if isinstance(retention, (list, tuple)) and all(isinstance(p, Policy) for p in retention):
        return list(retention) or None
    raise ConfigError(f"retention must be None, a policy, a list of policies or a config dict; got {retention!r}")


def best_policy(policies) -> KeepBest | None:
    return next((p for p in policies or [] if isinstance(p, KeepBest)), None)


def decide(policies: Sequence[Policy] | None, infos: Sequence[StepInfo]) -> set[int]:
    """Steps to keep: any policy keeps it, or it is the newest. None (or no policy) keeps everything."""
    steps = {i.step for i in infos}
    if not policies or not steps:
        return steps
    keep = {max(steps)}
    for p in policies:
        keep |= p.keep(infos)
    return keep & steps


_KEYS = ("keep_last", "keep_every", "keep_steps", "keep_best", "keep_every_n_seconds")


def retention_from_config(config: Mapping, where: str = "retention") -> list[Policy]:
    """Build policies from a dict such as ``{"keep_last": 3, "keep_best": {"metric": "val_loss"}}``.

    Example::

        import ckpt_callbacks as cc
        cc.retention_from_config({"keep_last": 3, "keep_every": 1000,
                                  "keep_best": {"metric": "val_acc", "mode": "max", "n": 2}})
        # [KeepLast(n=3), KeepEvery(n=1000), KeepBest(metric='val_acc', mode='max', n=2)]

    Unknown keys and bad values raise ConfigError naming the key. A key set to None counts as
    absent, and so does an empty ``keep_steps`` (a YAML ``keep_steps: []`` means "no milestones",
    not "keep nothing": alone, as a policy keeping no step, it would delete all but the newest);
    with no key set the list is empty, and an empty list keeps every step.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(config).__name__}")
    policies: list[Policy] = []
    for key, value in config.items():
        if key not in _KEYS:
            raise ConfigError(f"{where}.{key}: unknown retention key; expected one of {list(_KEYS)}")
        if value is None or (key == "keep_steps" and isinstance(value, (list, tuple)) and not value):
            continue
        try:
            if key == "keep_last":
                policies.append(KeepLast(value))
            elif key == "keep_every":
                policies.append(KeepEvery(value))
            elif key == "keep_steps":
                if not isinstance(value, (list, tuple)):
                    raise ConfigError(f"must be a list of steps, got {value!r}")
                policies.append(KeepSteps(value))
            elif key == "keep_every_n_seconds":
                policies.append(KeepEveryNSeconds(value))
            else:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"must be a mapping with metric, mode, n; got {value!r}")
                extra = set(value) - {"metric", "mode", "n"}
                if extra:
                    raise ConfigError(f"unknown key(s) {sorted(extra)}; expected metric, mode, n")
                if "metric" not in value:
                    raise ConfigError("missing 'metric'")
                policies.append(KeepBest(value["metric"], value.get("mode", "min"), value.get("n", 1)))
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(f"{where}.") else f"{where}.{key}: {msg}") from None
    return policies
