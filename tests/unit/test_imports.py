"""`import forerun` and the command line's `--help` import neither torch nor transformers; the public names import
their modules at first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import forerun

HEAVY = ("torch", "transformers")


def modules_after(script: str) -> set[str]:
    """The heavy modules a fresh interpreter holds after running `script`."""
    probe = f"{script}\nimport sys\nprint('heavy:' + ','.join(name for name in {HEAVY!r} if name in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(filter(None, done.stdout.rsplit("heavy:", 1)[1].strip().split(",")))


@pytest.mark.parametrize(
    "args", [["--help"], ["generate", "--help"], ["serve", "--help"], ["curve", "--help"], ["--version"]]
)
def test_help_imports_neither_torch_nor_transformers(args):
    script = (
        "from typer.testing import CliRunner\nfrom forerun.cli import app\n"
        f"done = CliRunner().invoke(app, {args!r})\nassert done.exit_code == 0, done.output\n"
        "assert ('Usage' in done.output) != (', transformers ' in done.output), done.output\n"
    )
    assert modules_after(script) == set()


def test_a_public_name_imports_its_module_at_first_use():
    assert modules_after("import forerun") == set()
    assert modules_after("from forerun import load_model") == set(HEAVY)  # the control: the probe sees imports


def test_every_public_name_resolves():
    assert sorted(forerun.__all__) == sorted(forerun.EXPORTS)
    for name in forerun.__all__:
        value = getattr(forerun, name)
        assert getattr(value, "__name__", name) == name or name.isupper()
        assert name in dir(forerun)
    with pytest.raises(AttributeError, match="no attribute 'Decodr'"):
        forerun.Decodr  # noqa: B018


def test_python_dash_m_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "forerun", "--help"], capture_output=True, text=True, check=True)
    assert "Usage" in done.stdout and "serve" in done.stdout
