"""One step's choice: rank the merged proposals by path probability and feed the prefix that pays on the curve."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from forerun.costmodel.curve import LatencyCurve
from forerun.tree import TokenTree


@dataclass(frozen=True)
class Choice:
    """What the cost model decided for one step."""

    nodes: int
    """Candidate nodes fed (0 = the root alone)."""
    fed: int
    """Tokens fed in the forward, the lead (prompt at the prefill) and probes included."""
    expected_accepted: float
    """E(k): the expected number of accepted draft tokens."""
    groups: tuple[int, ...] = ()
    """The probe groups fed (indices into the groups offered)."""
    padding: int = 0
    """Padding probes fed besides (counted in `fed`): where a larger forward costs less than a smaller one (bf16
    on a CPU with bf16 units: 2 tokens 0.89x one token), a step is padded up to the cheaper size."""


def best_prefix(
    chances: Sequence[float],
    curve: LatencyCurve,
    lead: int = 0,
    cap: int | None = None,
    groups: Sequence[tuple[float, int]] = (),
    draft_penalty: float = 1.0,
    refeed: bool = False,
    chain: bool = False,
) -> Choice:
    """The k, and the probe groups, maximising (1 + chances[0] + ... + chances[k-1] + group values) / cost(tokens).

    `chances`: the candidates' path probabilities, best first (each ancestor before its descendants). `groups`:
    optional (value, size) items, each fed whole or not at all (a Jacobi window: its worth in future accepted
    tokens, its probe count). `cap`: most nodes per forward, root included (the lead not counted).
    `draft_penalty`: scales the cost of every forward of more than one token (`ForwardTimes.penalty`: how much
    dearer such forwards measured, against the curve, than 1-token ones). `chain`: the candidates are one chain on
    a model with recurrent states (`forerun.base.chain`), and a step is never padded (`refeed` implies it);
    `refeed`: such a chain's lead (tokens fed again) and its head, where it is not accepted whole, are fed again
    with the next step (priced as lead + k more tokens in a 1-token forward). A model whose states can be cut back
    (convolution windows only: LFM2) feeds nothing again: a chain without `refeed`.

    Example (1 token 10 ms, 2: 11 ms, 4: 16 ms; a chain of chances 0.9, 0.5, 0.2):
        >>> curve = LatencyCurve((1, 2, 4), (0.010, 0.011, 0.016))
        >>> best_prefix([0.9, 0.5, 0.2], curve).nodes, best_prefix([0.9, 0.5, 0.2], curve, refeed=True).nodes
        (2, 1)
        >>> best_prefix([0.9, 0.5, 0.2], curve, chain=True).nodes   # cut back, not fed again: as a tree's
        2
    """

    def price(tokens: int) -> float:
        return curve.cost(tokens) * (draft_penalty if tokens > 1 else 1.0)

    # cheapest[n]: the cheapest forward of at least n nodes (lead not counted) within the cap, and its size
    cheapest: dict[int, tuple[float, int]] = {}
    if cap is not None and not (chain or refeed):
        for n in range(cap, 0, -1):
            here = (price(lead + n), n)
            cheapest[n] = min(here, cheapest.get(n + 1, here))

    def cost(nodes: int) -> tuple[float, int]:
        return cheapest.get(nodes, (price(lead + nodes), nodes))

    root_cost, root_size = cost(1)
    best, best_rate = Choice(0, lead + root_size, 0.0, (), root_size - 1), 1.0 / root_cost
    options = []  # (value, size, chosen groups) for every subset of the groups that fits
    for count in range(len(groups) + 1):
        for subset in itertools.combinations(range(len(groups)), count):
            options.append((sum(groups[i][0] for i in subset), sum(groups[i][1] for i in subset), subset))
    expected = 0.0
    for k in range(len(chances) + 1):
        if k:
            expected += chances[k - 1]
        for value, size, subset in options:
            nodes = 1 + k + size
            if (k or subset) and (cap is None or nodes <= cap):
                seconds, size = cost(nodes)
                if refeed and k:  # not accepted whole: the lead and the chain's head are fed again next step
                    seconds += (1.0 - chances[k - 1]) * (price(lead + 1 + k) - price(1))
                rate = (1.0 + expected + value) / seconds
                if rate > best_rate:
                    best, best_rate = Choice(k, lead + size, expected, subset, size - nodes), rate
    return best


def support_keys(
    merged: TokenTree, proposals: Sequence[TokenTree], node_maps: Sequence[dict[int, int]]
) -> list[tuple[str, float] | None]:
    """Per node of the `merged` proposals: the (source, score) its acceptance is calibrated under, None for the
    root and probes.

    The source names every drafter that proposed the node (`"prompt_lookup+trie"` where two agree) and ends in
    `"/contested"` where another drafter proposed a different token at the same place: a drafter's guess is
    likelier right when another makes it too and less likely when another guesses otherwise, and its average
    rate fits neither (measured on SmolLM2: a Jacobi guess that no other drafter shared was accepted a quarter as
    often as Jacobi guesses overall). The score is the best of the proposers' scores.

    Example: trie proposes 7 and 8 after the root, prompt lookup 7:
        >>> from forerun.tree import merge
        >>> a, b = TokenTree.rooted_at(5), TokenTree.rooted_at(5)
        >>> _ = a.add(0, 7, source="trie", score=0.4), a.add(0, 8, source="trie", score=0.2)
        >>> _ = b.add(0, 7, source="prompt_lookup", score=0.9)
        >>> tree, maps = merge(5, [a, b])
        >>> support_keys(tree, [a, b], maps)
        [None, ('prompt_lookup+trie', 0.9), ('trie/contested', 0.2)]
    """
    # One bit per drafter: a node's proposers and the drafters offering any child of its parent are bit masks
    # (this runs every step over a few hundred nodes).
    bits: dict[str, int] = {}
    masks, scores = [0] * len(merged), [-math.inf] * len(merged)
    for proposal, node_map in zip(proposals, node_maps, strict=True):
        roles, sources, own_scores = proposal.roles, proposal.sources, proposal.scores
        for node, m in node_map.items():
            if node and roles[node] == "candidate":
                masks[m] |= bits.setdefault(sources[node], 1 << len(bits))
                scores[m] = max(scores[m], own_scores[node])
    parents = merged.parents
    offered = [0] * len(merged)
    for node in range(1, len(merged)):
        offered[parents[node]] |= masks[node]
    names: dict[tuple[int, bool], str] = {}
    keys: list[tuple[str, float] | None] = [None] * len(merged)
    for node in range(1, len(merged)):
        mask = masks[node]
        if mask:
            cell = (mask, bool(offered[parents[node]] & ~mask))
            name = names.get(cell)
            if name is None:
                name = "+".join(sorted(source for source, bit in bits.items() if bit & mask))
                names[cell] = name = name + "/contested" if cell[1] else name
            keys[node] = (name, scores[node])
    return keys


def chain_selection(merged: TokenTree, node_maps: Sequence[dict[int, int]], chain: Sequence[int]) -> Selection:
    """The root and the `chain` nodes of `merged`, with each proposal's nodes mapped onto them."""
    tree, mapped = merged.subtree([0, *chain])
    maps = [{node: mapped[m] for node, m in node_map.items() if m in mapped} for node_map in node_maps]
    return Selection(tree, maps)


@dataclass
class Ranking:
    """The merged proposals of one step, with their verifiable candidates ranked by path probability."""

    merged: TokenTree
    node_maps: list[dict[int, int]]
    candidates: list[int]
    """Candidate nodes of `merged`, likeliest path first (a child never before its parent)."""
    chances: list[float]
    """Per candidate: the probability that its whole path is accepted."""
    keys: list[tuple[str, float] | None] = field(default_factory=list)
    """Per node of `merged`: its calibration cell's source and score (`support_keys`)."""
    raw: list[float] = field(default_factory=list)
    """Per node of `merged`: P(accepted | parent accepted) as calibrated, before `FedCheck` adjusts it."""

    def select(
        self, count: int, probes: Sequence[int] = (), expected: float | None = None, padding: int = 0
    ) -> Selection:
        """The tree of the root, the `count` best candidates and `probes` (nodes of `merged`), and `padding` probes
        of no drafter's (fed for a cheaper forward, their logits unused); `expected`: the expected accepted length
        to report (None: the sum of the kept candidates' chances)."""
        kept = [0, *self.candidates[:count], *probes]
        tree, mapped = self.merged.subtree(kept)
        for _ in range(padding):
            tree.add(0, tree.tokens[0], role="probe", source="padding", score=0.0)
        node_maps = [{node: mapped[m] for node, m in node_map.items() if m in mapped} for node_map in self.node_maps]
        expected = sum(self.chances[:count]) if expected is None else expected
        return Selection(tree, node_maps, expected, self, tuple(self.candidates[:count]))


@dataclass
class Selection:
    """The tree to feed this step and how each proposal maps onto it."""

    tree: TokenTree
    node_maps: list[dict[int, int]]
    """Per proposal: its node -> node of `tree` (nodes not fed are absent)."""
    expected_accepted: float | None = None
    """The cost model's E(k) for the fed tree (None for a static budget)."""
    ranking: Ranking | None = None
    """Every proposal of the step, merged and ranked (the cost model learns from all of them, fed or not)."""
    fed: tuple[int, ...] = ()
    """The candidates of `ranking.merged` fed this step."""
