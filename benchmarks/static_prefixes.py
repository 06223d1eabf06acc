"""Conversations on the static base with and without the prefix cache: what a turn's prefill reads again.

On the static base (a GPU's: slots, bucket graphs) a prompt is read in chunks of the largest bucket; a
conversation's next turn begins with the whole previous turn. With the prefix cache the stored head is copied into
the row's place (`forerun.base.place_prefixes`) and only the rest is fed. This runs the `multiturn` dataset
(4-turn chats over GSM8K, each turn after the answers so far) turn by turn through two Decoders on the static
base, `prefix_cache=0` and the default, interleaved, and reports per turn: prompt tokens, tokens taken from the
cache, tokens read (fed through the buckets, 64 a forward), the prefill's seconds, the whole turn's seconds, and
whether both wrote the same text (fp32: must be yes). On a CPU the buckets run eagerly; on a card they are replays
of captured graphs.

Usage:
    .venv/bin/python benchmarks/static_prefixes.py --turns 8 --new-tokens 64 --threads 2 \
        --out benchmarks/results/static-prefixes-epyc.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.models import load_model


def turns(decoders: dict[str, forerun.Decoder], tokenizer, count: int, new_tokens: int) -> list[dict]:
    """Each turn through every decoder in turn; a conversation's history holds the first decoder's answers."""
    histories: dict[str, list[dict]] = {}
    records = []
    for prompt in load_dataset("multiturn", count):
        device = next(iter(decoders.values())).model.device
        ids = encode(tokenizer, prompt, device, histories.get(prompt.conversation or "", []))
        texts = {}
        for label, decoder in decoders.items():
            result = decoder.generate(ids, new_tokens)
            stats, texts[label] = result.stats, result.new_tokens
            records.append({
                "turn": prompt.id, "decoder": label, "prompt_tokens": ids.shape[1],
                "cached": stats.cached_prompt_tokens, "read": ids.shape[1] - stats.cached_prompt_tokens,
                "prefill_ms": round(1e3 * stats.prefill_seconds, 1), "turn_s": round(stats.total_seconds, 3),
                "new_tokens": len(result.new_tokens),
            })  # fmt: skip
        first = next(iter(texts.values()))
        for record in records[-len(decoders) :]:
            record["same_text"] = texts[record["decoder"]] == first
        answer = tokenizer.decode(first, skip_special_tokens=True)
        history = histories.get(prompt.conversation or "", [])
        histories[prompt.conversation or ""] = [*history, *prompt.messages, {"role": "assistant", "content": answer}]
        print(*(json.dumps(record) for record in records[-len(decoders) :]), sep="\n", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--turns", type=int, default=8, help="4 turns a conversation")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", help="on a card: bf16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    decoders = {
        label: forerun.Decoder(model, tokenizer, args.method, static_cache=True, prefix_cache=tokens)
        for label, tokens in (("no prefix cache", 0), ("prefix cache", 8192))
    }
    records = turns(decoders, tokenizer, args.turns, args.new_tokens)
    summary = {}
    for label in decoders:
        mine = [r for r in records if r["decoder"] == label]
        summary[label] = {
            "prefill_s": round(sum(r["prefill_ms"] for r in mine) / 1e3, 2),
            "read": sum(r["read"] for r in mine),
            "cached": sum(r["cached"] for r in mine),
            "turns_s": round(sum(r["turn_s"] for r in mine), 2),
        }
    print(json.dumps(summary))
    if args.out:
        meta = {"cpu": platform.processor() or platform.machine(), "device": args.device, "threads": args.threads,
                "dtype": args.dtype, "torch": torch.__version__, "method": args.method,
                "new_tokens": args.new_tokens}  # fmt: skip
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "turns": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
