"""Speedup priced on the latency curve: a method's decisions judged without timing noise.

Wall-clock speedups on a shared CPU swing by several percent from run to run, more than most cost-model changes
move them. Here the Decoder is given the stored latency curve as its price (`latency=`: no forward timings steer
its choices, so a run is deterministic) and every step is charged what the curve says its forward costs:

    priced speedup = new tokens x cost(1 token) / sum over forwards of cost(tokens fed)

Prompts are decoded in order by one Decoder per dataset group (the trie and the calibration learn as they go);
conversations (`multiturn`) get plain generate's own answers as their history, as in `forerun bench`. To compare
two versions of the cost model, run this on each (same prompts, same curve).

Usage (CPU, 1 thread; BENCHMARKS.md, "Selection bias"):
    .venv/bin/python benchmarks/priced.py --datasets gsm8k,humaneval,mbpp,typehints --n 3
    .venv/bin/python benchmarks/priced.py --datasets gsm8k,humaneval,mbpp,typehints --skip 3 --n 6
    .venv/bin/python benchmarks/priced.py --datasets multiturn --n 12 --method prompt_lookup
"""

from __future__ import annotations

import argparse

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.latency import curve_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=3, help="Prompts per dataset (turns, for multiturn).")
    parser.add_argument("--skip", type=int, default=0, help="Leave out each dataset's first prompts (held-out sets).")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype)
    curve = curve_for(model)
    decoder = forerun.Decoder(model, tokenizer, args.method, latency=curve)
    names = args.datasets.split(",")
    prompts = [p for name in names for p in load_dataset(name, args.skip + args.n)[args.skip :]]
    decoder.generate(list(prompts[0].messages), chat=True, max_new_tokens=8)  # warm-up
    histories: dict[str, list[dict]] = {}
    tokens, priced, expected, accepted = 0, 0.0, 0.0, 0
    for prompt in prompts:
        ids = encode(tokenizer, prompt, model.device, histories.get(prompt.conversation or "", []))
        result = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
        stats = result.stats
        tokens += stats.new_tokens
        priced += sum(curve.cost(size) * count for size, count in stats.fed_hist.items())
        expected, accepted = expected + stats.expected_accepted, accepted + stats.accepted
        if prompt.conversation is not None:  # greedy: this answer is plain generate's
            answer = tokenizer.decode(result.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            turns = histories.get(prompt.conversation, [])
            histories[prompt.conversation] = [*turns, *prompt.messages, {"role": "assistant", "content": answer}]
    print(
        f"{args.method} on {','.join(names)} ({len(prompts)} prompts, {tokens} tokens, {args.dtype}): "
        f"priced speedup {tokens * curve.cost(1) / priced:.3f}x; expected accepted {expected:.0f}, accepted {accepted}"
    )


if __name__ == "__main__":
    main()
