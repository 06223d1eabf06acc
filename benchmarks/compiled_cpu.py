"""A CPU's bases end to end: `auto` on the growing cache (a CPU's default), on the static base eager, and on the
static base with compiled buckets (`Decoder(..., static_cache=True, compile_buckets=True)`), against plain
`generate`, interleaved per prompt in one process, every output checked against generate's.

What a Python user on a CPU gets from compiling: the compiling is timed apart (the Decoder's latency curve and
`warm_up` compile every bucket), then every run starts on a frozen heap (`gc.freeze`, as `forerun serve` does: compiling
leaves millions of objects). fp32 compiled products round otherwise than eager ones (logits within ~1e-4), so a
first difference there is judged as a tie or not (`forerun.exactness`), as low precision's are. Every base runs on
transformers' own linear layers (`load_model(pack=False)`): inductor cannot compile through weights laid out for
oneDNN, which `load_model` does by default on CPUs with AVX-512.

    python benchmarks/compiled_cpu.py --dataset gsm8k,humaneval,mbpp,typehints --n 3 --threads 1 \
        --out benchmarks/results/compiled-cpu-fp32-epyc-avx2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.report import geomean
from forerun.bench.runner import encode
from forerun.exactness import first_divergence
from forerun.measured import machine_label

BASES = {"growing cache": {}, "static": {"static_cache": True},
         "static, compiled": {"static_cache": True, "compile_buckets": True}}  # fmt: skip


def run(datasets: list[str], n: int, method: str, dtype: str, new_tokens: int) -> dict:
    """Per base ('generate' too): tokens, seconds, per-prompt speedups over generate, and how outputs compared."""
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=dtype, pack=False)
    prompts = [encode(tokenizer, p, model.device) for name in datasets for p in load_dataset(name, n)]
    made, longest = {}, max(ids.shape[1] for ids in prompts) + new_tokens
    for label, options in BASES.items():
        started = time.perf_counter()
        made[label] = forerun.Decoder(model, tokenizer, method, **options)
        made[label].warm_up(longest)  # every bucket before the first request, as a service would (none: growing)
        made[label].generate(prompts[0], 8)
        print(f"{label}: made in {time.perf_counter() - started:.1f} s", flush=True)
    gc.collect()
    gc.freeze()
    out = {label: {"tokens": 0, "seconds": 0.0, "speedups": [], "identical": 0, "ties": 0, "other": 0}
           for label in ["generate", *BASES]}  # fmt: skip
    for ids in prompts:
        started = time.perf_counter()
        reference = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)  # fmt: skip
        seconds = time.perf_counter() - started
        tokens, logits = reference.sequences[0, ids.shape[1] :].tolist(), [row[0] for row in reference.logits]
        out["generate"]["tokens"] += len(tokens)
        out["generate"]["seconds"] += seconds
        for label, decoder in made.items():
            started = time.perf_counter()
            result = decoder.generate(ids, new_tokens)
            took = time.perf_counter() - started
            first = first_divergence(tokens, result.new_tokens, logits, model.dtype)
            row = out[label]
            row["tokens"] += len(result.new_tokens)
            row["seconds"] += took
            row["speedups"].append(seconds / took)
            row["identical" if first is None else "ties" if first.is_tie else "other"] += 1
        print(" ".join(f"{k} {v['tokens'] / v['seconds']:.1f}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report(run(args.dataset.split(","), args.n, args.method, args.dtype, args.new_tokens), args)


def report(out: dict, args: argparse.Namespace) -> None:
    """Each row's tokens a second, geometric mean speedup over generate (and tokens per forward where it counts
    forwards), printed, and written with the command's settings and machine to `args.out` where given."""
    for label, row in out.items():
        speedups = row.pop("speedups", [])
        row["tok_s"] = round(row["tokens"] / row["seconds"], 2)
        if row.get("forwards"):
            row["tokens_per_forward"] = round(row["tokens"] / row["forwards"], 2)
        if speedups:
            row["geomean_vs_generate"] = round(geomean(speedups), 3)
        print(label, json.dumps(row))
    if args.out:
        machine = machine_label(torch.device("cpu"))
        settings = vars(args) | {"out": str(args.out), "machine": machine, "torch": torch.__version__}
        args.out.write_text(json.dumps({"settings": settings, "results": out}, indent=1))


if __name__ == "__main__":
    main()
