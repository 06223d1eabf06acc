"""Trie lookahead (PIA, KDD 2024): a bounded frequency trie over prompts and outputs proposes a multi-branch tree.

Windows of `max_query_length + branch_length` tokens, starting at every position of a text, are inserted from the
trie's top, adding a weight to the count of every node on the way; so the top level is "a token", its subtree
"what followed it". Prompt windows count `prompt_weight` and are withdrawn when the request ends; output windows
count `output_weight` and stay (outputs enter incrementally, as their windows complete).

Query: the context's last `max_query_length` tokens (then fewer) are walked from the top; the matched node's
subtree is drafted best-first by estimated path probability (count / sum of sibling counts, multiplied down the
path), at most `decoding_length` nodes and `branch_length` deep. Each node's score (its chance given its parent,
for the cost model) is its count / (sum of its siblings' counts + 1): a path seen once scores 0.5, one seen 9
times out of 9 scores 0.9.

Memory is bounded by a global node budget (`max_nodes`): beyond it every count is halved and nodes under a
threshold are pruned, so rare paths leave first and frequent ones stay. `save`/`load` use safetensors (no pickle).

Example (max_query_length=1, branch_length=2): inserting [1, 2, 3] and [1, 2, 4] twice and [1, 5, 6] once gives
    top ─ 1 (3) ─ 2 (3) ─ 3 (1)        querying [.., 1] drafts  root(1) ─ 2 ─ 4     (4 is likelier than 3)
                 │        └─ 4 (2)                                   │     └─ 3
                 └─ 5 (1) ─ 6 (1)                                   └─ 5 ─ 6
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from forerun.config import TrieConfig
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome
from forerun.drafters.tenants import TenantState
from forerun.drafters.trie_file import FORMAT, VERSION  # noqa: F401 - the file format names it
from forerun.tree import TokenTree

Children = dict[int, int]  # a node's children, token -> node id: ints only, so the garbage collector skips it


class TokenTrie:
    """The trie itself, shared by threads: `insert`, `withdraw_text`, `withdraw_prompt`, `evict`, `draft` and `save`
    take the lock (one writer at a time, no torn reads); `insert_text` inserts window by window, each under the
    lock; `match` is called by `draft` under its lock; `load` builds a new trie that no other thread sees yet.

    Nodes are ids into flat lists (0 is the top): `kids[i]` its children (None for a leaf), `count[i]` its weight
    from outputs and corpora (kept), `prompt[i]` from running requests' prompts (withdrawn as each ends); removed
    ids are reused. No node is an object: a long prompt adds tens of thousands, and as tracked objects they set off
    full collections that walked the whole process while no row of a batch moved (`benchmarks/drafter_host.py`).

    Example:
        >>> trie = TokenTrie(); trie.insert([1, 2, 3], 1.0); trie.insert([1, 2, 4], 2.0, prompt=True)
        >>> trie.weights([1, 2]), trie.weights([1, 2, 4]), trie.weights([9]), len(trie)
        ((1.0, 2.0), (0.0, 2.0), None, 4)
    """

    def __init__(self, max_nodes: int = 200_000) -> None:
        self.kids: list[Children | None] = [{}]
        self.count: list[float] = [0.0]
        self.prompt: list[float] = [0.0]
        self.free: list[int] = []
        """Ids of removed nodes, reused before the lists grow."""
        self.max_nodes = max_nodes
        self.nodes = 0
        self.lock = threading.RLock()

    def new_node(self) -> int:
        """A fresh node's id, with no children and no weight."""
        if self.free:
            return self.free.pop()
        self.kids.append(None)
        self.count.append(0.0)
        self.prompt.append(0.0)
        return len(self.kids) - 1

    def weight(self, node: int) -> float:
        return self.count[node] + self.prompt[node]

    def walk(self, path: Sequence[int]) -> int | None:
        """The node `path` leads to from the top, or None where there is none."""
        node: int | None = 0
        for token in path:
            children = self.kids[node]
            node = None if children is None else children.get(token)
            if node is None:
                return None
        return node

    def weights(self, path: Sequence[int]) -> tuple[float, float] | None:
        """The (output, prompt) weights of the node `path` leads to from the top, or None where there is none."""
        with self.lock:
            node = self.walk(path)
            return None if node is None else (self.count[node], self.prompt[node])

    def insert(self, window: list[int], weight: float, prompt: bool = False) -> None:
        with self.lock:
            kids, counts = self.kids, self.prompt if prompt else self.count
            node = 0
            for token in window:
                children = kids[node]
                if children is None:
                    children = kids[node] = {}
                child = children.get(token)
                if child is None:
                    child = children[token] = self.new_node()
                    self.nodes += 1
                counts[child] += weight
                node = child
            if self.nodes > self.max_nodes:
                self.evict()

    def insert_text(
        self,
        tokens: list[int],
        window: int,
        weight: float,
        prompt: bool = False,
        start: int = 0,
        complete_only: bool = False,
        skip_anchors: tuple[int, ...] = (),
    ) -> int:
        """Insert the windows of `tokens` starting at positions >= start; returns the next start position.

        Windows whose first token is in `skip_anchors` are not inserted.
        """
        end = len(tokens) - window + 1 if complete_only else len(tokens) - 1
        for i in range(start, max(start, end)):
            if tokens[i] not in skip_anchors:
                self.insert(tokens[i : i + window], weight, prompt)
        return max(start, end)

    def withdraw_text(self, tokens: list[int], window: int, weight: float, skip_anchors: tuple[int, ...] = ()) -> None:
        """Take back the prompt weight that `insert_text(tokens, window, weight, prompt=True)` added (never below
        zero: eviction may have halved it since), and remove the nodes left with no weight at all. Concurrent
        requests (a batch, the server) each withdraw only their own prompt."""
        with self.lock:
            kids, count, prompt = self.kids, self.count, self.prompt
            for i in range(max(0, len(tokens) - 1)):
                if tokens[i] in skip_anchors:
                    continue
                parent = 0
                for token in tokens[i : i + window]:
                    children = kids[parent]
                    node = None if children is None else children.get(token)
                    if node is None:
                        break
                    prompt[node] = max(0.0, prompt[node] - weight)
                    # Only nodes on the prompt's own windows lose weight, so only they can be left with none
                    # (a child never outweighs its parent: the subtree goes with them). Pruning here, not over the
                    # whole trie, keeps a finishing request's cost to its prompt (~15 ms a request had been spent
                    # walking a trie of a few hundred requests, stalling every row of a batch).
                    if count[node] + prompt[node] <= 1e-9:
                        del children[token]  # type: ignore[union-attr]
                        self.nodes -= self.remove(node)
                        break
                    parent = node

    def withdraw_prompt(self) -> None:
        """Drop every prompt weight; nodes left with no weight at all are removed."""
        with self.lock:
            count = self.count
            self.nodes -= self.prune(lambda node: count[node] <= 0.0, reset_prompt=True)

    def evict(self) -> None:
        """Halve all counts and prune those under 1 until the trie is within 80% of its budget."""
        with self.lock:
            threshold = 1.0
            while self.nodes > 0.8 * self.max_nodes:
                self.count[:] = [c * 0.5 for c in self.count]  # removed ids hold 0: halving them changes nothing
                self.prompt[:] = [c * 0.5 for c in self.prompt]
                self.nodes -= self.prune(lambda node: self.weight(node) < threshold)

    def prune(self, condemned: Callable[[int], bool], reset_prompt: bool = False) -> int:
        """Remove condemned subtrees (a child's weight never exceeds its parent's); returns the nodes removed."""
        removed, stack, kids = 0, [0], self.kids
        while stack:
            children = kids[stack.pop()]
            if not children:
                continue
            for token, child in list(children.items()):
                if condemned(child):
                    del children[token]
                    removed += self.remove(child)
                    continue
                if reset_prompt:
                    self.prompt[child] = 0.0
                stack.append(child)
        return removed

    def remove(self, node: int) -> int:
        """Free `node` and its subtree (already cut from its parent); returns how many nodes that was."""
        size, stack, kids = 0, [node], self.kids
        while stack:
            current = stack.pop()
            size += 1
            children = kids[current]
            if children:
                stack.extend(children.values())
            kids[current] = None
            self.count[current] = self.prompt[current] = 0.0
            self.free.append(current)
        return size

    def size(self, node: int = 0) -> int:
        """Nodes in the subtree under `node`, itself included (the top counts one: `len` does not count it)."""
        size, stack = 0, [node]
        while stack:
            children = self.kids[stack.pop()]
            size += 1
            if children:
                stack.extend(children.values())
        return size

    def match(self, context: list[int], max_query_length: int) -> int | None:
        """The node reached by the longest suffix of `context` (<= max_query_length tokens) found in the trie, where
        it has children (something to draft)."""
        for length in range(min(max_query_length, len(context)), 0, -1):
            node = self.walk(context[len(context) - length :])
            if node is not None and self.kids[node]:
                return node
        return None

    def draft(
        self, context: list[int], config: TrieConfig, eos: frozenset[int], source: str, budget: int | None = None
    ) -> TokenTree:
        """Best-first draft under the matched node: up to decoding_length nodes (and fewer than `budget`, the root
        counted), branch_length deep."""
        tree = TokenTree.rooted_at(context[-1])
        length = config.decoding_length if budget is None else min(config.decoding_length, budget - 1)
        with self.lock:
            node = self.match(context, config.max_query_length)
            if node is None:
                return tree
            kids, count, prompt = self.kids, self.count, self.prompt
            heap: list[tuple[float, int, int, int, int, int, float]] = []
            order = 0

            def push_children(parent_node: int, parent_index: int, probability: float, depth: int) -> None:
                nonlocal order
                children = kids[parent_node]
                if not children:
                    return
                total = sum(count[child] + prompt[child] for child in children.values())
                if total <= 0:
                    return
                for token, child in children.items():
                    weight = count[child] + prompt[child]
                    if weight > 0:
                        order += 1
                        share = weight / total
                        score = weight / (total + 1)
                        heapq.heappush(heap, (-probability * share, order, child, token, parent_index, depth, score))

            push_children(node, 0, 1.0, 1)
            # a trie's children are distinct tokens: nothing to fuse, so nodes are appended without `add`'s checks
            tokens, parents, depths, scores = tree.tokens, tree.parents, tree.depths, tree.scores
            children = tree.children
            while heap and len(tokens) <= length:
                negative, _, child, token, parent_index, depth, score = heapq.heappop(heap)
                index = len(tokens)
                children[(parent_index, token)] = index
                tokens.append(token)
                parents.append(parent_index)
                depths.append(depth)
                scores.append(score)
                if depth < config.branch_length and token not in eos:
                    push_children(child, index, -negative, depth + 1)
            tree.roles.extend(["candidate"] * (len(tokens) - 1))
            tree.sources.extend([source] * (len(tokens) - 1))
        return tree

    def __len__(self) -> int:
        return self.nodes

    def save(self, path: str | Path, config: TrieConfig | None = None) -> None:
        """Write the trie (output counts only) with safetensors (`forerun.drafters.trie_file`)."""
        from forerun.drafters.trie_file import write_trie

        with self.lock:
            write_trie(self, path, config)

    @classmethod
    def load(cls, path: str | Path, max_nodes: int | None = None, vocab: int | None = None) -> TokenTrie:
        """Read a file written by `save`; anything else raises ValueError naming the file and what is wrong (the
        caller's trie is untouched). Every value is checked before it is used (`trie_file.read_trie`), and the
        structure as it is built: a node before its parent or a token twice under one parent."""
        from forerun.drafters.trie_file import read_trie

        stored_budget, parents, tokens, counts = read_trie(path, vocab)
        trie = cls(max_nodes or stored_budget)
        for index, (parent, token, count) in enumerate(zip(parents, tokens, counts, strict=True)):
            if not -1 <= parent < index:
                raise ValueError(f"{path}: corrupt trie (node {index}'s parent {parent} is not before it)")
            above = parent + 1  # the file's node i is this trie's node i + 1 (0 is the top)
            children = trie.kids[above]
            if children is None:
                children = trie.kids[above] = {}
            if token in children:
                raise ValueError(f"{path}: corrupt trie (token {token} twice under node {parent})")
            node = children[token] = trie.new_node()
            trie.count[node] = count
        trie.nodes = len(tokens)
        return trie


SALTED_SHARE = 16
"""A salted tenant's trie holds this share of `max_nodes` (1/16: with up to 64 tenants, the salted tries together
hold at most 4 times the shared one)."""


class TrieDrafter:
    """Drafts from a `TokenTrie` that outlives requests (owned by the Decoder, shareable across threads)."""

    name = "trie"

    def __init__(self, config: TrieConfig | None = None, trie: TokenTrie | None = None) -> None:
        self.config = config or TrieConfig()
        shared = trie if trie is not None else TokenTrie(self.config.max_nodes)  # an empty trie is falsy
        salted_nodes = max(16, self.config.max_nodes // SALTED_SHARE)
        self.tenants = TenantState(shared, lambda: TokenTrie(salted_nodes))
        self.window = self.config.max_query_length + self.config.branch_length
        self.next_output_start = 0
        self.current = shared
        """The trie of the request this drafter serves (its salt's; `start` picks it)."""

    @property
    def trie(self) -> TokenTrie:
        """The shared trie of unsalted requests: the one saved, loaded and taught by `learn`."""
        return self.tenants.shared

    @trie.setter
    def trie(self, trie: TokenTrie) -> None:
        self.tenants.shared = self.current = trie

    def start(self, ctx: DraftContext) -> None:
        self.current = self.tenants.get(ctx.salt)
        if self.config.prompt_weight > 0:
            self.current.insert_text(
                ctx.tokens[: ctx.prompt_len],
                self.window,
                self.config.prompt_weight,
                prompt=True,
                skip_anchors=self.config.skip_anchors,
            )
        # Output windows start where the query context of the first output token starts.
        self.next_output_start = max(0, ctx.prompt_len - self.config.max_query_length)

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.current.draft(ctx.tokens, self.config, ctx.eos_token_ids, self.name, ctx.budget)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        self.next_output_start = self.current.insert_text(
            ctx.tokens,
            self.window,
            self.config.output_weight,
            start=self.next_output_start,
            complete_only=True,
            skip_anchors=self.config.skip_anchors,
        )

    def finish(self, ctx: DraftContext) -> None:
        self.current.insert_text(
            ctx.tokens,
            self.window,
            self.config.output_weight,
            start=self.next_output_start,
            skip_anchors=self.config.skip_anchors,
        )
        if self.config.prompt_weight > 0:  # this request's prompt only: other requests may be running beside it
            self.current.withdraw_text(
                ctx.tokens[: ctx.prompt_len], self.window, self.config.prompt_weight, self.config.skip_anchors
            )

    def learn(self, tokens: list[int]) -> None:
        """Insert a whole text (a corpus document, a past answer) with the output weight."""
        config = self.config
        self.trie.insert_text(list(tokens), self.window, config.output_weight, skip_anchors=config.skip_anchors)


METHOD = MethodSpec(
    name="trie",
    config=TrieConfig,
    build=lambda config, draft, vocab: TrieDrafter(config),
    budget=lambda config: 1 + config.decoding_length,
    about="PIA's lookahead: a frequency trie of prompts and past outputs drafts a multi-branch tree",
    device_defaults={
        "cuda": {"decoding_length": 32, "branch_length": 12},
        "flat": {"decoding_length": 64, "branch_length": 16},
    },
    style="bold magenta",
    saves_state=True,
)


def trie_drafter_of(drafters: list, method: str) -> TrieDrafter:
    """The trie drafter among a Decoder's `drafters` (whose trie `save_cache` / `load_cache` move), or a ValueError
    naming `method` when it keeps none."""
    for drafter in drafters:
        if isinstance(drafter, TrieDrafter):
            return drafter
    raise ValueError(f"method {method!r} keeps no trie to save or load; use a method with 'trie' in it")
