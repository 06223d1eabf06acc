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
    tree: TokenTree,
    probs_at: Callable[[int], torch.Tensor],
    generator: torch.Generator | None = None,
    uniforms_first: bool = False,
) -> Verdict:
    """Lossless verification of drafted tokens, several children per node, deterministic or sampled.

    At each node, p = probs_at(node) [vocab] (processors applied with the node's own prefix, then softmax).
    The candidate children are tried in order. Child c with token t, drafted from q (`tree.draft_probs[c]`; a
    deterministic guess has q = point mass on t), is accepted with probability min(1, p(t) / q(t)); on rejection
    p becomes the residual norm(max(0, p - q)) and the next child is tried against it. If every child is
    rejected, the bonus token is sampled from the residual (from p itself when there were no children).
    One child with q is the speculative sampling rule of Leviathan et al. / Chen et al.; several children are the
    multi-round rule of SpecInfer; with point masses the residual simply zeroes p(t). Each step leaves the token
    after the node distributed exactly as p.

    `uniforms_first`: draw one uniform per tree level before walking (Leviathan et al., Algorithm 1) instead of
    one per try as it comes (Chen et al., Algorithm 2); the two differ only in the order of random draws.

    Example: p = [0.5, 0.3, 0.2] at the root, one deterministic child with token 1: accepted with probability
    0.3; otherwise the bonus is drawn from [0.5, 0, 0.2] / 0.7, so P(0) = 0.7 * 0.5 / 0.7 = 0.5, as under p.
    """
    device = generator.device if generator is not None else torch.device("cpu")

    def uniform() -> float:
        return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))

    levels = []
    if uniforms_first:
        levels = torch.rand(max(tree.depths) + 1, generator=generator, dtype=torch.float64, device=device).tolist()
    node = 0
    accepted: list[int] = []
    while True:
        p = probs_at(node).double()  # [vocab]; float64 so tiny masses survive the subtractions
        p = p / p.sum()
        next_node = None
        for i, child in enumerate(tree.candidate_children(node)):
            token = tree.tokens[child]
            q = tree.draft_probs.get(child)
            if q is None:
                chance = float(p[token])
                residual = p.clone()
                residual[token] = 0.0
            else:
                q = fit_vocab(q.double(), p.shape[0]).to(p.device)
                chance = min(1.0, float(p[token]) / float(q[token])) if float(q[token]) > 0 else 0.0
                residual = (p - q).clamp_(min=0.0)
            draw = levels[tree.depths[node]] if uniforms_first and i == 0 else uniform()
            if chance > 0 and draw < chance:
                next_node = child
                break
            if float(residual.sum()) <= 0:  # p sat (numerically) all on rejected tokens: keep p itself
                break
            p = residual / residual.sum()
        if next_node is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(accepted, bonus)
        accepted.append(next_node)
        node = next_node


def fit_vocab(q: torch.Tensor, size: int) -> torch.Tensor:
    """q over the draft's rows -> q over the target's `size` rows (rows only one model has get no mass)."""
    if q.shape[0] == size:
        return q
    if q.shape[0] > size:
        return q[:size]
    return torch.cat([q, q.new_zeros(size - q.shape[0])])
