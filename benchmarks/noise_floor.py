"""How far plain `model.generate` departs from itself in low precision: batch of two (left-padded) vs batch of one.

For each prompt: greedy generate alone (with its logits), then in a left-padded batch beside the next prompt; where
the two first differ, the margin of batch-one's logits between its token and batch-two's, in units in the last
place (forerun.exactness). This is the noise floor forerun's tie contract is judged against.

Usage:
    .venv/bin/python benchmarks/noise_floor.py --dtype bf16 --n 20 --skip 10 --threads 1
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import Run, encode
from forerun.runspec import DTYPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--datasets", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=20, help="Prompts per dataset.")
    parser.add_argument("--skip", type=int, default=10, help="Skip the first prompts (those the benchmark timed).")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=DTYPES[args.dtype])
    prompts = [p for name in args.datasets.split(",") for p in load_dataset(name, args.skip + args.n)[args.skip :]]
    run = Run(model, args.max_new_tokens, None, 0)
    ids = [encode(tokenizer, p, model.device) for p in prompts]
    records = []
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
        reference, _ = run.hf(prompt_ids)
        records.append(run.noise_floor(prompt_ids, ids[(i + 1) % len(ids)], prompt, reference))
    ulps = [r.tie_ulps for r in records if r.tie_ulps is not None]
    summary = {
        "dtype": args.dtype,
        "prompts": len(records),
        "identical": sum(bool(r.identical) for r in records),
        "max_ulps": max(ulps, default=None),
        "ulps_histogram": dict(sorted(Counter(ulps).items())),
        "over_2_ulps": sum(u > 2 for u in ulps),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
