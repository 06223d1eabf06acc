"""Benchmark output: a table per dataset (rich), JSON with every per-prompt record, PNG plots (matplotlib)."""

from __future__ import annotations

import json
import math
import platform
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from forerun.bench.runner import Record

IDENTICAL = {True: "yes", False: "NO", None: "n/a (sampled)"}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(records: list[Record]) -> dict[str, dict[str, dict]]:
    """{dataset: {method: {tokens_per_second, speedup_geomean, speedup_min, speedup_max, ...}}}"""
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for record in records:
        groups[(record.dataset, record.method)].append(record)
    summary: dict[str, dict[str, dict]] = defaultdict(dict)
    for (dataset, method), rows in groups.items():
        speedups = [r.speedup for r in rows if r.speedup]
        tpf = [r.tokens_per_forward for r in rows if r.tokens_per_forward is not None]
        acc = [r.acceptance for r in rows if r.acceptance is not None]
        share = [r.draft_share for r in rows if r.draft_share is not None]
        tokens, seconds = sum(r.new_tokens for r in rows), sum(r.seconds for r in rows)
        summary[dataset][method] = {
            "prompts": len(rows),
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "speedup_geomean": geomean(speedups),
            "speedup_min": min(speedups) if speedups else None,
            "speedup_max": max(speedups) if speedups else None,
            "tokens_per_forward": sum(tpf) / len(tpf) if tpf else None,
            "acceptance": sum(acc) / len(acc) if acc else None,
            "draft_share": sum(share) / len(share) if share else None,
            # None: sampled runs, which are not compared token for token.
            "identical": None if any(r.identical is None for r in rows) else all(r.identical for r in rows),
        }
    return summary


def tables(summary: dict[str, dict[str, dict]]) -> list[Table]:
    out = []
    for dataset, methods in summary.items():
        table = Table(title=f"{dataset}: speed vs plain model.generate (same prompts, interleaved)")
        for column in (
            "method",
            "tok/s",
            "speedup (geomean)",
            "min-max",
            "tokens/forward",
            "acceptance",
            "draft time",
            "identical",
        ):
            table.add_column(column, justify="left" if column == "method" else "right")
        for method, row in methods.items():
            table.add_row(
                escape(method),
                f"{row['tokens_per_second']:.1f}",
                f"{row['speedup_geomean']:.2f}x",
                f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}",
                "-" if row["tokens_per_forward"] is None else f"{row['tokens_per_forward']:.2f}",
                "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}",
                "-" if row["draft_share"] is None else f"{row['draft_share']:.1%}",
                IDENTICAL[row["identical"]] if row["identical"] is not False else "[bold red]NO[/]",
            )
        out.append(table)
    return out


def markdown(summary: dict[str, dict[str, dict]]) -> str:
    """The same tables as GitHub markdown, for README.md and BENCHMARKS.md."""
    lines = []
    for dataset, methods in summary.items():
        lines += [
            f"**{dataset}**",
            "",
            "| method | tok/s | speedup (geomean) | min-max | tokens/forward | acceptance | draft time | identical |",
            "|---|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for method, r in methods.items():
            tpf = "-" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}"
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            share = "-" if r["draft_share"] is None else f"{r['draft_share']:.1%}"
            lines.append(
                f"| {method} | {r['tokens_per_second']:.1f} | {r['speedup_geomean']:.2f}x | "
                f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f} | {tpf} | {acc} | {share} | "
                f"{IDENTICAL[r['identical']]} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_outputs(records: list[Record], summary: dict, settings: dict, out: Path) -> list[Path]:
    """results.json, results.md, speedup.png, accepted_hist.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    settings = {**settings, "machine": platform.machine(), "python": platform.python_version()}
    paths = [out / "results.json", out / "results.md", out / "speedup.png", out / "accepted_hist.png"]
    paths[0].write_text(
        json.dumps({"settings": settings, "summary": summary, "records": [asdict(r) for r in records]}, indent=1)
    )
    paths[1].write_text(markdown(summary))
    plot_speedups(summary, paths[2])
    plot_histograms(records, paths[3])
    return paths


def plot_speedups(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(summary)
    methods = [m for m in dict.fromkeys(m for d in datasets for m in summary[d]) if m != "generate"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * len(datasets)), 4))
    width = 0.8 / max(1, len(datasets))
    for i, dataset in enumerate(datasets):
        values = [summary[dataset].get(m, {}).get("speedup_geomean", 0) for m in methods]
        ax.bar([x + i * width for x in range(len(methods))], values, width, label=dataset)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + width * (len(datasets) - 1) / 2 for x in range(len(methods))], methods, rotation=20)
    ax.set_ylabel("speedup vs model.generate (geomean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_histograms(records: list[Record], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        for k, v in r.accepted_hist.items():
            hists[r.method][int(k)] += v
    methods = [m for m in hists if sum(hists[m].values()) and any(k > 0 for k in hists[m])] or list(hists)
    fig, axes = plt.subplots(1, max(1, len(methods)), figsize=(3.2 * max(1, len(methods)), 3), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=False):
        counts = hists[method]
        xs = sorted(counts)
        total = sum(counts.values())
        ax.bar(xs, [counts[x] / total for x in xs])
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("accepted draft tokens per step")
    axes[0][0].set_ylabel("share of steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
