"""The token tree every drafter proposes and the engine feeds to the model in one forward.

Node 0 is the root: the last committed token, not yet in the KV cache, whose logits we need anyway. Every other
node has a parent with a smaller index, so a node's ancestors always come before it. Roles:
- ``candidate``: a guessed token that verification may accept;
- ``probe``: a token fed only for its logits (the Jacobi window); never accepted.

Candidates with the same parent and token are fused (shared prefixes are computed once); probes are never fused,
since their logits feed a separate computation.

Every node carries a `score`: its drafter's estimate, in [0, 1], that the target accepts it once its parent was
accepted (trie path frequency, match length, the draft model's own probability). The cost model
(`forerun.costmodel`) calibrates these scores and decides which nodes are worth feeding; the root's score is 1.

Example (the tree drawn in tests/unit/test_tree.py)::

    root(5) ─ 7 ─ 9          tokens   [5, 7, 9, 8]
         └─── 8              parents  [-1, 0, 1, 0]
                             depths   [0, 1, 2, 1]

    mask rows (node sees ancestors and itself; columns = cached prefix, then nodes):
        node 0: prefix | 1 0 0 0
        node 1: prefix | 1 1 0 0
        node 2: prefix | 1 1 1 0
        node 3: prefix | 1 0 0 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from forerun.attention import SDPA_FP32, SDPA_GROUPED
from forerun.forward_inputs import positional_support, stateful

Role = Literal["root", "candidate", "probe"]


@dataclass
class TokenTree:
    """A tree of tokens under one root, built by `add`; indices are stable once assigned."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    roles: list[Role]
    sources: list[str]
    scores: list[float]
    """Per node: the drafter's raw estimate that it is accepted given its parent is (a fused node keeps the max)."""
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    """(parent, token) -> node, for candidates only: the fusion index."""

    @classmethod
    def rooted_at(cls, token: int) -> TokenTree:
        return cls(tokens=[token], parents=[-1], depths=[0], roles=["root"], sources=[""], scores=[1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, role: Role = "candidate", source: str = "", score: float = 0.5) -> int:
        """Add `token` under node `parent`; a candidate equal to an existing sibling is fused and reused."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} is not a node of a tree of {len(self.tokens)} nodes")
        if role == "candidate":
            existing = self.children.get((parent, token))
            if existing is not None:
                self.scores[existing] = max(self.scores[existing], score)
                return existing
        index = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.roles.append(role)
        self.sources.append(source)
        self.scores.append(float(score))
        if role == "candidate":
            self.children[(parent, int(token))] = index
        return index

    def add_chain(
        self,
        parent: int,
        tokens: list[int],
        role: Role = "candidate",
        source: str = "",
        scores: Sequence[float] | float = 0.5,
    ) -> list[int]:
        """Add `tokens` as a chain under `parent` (one score for all, or one per token); returns their nodes."""
        per_token = [scores] * len(tokens) if isinstance(scores, (int, float)) else list(scores)
        nodes = []
        for token, score in zip(tokens, per_token, strict=True):
            parent = self.add(parent, token, role, source, score)
            nodes.append(parent)
        return nodes

    def graft(self, other: TokenTree, budget: int | None = None) -> dict[int, int]:
        """Add the nodes of `other` (same root token) under this root while len(self) < budget (None: all).

        Nodes come in `other`'s order, so a node is dropped whenever its parent was dropped: every kept node
        keeps its whole ancestry and the result is still a valid tree. Returns {node of other: node of self}
        for the nodes kept.
        """
        if other.tokens[0] != self.tokens[0]:
            raise ValueError(f"cannot graft a tree rooted at {other.tokens[0]} onto one rooted at {self.tokens[0]}")
        # `add`'s work inline: a step merges every row's proposals, a few hundred nodes between a card's forwards
        mapped = {0: 0}
        tokens, parents, depths, roles = self.tokens, self.parents, self.depths, self.roles
        sources, scores, children = self.sources, self.scores, self.children
        for i in range(1, len(other.tokens)):
            parent = mapped.get(other.parents[i])
            if parent is None:
                continue
            token, role = int(other.tokens[i]), other.roles[i]
            existing = children.get((parent, token))
            if budget is not None and len(tokens) >= budget and existing is None:
                continue
            if role == "candidate" and existing is not None:  # fused: the likelier estimate stays
                scores[existing] = max(scores[existing], float(other.scores[i]))
                mapped[i] = existing
                continue
            mapped[i] = len(tokens)
            if role == "candidate":
                children[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            roles.append(role)
            sources.append(other.sources[i])
            scores.append(float(other.scores[i]))
        return mapped

    def subtree(self, kept: Sequence[int]) -> tuple[TokenTree, dict[int, int]]:
        """The tree of the nodes `kept` (root included, ancestor-closed, any order); returns it and {old: new}.

        Example: kept [0, 3] of the module's example tree gives root(5) ─ 8, with {0: 0, 3: 1}.
        """
        mapped: dict[int, int] = {}
        tree = TokenTree.rooted_at(self.tokens[0])
        for old in sorted(kept):
            if old == 0:
                mapped[0] = 0
                continue
            parent = mapped.get(self.parents[old])
            if parent is None:
                raise ValueError(f"node {old} is kept without its parent {self.parents[old]}")
            role, token = self.roles[old], self.tokens[old]
            if role == "candidate" and (parent, token) in tree.children:  # fused already: `add` reuses it
                mapped[old] = tree.add(parent, token, role, self.sources[old], self.scores[old])
                continue
            # this tree's nodes are valid and distinct: appended without `add`'s checks (a step's every row)
            mapped[old] = len(tree.tokens)
            if role == "candidate":
                tree.children[(parent, token)] = len(tree.tokens)
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(tree.depths[parent] + 1)
            tree.roles.append(role)
            tree.sources.append(self.sources[old])
            tree.scores.append(self.scores[old])
        return tree, mapped

    def within_depth(self, depth: int) -> TokenTree:
        """This tree without its nodes deeper than `depth` (itself where it has none): a step with n tokens left to
        write verifies no guess past depth n - 1, which could not be kept.

        Example: the module's example tree within depth 1 is root(5) with 7 and 8, without 9."""
        if max(self.depths) <= depth:
            return self
        return self.subtree([node for node, at in enumerate(self.depths) if at <= depth])[0]

    def candidate_children(self, node: int) -> list[int]:
        """Candidate children of `node`, in insertion order."""
        return [i for i in range(node + 1, len(self)) if self.parents[i] == node and self.roles[i] == "candidate"]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestors(self) -> torch.Tensor:
        """Bool matrix [n, n]: entry (i, j) is True when j is i or an ancestor of i.

        A row is its parent's row plus the diagonal, so one pass in index order fills it.
        """
        n = len(self)
        matrix = np.zeros((n, n), dtype=np.bool_)  # rows filled in numpy: a torch slice per row costs ~5x more
        for i in range(n):
            parent = self.parents[i]
            if parent >= 0:
                matrix[i, : parent + 1] = matrix[parent, : parent + 1]
            matrix[i, i] = True
        return torch.from_numpy(matrix)


def is_chain(tree: TokenTree) -> bool:
    """Whether `tree` is its root and one line of candidates (each node the child of the one before it).

    Example:
        >>> tree = TokenTree.rooted_at(5)
        >>> _ = tree.add_chain(0, [7, 9])
        >>> is_chain(tree), (tree.add(0, 4) and is_chain(tree))
        (True, False)
    """
    return all(parent == node - 1 and role == "candidate" for node, (parent, role)
               in enumerate(zip(tree.parents[1:], tree.roles[1:], strict=True), start=1))  # fmt: skip


def best_chain(tree: TokenTree, worth: Sequence[float]) -> list[int]:
    """The line of candidates from the root of `tree` that goes, at every node, to the child of the highest
    `worth` (per node; the first child where equal): its nodes, root excluded, in order.

    Example (root 5 with children 7 and 4, and 9 under 7; worth 0.3 for 7, 0.5 for 4):
        >>> tree = TokenTree.rooted_at(5)
        >>> _ = tree.add_chain(0, [7, 9]), tree.add(0, 4)
        >>> best_chain(tree, [1.0, 0.3, 0.2, 0.5]), best_chain(tree, [1.0, 0.5, 0.2, 0.3])
        ([3], [1, 2])
    """
    best: dict[int, int] = {}
    for node in range(1, len(tree)):
        if tree.roles[node] != "candidate":
            continue
        parent = tree.parents[node]
        if parent not in best or worth[node] > worth[best[parent]]:
            best[parent] = node
    chain, node = [], 0
    while node in best:
        node = best[node]
        chain.append(node)
    return chain


def merge(root: int, trees: Sequence[TokenTree], budget: int | None = None) -> tuple[TokenTree, list[dict[int, int]]]:
    """Graft `trees` (all rooted at `root`) in order under one root, fusing shared prefixes, while fewer than
    `budget` nodes (None: all). Returns the merged tree and, per input tree, {its node: merged node}.

    Example: [root(5) ─ 7 ─ 9] and [root(5) ─ 7 ─ 4] merge into root(5) ─ 7 ─ 9, with 7 ─ 4 beside 9:
        >>> a, b = TokenTree.rooted_at(5), TokenTree.rooted_at(5)
        >>> _ = a.add_chain(0, [7, 9]), b.add_chain(0, [7, 4])
        >>> tree, maps = merge(5, [a, b])
        >>> tree.tokens, tree.parents, maps[1]
        ([5, 7, 9, 4], [-1, 0, 1, 1], {0: 0, 1: 1, 2: 3})
    """
    tree = TokenTree.rooted_at(root)
    return tree, [tree.graft(other, budget) for other in trees]


@dataclass(frozen=True)
class PackedTree:
    """Model inputs for one forward over a tree: `input_ids`, `position_ids` [1, n] and the 4-D mask."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[1, 1, lead + n, prefix_len + n]; None for a single root node (a causal chain needs no mask)."""


def attention_mask_4d(
    ancestors: torch.Tensor, prefix_len: int, attn_implementation: str, dtype: torch.dtype, lead: int = 0
) -> torch.Tensor:
    """Build the [1, 1, lead + n, prefix_len + n] mask: every node sees the whole prefix, its ancestors and itself.

    The last `lead` prefix tokens are fed in the same forward, before the tree (the prompt, at the prefill);
    their rows are causal. eager adds the mask to the attention scores, so it needs 0 (visible) / dtype-min
    (hidden) floats; sdpa and the other kernels that take masks accept a bool mask (True = visible).

    Example: a root with one child after a 2-token prefix, the second prefix token fed as lead (1 = visible):
        lead row  [1 1 0 0]
        root      [1 1 1 0]
        child     [1 1 1 1]
    """
    n = ancestors.shape[0]
    visible = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), ancestors], dim=1)  # [n, prefix_len + n]
    if lead:
        lead_rows = torch.ones(lead, prefix_len + n, dtype=torch.bool).tril(prefix_len - lead)
        visible = torch.cat([lead_rows, visible], dim=0)
    return as_attention_mask(visible[None, None], attn_implementation, dtype)


def as_attention_mask(visible: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = visible) as the attention kernel takes it: eager adds the mask to the scores, so it
    needs 0 / dtype-min floats; sdpa and the other kernels that take masks accept the bools."""
    if attn_implementation == "eager":
        return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return visible


def pack(
    tree: TokenTree,
    prefix_len: int,
    attn_implementation: str,
    dtype: torch.dtype,
    device: torch.device,
    lead: Sequence[int] = (),
) -> PackedTree:
    """Flatten `tree` into model inputs; positions are prefix_len + depth, the mask follows the ancestry.

    `lead`: the last len(lead) tokens of the prefix, not yet in the cache, fed first as a causal chain.
    """
    input_ids = torch.tensor([[*lead, *tree.tokens]], dtype=torch.long, device=device)
    depths = torch.tensor([tree.depths], dtype=torch.long, device=device) + prefix_len
    position_ids = torch.cat([torch.arange(prefix_len - len(lead), prefix_len, device=device)[None], depths], dim=1)
    if len(tree) == 1:  # a chain: the model's own causal mask is the right one
        return PackedTree(input_ids, position_ids, None)
    mask = attention_mask_4d(tree.ancestors(), prefix_len, attn_implementation, dtype, len(lead)).to(device)
    return PackedTree(input_ids, position_ids, mask)


TREE_ATTENTION = ("eager", "sdpa", SDPA_FP32, SDPA_GROUPED)
"""Attention implementations that take an arbitrary 4-D mask (flash-attention only knows causal/padding)."""


def tree_support(model: torch.nn.Module) -> str | None:
    """None if `model` can verify trees, else the reason it cannot (the caller falls back to plain)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if stateful(model):
        return (
            f"{type(model).__name__} keeps recurrent or convolution states (state-space, linear-attention or "
            "short-convolution layers), which cannot step back to a rejected guess: no trees (a chain of guesses a "
            "step where its chains are exact, else one token per forward)"
        )
    if alibi_by_key_place(model.config):
        return (
            f"{type(model).__name__} builds its ALiBi position biases from where keys sit, not from position ids: "
            "a tree's nodes sit side by side at other depths"
        )
    if (reason := positional_support(model)) is not None:
        return reason
    if impl not in TREE_ATTENTION:
        return (
            f"{type(model).__name__} uses attn_implementation={impl!r}, which cannot take a tree attention mask; "
            f"load it with one of {TREE_ATTENTION}"
        )
    return None


def alibi_by_key_place(config: object) -> bool:
    """Whether a model computes its ALiBi biases from where keys sit (their index in the cache, or their count of
    ones in a 2-D attention mask), not from `position_ids`: Bloom, MPT with `alibi` (its default) and Falcon with
    `alibi=True` (falcon-rw). A tree's nodes sit side by side while their positions are their depths, so such a
    model cannot verify trees.

    Example:
        >>> from transformers import FalconConfig
        >>> alibi_by_key_place(FalconConfig(alibi=True)), alibi_by_key_place(FalconConfig())
        (True, False)
    """
    model_type = getattr(config, "model_type", None)
    if model_type == "mpt":
        return bool(getattr(getattr(config, "attn_config", None), "alibi", False))
    return model_type == "bloom" or (model_type == "falcon" and bool(getattr(config, "alibi", False)))
