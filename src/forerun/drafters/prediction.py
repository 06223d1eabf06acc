"""Predicted outputs (OpenAI's `prediction`): a text the caller expects the answer to resemble drafts the answer.

The usual case is an edit: "rename this function and add type hints" with the original code as the prediction.
Most of the answer is the prediction verbatim, with local changes. The drafter keeps a cursor into the prediction
(where the answer is aligned with it) and proposes what follows the cursor. After a change, it re-synchronises:
the answer's last n tokens (n = 4 down to 1) are looked up in the prediction, preferring the first occurrence at or
after the cursor, then any occurrence. Where the answer has just written another token than the prediction's at the
cursor, it may have replaced that one token (a renamed word): the text after it is proposed too, as a second
branch, first where the lookup found only the last token somewhere further off. Nothing in the answer depends on
the prediction: every token is still the model's own choice, verified like any other draft.

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
NEAR = 4
"""A lookup of the last token alone that lands further than this from the cursor is likelier a coincidence than
the answer skipping ahead: the replaced-token branch is then the likelier one."""


class PredictionDrafter:
    name = "prediction"

    def __init__(self, prediction: list[int], draft_len: int = DRAFT_LEN) -> None:
        self.prediction, self.draft_len = list(prediction), draft_len
        self.cursor = 0
        """Position in the prediction of the next token we expect the answer to take from it."""
        self.output_start = 0
        self.proposed_at: list[tuple[int, list[int]]] = []
        """This step's branches: (position in the prediction they copy from, their nodes in the proposed tree)."""
        self.replaced: int | None = None
        """The prediction's position the answer wrote another token for at the last step (None: it did not)."""
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        """n-gram of the prediction -> positions right after it, in order."""
        for n in range(1, MAX_NGRAM + 1):
            for end in range(n, len(self.prediction) + 1):
                self.index[tuple(self.prediction[end - n : end])].append(end)

    def start(self, ctx: DraftContext) -> None:
        self.cursor, self.output_start, self.proposed_at, self.replaced = 0, ctx.prompt_len, [], None

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
        """The prediction after where the answer is found in it; and after a token the answer replaced, the
        prediction after that token (`branches`)."""
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        self.proposed_at = []
        length = min(self.draft_len, ctx.budget - 1)
        for position, score in self.branches(ctx.tokens):
            draft = cut_at_eos(self.prediction[position : position + length], ctx.eos_token_ids)
            if draft:
                nodes = tree.add_chain(0, draft, "candidate", self.name, [score] + [0.9] * (len(draft) - 1))
                self.proposed_at.append((position, nodes))
        return tree

    def branches(self, tokens: list[int]) -> list[tuple[int, float]]:
        """(position to copy from, chance of its first token) for each branch, likelier first."""
        found = self.locate(tokens)
        looked = [(found[0], found[1] / (found[1] + 1))] if found is not None else []
        after = None if self.replaced is None else self.replaced + 1
        if after is None or after >= len(self.prediction) or (found is not None and found[0] == after):
            return looked
        if found is not None and (found[1] > 1 or abs(found[0] - after) <= NEAR):
            return [*looked, (after, 0.3)]
        return [(after, 0.6), *looked]

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        accepted = set(outcome.verdict.accepted_nodes)
        self.replaced = None
        best = None  # (taken, position, nodes)
        for position, nodes in self.proposed_at:
            taken = sum(outcome.node_map.get(node) in accepted for node in nodes)
            if best is None or taken > best[0]:
                best = (taken, position, nodes)
        if best is not None:
            taken, position, nodes = best
            self.cursor = position + taken
            if taken < len(nodes) and outcome.node_map.get(nodes[taken]) is not None:
                self.replaced = self.cursor  # its token there was fed, and the answer wrote another

    def finish(self, ctx: DraftContext) -> None:
        pass
