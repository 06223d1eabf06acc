"""Verification: walk the candidate tree with the target model's own choices.

Notation and glossary, stated once:
- p: the target model's distribution at a node, after logits processors applied with that node's own prefix
  (committed tokens + the path to the node). Greedy decoding picks argmax p; sampling picks the Gumbel-max draw
  of p at the node's position, a function of the run's seed and the position only (`forerun.noise`).
- accepted tokens: candidate tokens along one root-to-leaf path that the target agrees with.
- bonus token: the target's own choice at the last accepted node (or at the root when nothing was accepted). It is
  always produced, so every forward yields at least one token, exactly the token plain decoding would produce.

Sampled runs are greedy runs over perturbed scores: one walk (`verify_greedy`) serves both.

Example (greedy): tree root(5) -> 7 -> 9, root -> 8; the target's argmax is 7 at the root, 3 at node 1.
Node 1 (token 7) is accepted, nothing under it matches 3, so the step yields [7, 3]: one accepted, one bonus.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from forerun.noise import GumbelNoise
from forerun.transcript import Transcript
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


def verify_sampled(
    tree: TokenTree, scores_at: Callable[[int], torch.Tensor], noise: GumbelNoise, position: int
) -> Verdict:
    """Lossless verification when sampling: at each node the target's token is its own draw, the Gumbel-max
    argmax(scores + G) with the noise of the node's position (`forerun.noise`); the walk is then the greedy one.

    `scores_at(node)`: processed scores [vocab] (temperature, top-p... applied with the node's own prefix).
    `position`: where the root's next token goes in the sequence (the committed length); a node at depth d draws
    at position + d. Every token written is the target's draw at its position whatever was drafted, so the
    distribution is exactly that of plain sampling, and a drafted token is accepted with probability p(token)
    (for a deterministic guess, as under the residual rule of Leviathan et al.; several children: their p summed,
    as under SpecInfer's).

    Example: p = [0.5, 0.3, 0.2] at the root and one child with token 1: over seeds, the child is accepted 30% of
    the time, and the bonus is 0 / 1 / 2 with probability 0.5 / 0.3 / 0.2 as under p.
    """
    return verify_greedy(tree, lambda node: noise.draw(scores_at(node), position + tree.depths[node]))


@dataclass
class NodeScores:
    """Processed scores at tree nodes, computed lazily with each node's own prefix (committed text + path).

    Logits processors (repetition penalty, temperature, top-p...) read the token ids before the position they
    score, so a node deep in a branch is scored with the branch's tokens, exactly as plain decoding would see them.
    """

    logits: torch.Tensor  # [n, vocab]
    processor: LogitsProcessorList | None
    committed: Transcript
    """The row's text so far (its last token is the root), read only where a processor needs the prefix."""
    tree: TokenTree
    choices: list[int] | None = None
    """Each node's raw argmax, where the base copied them to the host at once (used when nothing processes the
    logits: one transfer per step instead of one sync per walked node on an accelerator)."""
    drawn: list[int] | None = None
    """Each node's sampled draw, where they were made at once on the device and copied in one transfer
    (`forerun.draws`); None: the walk draws node by node."""

    def scores(self, node: int) -> torch.Tensor:
        row = self.logits[node : node + 1].float()  # [1, vocab]
        if not self.processor:
            return row[0]
        path = [self.tree.tokens[i] for i in self.tree.path_to(node)[1:]]
        sequence = self.committed.sequence  # [1, committed]
        prefix = torch.cat([sequence, sequence.new_tensor([path])], dim=1) if path else sequence
        return self.processor(prefix.to(row.device), row)[0]

    def argmax(self, node: int) -> int:
        if self.choices is not None and not self.processor:
            return self.choices[node]
        return int(self.scores(node).argmax())


@dataclass(frozen=True)
class Sampling:
    """Sample instead of argmax: each token is the target's Gumbel-max draw under `noise` at its position."""

    noise: GumbelNoise
    verifier: Callable = verify_sampled
    """The lossless verifier of the walk node by node; a parameter so tests can show that a biased one is caught."""
    at_once: bool | None = None
    """Draw at every node at once on the device (`forerun.draws`), the same tokens in one copy to the host: None
    where the logits are on an accelerator (there a walk pays a host sync per node; on a CPU, where a walk scores
    only the nodes it walks, scoring them all costs more)."""

    def draws_at_once(self, logits: torch.Tensor) -> bool:
        """Whether a step with these logits draws at every node at once."""
        return self.at_once if self.at_once is not None else logits.device.type != "cpu"


def verify(tree: TokenTree, scores: NodeScores, sampling: Sampling | None) -> Verdict:
    """The path of `tree` the target keeps: the greedy walk over draws made at once (`scores.drawn`), over the
    argmax where the row is greedy, else the sampling's own verifier (`verify_sampled`)."""
    if scores.drawn is not None:  # the same choices or draws, made at once: the walk is the greedy one over them
        return verify_greedy(tree, scores.drawn.__getitem__)
    if sampling is None:
        return verify_greedy(tree, scores.argmax)
    return sampling.verifier(tree, scores.scores, sampling.noise, scores.committed.length)
