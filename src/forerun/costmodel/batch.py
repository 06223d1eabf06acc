"""How the rows of a batch draft: one candidate count for every row, priced on the batched curve
(`best_shared_count`), whether rows propose at all (`DraftSwitch`, on measured wall-clock rates), and the batch's
own corrections (forward times against the curve, accepted against expected drafts). Pure: no model.

Rows that share one forward pad their trees to one node count, so the cost model picks one count for all rows,
maximising committed tokens per second over the batch; rows x nodes tokens in one forward cost more than one row of
as many tokens (every row reads its own cache: `LatencyCurve.batch_cost`), so the per-row budget shrinks as the
batch grows, down to one token per row per step when drafting does not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from forerun.costmodel.budgets import Budget, CostModel
from forerun.costmodel.choice import Selection
from forerun.costmodel.curve import LatencyCurve
from forerun.costmodel.switch import FIRST_PROBE_STEPS, DraftSwitch, IdleProposals
from forerun.tree import TokenTree, merge

BATCH_PRIOR = 4.0
"""Pseudo-tokens (expected = accepted) behind the batch's correction of the chances."""
BATCH_DECAY = 0.9
"""Per step: the batch's correction remembers about its last ten steps."""
CLOSED_FOCUS = 4.0
"""How sharply a closed batch weighs the rows with the most steps left (a row 10% ahead counts 0.66)."""
SHARE_FLOOR = 16
"""Nodes, root included, each drafter of a row in a batch may propose however many drafters share the row's cap
(`drafter_share`), where the cap allows as many: room for a useful tree of its own."""
REBASE_FACTOR = 2.0
"""A batch re-measures whether drafting pays once its cache is this many times longer or shorter (`Batch.rebase`)."""


@dataclass
class BatchPolicy:
    """A batch's drafting decisions and what it has measured (one per `forerun.batch.Batch`).

    `closed`: no row will join any more (`decode_rows` once nothing waits): the batch ends with its slowest row, so
    drafts are weighed by how much each row has left to do (`weights`); open batches (the server) weigh every
    row's progress alike.
    """

    closed: bool = False
    measured: dict[bool, float] = field(default_factory=lambda: {False: 1.0, True: 1.0})
    """Measured / predicted forward time (`LatencyCurve.batch_cost`), recency-weighted, for root-only steps (False)
    and steps with drafts (True): batched shapes may not cost what the curve says, and only their ratio matters to
    the decision (`best_shared_count`'s draft_penalty)."""
    switch: DraftSwitch = field(default_factory=lambda: DraftSwitch())
    """Whether rows propose at all (measured wall-clock rates of drafting and plain steps)."""
    idle: IdleProposals = field(default_factory=IdleProposals)
    """Whether rows propose at all where choices must be reproducible (what the cost model fed of their last
    proposals: no clock)."""
    idle_rows: int = 0
    """The most rows `idle` has heard a step of since it started over: at half as many rows or fewer drafting may
    pay again, so it starts over (not at every row that leaves: a server's rows come and go every few steps)."""
    costly: DraftSwitch = field(default_factory=lambda: DraftSwitch(probing=FIRST_PROBE_STEPS, paired=True))
    """Whether the rows' costly drafters (trained heads) draft, where their budgets weigh them (`CostModel.for_row`):
    one switch for every row, told each row's steps (a row-step each) paired with what the batch would have fed
    without the heads (`Batch.without_costly`), at the row's share of the batch's forward and its head's forwards
    whole: a head that pays alone may not beside other rows, whose forward it cannot share."""
    measured_at: int = 1
    """Cache slots when the switch and the forward-time corrections began measuring (`rebase`)."""
    expected: float = 0.0
    accepted: float = 0.0
    """Recency-weighted sums over the batch's steps of the cost model's expected and the actually accepted drafts:
    their ratio corrects the chances the next decision is made on (the rows' calibrations are each young, and a
    batch multiplies any optimism by its rows)."""

    @staticmethod
    def shared_curve(budgets: Sequence[Budget]) -> LatencyCurve | None:
        """The curve the draft switch prices steps on: only for two rows or more that all price on a curve (a row
        alone drafts as a single run does; static budgets always propose)."""
        if len(budgets) < 2 or any(budget.curve is None for budget in budgets):
            return None
        return budgets[0].curve

    def drafting(self, budgets: Sequence[Budget]) -> bool:
        """Whether the rows propose this step: by measured rates (`switch`), or where the budgets must not steer
        by timings, by what the cost model fed of their last proposals (`idle`)."""
        if self.shared_curve(budgets) is None:
            return True
        if steered(budgets):
            return self.switch.drafting()
        if 2 * len(budgets) <= self.idle_rows:
            self.idle, self.idle_rows = IdleProposals(), len(budgets)
        return self.idle.proposing()

    @staticmethod
    def proposal_caps(budgets: Sequence[Budget], drafters: Sequence[int]) -> list[int]:
        """Each row's most nodes for each of its drafters to propose (`drafters`: per row, how many it has): the
        row's cap (`Budget.proposal_nodes`; rows of one Decoder share a curve and a cap: priced once), shared
        among its drafters in a batch (`drafter_share`); a row alone gives each drafter its whole cap."""
        caps: dict[tuple[int, int], int] = {}
        out = []
        for budget, count in zip(budgets, drafters, strict=True):
            shape = (id(budget.curve), budget.max_nodes)
            if shape not in caps:
                caps[shape] = budget.proposal_nodes(len(budgets))
            out.append(caps[shape] if len(budgets) < 2 else drafter_share(caps[shape], count))
        return out

    def choose(
        self,
        roots: Sequence[int],
        proposals: Sequence[Sequence[TokenTree]],
        budgets: Sequence[Budget],
        steps_left: Sequence[float],
        lead: int = 0,
    ) -> list[Selection]:
        """Each row's tree for this step: with cost models, one shared count of candidates (what is fed never
        changes what is written, greedy or sampled: `forerun.noise`, so timings may steer); with static budgets,
        each row's share of its own node budget. `steps_left`: per row, what it has left to do (`weights`);
        `lead`: tokens a lone row feeds again before its tree (a hybrid's, `forerun.base.lone_chain`)."""
        if len(budgets) == 1:
            return [budgets[0].choose(roots[0], proposals[0], lead)]
        if all(isinstance(budget, CostModel) for budget in budgets):
            rankings = [budget.rank(root, p) for budget, root, p in zip(budgets, roots, proposals, strict=True)]
            correction = min(1.0, (self.accepted + BATCH_PRIOR) / (self.expected + BATCH_PRIOR))
            chances = [[c * correction for c in r.chances] for r in rankings]
            cap = min(budget.max_nodes for budget in budgets)
            penalty = max(1.0, self.measured[True] / self.measured[False]) if steered(budgets) else 1.0
            count = best_shared_count(chances, budgets[0].curve, cap, penalty, self.weights(steps_left))
            return [ranking.select(count) for ranking in rankings]
        return [shared_out(budget, root, p, max(1, budget.max_nodes // len(budgets)))
                for budget, root, p in zip(budgets, roots, proposals, strict=True)]  # fmt: skip

    def weights(self, steps_left: Sequence[float]) -> list[float] | None:
        """What each row's progress is worth to a closed batch: (steps it has left / the most any row has left) to
        the power CLOSED_FOCUS. A closed batch lasts as long as its slowest row, and a forward of fewer rows costs
        nearly as much, so tokens won by rows that will finish first anyway buy little wall time.

        Example:
            >>> BatchPolicy(closed=True).weights([10.0, 9.0, 0.0])
            [1.0, 0.6561, 0.0]
        """
        if not self.closed:
            return None
        most = max(steps_left, default=0.0)
        return [(n / most) ** CLOSED_FOCUS if most else 1.0 for n in steps_left]

    def rebase(self, slots: int) -> None:
        """Forget the measured rates and forward-time corrections when the cache has grown or shrunk more than
        REBASE_FACTOR-fold since they were measured: a tree costs a batch more beside a long row (every row reads
        the padded cache), so what was measured while a long prompt's row decoded must not pause drafting once it
        has left (measured: drafting paused for 150 steps after a 2150-token row left 3 short ones, 40.0 s against
        32.7 s for the same work)."""
        slots = max(1, slots)
        if not self.measured_at / REBASE_FACTOR <= slots <= self.measured_at * REBASE_FACTOR:
            self.switch, self.measured, self.measured_at = DraftSwitch(), {False: 1.0, True: 1.0}, slots
            self.idle, self.idle_rows = IdleProposals(), 0

    def learn(
        self,
        budgets: Sequence[Budget],
        selections: Sequence[Selection],
        kept: Sequence[Sequence[int]],
        nodes: int,
        forward_s: float,
    ) -> None:
        """Update the corrections: measured vs predicted forward time, accepted vs expected drafts."""
        rows = len(selections)
        if rows < 2:
            return
        curve = budgets[0].curve
        if curve is not None and steered(budgets):
            drafted = nodes > 1
            ratio = forward_s / curve.batch_cost(rows, nodes)
            self.measured[drafted] = BATCH_DECAY * self.measured[drafted] + (1 - BATCH_DECAY) * ratio
        expected = sum(selection.expected_accepted or 0.0 for selection in selections)
        if expected > 0:  # only drafted steps are evidence: root-only ones must not fade a lesson back to optimism
            self.expected = BATCH_DECAY * self.expected + expected
            self.accepted = BATCH_DECAY * self.accepted + sum(len(path) - 1 for path in kept)

    def record(
        self,
        budgets: Sequence[Budget],
        drafting: bool,
        kept: Sequence[Sequence[int]],
        seconds: float,
        nodes: int,
    ) -> None:
        """One whole step for the draft switch: its rate, tokens per row per predicted plain step; or, where
        choices are reproducible, whether the rows proposed and any candidate was fed (`nodes`: per row)."""
        curve = self.shared_curve(budgets)
        if curve is None:
            return
        if not steered(budgets):
            self.idle.record(drafting, nodes > 1)
            self.idle_rows = max(self.idle_rows, len(budgets))
            return
        tokens = sum(len(path) for path in kept) / len(kept)
        self.switch.record(drafting, tokens * curve.batch_cost(len(kept), 1) / max(seconds, 1e-9))


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
    if cap is not None:
        longest = max(0, min(longest, cap - 1))  # a cap of one node (the root) leaves no candidate
    # the gain at k, summed over rows as each row's k-th chance adds to it: one pass over the chances, not k
    added = [0.0] * (longest + 1)
    for c, w in zip(chances, weights, strict=True):
        for k, chance in enumerate(c[:longest], 1):
            added[k] += w * chance
    gain = sum(weights)
    for k in range(1, longest + 1):
        gain += added[k]
        rate = gain / (curve.batch_cost(rows, 1 + k) * draft_penalty)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def drafter_share(cap: int, drafters: int) -> int:
    """Most nodes, root included, each of a batch row's `drafters` proposes under the row's `cap`: an equal share,
    but never under min(cap, SHARE_FLOOR). On a flat curve (a card's) a 16-row batch's cap is 64 nodes a row, and
    each of `auto`'s three drafters filling it made ~150 merged nodes a row to rank, of which the cost model fed
    20-30; ranking, merging and learning every proposed node is host work paid whether fed or not.

    Example:
        >>> drafter_share(49, 3), drafter_share(64, 3), drafter_share(64, 1), drafter_share(8, 3)
        (16, 21, 64, 8)
    """
    return max(cap // max(1, drafters), min(cap, SHARE_FLOOR))


def shared_out(budget: Budget, root: int, proposals: Sequence[TokenTree], share: int) -> Selection:
    """A static budget's row tree in a batch: at most `share` nodes of its proposals, merged, or the chain its
    budget feeds (`Budget.chain`: a hybrid's rows, `forerun.base.chain`) cut to them."""
    if not budget.chain:
        return Selection(*merge(root, proposals, share))
    return replace(budget, max_nodes=share).choose(root, proposals)


def steered(budgets: Sequence[Budget]) -> bool:
    """Whether the batch may steer by its wall-clock timings (no row asks for reproducible choices)."""
    return not any(budget.reproducible for budget in budgets)
