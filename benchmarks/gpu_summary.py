"""Tables of a GPU check's records (`benchmarks/gpu_check.py`) as Markdown.

Usage:
    .venv/bin/python benchmarks/gpu_summary.py benchmarks/results/gpu-h200-run4.jsonl
    .venv/bin/python benchmarks/gpu_summary.py benchmarks/results/gpu-h200-run4.jsonl --plot docs/gpu-h200.png
    (with several files: the curve from every file, the bench from the last; a bench-only run plots the curves its
    decoders measured)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def ratio(values: list[float]) -> str:
    """A geometric mean as a table cell ("-" where nothing was compared)."""
    return f"{geometric_mean(values):.2f}x" if values else "-"


def batch_table(records: list[dict]) -> str:
    """Per batch size and method: tokens/s and ratios against transformers' batched generate (eager; static cache
    compiled where the run had it), tokens per forward, outputs equal to generate's rows."""
    lines = [
        "| rows | method | tok/s | vs batched generate (eager) | vs batched generate (static cache, compiled) | "
        "forwards per row | same as generate |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        if r["section"] == "batch" and "method" in r:
            static = f"{r['vs_static_generate']:.2f}x" if "vs_static_generate" in r else "-"
            lines.append(
                f"| {r['rows']} | {r['method']} | {r['tokens'] / r['seconds']:.0f} | {r['vs_generate']:.2f}x | "
                f"{static} | {r['forwards']:.1f} | {r['same_as_generate']} |"
            )
    return "\n".join(lines)


def bench_table(records: list[dict]) -> str:
    """Per method: tokens/s (all prompts), geometric-mean speed ratios against eager and compiled generate,
    tokens per forward, host ms per step, outputs identical / ties / other."""
    runs = [r for r in records if r["section"] == "bench" and "method" in r]
    by_prompt: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by_prompt[f"{r['dataset']}/{r['prompt']}"][r["method"]] = r
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lines = [
        "| method | tok/s | vs generate (eager) | vs generate (static cache, compiled) | vs forerun plain | "
        "tokens/forward | host ms/step | identical / tie / other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method in methods:
        rows = [p[method] for p in by_prompt.values() if method in p]
        rate = lambda r: r["new_tokens"] / r["seconds"]  # noqa: E731
        ratios = " | ".join(
            ratio([rate(p[method]) / rate(p[reference]) for p in by_prompt.values() if method in p and reference in p])
            for reference in ("generate", "generate_static_compiled", "plain")
        )
        tokens = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        tpf = [r["tokens_per_forward"] for r in rows if "tokens_per_forward" in r]
        host = [r["host_ms_per_step"] for r in rows if "host_ms_per_step" in r]
        same = sum(r["identical"] for r in rows)
        ties = sum(bool(r["tie"]) for r in rows)
        other = len(rows) - same - ties
        lines.append(
            f"| {method} | {tokens:.0f} | {ratios} | {sum(tpf) / len(tpf):.2f} | {sum(host) / len(host):.2f} | "
            f"{same} / {ties} / {other} |"
            if tpf
            else f"| {method} | {tokens:.0f} | {ratios} | - | - | {same} / {ties} / {other} |"
        )
    return "\n".join(lines)


def dataset_table(records: list[dict], reference: str = "generate_static_compiled") -> str:
    runs = [r for r in records if r["section"] == "bench" and "method" in r]
    by_prompt: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by_prompt[(r["dataset"], r["prompt"])][r["method"]] = r
    methods = [m for m in dict.fromkeys(r["method"] for r in runs) if m != reference]
    datasets = list(dict.fromkeys(d for d, _ in by_prompt))
    lines = [f"| dataset | {' | '.join(methods)} |", "|---|" + "---:|" * len(methods)]
    for dataset in datasets:
        cells = []
        for method in methods:
            ratios = [
                (p[method]["new_tokens"] / p[method]["seconds"])
                / (p[reference]["new_tokens"] / p[reference]["seconds"])
                for (d, _), p in by_prompt.items()
                if d == dataset and method in p
            ]
            cells.append(f"{geometric_mean(ratios):.2f}x")
        lines.append(f"| {dataset} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path, card: str) -> None:
    """Two panels: seconds per step by bucket (captured, eager on slots, eager growing cache), and each method's
    median tokens per second over the prompts (one slow prompt does not colour the bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = [r for r in records if r["section"] == "curve" and "bucket" in r]
    runs = [r for r in records if r["section"] == "bench" and "method" in r]
    compiled = next((r["curve_ms"] for r in records if "(compiled)" in r.get("note", "") and r.get("curve_ms")), None)
    captured = next((r["curve_ms"] for r in records if "made" in r.get("note", "") and "(compiled)" not in r["note"]
                     and r.get("curve_ms")), None)  # fmt: skip
    if not curve and captured:  # a bench-only run: its decoders' measured curves
        curve = [{"bucket": int(b), "captured_ms": ms} for b, ms in captured.items()]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    rates = [statistics.median(r["new_tokens"] / r["seconds"] for r in runs if r["method"] == m) for m in methods]
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 4.8))
    buckets = [r["bucket"] for r in curve]
    for key, label in (
        ("captured_ms", "captured graph (forerun on a GPU)"),
        ("static_eager_ms", "same step, eager"),
        ("growing_eager_ms", "growing cache, eager (the CPU's base)"),
    ):
        if all(key in r for r in curve):
            left.plot(buckets, [r[key] for r in curve], marker="o", label=label)
    if compiled:
        left.plot(buckets, [compiled[str(b)] for b in buckets], marker="o", label="compiled, then captured")
    left.set(xscale="log", xlabel="tree nodes fed (bucket)", ylabel="ms per step", ylim=(0, None))
    left.set_xticks(buckets, [str(b) for b in buckets])
    left.set_title("SmolLM2-135M bf16: one verification step")
    left.legend()
    colours = ["#999999" if m in ("generate", "hf_prompt_lookup") else "#4c72b0" if "generate" in m
               else "#c44e52" if "(compiled)" in m else "#dd8452" for m in methods]  # fmt: skip
    right.barh(methods[::-1], rates[::-1], color=colours[::-1])
    for y, rate in enumerate(rates[::-1]):
        right.text(rate, y, f" {rate:.0f}", va="center")
    prompts = len({(r["dataset"], r["prompt"]) for r in runs})
    right.set_xlim(0, max(rates) * 1.12)
    right.set(xlabel=f"tokens per second, median of {prompts} prompts (128 new tokens, greedy)")
    right.set_title("grey, blue: transformers; orange: forerun; red: compiled buckets")
    figure.suptitle(f"{card}, bf16, one row")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    if "--plot" in sys.argv:
        at = sys.argv.index("--plot")
        names, target = sys.argv[1:at], Path(sys.argv[at + 1])
        loaded = [[json.loads(line) for line in Path(n).read_text().splitlines() if line.strip()] for n in names]
        records = [r for file in loaded for r in file if r["section"] != "bench"] + [
            r for r in loaded[-1] if r["section"] == "bench"
        ]
        card = next((r.get("device") or r.get("card") for r in records if r["section"] == "env"), "GPU")
        plot(records, target, card)
        return
    for name in sys.argv[1:]:
        records = [json.loads(line) for line in Path(name).read_text().splitlines() if line.strip()]
        print(f"## {name}\n")
        curve = [r for r in records if r["section"] == "curve" and "bucket" in r]
        if curve:
            print("| bucket | captured ms | same step eager ms | growing cache eager ms | captured vs 1 node |")
            print("|---:|---:|---:|---:|---:|")
            for r in curve:
                print(f"| {r['bucket']} | {r['captured_ms']:.2f} | {r['static_eager_ms']:.2f} | "
                      f"{r['growing_eager_ms']:.2f} | {r['captured_relative']:.2f}x |")  # fmt: skip
            print()
        if any(r["section"] == "bench" and "method" in r for r in records):
            print(bench_table(records), "\n")
            compiled = any(r.get("method") == "generate_static_compiled" for r in records)
            reference = "generate_static_compiled" if compiled else "plain"
            against = "compiled static-cache generate" if compiled else "forerun plain (captured)"
            print(f"Against {against}, geometric mean per dataset:\n")
            print(dataset_table(records, reference), "\n")
        if any(r["section"] == "batch" and "method" in r for r in records):
            print(batch_table(records), "\n")


if __name__ == "__main__":
    main()
