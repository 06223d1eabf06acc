"""What a reproducible batch saves by pausing proposals the cost model feeds none of (`IdleProposals`).

Where choices must be reproducible (bf16, 4- and 8-bit weights: the defaults there) a batch may not steer by
timings, so before the back-off its rows proposed every step, however rarely the cost model fed a candidate. Each
round decodes the same prompts (chat-templated GSM8K, HumanEval, MBPP, typehints) as one batch with fresh decoders
(a trie that had seen the answers would flatter the next run), interleaved: `plain`, `auto`, and `auto` with the
back-off held off (`auto-always`: its rows propose every step, as before). Reports wall time, aggregate tokens per
second, tokens per row per forward, and whether each method's texts equal `plain`'s.

Usage:
    .venv/bin/python benchmarks/idle_proposals.py --weights bf16 --rows 8 --threads 2 --rounds 3
    .venv/bin/python benchmarks/idle_proposals.py --weights int4 --rows 16 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from batch_host import DATASETS, chat_ids, proposing_every_step

import forerun
from forerun.measured import machine_label
from forerun.models import load_model

METHODS = ("plain", "auto", "auto-always")


def prompts(tokenizer, rows: int) -> list[list[int]]:
    """`rows` chat-templated prompts, the datasets in turn."""
    return chat_ids(tokenizer, -(-rows // len(DATASETS)))[:rows]


def run(model, tokenizer, method: str, ids: list[list[int]], new_tokens: int) -> dict:
    """One batch of `ids` decoded by a fresh decoder of `method`."""
    decoder = forerun.Decoder(model, tokenizer, method.removesuffix("-always"))
    with proposing_every_step(method.endswith("-always")):
        started = time.perf_counter()
        results = decoder.generate(ids, new_tokens, eos_token_id=[])
        wall = time.perf_counter() - started
    tokens = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.forwards for r in results)
    return {"method": method, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1),
            "tokens_per_forward": round(tokens / max(forwards, 1), 2),
            "texts": [r.new_tokens for r in results]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", choices=("bf16", "int4", "int8"), default="bf16")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kind = {"dtype": "bf16"} if args.weights == "bf16" else {"quantize": args.weights}
    model, tokenizer = load_model(args.model, **kind)
    ids = prompts(tokenizer, args.rows)
    run(model, tokenizer, "auto", ids[:2], 8)  # the latency curve measured (or read) and the kernels warm
    records = []
    for round_ in range(args.rounds):
        turn = round_ % len(METHODS)  # each method first in one round of three
        order = METHODS[turn:] + METHODS[:turn]
        for method in order:
            record = run(model, tokenizer, method, ids, args.new_tokens) | {"round": round_}
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "texts"}), flush=True)
    plain = next(r["texts"] for r in records if r["method"] == "plain")
    summary = {"machine": machine_label(torch.device("cpu")), "threads": args.threads, "weights": args.weights,
               "rows": args.rows, "new_tokens": args.new_tokens}  # fmt: skip
    for method in METHODS:
        mine = [r for r in records if r["method"] == method]
        walls = sorted(r["wall_s"] for r in mine)
        same = sum(a == b for a, b in zip(mine[0]["texts"], plain, strict=True))
        summary[method] = {"wall_s": walls, "same_as_plain": same, "tokens_per_forward": mine[0]["tokens_per_forward"]}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": [
            {k: v for k, v in r.items() if k != "texts"} for r in records]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
