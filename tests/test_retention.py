"""Retention policies: exact surviving steps, properties, and config parsing."""

import math

import pytest
from hypothesis import given, settings, strategies as st

import ckpt_callbacks as cc
from ckpt_callbacks.retention import StepInfo, as_policies, decide, retention_from_config

NAN = float("nan")


def infos(steps, metric=None, times=None):
    metric = metric or {}
    return [StepInfo(s, (times or {}).get(s, float(s)), {"loss": metric[s]} if s in metric else {}) for s in steps]


LOSS = {10: 0.5, 20: 0.2, 30: 0.9, 40: NAN, 50: 0.3, 60: 0.1}
STEPS = [10, 20, 30, 40, 50, 60, 70]   # 70 has no metric


@pytest.mark.parametrize("policies, expected", [
    (None, STEPS),
    ([cc.KeepLast(2)], [60, 70]),
    ([cc.KeepLast(1)], [70]),
    ([cc.KeepEvery(20)], [20, 40, 60, 70]),                      # newest always kept
    ([cc.KeepSteps([10, 30, 999])], [10, 30, 70]),
    ([cc.KeepBest("loss", "min", 2)], [20, 60, 70]),
    ([cc.KeepBest("loss", "max", 2)], [10, 30, 70]),             # NaN is worst in both modes
    ([cc.KeepBest("loss", "min", 6)], [10, 20, 30, 40, 50, 60, 70]),  # NaN ranks last but counts
    ([cc.KeepBest("acc", "max", 3)], [70]),                      # nobody reported it
    ([cc.KeepLast(2), cc.KeepBest("loss", "min", 1)], [60, 70]),
    ([cc.KeepLast(1), cc.KeepBest("loss", "min", 2), cc.KeepEvery(30)], [20, 30, 60, 70]),
    ([cc.KeepEveryNSeconds(25)], [10, 30, 50, 70]),              # first of each 25 s window
])
def test_surviving_steps_table(policies, expected):
    assert sorted(decide(policies, infos(STEPS, LOSS))) == expected


def test_best_ties_go_to_newer_step():
    p = cc.KeepBest("loss", "min", 1)
    assert p.rank(infos([1, 2, 3], {1: 0.5, 2: 0.5, 3: 0.7})) == [2, 1, 3]


def test_best_ranks_int_metrics_exactly_not_through_float():
    # ints are stored exactly (64 bits); 2**53 + 1 and 2**53 are one float, which made a tie that
    # the newer, worse step won
    big = [StepInfo(1, metrics={"tokens": 2**53 + 1}), StepInfo(2, metrics={"tokens": 2**53}),
           StepInfo(3, metrics={"tokens": 2**63 - 1}), StepInfo(4, metrics={"tokens": 2**63 - 2})]
    assert cc.KeepBest("tokens", "max", 1).rank(big[:2]) == [1, 2]
    assert cc.KeepBest("tokens", "min", 1).rank(big[:2]) == [2, 1]
    assert cc.KeepBest("tokens", "min", 4).rank(big) == [2, 1, 4, 3]
    assert sorted(decide([cc.KeepBest("tokens", "max", 1)], big[:2] + [StepInfo(5)])) == [1, 5]


step_sets = st.lists(st.integers(0, 10_000), min_size=1, max_size=40, unique=True)
metric_values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))
policy_st = st.lists(st.one_of(
    st.builds(cc.KeepLast, st.integers(1, 5)),
    st.builds(cc.KeepEvery, st.integers(1, 50)),
    st.builds(cc.KeepBest, st.just("loss"), st.sampled_from(["min", "max"]), st.integers(1, 4)),
    st.builds(cc.KeepSteps, st.lists(st.integers(0, 10_000), max_size=5)),
    st.builds(cc.KeepEveryNSeconds, st.floats(1, 5000))), min_size=0, max_size=4)


@settings(max_examples=200, deadline=None)
@given(steps=step_sets, data=st.data(), policies=policy_st)
def test_properties(steps, data, policies):
    vals = {s: data.draw(metric_values) for s in steps}
    metric = {s: v for s, v in vals.items() if v is not None}
    inf = infos(steps, metric)
    keep = decide(policies, inf)
    assert max(steps) in keep                                             # newest always survives
    assert keep <= set(steps)
    shuffled = data.draw(st.permutations(inf))
    assert decide(policies, shuffled) == keep                             # order-independent
    for p in policies:
        if isinstance(p, cc.KeepBest):
            chosen = p.keep(inf)
            assert chosen <= set(metric)                                  # no metric: never best
            def score(s):
                v = metric[s]
                return math.inf if math.isnan(v) else (v if p.mode == "min" else -v)
            ranked = sorted(metric, key=score)
            assert len(chosen) == min(p.n, len(metric))
            if chosen and len(chosen) < len(metric):                     # the true best n
                worst_kept = max(score(s) for s in chosen)
                assert all(score(s) >= worst_kept for s in set(metric) - chosen)
            assert chosen <= set(metric) and (not ranked or score(ranked[0]) == min(score(s) for s in chosen) or not chosen)


def test_config_builds_policies():
    ps = cc.retention_from_config({"keep_last": 3, "keep_every": 1000, "keep_steps": [5000],
                                   "keep_best": {"metric": "val_loss", "mode": "min", "n": 2},
                                   "keep_every_n_seconds": 3600})
    assert ps == [cc.KeepLast(3), cc.KeepEvery(1000), cc.KeepSteps([5000]), cc.KeepBest("val_loss", "min", 2),
                  cc.KeepEveryNSeconds(3600)]
    # as docs/concepts.md says: a keep_best without a mode minimizes, whatever the metric's name
    assert cc.retention_from_config({"keep_best": {"metric": "val_accuracy"}}) == [cc.KeepBest("val_accuracy", "min", 1)]


@pytest.mark.parametrize("config, key", [
    ({"keep_lats": 3}, "retention.keep_lats"),
    ({"keep_last": 0}, "retention.keep_last"),
    ({"keep_last": "3"}, "retention.keep_last"),
    ({"keep_best": {"metric": "x", "mode": "up"}}, "retention.keep_best"),
    ({"keep_best": {"mode": "min"}}, "retention.keep_best"),
    ({"keep_best": {"metric": "x", "top": 2}}, "retention.keep_best"),
    ({"keep_steps": 5}, "retention.keep_steps"),
    ({"keep_every_n_seconds": -1}, "retention.keep_every_n_seconds"),
    ({"keep_every_n_seconds": float("nan")}, "retention.keep_every_n_seconds"),
    ({"keep_every_n_seconds": float("inf")}, "retention.keep_every_n_seconds"),
])
def test_bad_config_names_the_key(config, key):
    with pytest.raises(cc.ConfigError) as e:
        cc.retention_from_config(config)
    assert str(e.value).startswith(key), str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("steps", [5, "5", None, {1: 2}])
def test_keep_steps_of_something_not_a_list_is_a_config_error(steps):
    with pytest.raises(cc.ConfigError, match="keep_steps must be a list"):
        cc.KeepSteps(steps)


def test_no_policy_keeps_everything():
    infos = [StepInfo(s, float(s), {}) for s in (1, 2, 3)]
    assert decide(None, infos) == decide([], infos) == {1, 2, 3}
    assert as_policies([]) is None and as_policies({}) is None and as_policies({"keep_last": None}) is None
    assert retention_from_config({"keep_last": None, "keep_every": None}) == []
    # an empty keep_steps is "no milestones", not a policy keeping no step (which deletes all but the newest)
    assert retention_from_config({"keep_steps": []}) == [] and as_policies({"keep_steps": ()}) is None
    assert retention_from_config({"keep_steps": [], "keep_last": 2}) == [cc.KeepLast(2)]
