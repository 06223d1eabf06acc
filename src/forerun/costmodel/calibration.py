"""How likely a drafter's guess is accepted: online rates per source, depth and score (`Calibration`), and the
correction for feeding the guesses whose estimates came out highest (`FedCheck`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forerun.tree import TokenTree

if TYPE_CHECKING:
    from forerun.costmodel.choice import Ranking

DEPTH_BUCKETS = 6
"""Depths 1..5 each, then 6 and deeper together."""
SCORE_BINS = 5
PRIOR_WEIGHT = 2.0
"""The drafter's own score counts as this many observations until real ones arrive."""
WINDOW = 64.0
"""Counts are halved past this many observations per cell, so the estimates follow the text as it changes."""
MAX_PROBABILITY = 0.95
"""No guess is certain: along a chain of n nodes at p the expected accepted length sums p + p^2 + ... + p^n, and
near 1 a small error in p is a large error in that sum."""
MAX_GROUPS = 3
"""Probe groups weighed per step (every subset is tried: 2^3 options)."""
REQUEST_WEIGHT = 2.0
"""Pseudo-observations (agreeing with the long-run estimates) behind the per-request correction."""
REQUEST_DECAY = 0.97
"""Per observation: the request correction remembers about the last 30 checked nodes."""


def checked_candidates(tree: TokenTree, committed: Sequence[int]) -> Iterator[tuple[int, bool]]:
    """(node, accepted) for each candidate of `tree` whose parent path was committed: at depth d it would have been
    accepted, fed or not, exactly when its token is committed[d-1] (`committed`: the step's accepted drafts, then
    the bonus token). Candidates under a rejected one, or deeper than the step went, cannot be checked."""
    reached = {0}
    for node in range(1, len(tree)):
        depth = tree.depths[node]
        if tree.roles[node] != "candidate" or tree.parents[node] not in reached or depth > len(committed):
            continue
        accepted = tree.tokens[node] == committed[depth - 1]
        if accepted:
            reached.add(node)
        yield node, accepted


@dataclass
class Calibration:
    """Online acceptance rates per (source, depth bucket, score bin): P(accepted | parent accepted).

    Two levels: long-run rates per cell (kept across requests), times a per-request correction, the ratio of what
    was accepted to what the long-run rates predicted in this request so far (per source, first-level nodes and
    deeper ones apart): a chat answer and a code answer differ more than any cell can tell.

    Example:
        >>> calibration = Calibration()
        >>> calibration.probability("trie", 1, 0.9)     # no evidence yet: the drafter's own score
        0.9
        >>> for _ in range(8):
        ...     calibration.record("trie", 1, 0.9, False)
        >>> round(calibration.estimate("trie", 1, 0.9), 2)   # long-run: (0 + 2 * 0.9) / (8 + 2)
        0.18
    """

    hits: dict[tuple[str, int, int], float] = field(default_factory=dict)
    trials: dict[tuple[str, int, int], float] = field(default_factory=dict)
    request_hits: dict[tuple[str, int], float] = field(default_factory=dict)
    """This request, per (source, 0 = depth 1 / 1 = deeper): accepted nodes (recency-weighted)."""
    request_predicted: dict[tuple[str, int], float] = field(default_factory=dict)
    """This request: the long-run estimates of the same nodes, summed."""

    @staticmethod
    def cell(source: str, depth: int, score: float) -> tuple[str, int, int]:
        score = score if math.isfinite(score) else 0.0  # a drafter's bad score is no guess, never a crash
        return source, min(depth, DEPTH_BUCKETS), min(SCORE_BINS - 1, max(0, int(score * SCORE_BINS)))

    def estimate(self, source: str, depth: int, score: float) -> float:
        """The long-run rate of the cell (the drafter's score as a prior)."""
        key = self.cell(source, depth, score)
        prior = min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
        return (self.hits.get(key, 0.0) + PRIOR_WEIGHT * prior) / (self.trials.get(key, 0.0) + PRIOR_WEIGHT)

    def correction(self, source: str, depth: int) -> float:
        """This request's accepted / predicted for the source's first-level (or deeper) nodes, shrunk to 1."""
        level = (source, 0 if depth <= 1 else 1)
        hits, predicted = self.request_hits.get(level, 0.0), self.request_predicted.get(level, 0.0)
        return (hits + REQUEST_WEIGHT) / (predicted + REQUEST_WEIGHT)

    def probability(self, source: str, depth: int, score: float) -> float:
        """The long-run rate times this request's correction, at most 0.99."""
        return min(MAX_PROBABILITY, self.estimate(source, depth, score) * self.correction(source, depth))

    def probabilities(self, depths: Sequence[int], keys: Sequence[tuple[str, float] | None]) -> list[float]:
        """`probability` of each node with a key (its depth, (source, score)); 0.0 where the key is None. The same
        numbers as one call per node, with each source's correction worked out once (a step ranks every row's
        proposals: on a card, 16 rows of ~50 nodes between forwards of a few milliseconds)."""
        known: dict[tuple[str, int, float], float] = {}  # drafters repeat their scores: worked out once each
        corrections: dict[tuple[str, int], float] = {}
        out = [0.0] * len(keys)
        for node, key in enumerate(keys):
            if key is None:
                continue
            depth = min(depths[node], DEPTH_BUCKETS + 1)  # 1, 2 and deeper differ in the correction's level
            memo = (key[0], depth, key[1])
            p = known.get(memo)
            if p is None:
                level = (key[0], 0 if depth <= 1 else 1)
                correction = corrections.get(level)
                if correction is None:
                    correction = corrections[level] = self.correction(key[0], depth)
                p = known[memo] = min(MAX_PROBABILITY, self.estimate(key[0], depth, key[1]) * correction)
            out[node] = p
        return out

    def record(self, source: str, depth: int, score: float, accepted: bool) -> None:
        level = (source, 0 if depth <= 1 else 1)
        self.request_hits[level] = self.request_hits.get(level, 0.0) * REQUEST_DECAY + accepted
        key = self.cell(source, depth, score)
        prior = min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
        hits, trials = self.hits.get(key, 0.0), self.trials.get(key, 0.0)
        predicted = self.request_predicted.get(level, 0.0) * REQUEST_DECAY
        self.request_predicted[level] = predicted + (hits + PRIOR_WEIGHT * prior) / (trials + PRIOR_WEIGHT)  # estimate
        hits, trials = hits + accepted, trials + 1.0
        if trials > WINDOW:
            hits, trials = hits / 2, trials / 2
        self.hits[key], self.trials[key] = hits, trials

    def new_request(self) -> None:
        """Forget the per-request correction (the long-run rates stay)."""
        self.request_hits, self.request_predicted = {}, {}

    def learn(
        self, tree: TokenTree, committed: Sequence[int], keys: Sequence[tuple[str, float] | None] | None = None
    ) -> None:
        """Check every candidate of a proposed `tree` whose parent path was committed against what came next.

        `committed`: the tokens the step appended after the root (accepted drafts, then the bonus token), i.e. the
        target's own choices. A candidate at depth d whose path to its parent equals committed[:d-1] would have
        been accepted exactly when its token is committed[d-1], fed or not. `keys`: per node, the (source, score)
        its cell is filed under (default: the tree's own; see `support_keys`).
        """
        for node, accepted in checked_candidates(tree, committed):
            key = keys[node] if keys is not None else None
            source, score = key if key is not None else (tree.sources[node], tree.scores[node])
            self.record(source, tree.depths[node], score, accepted)


FED_WEIGHT = 4.0
"""Pseudo-tokens (accepted = predicted) behind each source's `FedCheck` factor."""
FED_DECAY = 0.995
"""Per fed guess of a source: its factor remembers about the last 200."""
FED_IDLE_STEPS = 16
FED_RELAX = 0.98
"""Per step after `FED_IDLE_STEPS` steps in a row in which a source proposed and none of its guesses was fed, its
evidence shrinks by this much (its factor relaxes toward 1): only fed guesses move the factor, so without this a
source whose factor fell would never be fed, nor checked, again (a cold trie alone on five prompts stopped
drafting for good). 0.98: priced on the curve as without it (1.270x against 1.268x; 0.9 lost the gain, 1.251x)."""


@dataclass
class FedCheck:
    """Accepted / predicted over the guesses the cost model fed, per source (the drafters behind a guess, as
    `support_keys` names them): a factor on each source's calibrated chances.

    `Calibration` learns from every proposed node, fed or not, which is unbiased for the average node of a cell;
    the nodes fed are not average: they are those whose estimate came out highest, and an estimate high by chance
    (a per-request correction after a lucky run, a young cell) is fed more often than one low by chance. Measured
    on SmolLM2-135M (fp32, `auto`, 12 conversation turns): fed guesses were predicted right 0.544 of the time and
    were right 0.507, unfed ones predicted 0.139 and right 0.202; fed Jacobi guesses contested by another drafter,
    predicted 0.18, were right 0.02. Priced on the latency curve, the factor took `auto` from 1.249x to 1.268x (4
    datasets, 12 prompts) and 1.279x to 1.314x (24 other prompts); on conversations 1.252x -> 1.267x and 1.373x ->
    1.366x; predicted and accepted tokens now agree within 2-8% (they differed by 5-16%).

    Example (a source whose fed guesses, predicted at 0.5, all failed):
        >>> check = FedCheck()
        >>> check.adjust("trie", 0.5)                  # nothing fed yet
        0.5
        >>> for _ in range(40):
        ...     check.record("trie", 0.5, False)
        >>> round(check.adjust("trie", 0.5), 3), check.adjust("prompt_lookup", 0.5)
        (0.09, 0.5)
    """

    predicted: dict[str, float] = field(default_factory=dict)
    hits: dict[str, float] = field(default_factory=dict)
    idle: dict[str, int] = field(default_factory=dict)
    """Per source: steps in a row in which it proposed and none of its guesses was fed."""

    def adjust(self, source: str, p: float) -> float:
        """`p`, a calibrated chance of a guess by `source`, times what its fed guesses turned out against theirs."""
        return min(MAX_PROBABILITY, p * self.factor(source))

    def factor(self, source: str) -> float:
        """What `source`'s fed guesses turned out against their calibrated chances (1 before any was fed)."""
        return (self.hits.get(source, 0.0) + FED_WEIGHT) / (self.predicted.get(source, 0.0) + FED_WEIGHT)

    def record(self, source: str, p: float, accepted: bool) -> None:
        """A fed guess by `source`, calibrated at `p` (before `adjust`), was `accepted` or not."""
        self.predicted[source] = self.predicted.get(source, 0.0) * FED_DECAY + p
        self.hits[source] = self.hits.get(source, 0.0) * FED_DECAY + accepted

    def learn(self, ranking: Ranking, fed: Sequence[int], committed: Sequence[int]) -> None:
        """Check the `fed` candidates of `ranking.merged` whose parent was accepted against the `committed` tokens;
        relax the factors of sources that have proposed without being fed for a while."""
        merged, fed_set = ranking.merged, set(fed)
        keys = ranking.keys
        offered = {keys[n][0] for n in range(1, len(merged)) if merged.parents[n] == 0 and keys[n] is not None}
        for source in offered - {keys[n][0] for n in fed_set}:
            self.idle[source] = self.idle.get(source, 0) + 1
            if self.idle[source] > FED_IDLE_STEPS and source in self.predicted:
                self.predicted[source] *= FED_RELAX
                self.hits[source] *= FED_RELAX
        for node in fed_set:
            self.idle[keys[node][0]] = 0
        for node, accepted in checked_candidates(merged, committed):  # fed nodes are closed under ancestors
            if node in fed_set:
                self.record(keys[node][0], ranking.raw[node], accepted)
