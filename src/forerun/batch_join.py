"""Rows joining a batch: a prompt read into the rows' cache (alone, in chunks, or side by side with others), its
first token verified in the prefill's forward, then the row spliced in between steps (`Batch`, which holds these).

A joining row is `begin`-ed (its drafters read the prompt, its cache is seeded from the prefix cache: a `Joining`),
then `feed`-ed a chunk at a time (running rows step in between) or at once; rows joining together are fed in the
same forwards where the rows' cache can (`feed_together`: a static base's places). A row whose first choice or
commit fails gets its error in its stead, and the others join (`feed_apart`).

Example:
    >>> joining = batch.begin(job)                                      # doctest: +SKIP
    >>> while (row := batch.feed(joining, chunk=256)) is None: batch.step()   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace

import torch

from forerun.base.dynamic import TreeLogits
from forerun.base.rows import SharedRows
from forerun.checks import is_count
from forerun.costmodel import BatchPolicy, Budget, Selection
from forerun.engine import tree_in_prefill
from forerun.row import RowJob, RowRun
from forerun.taps import LayerTaps, feature_layers
from forerun.tree import TokenTree

ONE_TOKEN = (
    "a batch's rows of a model with recurrent states that its forward does not record verify one token each a "
    "step while other rows decode beside them (a state cannot step back to a rejected guess; alone, a row verifies "
    "chains)"
)


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


class JoiningRows:
    """How rows join a `Batch` (its base class): `add`, `add_many`, `begin` / `feed`, `abandon`."""

    model: torch.nn.Module
    budget: Budget
    rows: list[RowRun]
    shared: SharedRows
    policy: BatchPolicy
    chains: bool
    learn: Callable[[], None]
    """What the rows' drafters put off, learnt now (`Batch.learn`): before a row joins, its drafters and the
    others' drafts see what they would have seen at once."""

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
        self.learn()
        budget = (budget or self.budget).for_row(self.policy.costly)
        if self.chains and job.drafters and not budget.chain:  # a hybrid whose chains are not exact: one token a step
            job = replace(job, drafters=[])
        row = RowRun.begin(job, budget)
        if self.chains and not job.drafters and not budget.chain:
            row.stats.fallback_reason = ONE_TOKEN
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
        if not joinings:  # nothing joins (a decode loop asks every step): what waits to be learnt may wait on
            return []
        self.learn()
        draft = not self.rows and len(joinings) == 1 if draft is None else draft
        draft = draft and not self.chains  # a chain accepted in part would read the prompt's own cache twice
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
        self.learn()
        self.shared.abandon(joining.own)
        for drafter in joining.row.job.drafters:
            drafter.finish(joining.row.ctx)
