"""Whether drafting pays its own time: `DraftSwitch` compares measured wall-clock rates with and without it.

The cost model weighs forwards; what drafting costs before the forward (proposing, ranking, a trained head's own
forwards) it does not see. A batch asks whether its rows propose at all (`forerun.costmodel.batch`); a single row
asks whether its costly drafters (a trained head) draft this step (`CostModel.switch`). Pure: no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from forerun.tree import TokenTree

SWITCH_DECAY = 0.9
"""Per step: each mode's measured rate remembers about its last ten steps."""
PAIRED_DECAY = 0.98
"""Per step, for a paired switch's totals: about the last fifty steps. Paired evidence compares the same steps, so
it can be kept long; a few steps where another drafter's long guess held must not decide alone."""
PAUSE_STEPS = 32
"""Steps decoded without drafting once drafting has measured slower than not drafting; each probe that finds it
still slower doubles the next pause, up to `MAX_PAUSE_STEPS` (a probe costs what drafting loses)."""
MAX_PAUSE_STEPS = 256
DRAFT_MARGIN = 1.03
"""Drafting is kept only while it measures at least this many times plain decoding's rate. At parity it wins
nothing and costs what step timings do not see: each request's drafter start and end (the trie reading the prompt
and learning the answer; ~3.5% of the wall time at 8 bf16 rows on the AVX-512 Xeon, where drafted and plain steps
measured within 1% of each other per token)."""
PROBE_STEPS = 6
"""Steps of drafting after a pause before the comparison is made again (fresh evidence, not the old average)."""
FIRST_PROBE_STEPS = 24
"""Steps of a trained head's drafting before a single row's switch first compares (`DraftSwitch(probing=...)`):
the cost model is still learning how far the head's guesses hold, and judged on six steps a head that pays was
switched off (`benchmarks/first_probe.py` measures first requests by this length)."""


@dataclass
class DraftSwitch:
    """Whether to draft this step (a batch's rows at all; a single row's costly drafters), from measured
    wall-clock rates of both modes.

    The cost model weighs forwards; proposing, ranking and learning cost time too (at 8 rows in bf16 on this CPU,
    ~16% of the wall time), spent before the model may still feed nothing. Each step's rate is recency-weighted
    per mode (a batch measures tokens per row per predicted undrafted step, `curve.batch_cost(rows, 1)`, so
    batches of different sizes compare; a single row, tokens per second). While drafting measures slower than not
    drafting, or faster by less than `DRAFT_MARGIN`, `PAUSE_STEPS` steps go without it (twice as many after each
    probe that confirms it), then `PROBE_STEPS` steps draft before comparing again. Outputs do not depend on it:
    what is fed never changes what is written.

    Example: drafting makes 1.2 tokens per row per step-equivalent, plain decoding 1.3 (d: drafting steps, p: plain):
        >>> import itertools
        >>> def modes(drafted_rate, plain_rate, steps=200):
        ...     switch, modes = DraftSwitch(), ""
        ...     for _ in range(steps):
        ...         drafting = switch.drafting()
        ...         switch.record(drafting, drafted_rate if drafting else plain_rate)
        ...         modes += "d" if drafting else "p"
        ...     return [f"{len(list(run))}{mode}" for mode, run in itertools.groupby(modes)]
        >>> modes(1.2, 1.3)  # plain measured once, then pauses
        ['6d', '6p', '6d', '32p', '6d', '64p', '6d', '74p']
        >>> modes(1.31, 1.3)  # a 1% lead is parity: paused alike
        ['6d', '6p', '6d', '32p', '6d', '64p', '6d', '74p']
        >>> modes(1.4, 1.3)  # 8% ahead: drafting stays on after the one plain measurement
        ['6d', '6p', '188d']
    """

    rates: dict[bool, float] = field(default_factory=lambda: {True: 1.0, False: 1.0})
    """Recency-weighted rates (a batch: tokens per row per predicted undrafted step; a row: tokens per second),
    for drafting steps and the others."""
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    paused: int = 0
    """Plain steps left in the current pause."""
    probing: int = PROBE_STEPS
    """Drafting steps left before the next comparison (a single row's costly drafters start at
    `FIRST_PROBE_STEPS`)."""
    pause: int = PAUSE_STEPS
    """The next pause's length."""
    totals: dict[bool, list[float]] = field(default_factory=lambda: {True: [0.0, 0.0], False: [0.0, 0.0]})
    """A paired switch's recency-weighted [tokens, seconds] per mode."""
    paired: bool = False
    """Each drafting step also tells what the same text would have cost without the drafting (`record_pair`, a
    single row's costly drafters: what the other drafters alone would have fed and kept). Comparisons are then made
    on the same text, and a pause's steps only count down."""

    def drafting(self) -> bool:
        return self.paused == 0

    def record(self, drafted: bool, rate: float) -> None:
        """One step's measured rate; decides the next steps' mode."""
        if not self.paired:  # a paired switch hears drafting steps through `record_pair`
            self.remember(drafted, rate)
        if not drafted:
            self.paused = max(0, self.paused - 1)
            if self.paused == 0:
                self.probing = PROBE_STEPS
            return
        self.probed()

    def record_pair(self, tokens: float, seconds: float, tokens_without: float, seconds_without: float) -> None:
        """One drafting step's tokens and seconds, and the tokens and seconds of the same text without the
        drafting. Each mode's rate is its recency-weighted tokens over its recency-weighted seconds: a mean of
        per-step rates would let the few cheap steps where another drafter's long guess held outweigh many steps the
        drafting won.

        Example: the head's steps make 1.0 tokens per unit of time, the same steps without it 1.2:
            >>> switch = DraftSwitch(paired=True, probing=4)
            >>> for _ in range(4):
            ...     switch.record_pair(2, 2.0, 1.2, 1.0)
            >>> switch.drafting(), switch.paused
            (False, 32)
        """
        for drafted, made, spent in ((True, tokens, seconds), (False, tokens_without, seconds_without)):
            total = self.totals[drafted]
            total[0], total[1] = PAIRED_DECAY * total[0] + made, PAIRED_DECAY * total[1] + spent
            self.rates[drafted] = total[0] / max(total[1], 1e-12)
            self.seen[drafted] += 1
        self.probed()

    def remember(self, drafted: bool, rate: float) -> None:
        weight = 1 - SWITCH_DECAY if self.seen[drafted] else 1.0  # the first measurement replaces the prior
        self.rates[drafted] = (1 - weight) * self.rates[drafted] + weight * rate
        self.seen[drafted] += 1

    def probed(self) -> None:
        """A drafting step is over: at the end of a probe, compare and pause (or not)."""
        self.probing = max(0, self.probing - 1)
        if self.probing == 0:
            if not self.seen[False]:
                self.paused = PROBE_STEPS  # plain decoding not measured yet: measure it briefly
            elif self.rates[True] < DRAFT_MARGIN * self.rates[False]:
                self.paused, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE_STEPS)
            else:
                self.pause = PAUSE_STEPS


IDLE_STEPS = 2
"""Proposing steps in a row whose proposals the cost model fed none of (every row its root alone) before a
reproducible batch pauses its proposals (`IdleProposals`)."""
IDLE_PAUSE_STEPS = 4
"""The first such pause; each probe that again feeds no candidate doubles it, up to `MAX_IDLE_PAUSE_STEPS`."""
MAX_IDLE_PAUSE_STEPS = 32
"""The longest pause: where drafting never pays, one step in 33 still proposes (and finds whether it pays again)."""


@dataclass
class IdleProposals:
    """Whether a reproducible batch's rows propose this step, from what the cost model fed of their last proposals.

    A batch whose choices must be reproducible may not steer by timings (`DraftSwitch`), but proposing is work
    the forward does not show: each row's drafters proposing and the cost model ranking their trees cost host
    time every step, wasted where the shared count comes out 0 and every row feeds its root alone (most steps of
    8 rows or more in bf16 or int4 on a CPU; on a card's captured forward that host time is the step's largest
    part). What the cost model chose is known without a clock: after `IDLE_STEPS` proposing steps in a row whose
    shared count was 0, `IDLE_PAUSE_STEPS` steps go without proposals, then one step proposes again (a probe);
    each probe that feeds no candidate doubles the next pause, up to `MAX_IDLE_PAUSE_STEPS`, and any step that
    feeds a candidate ends the back-off. Every input is a choice made on stored measurements and the tokens, so
    the same batch pauses at the same steps every run (and what is fed never changes what is written).

    Example (d: proposals fed, 0: proposed, none fed, p: paused):
        >>> def modes(fed: str) -> str:
        ...     idle, seen, fed = IdleProposals(), "", iter(fed)
        ...     while len(seen) < 40:
        ...         proposing = idle.proposing()
        ...         drafted = proposing and next(fed) == "d"
        ...         idle.record(proposing, drafted)
        ...         seen += ("d" if drafted else "0") if proposing else "p"
        ...     return seen
        >>> modes("0" * 40)  # drafting never pays: ever longer pauses
        '00pppp0pppppppp0pppppppppppppppp0ppppppp'
        >>> modes("00d" + "0" * 40)  # a probe that feeds a candidate starts the back-off over
        '00ppppd00pppp0pppppppp0pppppppppppppppp0'
    """

    idle: int = 0
    """Proposing steps in a row that fed no candidate."""
    paused: int = 0
    """Steps left in the current pause."""
    pause: int = IDLE_PAUSE_STEPS
    """The next pause's length."""

    def proposing(self) -> bool:
        return self.paused == 0

    def record(self, proposed: bool, drafted: bool) -> None:
        """One step: whether its rows proposed, and whether the batch then fed any candidate."""
        if not proposed:
            self.paused = max(0, self.paused - 1)
            return
        if drafted:
            self.idle, self.pause = 0, IDLE_PAUSE_STEPS
            return
        self.idle += 1
        if self.idle >= IDLE_STEPS:  # after a pause the count stays there: one idle probe pauses again
            self.paused, self.pause = self.pause, min(2 * self.pause, MAX_IDLE_PAUSE_STEPS)


def held(tree: TokenTree, tokens: Sequence[int]) -> int:
    """How many of `tokens` (a step's committed tokens: the accepted path, then the target's own next token) the
    candidates of `tree` hold as a path from its root: what verifying `tree` instead would have accepted. Every
    token along the way is the target's own choice at its position, so the count is exact while it is shorter
    than `tokens`; at full length that tree would have gone on by at least its own next token.

    Example: root 5 with the chain 7, 9 and a branch 8; the step committed 7, 9, 4:
        >>> tree = TokenTree.rooted_at(5); _ = tree.add_chain(0, [7, 9]), tree.add(0, 8)
        >>> held(tree, [7, 9, 4]), held(tree, [8, 2]), held(tree, [3])
        (2, 1, 0)
    """
    node, count = 0, 0
    for token in tokens:
        node = tree.children.get((node, token))
        if node is None:
            break
        count += 1
    return count
