"""Many sequences in one forward: batched tree decoding with ragged acceptance.

Every row (one prompt) proposes its own tree with its own drafters; the trees are padded to one node count; each
row has its own 4-D mask rows and position ids, and accepts its own number of drafts. The rows share one KV cache
`[rows, kv_heads, slots, head_dim]` whose slots need not line up: `RowCache.visible` `[rows, slots]` says which
slots hold a row's committed tokens. Holes (left padding where a shorter row joined, the slots a row did not fill
when another accepted more) are masked out for good, and squeezed out once that would free half the slots
(`compact`).

    one step, root r and two nodes fed per row; row 0 accepts its two drafts, row 1 none. The cache grows by the
    longest kept path (root + 2 = 3 slots); row 1's two unused slots become holes:

        row 0  [p p p p | r a a]      visible 1 1 1 1 | 1 1 1
        row 1  [_ p p p | r _ _]      visible 0 1 1 1 | 1 0 0

Positions are per row (tokens committed before the node), never slot indices, so holes change nothing a row
computes: each row's tokens are exactly those of its own single run (fp32). Rows join between steps (`Batch.add`:
their prompt is prefilled alone, with their first tree verified in that forward as a single run does, then spliced
in; or `Batch.begin` and `Batch.feed` a chunk at a time, the running rows stepping in between) and leave when their
own criteria stop them (EOS, stop strings, their own length) or when cancelled; that is what the server's continuous
batching and `forerun run` build on.

The per-row draft budget comes from the device's latency curve, measured with batches too (`LatencyCurve.
batch_cost`: rows x nodes tokens in one forward cost more than one row of as many tokens, since every row reads its
own cache): the cost model picks one candidate count for all rows maximising committed tokens per second over the
batch (`forerun.costmodel.best_shared_count`), down to one token per row per step when drafting does not pay.
Proposing itself costs time the forwards do not show; a `DraftSwitch` compares the measured wall-clock rates of
drafting and plain steps and pauses proposals while drafting is the slower.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList

from forerun.base.dynamic import forward_tree
from forerun.checks import is_count
from forerun.costmodel import Calibration, CostModel, LatencyCurve, Selection, best_shared_count
from forerun.drafters.base import DraftContext, Drafter, StepOutcome
from forerun.engine import (
    Budget,
    NodeScores,
    Sampling,
    Transcript,
    decode,
    tree_in_prefill,
    tree_support,
    verify,
)
from forerun.head import LogitsHead
from forerun.kvcache import keep_accepted, plain_layers, roomy_cache
from forerun.prefixcache import Prefixes
from forerun.stats import GenerationStats
from forerun.tree import TokenTree, as_attention_mask, merge

BATCH_PRIOR = 4.0
"""Pseudo-tokens (expected = accepted) behind the batch's correction of the chances."""
BATCH_DECAY = 0.9
"""Per step: the batch's correction remembers about its last ten steps."""
CLOSED_FOCUS = 4.0
"""How sharply a closed batch weighs the rows with the most steps left (a row 10% ahead counts 0.66)."""
REBASE_FACTOR = 2.0
"""A batch re-measures whether drafting pays once its cache is this many times longer or shorter (`Batch.rebase`)."""
COMPACT_SHARE = 0.5
"""Squeeze the holes out of the cache once they are more than this share of its slots (attention reads them all)."""


def fork(drafters: Sequence[Drafter]) -> list[Drafter]:
    """One more set of drafters for one more concurrent row: state that outlives requests (the trie, the n-gram
    pool, the draft model) is shared, state of one request (indexes, windows, the draft's cache) is rebound by
    `start`, so a shallow copy is a fresh request view."""
    return [copy.copy(drafter) for drafter in drafters]


PROPOSAL_COST = 2.0
"""A row in a batch proposes at most as many nodes as the batch could feed per row for this many times the cost of
a step of one token per row: per-row drafting work (proposing, ranking, merging; ~1 ms per row per step with a
flat curve's wide proposals) is paid whether fed or not, and bigger trees are never fed in a batch (bf16, 8 rows:
4 tokens per row already cost 1.7x one)."""


PAUSE_STEPS = 32
"""Steps a batch decodes without proposing once drafting has measured slower than not drafting; each probe that
finds drafting still slower doubles the next pause, up to `MAX_PAUSE_STEPS` (a probe costs what drafting loses)."""
MAX_PAUSE_STEPS = 256
DRAFT_MARGIN = 1.03
"""Drafting is kept only while it measures at least this many times plain decoding's rate. At parity it wins
nothing and costs what step timings do not see: each request's drafter start and end (the trie reading the prompt
and learning the answer; ~3.5% of the wall time at 8 bf16 rows on the AVX-512 Xeon, where drafted and plain steps
measured within 1% of each other per token)."""
PROBE_STEPS = 6
"""Steps of drafting after a pause before the comparison is made again (fresh evidence, not the old average)."""


@dataclass
class DraftSwitch:
    """Whether a batch's rows propose at all this step, from measured wall-clock rates of both modes.

    The cost model weighs forwards; proposing, ranking and learning cost time too (at 8 rows in bf16 on this CPU,
    ~16% of the wall time), spent before the model may still feed nothing. Each step's rate is measured as
    tokens per row per predicted undrafted step (`curve.batch_cost(rows, 1)`, so batches of different sizes
    compare), recency-weighted per mode. While drafting measures slower than plain decoding, or faster by less
    than `DRAFT_MARGIN`, the batch decodes `PAUSE_STEPS` steps without proposals (twice as many after each probe
    that confirms it), then drafts `PROBE_STEPS` steps before comparing again. Outputs do not depend on it: what is
    fed never changes what is written.

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
    """Recency-weighted tokens per row per predicted undrafted step, for drafting steps and plain ones."""
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    paused: int = 0
    """Plain steps left in the current pause."""
    probing: int = PROBE_STEPS
    """Drafting steps left before the next comparison."""
    pause: int = PAUSE_STEPS
    """The next pause's length."""

    def drafting(self) -> bool:
        return self.paused == 0

    def record(self, drafted: bool, rate: float) -> None:
        """One step's measured rate; decides the next steps' mode."""
        weight = 1 - BATCH_DECAY if self.seen[drafted] else 1.0  # the first measurement replaces the prior
        self.rates[drafted] = (1 - weight) * self.rates[drafted] + weight * rate
        self.seen[drafted] += 1
        if not drafted:
            self.paused = max(0, self.paused - 1)
            if self.paused == 0:
                self.probing = PROBE_STEPS
            return
        self.probing = max(0, self.probing - 1)
        if self.probing == 0:
            if not self.seen[False]:
                self.paused = PROBE_STEPS  # plain decoding not measured yet: measure it briefly
            elif self.rates[True] < DRAFT_MARGIN * self.rates[False]:
                self.paused, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE_STEPS)
            else:
                self.pause = PAUSE_STEPS


def proposal_budget(budget: Budget, rows: int) -> int:
    """Most nodes, root included, a row's drafters may propose in a batch of `rows` rows (`PROPOSAL_COST`).

    Example (2 rows: 1 token each 12 ms, 2: 18 ms, 4: 24 ms, 8: 40 ms):
        >>> from forerun.costmodel import LatencyCurve
        >>> two = LatencyCurve((1, 2, 4, 8), (0.012, 0.018, 0.024, 0.040))
        >>> budget = CostModel(LatencyCurve((1, 8), (0.010, 0.012), ((2, two),)), 16)
        >>> proposal_budget(budget, 1), proposal_budget(budget, 2)
        (16, 4)
    """
    if rows <= 1 or not isinstance(budget, CostModel):
        return budget.max_nodes
    curve, most = budget.curve, budget.max_nodes
    bound = PROPOSAL_COST * curve.batch_cost(rows, 1)
    return max((n for n in range(1, most + 1) if curve.batch_cost(rows, n) <= bound), default=1)


def row_budget(budget: Budget) -> Budget:
    """A row's own budget: the same curve, long-run calibration and check of fed guesses, its own per-request
    correction (no forward timings: a batch times its forwards itself, `Batch.measured`)."""
    if isinstance(budget, CostModel):
        shared = budget.calibration
        calibration = Calibration(hits=shared.hits, trials=shared.trials)
        return CostModel(budget.curve, budget.max_nodes, calibration, budget.fed_check, times=None)
    return budget


@dataclass
class RowJob:
    """What one row needs: its prompt and how it ends."""

    input_ids: torch.Tensor
    """[1, prompt_len], on the model's device."""
    transcript: Transcript
    """Holds the row's stopping criteria (max length, EOS, stop strings, cancel) and its streamer."""
    drafters: list[Drafter]
    eos: frozenset[int]
    max_new_tokens: int
    processor: LogitsProcessorList | None = None
    sampling: Sampling | None = None
    prefixes: Prefixes | None = None
    """Where the prompt's head may already be cached, and where the row leaves what it read."""


@dataclass
class Row:
    """A row of a running batch."""

    job: RowJob
    ctx: DraftContext
    budget: Budget
    prefix_len: int
    """Committed tokens in the cache before the root: the root's position."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    error: Exception | None = None
    """What ended this row early: its drafters, budget or verification failed (the other rows go on)."""

    @property
    def done(self) -> bool:
        return self.job.transcript.done or self.error is not None


@dataclass
class Joining:
    """A row whose prompt is being prefilled (`Batch.begin`, then `Batch.feed` until it returns the row)."""

    row: Row
    cache: DynamicCache
    """The row's own cache: what has been fed so far (its prefix-cache head included)."""
    fed: int
    """Prompt tokens in `cache`."""
    chunks: int = 0
    """Chunks fed so far (the final forward not counted)."""
    begun_s: float = 0.0
    """Seconds `begin` took (drafters reading the prompt): drafting time, for the row's stats."""

    @property
    def left(self) -> int:
        """Prompt tokens still to feed (the last one, fed with the first tree, counted)."""
        return len(self.row.ctx.tokens) - self.fed


class RowCache:
    """One DynamicCache for every row, and which of its slots each row may attend to."""

    def __init__(self, config) -> None:
        self.cache = roomy_cache(config)  # new slots written in place: no copy of every row's cache each step
        self.visible = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]
        self.vacant: list[int] = []
        """Cache rows whose row left (`vacate`): a joining row is written into one in place (`add`), and those still
        empty at the next step go (`settle`). Refilling a place costs one row's copy; dropping a row and appending
        another copied the whole cache twice (~14 ms each at 8 bf16 rows of ~300 slots here)."""

    @property
    def slots(self) -> int:
        return self.visible.shape[1]

    def add(self, row: DynamicCache, length: int) -> int:
        """Take in a row whose own cache holds `length` slots, every one visible: into a vacant place if there is one
        (`refill`), else appended, the shorter side left-padded. Returns the row's index among the held rows.
        """
        if self.vacant:
            return self.refill(row, length)
        rows, slots = self.visible.shape
        size = max(slots, length)
        for mine, theirs in zip(self.cache.layers, row.layers, strict=True):
            ours, new = layer_tensors(mine), layer_tensors(theirs)
            if ours is None and new is None:
                continue
            like = (ours or new)[0]
            ours = ours or (like.new_zeros(rows, like.shape[1], slots, like.shape[3]),) * 2
            new = new or (like.new_zeros(1, like.shape[1], length, like.shape[3]),) * 2
            keys = torch.cat([left_pad(ours[0], size), left_pad(new[0], size)], dim=0)
            values = torch.cat([left_pad(ours[1], size), left_pad(new[1], size)], dim=0)
            set_layer(mine, keys, values)
        visible = torch.ones(1, length, dtype=torch.bool)
        self.visible = torch.cat([left_pad(self.visible, size, dim=1), left_pad(visible, size, dim=1)], dim=0)
        return rows

    def refill(self, row: DynamicCache, length: int) -> int:
        """Write a joining row into the first vacant place, right-aligned (the cache grows on the left first if
        the row is longer than its slots); the place's older slots stay, invisible."""
        place = self.vacant.pop(0)
        if length > self.slots:
            self.grow(length)
        slots = self.slots
        for mine, theirs in zip(self.cache.layers, row.layers, strict=True):
            ours, new = layer_tensors(mine), layer_tensors(theirs)
            if ours is not None and new is not None:
                ours[0][place, :, slots - length :] = new[0][0]
                ours[1][place, :, slots - length :] = new[1][0]
        self.visible[place] = torch.arange(slots) >= slots - length
        return place  # the first vacant place: every place before it is held

    def grow(self, size: int) -> None:
        """Left-pad every row to `size` slots."""
        for layer in self.cache.layers:
            if layer_tensors(layer) is not None:
                set_layer(layer, left_pad(layer.keys, size), left_pad(layer.values, size))
        self.visible = left_pad(self.visible, size, dim=1)

    def places(self) -> list[int]:
        """The cache rows held by rows, in order: the batch's i-th row is cache row `places()[i]`."""
        vacant = set(self.vacant)
        return [place for place in range(self.visible.shape[0]) if place not in vacant]

    def vacate(self, places: Sequence[int]) -> None:
        """Rows at these cache places left: their slots are no one's until a joining row takes the place."""
        for place in places:
            self.visible[place] = False
        self.vacant = sorted({*self.vacant, *places})

    def settle(self) -> None:
        """Before a forward: places no row took go (`drop`), so every cache row is a batch row again."""
        if self.vacant:
            self.drop(self.places())

    def keep(self, kept: Sequence[Sequence[int]], nodes: int) -> None:
        """After a forward of `nodes` padded tree nodes per row: keep each row's path `kept[row]` (node indices,
        root first), gathered to the front of the new slots; the cache grows by the longest path."""
        slots, longest = self.slots, max(len(path) for path in kept)
        if nodes == 1:  # the roots alone: they already sit where they belong
            self.visible = torch.cat([self.visible, torch.ones(len(kept), 1, dtype=torch.bool)], dim=1)
            return
        index = torch.tensor([[slots + path[min(i, len(path) - 1)] for i in range(longest)] for path in kept])
        for layer in self.cache.layers:
            if layer_tensors(layer) is None:
                continue
            keys, values = layer.keys, layer.values  # [rows, heads, slots + nodes, dim]
            where = index.to(keys.device)[:, None, :, None].expand(keys.shape[0], keys.shape[1], longest, keys.shape[3])
            # Gather first (a copy), then write over the tree's slots and cut: no copy of the whole cache.
            keys[:, :, slots : slots + longest] = keys.gather(2, where)
            values[:, :, slots : slots + longest] = values.gather(2, where)
            layer.keys, layer.values = keys[:, :, : slots + longest], values[:, :, : slots + longest]
        filled = torch.arange(longest)[None] < torch.tensor([len(path) for path in kept])[:, None]
        self.visible = torch.cat([self.visible, filled], dim=1)

    def drop(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indices, in order); slots no remaining row sees go, holes are compacted if many."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.vacant = []
        self.visible = self.visible.index_select(0, index)
        for layer in self.cache.layers:
            if layer_tensors(layer) is not None:
                set_layer(
                    layer,
                    layer.keys.index_select(0, index.to(layer.keys.device)),
                    layer.values.index_select(0, index.to(layer.keys.device)),
                )
        if len(rows) and self.slots:
            self.compact(force=not bool(self.visible[:, 0].any()))

    def row(self, row: int) -> DynamicCache:
        """Row `row`'s visible slots alone, in order, as a one-row cache ([1, heads, visible, dim] per layer)."""
        where = self.visible[row].nonzero().flatten()
        single = DynamicCache()
        for index, layer in enumerate(self.cache.layers):
            if layer_tensors(layer) is None:
                return DynamicCache()  # a layer without entries: nothing to keep
            at = where.to(layer.keys.device)
            single.update(layer.keys[row : row + 1, :, at], layer.values[row : row + 1, :, at], index)
        return single

    def compact(self, force: bool = False) -> None:
        """Right-align each row's visible slots (order kept) when that frees more than COMPACT_SHARE of the slots.

        What compacting frees is the slots beyond the longest row's count, not every hole: where one row is much
        longer than the others (a long prompt joined), their padding cannot go, and squeezing would copy the whole
        cache every step for nothing (measured: 4 rows beside a 2150-token prompt, 0.3 s a step)."""
        rows, slots = self.visible.shape
        counts = self.visible.sum(dim=1)
        size = int(counts.max()) if rows else 0
        if not slots or (not force and slots - size <= COMPACT_SHARE * slots):
            return
        index = torch.zeros(rows, size, dtype=torch.long)
        for row in range(rows):
            where = self.visible[row].nonzero().flatten()
            index[row, size - len(where) :] = where
        visible = torch.arange(size)[None] >= (size - counts)[:, None]
        for layer in self.cache.layers:
            if layer_tensors(layer) is None:
                continue
            keys = layer.keys
            where = index.to(keys.device)[:, None, :, None].expand(rows, keys.shape[1], size, keys.shape[3])
            set_layer(layer, keys.gather(2, where), layer.values.gather(2, where))
        self.visible = visible


def layer_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return None
    return layer.keys, layer.values


def set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def left_pad(tensor: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor:
    """Zeros (False) in front along `dim` up to `size`."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def batchable(model: torch.nn.Module) -> bool:
    """Whether rows can share one cache: tree masks work and every cache layer is a plain, addressable one."""
    if tree_support(model) is not None:
        return False
    return plain_layers(DynamicCache(config=model.config))


class Batch:
    """Rows decoding together: `add` rows between steps, `step` until empty; finished rows leave by themselves.

    Example:
        >>> batch = Batch(model, decoder.budget)                              # doctest: +SKIP
        >>> for job in jobs: batch.add(job)                                   # doctest: +SKIP
        >>> while batch.rows: finished = batch.step()                         # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, budget: Budget, closed: bool = False) -> None:
        self.model, self.budget, self.closed = model, budget, closed
        """closed: no row will join any more (`decode_rows` once nothing waits): the batch ends with its slowest row,
        so drafts are weighed by how much each row has left to do (`weights`); open batches (the server) weigh
        every row's progress alike."""
        self.rows: list[Row] = []
        self.cache = RowCache(model.config)
        self.attention = model.config._attn_implementation or "eager"
        self.head = LogitsHead(model)
        """The batch's forwards (its first prefill decides how the logits of a few positions are computed)."""
        self.measured = {False: 1.0, True: 1.0}
        """Measured / predicted forward time (`LatencyCurve.batch_cost`), recency-weighted, for
        root-only steps (False) and steps with drafts (True): batched shapes may not cost what the curve says, and
        only their ratio matters to the decision (`best_shared_count`'s draft_penalty)."""
        self.switch = DraftSwitch()
        """Whether rows propose at all (measured wall-clock rates of drafting and plain steps)."""
        self.measured_at = 1
        """Cache slots when the switch and the forward-time corrections began measuring (`rebase`)."""
        self.expected, self.accepted = 0.0, 0.0
        """Recency-weighted sums over the batch's steps of the cost model's expected and the actually accepted
        drafts: their ratio corrects the chances the next batch decision is made on (the rows' calibrations are
        each young, and a batch multiplies any optimism by its rows)."""

    @torch.inference_mode()
    def add(self, job: RowJob, budget: Budget | None = None, draft: bool | None = None) -> Row:
        """Prefill the row's prompt alone in one forward, its first token verified in it (the prompt rides as the
        lead, so the first token costs no forward of its own), then splice it in: `begin`, then `feed` once.

        `budget`: whose curve and calibration the row uses (its Decoder's; default: the batch's). `draft`: whether
        the prefill also verifies the row's first tree, as the single-row engine does (default: only when the row
        decodes alone, no other row in the batch). A tree makes the prefill dearer (a tree mask instead of the
        causal kernel: +20-40 ms for a 60-180-token prompt, fp32 CPU) to win the tokens of one step, and one step of
        a row among several costs a fraction of a forward; alone, it costs a whole one. A row that is finished at
        once (its first token was EOS, max_new_tokens=1) leaves at the next `step`.
        """
        row = self.feed(self.begin(job, budget), draft=draft)
        assert row is not None  # no chunk size: the whole prompt in one forward
        return row

    def begin(self, job: RowJob, budget: Budget | None = None) -> Joining:
        """Start a row's prefill: its drafters see the prompt, its cache is seeded from the prefix cache; nothing
        is fed yet (`feed` does, in one forward or in chunks)."""
        started = time.perf_counter()
        prompt_len = job.input_ids.shape[1]
        budget = row_budget(budget or self.budget)
        ctx = DraftContext(
            job.transcript.sequence[0].tolist(),
            prompt_len,
            budget.max_nodes,
            job.eos,
            processor=job.processor,
            noise=job.sampling.noise if job.sampling is not None else None,
            selective=budget.selective,
            salt=job.prefixes.salt if job.prefixes is not None else "",
        )
        for drafter in job.drafters:
            drafter.start(ctx)
        budget.new_request()
        row = Row(job, ctx, budget, prompt_len - 1, started=started)
        own = DynamicCache(config=self.model.config)
        if job.prefixes is not None:
            row.stats.cached_prompt_tokens = job.prefixes.seed(own, ctx.tokens)
        return Joining(row, own, row.stats.cached_prompt_tokens, begun_s=time.perf_counter() - started)

    @torch.inference_mode()
    def feed(self, joining: Joining, chunk: int | None = None, draft: bool | None = None) -> Row | None:
        """Feed the next part of a joining row's prompt: at most `chunk` tokens in a causal forward of the row's
        own cache while more than that remain (returns None), else the rest with the first token (and its tree,
        when `draft`) and splice the row in (returns it). `chunk=None`: the rest at once.

        Chunks let running rows step between the parts of a long prompt, so a long prompt joining does not freeze
        every stream for its whole prefill; the cache a chunked prefill leaves holds the same tokens at the same
        positions (fp32: the same text as a one-forward prefill, as the prefix cache's seeded prefills are)."""
        if chunk is not None and not is_count(chunk, 1):
            raise ValueError(f"chunk must be a whole number of tokens >= 1 (None: the rest at once), got {chunk!r}")
        row, own = joining.row, joining.cache
        ctx, job, budget = row.ctx, row.job, row.budget
        prompt_len = job.input_ids.shape[1]
        lead = ctx.tokens[joining.fed : -1]  # what is still to be fed before the first tree
        if chunk is not None and len(lead) > chunk:
            part = lead[:chunk]
            joining.fed += len(part)
            # the part's last token stands as a lone root: a causal chain, no mask; its logits are not needed
            forward_tree(self.head, own, TokenTree.rooted_at(part[-1]), joining.fed - 1, part[:-1], self.attention)
            joining.chunks += 1
            return None
        t0 = time.perf_counter()
        drafting = tree_in_prefill(not self.rows if draft is None else draft, len(lead))
        root = ctx.tokens[-1]
        # A prefill that verifies no tree needs no proposals (a row joining others: proposing there was wasted work)
        proposals = [drafter.propose(ctx) if drafting else TokenTree.rooted_at(root) for drafter in job.drafters]
        selection = budget.choose(root, proposals, len(lead), drafting)
        tree = selection.tree
        t1 = time.perf_counter()
        logits = forward_tree(self.head, own, tree, prompt_len - 1, lead, self.attention)
        path = self.commit(row, selection, logits, joining.begun_s + t1 - t0, time.perf_counter() - t1)
        keep_accepted(own, prompt_len - 1, path)
        if job.prefixes is not None:
            job.prefixes.store(ctx.tokens, own, prompt_len - 1 + len(path))
        self.rows.insert(self.cache.add(own, prompt_len - 1 + len(path)), row)
        row.stats.prefill_seconds = time.perf_counter() - row.started
        row.stats.prefill_chunks = joining.chunks + 1
        return row

    def abandon(self, joining: Joining) -> None:
        """Drop a row whose prefill had begun (its request went away): its drafters finish, nothing is kept."""
        for drafter in joining.row.job.drafters:
            drafter.finish(joining.row.ctx)

    def choose(self, proposals: list[list[TokenTree]]) -> list[Selection]:
        """Each row's tree for this step (see the module docstring for the shared budget)."""
        rows = self.rows
        if len(rows) == 1:
            return [rows[0].budget.choose(rows[0].ctx.tokens[-1], proposals[0])]
        budgets = [row.budget for row in rows]
        if all(isinstance(budget, CostModel) for budget in budgets):
            rankings = [row.budget.rank(row.ctx.tokens[-1], p) for row, p in zip(rows, proposals, strict=True)]
            correction = min(1.0, (self.accepted + BATCH_PRIOR) / (self.expected + BATCH_PRIOR))
            chances = [[c * correction for c in r.chances] for r in rankings]
            cap = min(budget.max_nodes for budget in budgets)
            # What is fed never changes what is written (greedy or sampled: `forerun.noise`), so timings may steer.
            penalty = max(1.0, self.measured[True] / self.measured[False])
            count = best_shared_count(chances, budgets[0].curve, cap, penalty, self.weights())
            return [ranking.select(count) for ranking in rankings]
        # Static budgets (draft_model alone): each row's share of its own node budget.
        return [
            Selection(*merge(row.ctx.tokens[-1], p, max(1, row.budget.max_nodes // len(rows))))
            for row, p in zip(rows, proposals, strict=True)
        ]

    def shared_curve(self) -> LatencyCurve | None:
        """The latency curve the draft switch prices steps on: only for batches of two rows or more whose rows
        all use a cost model (a row alone drafts as a single run does; static budgets always propose)."""
        if len(self.rows) < 2 or not all(isinstance(row.budget, CostModel) for row in self.rows):
            return None
        return self.rows[0].budget.curve

    def weights(self) -> list[float] | None:
        """What each row's progress is worth to a closed batch: (steps it has left / the most any row has left)
        to the power CLOSED_FOCUS, a row's steps left being its tokens left over its tokens per step so far. A
        closed batch lasts as long as its slowest row, and a forward of fewer rows costs nearly as much, so tokens
        won by rows that will finish first anyway buy little wall time."""
        if not self.closed:
            return None
        steps_left = []
        for row in self.rows:
            made = len(row.job.transcript.sources)
            per_step = max(1.0, made / max(1, row.stats.forwards))
            steps_left.append(max(0, row.job.max_new_tokens - made) / per_step)
        most = max(steps_left, default=0.0)
        return [(n / most) ** CLOSED_FOCUS if most else 1.0 for n in steps_left]

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One forward for every row: propose, pack, forward, verify, commit; returns the rows that finished
        (rows that finished when they joined leave first, without a forward)."""
        finished_early = [row for row in self.rows if row.done]
        if finished_early:
            self.remove(finished_early)
            if not self.rows:
                return finished_early
        rows = self.rows
        # 1. propose: every row's drafters; the budget keeps what pays for the batch
        t0 = time.perf_counter()
        self.cache.settle()
        self.rebase()
        curve = self.shared_curve()
        drafting = curve is None or self.switch.drafting()
        if drafting:
            caps: dict[tuple[int, int], int] = {}  # rows of one Decoder share a curve and a cap: price it once
            for row in rows:
                shape = (id(getattr(row.budget, "curve", None)), row.budget.max_nodes)
                if shape not in caps:
                    caps[shape] = proposal_budget(row.budget, len(rows))
                row.ctx.budget = caps[shape]
            proposals = [self.propose(row) for row in rows]
            selections = self.choose_apart(proposals)
        else:  # paused: no proposals, one token per row
            selections = [
                Selection(*merge(row.ctx.tokens[-1], [TokenTree.rooted_at(row.ctx.tokens[-1])] * len(row.job.drafters)))
                for row in rows
            ]
        t1 = time.perf_counter()
        # 2. pack and 3. forward: one call for every row, trees padded to one size
        nodes = max(len(selection.tree) for selection in selections)
        input_ids, position_ids, mask = self.pack([selection.tree for selection in selections], nodes)
        logits = self.head(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache.cache,
            use_cache=True,
        )  # [rows, nodes, vocab]
        forward_s = time.perf_counter() - t1
        # 4. verify and 5. commit, per row; then keep each row's accepted path in the shared cache
        kept = [
            self.commit_apart(row, selection, logits[b, : len(selection.tree)], (t1 - t0) / len(rows), forward_s)
            for b, (row, selection) in enumerate(zip(rows, selections, strict=True))
        ]
        self.cache.keep(kept, nodes)
        self.learn(selections, kept, nodes, forward_s)
        if curve is not None:  # tokens per row per predicted plain step, everything of this step counted
            seconds = time.perf_counter() - t0
            tokens = sum(len(path) for path in kept) / len(rows)
            self.switch.record(drafting, tokens * curve.batch_cost(len(rows), 1) / max(seconds, 1e-9))
        finished = [row for row in rows if row.done]
        if finished:
            self.remove(finished)  # their places wait for joining rows; the next step drops the rest and compacts
        else:
            self.cache.compact()
        return finished_early + finished

    def propose(self, row: Row) -> list[TokenTree]:
        """The row's drafters' trees; a drafter that fails ends its own row (`Row.error`), which then feeds its
        root alone this step and leaves after it."""
        try:
            return [drafter.propose(row.ctx) for drafter in row.job.drafters]
        except Exception as error:  # noqa: BLE001 - one request's failure must not end its neighbours
            return self.fail(row, error)

    def fail(self, row: Row, error: Exception) -> list[TokenTree]:
        row.error = error
        return [TokenTree.rooted_at(row.ctx.tokens[-1]) for _ in row.job.drafters]

    def choose_apart(self, proposals: list[list[TokenTree]]) -> list[Selection]:
        """`choose`, and where it fails, the rows whose own budget fails on their own proposals end (each is
        tried alone), and the rest are chosen again."""
        try:
            return self.choose(proposals)
        except Exception as error:  # noqa: BLE001
            blamed = False
            for b, row in enumerate(self.rows):
                try:
                    row.budget.choose(row.ctx.tokens[-1], proposals[b])
                except Exception as own:  # noqa: BLE001
                    proposals[b], blamed = self.fail(row, own), True
            if not blamed:
                raise error
            return self.choose(proposals)

    def commit_apart(
        self, row: Row, selection: Selection, logits: torch.Tensor, propose_s: float, forward_s: float
    ) -> list[int]:
        """`commit`, where a failure ends only this row (its root stays in the cache until it leaves)."""
        if row.error is not None:
            return [0]
        try:
            return self.commit(row, selection, logits, propose_s, forward_s)
        except Exception as error:  # noqa: BLE001
            row.error = error
            return [0]

    def commit(
        self, row: Row, selection: Selection, logits: torch.Tensor, propose_s: float, forward_s: float
    ) -> list[int]:
        """Verify one row's tree on its `logits` [nodes, vocab], append its tokens, let its drafters and budget
        learn; returns the kept path (root first) for the cache."""
        tree, transcript = selection.tree, row.job.transcript
        verdict = verify(tree, NodeScores(logits, row.job.processor, transcript.sequence, tree), row.job.sampling)
        path = [0, *verdict.accepted_nodes]
        row.prefix_len += len(path)
        sources = [tree.sources[i] for i in verdict.accepted_nodes] + ["model"]
        tokens = [tree.tokens[i] for i in verdict.accepted_nodes] + [verdict.bonus_token]
        new_tokens = transcript.extend(tokens, sources, logits[path] if transcript.logprobs_top is not None else None)
        row.ctx.tokens.extend(new_tokens)
        started = time.perf_counter()
        for drafter, node_map in zip(row.job.drafters, selection.node_maps, strict=True):
            drafter.observe(row.ctx, StepOutcome(tree, verdict, logits, new_tokens, node_map))
        row.budget.learn(selection, new_tokens)
        drafting = time.perf_counter() - started + propose_s
        row.stats.record_step(
            tree, verdict.accepted_len, Counter(sources[:-1]), drafting, forward_s, selection.expected_accepted
        )
        return path

    def rebase(self) -> None:
        """Forget the measured rates and forward-time corrections when the cache has grown or shrunk more than
        REBASE_FACTOR-fold since they were measured: a tree costs a batch more beside a long row (every row reads the
        padded cache, and with a mask transformers copies it per head group), so what was measured while a long
        prompt's row decoded must not pause drafting once it has left (measured: drafting paused for 150 steps after
        a 2150-token row left 3 short ones, 40.0 s against 32.7 s for the same work)."""
        slots = max(1, self.cache.slots)
        if not self.measured_at / REBASE_FACTOR <= slots <= self.measured_at * REBASE_FACTOR:
            self.switch, self.measured, self.measured_at = DraftSwitch(), {False: 1.0, True: 1.0}, slots

    def learn(self, selections: Sequence[Selection], kept: Sequence[Sequence[int]], nodes: int, forward_s: float):
        """Update the batch's corrections: measured vs predicted forward time, accepted vs expected drafts."""
        rows = len(selections)
        if rows < 2:
            return
        curve = getattr(self.rows[0].budget, "curve", None)
        if curve is not None:
            drafted = nodes > 1
            ratio = forward_s / curve.batch_cost(rows, nodes)
            self.measured[drafted] = BATCH_DECAY * self.measured[drafted] + (1 - BATCH_DECAY) * ratio
        expected = sum(selection.expected_accepted or 0.0 for selection in selections)
        if expected > 0:  # only drafted steps are evidence: root-only ones must not fade a lesson back to optimism
            self.expected = BATCH_DECAY * self.expected + expected
            self.accepted = BATCH_DECAY * self.accepted + sum(len(path) - 1 for path in kept)

    def remove(self, leaving: Sequence[Row]) -> None:
        """Take rows out (finished or cancelled): their drafters finish, their stats are closed, slots freed."""
        gone = {id(row) for row in leaving}
        places = self.cache.places()
        for place, row in zip(places, self.rows, strict=True):
            if id(row) in gone and row.job.prefixes is not None:  # what it read (prompt, answer) for its next turn
                row.job.prefixes.store(row.ctx.tokens, self.cache.row(place), row.prefix_len)
        for row in leaving:
            for drafter in row.job.drafters:
                drafter.finish(row.ctx)
            row.stats.new_tokens = len(row.job.transcript.sources)
            row.stats.total_seconds = time.perf_counter() - row.started
            if row.job.transcript.streamer is not None:
                row.job.transcript.streamer.end()
        vacated = [place for place, row in zip(places, self.rows, strict=True) if id(row) in gone]
        self.rows = [row for row in self.rows if id(row) not in gone]
        if self.rows:  # their places are kept for rows that join before the next step (`RowCache.refill`)
            self.cache.vacate(vacated)
        else:
            self.cache = RowCache(self.model.config)

    def pack(self, trees: Sequence[TokenTree], nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids and position_ids [rows, nodes]; the mask [rows, 1, nodes, slots + nodes].

        A row sees its visible slots, then its tree's ancestry; padding nodes (rows with smaller trees) repeat
        the root at its position and see the row's slots and themselves only: no row ever attends to them.
        """
        rows, slots = len(trees), self.cache.slots
        input_ids = torch.zeros(rows, nodes, dtype=torch.long)
        position_ids = torch.zeros(rows, nodes, dtype=torch.long)
        visible = torch.zeros(rows, nodes, slots + nodes, dtype=torch.bool)
        visible[:, :, :slots] = self.cache.visible[:, None, :]
        for b, (row, tree) in enumerate(zip(self.rows, trees, strict=True)):
            size = len(tree)
            input_ids[b, :size] = torch.tensor(tree.tokens)
            input_ids[b, size:] = tree.tokens[0]
            position_ids[b, :size] = torch.tensor(tree.depths) + row.prefix_len
            position_ids[b, size:] = row.prefix_len
            visible[b, :size, slots : slots + size] = tree.ancestors()
            visible[b, range(size, nodes), range(slots + size, slots + nodes)] = True
        mask = as_attention_mask(visible[:, None], self.attention, self.model.dtype)
        device = self.model.device
        return input_ids.to(device), position_ids.to(device), mask.to(device)


def decode_batch(
    model: torch.nn.Module, jobs: Sequence[RowJob], budget: Budget, width: int | None = None
) -> list[GenerationStats]:
    """Decode every job; tokens land in each job's transcript, per-row stats are returned in job order.

    `width`: at most this many rows at once (default: all); see `decode_rows`.
    """
    stats: list[GenerationStats | None] = [None] * len(jobs)
    for index, row_stats in decode_rows(model, jobs, budget, width):
        stats[index] = row_stats
    return stats  # type: ignore[return-value]


def decode_rows(
    model: torch.nn.Module, jobs: Sequence[RowJob], budget: Budget, width: int | None = None, base=None
) -> Iterator[tuple[int, GenerationStats]]:
    """Decode the jobs, at most `width` rows at once, yielding (job index, stats) as each row finishes.

    A finished row's place goes to the next waiting job at the next step boundary (continuous batching, as the
    server's), so a batch never idles behind its slowest row while work waits: with 8 prompts and width 4, rows
    5-8 join as rows 1-4 finish, whenever that is. Once nothing waits the batch is closed (`Batch.closed`): it ends
    with its slowest row, and drafts are weighed by each row's steps left.

    Models whose cache cannot hold ragged rows (sliding windows, linear attention) or that cannot take a tree
    mask decode the rows one after another with the single-row engine (which falls back to plain decoding where
    it must): still exact, just not batched. So do rows decoded one at a time (one job, or `width` 1) where a
    `base` is given (`forerun.base.StaticBase`, a GPU's captured steps, which batches do not use yet).

    Example (a list of 8 prompts through 4 rows; `forerun run --batch-size 4` does this):
        >>> for index, stats in decode_rows(model, jobs, budget, width=4):   # doctest: +SKIP
        ...     print(index, jobs[index].transcript.sources)
    """
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    alone = len(jobs) == 1 or width == 1
    if not batchable(model) or (alone and base is not None):  # one row at a time: the single-row engine's base
        for index, job in enumerate(jobs):
            yield (
                index,
                decode(
                    model,
                    job.input_ids,
                    job.drafters,
                    job.transcript,
                    job.eos,
                    job.max_new_tokens,
                    budget,
                    True,
                    job.processor,
                    job.sampling,
                    job.prefixes,
                    base,
                ),
            )
        return
    width = len(jobs) if width is None else width
    waiting = deque(enumerate(jobs))
    batch = Batch(model, budget)
    index_of: dict[int, int] = {}
    alone = min(width, len(jobs)) == 1  # only a row that decodes alone drafts at its prefill (`Batch.add`)
    while waiting or batch.rows:
        while waiting and len(batch.rows) < width:
            index, job = waiting.popleft()
            index_of[id(batch.add(job, draft=alone))] = index
        batch.closed = not waiting
        for row in batch.step():
            if row.error is not None:
                raise row.error
            yield index_of.pop(id(row)), row.stats
