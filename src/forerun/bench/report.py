"""Benchmark output: a table per dataset (rich), JSON with every per-prompt record, PNG plots (matplotlib)."""

from __future__ import annotations

import datetime
import json
import math
import platform
import textwrap
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from forerun.bench.peers import PEER_METHODS
from forerun.bench.records import Record
from forerun.measured import write_json

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
        fed = [r.mean_fed for r in rows if r.mean_fed is not None]
        single = [r.single_token_share for r in rows if r.single_token_share is not None]
        ties = [r.tie_ulps for r in rows if r.tie_ulps is not None and r.tie_reading is None]
        tokens, seconds = sum(r.new_tokens for r in rows), sum(r.seconds for r in rows)
        compared = [r for r in rows if r.identical is not None]
        summary[dataset][method] = {
            "method": method,
            "prompts": len(rows),
            "tokens_per_second": tokens / seconds if seconds else None,
            "speedup_geomean": geomean(speedups) if speedups else None,
            "speedup_min": min(speedups) if speedups else None,
            "speedup_max": max(speedups) if speedups else None,
            "tokens_per_forward": sum(tpf) / len(tpf) if tpf else None,
            "acceptance": sum(acc) / len(acc) if acc else None,
            "draft_share": sum(share) / len(share) if share else None,
            "mean_fed": sum(fed) / len(fed) if fed else None,
            "single_token_share": sum(single) / len(single) if single else None,
            # None: sampled runs, which are not compared token for token.
            "identical": None if len(compared) < len(rows) else all(r.identical for r in rows),
            "identical_count": sum(bool(r.identical) for r in compared),
            "max_tie_ulps": max(ties) if ties else None,
            "other_readings": sum(r.tie_reading is not None for r in rows),
        }
    return summary


def identical_cell(row: dict) -> str:
    """'yes', 'NO', 'n/a (sampled)', or in low precision '3/5, ties <= 1.0 ulp'; for llama.cpp, how its prompt
    lookup compares with its own plain output."""
    if row["method"].split("[")[0] in PEER_METHODS:  # another runtime: its lookup against its own plain output
        if row["identical"] is None and not row["identical_count"]:
            return "n/a (other runtime)"
        return f"{row['identical_count']}/{row['prompts']} = its plain"
    if row["identical"] is None or (row["identical"] and row["max_tie_ulps"] is None):
        return IDENTICAL[row["identical"]]
    others = row.get("other_readings") or 0
    elsewhere = f", {others} a tie read otherwise" if others else ""
    if row["max_tie_ulps"] is None:
        return f"{row['identical_count']}/{row['prompts']}{elsewhere}" if others else "NO"
    return f"{row['identical_count']}/{row['prompts']}, ties <= {row['max_tie_ulps']:.1f} ulp{elsewhere}"


def cells(row: dict) -> list[str]:
    """The table cells of one summary row (every column after the method's name)."""

    def number(key: str, fmt: str) -> str:
        return "-" if row[key] is None else format(row[key], fmt)

    speed = "-" if row["speedup_geomean"] is None else f"{row['speedup_geomean']:.2f}x"
    spread = "-" if row["speedup_min"] is None else f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}"
    return [
        number("tokens_per_second", ".1f"),
        speed,
        spread,
        number("tokens_per_forward", ".2f"),
        number("acceptance", ".0%"),
        number("mean_fed", ".1f"),
        number("single_token_share", ".0%"),
        number("draft_share", ".1%"),
        identical_cell(row),
    ]


COLUMNS = (
    "method",
    "tok/s",
    "speedup (geomean)",
    "min-max",
    "tokens/forward",
    "acceptance",
    "fed/forward",
    "1-token steps",
    "draft time",
    "identical",
)


def tables(summary: dict[str, dict[str, dict]]) -> list[Table]:
    out = []
    for dataset, methods in summary.items():
        table = Table(title=f"{dataset}: speed vs plain model.generate (same prompts, interleaved)")
        for column in COLUMNS:
            table.add_column(column, justify="left" if column == "method" else "right")
        for method, row in methods.items():
            row_cells = [escape(cell) for cell in cells(row)]
            if row_cells[-1] == "NO":
                row_cells[-1] = "[bold red]NO[/]"
            table.add_row(escape(method), *row_cells)
        out.append(table)
    return out


def markdown(summary: dict[str, dict[str, dict]]) -> str:
    """The same tables as GitHub markdown, for README.md and docs/benchmarks.md."""
    lines = []
    for dataset, methods in summary.items():
        lines += [
            f"**{dataset}**",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|---" + "|---:" * (len(COLUMNS) - 2) + "|:---:|",
        ]
        for method, row in methods.items():
            lines.append(f"| {method} | " + " | ".join(cells(row)) + " |")
        lines.append("")
    return "\n".join(lines)


def overview(summary: dict[str, dict[str, dict]]) -> str:
    """One markdown table: method x dataset speedups (geomean), and the geometric mean over datasets."""
    datasets = list(summary)
    methods = [m for m in dict.fromkeys(m for d in datasets for m in summary[d]) if m != "generate"]
    lines = ["| method | " + " | ".join(datasets) + " | all (geomean) |", "|---" + "|---:" * (len(datasets) + 1) + "|"]
    for method in methods:
        values = [summary[d].get(method, {}).get("speedup_geomean") for d in datasets]
        present = [v for v in values if v]
        if not present:  # untimed rows (the batch-2 noise floor)
            continue
        speedups = " | ".join("-" if not v else f"{v:.2f}x" for v in values)
        lines.append(f"| {method} | {speedups} | {geomean(present):.2f}x |")
    return "\n".join(lines)


PARTIAL = "results.partial.json"
"""What a run has finished so far, under its `--out` folder: every prompt whose methods all ran (`write_partial`),
gone once results.json is written. A run cut short (a peer's native crash, a kill) keeps them; `--include` reads
the file as it reads a results.json."""


def write_partial(records: list[Record], settings: dict, out: Path) -> None:
    """`records` so far, as results.json holds them (no summary), written whole over `out`/PARTIAL."""
    try:
        write_json(out / PARTIAL, {"settings": run_settings(settings), "records": [asdict(r) for r in records]})
    except OSError:
        pass  # a full disk must not end the run: results.json, written at its end, says what failed


def run_settings(settings: dict) -> dict:
    """`settings` with the machine, Python and the day (kept where given)."""
    return {
        **settings, "machine": platform.machine(), "python": platform.python_version(),
        "date": settings.get("date") or datetime.date.today().isoformat(),
    }  # fmt: skip


def write_outputs(records: list[Record], summary: dict, settings: dict, out: Path) -> list[Path]:
    """results.json, results.md, speedup.png, accepted_hist.png under `out` (and the partial results go)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = run_settings(settings)
    paths = [out / "results.json", out / "results.md", out / "speedup.png", out / "accepted_hist.png"]
    paths[0].write_text(
        json.dumps({"settings": settings, "summary": summary, "records": [asdict(r) for r in records]}, indent=1)
    )
    paths[1].write_text(overview(summary) + "\n\n" + markdown(summary))
    plot_speedups(summary, paths[2], figure_title(settings))
    plot_histograms(records, paths[3], figure_title(settings))
    (out / PARTIAL).unlink(missing_ok=True)
    return paths


def figure_title(settings: dict) -> str:
    """What a plot ran on, in one line: the model, its weights, the machine, the threads, the tokens, the day.

    Example:
        >>> figure_title({"model": "smollm2-135m", "dtype": "bf16", "quantize": "int4", "threads": 1,
        ...               "machine_label": "AMD EPYC (AVX-512)", "max_new_tokens": 128, "date": "2026-11-29"})
        'smollm2-135m, bf16, int4 weights; AMD EPYC (AVX-512), 1 thread; 128 new tokens; 2026-11-29'
    """
    weights = f", {settings['quantize']} weights" if settings.get("quantize") else ""
    threads = settings.get("threads")
    threads_text = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    return (
        f"{settings.get('model', '')}, {settings.get('dtype', '')}{weights}; "
        f"{settings.get('machine_label', settings.get('device', ''))}{threads_text}; "
        f"{settings.get('max_new_tokens', '')} new tokens; {settings.get('date', '')}"
    )


def short_label(method: str, width: int = 34) -> str:
    """A method's name wrapped for an axis: a long bracketed setting breaks after its commas.

    Example:
        >>> print(short_label("jacobi[window=7,ngram=5,max_candidates=7]", width=20))
        jacobi[window=7,
        ngram=5,
        max_candidates=7]
    """
    return "\n".join(textwrap.wrap(method.replace(",", ", "), width)).replace(", ", ",")


def plot_speedups(summary: dict, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(summary)
    methods = [
        m
        for m in dict.fromkeys(m for d in datasets for m in summary[d])
        if m != "generate" and any(summary[d].get(m, {}).get("speedup_geomean") for d in datasets)
    ]
    # Horizontal bars, one group per method: long labels stay readable and the figure stays a sane size.
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.22 * len(methods) * max(1, len(datasets)) + 0.3 * len(methods)))
    height = 0.8 / max(1, len(datasets))
    for i, dataset in enumerate(datasets):
        values = [summary[dataset].get(m, {}).get("speedup_geomean") or 0 for m in methods]
        positions = [y + i * height for y in range(len(methods))]
        bars = ax.barh(positions, values, height, label=dataset)
        ax.bar_label(bars, labels=[f"{v:.2f}x" if v else "" for v in values], fontsize=7, padding=2)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    labels = [short_label(m) for m in methods]
    ax.set_yticks([y + height * (len(datasets) - 1) / 2 for y in range(len(methods))], labels, fontsize=8)
    ax.set_title(title, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup vs plain model.generate (geometric mean per dataset)")
    ax.set_xlim(
        0, max([1.2] + [(summary[d].get(m, {}).get("speedup_geomean") or 0) for d in datasets for m in methods]) * 1.15
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="dataset", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_histograms(records: list[Record], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        for k, v in r.accepted_hist.items():
            hists[r.method][int(k)] += v
    methods = [m for m in hists if sum(hists[m].values()) and any(k > 0 for k in hists[m])] or list(hists)
    width = 3.2 * max(1, len(methods))
    fig, axes = plt.subplots(1, max(1, len(methods)), figsize=(width, 3), squeeze=False, layout="constrained")
    for ax, method in zip(axes[0], methods, strict=False):
        counts = hists[method]
        xs = sorted(counts)
        total = sum(counts.values())
        ax.bar(xs, [counts[x] / total for x in xs])
        ax.set_title(short_label(method, 28), fontsize=9)
        ax.set_xlabel("accepted draft tokens per step")
    axes[0][0].set_ylabel("share of steps")
    fig.suptitle(textwrap.fill(title, int(width * 15)), fontsize=8)  # one method's panel is narrower than the title
    fig.savefig(path, dpi=110)
    plt.close(fig)
