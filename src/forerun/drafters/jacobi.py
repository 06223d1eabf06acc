"""Jacobi lookahead decoding (lade, ICML 2024) as a drafter: a probe window plus an n-gram pool.

The window has N-1 levels of W tokens. Level 0 is a chain under the root (offsets 0..W-1 after it); level j
holds, in column i, the model's earlier guess for the token after (j-1, i), so column i is a vertical chain:

    root ─ L0[0] ─ L0[1] ─ L0[2]          W = 3, N = 3 (levels 0 and 1)
             │       │       │
           L1[0]   L1[1]   L1[2]           parent of L1[i] is L0[i]; depth of Lj[i] is i + j + 1

Every window token is a `probe`: fed only for its logits, never accepted. After the forward, the model's
choice at each top-level node forms the next level. Once N-1 levels are full, column i yields the n-gram
[L0[i], L1[i], ..., L(N-2)[i], choice] (each token was predicted from the ones before it), stored in the pool
under its first token; then level 0 is dropped and the window moves up. Like lade, the window is reused at the
new offsets whatever the number of accepted tokens.

Verification branch: up to G pool n-grams whose key is the root token, as candidate chains (shared prefixes
fused, where lade verifies separate chains).

Example (W=3, N=3, window L0 = [4, 5, 6], L1 = [7, 8, 9], pool {3: [(11, 12)]}, root 3):
    nodes: root 3 | probes 4 5 6 (chain) | 7 8 9 (under 4, 5, 6) | candidates 11 12
    parents: [-1, 0, 1, 2, 1, 2, 3, 0, 7]
"""

from __future__ import annotations

import random
from collections import OrderedDict

from forerun.config import JacobiConfig
from forerun.drafters.base import DraftContext, StepOutcome
from forerun.tree import TokenTree


class NGramPool:
    """N-grams keyed by their first token, at most `capacity` continuations (N-1 tokens) per key.

    fifo: a new n-gram enters at the end, the oldest leaves (lade); a known one stays where it is.
    frequency: each sighting counts; the least counted leaves (the oldest among equals).
    Queries return the most recent (fifo) or most counted (frequency) first. Memory is bounded by
    vocabulary size x capacity x (N-1) tokens.
    """

    def __init__(self, capacity: int, policy: str = "fifo") -> None:
        self.capacity, self.policy = capacity, policy
        self.table: dict[int, OrderedDict[tuple[int, ...], int]] = {}

    def add(self, ngram: list[int] | tuple[int, ...]) -> None:
        if self.capacity == 0:
            return
        key, rest = ngram[0], tuple(ngram[1:])
        entries = self.table.setdefault(key, OrderedDict())
        if rest in entries:
            entries[rest] += 1
            return
        entries[rest] = 1
        if len(entries) > self.capacity:
            if self.policy == "fifo":
                entries.popitem(last=False)
            else:
                del entries[min(entries, key=entries.__getitem__)]  # first minimum = oldest among equals

    def query(self, key: int, limit: int) -> list[tuple[int, ...]]:
        entries = self.table.get(key)
        if not entries:
            return []
        if self.policy == "fifo":
            ordered = list(reversed(entries))
        else:
            ordered = sorted(reversed(entries), key=lambda rest: -entries[rest])  # stable: recent first among equals
        return ordered[:limit]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self.table.values())


class JacobiDrafter:
    name = "jacobi"

    def __init__(self, config: JacobiConfig | None = None) -> None:
        self.config = config or JacobiConfig()
        self.pool = NGramPool(self.config.max_candidates, self.config.pool_policy)
        self.levels: list[list[int]] = []
        self.probe_nodes: list[list[int]] = []
        self.text_ngrams_done = 0
        """Node index (in this drafter's last tree) of each window token, [level][column]."""

    @property
    def probe_count(self) -> int:
        return self.config.window * (self.config.ngram - 1)

    def start(self, ctx: DraftContext) -> None:
        prompt = ctx.tokens[: ctx.prompt_len]
        self.text_ngrams_done = max(0, ctx.prompt_len - self.config.ngram + 1)
        rng = random.Random(self.config.seed)
        self.levels = [[rng.choice(prompt) for _ in range(self.config.window)]]
        if self.config.pool_from_prompt:
            n = self.config.ngram
            for i in range(len(prompt) - n + 1):
                self.pool.add(prompt[i : i + n])

    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        candidates = self.pool.query(ctx.tokens[-1], self.config.max_candidates)
        self.probe_nodes = []
        if candidates or not self.config.lazy_window:
            # Probes first: the engine's budget (checked >= window size by the Decoder) then cuts candidates only.
            level0 = tree.add_chain(0, self.levels[0], role="probe", source=self.name)
            self.probe_nodes = [level0]
            for level in self.levels[1:]:
                below = self.probe_nodes[-1]
                self.probe_nodes.append(
                    [tree.add(below[i], token, "probe", self.name) for i, token in enumerate(level)]
                )
        for rest in candidates:
            tree.add_chain(0, list(rest), "candidate", self.name)
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if self.config.pool_from_output:
            n = self.config.ngram
            for i in range(self.text_ngrams_done, len(ctx.tokens) - n + 1):
                self.pool.add(ctx.tokens[i : i + n])
            self.text_ngrams_done = max(self.text_ngrams_done, len(ctx.tokens) - n + 1)
        if not self.probe_nodes:  # lazy window, nothing verified this step: the window waits
            return
        top = self.levels[-1]
        new_level = []
        for i, node in enumerate(self.probe_nodes[-1]):
            mapped = outcome.node_map.get(node)
            new_level.append(outcome.choices[mapped] if mapped is not None else top[i])
        if len(self.levels) < self.config.ngram - 1:  # warm-up: the window is still filling
            self.levels.append(new_level)
            return
        for i, last in enumerate(new_level):
            self.pool.add([level[i] for level in self.levels] + [last])
        self.levels = self.levels[1:] + [new_level]

    def finish(self, ctx: DraftContext) -> None:
        self.levels, self.probe_nodes = [], []
