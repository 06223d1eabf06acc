"""Scoring multiple-choice answers as evaluation harnesses do: each answer after the same few-shot context.

lm-evaluation-harness scores a multiple-choice question by sending the context followed by each answer, every
one scored whole (`echo` with `logprobs`). Here each GSM8K question, after `--shots` solved GSM8K examples, gets
four answers (its reference answer and three others), each scored by `Decoder.score` with the prefix cache on
(every answer after the first reads the context's keys, values and entries from it) and off (each scored whole),
interleaved per question. Reported: milliseconds per answer each way, the speedup, the context and answer lengths,
and the largest difference between the two ways' log-probabilities.

    .venv/bin/python benchmarks/scoring.py --n 10 --threads 1 --out benchmarks/results/scoring-fp32-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import package_file, read_jsonl


def questions(n: int, shots: int) -> list[tuple[str, list[str]]]:
    """(context, four answers) for the `n` GSM8K questions after the first `shots`, which are the examples."""
    rows = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))
    examples = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:shots])
    out = []
    for index, row in enumerate(rows[shots : shots + n]):
        others = [rows[(index + k * 7) % len(rows)]["answer"] for k in (1, 2, 3)]
        answers = [f" {row['answer']}", *(f" {a}" for a in others)]
        out.append((f"{examples}Question: {row['question']}\nAnswer:", answers))
    return out


def timed(decoder: forerun.Decoder, texts: list[list[int]]) -> tuple[float, list]:
    started = time.perf_counter()
    scored = [decoder.score(ids, top=1) for ids in texts]
    return time.perf_counter() - started, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model(args.model)
    cached = forerun.Decoder(model, tokenizer, "plain")
    whole = forerun.Decoder(model, tokenizer, "plain", prefix_cache=0)
    rows, worst = [], 0.0
    for context, answers in questions(args.n, args.shots):
        head = tokenizer(context).input_ids
        texts = [head + tokenizer(answer).input_ids for answer in answers]
        cached.prefixes.clear()  # each question's context is new to the cache, as in a harness
        seconds = {}
        for name, decoder in (("cached", cached), ("whole", whole)):
            seconds[name], scored = timed(decoder, texts)
            if name == "cached":
                kept = scored
            else:
                for a, b in zip(kept, scored, strict=True):
                    worst = max(worst, max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:], strict=True)))
        rows.append({"context": len(head), "answers": [len(t) - len(head) for t in texts], **seconds})
    per = {name: 1000 * sum(r[name] for r in rows) / (4 * len(rows)) for name in ("cached", "whole")}
    report = {
        "ms_per_answer": {name: round(value, 1) for name, value in per.items()},
        "speedup": round(per["whole"] / per["cached"], 2),
        "speedup_geomean": round(statistics.geometric_mean(r["whole"] / r["cached"] for r in rows), 2),
        "context_tokens": round(statistics.mean(r["context"] for r in rows)),
        "answer_tokens": round(statistics.mean(a for r in rows for a in r["answers"]), 1),
        "max_abs_logprob_difference": worst,
        "questions": len(rows),
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**report, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
