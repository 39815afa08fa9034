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
