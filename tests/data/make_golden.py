"""Writes tests/data/golden_v1: a format-v1 checkpoint kept in the repository forever.

Run once (never rerun to "fix" a failing test: a failure means the format changed):
    python tests/data/make_golden.py
"""

import os
import shutil
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ckpt_callbacks as cc  # noqa: E402
from test_format import golden_tree  # noqa: E402

out = os.path.join(os.path.dirname(__file__), "golden_v1")
shutil.rmtree(out, ignore_errors=True)
with cc.CheckpointManager(out, async_save=False) as m:
    m.save(7, golden_tree(), metrics={"val_loss": 0.25})
os.remove(os.path.join(out, ".ckpt_callbacks.lock")) if os.path.exists(os.path.join(out, ".ckpt_callbacks.lock")) else None
print("wrote", out)
