"""Verification: walk the candidate tree with the target model's own choices.

Notation and glossary, stated once:
- p: the target model's distribution at a node, after logits processors applied with that node's own prefix
  (committed tokens + the path to the node). Greedy decoding picks argmax p.
- q: the draft distribution of a proposed token. Model-free drafters (prompt lookup, trie, Jacobi pool) are
  deterministic: q is a point mass on the proposed token.
- accepted tokens: candidate tokens along one root-to-leaf path that the target agrees with.
- bonus token: the target's own choice at the last accepted node (or at the root when nothing was accepted). It is
  always produced, so every forward yields at least one token, exactly the token plain decoding would produce.

Example (greedy): tree root(5) -> 7 -> 9, root -> 8; the target's argmax is 7 at the root, 3 at node 1.
Node 1 (token 7) is accepted, nothing under it matches 3, so the step yields [7, 3]: one accepted, one bonus.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forerun.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification."""

    accepted_nodes: list[int]
    """Candidate nodes accepted, root excluded, in path order; their KV entries are kept."""
    bonus_token: int
    """The target's own token after the accepted path; it becomes the next root."""

    @property
    def accepted_len(self) -> int:
        return len(self.accepted_nodes)


def verify_greedy(tree: TokenTree, choice_at: Callable[[int], int]) -> Verdict:
    """Accept the longest path whose every token is the target's greedy choice at its parent.

    `choice_at(node)` returns argmax p at `node`; it is called only for nodes on the walked path, so per-node
    logits processing costs at most accepted_len + 1 evaluations.
    """
    node = 0
    accepted: list[int] = []
    while True:
        choice = choice_at(node)
        child = tree.children.get((node, choice))
        if child is None:
            return Verdict(accepted, choice)
        accepted.append(child)
        node = child
