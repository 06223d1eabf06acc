"""Prompt lookup: propose what followed earlier occurrences of the text's last n-gram.

The index maps every n-gram (n in [min_ngram, max_ngram]) of the committed text to the positions right after
it, most recent first (a chain through earlier occurrences); it grows by the new tokens of each step, so a lookup
costs O(max_ngram), not O(length).
Longer matches are tried first; distinct continuations (most recent occurrence first) become branches of one
tree, sharing prefixes. transformers' version takes only the first match, as one chain.

Score of a node (an estimate of acceptance given its parent was accepted, calibrated online by the cost model):
n / (n + 1) for a match of n tokens, divided by the branch's rank (1 for the most recent occurrence).

Example (max_ngram=2, min_ngram=1, draft_len=3, max_branches=2):
    text [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]: the suffix [1, 2] occurred before 5 (position 6) and before 3
    (position 2); branches [5, 6, 1] then [3, 4, 1]:

        root(2) ─ 5 ─ 6 ─ 1
             └─── 3 ─ 4 ─ 1
"""

from __future__ import annotations

from collections.abc import Iterator

from forerun.config import PromptLookupConfig
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome, cut_at_eos
from forerun.tree import TokenTree


class PromptLookupDrafter:
    name = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()
        self.latest: dict[int, dict[tuple[int, ...], int]] = {}
        """Per n: each n-gram of the text -> the position right after its latest occurrence."""
        self.earlier: dict[int, list[int]] = {}
        """Per n: at [p - 1], the position right after the occurrence before the one ending at p - 1 of the same
        n-gram (0: none). Positions are chained through ints, not kept in a list per n-gram: a long prompt's lists
        were thousands of objects for the garbage collector to track (as `forerun.drafters.trie`'s nodes were)."""
        self.indexed_len = 0

    def start(self, ctx: DraftContext) -> None:
        sizes = range(self.config.min_ngram, self.config.max_ngram + 1)
        self.latest, self.earlier = {n: {} for n in sizes}, {n: [] for n in sizes}
        self.indexed_len = 0
        self.extend_index(ctx.tokens)

    def extend_index(self, tokens: list[int]) -> None:
        """Index every n-gram ending at a position in [indexed_len, len(tokens))."""
        for end in range(self.indexed_len, len(tokens)):
            for n, latest in self.latest.items():
                before = 0
                if end + 1 >= n:
                    key = tuple(tokens[end + 1 - n : end + 1])
                    before = latest.get(key, 0)
                    latest[key] = end + 1
                self.earlier[n].append(before)
        self.indexed_len = len(tokens)

    def occurrences(self, n: int, gram: tuple[int, ...]) -> Iterator[int]:
        """Positions right after each occurrence of `gram` (n tokens) in the indexed text, most recent first."""
        start, earlier = self.latest[n].get(gram, 0), self.earlier[n]
        while start:
            yield start
            start = earlier[start - 1]

    def continuations(self, tokens: list[int], eos_token_ids: frozenset[int]) -> Iterator[tuple[int, list[int]]]:
        """Distinct continuations of the text's suffix as (match length, tokens), longest match first, most recent
        first: found as they are asked for (a proposal whose budget is full asks for no more)."""
        found = 0
        seen: set[tuple[int, ...]] = set()
        length = len(tokens)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if n > length:
                continue
            for start in self.occurrences(n, tuple(tokens[length - n :])):
                if start >= length:  # the suffix itself: nothing follows it yet
                    continue
                draft = cut_at_eos(tokens[start : start + self.config.draft_len], eos_token_ids)
                key = tuple(draft)
                if key in seen:
                    continue
                seen.add(key)
                yield n, draft
                found += 1
                if found >= self.config.max_branches:
                    return

    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        for rank, (n, draft) in enumerate(self.continuations(ctx.tokens, ctx.eos_token_ids), start=1):
            tree.graft(chain_tree(ctx.tokens[-1], draft, self.name, n / (n + 1) / rank), ctx.budget)
            if len(tree) >= ctx.budget:  # full: a later graft would fuse what matches and drop the rest (a batch
                break  # row's share of its cap is a chain or two of the flat curve's eight)
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        self.extend_index(ctx.tokens)

    def finish(self, ctx: DraftContext) -> None:
        self.latest, self.earlier = {}, {}
        self.indexed_len = 0


def chain_tree(root: int, tokens: list[int], source: str, score: float = 0.5) -> TokenTree:
    """A tree that is one chain of candidates under `root`, every node scored `score`."""
    tree = TokenTree.rooted_at(root)
    tree.add_chain(0, tokens, "candidate", source, score)
    return tree


METHOD = MethodSpec(
    name="prompt_lookup",
    config=PromptLookupConfig,
    build=lambda config, draft, vocab: PromptLookupDrafter(config),
    budget=lambda config: 1 + min(config.draft_len * config.max_branches, 15),
    about="copy what followed earlier occurrences of the text's last n-gram (prompt and output)",
    device_defaults={"cuda": {"max_branches": 4}, "flat": {"max_branches": 8, "draft_len": 16}},
    style="bold green",
)
