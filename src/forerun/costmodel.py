"""What to feed this step: the drafters' trees merged, then cut to what pays on this device. Pure: no model.

Two budgets share one interface (`choose` the tree to feed from the drafters' proposals, `learn` from what was
committed):

- `StaticBudget(n)`: the drafters' trees grafted in order until n nodes (a single method's classic behaviour).
- `CostModel(curve)`: every proposed node carries a score, its drafter's estimate that the target accepts it once
  its parent is accepted. `Calibration` turns scores into probabilities learned online, per drafter, depth and
  score bin, from *every* proposed node, fed or not: after a step the committed tokens are the target's own choices,
  so any proposed path can be checked against them afterwards (this is what lets a drafter that was switched off
  earn its way back). With p(node) calibrated, a node's chance to be accepted is the product of p along its path,
  and feeding the k likeliest candidates (an ancestor-closed set, since a child is never likelier than its parent)
  is expected to commit 1 + E(k) tokens, E(k) their summed chances. The cost model feeds the k that maximises

        (1 + E(k)) / latency(tokens fed)

  on the device's measured latency curve (`LatencyCurve`, never assumed monotone), k = 0 (the root alone, one token
  per forward) included: when drafts are poor, decoding goes on at plain speed. Probe nodes (the Jacobi window:
  fed for their logits, never accepted) come in groups, one per drafter, fed whole or not at all; a group is worth
  the sum of its probes' scores (the drafter's estimate of the accepted tokens feeding it buys later) and costs
  its size. The nodes fed are those whose estimate came out highest, so estimates high by chance are fed more
  often than those low by chance: `FedCheck` scales each source's chances by how its fed guesses fared against
  what was predicted for them.

Example (a curve where 2 tokens cost 1.5x one token and 4 tokens 1.6x):
    >>> curve = LatencyCurve((1, 2, 4), (0.010, 0.015, 0.016))
    >>> # one sure candidate: (1 + 1) / 0.015 beats 1 / 0.010, so it is fed
    >>> # one candidate at 30%: (1 + 0.3) / 0.015 = 87 < 100 = 1 / 0.010, so the root goes alone
    >>> best_prefix([1.0], curve).nodes, best_prefix([0.3], curve).nodes
    (1, 0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from forerun.tree import TokenTree, merge

FLAT_AT_16 = 1.5
"""A latency curve is flat where a 16-token forward costs at most this many 1-token forwards."""


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per forward against tokens fed in it, measured on one device, dtype and thread count.

    `cost(n)` is the measurement at n, linear between measured sizes, and extrapolated linearly from the last two
    sizes beyond the largest (a prefill of a long prompt plus a tree).

    `batched` optionally holds curves measured with several rows per forward: (rows, curve of seconds against
    tokens per row). A batch does not cost what one row of as many tokens costs: each row reads its own cache and
    attends through its own mask rows (on this CPU, fp32: 8 rows x 2 tokens cost 1.34x one row of 16 tokens).
    `batch_cost` uses them; without them it prices rows x n tokens as one row of rows * n.

    Example (one row: 1 token 10 ms, 2 tokens 15 ms; 2 rows: 12 ms and 24 ms):
        >>> curve = LatencyCurve((1, 2), (0.010, 0.015), ((2, LatencyCurve((1, 2), (0.012, 0.024))),))
        >>> round(curve.batch_cost(2, 2) * 1000, 1), round(curve.batch_cost(3, 1) * 1000, 1)  # 3 rows: beyond 2
        (24.0, 14.0)
        >>> round(LatencyCurve((1, 2, 4), (0.010, 0.015, 0.016)).batch_cost(2, 2) * 1000, 1)  # no rows measured
        16.0
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    batched: tuple[tuple[int, LatencyCurve], ...] = ()

    def __post_init__(self) -> None:
        sizes, seconds = tuple(int(n) for n in self.sizes), tuple(float(s) for s in self.seconds)
        if not sizes or len(sizes) != len(seconds):
            raise ValueError("a latency curve needs as many timings as sizes, and at least one")
        if sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"latency curve sizes must start at 1 and increase, got {list(sizes)}")
        if not all(math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError(f"latency curve timings must be positive seconds, got {list(seconds)}")
        batched = tuple(sorted(((int(rows), curve) for rows, curve in self.batched), key=lambda item: item[0]))
        if any(rows < 2 for rows, _ in batched) or len({rows for rows, _ in batched}) != len(batched):
            raise ValueError(f"batched latency curves need distinct row counts >= 2, got {[r for r, _ in batched]}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "batched", batched)
        # Every whole size up to the largest, looked up: the cost model prices every prefix of every step, and on a
        # GPU's 64-size curve a scan per price was a fifth of `auto`'s host time between forwards.
        object.__setattr__(self, "table", tuple(self.interpolated(n) for n in range(sizes[-1] + 1)))

    def cost(self, n: int) -> float:
        """Seconds for a forward of `n` tokens."""
        if type(n) is int and 0 <= n < len(self.table):
            return self.table[n]
        return self.interpolated(n)

    def interpolated(self, n: int) -> float:
        """`cost(n)` worked out from the measured sizes (the module docstring's rule)."""
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[0]:
            return seconds[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                left, right = sizes[i - 1], sizes[i]
                return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (n - left) / (right - left)
        if len(sizes) == 1:
            return seconds[0] * n
        slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
        return seconds[-1] + slope * (n - sizes[-1])

    def batch_cost(self, rows: int, nodes: int) -> float:
        """Seconds for a forward of `rows` rows x `nodes` tokens each: linear in rows between the measured row
        counts (this curve is rows = 1), extrapolated linearly beyond the largest."""
        if rows <= 1:
            return self.cost(nodes)
        if not self.batched:
            return self.cost(rows * nodes)
        measured = [(1, self), *self.batched]
        for (low, lower), (high, higher) in zip(measured, measured[1:], strict=False):
            if rows <= high:
                share = (rows - low) / (high - low)
                return lower.cost(nodes) + (higher.cost(nodes) - lower.cost(nodes)) * share
        (low, lower), (high, higher) = measured[-2], measured[-1]
        slope = max(0.0, (higher.cost(nodes) - lower.cost(nodes)) / (high - low))
        return higher.cost(nodes) + slope * (rows - high)

    def relative(self, n: int) -> float:
        """cost(n) / cost(1)."""
        return self.cost(n) / self.seconds[0]

    @property
    def flat(self) -> bool:
        """Whether 16 tokens cost at most `FLAT_AT_16` times one token: drafters may then propose wide trees (the
        cost model still cuts each step's). bf16 on a CPU with native bf16 (1.21x), a GPU; not fp32 on a CPU
        (2.2x) nor bf16 on one without bf16 units (10x).

            >>> LatencyCurve((1, 16), (0.030, 0.036)).flat, LatencyCurve((1, 16), (0.035, 0.080)).flat
            (True, False)
        """
        return self.relative(16) <= FLAT_AT_16

    def default_cap(self, most: float = 3.0) -> int:
        """The largest measured size whose forward costs at most `most` times a 1-token forward."""
        return max(n for n, s in zip(self.sizes, self.seconds, strict=True) if s <= most * self.seconds[0])

    def with_batches(self, batched: Sequence[tuple[int, LatencyCurve]]) -> LatencyCurve:
        """This curve with `batched` row curves (replacing any it had)."""
        return LatencyCurve(self.sizes, self.seconds, tuple(batched))

    def as_dict(self) -> dict:
        data: dict = {"sizes": list(self.sizes), "seconds": list(self.seconds)}
        if self.batched:
            data["batched"] = {str(rows): curve.as_dict() for rows, curve in self.batched}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> LatencyCurve:
        batched = tuple((int(rows), cls.from_dict(curve)) for rows, curve in (data.get("batched") or {}).items())
        return cls(tuple(data["sizes"]), tuple(data["seconds"]), batched)


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

    def record(self, source: str, depth: int, score: float, accepted: bool) -> None:
        level = (source, 0 if depth <= 1 else 1)
        self.request_hits[level] = self.request_hits.get(level, 0.0) * REQUEST_DECAY + accepted
        predicted = self.request_predicted.get(level, 0.0) * REQUEST_DECAY
        self.request_predicted[level] = predicted + self.estimate(source, depth, score)
        key = self.cell(source, depth, score)
        hits, trials = self.hits.get(key, 0.0) + accepted, self.trials.get(key, 0.0) + 1.0
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
        factor = (self.hits.get(source, 0.0) + FED_WEIGHT) / (self.predicted.get(source, 0.0) + FED_WEIGHT)
        return min(MAX_PROBABILITY, p * factor)

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
) -> Choice:
    """The k, and the probe groups, maximising (1 + chances[0] + ... + chances[k-1] + group values) / cost(tokens).

    `chances`: the candidates' path probabilities, best first (each ancestor before its descendants). `groups`:
    optional (value, size) items, each fed whole or not at all (a Jacobi window: its worth in future accepted
    tokens, its probe count). `cap`: most nodes per forward, root included (the lead not counted).
    `draft_penalty`: scales the cost of every forward of more than one token (`ForwardTimes.penalty`: how much
    dearer such forwards measured, against the curve, than 1-token ones).
    """

    def price(tokens: int) -> float:
        return curve.cost(tokens) * (draft_penalty if tokens > 1 else 1.0)

    # cheapest[n]: the cheapest forward of at least n nodes (lead not counted) within the cap, and its size
    cheapest: dict[int, tuple[float, int]] = {}
    if cap is not None:
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


def best_shared_count(
    chances: Sequence[Sequence[float]],
    curve: LatencyCurve,
    cap: int | None = None,
    draft_penalty: float = 1.0,
    weights: Sequence[float] | None = None,
) -> int:
    """Candidates per row, the same for every row of a batch (their trees are padded to one size), maximising

        sum over rows of weight[row] * (1 + chances[row][0] + ... + chances[row][k-1]) / batch_cost(rows, 1 + k)

    on the device's curve: a batch of 8 rows x 16 nodes is a 128-token forward (dearer still than one row of 128
    tokens where the curve has measured batches), so the per-row budget shrinks as the batch grows, down to k = 0
    (one token per row per step) where drafting does not pay. `draft_penalty` scales the cost of forwards that
    carry drafts (k > 0): how much slower such forwards measured than the curve predicts, relative to root-only
    ones (`forerun.batch.Batch` learns it online). `weights` (default 1 each): what a row's progress is worth, e.g.
    in a batch that no row will join only the rows with the most left to do decide when it ends.

    Example (2 tokens cost 1.5x one token, 4 tokens 1.6x, 8 tokens 3x):
        >>> curve = LatencyCurve((1, 2, 4, 8), (0.010, 0.015, 0.016, 0.030))
        >>> best_shared_count([[0.6, 0.5]], curve), best_shared_count([[0.6, 0.5]] * 4, curve)
        (2, 0)
    """
    rows = len(chances)
    weights = [1.0] * rows if weights is None else list(weights)
    best, best_rate = 0, sum(weights) / curve.batch_cost(rows, 1)
    longest = max((len(c) for c, w in zip(chances, weights, strict=True) if w > 0), default=0)
    for k in range(1, longest + 1):
        if cap is not None and 1 + k > cap:
            break
        gain = sum(w * (1.0 + sum(c[:k])) for c, w in zip(chances, weights, strict=True))
        rate = gain / (curve.batch_cost(rows, 1 + k) * draft_penalty)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


TIME_DECAY = 0.95
"""Per timed step: a `ForwardTimes` ratio remembers about its last twenty forwards."""
TIME_RELAX = 0.9
"""Per 1-token forward after `IDLE_STEPS` of them in a row, the drafted ratio keeps this much of its distance from
the 1-token one: a penalty learnt in a burst of load, or in a long context since gone, that stopped all drafting
is forgotten (the next drafted step measures afresh) instead of stopping it for good."""
IDLE_STEPS = 16
TIME_PRIOR = 2.0
"""The curve's own price counts as this many forwards until timings arrive."""
RATIO_BOUNDS = (1 / 3, 3.0)
"""One timing moves a ratio at most as if it measured 3x off the curve: a scheduler stall or a page fault mid-
forward is not the device's cost."""
PENALTY_BOUNDS = (0.5, 3.0)


@dataclass
class ForwardTimes:
    """Measured / predicted seconds of this device's forwards, recency-weighted: for 1-token forwards (`root`) and
    for forwards of more tokens (`drafted`), each against the latency curve.

    The curve is measured once, after 256 cached tokens, and kept on disk; the forwards a request makes are not
    those: after a 2000-token document 8 tokens cost 2.55x one token here instead of 1.6x (attention grows with the
    context, and with a tree's mask transformers copies the cache per head group), and a curve measured while the
    machine was busy keeps that machine's shape (stored: 12 tokens 2.06x one token; measured quiet: 2.23x). Only
    the ratio of the two corrections changes a decision (`penalty`): a load that slows every forward alike cancels.

    Example (drafted forwards measuring 1.5x their curve price, 1-token ones on it):
        >>> times = ForwardTimes()
        >>> for _ in range(60):
        ...     times.record(1, 0.010, 0.010)
        ...     times.record(8, 0.020, 0.030)
        >>> round(times.penalty, 2)
        1.5
    """

    root: float = 1.0
    drafted: float = 1.0
    weights: tuple[float, float] = (TIME_PRIOR, TIME_PRIOR)
    """How many (recency-weighted) forwards stand behind `root` and `drafted`: the first timings move a young
    estimate most (an average until about 1 / (1 - TIME_DECAY) forwards, a moving average after)."""
    idle: int = 0
    """1-token forwards since the last drafted one."""

    def record(self, fed: int, predicted: float, seconds: float) -> None:
        """One forward of `fed` tokens, priced `predicted` by the curve, took `seconds`."""
        if not (predicted > 0 and math.isfinite(seconds) and seconds > 0):
            return
        ratio = min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], seconds / predicted))
        root_weight, drafted_weight = self.weights
        if fed > 1:
            drafted_weight = TIME_DECAY * drafted_weight + 1
            self.drafted += (ratio - self.drafted) / drafted_weight
            self.weights, self.idle = (root_weight, drafted_weight), 0
            return
        root_weight = TIME_DECAY * root_weight + 1
        self.root += (ratio - self.root) / root_weight
        self.weights, self.idle = (root_weight, drafted_weight), self.idle + 1
        if self.idle > IDLE_STEPS:
            self.drafted = self.root + TIME_RELAX * (self.drafted - self.root)

    @property
    def penalty(self) -> float:
        """How much dearer than the curve says a forward of several tokens is, relative to a 1-token forward."""
        return min(PENALTY_BOUNDS[1], max(PENALTY_BOUNDS[0], self.drafted / self.root))


@dataclass
class StaticBudget:
    """Graft the proposals in order until `max_nodes` nodes (root included): a fixed budget."""

    max_nodes: int
    selective = False
    """Drafters propose only what they want fed."""

    def choose(self, root: int, proposals: Sequence[TokenTree], lead: int = 0, drafts: bool = True) -> Selection:
        """`drafts=False`: feed the root alone this step."""
        tree, node_maps = merge(root, proposals, self.max_nodes if drafts else 1)
        return Selection(tree, node_maps)

    def learn(self, selection: Selection, committed: Sequence[int]) -> None:
        pass

    def timed(self, fed: int, seconds: float) -> None:
        pass

    def new_request(self) -> None:
        pass


@dataclass
class CostModel:
    """Feed what maximises expected committed tokens per second, on `curve`, at most `max_nodes` per forward."""

    curve: LatencyCurve
    max_nodes: int
    calibration: Calibration = field(default_factory=Calibration)
    fed_check: FedCheck = field(default_factory=FedCheck)
    """How right the fed guesses were against their estimates: corrects what selecting on estimates does."""
    times: ForwardTimes | None = field(default_factory=ForwardTimes)
    """How this device's forwards measure against `curve` (`timed`): drafted forwards are priced with its penalty.
    None: `curve` is the price, as it is (a hand-made curve, in tests)."""
    selective = True
    """Drafters propose whatever might pay; this model picks."""

    def raw_chances(self, tree: TokenTree, keys: Sequence[tuple[str, float] | None]) -> list[float]:
        """Per node of the merged `tree`: P(accepted | parent accepted), calibrated in the cell of its `keys`
        (who proposed it, who disputes it: `support_keys`); probes and the root get 0 and 1."""
        p = [0.0] * len(tree)
        p[0] = 1.0
        for node in range(1, len(tree)):
            key = keys[node]
            if key is not None:
                p[node] = self.calibration.probability(key[0], tree.depths[node], key[1])
        return p

    def chances(
        self, tree: TokenTree, keys: Sequence[tuple[str, float] | None], raw: list[float] | None = None
    ) -> list[float]:
        """The `raw_chances` (given or computed), corrected for being selected on (`FedCheck`), siblings capped.

        One token follows a node, so siblings' chances sum to at most 1: the likeliest sibling keeps its estimate
        and the others share only what is left (not a proportional cut, which would tax the best guess for the
        mere presence of a poor one).
        """
        raw = self.raw_chances(tree, keys) if raw is None else raw
        p = [1.0] + [x if keys[i] is None else self.fed_check.adjust(keys[i][0], x) for i, x in enumerate(raw) if i]
        siblings: dict[int, list[int]] = {}
        for node in range(1, len(tree)):
            siblings.setdefault(tree.parents[node], []).append(node)
        for group in siblings.values():
            left = 1.0
            for node in sorted(group, key=lambda n: -p[n]):
                p[node] = min(p[node], left)
                left -= p[node]
        return p

    def rank(self, root: int, proposals: Sequence[TokenTree]) -> Ranking:
        """Merge the proposals and order their verifiable candidates by path probability (best first)."""
        merged, node_maps = merge(root, proposals)
        if len(merged) == 1:
            return Ranking(merged, node_maps, [], [], [None])
        keys = support_keys(merged, proposals, node_maps)
        raw = self.raw_chances(merged, keys)
        p = self.chances(merged, keys, raw)
        reach = [1.0] + [0.0] * (len(merged) - 1)
        verifiable = [True] + [False] * (len(merged) - 1)  # a candidate under a probe can never be accepted
        for node in range(1, len(merged)):  # parents come first: one pass
            parent = merged.parents[node]
            if merged.roles[node] == "candidate" and verifiable[parent]:
                verifiable[node] = True
                reach[node] = reach[parent] * p[node]
        # Zero-chance candidates stay in the list, last: on a non-monotone curve they may pad a forward to a
        # cheaper size (here 4 tokens cost less than 3).
        candidates = [n for n in range(1, len(merged)) if verifiable[n]]
        candidates.sort(key=lambda n: (-reach[n], n))  # a child never precedes its parent
        return Ranking(merged, node_maps, candidates, [reach[n] for n in candidates], keys, raw)

    def choose(self, root: int, proposals: Sequence[TokenTree], lead: int = 0, drafts: bool = True) -> Selection:
        ranking = self.rank(root, proposals)
        merged, node_maps = ranking.merged, ranking.node_maps
        if not drafts:
            return ranking.select(0)
        # Each proposal's probes form an optional group, worth the sum of their scores (the drafter's estimate
        # of the future accepted tokens feeding them buys), fed whole or not at all.
        probes_of = [
            [m for n, m in node_map.items() if proposal.roles[n] == "probe"]
            for proposal, node_map in zip(proposals, node_maps, strict=True)
        ]
        offered = [i for i, probes in enumerate(probes_of) if probes][:MAX_GROUPS]
        groups = [(sum(merged.scores[m] for m in probes_of[i]), len(probes_of[i])) for i in offered]
        penalty = self.times.penalty if self.times is not None else 1.0
        choice = best_prefix(ranking.chances, self.curve, lead, self.max_nodes, groups, penalty)
        probes = [m for g in choice.groups for m in probes_of[offered[g]]]
        return ranking.select(choice.nodes, probes, choice.expected_accepted, choice.padding)

    def learn(self, selection: Selection, committed: Sequence[int]) -> None:
        """Check every node proposed this step (`selection.ranking`), fed or not, against the `committed` tokens."""
        ranking = selection.ranking
        if ranking is not None:
            self.calibration.learn(ranking.merged, committed, ranking.keys)
            if ranking.raw:
                self.fed_check.learn(ranking, selection.fed, committed)

    def timed(self, fed: int, seconds: float) -> None:
        """A decoding forward (no prompt lead) of `fed` tokens took `seconds`, verification included."""
        if self.times is not None:
            self.times.record(fed, self.curve.cost(fed), seconds)

    def new_request(self) -> None:
        self.calibration.new_request()
