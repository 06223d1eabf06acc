"""Latency curves as files: JSON and one plot of every curve measured (e.g. fp32 and bf16 side by side).

The measurement itself is `forerun.latency.measure_curve` (the cost model's); `forerun curve` also stores each
curve where the cost model looks for it.

Example:
    >>> curves = {"fp32": measure_curve(model32), "bf16": measure_curve(model16)}            # doctest: +SKIP
    >>> write_curves(curves, {"model": "smollm2-135m", "device": "cpu", "threads": 1}, Path("out"))  # doctest: +SKIP
    [PosixPath('out/latency.json'), PosixPath('out/latency.png')]
"""

from __future__ import annotations

import json
from pathlib import Path

from forerun.costmodel import LatencyCurve


def write_curves(curves: dict[str, LatencyCurve], settings: dict, out: Path) -> list[Path]:
    """latency.json (every curve, seconds and relative to 1 token) and latency.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency.json", out / "latency.png"]
    data = {
        label: {**curve.as_dict(), "relative": [round(curve.relative(n), 3) for n in curve.sizes]}
        for label, curve in curves.items()
    }
    paths[0].write_text(json.dumps({"settings": settings, "curves": data}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, curve in curves.items():
        sizes = list(curve.sizes)
        left.plot(sizes, [s * 1000 for s in curve.seconds], marker="o", label=label)
        right.plot(sizes, [curve.relative(n) for n in sizes], marker="o", label=label)
    largest = max(max(curve.sizes) for curve in curves.values())
    right.plot([1, largest], [1, largest], linestyle=":", color="grey", label="proportional to tokens")
    right.set_ylim(0, max(max(curve.relative(n) for n in curve.sizes) for curve in curves.values()) * 1.15)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens fed in one forward")
        ax.grid(alpha=0.3)
        ax.legend()
    left.set_ylabel("ms per forward")
    left.set_ylim(bottom=0)
    right.set_ylabel("latency / latency of 1 token")
    threads = f", {settings['threads']} thread(s)" if settings.get("threads") else ""
    fig.suptitle(f"{settings.get('model', '')} on {settings.get('device', '')}{threads}: forward latency")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
