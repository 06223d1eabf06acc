"""Chains on a hybrid with recurrent states: what verifying guesses costs and gains there, at a real model's shape.

No hybrid model ships offline (Qwen3.5, Qwen3-Next, Granite 4, Nemotron-H are hub downloads), so this builds a
randomly initialised Qwen3.5 text model (three gated-delta-net layers to one full-attention layer, as Qwen3.5 lays
them out) of a small real model's width, and sets how often a guess is right itself: the guesses are a predicted
output (`prediction=`, OpenAI's predicted outputs: an edit that keeps most of a text) built from the model's own
greedy answer with every k-th token changed. Random weights say nothing of how often prompt lookup or a trie would
be right on a real hybrid: that is why the guesses are made here. What it measures is the mechanism: the chain's
forward (states copied first), the head of a partly accepted chain fed again with the next step, and the cost
model's pricing of both on this device's measured curve. Every output is compared with plain `generate`. `--turn`:
also a conversation's next turn (the first turn's prompt and answer, then a new message), its prefill with the
prefix cache holding the first turn's whole cache, states included, and without. `--shared`: a system prompt of that
many tokens before three users' messages; the third's prefill with the prefix cache (the second kept the cache after
the head it shared with the first) and without. `--batch`: that many prompts at once (a comma list) in one batch
with prompt lookup (the rows' chains side by side, each row's states cut back to its own), the same batch with one
token per row a step (`plain`: what a batch of Qwen3.5's rows fed before), the same prompts one after another
(forerun and `generate` alone) and `generate` with the prompts left-padded into one batch; rounds interleaved;
`--batch-every k`: also the batch with each row's answer predicted, every k-th token wrong. `--lone`: each
prediction also decoded as a batching server decodes its only request, a row alone in a `Batch` (chains,
`forerun.base.lone_chain`), beside a single run, both without a prefix cache (before, such a row fed one token a
step: `forerun plain`'s rate).

Usage:
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --out benchmarks/results/hybrid-chains-epyc.json
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --every "" --prompts 0 --turn 400   # a next turn
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --every "" --prompts 0 --shared 400  # a system prompt
    .venv/bin/python benchmarks/hybrid_chains.py --threads 2 --every "" --prompts 0 --batch 4,8   # batches
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --every "" --prompts 0 --batch 4 --batch-every 8 \
        --family lfm2   # a batch's rows predicted: chains together
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --every 0,8,4 --lone    # a server's lone request
    .venv/bin/python benchmarks/hybrid_chains.py --threads 1 --family lfm2   # convolution windows, cut back
    python3 benchmarks/hybrid_chains.py --device cuda --dtype bf16 --out "$OUT/hybrid_chains.json"   # a card
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import forerun
from forerun.batch import Batch

SHAPE = dict(
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    vocab_size=49152,
    max_position_embeddings=4096,
)
"""About 170M parameters (SmolLM2-135M's vocabulary and scale), every fourth layer full attention."""
LFM2_SHAPE = dict(
    hidden_size=768,
    intermediate_size=3072,  # 2048 after LFM2's own adjustment (two thirds, rounded to 256)
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    full_attn_idxs=[2, 5, 8, 10, 12, 14],  # LFM2-350M's layout: 10 short convolutions, 6 attention layers
    vocab_size=49152,
    max_position_embeddings=4096,
)
"""About 150M parameters, laid out as LFM2-350M is (`--family lfm2`): its states are convolution windows only."""


def hybrid(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", family: str = "qwen3_5_text"
) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **(LFM2_SHAPE if family == "lfm2" else SHAPE))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def edited(answer: list[int], every: int | None, vocab: int) -> list[int]:
    """`answer` with every `every`-th token replaced by another (None: unchanged)."""
    if every is None:
        return list(answer)
    return [(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(answer)]


def timed(make) -> tuple[float, object]:
    """Seconds of `make()` (a card's work waited for) and its result."""
    started = time.perf_counter()
    out = make()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started, out


def next_turn(model: torch.nn.Module, first: int, answer: int = 64, message: int = 16) -> dict:
    """Seconds to the first token of a second turn (`first` prompt tokens, `answer`, then `message` new ones), with
    the prefix cache holding the first turn and without; and whether both wrote the same text."""
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, vocab, (1, first), generator=generator).to(device)
    out = {}
    for cached in (True, False):
        decoder = forerun.Decoder(model, None, "plain", prefix_cache=4096 if cached else 0)
        turn = decoder.generate(prompt, answer, eos_token_id=[]).sequences
        following = torch.cat([turn, torch.randint(3, vocab, (1, message), generator=generator).to(device)], 1)
        second = decoder.generate(following, 1, eos_token_id=[])
        out[cached] = (second.stats.prefill_seconds, second.stats.cached_prompt_tokens, second.sequences)
        generator.manual_seed(2)
        torch.randint(3, vocab, (1, first), generator=generator)  # the same message for the other decoder
    return {"first_turn_tokens": first + answer, "prefill_s_cached": round(out[True][0], 3),
            "prefill_s_read_again": round(out[False][0], 3), "cached_tokens": out[True][1],
            "same": torch.equal(out[True][2], out[False][2])}  # fmt: skip


def shared_head(model: torch.nn.Module, system: int, message: int = 16, answer: int = 16) -> dict:
    """Seconds of the third prompt's prefill (`system` shared tokens, then `message` of its own), with the prefix
    cache (the second prompt kept the cache after the head it shared with the first) and without; the same text?"""
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    generator = torch.Generator().manual_seed(3)
    head = torch.randint(3, vocab, (1, system), generator=generator)
    texts = [torch.cat([head, torch.randint(3, vocab, (1, message), generator=generator)], 1).to(device)
             for _ in range(3)]  # fmt: skip
    out = {}
    for cached in (True, False):
        decoder = forerun.Decoder(model, None, "plain", prefix_cache=4096 if cached else 0)
        prefills = [decoder.generate(text, answer, eos_token_id=[]) for text in texts]
        out[cached] = [(r.stats.prefill_seconds, r.stats.cached_prompt_tokens, r.sequences) for r in prefills]
    return {"system_tokens": system, "prefill_s_cached": [round(r[0], 3) for r in out[True]],
            "prefill_s_read_again": [round(r[0], 3) for r in out[False]], "cached_tokens": [r[1] for r in out[True]],
            "same": all(torch.equal(a[2], b[2]) for a, b in zip(out[True], out[False], strict=True))}  # fmt: skip


def batches(
    model: torch.nn.Module, size: int, new_tokens: int, curve, every: int | None = None, rounds: int = 2
) -> dict:
    """Tokens per second of `size` ragged prompts (32-64 tokens, `new_tokens` each) in one forerun batch with prompt
    lookup, the same batch with one token per row a step (`plain`: what a hybrid's batch fed before its rows could
    draft together), one after another (forerun with prompt lookup, generate) and left-padded in one `generate`
    batch, best of `rounds` interleaved rounds, every forerun decoder on `curve` without a prefix cache; whether
    forerun's rows are each prompt's own `generate` text. `every`: also the batch with each row's answer predicted,
    every `every`-th token wrong (0: none wrong)."""
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    generator = torch.Generator().manual_seed(4)
    texts = [torch.randint(3, vocab, (1, 32 + (i * 11) % 33), generator=generator).to(device) for i in range(size)]
    options = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    lookup, plain = (forerun.Decoder(model, None, m, latency=curve, prefix_cache=0) for m in ("prompt_lookup", "plain"))
    longest = max(text.shape[1] for text in texts)
    padded = torch.cat([torch.nn.functional.pad(t, (longest - t.shape[1], 0)) for t in texts])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(t), (longest - t.shape[1], 0)) for t in texts])
    want = [model.generate(t, **options) for t in texts]
    predicted = [forerun.GenerationRequest(t, new_tokens, eos_token_id=[], prediction=edited(
        w[0, t.shape[1] :].tolist(), every or None, vocab)) for t, w in zip(texts, want, strict=True)]  # fmt: skip
    ways = {
        "forerun batch": lambda: lookup.generate(texts, new_tokens, eos_token_id=[]),
        "forerun batch, one token a row": lambda: plain.generate(texts, new_tokens, eos_token_id=[]),
        "forerun one after another": lambda: [lookup.generate(t, new_tokens, eos_token_id=[]) for t in texts],
        "generate one after another": lambda: [model.generate(t, **options) for t in texts],
        "generate padded batch": lambda: model.generate(padded, attention_mask=mask, **options),
    }
    if every is not None:
        ways[f"forerun batch, predicted (every {every or 'none'} wrong)"] = lambda: lookup.generate(predicted)
    best, outs = dict.fromkeys(ways, float("inf")), {}
    for _ in range(rounds):
        for name, run in ways.items():
            seconds, outs[name] = timed(run)
            best[name] = min(best[name], seconds)
    same = {name: all(torch.equal(r.sequences, w) for r, w in zip(outs[name], want, strict=True))
            for name in ways if name.startswith("forerun")}  # fmt: skip
    padded_same = all(torch.equal(p[longest:], w[0, w.shape[1] - new_tokens :]) for p, w in zip(outs[
        "generate padded batch"], want, strict=True))  # fmt: skip
    per_forward = {name: round(sum(r.stats.new_tokens for r in outs[name]) / sum(r.stats.forwards for r in outs[name]),
                               2) for name in same}  # fmt: skip
    return {"rows": size, "new_tokens": new_tokens, "same": same, "padded_generate_same": padded_same,
            "tok_s": {name: round(size * new_tokens / seconds, 1) for name, seconds in best.items()},
            "tokens_per_forward": per_forward}  # fmt: skip


def alone_in_batch(decoder: forerun.Decoder, prompt: torch.Tensor, new_tokens: int, prediction: list[int]):
    """The request decoded as a batching server decodes its only request: a row alone in a `Batch`."""
    request = forerun.GenerationRequest(prompt, new_tokens, eos_token_id=[], prediction=prediction)
    prepared = decoder.prepare(request)
    batch = Batch(decoder.model, decoder.batch_budget())
    row = batch.add(prepared.job)
    while batch.rows:
        batch.step()
    return decoder.result(prepared, row.stats)


def by_method(rows: list[dict], new_tokens: int) -> dict[str, dict]:
    """Per method, in the rows' order: tokens per second over its prompts, its geometric-mean speed against
    `generate` prompt by prompt, its first prompt's tokens per forward, and whether every text was generate's."""
    summary = {}
    base = [row for row in rows if row["method"] == "generate"]
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        ratios = [b["seconds"] / m["seconds"] for m, b in zip(mine, base, strict=True)]
        summary[method] = {
            "tok_s": round(new_tokens * len(mine) / sum(row["seconds"] for row in mine), 1),
            "vs_generate": round(statistics.geometric_mean(ratios), 2),
            "tokens_per_forward": mine[0].get("tokens_per_forward"),
            "all_same": all(row["same"] for row in mine),
        }
    return summary


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--every", default="0,16,8,4", help="every k-th predicted token wrong (0: none)")
    parser.add_argument("--turn", type=int, default=0, help="a next turn after a first prompt of this many tokens")
    parser.add_argument("--shared", type=int, default=0, help="a system prompt of this many tokens, three users")
    parser.add_argument("--batch", default="", help="rows of one batch (a comma list) against one after another")
    parser.add_argument("--batch-every", type=int, help="batches: also each row predicted, every k-th token wrong")
    parser.add_argument("--lone", action="store_true", help="also alone in a batch (a server's only request)")
    parser.add_argument("--family", default="qwen3_5_text", choices=("qwen3_5_text", "lfm2"), help="the shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model = hybrid(dtype=dtype, device=args.device, family=args.family)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (1, 48), generator=generator).to(args.device) for _ in range(args.prompts)]
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=None)  # the curve measured now
    plain = forerun.Decoder(model, None, "plain")
    uncached = forerun.Decoder(model, None, "prompt_lookup", latency=decoder.budget.curve, prefix_cache=0)
    curve = decoder.budget.curve
    print("curve (relative to 1 token):", {n: round(curve.relative(n), 2) for n in (2, 4, 8, 16)}, flush=True)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    everies = [None if int(k) == 0 else int(k) for k in args.every.split(",") if k]
    rows = []
    for round_, prompt in enumerate(prompts):
        seconds, want = timed(lambda p=prompt: model.generate(p, **options))
        answer = want[0, prompt.shape[1] :].tolist()
        rows.append({"prompt": round_, "method": "generate", "seconds": seconds, "same": True})
        seconds, result = timed(lambda p=prompt: plain.generate(p, args.new_tokens, eos_token_id=[]))
        rows.append({"prompt": round_, "method": "forerun plain", "seconds": seconds,
                     "same": torch.equal(result.sequences.cpu(), want.cpu()), "tokens_per_forward": 1.0})  # fmt: skip
        ways = {"": lambda p, q: decoder.generate(p, args.new_tokens, eos_token_id=[], prediction=q)}
        if args.lone:
            ways[", single run"] = lambda p, q: uncached.generate(p, args.new_tokens, eos_token_id=[], prediction=q)
            ways[", alone in a batch"] = lambda p, q: alone_in_batch(uncached, p, args.new_tokens, q)
        for every in everies:
            prediction = edited(answer, every, vocab)
            for way, run in ways.items():
                seconds, result = timed(lambda p=prompt, q=prediction, run=run: run(p, q))
                stats = result.stats
                rows.append({"prompt": round_, "method": f"prediction, every {every or 'none'} wrong{way}",
                             "seconds": seconds, "same": torch.equal(result.sequences.cpu(), want.cpu()),
                             "tokens_per_forward": round(stats.tokens_per_forward, 2), "fed_again": stats.fed_again,
                             "fed_per_forward": round(stats.mean_fed, 2)})  # fmt: skip
        for row in rows[-2 - len(everies) * len(ways) :]:
            print(json.dumps(row), flush=True)
    summary = {}
    if args.turn:
        summary["next turn"] = next_turn(model, args.turn)
        print("next turn", summary["next turn"], flush=True)
    if args.shared:
        summary["shared head"] = shared_head(model, args.shared)
        print("shared head", summary["shared head"], flush=True)
    for size in [int(k) for k in args.batch.split(",") if k]:
        summary[f"batch {size}"] = batches(model, size, args.new_tokens, curve, args.batch_every)
        print(f"batch {size}", summary[f"batch {size}"], flush=True)
    for method, figures in by_method(rows, args.new_tokens).items():
        summary[method] = figures
        print(method, figures, flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    shape, relative = (
        LFM2_SHAPE if args.family == "lfm2" else SHAPE,
        {n: round(curve.relative(n), 3) for n in (2, 4, 8, 16)},
    )
    env = {"device": device, "dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
           "family": args.family, "shape": shape, "curve": relative}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"env": env, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
