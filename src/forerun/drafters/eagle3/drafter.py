"""The EAGLE-3 drafter: a trained head reads the target's own hidden states and drafts a dynamic tree.

After every verified step the engine hands over the target's features at the positions it committed
(`StepOutcome.features`, tapped off the verification forward: no extra target forward). The head reads them,
one position each, into its own cache: position i pairs g_i with the token x_{i+1} after it. Its output at the
last such position predicts the child of the new root; deeper levels feed the head its own outputs (module
docstring of `forerun.drafters.eagle3.head`). Each level is one head forward of the expanded nodes, with a tree
mask: a node sees the committed positions, its ancestors and itself. The drafted entries are dropped from the
head's cache before it reads the next step's features.

Example (the tree after "... The cat", root " cat", depth 2, width 2, topk 2):
    root( cat) -> " sat" (0.6) -> " on" (0.9), " down" (0.05)
               -> " is"  (0.3) -> " a" (0.4),  " on" (0.2)
Each node's score is the head's probability of it given its parent (the cost model calibrates them).
"""

from __future__ import annotations

import math

import torch

from forerun.config import Eagle3Config
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome
from forerun.drafters.eagle3.head import Eagle3Head, HeadCache
from forerun.tree import TokenTree


class Eagle3Drafter:
    """Drafts with `head` (`forerun.drafters.eagle3.load_head`); `feature_layers` tells the engine what to tap."""

    name = "eagle3"
    costly = True
    """Its head's forwards are time the cost model's curve does not see: it sits out while it does not pay."""

    def __init__(self, config: Eagle3Config, head: Eagle3Head) -> None:
        self.config, self.head = config, head
        self.feature_layers = head.aux_layers
        self.cache = HeadCache()
        self.committed = 0
        """Entries of `cache` that belong to committed positions (the rest are the last step's drafts)."""
        self.last: torch.Tensor | None = None
        """The head's output [H] at the newest position it read: it predicts the root's child."""
        self.outputs: dict[int, torch.Tensor] = {}
        """This step's drafted nodes' head outputs (each predicts the node's children)."""
        self.forwards = 0
        """Forwards of the head since `spent` was last asked."""
        self.parameters = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed_tokens."))
        """What one forward of the head reads (its embedding is looked up, not read)."""

    def spent(self) -> float:
        """Parameters the head's forwards read since the last call (the cost model prices them)."""
        forwards, self.forwards = self.forwards, 0
        return float(forwards * self.parameters)

    def start(self, ctx: DraftContext) -> None:
        self.cache, self.committed, self.last, self.outputs = HeadCache(), 0, None, {}

    @torch.inference_mode()
    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """Read the committed positions' features: positions T-1-m .. T-2 with the tokens after each."""
        if outcome.features is None:  # nothing tapped (a batch, a replayed graph): read again from the next step
            self.start(ctx)
            return
        self.cache.crop(self.committed)
        count, end = outcome.features.shape[0], len(ctx.tokens) - 1
        device = outcome.features.device
        positions = torch.arange(end - count, end, device=device)
        tokens = torch.tensor(ctx.tokens[end - count + 1 : end + 1], device=device)
        features = outcome.features.to(self.head.fc.weight.dtype)
        out = self.head(tokens, self.head.project(features), positions, self.cache)
        self.committed, self.last, self.forwards = self.cache.length, out[-1], self.forwards + 1

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        if self.last is None or ctx.budget <= 1:
            return tree
        self.cache.crop(self.committed)
        self.outputs = {}
        position = len(ctx.tokens) - 1  # the head position of the root's children: the root's own
        frontier = [(0, self.last, 0.0)]  # (tree node, head output predicting its children, path log-probability)
        entries: list[int] = []  # the tree node of each drafted cache entry, in order
        floor = math.log(self.config.min_prob) if self.config.min_prob > 0 else -math.inf
        for level in range(self.config.depth):
            added = self.children(tree, frontier, ctx)
            if not added or level == self.config.depth - 1:
                break
            expand = [
                item for item in sorted(added, key=lambda item: -item[2])[: self.config.width] if item[2] >= floor
            ]
            if not expand:  # the head is unsure past this level: no forward of it for guesses that would not hold
                break
            outs = self.read_level(tree, [node for node, _, _ in expand], entries, position)
            entries.extend(node for node, _, _ in expand)
            frontier = [(node, out, logp) for (node, _, logp), out in zip(expand, outs, strict=True)]
            position += 1
        return tree

    def children(self, tree: TokenTree, frontier, ctx: DraftContext) -> list[tuple[int, int, float]]:
        """Add the `topk` most probable children of each frontier node, most probable paths first, while the
        budget lasts; returns (node, token, path log-probability) of the nodes added."""
        frontier = [item for item in frontier if item[0] == 0 or tree.tokens[item[0]] not in ctx.eos_token_ids]
        if not frontier:
            return []
        outs = torch.stack([out for _, out, _ in frontier])
        probs = torch.softmax(self.head.draft_logits(outs).float(), dim=-1)  # [frontier, draft vocabulary]
        top = probs.topk(min(self.config.topk, probs.shape[-1]), dim=-1)
        targets = self.head.target_ids(top.indices).tolist()
        found = [
            (node, token, prob, logp + math.log(max(prob, 1e-12)))
            for (node, _, logp), tokens, row in zip(frontier, targets, top.values.tolist(), strict=True)
            for token, prob in zip(tokens, row, strict=True)
        ]
        added = []
        for parent, token, prob, logp in sorted(found, key=lambda item: -item[3]):
            if len(tree) >= ctx.budget:
                break
            added.append((tree.add(parent, token, source=self.name, score=prob), token, logp))
        return added

    def read_level(self, tree: TokenTree, nodes: list[int], entries: list[int], position: int) -> list[torch.Tensor]:
        """One head forward of `nodes` (one level) at head position `position`, each seeing the committed entries,
        its ancestors' drafted entries and itself; returns each node's output, which predicts its children."""
        device = self.last.device
        hidden = torch.stack([self.last if tree.parents[n] == 0 else self.outputs[tree.parents[n]] for n in nodes])
        # The drafted part is built on the host and moved once (an element written into a card's tensor is a kernel
        # launch of its own); every node sees every committed entry.
        drafted = []
        for row, node in enumerate(nodes):
            lineage = set(tree.path_to(node))  # the root's position is committed: it has no drafted entry
            own = [False] * len(nodes)
            own[row] = True
            drafted.append([entry in lineage for entry in entries] + own)
        committed = torch.ones(len(nodes), self.committed, dtype=torch.bool, device=device)
        visible = torch.cat([committed, torch.tensor(drafted, dtype=torch.bool).to(device)], dim=1)
        tokens = torch.tensor([tree.tokens[node] for node in nodes], device=device)
        positions = torch.full((len(nodes),), position, device=device)
        outs = list(self.head(tokens, hidden, positions, self.cache, visible))
        self.outputs.update(zip(nodes, outs, strict=True))
        self.forwards += 1
        return outs

    def finish(self, ctx: DraftContext) -> None:
        self.start(ctx)


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
