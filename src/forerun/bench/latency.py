"""Latency curves as files: JSON and one plot of every curve measured (e.g. fp32 and bf16 side by side), with a
third panel for the batched row curves when they were measured.

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

    batched = any(curve.batched for curve in curves.values())
    fig, axes = plt.subplots(1, 3 if batched else 2, figsize=(15 if batched else 10, 4))
    left, right = axes[0], axes[1]
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
    if batched:
        rows_axis = axes[2]
        for label, curve in curves.items():
            top = max((max(c.sizes) for _, c in curve.batched), default=max(curve.sizes))
            for rows, row_curve in ((1, curve), *curve.batched):
                sizes = [n for n in row_curve.sizes if n <= top]
                relative = [row_curve.cost(n) / curve.seconds[0] for n in sizes]
                rows_axis.plot(sizes, relative, marker=".", label=f"{label}, {rows} row{'s' if rows > 1 else ''}")
        rows_axis.set_xscale("log", base=2)
        rows_axis.set_xlabel("tokens per row, several rows in one forward")
        rows_axis.set_ylabel("latency / latency of 1 row x 1 token")
        rows_axis.set_ylim(bottom=0)
        rows_axis.grid(alpha=0.3)
        rows_axis.legend(fontsize="small")
    left.set_ylabel("ms per forward")
    left.set_ylim(bottom=0)
    right.set_ylabel("latency / latency of 1 token")
    threads = f", {settings['threads']} thread(s)" if settings.get("threads") else ""
    where = settings.get("machine_label") or settings.get("device", "")
    fig.suptitle(f"{settings.get('model', '')} on {where}{threads}: forward latency")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
