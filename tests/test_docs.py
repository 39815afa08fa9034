"""The README's quickstart and the docs' Python examples run as written."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", open(path).read(), re.S)


def test_readme_quickstart_runs_and_prints_what_it_says(tmp_path):
    block = _python_blocks(os.path.join(ROOT, "README.md"))[0]
    code = block.replace("/tmp/ckpt-demo", str(tmp_path / "demo"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[80, 90, 100] 100" in r.stdout, r.stdout


def test_readme_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'pip install -e ".[test]" && python -m pytest -q' in readme
    assert ci.rstrip().endswith("python -m pytest -q") and 'pip install --quiet -e ".[test]"' in ci


# Module docstrings start with a runnable example; these three are shell commands or need a
# real bucket (docs/storage.md's examples, run against real servers in test_storage/test_cli).
_NOT_PYTHON = {"cli", "bench", "objectstore"}

_RUN_EXAMPLES = r'''
import ast, os, sys, textwrap, traceback
pkg, tmp = sys.argv[1], sys.argv[2]
failed = []
for name in sys.argv[3:]:
    doc = ast.get_docstring(ast.parse(open(os.path.join(pkg, name + ".py")).read())) or ""
    head, _, rest = doc.partition("::\n")
    lines = rest.splitlines()
    block = []
    for line in lines:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    os.makedirs(f"{tmp}/{name}")
    for path in ("/tmp/", "/dev/shm/"):   # every example in a directory of its own
        code = code.replace(path, f"{tmp}/{name}/")
    try:
        exec(compile(code, f"<{name} docstring>", "exec"), {"__name__": f"example_{name}"})
    except BaseException:
        failed.append(f"{name}: {traceback.format_exc()[-1500:]}")
print("FAILED:\n" + "\n".join(failed) if failed else "all ran")
'''


def test_every_module_docstring_example_runs_as_written(tmp_path):
    pkg = os.path.join(ROOT, "ckpt_callbacks")
    names = sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py") and not f.startswith("_"))
    with_example = [n for n in names if "Example" in (open(os.path.join(pkg, n + ".py")).read().split('"""')[1])]
    assert set(names) - set(with_example) == set(), "a module without an example in its docstring"
    run = [n for n in with_example if n not in _NOT_PYTHON]
    r = subprocess.run([sys.executable, "-c", _RUN_EXAMPLES, pkg, str(tmp_path), *run], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax",
                            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert r.returncode == 0 and r.stdout.strip().endswith("all ran"), r.stdout[-6000:] + r.stderr[-2000:]


# Entry points whose own docstrings start with a runnable example (besides their modules'): a
# class's methods continue its example, in the order they are defined (as doctest shares names).
_ENTRY_POINTS = r'''
import inspect, os, sys, textwrap, traceback
import ckpt_callbacks as cc
from ckpt_callbacks.keras import AsyncCheckpoint, ResumableDataset, load_weights
from ckpt_callbacks.flax import CheckpointHook
tmp = sys.argv[1]

def example(obj):
    doc = inspect.getdoc(obj) or ""
    head, sep, rest = doc.partition("::\n")
    paragraphs = head.split("\n\n")   # the summary, then the example
    if not sep or len(paragraphs) > 2 or not paragraphs[-1].startswith("Example"):
        return None
    block = []
    for line in rest.splitlines():
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))

classes = [cc.CheckpointManager, AsyncCheckpoint, CheckpointHook, ResumableDataset]
functions = [load_weights, cc.retention_from_config, cc.KeepLast, cc.KeepEvery, cc.KeepSteps, cc.KeepBest, cc.KeepEveryNSeconds]
missing, failed, ran = [], [], 0
for obj in classes + functions:
    members = []
    if obj in classes[:3]:   # their methods are entry points too (not the hooks Keras calls)
        members = [(n, v) for n, v in vars(obj).items()
                   if callable(v) and not n.startswith("_") and not n.startswith("on_")]
    ns = {"__name__": f"example_{obj.__name__}"}
    os.makedirs(f"{tmp}/{obj.__name__}")
    for name, o in [(obj.__name__, obj)] + [(f"{obj.__name__}.{n}", v) for n, v in members]:
        code = example(o)
        if code is None:
            missing.append(name)
            continue
        code = code.replace("/tmp/", f"{tmp}/{obj.__name__}/")
        try:
            exec(compile(code, f"<{name} docstring>", "exec"), ns)
            ran += 1
        except BaseException:
            failed.append(f"{name}: {traceback.format_exc()[-1500:]}")
            break
print(f"missing: {missing}\nfailed: {failed}\nran {ran}")
'''


def test_entry_point_docstrings_start_with_an_example_that_runs(tmp_path):
    r = subprocess.run([sys.executable, "-c", _ENTRY_POINTS, str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax"})
    out = r.stdout
    assert r.returncode == 0 and "missing: []\nfailed: []\nran 27" in out, out[-6000:] + r.stderr[-3000:]
