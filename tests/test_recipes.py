"""Every recipe in recipes/: its YAML parses against its script, and it runs, small, as users run it."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import ckpt_callbacks as cc
from ckpt_callbacks.config import load_config
from helpers import assert_tree_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")


def script_of(yaml_path):
    """The script a YAML belongs to: its first line reads ``# recipe: <script>.py``."""
    with open(yaml_path) as f:
        m = re.match(r"#\s*recipe:\s*(\S+\.py)", f.readline())
    assert m, f"{yaml_path}: first line must be '# recipe: <script>.py'"
    return os.path.join(RECIPES, m.group(1))


def load_module(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3].replace("-", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)   # recipes import frameworks lazily, inside their functions
    return mod


def run_recipe(script, *args, timeout=300, env=None):
    p = subprocess.run([sys.executable, os.path.join(RECIPES, script), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return p.stdout


@pytest.mark.parametrize("yaml_path", sorted(glob.glob(os.path.join(RECIPES, "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_every_recipe_config_parses_against_its_script(yaml_path):
    mod = load_module(script_of(yaml_path))
    cfg = load_config(yaml_path, train_defaults=mod.TRAIN_DEFAULTS,
                      resume_modes=getattr(mod, "RESUME_MODES", ("latest", "best", "step", "off")))
    assert cfg.checkpoint.directory
    assert set(cfg.train) == set(mod.TRAIN_DEFAULTS)
    # a typo in any train key is caught, naming the key
    with pytest.raises(cc.ConfigError, match=r"train.stepz: unknown key"):
        load_config(yaml_path, train_defaults=mod.TRAIN_DEFAULTS, overrides=["train.stepz=1"])


def test_there_is_a_recipe_of_each_kind():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(RECIPES, "*.yaml"))}
    assert {"digits_mlp.yaml", "flax_nnx.yaml", "keras_fit.yaml", "multiprocess.yaml", "digits_s3.yaml"} <= names


SMALL = ["--set", "train.steps=60", "--set", "checkpoint.save_interval_steps=10", "--set", "train.eval_every=10",
         "--set", "train.hidden=32"]


def test_main_job_is_killed_resumes_and_ends_like_an_uninterrupted_run(tmp_path):
    a, b = str(tmp_path / "interrupted"), str(tmp_path / "straight")
    out = run_recipe("digits_mlp.py", *SMALL, "--set", f"checkpoint.directory={a}", "--set", "train.interrupt_at=35",
                     "--summary-json", str(tmp_path / "a.json"), "--timeline", str(tmp_path / "a.html"))
    assert "run 1: exited with -9 (killed by SIGKILL)" in out
    assert "== summary ==" in out and "best step:" in out and "training stalled" in out
    s = json.load(open(tmp_path / "a.json"))
    assert s["resumed_from"] in (20, 30)   # 30 unless its write was still in flight at the kill
    assert s["saved_this_run"] == list(range(s["resumed_from"] + 10, 61, 10))
    run_recipe("digits_mlp.py", *SMALL, "--set", f"checkpoint.directory={b}", "--set", "train.interrupt_at=0",
               "--summary-json", str(tmp_path / "b.json"))
    t = json.load(open(tmp_path / "b.json"))
    assert t["resumed_from"] is None and t["saved_this_run"] == [10, 20, 30, 40, 50, 60]
    # retention: the 2 newest + the 2 best by val_accuracy (max), identical in both runs
    assert s["kept"] == t["kept"] and s["best_step"] == t["best_step"] and {50, 60} <= set(s["kept"])
    assert len(s["kept"]) <= 4
    assert s["best_reevaluated_val_accuracy"] == s["best_metrics"]["val_accuracy"]
    # bit-identical final state: the kill and resume changed nothing
    ra = cc.CheckpointManager(a, read_only=True)
    rb = cc.CheckpointManager(b, read_only=True)
    assert_tree_equal(ra.restore(60), rb.restore(60))
    assert ra.host_state(60) == rb.host_state(60)
    assert "<svg" in open(tmp_path / "a.html").read()


def test_main_job_resume_best_and_off(tmp_path):
    d = str(tmp_path / "run")
    base = [*SMALL, "--set", f"checkpoint.directory={d}", "--set", "train.interrupt_at=0",
            "--set", "train.steps=30"]
    run_recipe("digits_mlp.py", *base)
    best = cc.CheckpointManager(d, read_only=True, retention={"keep_best": {"metric": "val_accuracy",
                                                                            "mode": "max"}}).best_step()
    out = run_recipe("digits_mlp.py", *base, "--set", "checkpoint.resume=best", "--set", "train.steps=40",
                     "--summary-json", str(tmp_path / "s.json"))
    assert f"resumed from step {best}" in out
    assert json.load(open(tmp_path / "s.json"))["resumed_from"] == best
    bad = subprocess.run([sys.executable, os.path.join(RECIPES, "digits_mlp.py"), *base, "--set",
                          "checkpoint.retention.keep_lsat=1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "checkpoint.retention.keep_lsat: unknown retention key" in bad.stderr
