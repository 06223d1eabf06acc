"""The budgets the step loop asks what to feed: `StaticBudget` (what the knobs ask) and `CostModel` (what pays),
behind one `Budget` protocol, and `ForwardTimes` (this run's forwards against the curve)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from forerun.costmodel.calibration import MAX_GROUPS, MAX_PROBABILITY, Calibration, FedCheck
from forerun.costmodel.choice import Ranking, Selection, best_prefix, chain_selection, support_keys
from forerun.costmodel.curve import LatencyCurve
from forerun.costmodel.switch import DraftSwitch
from forerun.tree import TokenTree, best_chain, merge

PROPOSAL_COST = 2.0
"""A row in a batch proposes at most as many nodes as the batch could feed per row for this many times the cost of
a step of one token per row (shared among its drafters: `forerun.costmodel.batch.drafter_share`): per-row drafting
work (proposing, ranking, merging) is paid whether fed or not, and bigger trees are never fed in a batch (bf16, 8
rows: 4 tokens per row already cost 1.7x one)."""


class Budget(Protocol):
    """What the step loop asks each step: which of the proposed nodes to feed (`choose`), and what it tells back
    (`learn` the committed tokens, `timed` a forward, `new_request`). `curve`: the latency curve it prices on
    (None: it feeds what the knobs ask, whatever the device)."""

    max_nodes: int
    selective: bool
    """Whether drafters may propose whatever might pay (the budget picks), or only what they want fed."""
    reproducible: bool
    """Whether it decides from stored measurements and learned acceptance only, never from this run's wall-clock
    timings (then a batch of its rows does not steer by timings either: `forerun.costmodel.batch`)."""
    switch: DraftSwitch | None
    """Whether a row's costly drafters draft this step (None: always)."""
    chain: bool
    """Whether it feeds one chain of the proposals (a model with recurrent states: `forerun.base.chain`)."""

    @property
    def curve(self) -> LatencyCurve | None: ...

    def choose(self, root: int, proposals: Sequence[TokenTree], lead: int = 0, drafts: bool = True) -> Selection: ...

    def learn(self, selection: Selection, committed: Sequence[int]) -> None: ...

    def timed(self, fed: int, seconds: float) -> None: ...

    def priced_step(self, fed: int, drafter_seconds: float, rows: int = 1) -> float:
        """A step's seconds on stored measurements alone, for a switch that must not time (`CostModel.priced_step`)."""
        ...

    def new_request(self) -> None: ...

    def for_row(self, switch: DraftSwitch | None = None) -> Budget:
        """The budget of one row of a batch (its own per-request state, the shared long-run state; `switch`: the
        batch's for costly drafters, where this budget weighs them)."""
        ...

    def proposal_nodes(self, rows: int) -> int:
        """Most nodes, root included, a row's drafters may propose in a batch of `rows` rows."""
        ...


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
    reproducible = True
    """What it feeds follows the knobs alone."""
    switch = None
    """Every drafter drafts every step, as its knobs ask."""
    chain: bool = False
    """Feed one chain of the proposals (the first drafter's first line): a model with recurrent states
    (`forerun.base.chain`)."""

    def priced_step(self, fed: int, drafter_seconds: float, rows: int = 1) -> float:
        """Never asked (no switch); a forward a step."""
        return 1.0

    def choose(self, root: int, proposals: Sequence[TokenTree], lead: int = 0, drafts: bool = True) -> Selection:
        """`drafts=False`: feed the root alone this step."""
        if self.chain and drafts:
            merged, maps = merge(root, proposals)
            first = [-node for node in range(len(merged))]  # the earliest child: the first proposal's line
            return chain_selection(merged, maps, best_chain(merged, first)[: self.max_nodes - 1])
        tree, node_maps = merge(root, proposals, self.max_nodes if drafts else 1)
        return Selection(tree, node_maps)

    def learn(self, selection: Selection, committed: Sequence[int]) -> None:
        pass

    def timed(self, fed: int, seconds: float) -> None:
        pass

    def new_request(self) -> None:
        pass

    @property
    def curve(self) -> None:
        return None

    def for_row(self, switch: DraftSwitch | None = None) -> StaticBudget:
        return self

    def proposal_nodes(self, rows: int) -> int:
        return self.max_nodes


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
    reproducible: bool = False
    """Decide from `curve` and the learned acceptance only: `times` is neither kept nor used. In low precision each
    tree shape rounds differently, so a choice steered by this run's timings could move a numerical tie from run to
    run; from stored measurements, the same prompt gives the same text every run (`EngineConfig.reproducible`)."""
    switch: DraftSwitch | None = None
    """Whether the costly drafters (a trained head: forwards of its own before the target's) draft this step,
    from rates with and without them: measured, or priced on the curve when choices are `reproducible`
    (`priced_step`); None: they always draft."""
    selective = True
    """Drafters propose whatever might pay; this model picks."""
    chain: bool = False
    """Feed one chain, the likeliest line of the proposals, and price feeding a partly accepted chain's head again
    with the next step: a model with recurrent states (`forerun.base.chain`)."""
    refeeds: bool = True
    """With `chain`: whether a partly accepted chain's head is fed again (states copied and put back); False where
    the states are cut back instead (convolution windows only: `forerun.base.chain.croppable`)."""

    def raw_chances(self, tree: TokenTree, keys: Sequence[tuple[str, float] | None]) -> list[float]:
        """Per node of the merged `tree`: P(accepted | parent accepted), calibrated in the cell of its `keys`
        (who proposed it, who disputes it: `support_keys`); probes and the root get 0 and 1."""
        p = self.calibration.probabilities(tree.depths, keys)
        p[0] = 1.0
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
        factors: dict[str, float] = {}  # per source, worked out once
        p = [1.0] * len(tree)
        for node in range(1, len(tree)):
            key = keys[node]
            if key is None:
                p[node] = raw[node]
                continue
            factor = factors.get(key[0])
            if factor is None:
                factor = factors[key[0]] = self.fed_check.factor(key[0])
            p[node] = min(MAX_PROBABILITY, raw[node] * factor)
        siblings: dict[int, list[int]] = {}
        for node in range(1, len(tree)):
            siblings.setdefault(tree.parents[node], []).append(node)
        for group in siblings.values():
            if len(group) == 1:  # an only child keeps its chance (at most MAX_PROBABILITY < 1)
                continue
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
        if self.chain:
            candidates = best_chain(merged, reach)
        else:
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
        offered = [] if self.chain else [i for i, probes in enumerate(probes_of) if probes][:MAX_GROUPS]
        groups = [(sum(merged.scores[m] for m in probes_of[i]), len(probes_of[i])) for i in offered]
        penalty = self.times.penalty if self.times is not None and not self.reproducible else 1.0
        refeed = self.chain and self.refeeds
        choice = best_prefix(ranking.chances, self.curve, lead, self.max_nodes, groups, penalty, refeed, self.chain)
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
        if self.times is not None and not self.reproducible:
            self.times.record(fed, self.curve.cost(fed), seconds)

    def priced_step(self, fed: int, drafter_seconds: float, rows: int = 1) -> float:
        """A step's seconds on stored measurements alone (reproducible choices time nothing): the forward of `fed`
        tokens on the curve, plus the costly drafters' own forwards as priced on their own measured costs
        (`drafter_seconds`, e.g. `forerun.drafters.eagle3.costs.HeadCosts`). A row among `rows` of a batch pays
        its share of their forward (`LatencyCurve.batch_cost`) and its drafters' forwards whole.

        Example (1 token 10 ms, 8 tokens 12 ms; a head's three forwards priced at 1 ms each; 4 rows of 8 tokens
        48 ms):
            >>> four = LatencyCurve((1, 8), (0.016, 0.048))
            >>> model = CostModel(LatencyCurve((1, 8), (0.010, 0.012), ((4, four),)), 16)
            >>> round(model.priced_step(8, 0.003), 4), round(model.priced_step(1, 0), 4)
            (0.015, 0.01)
            >>> round(model.priced_step(8, 0.003, rows=4), 4)
            0.015
        """
        return self.curve.batch_cost(rows, fed) / rows + drafter_seconds

    def new_request(self) -> None:
        self.calibration.new_request()

    def for_row(self, switch: DraftSwitch | None = None) -> CostModel:
        """A row's own budget: the same curve, long-run calibration and check of fed guesses, its own per-request
        correction (no forward timings: a batch times its forwards itself, `forerun.costmodel.batch`). Where this
        budget weighs costly drafters (it has a switch), the row's are weighed by `switch`, the batch's (its rows
        share it: `BatchPolicy.costly`); without one they always draft."""
        calibration = Calibration(hits=self.calibration.hits, trials=self.calibration.trials)
        weighed = switch if self.switch is not None else None
        return replace(self, calibration=calibration, times=None, switch=weighed)

    def proposal_nodes(self, rows: int) -> int:
        """Most nodes, root included, a row's drafters may propose in a batch of `rows` rows (`PROPOSAL_COST`).

        Example (2 rows: 1 token each 12 ms, 2: 18 ms, 4: 24 ms, 8: 40 ms):
            >>> two = LatencyCurve((1, 2, 4, 8), (0.012, 0.018, 0.024, 0.040))
            >>> budget = CostModel(LatencyCurve((1, 8), (0.010, 0.012), ((2, two),)), 16)
            >>> budget.proposal_nodes(1), budget.proposal_nodes(2)
            (16, 4)
        """
        if rows <= 1:
            return self.max_nodes
        bound = PROPOSAL_COST * self.curve.batch_cost(rows, 1)
        return max((n for n in range(1, self.max_nodes + 1) if self.curve.batch_cost(rows, n) <= bound), default=1)
