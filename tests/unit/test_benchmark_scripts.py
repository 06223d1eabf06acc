"""Every benchmark the docs give a command for still loads: its imports resolve (a module the tests moved had left
three server and long-prompt benchmarks failing at their first line) and every shell script parses."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL = sorted(BENCHMARKS.glob("*.sh"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20 and len(SHELL) >= 3  # a wrong folder must not pass as "nothing broken"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_imports(script: Path):
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))  # as `python benchmarks/x.py` runs it: its own folder first on the path
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # module level only: each script runs under `if __name__ == "__main__"`
    finally:
        sys.path[:] = saved
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
    assert module.__doc__, f"{script.name} has no docstring saying how it is run"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SHELL, ids=lambda path: path.name)
def test_shell_script_parses(script: Path):
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
