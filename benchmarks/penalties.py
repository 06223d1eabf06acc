"""OpenAI's frequency and presence penalties end to end: what they cost drafting, against plain `generate` with the
same penalties (forerun's `OccurrencePenalty` as its `logits_processor`), interleaved per prompt in one process,
every greedy output checked against that generate's.

A penalty lowers the logits of tokens the answer already holds, so the text copies itself less, and the drafters
that guess by copying (prompt lookup, the trie) are accepted less: the table shows each method's speedup with and
without the penalties, each against plain generate of the same settings.

    python benchmarks/penalties.py --dataset gsm8k,humaneval,mbpp,typehints --n 3 --threads 1 \
        --frequency 0.5 --presence 0.5 --out benchmarks/results/penalties-fp32-epyc-avx2.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from compiled_cpu import report  # a sibling script (`python benchmarks/penalties.py` puts this folder first)
from transformers import LogitsProcessorList

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.exactness import first_divergence
from forerun.penalties import OccurrencePenalty


def run(datasets: list[str], n: int, methods: list[str], penalties: tuple[float, float], new_tokens: int) -> dict:
    """Per (setting, method): tokens, seconds, forwards, per-prompt speedups over generate of the same setting,
    and how outputs compared with it."""
    model, tokenizer = forerun.load_model("smollm2-135m", dtype="fp32")
    prompts = [encode(tokenizer, p, model.device) for name in datasets for p in load_dataset(name, n)]
    settings = {"none": {}, "penalised": {"frequency_penalty": penalties[0], "presence_penalty": penalties[1]}}
    # a Decoder per setting: a trie keeps the answers it saw, and the same prompt's other answer is no fair guess
    decoders = {(s, m): forerun.Decoder(model, tokenizer, m) for s in settings for m in methods}
    for decoder in decoders.values():
        decoder.generate(prompts[0], 8)  # the latency curve, timed once, outside every run
    out = {f"{setting}, {label}": {"tokens": 0, "seconds": 0.0, "forwards": 0, "speedups": [], "identical": 0,
                                    "ties": 0, "other": 0}
           for setting in settings for label in ["generate", *methods]}  # fmt: skip
    for ids in prompts:
        for setting, options in settings.items():
            extra = {}
            if options:
                processor = OccurrencePenalty(*penalties, prompt_length=ids.shape[1])
                extra["logits_processor"] = LogitsProcessorList([processor])
            started = time.perf_counter()
            reference = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True, **extra)  # fmt: skip
            seconds = time.perf_counter() - started
            tokens = reference.sequences[0, ids.shape[1] :].tolist()
            logits = [row[0] for row in reference.scores]  # the scores generate chose from
            add(out[f"{setting}, generate"], len(tokens), seconds, len(tokens), 1.0, None)
            for method in methods:
                decoder = decoders[setting, method]
                started = time.perf_counter()
                result = decoder.generate(ids, new_tokens, **options)
                took = time.perf_counter() - started
                first = first_divergence(tokens, result.new_tokens, logits, model.dtype)
                add(out[f"{setting}, {method}"], len(result.new_tokens), took, result.stats.forwards, seconds / took,
                    first)  # fmt: skip
        print(" ".join(f"[{k}] {v['tokens'] / v['seconds']:.1f}" for k, v in out.items()), flush=True)
    return out


def add(row: dict, tokens: int, seconds: float, forwards: int, speedup: float, first) -> None:
    """One prompt's run into its row (`first`: its first difference from generate, None where identical)."""
    row["tokens"] += tokens
    row["seconds"] += seconds
    row["forwards"] += forwards
    row["speedups"].append(speedup)
    row["identical" if first is None else "ties" if first.is_tie else "other"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--methods", default="prompt_lookup,auto")
    parser.add_argument("--frequency", type=float, default=0.5)
    parser.add_argument("--presence", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    penalties = (args.frequency, args.presence)
    report(run(args.dataset.split(","), args.n, args.methods.split(","), penalties, args.new_tokens), args)


if __name__ == "__main__":
    main()
