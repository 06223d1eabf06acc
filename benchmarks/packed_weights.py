"""The forward-latency curve with transformers' own linear layers and with the matrices laid out for oneDNN
(`forerun.base.packed`), per dtype, measured in turns in one process (one round of every size for each model, the
fastest of all rounds kept), and one plot.

    python benchmarks/packed_weights.py --dtype fp32,bf16 --threads 1 --rounds 5 \
        --out benchmarks/results/packed-curve-epyc-avx512.json --plot docs/latency-cpu-packed.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from forerun.latency import measure_curve
from forerun.measured import machine_label
from forerun.models import load_model

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)


def measure(dtype: str, sizes: tuple[int, ...], rounds: int, context: int) -> dict[str, list[float]]:
    """{'own': ms per size, 'packed': ms per size}: the fastest of `rounds` rounds, the two models in turn."""
    models = {name: load_model("smollm2-135m", dtype=dtype, pack=name == "packed")[0] for name in ("own", "packed")}
    best = {name: [float("inf")] * len(sizes) for name in models}
    for round_ in range(rounds):
        for name, model in models.items():
            curve = measure_curve(model, sizes, context, repeats=1, seed=round_)
            best[name] = [min(a, b * 1000) for a, b in zip(best[name], curve.seconds[-len(sizes) :], strict=True)]
        print(f"{dtype} round {round_ + 1}/{rounds}", flush=True)
    return best


def plot(results: dict[str, dict[str, list[float]]], sizes: tuple[int, ...], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (dtype, curves) in zip(axes[0], results.items(), strict=True):
        own_one = curves["own"][0]
        for name, label in (("own", "transformers' layers"), ("packed", "laid out for oneDNN")):
            ax.plot(sizes, [ms / own_one for ms in curves[name]], marker="o", label=label)
        ax.axhline(1.0, color="grey", linestyle=":", label="1 token, transformers' layers")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens fed in one forward (256 cached)")
        ax.set_ylabel("latency / 1-token forward with transformers' layers")
        ax.set_title(f"{dtype}: 1 token {own_one:.1f} ms -> {curves['packed'][0]:.1f} ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {dtype: measure(dtype, SIZES, args.rounds, args.context) for dtype in args.dtype.split(",")}
    cpu = machine_label(torch.device("cpu"))
    settings = {"model": "smollm2-135m", "cpu": cpu, "threads": args.threads, "context": args.context,
                "rounds": args.rounds, "torch": torch.__version__}  # fmt: skip
    args.out.write_text(json.dumps({"settings": settings, "sizes": SIZES, "ms": results}, indent=1))
    for dtype, curves in results.items():
        for name, values in curves.items():
            print(dtype, f"{name:7}", " ".join(f"{n}:{ms:.1f}" for n, ms in zip(SIZES, values, strict=True)))
    if args.plot:
        threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
        plot(results, SIZES, f"SmolLM2-135M forward, {cpu}, {threads}", args.plot)


if __name__ == "__main__":
    main()
