"""Sibling layers stacked (`forerun.base.stacked`: a layer's q, k, v and its gate, up projections laid out as one
matrix each) against the same layers laid out apart, interleaved in one process on a CPU with oneDNN's layout.

Two models of the same weights: `load_model`'s (stacked) and the same with every sibling given its own product
again (`unstack_siblings`; laid out, its row table measured for its own layers). First one forward by tokens fed
after 200 cached (the fastest of `--repeats`, the two models in turn, same logits asserted); then, for every
prompt, plain `generate` and forerun `auto` on each model in turn. Prints milliseconds per forward, tokens per
second over all prompts (the prefill included), whether the two models' generate wrote the same tokens, and how
many `auto` outputs equal their model's generate (fp32: all; bf16: or first differ at a tie).

    python benchmarks/stacked_ab.py --dtype fp32 --n 3 --threads 1 --out benchmarks/results/stacked-ab-fp32-epyc.json
    python benchmarks/stacked_ab.py --dtype bf16 --n 3 --threads 1 --out benchmarks/results/stacked-ab-bf16-epyc.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import forerun
from forerun.base.packed import lay_out_rows
from forerun.base.stacked import unstack_siblings
from forerun.bench.datasets import load_dataset
from forerun.exactness import first_divergence
from forerun.measured import machine_label

DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints")
CACHED = 200


def models(dtype: str) -> dict[str, tuple[torch.nn.Module, object]]:
    stacked = forerun.load_model("smollm2-135m", dtype=dtype)
    apart, tokenizer = forerun.load_model("smollm2-135m", dtype=dtype)
    assert unstack_siblings(apart) > 0, "nothing was stacked"
    lay_out_rows(apart)  # fp32: the table for its own layers
    return {"apart": (apart, tokenizer), "stacked": stacked}


@torch.inference_mode()
def forwards(named: dict, fed: tuple[int, ...], repeats: int) -> dict[str, dict[int, float]]:
    """Milliseconds of one forward of n tokens after CACHED cached ones, the fastest of `repeats` per model."""
    ids = torch.arange(1000, 1000 + CACHED)[None]
    caches = {}
    for name, (model, _) in named.items():
        caches[name] = DynamicCache(config=model.config)
        model(ids, cache=caches[name], use_cache=True)
    best = {name: dict.fromkeys(fed, float("inf")) for name in named}
    for n in fed:
        positions = torch.arange(CACHED, CACHED + n)[None]
        logits = {}
        for _ in range(repeats):
            for name, (model, _) in named.items():
                started = time.perf_counter()
                out = model(torch.full((1, n), 42), cache=caches[name], position_ids=positions, use_cache=True)
                best[name][n] = min(best[name][n], (time.perf_counter() - started) * 1e3)
                caches[name].crop(-n)
                logits[name] = out.logits
        assert torch.equal(*logits.values()), f"{n} tokens: the stacked model's logits differ"
    return best


def decode(named: dict, n: int, new_tokens: int) -> tuple[dict, dict, dict]:
    """(tokens/s per "method model", per model how many `auto` outputs equal its generate's or first differ at a
    tie, {how many prompts the two models' generate wrote alike, `auto`'s tokens per forward per model})."""
    tokenizer = named["apart"][1]
    decoders = {name: forerun.Decoder(model, tokenizer, "auto") for name, (model, _) in named.items()}
    prompts = [p for name in DATASETS for p in load_dataset(name, n)]
    for decoder in decoders.values():  # warm-up: curves, the output matrix's layout, first calls
        decoder.generate(list(prompts[0].messages), 16)
    totals = {f"{kind} {name}": [0, 0.0] for name in named for kind in ("generate", "auto")}
    exact, alike, forwards = dict.fromkeys(named, 0), 0, dict.fromkeys(named, 0)
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        written = []
        for name, (model, _) in named.items():
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            totals[f"generate {name}"][1] += time.perf_counter() - started
            expected = out.sequences[0, ids.shape[1] :].tolist()
            totals[f"generate {name}"][0] += len(expected)
            written.append(expected)
            started = time.perf_counter()
            result = decoders[name].generate(ids, new_tokens)
            totals[f"auto {name}"][1] += time.perf_counter() - started
            totals[f"auto {name}"][0] += len(result.new_tokens)
            forwards[name] += result.stats.forwards
            divergence = first_divergence(expected, result.new_tokens, [row[0] for row in out.logits], model.dtype)
            exact[name] += divergence is None or (model.dtype != torch.float32 and divergence.is_tie)
        alike += written[0] == written[1]
    per_forward = {name: totals[f"auto {name}"][0] / forwards[name] for name in named}
    return (
        {label: tokens / seconds for label, (tokens, seconds) in totals.items()},
        exact,
        {
            "alike": alike,
            "auto_tokens_per_forward": per_forward,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset (4 datasets)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    named = models(args.dtype)
    machine = machine_label(torch.device("cpu"))
    print(f"{machine}, {args.threads} thread(s), {args.dtype}")
    steps = forwards(named, (1, 2, 4, 8, 16), args.repeats)
    for n in steps["apart"]:
        apart, stacked = steps["apart"][n], steps["stacked"][n]
        print(f"{n:3d} tokens: apart {apart:6.2f} ms, stacked {stacked:6.2f} ms ({apart / stacked:.2f}x)")
    rates, exact, alike = decode(named, args.n, args.max_new_tokens)
    for label, rate in rates.items():
        print(f"{label:18s} {rate:6.1f} tokens/s")
    prompts = args.n * len(DATASETS)
    print(f"auto equal to its model's generate (bf16: or a tie): {exact} of {prompts}; generate alike: {alike}")
    record = {"machine": machine, "threads": args.threads, "dtype": args.dtype,
              "prompts": prompts, "forward_ms": steps, "tokens_per_second": rates, "auto_exact": exact,
              **alike}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
