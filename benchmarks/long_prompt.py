"""Long prompts: speed of each method against plain `model.generate` on documents of ~1000 and ~2000 tokens.

The prompt is HumanEval prompts one after another ("summarise what these functions do"), as in
`server_stall.py`; each method answers it `--rounds` times, interleaved with plain generate, from a fresh Decoder
each round (so no answer is replayed from a trie that saw it). Reported: speedup of the summed times, forerun's
prefill seconds against generate's whole run, tokens per forward, and whether every answer equals generate's
(`--dtype bf16`: "tie" where the first difference sits on a numerical tie, `forerun.exactness`).

Usage:
    .venv/bin/python benchmarks/long_prompt.py --lengths 1000,2000 --methods plain,prompt_lookup,auto --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import forerun
from forerun.exactness import first_divergence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_stall import long_document  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,2000", help="About how many prompt tokens, comma-separated.")
    parser.add_argument("--methods", default="plain,prompt_lookup,auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype)
    methods = args.methods.split(",")
    print(f"{args.dtype}, {args.threads} torch thread(s), {args.max_new_tokens} new tokens, {args.rounds} rounds")
    print("| prompt tokens | method | speedup | prefill (s) | tokens/forward | identical |")
    print("|---:|---|---:|---:|---:|:---:|")
    for length in (int(n) for n in args.lengths.split(",")):
        messages = [{"role": "user", "content": long_document(tokenizer, length)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        spent = {m: 0.0 for m in ["generate", *methods]}
        prefill = {m: 0.0 for m in methods}
        per_forward = {m: 0.0 for m in methods}
        same = {m: "yes" for m in methods}
        for _ in range(args.rounds):
            began = time.perf_counter()
            reference = model.generate(
                ids, max_new_tokens=args.max_new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            spent["generate"] += time.perf_counter() - began
            expected = reference.sequences[0, ids.shape[1] :].tolist()
            for method in methods:
                decoder = forerun.Decoder(model, tokenizer, method, prefix_cache=0)
                began = time.perf_counter()
                result = decoder.generate(ids[0].tolist(), args.max_new_tokens)
                spent[method] += time.perf_counter() - began
                prefill[method] += result.stats.prefill_seconds / args.rounds
                per_forward[method] += result.stats.tokens_per_forward / args.rounds
                same[method] = worst(same[method], judged(expected, result.new_tokens, reference.logits, model.dtype))
        for method in methods:
            print(f"| {ids.shape[1]} | {method} | {spent['generate'] / spent[method]:.2f}x | {prefill[method]:.1f} | "
                  f"{per_forward[method]:.2f} | {same[method]} |", flush=True)  # fmt: skip


def judged(expected: list[int], tokens: list[int], logits, dtype: torch.dtype) -> str:
    """Whether `tokens` are `expected`: "yes", "tie" (the first difference at a numerical tie) or "NO"."""
    divergence = first_divergence(expected, tokens, logits, dtype)
    return "yes" if divergence is None else ("tie" if divergence.is_tie else "NO")


def worst(a: str, b: str) -> str:
    return max(a, b, key=("yes", "tie", "NO").index)


if __name__ == "__main__":
    main()
