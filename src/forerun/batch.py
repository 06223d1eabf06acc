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

That is the growing cache's layout (`forerun.base.rows.DynamicRows`, a CPU's); on a static base (a GPU's) each row
has a place of its own instead, without padding or holes (`StaticRows`); the batch is the same either way.

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
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from forerun.base.dynamic import TreeLogits
from forerun.base.rows import DynamicRows, RowsLogits, SharedRows
from forerun.checks import is_count
from forerun.costmodel import BatchPolicy, Budget, Selection
from forerun.drafters.base import Drafter
from forerun.engine import tree_in_prefill, tree_support
from forerun.host_copy import to_host
from forerun.kvcache import plain_layers
from forerun.row import RowJob, RowRun, costly
from forerun.taps import LayerTaps, feature_layers, row_features
from forerun.tree import TokenTree, merge


def fork(drafters: Sequence[Drafter]) -> list[Drafter]:
    """One more set of drafters for one more concurrent row: state that outlives requests (the trie, the n-gram
    pool, the draft model) is shared, state of one request (indexes, windows, the draft's cache) is rebound by
    `start`, so a shallow copy is a fresh request view."""
    return [copy.copy(drafter) for drafter in drafters]


@dataclass
class Joining:
    """A row whose prompt is being prefilled (`Batch.begin`, then `Batch.feed` until it returns the row)."""

    row: RowRun
    own: object
    """The row's handle in the shared rows (`SharedRows.open`): its own cache of what has been fed so far (its
    prefix-cache head included), or its place."""
    fed: int
    """Prompt tokens fed so far (or found in the prefix cache)."""
    chunks: int = 0
    """Chunks fed so far (the final forward not counted)."""
    begun_s: float = 0.0
    """Seconds `begin` took (drafters reading the prompt): drafting time, for the row's stats."""

    @property
    def left(self) -> int:
        """Prompt tokens still to feed (the last one, fed with the first tree, counted)."""
        return len(self.row.ctx.tokens) - self.fed


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

    def __init__(
        self, model: torch.nn.Module, budget: Budget, closed: bool = False, shared: SharedRows | None = None
    ) -> None:
        """`shared`: the rows' cache and forward (`forerun.base.rows`; default: a growing cache, the CPU's)."""
        self.model, self.budget = model, budget
        self.rows: list[RowRun] = []
        self.shared: SharedRows = DynamicRows(model) if shared is None else shared
        self.policy = BatchPolicy(closed)
        """How the rows draft together (`forerun.costmodel.batch`)."""

    @property
    def closed(self) -> bool:
        """No row will join any more (`decode_rows` once nothing waits): drafts are weighed by each row's steps
        left (`BatchPolicy.weights`)."""
        return self.policy.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self.policy.closed = value

    @torch.inference_mode()
    def add(self, job: RowJob, budget: Budget | None = None, draft: bool | None = None) -> RowRun:
        """Prefill the row's prompt alone in one forward, its first token verified in it (the prompt rides as the
        lead, so the first token costs no forward of its own), then splice it in: `begin`, then `feed` once.

        `budget`: whose curve and calibration the row uses (its Decoder's; default: the batch's). `draft`: whether
        the prefill also verifies the row's first tree, as the single-row engine does (default: only when the row
        decodes alone, no other row in the batch). A tree makes the prefill dearer (a tree mask instead of the
        causal kernel: +20-40 ms for a 60-180-token prompt, fp32 CPU) to win the tokens of one step, and one step of
        a row among several costs a fraction of a forward; alone, it costs a whole one. A row that is finished at
        once (its first token was EOS, max_new_tokens=1) leaves at the next `step`.
        """
        return self.add_many([job], budget, draft)[0]

    @torch.inference_mode()
    def add_many(self, jobs: Sequence[RowJob], budget: Budget | None = None, draft: bool | None = None) -> list[RowRun]:
        """`add` of several rows at once, their prompts fed side by side where the rows' cache can (`feed_together`:
        a static base's places, where sixteen prompts cost a card about one's forwards); returns them in order."""
        if not self.shared.side_by_side:  # one by one: each row's prefill stores its text in the prefix cache
            return [self.feed_together([self.begin(job, budget)], draft)[0] for job in jobs]  # for the next to find
        joinings: list[Joining] = []
        try:
            for job in jobs:
                joinings.append(self.begin(job, budget))
        except Exception:
            for joining in joinings:  # their places and drafters are let go: nothing of theirs was fed
                self.abandon(joining)
            raise
        return self.feed_together(joinings, draft)

    def begin(self, job: RowJob, budget: Budget | None = None) -> Joining:
        """Start a row's prefill: its drafters see the prompt, its cache is seeded from the prefix cache; nothing
        is fed yet (`feed` does, in one forward or in chunks)."""
        budget = (budget or self.budget).for_row(self.policy.costly)
        row = RowRun.begin(job, budget)
        max_len = job.input_ids.shape[1] + job.max_new_tokens + budget.max_nodes
        own, row.stats.cached_prompt_tokens = self.shared.open(job.prefixes, row.ctx.tokens, max_len)
        return Joining(row, own, row.stats.cached_prompt_tokens, begun_s=time.perf_counter() - row.started)

    @torch.inference_mode()
    def feed(self, joining: Joining, chunk: int | None = None, draft: bool | None = None) -> RowRun | None:
        """Feed the next part of a joining row's prompt: at most `chunk` tokens in a causal forward of the row's
        own cache while more than that remain (returns None), else the rest with the first token (and its tree,
        when `draft`) and splice the row in (returns it). `chunk=None`: the rest at once.

        Chunks let running rows step between the parts of a long prompt, so a long prompt joining does not freeze
        every stream for its whole prefill; the cache a chunked prefill leaves holds the same tokens at the same
        positions (fp32: the same text as a one-forward prefill, as the prefix cache's seeded prefills are)."""
        if chunk is not None and not is_count(chunk, 1):
            raise ValueError(f"chunk must be a whole number of tokens >= 1 (None: the rest at once), got {chunk!r}")
        lead = joining.row.ctx.tokens[joining.fed : -1]  # what is still to be fed before the first tree
        if chunk is not None and len(lead) > chunk:
            part = lead[:chunk]
            joining.fed += len(part)
            # the part's last token stands as a lone root: a causal chain, no mask; its logits are not needed
            self.shared.feed(joining.own, TokenTree.rooted_at(part[-1]), joining.fed - 1, part[:-1])
            joining.chunks += 1
            return None
        return self.feed_together([joining], draft)[0]

    @torch.inference_mode()
    def feed_together(self, joinings: Sequence[Joining], draft: bool | None = None) -> list[RowRun]:
        """The rest of each joining row's prompt with its first token (and tree, when `draft`; default: only for
        a lone row joining an empty batch), in the same forwards where the rows' cache can (`SharedRows.
        feed_many`), and splice them in, in order; the first row's failure is raised (`feed_apart` keeps the rest)."""
        joined = self.feed_apart(joinings, draft)
        for outcome in joined:
            if isinstance(outcome, Exception):
                raise outcome
        return joined  # type: ignore[return-value]

    @torch.inference_mode()
    def feed_apart(self, joinings: Sequence[Joining], draft: bool | None = None) -> list[RowRun | Exception]:
        """`feed_together`, where a row whose first choice or commit fails gets its error in its stead and the
        others join (the caller abandons it: a server fails that request only); a failed forward is raised. Rows
        whose drafters read layers the base does not return (their hooks would see every row's forward at once)
        are fed one by one."""
        draft = not self.rows and len(joinings) == 1 if draft is None else draft
        if len(joinings) > 1 and any(self.hooked(joining) for joining in joinings):
            return [outcome for joining in joinings for outcome in self.feed_apart([joining], draft)]
        outcomes: list[RowRun | Exception | tuple[Selection, list[int], float]] = []
        for joining in joinings:
            try:
                outcomes.append(self.first_choice(joining, draft))
            except Exception as error:  # noqa: BLE001 - one request's failure must not end its neighbours
                outcomes.append(error)
        live = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, tuple)]
        t1 = time.perf_counter()
        taps = [LayerTaps(self.model, feature_layers(joinings[i].row.job.drafters), self.shared.features) for i in live]
        with ExitStack() as hooks:
            for tap in taps:
                hooks.enter_context(tap)
            fed = self.shared.feed_many([
                (joinings[i].own, outcomes[i][0].tree, joinings[i].row.job.input_ids.shape[1] - 1, outcomes[i][1])
                for i in live
            ])  # fmt: skip
        forward_s = time.perf_counter() - t1
        for i, out, tap in zip(live, fed, taps, strict=True):
            try:
                outcomes[i] = self.join(joinings[i], *outcomes[i], out, tap.take(out.features), forward_s)
            except Exception as error:  # noqa: BLE001
                outcomes[i] = error
        return outcomes  # type: ignore[return-value]

    def first_choice(self, joining: Joining, draft: bool) -> tuple[Selection, list[int], float]:
        """A joining row's first tree (its root alone unless `draft`), the prompt still to feed before it, and the
        seconds the row has spent proposing."""
        t0, row, lead = time.perf_counter(), joining.row, joining.row.ctx.tokens[joining.fed : -1]
        drafting = tree_in_prefill(draft, len(lead))
        # A prefill that verifies no tree needs no proposals (a row joining others: proposing there was wasted work)
        selection = row.budget.choose(row.root, row.propose(drafting), len(lead), drafting)
        return selection, lead, joining.begun_s + time.perf_counter() - t0

    def join(
        self,
        joining: Joining,
        selection: Selection,
        lead: list[int],
        propose_s: float,
        out: TreeLogits,
        tapped: torch.Tensor | None,
        forward_s: float,
    ) -> RowRun:
        """Commit a fed row's first tree and take it into the batch."""
        row, prefix_len = joining.row, joining.row.job.input_ids.shape[1] - 1
        choices, drawn = row.on_host(selection.tree, out.logits, out.argmax)
        path = row.commit(selection, out.logits, propose_s, forward_s, tapped, len(lead), choices, drawn)
        self.rows.insert(self.shared.admit(joining.own, prefix_len, path, row.job.prefixes, row.ctx.tokens), row)
        row.stats.prefill_seconds = time.perf_counter() - row.started
        row.stats.prefill_chunks = joining.chunks + 1
        return row

    def hooked(self, joining: Joining) -> bool:
        """Whether the row's drafters read layers through hooks (not the ones the base's forwards return)."""
        return feature_layers(joining.row.job.drafters) not in ((), self.shared.features)

    def abandon(self, joining: Joining) -> None:
        """Drop a row whose prefill had begun (its request went away): its drafters finish, nothing is kept."""
        self.shared.abandon(joining.own)
        for drafter in joining.row.job.drafters:
            drafter.finish(joining.row.ctx)

    def choose(self, proposals: list[list[TokenTree]]) -> list[Selection]:
        """Each row's tree for this step (`forerun.costmodel.BatchPolicy.choose`)."""
        rows = self.rows
        roots, budgets = [row.root for row in rows], [row.budget for row in rows]
        return self.policy.choose(roots, proposals, budgets, [row.steps_left() for row in rows])

    @torch.inference_mode()
    def step(self) -> list[RowRun]:
        """One forward for every row: propose, pack, forward, verify, commit; returns the rows that finished
        (rows that finished when they joined leave first, without a forward)."""
        finished_early = [row for row in self.rows if row.done]
        if finished_early:
            self.remove(finished_early)
            if not self.rows:
                return finished_early
        rows, budgets = self.rows, [row.budget for row in self.rows]
        for row in rows:
            row.rows = len(rows)  # each row's steps are priced at its share of this forward
        # 1. propose: every row's drafters; the policy keeps what pays for the batch
        t0 = time.perf_counter()
        self.shared.settle()
        self.policy.rebase(self.shared.slots)
        drafting = self.policy.drafting(budgets)
        if drafting:
            for row, cap in zip(rows, self.policy.proposal_caps(budgets), strict=True):
                row.ctx.budget = cap
            proposals = [self.propose(row) for row in rows]
            selections = self.choose_apart(proposals)
            self.without_costly(rows, proposals)
        else:  # paused: no proposals, one token per row; the heads sit out (no forwards of their own)
            selections = [Selection(*merge(row.root, row.propose(False, with_costly=False))) for row in rows]
        t1 = time.perf_counter()
        # 2. pack and 3. forward: one call for every row, trees padded to one size
        nodes = max(len(selection.tree) for selection in selections)
        for row in rows:
            row.padded = nodes
        prefix_lens = [row.prefix_len for row in rows]
        # tapped paused too: the heads keep what is written and read it in one forward when the batch drafts again
        layers = feature_layers(d for row in rows for d in row.job.drafters)
        with LayerTaps(self.model, layers, read=self.shared.features) as taps:
            trees = [selection.tree for selection in selections]
            out = self.shared.forward(prefix_lens, trees, nodes)
        forward_s = time.perf_counter() - t1
        tapped = taps.take(out.features, arrange=self.shared.in_row_order)  # [rows, nodes, F]
        # 4. verify and 5. commit, per row; then keep each row's accepted path in the shared cache
        kept = self.commit_rows(selections, out, (t1 - t0) / len(rows), forward_s, tapped, layers)
        self.shared.keep(prefix_lens, kept, nodes)
        self.policy.learn(budgets, selections, kept, nodes, forward_s)
        self.policy.record(budgets, drafting, kept, time.perf_counter() - t0)
        finished = [row for row in rows if row.done]
        if finished:
            self.remove(finished)  # their places wait for joining rows; the next step drops the rest and compacts
        else:
            self.shared.compact()
        return finished_early + finished

    def commit_rows(
        self,
        selections: Sequence[Selection],
        out: RowsLogits,
        propose_s: float,
        forward_s: float,
        tapped: torch.Tensor | None,
        layers: tuple[int, ...],
    ) -> list[list[int]]:
        """Verify and commit every row on the step's outputs (`out`; `tapped`: the `layers`' features [rows, nodes,
        F]); a failure ends its own row alone (`commit_apart`). Sampled rows' draws at every node are made first
        (`forerun.draws`; None for the rows that walk), then copied to the host with the base's argmaxes in one
        transfer: the step's one wait for the card. Returns each row's kept path."""
        rows = self.rows
        logits = [out.row(b, len(selection.tree)) for b, selection in enumerate(selections)]
        argmax, *drawn = to_host([
            out.argmax,
            *(row.draws(selection.tree, row_logits) if row.error is None else None
              for row, selection, row_logits in zip(rows, selections, logits, strict=True)),
        ])  # fmt: skip
        return [
            self.commit_apart(
                row,
                selection,
                logits[b],
                propose_s,
                forward_s,
                row_features(tapped, b, len(selection.tree), layers, row.job.drafters),
                None if argmax is None else argmax[out.at[b]][: len(selection.tree)],
                drawn[b],
            )
            for b, (row, selection) in enumerate(zip(rows, selections, strict=True))
        ]

    def without_costly(self, rows: list[RowRun], proposals: list[list[TokenTree]]) -> None:
        """What the batch would have fed had the rows' costly drafters (trained heads) not drafted this step, for
        their paired switch (`RowRun.time_costly`): the batch's own choice over the other drafters' proposals and
        the node count it pads to. (A row's own choice would feed what pays for a single row: beside other rows a
        tree costs more, and the heads were credited with tokens the batch would not have fed.)"""
        weighed = [row.weighs_costly and row.error is None for row in rows]
        if len(rows) < 2 or not any(weighed):  # a row alone chose its own (`RowRun.propose`)
            return
        others = [
            [tree for drafter, tree in zip(row.job.drafters, trees, strict=True) if not costly(drafter)]
            for row, trees in zip(rows, proposals, strict=True)
        ]
        try:
            alone = self.choose(others)
        except Exception:  # noqa: BLE001 - advice for the switch only; each row's own choice stands
            return
        padded = max(len(selection.tree) for selection in alone)
        for row, selection, weigh in zip(rows, alone, weighed, strict=True):
            if weigh:
                row.alone, row.padded_alone = selection, padded

    def propose(self, row: RowRun) -> list[TokenTree]:
        """The row's drafters' trees; a drafter that fails ends its own row (`RowRun.error`), which then feeds its
        root alone this step and leaves after it."""
        try:
            return row.propose()
        except Exception as error:  # noqa: BLE001 - one request's failure must not end its neighbours
            return self.fail(row, error)

    def fail(self, row: RowRun, error: Exception) -> list[TokenTree]:
        row.error = error
        return row.propose(False)

    def choose_apart(self, proposals: list[list[TokenTree]]) -> list[Selection]:
        """`choose`, and where it fails, the rows whose own budget fails on their own proposals end (each is
        tried alone), and the rest are chosen again."""
        try:
            return self.choose(proposals)
        except Exception as error:  # noqa: BLE001
            blamed = False
            for b, row in enumerate(self.rows):
                try:
                    row.budget.choose(row.root, proposals[b])
                except Exception as own:  # noqa: BLE001
                    proposals[b], blamed = self.fail(row, own), True
            if not blamed:
                raise error
            return self.choose(proposals)

    def commit_apart(
        self,
        row: RowRun,
        selection: Selection,
        logits: torch.Tensor,
        propose_s: float,
        forward_s: float,
        tapped: torch.Tensor | None = None,
        choices: list[int] | None = None,
        drawn: list[int] | None = None,
    ) -> list[int]:
        """`RowRun.commit`, where a failure ends only this row (its root stays in the cache until it leaves)."""
        if row.error is not None:
            return [0]
        try:
            return row.commit(selection, logits, propose_s, forward_s, tapped, choices=choices, drawn=drawn)
        except Exception as error:  # noqa: BLE001
            row.error = error
            return [0]

    def remove(self, leaving: Sequence[RowRun]) -> None:
        """Take rows out (finished or cancelled): what each read is left in the prefix cache, each row finishes
        (`RowRun.finish`), their room is freed."""
        gone = {id(row) for row in leaving}
        self.shared.remove([
            (index, row.job.prefixes, row.ctx.tokens, row.prefix_len)
            for index, row in enumerate(self.rows) if id(row) in gone
        ])  # fmt: skip
        for row in leaving:
            row.finish()
        self.rows = [row for row in self.rows if id(row) not in gone]
