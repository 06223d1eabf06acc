"""The drafter protocol: `propose` a tree from the committed text, `observe` what verification decided.

A drafter knows nothing of the model forward; the engine knows nothing of how drafts are made. Per-request state
is reset in `start`; state that outlives requests (pools, tries) stays in the drafter object, which the caller's
`Decoder` owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import LogitsProcessorList

from forerun.tree import TokenTree
from forerun.verify import Verdict


@dataclass
class DraftContext:
    """What a drafter may read: the committed tokens (prompt + output; the last one is the tree's root)."""

    tokens: list[int]
    prompt_len: int
    budget: int
    """Most nodes, root included, the engine will feed this step."""
    eos_token_ids: frozenset[int]
    sampled: bool = False
    """The target samples (drafters that sample must then attach their q to the tree: `TokenTree.draft_probs`)."""
    processor: LogitsProcessorList | None = None
    """The target's logits processors (temperature, top-p, penalties...), for drafters that score tokens."""
    generator: torch.Generator | None = None
    """The run's random generator (None = torch's global one), for drafters that sample."""


@dataclass(frozen=True)
class StepOutcome:
    """What one verified forward decided, shown to every drafter."""

    tree: TokenTree
    verdict: Verdict
    choices: list[int]
    """The target's greedy choice at every node of `tree` (probe nodes included), index-aligned with it."""
    new_tokens: list[int]
    """Tokens committed by this step (accepted + bonus), already appended to the context."""
    node_map: dict[int, int]
    """This drafter's proposed node -> node of `tree` (nodes cut by the budget are absent)."""


class Drafter(Protocol):
    """Every method is one of these; `plain` is the empty list of drafters."""

    name: str

    def start(self, ctx: DraftContext) -> None:
        """A new request begins: `ctx.tokens` is the prompt (the first root is its last token), or the prompt plus
        its first token when the prefill ran alone (`EngineConfig.draft_in_prefill=False`, or no drafters)."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        """Return a tree rooted at ctx.tokens[-1], of at most ctx.budget nodes."""
        ...

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """Learn from a verified step; ctx.tokens already includes outcome.new_tokens."""

    def finish(self, ctx: DraftContext) -> None:
        """The request ended (EOS, length or stop string)."""


def cut_at_eos(tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """Keep tokens up to and including the first EOS: nothing after an end of text can be accepted.

    Example:
        >>> cut_at_eos([4, 2, 9], frozenset({2}))
        [4, 2]
    """
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
