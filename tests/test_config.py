"""Run configs: every key parsed, every bad key or value rejected with an error naming it."""

import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks.config import apply_overrides, load_config, parse_checkpoint

TRAIN = {"steps": 100, "lr": 1e-3, "name": "mlp", "shuffle": True}


def test_full_config_from_yaml(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("""
checkpoint:
  directory: ~/ckpt-test-dir
  save_interval_steps: 5
  async_save: false
  max_staging_bytes: 1048576
  timeout_s: 30
  retention:
    keep_last: 2
    keep_every: 100
    keep_steps: [7]
    keep_every_n_seconds: 3600
    keep_best: {metric: val_acc, mode: max, n: 2}
  resume: best
train:
  steps: 20
  lr: 1
""")
    cfg = load_config(p, train_defaults=TRAIN)
    c = cfg.checkpoint
    assert c.directory.endswith("/ckpt-test-dir") and not c.directory.startswith("~")
    assert (c.save_interval_steps, c.async_save, c.max_staging_bytes, c.timeout_s) == (5, False, 1 << 20, 30.0)
    assert c.resume == "best"
    assert c.policies == [cc.KeepLast(2), cc.KeepEvery(100), cc.KeepSteps([7]), cc.KeepEveryNSeconds(3600),
                          cc.KeepBest("val_acc", "max", 2)]
    assert cfg.train == {"steps": 20, "lr": 1.0, "name": "mlp", "shuffle": True}
    assert isinstance(cfg.train["lr"], float)


@pytest.mark.parametrize("resume,expected", [("latest", "latest"), ("off", None), (False, None), (None, None),
                                             (300, 300)])
def test_resume_modes(resume, expected):
    c = parse_checkpoint({"directory": "/tmp/x", "resume": resume})
    assert c.resume == expected


def test_urls_are_kept_and_defaults():
    c = parse_checkpoint({"directory": "s3://bucket/prefix/run"})
    assert c.directory == "s3://bucket/prefix/run"
    assert (c.save_interval_steps, c.async_save, c.retention, c.resume) == (1, True, None, "latest")
    assert c.policies is None


BAD = [
    ({"directory": "/x", "save_every": 3}, "checkpoint.save_every: unknown key"),
    ({}, "checkpoint.directory: missing"),
    ({"directory": ""}, "checkpoint.directory: expected a non-empty path"),
    ({"directory": "ftp://host/x"}, "checkpoint.directory: unsupported URL scheme 'ftp'"),
    ({"directory": "/x", "save_interval_steps": 0}, "checkpoint.save_interval_steps: expected a positive int, got 0"),
    ({"directory": "/x", "save_interval_steps": "10"}, "checkpoint.save_interval_steps"),
    ({"directory": "/x", "async_save": "yes"}, "checkpoint.async_save: expected true or false"),
    ({"directory": "/x", "max_staging_bytes": -1}, "checkpoint.max_staging_bytes"),
    ({"directory": "/x", "timeout_s": 0}, "checkpoint.timeout_s"),
    ({"directory": "/x", "timeout_s": float("nan")}, "checkpoint.timeout_s: expected a positive, finite number"),
    ({"directory": "/x", "timeout_s": float("inf")}, "checkpoint.timeout_s: expected a positive, finite number"),
    ({"directory": "/x", "retention": [3]}, "checkpoint.retention: expected a mapping"),
    ({"directory": "/x", "retention": {"keep_lats": 3}}, "checkpoint.retention.keep_lats: unknown retention key"),
    ({"directory": "/x", "retention": {"keep_last": 0}}, "checkpoint.retention.keep_last"),
    ({"directory": "/x", "retention": {"keep_best": {"metric": "l", "mode": "low"}}},
     "checkpoint.retention.keep_best: keep_best.mode must be 'min' or 'max'"),
    ({"directory": "/x", "retention": {"keep_best": {"mode": "min"}}}, "checkpoint.retention.keep_best: missing 'metric'"),
    ({"directory": "/x", "retention": {"keep_best": {"metric": "l", "k": 1}}}, "checkpoint.retention.keep_best: unknown key"),
    ({"directory": "/x", "retention": {"keep_steps": 5}}, "checkpoint.retention.keep_steps"),
    ({"directory": "/x", "retention": {"keep_every_n_seconds": -1}}, "checkpoint.retention.keep_every_n_seconds"),
    ({"directory": "/x", "resume": "newest"}, "checkpoint.resume: expected latest | best | <step> | off, got 'newest'"),
    ({"directory": "/x", "resume": -3}, "checkpoint.resume: a step must be >= 0"),
    ({"directory": "/x", "resume": "best"}, "checkpoint.resume: 'best' needs checkpoint.retention.keep_best"),
]


@pytest.mark.parametrize("section,message", BAD)
def test_bad_checkpoint_sections_name_the_key(section, message):
    with pytest.raises(cc.ConfigError) as e:
        load_config({"checkpoint": section})
    assert message in str(e.value)


def test_bad_top_level_and_train_keys():
    with pytest.raises(cc.ConfigError, match=r"^trian: unknown top-level key"):
        load_config({"checkpoint": {"directory": "/x"}, "trian": {}})
    with pytest.raises(cc.ConfigError, match=r"^checkpoint: missing section"):
        load_config({"train": {}})
    with pytest.raises(cc.ConfigError, match=r"train.stpes: unknown key; this script knows"):
        load_config({"checkpoint": {"directory": "/x"}, "train": {"stpes": 1}}, train_defaults=TRAIN)
    with pytest.raises(cc.ConfigError, match=r"train.steps: expected int like the default 100, got 2.5"):
        load_config({"checkpoint": {"directory": "/x"}, "train": {"steps": 2.5}}, train_defaults=TRAIN)
    with pytest.raises(cc.ConfigError, match=r"train.shuffle: expected bool"):
        load_config({"checkpoint": {"directory": "/x"}, "train": {"shuffle": 1}}, train_defaults=TRAIN)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(cc.ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("checkpoint: [unclosed\n")
    with pytest.raises(cc.ConfigError, match="is not valid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(cc.ConfigError, match="expected a mapping"):
        load_config(p)


def test_overrides_apply_before_validation():
    base = {"checkpoint": {"directory": "/x", "retention": {"keep_last": 3}}, "train": {"steps": 10}}
    out = apply_overrides(base, ["train.steps=2", "checkpoint.retention.keep_best.metric=acc",
                                 "checkpoint.async_save=false", "checkpoint.resume=off"])
    assert out["train"]["steps"] == 2 and out["checkpoint"]["async_save"] is False
    assert out["checkpoint"]["retention"] == {"keep_last": 3, "keep_best": {"metric": "acc"}}
    assert base["train"]["steps"] == 10   # the input is not modified
    with pytest.raises(cc.ConfigError, match="checkpoint.save_interval_steps"):
        load_config(base, train_defaults=TRAIN, overrides=["checkpoint.save_interval_steps=0"])
    with pytest.raises(cc.ConfigError, match="expected key.path=value"):
        apply_overrides(base, ["train.steps"])
    with pytest.raises(cc.ConfigError, match="train.steps is not a mapping"):
        apply_overrides(base, ["train.steps.x=1"])


def test_manager_and_resume_step_follow_the_config(tmp_path):
    d = str(tmp_path / "run")
    section = {"directory": d, "save_interval_steps": 2, "async_save": False,
               "retention": {"keep_last": 1, "keep_best": {"metric": "loss", "mode": "min"}}}
    cfg = parse_checkpoint(section)
    with cfg.manager() as m:
        assert cfg.resume_step(m) is None   # nothing committed yet
        assert m.save(1, {"x": np.ones(2)}) is False   # not on the interval
        for s, loss in [(2, 0.1), (4, 0.5), (6, 0.7)]:
            assert m.save(s, {"x": np.full(2, s)}, metrics={"loss": loss})
        assert m.all_steps() == [2, 6]
        assert cfg.resume_step(m) == 6
        assert parse_checkpoint({**section, "resume": "best"}).resume_step(m) == 2
        assert parse_checkpoint({**section, "resume": 2}).resume_step(m) == 2
        assert parse_checkpoint({**section, "resume": "off"}).resume_step(m) is None
        with pytest.raises(cc.CheckpointNotFoundError, match="step 4 is not a committed checkpoint"):
            parse_checkpoint({**section, "resume": 4}).resume_step(m)


def test_script_can_narrow_resume_modes():
    with pytest.raises(cc.ConfigError, match=r"checkpoint.resume: this script resumes only from latest \| off"):
        load_config({"checkpoint": {"directory": "/x", "resume": 5}}, resume_modes=("latest", "off"))
    with pytest.raises(cc.ConfigError, match=r"checkpoint.resume: expected latest \| off, got 'best'"):
        load_config({"checkpoint": {"directory": "/x", "resume": "best",
                                    "retention": {"keep_best": {"metric": "m"}}}}, resume_modes=("latest", "off"))
