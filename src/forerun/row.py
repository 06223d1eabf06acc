"""One request as the step loop sees it: `RowJob` (what it asks) and `RowRun` (its decoding under way).

The life of a row is the same whether it decodes alone (`forerun.engine.decode`) or beside others in one forward
(`forerun.batch.Batch`):

    RowRun.begin(job, budget)          drafters read the prompt, the budget starts a request
    loop:  row.propose(drafting)       each drafter's tree (the budget then chooses what is fed)
           ... one forward on a base ...
           row.commit(selection, logits)   verify, append the tokens, drafters and budget learn, stats
    row.finish()                       drafters finish, stats closed, the streamer ends

Only the forward differs (the single row's base, the batch's shared ragged cache), and so does who chooses (the
row's budget, or the batch's policy for all rows at once).

Example:
    >>> row = RowRun.begin(job, budget)                                       # doctest: +SKIP
    >>> while not row.done:                                                   # doctest: +SKIP
    ...     selection = budget.choose(row.root, row.propose(True))
    ...     logits = forward(selection.tree, row.prefix_len)                  # [nodes, vocab]
    ...     row.commit(selection, logits)
    >>> stats = row.finish()                                                  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial

import torch
from transformers import LogitsProcessorList

from forerun.costmodel import Budget, Selection
from forerun.costmodel.switch import held
from forerun.drafters.base import DraftContext, Drafter, StepOutcome
from forerun.draws import choose_at_once
from forerun.draws import chosen as chosen_at_once
from forerun.draws import drawn as drawn_at_once
from forerun.host_copy import to_host
from forerun.prefixcache import Prefixes
from forerun.stats import GenerationStats
from forerun.structured import Constraint
from forerun.taps import committed_features
from forerun.transcript import Transcript
from forerun.tree import TokenTree
from forerun.verify import NodeScores, Sampling, Verdict, verify

Deferred = list[tuple["RowRun", Callable[[], None]]]
"""Drafters' learning put off (`RowRun.accept`, `RowRun.finish`): each with the row it is for, in the order put."""


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
class RowRun:
    """A row being decoded: its drafters' context, its budget, its place in the cache, its stats."""

    job: RowJob
    ctx: DraftContext
    budget: Budget
    prefix_len: int
    """Committed tokens in the cache before the root: the root's position."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    error: Exception | None = None
    """What ended this row early: its drafters, budget or verification failed (in a batch, the other rows go on)."""
    costly_drafting: bool = True
    """Whether this step's costly drafters drafted (`propose`)."""
    costly_seconds: float = 0.0
    """This step's time in the costly drafters' own proposing and learning (their forwards)."""
    alone: Selection | None = None
    """What the budget would have fed this step without the costly drafters (a paired switch's comparison)."""
    rows: int = 1
    """Rows that share this step's forward (a batch's, set by it each step): the row pays its share of it."""
    padded: int = 0
    """Nodes a batch padded every row's tree to in this step's forward (0: a single row's own tree)."""
    padded_alone: int = 0
    """Nodes the batch's choice without the costly drafters would have padded to (`Batch.without_costly`)."""

    @classmethod
    def begin(cls, job: RowJob, budget: Budget) -> RowRun:
        """Start a row: its drafters see the prompt, its budget starts a request; nothing is fed yet."""
        started = time.perf_counter()
        prompt_len = job.input_ids.shape[1]
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
        return cls(job, ctx, budget, prompt_len - 1, started=started)

    @cached_property
    def grammar(self) -> Constraint | None:
        """The response format's mask among the row's processors (`forerun.structured`), or None."""
        return next((p for p in self.job.processor or () if isinstance(p, Constraint)), None)

    @property
    def done(self) -> bool:
        return self.job.transcript.done or self.error is not None

    @property
    def root(self) -> int:
        """The last committed token: the root of this step's tree."""
        return self.ctx.tokens[-1]

    def propose(self, drafting: bool = True, with_costly: bool = True) -> list[TokenTree]:
        """Each drafter's tree; `drafting=False`: the root alone from each (a step that verifies no tree needs no
        proposals). Costly drafters (a trained head) sit out while the budget's switch measures them not paying, or
        where `with_costly=False` (a paused batch's rows): they keep what is written for the step they draft again.
        What a single row would feed without them is chosen here; a batch's rows, by the batch (`without_costly`)."""
        switch = self.budget.switch
        left = self.job.max_new_tokens - len(self.job.transcript.sources)
        self.ctx.left = left
        # about the switch alone: a step that verifies no tree (a long prompt's prefill) still lets them read
        self.costly_drafting = with_costly and (switch is None or switch.drafting())
        self.costly_seconds, self.alone, self.padded_alone = 0.0, None, 0
        if not drafting:
            return [TokenTree.rooted_at(self.root)] * len(self.job.drafters)  # one tree: it is only read
        trees = []
        for drafter in self.job.drafters:
            if not costly(drafter):
                trees.append(drafter.propose(self.ctx))
            elif self.costly_drafting:
                started = time.perf_counter()
                trees.append(drafter.propose(self.ctx))
                self.costly_seconds += time.perf_counter() - started
            else:
                trees.append(TokenTree.rooted_at(self.root))
        # guesses past the answer's end cannot be kept (and a chain base's states would read them)
        trees = [tree.within_depth(max(0, left - 1)) for tree in trees]
        if (grammar := self.grammar) is not None:  # nor can guesses a response format refuses
            answer = self.ctx.tokens[grammar.prompt_length :]
            trees = [grammar.pruned(tree, answer) for tree in trees]
        if self.weighs_costly and self.rows == 1:
            started = time.perf_counter()  # what the budget would feed without them, for the switch's comparison
            others = [tree for drafter, tree in zip(self.job.drafters, trees, strict=True) if not costly(drafter)]
            self.alone = self.budget.choose(self.root, others)
            self.costly_seconds += time.perf_counter() - started
        return trees

    def verify(
        self,
        tree: TokenTree,
        logits: torch.Tensor,
        choices: list[int] | None = None,
        drawn: list[int] | None = None,
    ) -> Verdict:
        """The longest path of `tree` the target agrees with, on the tree's `logits` [nodes, vocab] (`choices`:
        every node's argmax, where the base computed them at once; `drawn`: every node's sampled draw, where this
        row draws at once; both on the host: `on_host`)."""
        job = self.job
        scores = NodeScores(logits, job.processor, job.transcript, tree, choices)
        scores.drawn = drawn
        return verify(tree, scores, job.sampling)

    def on_host(
        self, tree: TokenTree, logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> tuple[list[int] | None, list[int] | None]:
        """The base's `argmax` at every node (None: none) and this row's draws at every node (None: it walks,
        `draws`), copied to the host in one transfer: on a card the step waits once, after the draws' kernels."""
        choices, drawn = to_host([argmax, self.draws(tree, logits)])
        return choices, drawn  # type: ignore[return-value]

    def draws(self, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor | None:
        """Every node's sampled draw [nodes], left on the device, where this row draws at once
        (`Sampling.draws_at_once`, and processors that act row by row: `forerun.draws`), or its greedy choice where
        a greedy row's logits are processed on an accelerator (`draws.choose_at_once`); else None, and None where
        its processors fail here (its walk then fails the row alone: a batch makes every row's draws together)."""
        job = self.job
        greedy = job.sampling is None
        if greedy and not (job.processor and choose_at_once(logits)):
            return None
        if not greedy and not job.sampling.draws_at_once(logits):
            return None
        scores = NodeScores(logits, job.processor, job.transcript, tree)
        try:
            return chosen_at_once(scores) if greedy else drawn_at_once(scores, job.sampling.noise)
        except Exception:  # noqa: BLE001 - one request's failure must not end its neighbours
            return None

    def accept(
        self,
        selection: Selection,
        verdict: Verdict,
        logits: torch.Tensor,
        propose_s: float,
        forward_s: float,
        features: torch.Tensor | None = None,
        choices: list[int] | None = None,
        later: Deferred | None = None,
    ) -> list[int]:
        """Append the verdict's tokens, let the drafters and the budget learn, record the step; returns the kept
        path (root first) for the cache, and moves the root past it. `features`, `choices`: `StepOutcome`'s.
        `later`: where a batch's step that fed its rows' roots alone puts the drafters' learning (`teach`), to run
        it while its next forward does (`forerun.batch.Batch.learn`)."""
        tree, transcript = selection.tree, self.job.transcript
        path = [0, *verdict.accepted_nodes]  # the node each new token was chosen at
        self.prefix_len += len(path)
        sources = [tree.sources[i] for i in verdict.accepted_nodes] + ["model"]
        tokens = [tree.tokens[i] for i in verdict.accepted_nodes] + [verdict.bonus_token]
        new_tokens = transcript.extend(tokens, sources, logits[path] if transcript.wants_logits else None)
        self.ctx.tokens.extend(new_tokens)
        started = time.perf_counter()
        step = (selection.node_maps, tree, verdict, logits, new_tokens, features, choices, self.costly_drafting)
        if later is not None and self.job.drafters:
            later.append((self, partial(self.teach, *step)))
        else:
            self.teach(*step)
        self.budget.learn(selection, new_tokens)
        drafting_s = time.perf_counter() - started + propose_s
        self.time_costly(selection, len(new_tokens), drafting_s + forward_s / self.rows)
        expected = selection.expected_accepted
        accepted_by = Counter(sources[:-1]) if verdict.accepted_nodes else {}
        self.stats.record_step(tree, verdict.accepted_len, accepted_by, drafting_s, forward_s, expected)
        if self.stats.forwards == 1:
            self.stats.prefill_seconds = time.perf_counter() - self.started
        return path

    def teach(
        self,
        node_maps: list[dict[int, int]],
        tree: TokenTree,
        verdict: Verdict,
        logits: torch.Tensor,
        new_tokens: list[int],
        features: torch.Tensor | None,
        choices: list[int] | None,
        costly_drafting: bool,
    ) -> None:
        """Each drafter learns a step (`StepOutcome`'s fields; its own `node_maps` entry): it `observe`s it, or
        sits it out (a costly drafter that did not draft: it keeps what it needs to draft again, a head the
        features it reads later)."""
        for drafter, node_map in zip(self.job.drafters, node_maps, strict=True):
            outcome = StepOutcome(tree, verdict, logits, new_tokens, node_map, features, choices)
            if costly_drafting or not costly(drafter):
                observed = time.perf_counter()
                drafter.observe(self.ctx, outcome)
                if costly(drafter):
                    self.costly_seconds += time.perf_counter() - observed
            else:
                drafter.sit_out(self.ctx, outcome)

    def time_costly(self, selection: Selection, tokens: int, seconds: float) -> None:
        """Tell the budget's switch this step's rate, with or without the costly drafters (a prefill is no step:
        it reads the prompt): measured, or priced on the curve where choices must be reproducible (the tokens fed
        and the drafters' own forwards, `CostModel.priced_step`). A paired switch is told too what the same step
        would have cost without them: what the budget would have fed of the other drafters' proposals (`alone`),
        at its price, and how many of the committed tokens it holds (`held`)."""
        switch, budget = self.budget.switch, self.budget
        if switch is None or not self.has_costly or self.stats.forwards == 0:
            return
        fed = self.padded or len(selection.tree)
        spent = sum(drafter.spent() for drafter in self.job.drafters if costly(drafter) and hasattr(drafter, "spent"))
        if budget.reproducible:
            seconds = budget.priced_step(fed, spent, self.rows)
        if seconds <= 0:
            return
        if not (switch.paired and self.costly_drafting):
            switch.record(self.costly_drafting, tokens / seconds)
            return
        if self.alone is None:
            return
        kept = min(held(self.alone.tree, self.ctx.tokens[len(self.ctx.tokens) - tokens :]), tokens) + 1
        alone = budget.priced_step(self.padded_alone or len(self.alone.tree), 0, self.rows)
        if not budget.reproducible:  # the measured step less the costly drafters' time, their nodes priced apart
            alone = max(seconds - self.costly_seconds - budget.priced_step(fed, 0, self.rows) + alone, 1e-9)
        # weighed by the text written, not by steps: at the rate this step shows, the others alone would have taken
        # tokens / kept such steps for the same tokens (the head's steps are fewest where it helps most, so a mean
        # over its steps would count the others' easy stretches too often)
        switch.record_pair(tokens, seconds, tokens, alone * tokens / kept)

    @property
    def weighs_costly(self) -> bool:
        """Whether this step's costly drafters drafted under a paired switch (which hears what the step would have
        been without them)."""
        switch = self.budget.switch
        return self.costly_drafting and self.has_costly and switch is not None and switch.paired

    @cached_property
    def has_costly(self) -> bool:
        """Whether any of the row's drafters is costly (`costly`)."""
        return any(map(costly, self.job.drafters))

    def commit(
        self,
        selection: Selection,
        logits: torch.Tensor,
        propose_s: float,
        forward_s: float,
        tapped: torch.Tensor | None = None,
        lead: int = 0,
        choices: list[int] | None = None,
        drawn: list[int] | None = None,
        later: Deferred | None = None,
    ) -> list[int]:
        """`verify` then `accept`: the kept path (root first). `tapped`: the row's features off the forward,
        [1, lead + nodes, F] (`forerun.taps`), of which its drafters are handed the committed positions'.
        `choices`: every node's argmax, where the base computed them; `drawn`: `verify`'s; `later`: `accept`'s."""
        verdict = self.verify(selection.tree, logits, choices, drawn)
        features = committed_features(tapped, lead, [0, *verdict.accepted_nodes])
        return self.accept(selection, verdict, logits, propose_s, forward_s, features, choices, later)

    def steps_left(self) -> float:
        """Steps this row still needs at its rate so far (its tokens left over its tokens per step)."""
        made = len(self.job.transcript.sources)
        per_step = max(1.0, made / max(1, self.stats.forwards))
        return max(0, self.job.max_new_tokens - made) / per_step

    def finish(self, later: Deferred | None = None) -> GenerationStats:
        """The row is over (finished, cancelled or failed): its drafters finish (or, with `later`, are put there
        to finish: `accept`'s), its stats are closed and its streamer ends."""
        if later is None:
            self.finish_drafters()
        else:
            later.append((self, self.finish_drafters))
        self.stats.new_tokens = len(self.job.transcript.sources)
        self.stats.total_seconds = time.perf_counter() - self.started
        if self.job.transcript.streamer is not None:
            self.job.transcript.streamer.end()
        return self.stats

    def finish_drafters(self) -> None:
        for drafter in self.job.drafters:
            drafter.finish(self.ctx)


def costly(drafter: Drafter) -> bool:
    """Whether `drafter` spends forwards of its own before the target's (a trained head): the budget's switch
    may make it sit out (`CostModel.switch`). Such a drafter tells what its forwards cost since it was last asked
    (`spent()`: seconds, as they measured on this device, where a budget prices steps: `price(cache_dir)`), and is
    shown each step it sat out (`sit_out(ctx, outcome)`, instead of `observe`)."""
    return getattr(drafter, "costly", False)
