"""What a trained head's probes are worth: the head on a fixed schedule (`--probe` steps drafting, then `--pause`
steps sitting out, over and over), reproducible choices (priced on the stored curve, so the counts repeat exactly),
for several `catch_up` settings: how many positions written while it sat out it reads when it drafts again
(0: none, its cache starts over from the step it drafts in).

Each line: the steps the head drafted a tree in, how many of its tokens the target accepted (per drafted step), and
tokens per forward over every prompt. Counts, not times: the schedule replaces the switch that would otherwise
decide from them.

    .venv/bin/python benchmarks/head_probes.py --n 12 --methods eagle3,auto --pause 32 --catch-up 0,64,512
    .venv/bin/python benchmarks/head_probes.py --n 8 --methods eagle3 --pause 96 --max-new-tokens 384

(`benchmarks/results/head-probes-fp32-epyc-avx2.md` holds both runs.)
"""

from __future__ import annotations

import argparse

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.costmodel import DraftSwitch
from forerun.drafters.eagle3 import load_head


class Schedule(DraftSwitch):
    """A switch that measures nothing: `probe` drafting steps, then `pause` steps without the head, repeated."""

    def __init__(self, probe: int, pause: int) -> None:
        super().__init__(paired=True)
        self.step, self.probe, self.period = 0, probe, probe + pause

    def drafting(self) -> bool:  # asked once a step (`RowRun.propose`)
        self.step += 1
        return (self.step - 1) % self.period < self.probe

    def record(self, drafted: bool, rate: float) -> None:
        pass

    def record_pair(self, *measured: float) -> None:
        pass


def run(decoder: forerun.Decoder, prompts: list, args: argparse.Namespace) -> tuple[int, int, float]:
    """(steps the head drafted a tree in, its tokens accepted, tokens per forward) over `prompts`."""
    head = next(d for d in decoder.drafters if d.name == "eagle3")
    propose, drafted = head.propose, [0]

    def counted(ctx):
        tree = propose(ctx)
        drafted[0] += len(tree) > 1
        return tree

    head.propose = counted
    accepted = tokens = forwards = 0
    for prompt in prompts:
        decoder.budget.switch = Schedule(args.probe, args.pause)  # each request from the schedule's start
        result = decoder.generate(encode(decoder.tokenizer, prompt, "cpu"), args.max_new_tokens)
        accepted += result.stats.accepted_by.get("eagle3", 0)
        tokens, forwards = tokens + result.stats.new_tokens, forwards + result.stats.forwards
    return drafted[0], accepted, tokens / forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="benchmarks/chat_questions.jsonl", help="comma-separated")
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--methods", default="eagle3,auto")
    parser.add_argument("--probe", type=int, default=6)
    parser.add_argument("--pause", type=int, default=32)
    parser.add_argument("--catch-up", default="0,64,512", help="comma-separated eagle3.catch_up values")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head", default="smollm2-135m")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m")
    head = load_head(args.head, model)
    prompts = [p for name in args.dataset.split(",") for p in load_dataset(name, args.n)]
    print("| method | catch_up | steps the head drafted | its tokens accepted | per drafted step | tokens/forward |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        for keep in (int(value) for value in args.catch_up.split(",")):
            named = "auto+eagle3" if method == "auto" else method  # (the head's knobs need it named)
            decoder = forerun.Decoder(model, tokenizer, named, draft_head=head, reproducible=True,
                                      **{"eagle3.catch_up": keep})  # fmt: skip
            drafted, accepted, per_forward = run(decoder, prompts, args)
            print(f"| {method} | {keep} | {drafted} | {accepted} | {accepted / max(drafted, 1):.3f} | "
                  f"{per_forward:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
