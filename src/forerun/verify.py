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

import torch

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


def verify_sample(
    tree: TokenTree, probs_at: Callable[[int], torch.Tensor], generator: torch.Generator | None = None
) -> Verdict:
    """Lossless verification of deterministic drafts (q = point mass), several children per node.

    At each node, p = probs_at(node) [vocab] (processors applied with the node's own prefix, then softmax).
    Recursive rejection: try the candidate children in order; child c (token t) is accepted with probability
    p(t) / M, M the mass still in p; on rejection p(t) is set to 0 (M shrinks). If every child is rejected, the
    bonus token is sampled from what remains of p, renormalised. The token that leaves a node is therefore
    distributed exactly as p: P(c_i) = p(c_i) (the rejection factors telescope), and any other token x keeps
    p(x) / M_final * M_final = p(x).

    Example: p = [0.5, 0.3, 0.2] at the root, one child with token 1: accepted with probability 0.3; otherwise
    the bonus is drawn from [0.5, 0, 0.2] / 0.7, so P(0) = 0.7 * 0.5 / 0.7 = 0.5, as under p.
    """
    node = 0
    accepted: list[int] = []
    while True:
        p = probs_at(node).double().clone()  # [vocab]; float64 so tiny masses survive the subtractions
        next_node = None
        for child in (tree.children.get((node, token)) for token in candidate_tokens(tree, node)):
            token = tree.tokens[child]
            mass = float(p.sum())
            chance = float(p[token]) / mass if mass > 0 else 0.0
            if chance > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < chance:
                next_node = child
                break
            p[token] = 0.0
        if next_node is None:
            if float(p.sum()) <= 0:  # numerically everything was drafted and rejected: fall back to p itself
                p = probs_at(node).double()
            bonus = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return Verdict(accepted, bonus)
        accepted.append(next_node)
        node = next_node


def candidate_tokens(tree: TokenTree, node: int) -> list[int]:
    """Tokens of `node`'s candidate children, in insertion order (the drafters' preference order)."""
    return [tree.tokens[i] for i in tree.candidate_children(node)]
