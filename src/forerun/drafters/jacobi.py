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
fused, where lade verifies separate chains). Scores: the n-gram's count c among the key's total C gives its first
node c / (C + 1), deeper nodes c / (c + 1) (seen more often, trusted more).

When a budget feeds none of the window's probes (the cost model decided a step was not worth it), the window
waits: it moves only with the model's choices at its own probes.

What the window is worth: the pool remembers which n-grams a trajectory produced, and the drafter counts the
accepted tokens those n-grams earned per step the window was fed (a running ratio that starts at 0.5). Each probe
node carries that worth divided among the probes as its score, so a cost model can weigh feeding the window
against its cost; under a cost model (`DraftContext.selective`) the window is proposed on every step.

Example (W=3, N=3, window L0 = [4, 5, 6], L1 = [7, 8, 9], pool {3: [(11, 12)]}, root 3):
    nodes: root 3 | probes 4 5 6 (chain) | 7 8 9 (under 4, 5, 6) | candidates 11 12
    parents: [-1, 0, 1, 2, 1, 2, 3, 0, 7]
"""

from __future__ import annotations

import random
from collections import OrderedDict

from forerun.config import JacobiConfig
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome
from forerun.drafters.tenants import TenantState
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
        self.from_window: set[tuple[int, tuple[int, ...]]] = set()
        """The n-grams (key, rest) that a Jacobi trajectory produced (not only the text)."""

    def add(self, ngram: list[int] | tuple[int, ...], window: bool = False) -> None:
        if self.capacity == 0:
            return
        key, rest = ngram[0], tuple(ngram[1:])
        if window:
            self.from_window.add((key, rest))
        entries = self.table.setdefault(key, OrderedDict())
        if rest in entries:
            entries[rest] += 1
            return
        entries[rest] = 1
        if len(entries) > self.capacity:
            if self.policy == "fifo":
                gone, _ = entries.popitem(last=False)
            else:
                gone = min(entries, key=entries.__getitem__)  # first minimum = oldest among equals
                del entries[gone]
            self.from_window.discard((key, gone))

    def count(self, key: int, rest: tuple[int, ...]) -> int:
        """How often `key` + `rest` was added (0 if not in the pool)."""
        return self.table.get(key, {}).get(rest, 0)

    def total(self, key: int) -> int:
        """The counts of every n-gram under `key`, summed."""
        return sum(self.table.get(key, {}).values())

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
        self.pools = TenantState(self.new_pool(), self.new_pool)
        self.pool = self.pools.shared
        """The n-gram pool of the request this drafter serves (its salt's; `start` picks it)."""
        self.levels: list[list[int]] = []
        """The window's tokens, [level][column]; level 0 follows the root."""
        self.probe_nodes: list[list[int]] = []
        """Node index (in this drafter's last tree) of each window token, [level][column]."""
        self.text_ngrams_done = 0
        """Start of the first n-gram of the committed text not yet pooled (pool_from_output)."""
        self.window_credit, self.window_feeds = 0.5, 1.0
        """Accepted tokens from window-made n-grams, and steps the window was fed (decayed, kept across requests)."""
        self.window_candidates: set[int] = set()
        """Nodes of the last tree drafted from window-made n-grams."""

    @property
    def window_value(self) -> float:
        """Expected accepted tokens one feed of the window earns (through the n-grams it adds to the pool)."""
        return self.window_credit / self.window_feeds

    def new_pool(self) -> NGramPool:
        return NGramPool(self.config.max_candidates, self.config.pool_policy)

    def start(self, ctx: DraftContext) -> None:
        self.pool = self.pools.get(ctx.salt)
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
        self.probe_nodes, self.window_candidates = [], set()
        if candidates or not self.config.lazy_window or ctx.selective:
            # Probes first: the engine's budget (checked >= window size by the Decoder) then cuts candidates only.
            share = self.window_value / (len(self.levels) * self.config.window)
            level0 = tree.add_chain(0, self.levels[0], role="probe", source=self.name, scores=share)
            self.probe_nodes = [level0]
            for level in self.levels[1:]:
                below = self.probe_nodes[-1]
                self.probe_nodes.append(
                    [tree.add(below[i], token, "probe", self.name, share) for i, token in enumerate(level)]
                )
        root = ctx.tokens[-1]
        total = self.pool.total(root)
        for rest in candidates:
            count = self.pool.count(root, rest)
            scores = [count / (total + 1)] + [count / (count + 1)] * (len(rest) - 1)
            nodes = tree.add_chain(0, list(rest), "candidate", self.name, scores)
            if (root, rest) in self.pool.from_window:
                self.window_candidates.update(nodes)
        return tree

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if self.config.pool_from_output:
            n = self.config.ngram
            for i in range(self.text_ngrams_done, len(ctx.tokens) - n + 1):
                self.pool.add(ctx.tokens[i : i + n])
            self.text_ngrams_done = max(self.text_ngrams_done, len(ctx.tokens) - n + 1)
        accepted = set(outcome.verdict.accepted_nodes)
        earned = sum(outcome.node_map.get(node) in accepted for node in self.window_candidates)
        fed = [outcome.node_map.get(node) for node in self.probe_nodes[-1]] if self.probe_nodes else []
        window_fed = any(node is not None for node in fed)
        self.window_credit = 0.98 * self.window_credit + earned
        self.window_feeds = 0.98 * self.window_feeds + window_fed
        if self.window_feeds < 0.5:  # long unfed: rescale both (their ratio, the worth, is what matters)
            self.window_credit, self.window_feeds = self.window_credit / self.window_feeds * 0.5, 0.5
        if not window_fed:  # the window was not fed this step: it waits
            return
        top = self.levels[-1]
        new_level = [outcome.choice(node) if node is not None else top[i] for i, node in enumerate(fed)]
        if len(self.levels) < self.config.ngram - 1:  # warm-up: the window is still filling
            self.levels.append(new_level)
            return
        for i, last in enumerate(new_level):
            self.pool.add([level[i] for level in self.levels] + [last], window=True)
        self.levels = self.levels[1:] + [new_level]

    def finish(self, ctx: DraftContext) -> None:
        self.levels, self.probe_nodes = [], []


METHOD = MethodSpec(
    name="jacobi",
    config=JacobiConfig,
    build=lambda config, draft, vocab: JacobiDrafter(config),
    budget=lambda config: 1 + config.window * (config.ngram - 1) + config.max_candidates * (config.ngram - 1),
    min_budget=lambda config: 1 + config.window * (config.ngram - 1),
    about="lade's lookahead: a window of Jacobi iterations fills an n-gram pool that drafts",
    device_defaults={
        "cuda": {"window": 7, "ngram": 5, "max_candidates": 7, "pool_from_output": False, "lazy_window": False},
        "flat": {"max_candidates": 7},
    },
    style="bold cyan",
)
