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
drafting and plain steps and pauses proposals while drafting is the slower. Where choices must be reproducible
(no clock may steer them), `IdleProposals` pauses them after steps whose proposals the cost model fed none of.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from forerun.base.rows import DynamicRows, RowsLogits, SharedRows
from forerun.batch_join import ONE_TOKEN, JoiningRows
from forerun.costmodel import BatchPolicy, Budget, Selection
from forerun.drafters.base import Drafter
from forerun.engine import tree_support
from forerun.forward_inputs import stateful
from forerun.host_copy import to_host
from forerun.kvcache import plain_layers
from forerun.row import Deferred, RowJob, RowRun, costly  # noqa: F401 - RowJob re-exported
from forerun.taps import LayerTaps, feature_layers, row_features
from forerun.tree import TokenTree, merge

logger = logging.getLogger(__name__)


def fork(drafters: Sequence[Drafter]) -> list[Drafter]:
    """One more set of drafters for one more concurrent row: state that outlives requests (the trie, the n-gram
    pool, the draft model) is shared, state of one request (indexes, windows, the draft's cache) is rebound by
    `start`, so a shallow copy is a fresh request view."""
    return [copy.copy(drafter) for drafter in drafters]


def batchable(model: torch.nn.Module) -> bool:
    """Whether rows can share one cache: tree masks work and every cache layer is a plain, addressable one."""
    if tree_support(model) is not None:
        return False
    return plain_layers(DynamicCache(config=model.config))


class Batch(JoiningRows):
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
        self.chains = stateful(model)
        """A hybrid's rows: a row alone verifies chains (`forerun.base.lone_chain`); rows together, chains side by
        side where their states are recorded (`SharedRows.chains_together`), else one token each a step."""
        self.policy = BatchPolicy(closed)
        """How the rows draft together (`forerun.costmodel.batch`)."""
        self.unlearned: Deferred = []
        """What the rows' drafters are still to learn (`learn`)."""

    @property
    def closed(self) -> bool:
        """No row will join any more (`decode_rows` once nothing waits): drafts are weighed by each row's steps
        left (`BatchPolicy.weights`)."""
        return self.policy.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self.policy.closed = value

    def choose(self, proposals: list[list[TokenTree]]) -> list[Selection]:
        """Each row's tree for this step (`forerun.costmodel.BatchPolicy.choose`)."""
        rows = self.rows
        roots, budgets = [row.root for row in rows], [row.budget for row in rows]
        return self.policy.choose(roots, proposals, budgets, [row.steps_left() for row in rows], self.shared.waiting)

    def drafts(self, budgets: Sequence[Budget]) -> bool:
        """Whether the rows propose this step: as the policy says; a hybrid's rows only alone (together where
        their states are windows cut back row by row: `SharedRows.chains_together`), and not once more tokens wait
        to be fed again than a tree's worth (they are then read plainly, as a single row's are). Rows without
        drafters (`plain`) have nothing to propose or rank: each feeds its root, as a paused batch's rows do."""
        if not any(row.job.drafters for row in self.rows):
            return False
        if self.chains and len(budgets) > 1 and not self.shared.chains_together:
            for row in self.rows:
                if row.job.drafters and row.stats.fallback_reason is None:
                    row.stats.fallback_reason = ONE_TOKEN
            return False
        if self.chains and self.shared.waiting >= budgets[0].max_nodes:
            return False
        return self.policy.drafting(budgets)

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
        drafting = self.drafts(budgets)
        if drafting:
            self.learn()  # what the last step taught, before anything is proposed
            caps = self.policy.proposal_caps(budgets, [len(row.job.drafters) for row in rows])
            for row, cap in zip(rows, caps, strict=True):
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
        self.learn()  # paused: a card is still computing the forward (its results wait for `to_host`)
        tapped = taps.take(out.features, arrange=self.shared.in_row_order)  # [rows, nodes, F]
        # 4. verify and 5. commit, per row; then keep each row's accepted path in the shared cache
        later = None if drafting else self.unlearned
        kept = self.commit_rows(selections, out, (t1 - t0) / len(rows), forward_s, tapped, layers, later)
        self.shared.keep(prefix_lens, kept, nodes)
        if len(rows) == 1:
            rows[0].stats.fed_again += self.shared.waiting  # a hybrid's chain accepted in part
        self.policy.learn(budgets, selections, kept, nodes, forward_s)
        self.policy.record(budgets, drafting, kept, time.perf_counter() - t0, nodes)
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
        later: Deferred | None = None,
    ) -> list[list[int]]:
        """Verify and commit every row on the step's outputs (`out`; `tapped`: the `layers`' features [rows, nodes,
        F]); a failure ends its own row alone (`commit_apart`). Sampled rows' draws at every node are made first
        (`forerun.draws`; None for the rows that walk), then copied to the host with the base's argmaxes in one
        transfer: the step's one wait for the card. Returns each row's kept path. `later`: `RowRun.accept`'s."""
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
                later,
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
        later: Deferred | None = None,
    ) -> list[int]:
        """`RowRun.commit`, where a failure ends only this row (its root stays in the cache until it leaves)."""
        if row.error is not None:
            return [0]
        try:
            return row.commit(selection, logits, propose_s, forward_s, tapped, choices=choices, drawn=drawn,
                              later=later)  # fmt: skip
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
            row.finish(self.unlearned)
        self.rows = [row for row in self.rows if id(row) not in gone]
        if not self.rows:  # no next step to learn it in
            self.learn()

    def learn(self) -> None:
        """What the rows' drafters put off (`unlearned`: a paused step's observations, leaving rows' finishes),
        in the order they were put off. A step whose rows feed their roots alone runs it while its forward does
        (on a card the forward runs on while the host works); before any row proposes or joins it is all done, so
        every drafter drafts from what it would have learnt at once. A failure ends its own row (one that left
        already is logged: its answer was whole)."""
        unlearned, self.unlearned = self.unlearned, []
        for row, learn in unlearned:
            try:
                learn()
            except Exception as error:  # noqa: BLE001 - one request's failure must not end its neighbours
                if not any(row is other for other in self.rows):
                    logger.warning("forerun: a finished row's drafters failed to learn its text: %r", error)
                elif row.error is None:
                    row.error = error
