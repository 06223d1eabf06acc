"""Two methods of one `forerun bench` run, prompt by prompt: how much faster the second is than the first.

In bf16 each method may leave generate's text at its own ties, so two methods can write different texts for the
same prompt (one stops after 38 tokens, the other goes on to 113): a ratio over all prompts mixes what the methods
cost with which text they wrote. This reads a run's results.json and gives, per dataset, the geometric mean of the
per-prompt ratio (second over first) over all prompts, over the prompts where both wrote as many tokens, and over
those where both wrote generate's very text.

Usage:
    .venv/bin/python benchmarks/paired.py bench-results/results.json prompt_lookup+trie+jacobi auto

Example output line:
    | gsm8k | 0.979 (20) | 0.979 (20) | 0.982 (6) |
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def geomean(ratios: list[float]) -> str:
    """'1.034 (20)': the geometric mean and how many prompts it is over; '-' for none."""
    if not ratios:
        return "-"
    return f"{math.exp(sum(math.log(r) for r in ratios) / len(ratios)):.3f} ({len(ratios)})"


def paired_rows(records: list[dict], first: str, second: str) -> list[str]:
    """One markdown row per dataset: all prompts, equal lengths, both identical to generate."""
    runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for record in records:
        runs[(record["dataset"], record["prompt_id"])][record["method"]] = record
    by_dataset: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"all": [], "length": [], "identical": []})
    for (dataset, _), methods in runs.items():
        if first not in methods or second not in methods:
            continue
        a, b = methods[first], methods[second]
        ratio = b["speedup"] / a["speedup"]
        kept = by_dataset[dataset]
        kept["all"].append(ratio)
        if a["new_tokens"] == b["new_tokens"]:
            kept["length"].append(ratio)
        if a["identical"] is True and b["identical"] is True:
            kept["identical"].append(ratio)
    return [
        f"| {dataset} | {geomean(kept['all'])} | {geomean(kept['length'])} | {geomean(kept['identical'])} |"
        for dataset, kept in by_dataset.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="A `forerun bench` run's results.json.")
    parser.add_argument("first", help="The method compared against (a label of the run).")
    parser.add_argument("second", help="The method compared.")
    args = parser.parse_args()
    records = json.loads(args.results.read_text())["records"]
    labels = {record["method"] for record in records}
    for label in (args.first, args.second):
        if label not in labels:
            parser.error(f"method {label!r} is not in {args.results}; it holds {', '.join(sorted(labels))}")
    print(f"{args.second} over {args.first}, geometric mean of per-prompt ratios (prompts)\n")
    print("| dataset | all prompts | same length | both generate's text |\n|---|---:|---:|---:|")
    print("\n".join(paired_rows(records, args.first, args.second)))


if __name__ == "__main__":
    main()
