"""constraints.txt, which `make setup` installs under: it must agree with pyproject.toml's own pins, or a fresh
machine's setup fails on the conflict (or installs what the suite never ran with)."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^;\s]+)")


def pins(lines: list[str]) -> dict[str, str]:
    """{normalised name: version} of every `name==version` line."""
    found = {}
    for line in lines:
        match = PIN.match(line.strip())
        if match:
            found[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return found


def test_constraints_hold_pyprojects_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    ours = pins([*project["dependencies"], *(d for name in ("test", "docs", "quantize") for d in extras[name])])
    constrained = pins((ROOT / "constraints.txt").read_text().splitlines())
    assert len(constrained) > len(ours) > 10  # the transitive ones too
    differ = {name: (version, constrained.get(name)) for name, version in ours.items()}
    assert {k: v for k, v in differ.items() if v[0] != v[1]} == {}
    assert constrained["torch"] == "2.13.0"  # the public version: the Makefile installs the CPU build


def test_a_pin_needing_a_newer_python_gets_a_marker():
    line = runpy.run_path(str(ROOT / ".ci" / "constraints.py"))["line"]
    assert line("pymdown-extensions", "13.1.2", ">=3.11.5", "3.11.7") == (
        'pymdown-extensions==13.1.2; python_full_version >= "3.11.5"'
    )
    assert line("networkx", "3.6.1", ">=3.11,!=3.14.1", "3.11.7") == "networkx==3.6.1"  # a later Python's hole
    assert line("torch", "2.13.0+cpu", None, "3.12.1") == "torch==2.13.0"
    assert line("x", "1", ">=3.12", "3.12.1") == 'x==1; python_full_version >= "3.12.0"'
