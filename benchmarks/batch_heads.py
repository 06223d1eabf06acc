"""Batches of chat questions with and without a trained head: does the head pay beside other rows?

A head's forwards run row by row (each row reads its own text), while the target's forward is shared by the
batch's rows: what pays for one row may not beside seven others. This decodes the first `--rows` of the benchmark's
chat questions as one batch under `plain`, `auto` without the head and `auto` with it (`--draft-head`), with fresh
Decoders every round (the trie would otherwise recall the answers of the round before), interleaved, `--rounds`
times, and reports the fastest round of each: tokens per second over all rows and tokens per forward.

    python benchmarks/batch_heads.py --rows 2,4,8 --dtype bf16 --threads 1 \
        --out benchmarks/results/batch-heads-bf16-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import forerun

QUESTIONS = Path(__file__).with_name("chat_questions.jsonl")


def decoders(model, tokenizer, head: str) -> dict[str, forerun.Decoder]:
    """Fresh Decoders (nothing learned yet) for the three ways a batch is decoded."""
    return {
        "plain": forerun.Decoder(model, tokenizer, method="plain"),
        "auto": forerun.Decoder(model, tokenizer, method="auto"),
        "auto with the head": forerun.Decoder(model, tokenizer, method="auto", draft_head=head),
    }


def run(model, tokenizer, questions: list[str], head: str, tokens: int, rounds: int) -> dict[str, dict]:
    """The fastest of `rounds` interleaved rounds of each way, on one batch of `questions`."""
    for decoder in decoders(model, tokenizer, head).values():  # curves and head costs measured before timing
        decoder.generate(questions, tokens, chat=True)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, decoder in decoders(model, tokenizer, head).items():
            started = time.perf_counter()
            results = decoder.generate(questions, tokens, chat=True)
            seconds = time.perf_counter() - started
            if name not in best or seconds < best[name]["seconds"]:
                written = sum(result.stats.new_tokens for result in results)
                best[name] = {
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(written / seconds, 1),
                    "tokens_per_forward": round(written / sum(r.stats.forwards for r in results), 2),
                    "texts": [result.text for result in results],
                }
    plain = best["plain"]["texts"]
    for entry in best.values():
        entry["same_as_plain"] = sum(a == b for a, b in zip(entry.pop("texts"), plain, strict=True))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-head", default="smollm2-135m")
    parser.add_argument("--rows", default="2,4,8")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model(args.model, dtype=args.dtype)
    questions = [json.loads(line)["prompt"] for line in QUESTIONS.open()]
    table = {}
    for rows in (int(r) for r in args.rows.split(",")):
        table[rows] = run(model, tokenizer, questions[:rows], args.draft_head, args.max_new_tokens, args.rounds)
        cells = " | ".join(f"{name} {e['tokens_per_s']} tok/s ({e['tokens_per_forward']} t/f)"
                           for name, e in table[rows].items())  # fmt: skip
        print(f"{rows} rows: {cells}", flush=True)
    record = {
        "model": args.model, "head": args.draft_head, "dtype": args.dtype, "threads": args.threads,
        "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "rows": table,
    }  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
