"""Weights laid out for oneDNN or not, end to end: plain `generate` and forerun's methods on transformers' own layers
and on the laid-out ones (`load_model(pack=...)`), interleaved per prompt in one process.

What decides `load_model`'s default on a CPU (`forerun.base.packed.packable`): a user's baseline is plain generate on
transformers' own layers, so every figure is tokens per second and its ratio to that. Each method on the laid-out
model is checked against plain generate of the laid-out model, on transformers' layers against theirs (fp32:
identical; bf16: identical or first different at a tie). A fresh Decoder per configuration, each on its own curve.

    python benchmarks/pack_ab.py --dataset gsm8k,humaneval,mbpp,typehints --n 3 --methods auto --threads 1 \
        --out benchmarks/results/pack-ab-fp32-epyc-avx2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.exactness import first_divergence
from forerun.measured import machine_label

LAYOUTS = ("own", "laid out")


def timed(call, *args, **kwargs):
    started = time.perf_counter()
    out = call(*args, **kwargs)
    return time.perf_counter() - started, out


def run(datasets: list[str], n: int, methods: list[str], dtype: str, new_tokens: int) -> dict:
    """Per (layout, method or 'generate'): tokens, seconds and whether every output matched its layout's generate."""
    models = {name: forerun.load_model("smollm2-135m", dtype=dtype, pack=name == "laid out") for name in LAYOUTS}
    decoders = {(name, m): forerun.Decoder(*models[name], method=m) for name in LAYOUTS for m in methods}
    keys = [(name, m) for name in LAYOUTS for m in ("generate", *methods)]
    seconds, tokens = dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0)
    same = dict.fromkeys(keys, True)
    prompts = [p for dataset in datasets for p in load_dataset(dataset, n)]
    for index, prompt in enumerate(prompts):
        for name in LAYOUTS:
            model, tokenizer = models[name]
            ids = encode(tokenizer, prompt, torch.device("cpu"))
            greedy = {"max_new_tokens": new_tokens, "do_sample": False}
            spent, out = timed(model.generate, ids, **greedy, output_logits=True, return_dict_in_generate=True)
            expected = out.sequences[0, ids.shape[1] :].tolist()
            seconds[name, "generate"] += spent
            tokens[name, "generate"] += len(expected)
            logits = torch.cat(out.logits).float()
            for method in methods:
                spent, result = timed(decoders[name, method].generate, ids[0].tolist(), new_tokens)
                seconds[name, method] += spent
                tokens[name, method] += len(result.new_tokens)
                divergence = first_divergence(expected, result.new_tokens, logits, model.dtype)
                same[name, method] &= divergence is None or (dtype != "fp32" and divergence.is_tie)
        print(f"prompt {index + 1}/{len(prompts)}", flush=True)
    rates = {f"{name}: {m}": tokens[name, m] / seconds[name, m] for name, m in keys}
    return {"tokens_per_second": rates, "matched": {f"{name}: {m}": same[name, m] for name, m in keys}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=3, help="Prompts per dataset.")
    parser.add_argument("--methods", default="auto")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_label(torch.device("cpu"))
    found = run(args.dataset.split(","), args.n, args.methods.split(","), args.dtype, args.max_new_tokens)
    rates = found["tokens_per_second"]
    baseline = rates["own: generate"]
    print(f"{machine}, {args.dtype}, {args.threads} thread(s), {args.max_new_tokens} new tokens, {args.dataset}")
    print("| layout: method | tokens/s | vs generate on transformers' layers | output matched |")
    print("|---|---:|---:|:---:|")
    for key, rate in rates.items():
        print(f"| {key} | {rate:.1f} | {rate / baseline:.2f}x | {found['matched'][key]} |")
    if args.out:
        settings = {"machine": machine, "dtype": args.dtype, "threads": args.threads, "datasets": args.dataset,
                    "n": args.n, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__}  # fmt: skip
        args.out.write_text(json.dumps({"settings": settings, **found}, indent=1))


if __name__ == "__main__":
    main()
