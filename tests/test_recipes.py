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
from ckpt_callbacks import cli
from ckpt_callbacks.config import load_config
from helpers import assert_tree_equal

try:
    from objstore import objstore, objstore_env  # noqa: F401 - pytest fixtures (real S3/GCS servers)
except ImportError:
    @pytest.fixture
    def objstore(request):
        pytest.skip("tests/objstore.py (real object-store servers) is not in this tree yet")

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


def need_module(name, what):
    """Skip only while another engineer's module is absent (the recipe imports it in its own process)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} ({what}) is not in this tree yet")


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
    # (an interrupt_at not below train.steps: trained straight through, as with 0)
    out = run_recipe("digits_mlp.py", *SMALL, "--set", f"checkpoint.directory={b}", "--set", "train.interrupt_at=60",
                     "--summary-json", str(tmp_path / "b.json"))
    assert "train.interrupt_at=60 is not below train.steps=60: training without an interruption" in out
    assert "run 1:" not in out
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


@pytest.mark.slow
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


def test_flax_nnx_recipe_trains_then_resumes(tmp_path):
    need_module("ckpt_callbacks.flax", "CheckpointHook")
    d = str(tmp_path / "run")
    small = ["--set", f"checkpoint.directory={d}", "--set", "checkpoint.save_interval_steps=10",
             "--set", "train.eval_every=10", "--set", "train.hidden=32"]
    out = run_recipe("flax_nnx.py", *small, "--set", "train.steps=25", "--summary-json", str(tmp_path / "a.json"))
    assert "starting at step 0" in out
    a = json.load(open(tmp_path / "a.json"))
    assert a["saved_this_run"] == [10, 20, 25] and a["kept"] == [20, 25]   # keep_last 2 (+ best by val_loss)
    out = run_recipe("flax_nnx.py", *small, "--set", "train.steps=40", "--summary-json", str(tmp_path / "b.json"))
    assert "starting at step 25 (resumed" in out
    b = json.load(open(tmp_path / "b.json"))
    assert b["saved_this_run"] == [30, 40] and b["kept"][-2:] == [30, 40]
    assert b["best_metrics"]["val_loss"] == min(cc.CheckpointManager(d, read_only=True).metrics(s)["val_loss"]
                                                for s in b["kept"] if s % 10 == 0)


def test_keras_fit_recipe_trains_then_resumes(tmp_path):
    need_module("ckpt_callbacks.keras", "AsyncCheckpoint")
    d = str(tmp_path / "run")
    small = ["--set", f"checkpoint.directory={d}", "--set", "train.hidden=32", "--set", "train.batch_size=128"]
    run_recipe("keras_fit.py", *small, "--set", "train.epochs=2", "--summary-json", str(tmp_path / "a.json"),
               env={"KERAS_BACKEND": "jax"})
    a = json.load(open(tmp_path / "a.json"))
    per_epoch = a["kept"][0]
    assert a["epochs_run"] == 2 and a["kept"] == [per_epoch, 2 * per_epoch]
    run_recipe("keras_fit.py", *small, "--set", "train.epochs=3", "--summary-json", str(tmp_path / "b.json"),
               env={"KERAS_BACKEND": "jax"})
    b = json.load(open(tmp_path / "b.json"))
    assert b["epochs_run"] == 1   # resumed after epoch 2: only epoch 3 ran
    assert 3 * per_epoch in b["kept"] and len(b["kept"]) <= 3
    assert b["best_metrics"]["val_accuracy"] == max(cc.CheckpointManager(d, read_only=True).metrics(s)["val_accuracy"]
                                                    for s in b["kept"])


def test_multiprocess_recipe_resumes_on_a_different_process_count(tmp_path):
    d = str(tmp_path / "run")
    out = run_recipe("multiprocess.py", "--set", f"checkpoint.directory={d}", "--set", "train.stop_at=20",
                     "--set", "train.steps=40", "--set", "checkpoint.save_interval_steps=10",
                     "--set", "train.eval_every=10", "--set", "train.hidden=32", timeout=400)
    assert "[2 processes] committed [10, 20]" in out
    assert "[1 processes] resumed step 20 onto a 2-device mesh" in out
    m = cc.CheckpointManager(d, read_only=True)
    assert m.all_steps() == [30, 40] or set(m.all_steps()) >= {30, 40}
    tree = m.restore(40)
    assert int(tree["step"]) == 40 and tree["params"]["l1"]["w"].shape == (64, 32)


@pytest.mark.parametrize("objstore", ["s3", pytest.param("gs", marks=pytest.mark.slow)], indirect=True)
def test_object_store_recipe_and_cli_on_the_url(objstore, tmp_path):
    url = objstore.url
    cfg = os.path.join(RECIPES, "digits_s3.yaml")
    out = run_recipe("digits_mlp.py", "--config", cfg, *SMALL, "--set", f"checkpoint.directory={url}",
                     "--set", "train.steps=30", "--set", "train.interrupt_at=19",
                     "--summary-json", str(tmp_path / "s.json"))
    assert "killed by SIGKILL" in out
    s = json.load(open(tmp_path / "s.json"))
    assert s["resumed_from"] in (None, 10)   # None if save 10 was still uploading at the kill
    assert s["kept"][-1] == 30 and s["best_step"] in s["kept"]
    assert cli.main(["verify", url, "--all", "--quiet"]) == 0
    assert cli.main(["ls", url]) == 0
