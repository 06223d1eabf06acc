"""Test drafters with known behaviour (an oracle that knows the answer, a random one that never helps), and a
hybrid's chain step kept in part."""

from __future__ import annotations

import random

import torch

from forerun.base.chain import ChainBase, chain_of
from forerun.drafters.base import DraftContext, StepOutcome
from forerun.tree import TokenTree


class OracleDrafter:
    """Proposes the true continuation (depth tokens), after a wrong branch so the accepted path is not node 1.."""

    name = "oracle"

    def __init__(self, truth: list[int], depth: int, vocab: int) -> None:
        self.truth, self.depth, self.vocab = truth, depth, vocab

    def start(self, ctx: DraftContext) -> None:
        pass

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = len(ctx.tokens)
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        tree.add_chain(0, [(t + 1) % self.vocab for t in self.truth[n : n + 2]], source="decoy")
        tree.add_chain(0, self.truth[n : n + self.depth], source=self.name)
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        pass

    def finish(self, ctx: DraftContext) -> None:
        pass


class RandomDrafter:
    """Proposes random tokens that are never the truth (the true next token is excluded)."""

    name = "random"

    def __init__(self, truth: list[int], vocab: int, width: int = 3, depth: int = 4, seed: int = 0) -> None:
        self.truth, self.vocab, self.width, self.depth = truth, vocab, width, depth
        self.rng = random.Random(seed)

    def start(self, ctx: DraftContext) -> None:
        pass

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = len(ctx.tokens)
        forbidden = self.truth[n] if n < len(self.truth) else -1
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        for _ in range(self.width):
            first = self.rng.choice([t for t in range(self.vocab) if t != forbidden])
            rest = [self.rng.randrange(self.vocab) for _ in range(self.depth - 1)]
            tree.add_chain(0, [first, *rest], source=self.name)
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        pass

    def finish(self, ctx: DraftContext) -> None:
        pass


# The real model's test prompts (one of each kind: code, arithmetic, an edit, prose, a list).
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Add type hints to this function:\n\ndef add(a, b):\n    total = a + b\n    return total\n",
    "Explain what a hash table is, in three sentences.",
    "List the planets of the solar system in order from the sun.",
]


def chat_ids(tokenizer, text: str):
    """input_ids [1, L] of `text` as one user message in the tokenizer's chat template, ready for an answer."""
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def keep_half_a_chain(base: ChainBase, ids: list[int], extra: int = 0) -> None:
    """On a begun chain base whose states are recorded through a step: ids[:5] read with the root ids[5], then a
    chain of 4 (ids[6], ids[7] and two wrong guesses) of which 2 are kept, its states cut back (`extra`: one token
    further, as if it had been rejected too: a wrong state). Nothing waits to be fed again."""
    with torch.inference_mode():
        base.forward(TokenTree.rooted_at(ids[5]), 5, ids[:5])
        base.commit(5, [0])
        base.forward(chain_of([ids[6], ids[7], 3, 4]), 6, ())
        assert base.recorded and base.copies is None
        if extra:
            base.fed.append(0)
        assert base.commit(6, [0, 1]) == 0 and base.pending == []


def without_recording(monkeypatch) -> None:
    """Decoders made after this take their model's forward for one that writes no guess's recurrent state (as
    transformers' Zamba's): a chain accepted in part has its states put back from a copy and its head fed again,
    and a batch's rows feed one token each."""
    monkeypatch.setattr("forerun.assembly.records_states", lambda model: False)
