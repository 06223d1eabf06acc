"""How a trained head fares in a fresh decoder's first request: `eagle3` and `auto` with the shipped SmolLM2-135M
head, one new `Decoder` per chat question (each a first request: the cost model has learned nothing yet), with the
single-row switch's first comparison after `--first-probe` drafted steps (forerun's default: 24).

    .venv/bin/python benchmarks/first_probe.py --dtype bf16 --first-probe 6,24

Prints tokens per forward and tok/s per method and probe length, with plain forerun for scale (1 thread).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import forerun

QUESTIONS = Path(__file__).with_name("chat_questions.jsonl")


def run(model, tokenizer, method: str, probe: int, questions: list[str], tokens: int) -> tuple[float, float]:
    """Tokens per forward and tokens per second over `questions`, a fresh decoder each."""
    seconds = new = forwards = 0
    for question in questions:
        head = "smollm2-135m" if method != "plain" else None
        decoder = forerun.Decoder(model, tokenizer, method, draft_head=head)
        if probe and decoder.budget.switch is not None:
            decoder.budget.switch.probing = probe
        stats = decoder.generate(question, tokens, chat=True).stats
        seconds, new, forwards = seconds + stats.total_seconds, new + stats.new_tokens, forwards + stats.forwards
    return new / forwards, new / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--first-probe", default="6,24", help="comma-separated probe lengths")
    parser.add_argument("--questions", default="6:10", help="a slice of benchmarks/chat_questions.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start, stop = (int(part) for part in args.questions.split(":"))
    questions = [json.loads(line)["prompt"] for line in QUESTIONS.open()][start:stop]
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype)
    runs = [("plain", 0)] + [(m, int(p)) for m in ("eagle3", "auto") for p in args.first_probe.split(",")]
    for method, probe in runs:
        per_forward, rate = run(model, tokenizer, method, probe, questions, args.max_new_tokens)
        print(f"{args.dtype} {method:7s} first probe {probe:3d}: {per_forward:.2f} tokens/forward, {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
