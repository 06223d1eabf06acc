"""What a better-trained EAGLE-3 head would make of chat on this CPU: a noisy oracle in the shipped head's place.

The oracle runs the shipped head's own forwards (its layer and its output matrix, so each level costs what the
real head's does), then throws its guess away: at head position i its first choice is the target's own token at
i + 2 (read off plain generate's text) with probability `agreement`, else a wrong token, with the head's
probability `agreement` on it either way. Its agreement with the target given the right tokens before is then
`agreement` at every level, where the shipped head's is 67.7% / 63.8% / 60.8% on held-out text
(docs/benchmarks.md, "EAGLE-3"). Greedy outputs are checked against generate's; the speedup is `auto` with the
oracle over plain generate, same process, interleaved, fp32.

    python benchmarks/head_ceiling.py --agreement 0.7,0.8,0.9 --n 6 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import forerun
from forerun.drafters.eagle3 import Eagle3Head, load_head

QUESTIONS = Path(__file__).parent / "chat_questions.jsonl"


class NoisyOracle(Eagle3Head):
    """The shipped head's forwards, the oracle's guesses (module docstring); draft ids are target ids."""

    def __init__(self, real: Eagle3Head, truth: list[int], agreement: float, vocab: int) -> None:
        config = real.config.__class__.from_dict({**real.config.to_dict(), "draft_vocab_size": vocab})
        super().__init__(config, real.embed_tokens, real.aux_layers)
        state = {k: v for k, v in real.state_dict().items() if not k.startswith(("lm_head", "d2t", "t2d"))}
        self.load_state_dict(state, strict=False)
        self.d2t.zero_()
        self.real, self.truth, self.agreement, self.vocab = real, truth, agreement, vocab
        self.lm_head = torch.nn.Identity()  # not read: the guesses come from `truth`

    def forward(self, tokens, hidden, positions, cache, visible=None):
        out = super().forward(tokens, hidden, positions, cache, visible).clone()
        out[:, 0] = positions.to(out.dtype)  # the oracle reads the position back in `draft_logits`
        return out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        self.real.draft_logits(out)  # the real head's cost
        logits = torch.full((out.shape[0], self.vocab), -30.0)
        for row, position in enumerate(out[:, 0].round().long().tolist()):
            token = self.truth[position + 2] if position + 2 < len(self.truth) else 0
            right = random.Random(position * 7919 + row).random() < self.agreement
            guess = token if right else (token + 1) % self.vocab
            logits[row, guess] = 0.0
            logits[row, (guess + 2) % self.vocab] = float(torch.tensor((1 - self.agreement) / self.agreement).log())
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agreement", default="0.7,0.8,0.9")
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m")
    real = load_head("smollm2-135m", model)
    vocab = model.get_output_embeddings().weight.shape[0]
    questions = [json.loads(line)["prompt"] for line in QUESTIONS.read_text().splitlines()][: args.n]
    levels = [float(a) for a in args.agreement.split(",")]
    totals = {label: [0.0, 0, 0] for label in ["generate", "auto (shipped head)", *map(str, levels)]}
    for question in questions:
        ids = forerun.Decoder(model, tokenizer, "plain").encode(question, chat=True)
        started = time.perf_counter()
        truth = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - started
        made = truth.shape[1] - ids.shape[1]
        totals["generate"] = [totals["generate"][0] + seconds, totals["generate"][1] + made, 0]
        heads = {"auto (shipped head)": real}
        heads.update({str(a): NoisyOracle(real, truth[0].tolist(), a, vocab).eval() for a in levels})
        for label, head in heads.items():
            decoder = forerun.Decoder(model, tokenizer, "auto", draft_head=head)
            started = time.perf_counter()
            result = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
            seconds = time.perf_counter() - started
            assert torch.equal(result.sequences, truth), label
            spent, tokens, forwards = totals[label]
            totals[label] = [spent + seconds, tokens + made, forwards + result.stats.forwards]
    base = totals["generate"][1] / totals["generate"][0]
    print(
        f"| head in `auto` | tok/s | vs generate | tokens/forward |  ({args.n} chat questions, fp32, "
        f"{args.threads} thread(s))\n|---|---:|---:|---:|"
    )
    for label, (seconds, tokens, forwards) in totals.items():
        name = label if not label[0].isdigit() else f"oracle at {float(label):.0%} agreement"
        per_forward = f"{tokens / forwards:.2f}" if forwards else "1.00"
        print(f"| {name} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f}x | {per_forward} |")


if __name__ == "__main__":
    main()
