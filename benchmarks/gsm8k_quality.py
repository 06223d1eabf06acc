"""What lower-precision weights cost in answers: GSM8K accuracy of the same model in fp32, bf16, int8 and int4 weights.

forerun writes the answers of the model it is given (token for token in fp32, up to numerical ties otherwise), so
any loss here is the precision's, not forerun's. Each configuration answers the first N GSM8K test problems
greedily with `auto`; an answer is right when the last number it writes equals the reference.

    python benchmarks/gsm8k_quality.py --model qwen2.5-coder-0.5b --n 50 --threads 1 --configs bf16,int8,int4 \
        --out benchmarks/results/gsm8k-quality-qwen-epyc.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import package_file, read_jsonl

INSTRUCTION = "\n\nSolve it step by step, then end with: The answer is <number>."
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in `text`, without thousands separators or a trailing '.0' ('1,200.00' -> '1200')."""
    found = NUMBER.findall(text or "")
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[: -len(value.split(".")[1]) - 1] if "." in value and set(value.split(".")[1]) == {"0"} else value


def run(name: str, config: str, problems: list[dict], max_new_tokens: int) -> dict:
    dtype = torch.float32 if config == "fp32" else torch.bfloat16
    model, tokenizer = forerun.load_model(name, dtype=dtype, quantize=config if config in ("int4", "int8") else None)
    decoder = forerun.Decoder(model, tokenizer, "auto")
    right, tokens, started, answers = 0, 0, time.perf_counter(), []
    for problem in problems:
        result = decoder.generate(problem["question"] + INSTRUCTION, max_new_tokens, chat=True)
        got = last_number(result.text)
        right += got == problem["answer"]
        tokens += result.stats.new_tokens
        answers.append({"id": problem["task_id"], "answer": problem["answer"], "got": got})
    seconds = time.perf_counter() - started
    return {
        "model": name,
        "config": config,
        "problems": len(problems),
        "right": right,
        "accuracy": right / len(problems),
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default="fp32,bf16,int4")
    parser.add_argument("--out", default="gsm8k-quality.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problems = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))[: args.n]
    results = []
    for config in args.configs.split(","):
        results.append(run(args.model, config, problems, args.max_new_tokens))
        row = results[-1]
        print(f"{config}: {row['right']}/{row['problems']} right, {row['tokens_per_second']:.1f} tokens/s", flush=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
