"""Write constraints.txt from the running environment: every installed distribution but forerun at its version.

A pin whose distribution needs a newer Python than forerun does (pymdown-extensions 13 needs 3.11.5, forerun 3.11)
gets a marker, so that an older 3.11 resolves that package freely instead of failing. The local CPU torch build is
pinned by its public version (`torch==2.13.0`; the Makefile installs the CPU wheel). The header is kept.

Usage: .venv/bin/python .ci/constraints.py constraints.txt   (`make constraints`)
"""

from __future__ import annotations

import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

OURS = SpecifierSet(">=3.11")
"""forerun's requires-python."""
TOOLS = {"forerun", "pip", "setuptools", "wheel"}
"""Not pinned: forerun itself, and what a fresh venv brings (the Makefile upgrades pip first)."""


def line(name: str, version: str, requires: str | None, running: str = "3.11.7") -> str:
    """`name==version`, with `; python_full_version >= "X"` where `requires` leaves out an older Python than the
    `running` one that forerun takes (a Python it leaves out above the running one is not this pin's concern).

    Example:
        >>> line("pymdown-extensions", "13.1.2", ">=3.11.5")
        'pymdown-extensions==13.1.2; python_full_version >= "3.11.5"'
        >>> line("torch", "2.13.0+cpu", ">=3.10"), line("networkx", "3.6.1", ">=3.11,!=3.14.1")
        ('torch==2.13.0', 'networkx==3.6.1')
    """
    pin = f"{name}=={Version(version).public}"
    allowed, top = SpecifierSet(requires or ""), Version(running)
    older = [Version(f"3.{minor}.{patch}") for minor in range(11, top.minor + 1) for patch in range(30)]
    older = [v for v in older if v <= top and v in OURS]
    left_out = [v for v in older if v not in allowed]
    if not left_out:
        return pin
    return f'{pin}; python_full_version >= "{min(v for v in older if v > max(left_out))}"'


def main(path: Path) -> None:
    header = [row for row in path.read_text().splitlines() if row.startswith("#")] if path.exists() else []
    running = ".".join(map(str, sys.version_info[:3]))
    found = {d.metadata["Name"]: d for d in distributions() if d.metadata["Name"].lower() not in TOOLS}
    pins = [line(name, d.version, d.metadata["Requires-Python"], running) for name, d in sorted(
        found.items(), key=lambda item: item[0].lower())]  # fmt: skip
    path.write_text("\n".join([*header, *pins]) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
