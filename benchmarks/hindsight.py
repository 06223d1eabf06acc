"""How far `auto`'s choices are from hindsight: the same proposals, fed as if the output were known.

Per step the cost model sees every drafter's proposal and feeds a subset. In hindsight the best a step could do
with the same proposals is to feed exactly the longest proposed path the output confirms (the root alone when
none does), at the cheapest forward size that holds it. Both are priced on the measured latency curve (the cost
model's own), so the comparison is free of timing noise:

    speedup = new tokens x cost(1 token) / sum over steps of cost(tokens fed)

Usage (CPU, 1 thread; BENCHMARKS.md, "Where the limit is"):
    .venv/bin/python benchmarks/hindsight.py --dtype fp32 --n 3
    .venv/bin/python benchmarks/hindsight.py --dtype fp32 --n 3 --knob prompt_lookup.max_branches=4
"""

from __future__ import annotations

import argparse

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.costmodel import CostModel
from forerun.methods import parse_knob_pairs


class Recorder:
    """The Decoder's cost model, recording each step's merged proposals (and the lead the step carried)."""

    def __init__(self, budget: CostModel) -> None:
        self.budget, self.steps = budget, []

    def choose(self, root, proposals, lead=0, drafts=True):
        selection = self.budget.choose(root, proposals, lead, drafts)
        self.steps.append((selection.ranking.merged if selection.ranking else None, lead))
        return selection

    def __getattr__(self, name):
        return getattr(self.budget, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--n", type=int, default=3, help="Prompts per dataset (gsm8k, humaneval, mbpp, typehints).")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--knob", action="append", default=[], help="A knob of auto's drafters, e.g. trie.decoding_length=24"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype)
    decoder = forerun.Decoder(model, tokenizer, "auto", **parse_knob_pairs(args.knob))
    recorder = Recorder(decoder.budget)
    decoder.budget = recorder
    curve, cap = recorder.curve, recorder.max_nodes
    prompts = [p for name in ("gsm8k", "humaneval", "mbpp", "typehints") for p in load_dataset(name, args.n)]
    decoder.generate(list(prompts[0].messages), chat=True, max_new_tokens=16)  # warm-up: the trie, the calibration

    def cheapest(nodes: int) -> float:  # the cheapest forward holding `nodes` tokens (padding allowed)
        return min(curve.cost(size) for size in range(nodes, max(nodes, cap) + 1))

    tokens, actual, hindsight = 0, 0.0, 0.0
    for prompt in prompts:
        recorder.steps = []
        result = decoder.generate(list(prompt.messages), chat=True, max_new_tokens=args.max_new_tokens)
        out = result.sequences[0].tolist()
        tokens += result.stats.new_tokens
        actual += sum(curve.cost(size) * count for size, count in result.stats.fed_hist.items())
        position = len(out) - result.stats.new_tokens - 1  # the first step's root: the prompt's last token
        for merged, lead in recorder.steps:  # the recorded proposals, in order, along the real output
            if position >= len(out) - 1:
                break
            confirmed, node = 0, 0
            while merged is not None and position + 1 + confirmed < len(out):
                child = merged.children.get((node, out[position + 1 + confirmed]))
                if child is None or merged.roles[child] != "candidate":
                    break
                node, confirmed = child, confirmed + 1
            hindsight += cheapest(lead + 1 + confirmed) if confirmed else curve.cost(lead + 1)
            position += 1 + confirmed
    one = curve.cost(1)
    print(
        f"{args.dtype}, {len(prompts)} prompts, {tokens} tokens: auto {tokens * one / actual:.3f}x, "
        f"hindsight with the same proposals {tokens * one / hindsight:.3f}x (priced on the measured curve)"
    )


if __name__ == "__main__":
    main()
