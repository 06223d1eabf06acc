"""Predicted outputs (OpenAI's `prediction`): a text the caller expects the answer to resemble drafts the answer.

The usual case is an edit: "rename this function and add type hints" with the original code as the prediction.
Most of the answer is the prediction verbatim, with local changes. The drafter keeps a cursor into the prediction
(where the answer is aligned with it) and proposes what follows the cursor. After a change, it re-synchronises:
the answer's last n tokens (n = 4 down to 1) are looked up in the prediction, preferring the first occurrence at or
after the cursor, then any occurrence. Nothing in the answer depends on the prediction: every token is still the
model's own choice, verified like any other draft.

It is a per-request drafter (the prediction belongs to one request), added in front of the method's own drafters;
it is not a method of the registry. Its source name is "prediction": `accepted_by["prediction"]` counts the
answer's tokens that came from the prediction.

Example (prediction "def add ( a , b ) : return a + b", the answer so far "def sum ( a"):
    the answer's last token "a" is found in the prediction at position 3, so the drafter proposes ", b ) : ..."
"""

from __future__ import annotations

from collections import defaultdict

from forerun.drafters.base import DraftContext, StepOutcome, cut_at_eos
from forerun.tree import TokenTree

MAX_NGRAM = 4
DRAFT_LEN = 48
"""Most tokens proposed per step (the cost model feeds what pays)."""


class PredictionDrafter:
    name = "prediction"

    def __init__(self, prediction: list[int], draft_len: int = DRAFT_LEN) -> None:
        self.prediction, self.draft_len = list(prediction), draft_len
        self.cursor = 0
        """Position in the prediction of the next token we expect the answer to take from it."""
        self.output_start = 0
        self.proposed_at: int | None = None
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        """n-gram of the prediction -> positions right after it, in order."""
        for n in range(1, MAX_NGRAM + 1):
            for end in range(n, len(self.prediction) + 1):
                self.index[tuple(self.prediction[end - n : end])].append(end)

    def start(self, ctx: DraftContext) -> None:
        self.cursor, self.output_start, self.proposed_at = 0, ctx.prompt_len, None

    def locate(self, tokens: list[int]) -> tuple[int, int] | None:
        """(position in the prediction to copy from, match length) for the text so far, or None."""
        output = tokens[self.output_start :]
        if not output:
            return (self.cursor, 1) if self.cursor < len(self.prediction) else None  # the answer starts with it
        for n in range(min(MAX_NGRAM, len(output)), 0, -1):
            positions = [p for p in self.index.get(tuple(output[-n:]), ()) if p < len(self.prediction)]
            if positions:
                ahead = [p for p in positions if p >= self.cursor]
                return (ahead[0] if ahead else positions[-1]), n
        return None

    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        found = self.locate(ctx.tokens)
        self.proposed_at = None
        if found is None:
            return tree
        position, n = found
        draft = cut_at_eos(
            self.prediction[position : position + min(self.draft_len, ctx.budget - 1)], ctx.eos_token_ids
        )
        tree.add_chain(0, draft, "candidate", self.name, [n / (n + 1)] + [0.9] * (len(draft) - 1))
        self.proposed_at = position
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if self.proposed_at is not None:
            mine = set(outcome.node_map.values())
            taken = sum(node in mine for node in outcome.verdict.accepted_nodes)
            self.cursor = self.proposed_at + taken

    def finish(self, ctx: DraftContext) -> None:
        pass
