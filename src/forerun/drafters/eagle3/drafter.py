"""The EAGLE-3 drafter: a trained head reads the target's own hidden states and drafts a dynamic tree.

After every verified step the engine hands over the target's features at the positions it committed
(`StepOutcome.features`, tapped off the verification forward: no extra target forward). The head reads them,
one position each, into its own cache (preallocated slots: `forerun.drafters.eagle3.runner`): position i pairs
g_i with the token x_{i+1} after it. Its output at the last such position predicts the child of the new root;
deeper levels feed the head its own outputs (module docstring of `forerun.drafters.eagle3.head`). Each level
is one head forward of the expanded nodes, with a tree mask: a node sees the committed positions, its ancestors
and itself. Drafted nodes write the slots after the committed ones, which the next step's committed positions
write over.

Example (the tree after "... The cat", root " cat", depth 2, width 2, topk 2):
    root( cat) -> " sat" (0.6) -> " on" (0.9), " down" (0.05)
               -> " is"  (0.3) -> " a" (0.4),  " on" (0.2)
Each node's score is the head's probability of it given its parent (the cost model calibrates them).

While the budget's switch keeps the head out (`sit_out`), the committed positions' features wait, and the head reads
them all in one forward when it drafts again: its first step back drafts, with the whole text behind it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from forerun.config import Eagle3Config
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome
from forerun.drafters.eagle3.costs import HeadCosts, head_costs
from forerun.drafters.eagle3.head import Eagle3Head
from forerun.drafters.eagle3.runner import ROWS, HeadRead, HeadRunner
from forerun.tree import TokenTree


class Eagle3Drafter:
    """Drafts with `head` (`forerun.drafters.eagle3.load_head`); `feature_layers` tells the engine what to tap.
    `capture`: the head's forwards are captured as CUDA graphs where it is on a card (`HeadRunner`); a copy (a
    batch's row) runs them eagerly on slots of its own."""

    name = "eagle3"
    costly = True
    """Its head's forwards are time the cost model's curve does not see: it sits out while it does not pay."""

    def __init__(self, config: Eagle3Config, head: Eagle3Head, capture: bool = True) -> None:
        self.config, self.head = config, head
        self.feature_layers = head.aux_layers
        self.runner = HeadRunner(head, config.topk, capture)
        self.committed = 0
        """Slots of the head's cache that hold committed positions (0..committed-1); drafts go after them."""
        self.last: HeadRead | None = None
        """The head's read of the newest committed position: its output [1, H] and the root's likeliest children."""
        self.outputs: dict[int, torch.Tensor] = {}
        """This step's drafted nodes' head outputs (each predicts the node's children)."""
        self.costs: HeadCosts | None = None
        """What its forwards cost on this device, where a budget prices them (`price`); None: not priced."""
        self.priced = 0.0
        """Seconds its forwards cost on `costs` since `spent` was last asked."""
        self.reach = config.depth
        """Levels to draft this step: one below the deepest of its nodes the budget fed last time (`observe`)."""
        self.drafted = 0
        """Levels this step's proposal has below its root."""
        self.pending: list[tuple[list[int], list[int], torch.Tensor]] = []
        """Committed positions read while sitting out, to read on drafting again: (tokens, positions, features)."""

    def __copy__(self) -> Eagle3Drafter:
        copied = Eagle3Drafter(self.config, self.head, capture=False)
        copied.costs = self.costs
        return copied

    def price(self, cache_dir: str | Path | None) -> None:
        """Price its forwards from now on at what they cost on this device (`head_costs`: stored in `cache_dir`, or
        measured now); a budget that prices steps instead of timing them asks for it."""
        self.costs = head_costs(self.head, self.runner.topk, self.runner.capture, cache_dir)

    def spent(self) -> float:
        """Seconds the head's forwards cost on its measured `costs` since the last call (0 where not priced)."""
        priced, self.priced = self.priced, 0.0
        return priced

    def forwarded(self, rows: int, project: bool) -> None:
        """One forward of the head of `rows` rows ran (`HeadCosts.cost`)."""
        if self.costs is not None:
            self.priced += self.costs.cost(rows, project)

    @torch.inference_mode()
    def warm(self, length: int) -> float:
        """Make the head's slots and graphs for texts of `length` tokens now (`Decoder.warm_up`); the seconds."""
        started = time.perf_counter()
        self.runner.warm(length + self.drafted_slots(), self.config.width)
        return time.perf_counter() - started

    def drafted_slots(self) -> int:
        """Slots a step's drafts take at most: every level but the last reads `width` nodes."""
        return (self.config.depth - 1) * self.config.width

    def start(self, ctx: DraftContext) -> None:
        self.committed, self.last, self.outputs, self.pending = 0, None, {}, []
        self.reach, self.drafted = self.config.depth, 0

    @torch.inference_mode()
    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """Read the committed positions' features: positions T-1-m .. T-2 with the tokens after each."""
        if outcome.features is None or not len(outcome.features):  # nothing tapped: read again from the next step
            self.start(ctx)
            return
        if self.drafted:  # the budget's choice: levels it did not feed were forwards of the head for nothing
            fed = max((outcome.tree.depths[node] for mine, node in outcome.node_map.items() if mine), default=0)
            self.reach = min(self.config.depth, fed + 1)
        self.catch_up()
        self.read_committed(*committed_span(ctx, outcome.features))

    def sit_out(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """A step verified without the head (the switch measured it not paying): keep the committed positions'
        features for the step it drafts again, which reads them in one forward (`catch_up`) instead of one a step
        now. Its cache starts over where more than `config.catch_up` positions wait (from the newest of them) or a
        step tapped nothing."""
        keep = self.config.catch_up
        if outcome.features is None or not len(outcome.features) or keep == 0:
            self.start(ctx)
            return
        self.pending.append(committed_span(ctx, outcome.features))
        waiting = sum(len(tokens) for tokens, _, _ in self.pending)
        if waiting > keep:  # the newest positions, read into a fresh cache (no gap in what it sees)
            tokens, positions, features = (part[-keep:] for part in joined(self.pending))
            self.committed, self.last, self.pending = 0, None, [(tokens, positions, features)]

    def catch_up(self) -> None:
        """Read what waited while the head sat out, if anything (one forward, chunked by the runner's rows)."""
        if self.pending:
            waiting, self.pending = joined(self.pending), []
            self.read_committed(*waiting)

    def read_committed(self, tokens: list[int], positions: list[int], features: torch.Tensor) -> None:
        """Read committed positions `positions` (each with the token after it, `tokens`, and its features [m, F])
        into the slots after the committed ones; the last one's read drafts the root's children."""
        first, count = self.committed, len(tokens)
        self.runner.reserve(first, first + count + self.drafted_slots())
        slots = list(range(first, first + count))
        self.last = self.runner.read(tokens, positions, slots, [(slot + 1, []) for slot in slots], features,
                                     True, True)  # fmt: skip
        self.committed = first + count
        for start in range(0, count, ROWS[-1]):  # the runner's forwards: chunks of its largest row count
            self.forwarded(min(ROWS[-1], count - start), True)
        self.outputs = {0: self.last.out[0]}  # the root's: it predicts the root's children

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        self.drafted = 0
        self.catch_up()
        if self.last is None or ctx.budget <= 1:
            return tree
        self.outputs = {0: self.last.out[0]}
        position = len(ctx.tokens) - 1  # the head position of the root's children: the root's own
        frontier, read = [(0, 0.0)], self.last  # (tree node, path log-probability); its rows' likeliest children
        entries: list[int] = []  # the tree node of each drafted slot, in order
        floor = math.log(self.config.min_prob) if self.config.min_prob > 0 else -math.inf
        for level in range(self.reach):
            added = self.children(tree, frontier, read, ctx)
            self.drafted += bool(added)
            if not added or level == self.reach - 1 or len(tree) >= ctx.budget:
                break  # (a full tree: another level's forward would add nothing)
            expand = [
                item for item in sorted(added, key=lambda item: -item[2])[: self.config.width] if item[2] >= floor
            ]
            if not expand:  # the head is unsure past this level: no forward of it for guesses that would not hold
                break
            read = self.read_level(tree, [node for node, _, _ in expand], entries, position)
            entries.extend(node for node, _, _ in expand)
            frontier = [(node, logp) for node, _, logp in expand]
            position += 1
        return tree

    def children(self, tree: TokenTree, frontier: list[tuple[int, float]], read: HeadRead,
                 ctx: DraftContext) -> list[tuple[int, int, float]]:  # fmt: skip
        """Add the `topk` most probable children of each frontier node (`read`'s rows, in order), most probable
        paths first, while the budget lasts; returns (node, token, path log-probability) of the nodes added."""
        found = [
            (node, token, prob, logp + math.log(max(prob, 1e-12)))
            for (node, logp), tokens, row in zip(frontier, read.ids.tolist(), read.probs.tolist(), strict=True)
            if node == 0 or tree.tokens[node] not in ctx.eos_token_ids
            for token, prob in zip(tokens, row, strict=True)
        ]
        added = []
        for parent, token, prob, logp in sorted(found, key=lambda item: -item[3]):
            if len(tree) >= ctx.budget:
                break
            added.append((tree.add(parent, token, source=self.name, score=prob), token, logp))
        return added

    @torch.inference_mode()
    def read_level(self, tree: TokenTree, nodes: list[int], entries: list[int], position: int) -> HeadRead:
        """One head forward of `nodes` (one level) at head position `position`, each seeing the committed slots,
        its ancestors' drafted slots and its own; returns each node's output (which predicts its children) and
        its likeliest children."""
        hidden = torch.stack([self.outputs[tree.parents[node]] for node in nodes])
        drafted = self.committed + len(entries)  # this level's first slot
        slot_of = {entry: self.committed + i for i, entry in enumerate(entries)}
        visible = [
            (self.committed, [slot_of[n] for n in tree.path_to(node) if n in slot_of] + [drafted + row])
            for row, node in enumerate(nodes)
        ]  # the root's position is committed: it has no drafted slot
        read = self.runner.read([tree.tokens[node] for node in nodes], [position] * len(nodes),
                                list(range(drafted, drafted + len(nodes))), visible, hidden, False)  # fmt: skip
        self.outputs.update(zip(nodes, read.out, strict=True))
        self.forwarded(len(nodes), False)
        return read

    def finish(self, ctx: DraftContext) -> None:
        self.start(ctx)


def committed_span(ctx: DraftContext, features: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """A step's committed positions as the head reads them: the last m = len(features) positions before the newest
    token, T-1-m .. T-2, each with the token after it.

    Example (tokens [5, 6, 7, 8, 9], 2 positions tapped):
        >>> ctx = DraftContext([5, 6, 7, 8, 9], 2, 8, frozenset())
        >>> committed_span(ctx, torch.zeros(2, 3))[:2]
        ([8, 9], [2, 3])
    """
    count, end = features.shape[0], len(ctx.tokens) - 1
    return ctx.tokens[end - count + 1 : end + 1], list(range(end - count, end)), features


def joined(spans: list[tuple[list[int], list[int], torch.Tensor]]) -> tuple[list[int], list[int], torch.Tensor]:
    """Spans of committed positions (`committed_span`'s), one after another, as one."""
    return (
        [token for tokens, _, _ in spans for token in tokens],
        [position for _, positions, _ in spans for position in positions],
        torch.cat([features for _, _, features in spans]),
    )


METHOD = MethodSpec(
    name="eagle3",
    config=Eagle3Config,
    build=lambda config, head, vocab: Eagle3Drafter(config, head),
    budget=lambda config: 1 + config.topk + (config.depth - 1) * config.width,
    about="a trained EAGLE-3 head reads the target's hidden states and drafts a dynamic tree (SpecForge's layout)",
    style="bold magenta",
    model_free=False,
    reads_head=True,
)
