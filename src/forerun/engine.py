"""The decode loop of one row: propose -> choose -> forward -> verify -> commit, for every method.

The row's life (drafters, transcript, stats) is `forerun.row.RowRun`, the same in a batch; the forward is a base's
(`forerun.base`); what to feed each step is the budget's business (`forerun.costmodel`); the loop only moves
tokens. Greedy output equals
`model.generate(do_sample=False)` token for token: every token is the target's own choice at its own prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from forerun.base.dynamic import DynamicBase, TreeBase
from forerun.costmodel import Budget
from forerun.drafters.base import Drafter
from forerun.row import RowJob, RowRun
from forerun.stats import GenerationStats
from forerun.taps import LayerTaps, committed_features, feature_layers
from forerun.tree import TREE_ATTENTION, tree_support  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

PREFILL_TREE_MAX_LEAD = 256
"""Longest lead (prompt tokens fed at the prefill) that a first tree rides with. A tree needs a 4-D mask, and with
one the whole prompt loses the causal kernel, which skips the upper triangle of its attention: the prefill's extra
cost grows with the square of the prompt, while the tree can win at most one step (the measurements: the
benchmarks page, "Long prompts"). Longer leads are read causally, exactly as generate's prefill, and drafting
starts at the next step; a lead that is short because the prefix cache holds the rest rides with its tree (it has
no long triangle of its own to lose)."""


def tree_in_prefill(wanted: bool, lead: int) -> bool:
    """Whether the prefill, feeding `lead` prompt tokens, verifies a first tree too (`wanted`: the caller would)."""
    return wanted and lead <= PREFILL_TREE_MAX_LEAD


def decode(
    model: torch.nn.Module,
    job: RowJob,
    budget: Budget,
    draft_in_prefill: bool = True,
    base: TreeBase | None = None,
) -> GenerationStats:
    """Tree decoding of one row (`job.input_ids` [1, prompt_len]); tokens land in `job.transcript`.

    The first step is the prefill: the prompt before its last token rides in front of the first tree (the
    `lead`, a causal chain), so the first draft is verified by the prefill itself, as transformers' assisted
    generation does. With the root alone (no drafters, `draft_in_prefill=False`, or a lead longer than
    PREFILL_TREE_MAX_LEAD) that forward is exactly generate's prefill. `job.prefixes`: the KV of a head this prompt
    shares with earlier text is taken from there and not fed again; the text read here is left there. `base`: the
    cache and forward trees are verified on (`forerun.base`; None: a `DynamicBase`, the CPU's).
    """
    max_len = job.input_ids.shape[1] + job.max_new_tokens + budget.max_nodes
    base, drafters, reason = fallback_if_unsupported(model, base, job.drafters, max_len)
    row = RowRun.begin(replace(job, drafters=drafters), budget)
    row.stats.fallback_reason = reason
    chains = getattr(base, "chains", False)  # no chain at the prefill: one accepted in part would read it twice
    row.stats.cached_prompt_tokens = base.seed(job.prefixes, row.ctx.tokens)
    lead = row.ctx.tokens[row.stats.cached_prompt_tokens : -1]
    with LayerTaps(model, feature_layers(drafters), read=base.features) as taps:
        while not row.done:
            t0 = time.perf_counter()
            drafts = row.stats.forwards > 0 or tree_in_prefill(draft_in_prefill and not chains, len(lead))
            again = len(getattr(base, "pending", ()))  # accepted tokens a chain base feeds again first
            # each chain accepted in part puts the states back before them: past a tree's worth, read them plainly
            drafts = drafts and again < budget.max_nodes
            selection = budget.choose(row.root, row.propose(drafts), len(lead) + again, drafts)
            t1 = time.perf_counter()
            fed = base.forward(selection.tree, row.prefix_len, lead)  # one call of the unmodified model
            choices, drawn = row.on_host(selection.tree, fed.logits, fed.argmax)  # the step's one copy
            verdict = row.verify(selection.tree, fed.logits, choices, drawn)
            if not lead and not again:  # what this forward cost against the curve (a prefill is not on it)
                budget.timed(len(selection.tree), time.perf_counter() - t1)
            kept = [0, *verdict.accepted_nodes]
            row.stats.fed_again += base.commit(row.prefix_len, kept) or 0
            features = committed_features(taps.take(fed.features), len(lead) + again, kept)
            row.accept(selection, verdict, fed.logits, t1 - t0, time.perf_counter() - t1, features, choices)
            lead = []
    base.store(job.prefixes, row.ctx.tokens, row.prefix_len)  # the cache holds prompt + accepted
    return row.finish()


def fallback_if_unsupported(
    model: torch.nn.Module,
    base: TreeBase | None,
    drafters: Sequence[Drafter],
    max_len: int,
) -> tuple[TreeBase, list[Drafter], str | None]:
    """A base ready for `max_len` tokens (the growing cache where the given one cannot hold this request, e.g. a
    text longer than a sliding window), and the drafters, dropped (plain decoding: still exact) when this model
    or its cache cannot verify trees (with why)."""
    reason = base.begin(max_len) if base is not None else None
    if base is None or reason is not None:
        if base is not None:
            logger.info("forerun: the growing cache for this request: %s", reason)
        base = DynamicBase(model)
        reason = base.begin(max_len)
    if not drafters:
        return base, list(drafters), None
    model_reason = None if getattr(base, "chains", False) else tree_support(model)  # chains need no tree mask
    reason = model_reason or reason
    if reason is None:
        return base, list(drafters), None
    # the model's own reason the Decoder told once, when it was built; a request's own (its length) is told here
    level = logging.DEBUG if model_reason else logging.WARNING
    logger.log(level, "forerun: falling back to plain decoding: %s", reason)
    return base, [], reason
