"""How long `forerun.load_model` takes on a GGUF file: converted by transformers (a fresh cache folder) against read
from the folder that conversion kept (`forerun.converted`), each in a fresh process, alternating, for fp32, bf16
and int4 (the file's own 4-bit codes). One JSON line per load, then a table of medians.

    python benchmarks/load_time.py --rounds 3 --threads 1 --out benchmarks/results/load-time-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ONE_LOAD = """
import json, sys, time
import torch
torch.set_num_threads({threads})
import forerun
started = time.perf_counter()
forerun.load_model({model!r}, dtype={dtype!r}, quantize={quantize!r}, cache_dir={cache!r})
print(json.dumps({{"seconds": time.perf_counter() - started}}))
"""
CONFIGS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int4": ("bf16", "int4")}


def one_load(model: str, config: str, cache: str, threads: int) -> float:
    """Seconds one `load_model` call took in a fresh process (imports not counted)."""
    dtype, quantize = CONFIGS[config]
    code = ONE_LOAD.format(threads=threads, model=model, dtype=dtype, quantize=quantize, cache=cache)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", default="fp32,bf16,int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the records (JSON lines) here")
    args = parser.parse_args()
    import torch

    from forerun.measured import machine_label

    machine = machine_label(torch.device("cpu"))
    records = []
    for round_ in range(args.rounds):
        for config in args.configs.split(","):
            with tempfile.TemporaryDirectory() as cache:  # converted, then read from what it kept
                for kind in ("converted", "kept"):
                    seconds = one_load(args.model, config, cache, args.threads)
                    record = {"round": round_, "config": config, "load": kind, "seconds": round(seconds, 3),
                              "threads": args.threads, "machine": machine}  # fmt: skip
                    print(json.dumps(record), flush=True)
                    records.append(record)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"\n{args.model}, {machine}, {args.threads} thread(s), median of {args.rounds} (s)")
    print("| load | " + " | ".join(args.configs.split(",")) + " |")
    print("|---|" + "---:|" * len(args.configs.split(",")))
    for kind in ("converted", "kept"):
        medians = [statistics.median(r["seconds"] for r in records if r["config"] == c and r["load"] == kind)
                   for c in args.configs.split(",")]  # fmt: skip
        print(f"| {kind} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
